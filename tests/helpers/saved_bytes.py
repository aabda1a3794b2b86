"""Saved-activation bytes of the tiny DeepSeek-V3 and Llama, measured with ``SavedActivationMeter``,
next to the planner's per-token estimate: per layer kind and per pipeline stage, for each recompute
policy (``tests/planner/test_planner_recompute.py``; also printed as a table by running this module)."""

from __future__ import annotations

import torch

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.deepseek_v3 import build_stages as deepseek_stages
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM
from mt_dualpipe.models.llama.stages import build_stages as llama_stages
from mt_dualpipe.models.recompute import POLICIES, SavedActivationMeter
from mt_dualpipe.planner import ModelSpec

SEQ = 32
STAGES = 2
MODELS = ("deepseek", "llama")


def config(kind: str):
    if kind == "deepseek":
        return DeepSeekV3Config.preset("tiny", dim=64, n_layers=3, vocab_size=64, inter_dim=128, moe_inter_dim=32,
                                       max_seq_len=64, mtp_depth=1)
    return LlamaConfig.preset("tiny", num_hidden_layers=4, vocab_size=64)


def spec(kind: str) -> ModelSpec:
    cfg = config(kind)
    return ModelSpec.from_deepseek_config(cfg) if kind == "deepseek" else ModelSpec.from_llama_config(cfg)


def stages(kind: str, policy: str) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    cfg = config(kind)
    if kind == "deepseek":
        return deepseek_stages(cfg, STAGES, source=DeepSeekV3Model(cfg), recompute=policy)
    return llama_stages(cfg, STAGES, source=LlamaForCausalLM(cfg), recompute=policy)


def layers(stage: torch.nn.Module) -> list[torch.nn.Module]:
    return list(stage.model.layers.values())


def saved_parameter_bytes(module: torch.nn.Module, run) -> int:
    """Bytes of ``module``'s parameters that autograd references while ``run()`` builds its graph (e.g.
    a plain linear's weight): the meter counts them, but they are weights, not activations."""
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key in params:
            seen.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(params[k] for k in seen)


def metered(module: torch.nn.Module, run) -> tuple[int, int]:
    """(the meter's peak, the part of it that is ``module``'s parameters) for one ``run()``."""
    meter = SavedActivationMeter()
    with meter.measure():
        run()
    return meter.peak, saved_parameter_bytes(module, run)


def measure(kind: str, policy: str) -> dict[str, tuple[int, int]]:
    """(meter peak, parameter bytes in it) for one micro-batch (1 x SEQ tokens): per stage
    (``stage0``...) and per layer kind (``dense`` / ``moe`` / ``layer``: one layer run alone)."""
    cfg = config(kind)
    built = stages(kind, policy)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
    out: dict[str, tuple[int, int]] = {}
    x: torch.Tensor = tokens
    for i, stage in enumerate(built):
        last = i == len(built) - 1

        def run(stage=stage, x=x, last=last):
            y = stage(x)
            if last:
                stage.criterion(y, labels)
            return y

        out[f"stage{i}"] = metered(stage, run)
        x = run().detach().requires_grad_()
    x = torch.randn(1, SEQ, x.size(-1), requires_grad=True)
    for layer in (m for st in built for m in layers(st)):
        name = ("moe" if layer.is_moe else "dense") if kind == "deepseek" else "layer"
        if name not in out:
            out[name] = metered(layer, lambda layer=layer: layer(x))
    return out


def planned(kind: str, policy: str) -> dict[str, float]:
    """The planner's bytes for the same pieces: per-token ``act_bytes`` x SEQ."""
    model = spec(kind)
    items = model.items(SEQ, act_unit=4.0, recompute=policy, elem=4.0, attention="eager")
    per_stage = [len(ids) for ids in stage_layer_counts(kind)]
    out: dict[str, float] = {}
    k = 0
    for i, n in enumerate(per_stage):
        n += (i == 0) + (i == len(per_stage) - 1)  # + embedding, + head (and MTP)
        out[f"stage{i}"] = sum(it.act_bytes for it in items[k:k + n]) * SEQ
        k += n
    for layer_id in range(model.layer_num):
        name = ("moe" if model.moe_layer(layer_id) else "dense") if kind == "deepseek" else "layer"
        out.setdefault(name, items[1 + layer_id].act_bytes * SEQ)
    return out


def stage_layer_counts(kind: str) -> list[list[int]]:
    if kind == "deepseek":
        from mt_dualpipe.models.deepseek_v3.stages import stage_layer_ids
    else:
        from mt_dualpipe.models.llama.stages import stage_layer_ids
    return stage_layer_ids(config(kind), STAGES)


def table(kinds=MODELS) -> list[tuple[str, str, str, int, int, float]]:
    """(model, policy, piece, meter peak, parameter bytes in it, planned bytes) per model, policy, piece."""
    rows = []
    for kind in kinds:
        for policy in POLICIES:
            got, est = measure(kind, policy), planned(kind, policy)
            rows += [(kind, policy, piece, *got[piece], est[piece]) for piece in got]
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"{'model':9s} {'policy':9s} {'piece':7s} {'meter':>9s} {'params':>7s} {'acts':>9s} {'planned':>9s} "
          f"{'ratio':>6s}")
    for kind, policy, piece, peak, params, est in table():
        acts = peak - params
        print(f"{kind:9s} {policy:9s} {piece:7s} {peak:9d} {params:7d} {acts:9d} {est:9.0f} {est / acts:6.3f}")
