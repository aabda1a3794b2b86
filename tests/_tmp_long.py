import time, contextlib, torch, os
from benchmarks import moe_overlap as mo
from tests.helpers.dist import run_ranks

def w(rank, world, family, steps):
    import torch.distributed as dist
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.runtime import Pipeline
    from mt_dualpipe.schedules import build_schedule
    torch.set_num_threads(1)
    dims = init_parallel(pp=2, dp=1, ep=2)
    pp, ep = dims.coord("pp"), dims.group("ep")
    sched = build_schedule("dualpipev", 2, 8)
    mods, crit = mo._family(family, sched, pp, ep)
    pipe = Pipeline(mods, sched, mesh=dims, dp_batch="local", timeout=120)
    g = torch.Generator().manual_seed(1 + dims.coord("ep"))
    tokens = torch.randint(0, mo.VOCAB, (mo.MICROBATCHES * 2, mo.SEQ + 1), generator=g)
    if rank == 0:
        open("/tmp/diag/rank0.pid", "w").write(str(os.getpid()))
    for _ in range(steps):
        mo._step(pipe, sched, pp, crit, tokens)
    return 0

def main(family, steps):
    run_ranks(w, 4, family, steps, timeout=600)
