"""Pipeline x tensor parallel on gloo ranks: a Llama split with ``parallelize_llama_stage`` (PP2 x TP2).

After one SGD step the gathered parameters (DTensor shards through ``full_tensor()``) equal the
single-process model's over the same batch, and W really ran the tensor-parallel linears' deferred
weight-gradient GEMMs: the B/W split holds for DTensor weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mt_dualpipe.models.llama import LlamaStage
from mt_dualpipe.parallel.tensor_parallel import llama_tp_plan
from mt_dualpipe.runtime.data_parallel import check_mesh
from mt_dualpipe.runtime.errors import PipelineError
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import TP_CHUNKS, tp_llama_config, tp_llama_reference, tp_pipeline_step, tp_refusals

TP_LINEARS = 7  # q, k, v, o, gate, up, down: the split linears of one decoder layer


def test_llama_plan_splits_attention_and_swiglu_of_every_layer_and_nothing_else():
    stage = LlamaStage(tp_llama_config(), 1, 2, [2, 3])  # the last stage: layers, norm and head
    plan = {name: type(style) for name, style in llama_tp_plan(stage).items()}
    want = {}
    for i in (2, 3):
        for leaf, style in (("self_attn.q_proj", ColwiseParallel), ("self_attn.k_proj", ColwiseParallel),
                            ("self_attn.v_proj", ColwiseParallel), ("self_attn.o_proj", RowwiseParallel),
                            ("mlp.gate_proj", ColwiseParallel), ("mlp.up_proj", ColwiseParallel),
                            ("mlp.down_proj", RowwiseParallel)):
            want[f"model.layers.{i}.{leaf}"] = style
    assert plan == want  # lm_head, norms and embedding stay replicated


def test_mesh_with_tensor_and_expert_parallel_is_refused():
    """The runtime's mesh check alone (no processes): pp x dp x tp is accepted, tp with ep is not."""
    def mesh(pp: int, dp: int, ep: int, tp: int) -> SimpleNamespace:
        grid = SimpleNamespace(size=lambda: pp * dp * ep * tp, shape=(pp, dp, ep, tp))
        return SimpleNamespace(pp=pp, dp=dp, ep=ep, tp=tp, mesh=grid)

    check_mesh(mesh(2, 2, 1, 2))
    with pytest.raises(PipelineError) as err:
        check_mesh(mesh(2, 1, 2, 2))
    assert str(err.value) == ("Pipeline(mesh=) with tp=2 supports ep=1 only, got ep=2: tensor-parallel expert layers "
                              "are not built (docs/architecture.md, 'Tensor parallel')")


def _check(out: list[dict], dp: int, split: bool, deferred: bool = True) -> None:
    want = tp_llama_reference(dp)
    got: dict[str, torch.Tensor] = {}
    for r in out:
        for name, value in r["params"].items():
            if name in got:  # every tp (and dp) rank holding a stage gathers the same full tensor
                torch.testing.assert_close(value, got[name], rtol=0, atol=0, msg=name)
            got[name] = value
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12, msg=name)
    for r in out:
        per_stage = set(r["stage_layers"])
        assert len(per_stage) == 1  # equal stages on a rank, so the counts below are per stage
        layers = per_stage.pop()
        assert r["sharded"] == TP_LINEARS * layers * len(r["stage_layers"])
        # W ran one deferred GEMM closure per split linear, per W op: the B/W split holds for DTensor weights
        assert (r["w_ops"] > 0) == split
        assert r["closures_run"] == (TP_LINEARS * layers * r["w_ops"] if deferred else 0)
        # DeferredLinear's W takes local shards: no tp collective in W. The generic split of the first stage
        # (token inputs take no gradient) leaves its whole backward to W: one input-gradient all-reduce per
        # column-wise input (q, k, v; gate, up) per layer and micro-batch
        first = 5 * layers * TP_CHUNKS if r["holds_first"] and not deferred else 0
        assert r["w_collectives"] == first
        # a sharded weight's post-accumulate hook fired once per micro-batch of its stage, always with a
        # gradient, inside W exactly as often as the schedule has W ops for that stage (else in a fused BW)
        fired = r["hook_saw_grad"]
        assert len(fired) == TP_CHUNKS // r["chains"] and all(grad for grad, _ in fired)
        assert sum(in_w for _, in_w in fired) == r["first_stage_w_ops"]


TP_SCHEDULES = ("1f1b", "zbv", "dualpipe")


def _every_schedule(rank: int, world: int) -> dict:
    """Every schedule of TP_SCHEDULES in one spawn (process start-up dominates a case)."""
    return {schedule: tp_pipeline_step(rank, world, schedule, True) for schedule in TP_SCHEDULES}


def test_pp2_tp2_llama_equals_single_process_after_one_sgd_step():
    out = run_ranks(_every_schedule, 4, timeout=300)
    for schedule in TP_SCHEDULES:
        _check([o[schedule] for o in out], 1, schedule != "1f1b")


@pytest.mark.slow  # 8 processes: about 110 s on a loaded 2-core machine
def test_pp2_dp2_tp2_allreduces_each_tp_shard_over_dp():
    """8 ranks: each tp rank all-reduces its local shards over its dp group at the stage's REDUCE_GRAD."""
    _check(run_ranks(tp_pipeline_step, 8, "zbv", True, 2, timeout=300), 2, True)


@pytest.mark.slow  # a second split path of the same model: about 35-75 s on a loaded 2-core machine
def test_plain_linears_split_generically_with_dtensor_weights():
    """Without DeferredLinear the generic split (autograd graph cut) runs the TP weight gradients in W too."""
    _check(run_ranks(tp_pipeline_step, 4, "zbv", False, timeout=180), 1, True, deferred=False)


def test_refusals_name_what_is_wrong():
    out = run_ranks(tp_refusals, 4, timeout=120)
    for rank, r in enumerate(out):
        assert r["heads"] == ("attention 'model.layers.0.self_attn': head counts {'kv_heads': 1} are not divisible by "
                              "tp=2; every tp rank needs whole query and key/value heads")
        assert r["zero1"].endswith("tensor-parallel (DTensor) parameters such as ['a.weight', 'a.bias'] reduce over "
                                   "dp with dp_mode='allreduce' or dp_mode='allreduce_bf16' only, got "
                                   "dp_mode='zero1'")
        if rank in (0, 1):  # pipeline rank 0 (global ranks 0 and 1) refuses its DTensor output at F
            name = "rank 0" if rank == 0 else "pipeline rank 0 (global rank 1)"
            assert r["dtensor"].startswith(f"PipelineError: {name} F(chain 0, stage 0, mb 0) in Block: the stage "
                                           "returned a DTensor (output 0 with placements (Replicate()))")
            assert "use_local_output=True" in r["dtensor"]
