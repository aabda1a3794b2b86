"""runtime/overlap.py: an F&B unit's two sides hand over at overlap points, in a fixed order, with errors
raised on the caller; and on 4 gloo ranks (pp 2 x ep 2) a user's own module that marks its all-to-all over
the EP group gets the overlap under DualPipeV, with results bit-identical to F then B."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mt_dualpipe.runtime import overlap
from mt_dualpipe.runtime.overlap import overlap_point, run_overlapped, sequential_units
from tests.helpers.dist import run_ranks


class _Grad(torch.autograd.Function):
    """Identity whose backward reaches an overlap point (as an all-to-all's backward does)."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append("B>")
        overlap_point()
        ctx.log.append("B<")
        return g, None


def test_sides_alternate_at_overlap_points_and_a_finished_side_leaves_the_baton():
    log: list[str] = []
    x = torch.ones(3, requires_grad=True)
    y = _Grad.apply(_Grad.apply(x, log), log).sum()  # two overlap points in its backward

    def forward():
        for i in range(3):
            log.append(f"F{i}")
            overlap_point()
        log.append("F end")
        return "f"

    assert run_overlapped(forward, y.backward) == "f"
    # F runs first; each side runs to its next point; B's first point comes right after its first step
    assert log == ["F0", "B>", "F1", "B<", "B>", "F2", "B<", "F end"]
    assert torch.equal(x.grad, torch.ones(3))
    log.clear()
    overlap_point()  # outside a unit: nothing to hand over
    assert log == [] and run_overlapped(lambda: "again", lambda: None) == "again"  # the unit was closed


def test_an_error_of_either_side_is_raised_on_the_caller_after_both_stopped():
    done = threading.Event()

    def backward():
        overlap_point()
        done.set()

    def failing():
        overlap_point()
        raise ValueError("forward broke")

    with pytest.raises(ValueError, match="forward broke"):
        run_overlapped(failing, backward)
    assert done.is_set()  # the B side ran to its end first
    assert run_overlapped(lambda: 1, lambda: None) == 1  # and the failed unit was closed

    def failing_backward():
        raise KeyError("backward broke")

    with pytest.raises(KeyError, match="backward broke"):
        run_overlapped(lambda: overlap_point(), failing_backward)
    with pytest.raises(RuntimeError, match="do not nest"):
        run_overlapped(lambda: run_overlapped(lambda: None, lambda: None), lambda: None)


def test_sequential_units_turns_the_hand_over_off():
    overlap_point()  # a point was reached in this process
    assert overlap.overlap_wanted()
    with sequential_units():
        assert not overlap.overlap_wanted()
    assert overlap.overlap_wanted()


# ----- a user's module on 2 gloo ranks ------------------------------------------------------------------
class _Exchange(torch.autograd.Function):
    """A user's own differentiable exchange over an EP group (each rank sends half its rows to its partner),
    marking the wait with ``overlap_point`` forward and backward."""

    @staticmethod
    def _swap(x, group):
        import torch.distributed as dist

        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x.contiguous(), group=group, async_op=True)
        time.sleep(0.01)  # a slow network: the other side computes meanwhile
        overlap_point()
        work.wait()
        return out

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _Exchange._swap(x, group)

    @staticmethod
    def backward(ctx, g):
        return _Exchange._swap(g, ctx.group), None


class _Mixer(torch.nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        from mt_dualpipe.parallel import set_weight_kind

        set_weight_kind(self.b, "expert")  # this rank's own "expert": not averaged over the EP group

    def forward(self, x):
        return self.b(torch.tanh(_Exchange.apply(self.a(x), self.group)))


def _user_module_worker(rank: int, world: int) -> dict:
    import mt_dualpipe.runtime.executor as ex
    from mt_dualpipe import Pipeline
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.schedules.registry import build_schedule

    torch.set_default_dtype(torch.float64)
    dims = init_parallel(pp=2, dp=1, ep=2)
    pp, ep = dims.coord("pp"), dims.coord("ep")
    sched = build_schedule("dualpipev", 2, 8)
    results = {}
    for mode in ("overlapped", "sequential"):
        torch.manual_seed(0)
        mods = [_Mixer(dims.group("ep")), _Mixer(dims.group("ep"))]  # dualpipev: two stages per rank (a V)
        pipe = Pipeline(mods, sched, mesh=dims, timeout=60)
        g = torch.Generator().manual_seed(1 + ep)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        inputs, labels = ((x,), (y,)) if pp == 0 else ((), ())  # dualpipev: the V starts and ends on pp 0
        units: list[int] = []
        real = ex.run_overlapped

        def counted(f, b, units=units, real=real):
            units.append(1)
            return real(f, b)

        ex.run_overlapped = counted
        try:
            with sequential_units() if mode == "sequential" else torch.enable_grad():
                loss, _ = pipe.step(*inputs, num_chunks=8, criterion=lambda o, t: ((o - t) ** 2).mean(),
                                    labels=labels)
        finally:
            ex.run_overlapped = real
        results[mode] = {"loss": loss, "units": len(units),
                         "grads": [p.grad.clone() for m in mods for p in m.parameters()]}
    return results


def test_a_users_module_with_an_overlap_point_runs_overlapped_and_bit_identical():
    for res in run_ranks(_user_module_worker, 4, timeout=180):
        over, seq = res["overlapped"], res["sequential"]
        assert over["units"] > 0 and seq["units"] == 0  # F&B units ran as two sides only when enabled
        assert all(torch.equal(a, b) for a, b in zip(over["grads"], seq["grads"]))
        assert (over["loss"] is None) == (seq["loss"] is None)
        if over["loss"] is not None:
            assert torch.equal(over["loss"], seq["loss"])


# ----- a family on the shared layer: every feature on, overlapped == F then B ---------------------------------
def _qwen3_worker(rank: int, world: int, features: dict) -> dict:
    import mt_dualpipe.runtime.executor as ex
    from mt_dualpipe import Pipeline
    from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, criterion_for, stages_for_rank
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.schedules.registry import build_schedule

    torch.set_num_threads(1)
    if not features.get("fp8"):
        torch.set_default_dtype(torch.float64)
    dims = init_parallel(pp=2, dp=1, ep=2)
    pp = dims.coord("pp")
    config = Qwen3MoeConfig.preset("tiny", vocab_size=64, output_router_logits=True,
                                   memory_savers=features.get("savers", "none"))
    sched = build_schedule("dualpipev", 2, 6)
    g = torch.Generator().manual_seed(3 + dims.coord("ep"))
    tokens = torch.randint(0, 64, (6, 9), generator=g)
    results = {}
    for mode in ("overlapped", "sequential"):
        torch.manual_seed(0)
        mods = stages_for_rank(config, sched, pp, ep_group=dims.group("ep"), recompute=features["recompute"],
                               compile=features.get("compile", False), fp8=features.get("fp8", False))
        pipe = Pipeline(mods, sched, mesh=dims, dp_mode="zero1", dp_batch="local", timeout=120)
        opt = pipe.build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
        before = [p.detach().clone() for m in mods for p in m.parameters()]
        units: list[int] = []
        real = ex.run_overlapped

        def counted(f, b, units=units, real=real):
            units.append(1)
            return real(f, b)

        ex.run_overlapped = counted
        try:
            with sequential_units() if mode == "sequential" else torch.enable_grad():
                inputs, labels = ((tokens[:, :-1],), (tokens[:, 1:],)) if pp == 0 else ((), ())
                loss, _ = pipe.step(*inputs, num_chunks=6, criterion=criterion_for(mods), labels=labels)
        finally:
            ex.run_overlapped = real
        opt.step()  # ZeRO-1: the gradients are reduce-scattered into the optimizer's shards; compare the step
        moved = sum(not torch.equal(a, p) for a, p in zip(before, (p for m in mods for p in m.parameters())))
        results[mode] = {"loss": loss, "units": len(units), "closures": pipe.store.closures_run, "moved": moved,
                         "params": {f"{i}.{n}": p.detach().clone() for i, m in enumerate(mods)
                                    for n, p in m.named_parameters()}}
    return results


@pytest.mark.parametrize("features", [
    pytest.param({"recompute": "selective", "compile": "aot_eager"}, id="recompute-compile-zero1-balance"),
    pytest.param({"recompute": "full", "fp8": True, "savers": "all"}, id="fp8-savers-full", marks=pytest.mark.slow),
])
def test_qwen3_moe_overlaps_its_expert_all_to_alls_with_no_code_of_its_own(features):
    """Qwen3-MoE (the shared MoEBlock and dispatcher) at pp 2 x ep 2 under DualPipeV, with the balance loss, ZeRO-1
    and the features named: its F&B units run as two sides, the weight GEMMs still go to W, and the losses and
    every parameter after an SGD step equal F then B's bit for bit."""
    for res in run_ranks(_qwen3_worker, 4, features, timeout=300):
        over, seq = res["overlapped"], res["sequential"]
        assert over["units"] > 0 and seq["units"] == 0
        assert over["closures"] == seq["closures"] > 0
        assert over["params"].keys() == seq["params"].keys() and over["moved"] > 10  # the step really trained
        assert all(torch.equal(over["params"][k], seq["params"][k]) for k in over["params"])
        assert (over["loss"] is None) == (seq["loss"] is None)
        if over["loss"] is not None:
            assert torch.equal(over["loss"], seq["loss"])
