import sys, torch, contextlib
sys.path.insert(0, "/work/lead")
from benchmarks import moe_overlap as mo
from tests.helpers.dist import run_ranks

def w(rank, world):
    import torch.distributed as dist
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.runtime import Pipeline
    from mt_dualpipe.runtime.overlap import sequential_units
    from mt_dualpipe.schedules import build_schedule
    torch.set_num_threads(1)
    dims = init_parallel(pp=2, dp=1, ep=2)
    pp, ep = dims.coord("pp"), dims.group("ep")
    sched = build_schedule("dualpipev", 2, 8)
    out = {}
    for mode in ("overlapped", "sequential", "overlapped2"):
        mods, crit = mo._family("layers", sched, pp, ep)
        pipe = Pipeline(mods, sched, mesh=dims, dp_batch="local", timeout=120)
        g = torch.Generator().manual_seed(1 + dims.coord("ep"))
        tokens = torch.randint(0, mo.VOCAB, (mo.MICROBATCHES * 2, mo.SEQ + 1), generator=g)
        with sequential_units() if mode == "sequential" else contextlib.nullcontext():
            mo._step(pipe, sched, pp, crit, tokens)
        out[mode] = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters() if p.grad is not None}
    diffs = {k: (out["overlapped"][k] - out["sequential"][k]).abs().max().item() for k in out["sequential"]}
    d2 = {k: (out["overlapped"][k] - out["overlapped2"][k]).abs().max().item() for k in out["sequential"]}
    return {k: v for k, v in diffs.items() if v}, {k: v for k, v in d2.items() if v}
def main():
  for r, (d, d2) in enumerate(run_ranks(w, 4, timeout=300)):
    print(r, len(d), sorted(d.items(), key=lambda kv: -kv[1])[:4], "| overlapped vs overlapped:", len(d2))
