"""Train a family's tiny preset (Qwen3-MoE, Llama) under any schedule on a pp x dp x ep mesh of local CPU processes.

    python examples/train_family.py --family qwen3_moe --pp 2 --ep 2 --schedule zbv     # 4 processes, ~30 s
    python examples/train_family.py --family llama --pp 2 --dp 2 --dp-mode zero1 --schedule 1f1b
    python examples/train_family.py --family llama --pp 2 --dp 2 --dp-mode fsdp --schedule zbv
    torchrun --nproc-per-node 4 examples/train_family.py --family qwen3_moe --ep 2 --schedule dualpipev

What ``mt-dualpipe plan`` prints as the miniature of a layout planned for a family on the shared decoder stages
(``mt_dualpipe/planner/families.py``; DeepSeek-V3 has its own demo, ``examples/deepseek_v3_repro.py``): the same
schedule, pp, dp, ep, data-parallel mode, recompute policy, activation savers and micro-batches, on the family's
``tiny`` preset. It spawns ``--pp`` x ``--dp`` x ``--ep`` processes itself (gloo on 127.0.0.1), or runs as one of
them under torchrun, on one ``mt_dualpipe.parallel.init_parallel(pp, dp, ep)`` mesh. Every rank builds the same
seeded model (the registry's model class for ``--family``), keeps its own stages through the public entry
``mt_dualpipe.stages_for_rank(model, schedule, rank, ...)`` (with ``--ep`` > 1 each MoE layer keeps only this
rank's share of the experts, exchanging tokens by all-to-all over the ep group), and trains with AdamW through
``Pipeline(mesh=..., dp_mode=...)``, which reduces each stage's gradients right after its last W: dense weights
over dp x ep, experts over dp; ``zero1`` shards the AdamW state (``pipe.build_optimizer``), ``fsdp`` runs
``fully_shard``-ed stages (dense families: FSDP reduces one group). The loss is ``mt_dualpipe.criterion_for``'s,
normalised by the step's tokens, so the printed number is the step's mean over every replica. The task is
synthetic (each sequence counts from a random start by a random stride, modulo the vocabulary), so the loss
falls within a few steps; the last line reads ``loss FIRST -> LAST over N steps``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":  # the ranks' fork server imports torch beside this process, not after it
    from mt_dualpipe.parallel.local_ranks import start_rank_server

    start_rank_server()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mt_dualpipe  # noqa: E402
from mt_dualpipe.layers.savers import parse_memory_savers  # noqa: E402
from mt_dualpipe.models.recompute import POLICIES  # noqa: E402
from mt_dualpipe.models.registry import (
    FAMILIES,  # noqa: E402
    planned_families,  # noqa: E402
)
from mt_dualpipe.parallel.local_ranks import local_init_method, spawn_local_ranks  # noqa: E402
from mt_dualpipe.parallel.modes import DP_MODES  # noqa: E402
from mt_dualpipe.planner.families import FAMILY_EXAMPLE  # noqa: E402
from mt_dualpipe.schedules import ScheduleError, build_schedule, schedule_info  # noqa: E402

RUNS = tuple(t for t, f in planned_families().items() if f.example == FAMILY_EXAMPLE)
"""The families this example trains: those whose plans print it (``models.registry``: ``Family.planned``)."""
STRIDES = (1, 2, 3)
"""The synthetic task's strides: a sequence is ``start + stride * i`` modulo the vocabulary."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", required=True, choices=RUNS,
                   help="the model family (its model_type in mt_dualpipe.models.registry.FAMILIES); its tiny preset "
                        "is trained")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks, default 2")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the whole model, default 1")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: each MoE layer's experts shard over --ep ranks, which also run\n"
                        "different data; must divide the preset's experts (default 1)")
    p.add_argument("--dp-mode", default="allreduce", choices=list(DP_MODES),
                   help="the data-parallel gradient sync (mt_dualpipe.parallel.modes.DP_MODES), default allreduce")
    p.add_argument("--schedule", default="1f1b", help="any registered schedule, default 1f1b")
    p.add_argument("--virtual-stages", type=int, default=None, help="stages per rank of interleaved-1f1b (default 2)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step (default: two per stage of a chain)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch and replica, default 2")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence, default 32")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps, default 20")
    p.add_argument("--recompute", default="none", choices=POLICIES,
                   help="activation recompute policy of the stages (mt_dualpipe.models.recompute), default none")
    p.add_argument("--memory-savers", default="none", metavar="NAMES",
                   help="the config's activation savers (layers/savers.py): 'all', 'none' (default) or a list")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="decoder layers (the preset's num_hidden_layers); one per stage of a chain fills it")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V", help="vocabulary (the preset's vocab_size)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, default 3e-3")
    p.add_argument("--timeout", type=float, default=300.0, help="bound of every pipeline wait in seconds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.pp, args.dp, args.ep, args.steps, args.micro_batch_size, args.seq_len) < 1:
        p.error("--pp, --dp, --ep, --steps, --micro-batch-size and --seq-len must be >= 1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: the world size fixes pp
        world = int(os.environ["WORLD_SIZE"])
        if world % (args.dp * args.ep):
            p.error(f"torchrun started {world} processes, not a multiple of --dp x --ep = {args.dp} x {args.ep}")
        args.pp = world // (args.dp * args.ep)
    try:
        config = model_config(args)
    except ValueError as exc:
        p.error(str(exc))
    problem = layout_problem(args, config)
    if problem:
        p.error(problem)
    return args


def model_config(args: argparse.Namespace) -> Any:
    """The family's tiny preset with the sizes and savers the command line sets."""
    parse_memory_savers(args.memory_savers)  # an unknown name is refused with the known ones
    changes = {"num_hidden_layers": args.layers, "vocab_size": args.vocab_size}
    entry = FAMILIES[args.family]
    return entry.load(entry.config_class).preset(
        "tiny", memory_savers=args.memory_savers, **{k: v for k, v in changes.items() if v is not None})


def layout_problem(args: argparse.Namespace, config: Any) -> str | None:
    """Why this mesh, mode and schedule cannot run the preset (None when they can); sets ``args.microbatches``."""
    experts = getattr(config, "num_experts", 0)
    if max(experts, 1) % args.ep:
        return (f"--ep {args.ep} does not divide the {experts} experts of the {args.family} tiny preset"
                if experts else f"--ep {args.ep}: the {args.family} preset has no experts to shard (use --ep 1)")
    mode = DP_MODES[args.dp_mode]
    if args.ep > 1 and not mode.expert_parallel:
        return f"--dp-mode {args.dp_mode} does not run with expert parallelism (--ep {args.ep})"
    if config.tie_word_embeddings and args.pp > 1 and not mode.tied_weights:
        return f"--dp-mode {args.dp_mode} cannot reduce the embedding tied across stages"
    if args.seq_len > config.max_position_embeddings:
        return f"--seq-len {args.seq_len} exceeds the preset's max_position_embeddings {config.max_position_embeddings}"
    if args.virtual_stages is not None and args.schedule != "interleaved-1f1b":
        return f"--virtual-stages is an option of interleaved-1f1b, not of {args.schedule!r}"
    try:
        chain = len(schedule_info(args.schedule).layout(args.pp, **schedule_options(args)).ranks[0])
        args.microbatches = args.microbatches or 2 * chain
        build_schedule(args.schedule, args.pp, args.microbatches, **schedule_options(args))
    except ScheduleError as exc:
        return str(exc)
    if config.num_hidden_layers < chain:
        return (f"{config.num_hidden_layers} layers leave stages of {args.schedule}'s {chain}-stage chain without "
                f"one: pass --layers {chain}")
    return None


def schedule_options(args: argparse.Namespace) -> dict:
    return {} if args.virtual_stages is None else {"virtual_stages": args.virtual_stages}


def batch(args: argparse.Namespace, vocab: int, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One replica's (tokens, labels) of a step: every rank of a pipeline draws the same, no data is sent."""
    gen = torch.Generator().manual_seed((args.seed * 100003 + step) * 1009 + replica)
    rows = args.micro_batch_size * args.microbatches
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (rows, 1), generator=gen)]
    seq = (start + stride * torch.arange(args.seq_len + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def rank_batch(sched: Any, pp_rank: int, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, tuple]:
    """This rank's inputs (of the chain it feeds) and labels (of the chain it ends), each chain its micro-batches."""
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == pp_rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == pp_rank]
    xs, ys = x.tensor_split(sched.num_microbatches), y.tensor_split(sched.num_microbatches)
    inputs = (torch.cat([xs[m] for m in sched.microbatches_of(first[0])]),) if first else ()
    labels = (torch.cat([ys[m] for m in sched.microbatches_of(last[0])]),) if last else ()
    return inputs, labels


def run_rank(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        train(args, rank)
        dist.barrier()  # no rank tears its gloo connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int) -> None:
    from mt_dualpipe.parallel import init_parallel

    dims = init_parallel(pp=args.pp, dp=args.dp, ep=args.ep)
    pp_rank, replica = dims.coord("pp"), dims.coord("dp") * args.ep + dims.coord("ep")
    config = model_config(args)
    sched = build_schedule(args.schedule, args.pp, args.microbatches, **schedule_options(args))
    entry = FAMILIES[args.family]
    torch.manual_seed(args.seed)
    model = entry.load(entry.model_class)(config)  # the same weights on every rank; each keeps its stages
    extra = {"ep_group": dims.group("ep")} if args.ep > 1 else {}
    mods = mt_dualpipe.stages_for_rank(model, sched, pp_rank, recompute=args.recompute, **extra)
    del model
    if DP_MODES[args.dp_mode].needs_fully_shard:
        from torch.distributed.fsdp import fully_shard

        for m in mods:
            fully_shard(m, mesh=dims.submesh("dp"))
    pipe = mt_dualpipe.Pipeline(mods, sched, mesh=dims, dp_mode=args.dp_mode, dp_batch="local", timeout=args.timeout)
    opt = pipe.build_optimizer(lambda params: torch.optim.AdamW(params, lr=args.lr))
    tokens = args.microbatches * args.micro_batch_size * args.seq_len  # this replica's labels per step
    criterion = mt_dualpipe.criterion_for(mods, normalizer=float(tokens))
    if rank == 0:
        print(f"{args.family} (tiny, {config.num_hidden_layers} layers) · {args.schedule} · pp {args.pp} x dp "
              f"{args.dp} x ep {args.ep} ({args.dp_mode}, recompute {args.recompute}) · {args.microbatches} "
              f"micro-batches of {args.micro_batch_size}x{args.seq_len} tokens", flush=True)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = batch(args, config.vocab_size, step, replica)
        inputs, labels = rank_batch(sched, pp_rank, x, y)
        opt.zero_grad(set_to_none=True)
        loss, _ = pipe.step(*inputs, num_chunks=args.microbatches, criterion=criterion, labels=labels)
        opt.step()
        # the chains ending on this rank hold their micro-batches' share of the replica's mean: sum, then average
        total = torch.tensor([float(loss.sum()) if loss is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / (args.dp * args.ep))
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps "
              f"({time.perf_counter() - start:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: we are one of the ranks
        dist.init_process_group("gloo")
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        return 0
    world = args.pp * args.dp * args.ep
    spawn_local_ranks(run_rank, world, (world, args, local_init_method()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
