"""Packed documents through ``Pipeline.step`` on 2 gloo ranks, every schedule, against transformers and one process.

A step is what the data package emits for fine-tuning (``data.finetune.FinetuneData``, ``mode="pack"``: four
ragged micro-batches of two packed rows, position ids restarting per document, each document's last label
-100), passed as ``pipe.step(ids, position_ids, labels=(labels,))``; every stage hands the position ids on
with its hidden states and the criterion normalises by the step's valid-label count (``step.normalizer``).
Llama runs under 1F1B, ZB-V, DualPipeV and DualPipe; Qwen3-MoE under ZB-V; LLaVA's text part under 1F1B
(images inside packed documents: ``test_packed_documents.py``); DeepSeek-V3 with MTP under DualPipeV and
DualPipe. Each micro-batch's loss and every gradient equal, within 1e-12 relative (float64; only the
summation order differs):

- one process: our full model on each micro-batch, the losses summed (DeepSeek-V3: main + MTP with
  ``step_normalizers(..., position_ids=)``);
- transformers' packed path on each micro-batch (transformers reads the documents from the position ids;
  it has no MTP, so DeepSeek-V3 is compared with one process only).
"""

from __future__ import annotations

import pytest
import torch

import mt_dualpipe
from mt_dualpipe.data.finetune import FinetuneData
from mt_dualpipe.layers import lm_loss
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, step_normalizers
from tests.helpers import hf_reference
from tests.helpers.dist import run_ranks
from tests.helpers.hf_reference import float64_transformers, randomize, unfused_grads
from tests.helpers.packed import EXTRA_MODULES, documents, grads_of, hf_models, logits_of, max_grad_error

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

CASES = (("llama", "1f1b"), ("llama", "zbv"), ("llama", "dualpipev"), ("llama", "dualpipe"), ("qwen3_moe", "zbv"),
         ("llava", "1f1b"), ("deepseek_v3", "dualpipev"), ("deepseek_v3", "dualpipe"))
LAYERS = 4  # one per stage of a V on 2 ranks
NUM_MB = 4
TOL = 1e-12


def finetune_step():
    """Step 0 of the data package's packed fine-tuning steps: 4 micro-batches of 2 rows of at most 16 tokens."""
    lengths = [3 + (5 * i) % 11 for i in range(18)]
    return FinetuneData(documents(lengths), token_budget=32, num_chunks=NUM_MB, seq_len=16).step(0)


def deepseek_model(path) -> DeepSeekV3Model:
    """DeepSeek-V3 with one MTP module (and its sequence-wise balance loss: a row is a sequence on both sides),
    saved to ``path`` and read back as the ranks read it."""
    config = DeepSeekV3Config.preset("tiny", dim=32, n_layers=LAYERS, vocab_size=64, inter_dim=48, moe_inter_dim=16,
                                     max_seq_len=32, mtp_depth=1)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config).double()
    randomize(model, 2)
    model.save_pretrained(path)
    return mt_dualpipe.from_pretrained(path, dtype=torch.float64)


def normalizer(family: str, step):
    if family == "deepseek_v3":
        return step_normalizers(step.labels, 1, position_ids=step.position_ids)
    return step.normalizer


def micro_batch_loss(model, family: str, ids, pos, labels, norm):
    if family == "deepseek_v3":
        return model.losses(model.hidden(ids, pos), labels, norm, position_ids=pos).total
    return lm_loss(logits_of(model, ids, pos), labels, normalizer=norm)


def one_process(model, family: str, step, rename=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each micro-batch's loss and the gradients of their sum (``rename``: transformers' under our names)."""
    model.zero_grad(set_to_none=True)
    norm = normalizer(family, step)
    losses = []
    for ids, pos, labels in zip(step.input_ids, step.position_ids, step.labels):
        loss = micro_batch_loss(model, family, ids, pos, labels, norm)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, grads_of(model) if rename is None else unfused_grads(model, rename)


# ----- the ranks ---------------------------------------------------------------------------------------------
def _run_case(rank: int, family: str, schedule: str, path: str) -> dict:
    import importlib

    from mt_dualpipe import DualPipe, Pipeline, from_pretrained
    from mt_dualpipe.schedules.registry import build_schedule

    fam = importlib.import_module(f"mt_dualpipe.models.{family}")
    sched = build_schedule(schedule, 2, NUM_MB)
    model = from_pretrained(path, dtype=torch.float64)  # the references' model, read from the same checkpoint
    torch.set_default_dtype(torch.float64)  # stages are built in the default dtype, then copy the model's weights
    mods = fam.stages_for_rank(model.config, sched, rank, source=model)
    pipe = DualPipe(tuple(mods), timeout=60) if schedule == "dualpipe" else Pipeline(mods, schedule, timeout=60)
    step = finetune_step()
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
    mine = lambda xs, chain: [xs[m] for m in sched.microbatches_of(chain)]  # noqa: E731
    inputs = [mine(step.input_ids, first[0]), mine(step.position_ids, first[0])] if first else []
    labels = (mine(step.labels, last[0]),) if last else ()
    loss, _ = pipe.step(*inputs, num_chunks=NUM_MB, criterion=fam.criterion_for(mods, normalizer(family, step)),
                        labels=labels)
    if schedule == "dualpipe" and not pipe.grad_syncs:  # stages with tied_parameters (DeepSeek-V3): step() summed
        pipe.sync_mirrored_grads()
    return {"losses": None if loss is None else dict(zip(sched.microbatches_of(last[0]), loss.tolist())),
            "grads": {n: g.clone() for m in mods for n, g in grads_of(m).items()}}


def _every_case(rank: int, world: int, paths: dict) -> dict:
    return {case: _run_case(rank, *case, paths[case[0]]) for case in CASES}


# ----- the references and the test ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per family: its checkpoint and the references' (losses, gradients) by name."""
    step = finetune_step()
    saved = hf_reference.MODULES
    hf_reference.MODULES = saved + EXTRA_MODULES  # module scope: monkeypatch is per test
    try:
        out = {}
        for family in sorted({f for f, _ in CASES}):
            path = tmp_path_factory.mktemp(family)
            if family == "deepseek_v3":
                ours = deepseek_model(path)
                out[family] = (str(path), {"one process": one_process(ours, family, step)})
                continue
            hf, ours, rename = hf_models(family, path, LAYERS)
            with float64_transformers():
                theirs = one_process(hf, family, step, rename)
            out[family] = (str(path), {"one process": one_process(ours, family, step), "transformers": theirs})
        return out
    finally:
        hf_reference.MODULES = saved


@pytest.fixture(scope="module")
def pipelined(references) -> list[dict]:
    return run_ranks(_every_case, 2, {f: r[0] for f, r in references.items()}, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_packed_steps_equal_transformers_and_one_process(references, pipelined, case):
    family, schedule = case
    got = [rank[case] for rank in pipelined]
    losses = {m: v for r in got if r["losses"] for m, v in r["losses"].items()}
    assert sorted(losses) == list(range(NUM_MB))  # every micro-batch's loss came back once
    held = set().union(*(r["grads"] for r in got))
    errors = {}
    for name, (want_losses, want_grads) in references[family][1].items():
        # the two ranks hold every parameter (transformers' LLaVA trains the vision tower ours keeps frozen)
        assert held == set(want_grads) if name == "one process" else held <= set(want_grads)
        errors[name] = (max(abs(losses[m] - want_losses[m]) / abs(want_losses[m]) for m in range(NUM_MB)),
                        max(max_grad_error(r["grads"], want_grads) for r in got))
    print(f"packed {family} under {schedule}: (loss, gradient) max relative error {errors}")
    assert all(e < TOL for pair in errors.values() for e in pair), errors
