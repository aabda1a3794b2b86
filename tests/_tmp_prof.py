import time, contextlib, torch
from benchmarks import moe_overlap as mo
from tests.helpers.dist import run_ranks

def w(rank, world, family):
    import torch.distributed as dist
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.runtime import Pipeline, overlap
    import mt_dualpipe.runtime.stage as stage_mod
    from mt_dualpipe.runtime.overlap import sequential_units
    from mt_dualpipe.schedules import build_schedule
    torch.set_num_threads(1)
    dims = init_parallel(pp=2, dp=1, ep=2)
    pp, ep = dims.coord("pp"), dims.group("ep")
    sched = build_schedule("dualpipev", 2, 8)
    mods, crit = mo._family(family, sched, pp, ep)
    pipe = Pipeline(mods, sched, mesh=dims, dp_batch="local", timeout=120)
    g = torch.Generator().manual_seed(1 + dims.coord("ep"))
    tokens = torch.randint(0, mo.VOCAB, (mo.MICROBATCHES * 2, mo.SEQ + 1), generator=g)
    acc = {}
    rf, rb = stage_mod.Stage.forward, stage_mod.Stage.backward
    def tf(self, *a, **k):
        t = time.perf_counter(); r = rf(self, *a, **k); acc["F"] = acc.get("F", 0) + time.perf_counter() - t; return r
    def tb(self, *a, **k):
        t = time.perf_counter(); r = rb(self, *a, **k); acc["B"] = acc.get("B", 0) + time.perf_counter() - t; return r
    stage_mod.Stage.forward, stage_mod.Stage.backward = tf, tb
    import warnings
    seen = {}
    real_warn = stage_mod.warnings.warn_explicit
    def counting(message, category, *a, **k):
        seen[str(message)[:80]] = seen.get(str(message)[:80], 0) + 1
        return real_warn(message, category, *a, **k)
    stage_mod.warnings.warn_explicit = counting
    orig_cw = stage_mod._refusing_lost_gradients
    out = {}
    for mode in ("overlapped", "sequential") * 3:
        acc.clear()
        dist.barrier(); t = time.perf_counter()
        with sequential_units() if mode == "sequential" else contextlib.nullcontext():
            mo._step(pipe, sched, pp, crit, tokens)
        out.setdefault("warn", []).append(dict(seen)); seen.clear()
        out.setdefault(mode, []).append((round((time.perf_counter() - t) * 1000), {k: round(v * 1000) for k, v in acc.items()}))
    return out

def main(family):
    for r, o in enumerate(run_ranks(w, 4, family, timeout=300)):
        print(r, o)
