"""FP8 against full precision on a pipelined Llama: the same tiny model, data and seed, two loss curves.

    python examples/llama_fp8.py                          # 2 gloo ranks, ZB-V, fp32 vs FP8, llama_fp8.png
    python examples/llama_fp8.py --baseline bf16 --steps 200 --out curves.png
    python examples/llama_fp8.py --corpus notes/ --tokenizer tokenizer.json   # real text instead of the task

"FP8 is nearly lossless" is shown here, not asserted: each pipeline rank builds the same seeded
``LlamaConfig.preset("tiny")`` model, keeps its stages, and trains it twice over the same batches —
once with its linears in the baseline precision (fp32, or bf16 weights and activations) and once
converted to block-scaled FP8 (``mt_dualpipe.fp8``: E4M3 operands with one scale per
128x128 weight block and per 1x128 activation tile; the optimizer keeps full-precision masters). Both
loss curves go into one PNG (matplotlib, the ``plot`` extra) and the relative gap is printed:
``(fp8 − baseline) / baseline`` of the mean loss over the last ``--window`` steps and of a held-out
loss measured after training (forward-only pipeline steps on batches no step trained on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":  # the ranks' fork server imports torch beside this process, not after it
    from mt_dualpipe.parallel.local_ranks import start_rank_server

    start_rank_server()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mt_dualpipe import Pipeline  # noqa: E402
from mt_dualpipe.models.deepseek_v3.data import synthetic_batch  # noqa: E402
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM, stages_for_rank, sync_replicas  # noqa: E402
from mt_dualpipe.parallel.local_ranks import local_init_method, spawn_local_ranks  # noqa: E402
from mt_dualpipe.schedules.registry import build_schedule  # noqa: E402

PRECISIONS = ("fp32", "bf16")
HELD_OUT = 1_000_003  # data positions from here on are never trained on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (local gloo processes), default 2")
    p.add_argument("--schedule", default="zbv", help="any registered schedule, default zbv")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run, default 60")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 2 x stages)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch, default 4")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, default 64")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, default 3e-3")
    p.add_argument("--baseline", default="fp32", choices=PRECISIONS, help="what FP8 is compared with, default fp32")
    p.add_argument("--window", type=int, default=10, help="steps averaged for the final-loss gap, default 10")
    p.add_argument("--val-batches", type=int, default=2, help="held-out batches after training, default 2")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, choices=("inductor", "aot_eager"),
                   help="torch.compile each layer's memory-bound parts, linears kept eager so W keeps their\n"
                        "weight GEMMs (mt_dualpipe.models.compile); backend default inductor")
    p.add_argument("--corpus", nargs="+", default=None, metavar="FILE|DIR",
                   help="train on local text (streamed, packed) instead of the synthetic task")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json for --corpus (default bytes)")
    p.add_argument("--out", default="llama_fp8.png", help="the PNG both curves go into, default llama_fp8.png")
    p.add_argument("--summary", default=None, help="write the losses and gaps as JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.val_batches < 0:
        p.error("--ranks and --steps must be >= 1, --val-batches >= 0")
    if not 1 <= args.window <= args.steps:
        p.error(f"--window must be in 1..--steps ({args.steps}), got {args.window}")
    if args.tokenizer and not args.corpus:
        p.error("--tokenizer needs --corpus (the text it tokenizes)")
    return args


# ----- one rank ---------------------------------------------------------------------------------------
def make_data(args: argparse.Namespace, sched):
    """(config, batch(position) -> (tokens, labels)): the synthetic task or packed text; the same on every rank."""
    rows = args.micro_batch_size * sched.num_microbatches
    config = LlamaConfig.preset("tiny", max_position_embeddings=max(1024, args.seq_len))
    if not args.corpus:
        def batch(position: int):
            gen = torch.Generator().manual_seed(args.seed * 100003 + position)
            return synthetic_batch(config.vocab_size, rows, args.seq_len, gen)

        return config, batch
    from mt_dualpipe.data.text import PackedText, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    data = PackedText(args.corpus, args.seq_len, rows, tokenizer=tok, seed=args.seed)
    config = config.replace(vocab_size=max(tok.vocab_size, 256))

    def text_batch(position: int):
        return data.val_batch(position - HELD_OUT) if position >= HELD_OUT else data.train_batch(position)

    return config, text_batch


def split_batch(sched, rank: int, tokens: torch.Tensor, labels: torch.Tensor):
    """(inputs, labels) for this rank: the micro-batches of the chains that start / end here."""
    M = sched.num_microbatches
    xs, ys = tokens.tensor_split(M), labels.tensor_split(M)
    first = [c for c, chain in enumerate(sched.placement) if chain[0] == rank]
    last = [c for c, chain in enumerate(sched.placement) if chain[-1] == rank]
    inputs = (torch.cat([xs[m] for m in sched.microbatches_of(first[0])]),) if first else ()
    labs = (torch.cat([ys[m] for m in sched.microbatches_of(last[0])]),) if last else ()
    return inputs, labs


def mean_logged_loss(mods, world: int) -> float:
    """Mean of every rank's logged micro-batch losses of the last step (collective)."""
    logs = [x for m in mods for x in m.loss_log]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, logs)
    flat = [x for got in everyone for x in got]
    for m in mods:
        m.loss_log.clear()
    return sum(flat) / len(flat)


def train_one(args, precision: str, rank: int, world: int) -> dict:
    """Train the seeded model once in ``precision`` ("fp32", "bf16" or "fp8"); losses per step and held out."""
    sched = build_schedule(args.schedule, world, args.microbatches or 2 * world * 2)
    config, batch = make_data(args, sched)
    torch.manual_seed(args.seed)
    full = LlamaForCausalLM(config)
    mods = stages_for_rank(config, sched, rank, source=full, fp8=precision == "fp8", compile=args.compile or False)
    del full
    if precision == "bf16":
        mods = [m.to(torch.bfloat16) for m in mods]
    criterion = next((m.criterion for m in mods if m.is_last), None)
    pipe = Pipeline(mods, sched)
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=args.lr, weight_decay=0.1)
    losses = []
    for step in range(args.steps):
        inputs, labels = split_batch(sched, rank, *batch(step))
        opt.zero_grad(set_to_none=True)
        pipe.step(*inputs, num_chunks=sched.num_microbatches, criterion=criterion, labels=labels)
        sync_replicas(mods, dist.group.WORLD)  # tied / mirrored copies of one parameter
        opt.step()
        losses.append(mean_logged_loss(mods, world))
    held = []
    for i in range(args.val_batches):
        inputs, labels = split_batch(sched, rank, *batch(HELD_OUT + i))
        with torch.no_grad():
            pipe.step(*inputs, num_chunks=sched.num_microbatches, criterion=criterion, labels=labels)
        held.append(mean_logged_loss(mods, world))
    return {"loss": losses, "held_out": sum(held) / len(held) if held else None}


def run_rank(rank: int, world: int, args: argparse.Namespace, init: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        runs = {p: train_one(args, p, rank, world) for p in (args.baseline, "fp8")}
        if rank == 0:
            out.update(runs)
        dist.barrier()  # no rank tears its gloo connections down while its peer still uses them
    finally:
        dist.destroy_process_group()


# ----- report -----------------------------------------------------------------------------------------
def gaps(runs: dict, baseline: str, window: int) -> dict:
    """Relative gaps (fp8 − baseline) / baseline: last-``window`` mean loss, held-out loss, worst step."""
    base, fp8 = runs[baseline]["loss"], runs["fp8"]["loss"]
    tail_b, tail_f = sum(base[-window:]) / window, sum(fp8[-window:]) / window
    out = {"final_mean_loss": {baseline: tail_b, "fp8": tail_f, "relative_gap": (tail_f - tail_b) / tail_b},
           "max_step_relative_gap": max(abs(f - b) / b for f, b in zip(fp8, base))}
    hb, hf = runs[baseline]["held_out"], runs["fp8"]["held_out"]
    if hb is not None:
        out["held_out_loss"] = {baseline: hb, "fp8": hf, "relative_gap": (hf - hb) / hb}
    return out


def plot(runs: dict, baseline: str, result: dict, path: str, title: str) -> bool:
    """Both curves in one PNG; False (and a line saying what to install) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib, or mt_dualpipe[plot]); {path} "
              "was not written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = range(1, len(runs[baseline]["loss"]) + 1)
    ax.plot(steps, runs[baseline]["loss"], label=baseline, linewidth=1.6)
    ax.plot(steps, runs["fp8"]["loss"], label="fp8 (block-scaled E4M3)", linewidth=1.2, linestyle="--")
    gap = result["final_mean_loss"]["relative_gap"]
    ax.set(xlabel="optimizer step", ylabel="training loss", title=f"{title}\nfinal-loss gap {100 * gap:+.2f} %")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def report(args: argparse.Namespace, runs: dict) -> dict:
    result = gaps(runs, args.baseline, args.window)
    title = f"tiny Llama · {args.schedule} on {args.ranks} ranks · {args.steps} steps"
    final = result["final_mean_loss"]
    print(f"{title}: loss {runs[args.baseline]['loss'][0]:.3f} → {final[args.baseline]:.3f} ({args.baseline}, mean "
          f"of the last {args.window} steps) vs {final['fp8']:.3f} (fp8): relative gap "
          f"{100 * final['relative_gap']:+.2f} %")
    if "held_out_loss" in result:
        h = result["held_out_loss"]
        print(f"held-out loss {h[args.baseline]:.4f} ({args.baseline}) vs {h['fp8']:.4f} (fp8): relative gap "
              f"{100 * h['relative_gap']:+.2f} %")
    print(f"largest per-step relative gap {100 * result['max_step_relative_gap']:.2f} %")
    if plot(runs, args.baseline, result, args.out, title):
        print(f"loss curves written to {args.out}")
    summary = {"schedule": args.schedule, "ranks": args.ranks, "steps": args.steps, "baseline": args.baseline,
               "compile": args.compile,
               "data": args.corpus or "synthetic", "runs": runs, **result}
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=1))
        print(f"summary written to {args.summary}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    init = local_init_method()
    with torch.multiprocessing.Manager() as manager:
        out = manager.dict()
        spawn_local_ranks(run_rank, args.ranks, (args.ranks, args, init, out))
        runs = dict(out)
    report(args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
