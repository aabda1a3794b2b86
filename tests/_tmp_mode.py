import time, contextlib, torch, os
from benchmarks import moe_overlap as mo
from tests.helpers.dist import run_ranks

def w(rank, world, family, variant):
    import torch.distributed as dist
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.runtime import Pipeline, overlap
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
    if variant == "thread-no-handover":
        overlap._Baton.hand_over = lambda self, side: None
    times = []
    for i in range(6):
        dist.barrier(); t = time.perf_counter()
        with sequential_units() if variant == "sequential" else contextlib.nullcontext():
            mo._step(pipe, sched, pp, crit, tokens)
        times.append(round((time.perf_counter() - t) * 1000))
    return times

def main(family):
    for v in ("sequential", "thread-no-handover", "overlapped"):
        print(v, run_ranks(w, 4, family, v, timeout=600)[0])
