"""The torchtitan recipe on this library: Llama under ZB-V, PP x FSDP2 on a DeviceMesh the user builds,
per-block activation checkpointing and per-block ``torch.compile``; the loss checked against one process.

What a torchtitan user already writes, unchanged: ``init_device_mesh("cpu", (pp, dp),
mesh_dim_names=("pp", "dp_shard"))``, then per transformer block ``checkpoint_wrapper`` (non-reentrant),
``block.compile()`` and ``fully_shard(block, mesh=mesh["dp_shard"])``, then ``fully_shard`` of the
stage. The library takes that mesh as is (``Pipeline(..., mesh=mesh, dp_mode="fsdp")`` reads the
dimension names, ``parallel/mesh_roles.py``), keeps the FSDP stages unsharded for the step and
reduce-scatters after each stage's last W, recomputes each checkpointed block once (in B; W reuses
it) and keeps the compiled blocks' linears out of the graph so their weight GEMMs still run in W
(``runtime/compiled.py``). The model is ``models.llama`` (its linears defer their weight
gradients to W). ``pp x dp`` gloo ranks on this machine (default 2 x 2); every step's mean loss is
printed next to the same model trained in one process on the same batches.

    python examples/torchtitan_style.py [--steps 3] [--pp 2] [--dp 2] [--no-compile] [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
if __name__ == "__main__":  # the ranks' fork server imports torch beside this process, not after it
    from mt_dualpipe.parallel.local_ranks import start_rank_server

    start_rank_server()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from mt_dualpipe import Pipeline  # noqa: E402
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM, stages_for_rank  # noqa: E402
from mt_dualpipe.parallel.local_ranks import local_init_method, spawn_local_ranks  # noqa: E402
from mt_dualpipe.schedules import build_schedule  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (the mesh's 'pp' dimension), default 2")
    p.add_argument("--dp", type=int, default=2, help="FSDP ranks (the mesh's 'dp_shard' dimension), default 2")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, default 3")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step, default 4")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch and replica, default 2")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence, default 32")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, default 1e-3")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the per-block torch.compile")
    p.add_argument("--backend", default="inductor", help="torch.compile backend, default inductor (aot_eager: faster "
                                                          "to compile, the same AOTAutograd graphs)")
    p.add_argument("--summary", default=None, help="write both loss curves as JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.pp < 1 or args.dp < 1 or args.steps < 1:
        p.error("--pp, --dp and --steps must be >= 1")
    return args


def model_config() -> LlamaConfig:
    """Four layers: one per stage of a 2-rank V (ZB-V places stages r and 2P-1-r on rank r)."""
    return LlamaConfig.preset("tiny", num_hidden_layers=4, vocab_size=128, tie_word_embeddings=False)


def batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank and in the reference): tokens and next tokens."""
    rows = args.dp * args.microbatches * args.micro_batch_size
    gen = torch.Generator().manual_seed(args.seed * 7919 + step)
    t = torch.randint(0, model_config().vocab_size, (rows, args.seq_len + 1), generator=gen)
    return t[:, :-1], t[:, 1:]


def parallelize(stage: nn.Module, mesh, args: argparse.Namespace) -> nn.Module:
    """torchtitan's order per block: activation checkpointing, then compile, then ``fully_shard``; then the stage."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    layers = stage.model.layers
    for name, layer in list(layers.items()):
        block = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if args.compile:
            block.compile(backend=args.backend)
        layers[name] = fully_shard(block, mesh=mesh["dp_shard"])
    return fully_shard(stage, mesh=mesh["dp_shard"])


def run_rank(rank: int, args: argparse.Namespace, init: str, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    world = args.pp * args.dp
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (args.pp, args.dp), mesh_dim_names=("pp", "dp_shard"))
        pp_rank = mesh["pp"].get_local_rank()
        sched = build_schedule("zbv", args.pp, args.microbatches)
        config = model_config()
        torch.manual_seed(args.seed)
        stages = stages_for_rank(config, sched, pp_rank, source=LlamaForCausalLM(config))
        stages = [parallelize(st, mesh, args) for st in stages]
        pipe = Pipeline(stages, sched, mesh=mesh, dp_mode="fsdp")
        opt = torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=args.lr)
        criterion = next((st.criterion for st in stages if st.is_last), None)
        first = [c for c, chain in enumerate(sched.placement) if chain[0] == pp_rank]
        last = [c for c, chain in enumerate(sched.placement) if chain[-1] == pp_rank]
        losses = []
        for step in range(args.steps):
            tokens, labels = batch(args, step)  # the global batch: each dp replica takes its share
            opt.zero_grad(set_to_none=True)
            pipe.step(*((tokens,) if first else ()), num_chunks=sched.num_microbatches, criterion=criterion,
                      labels=(labels,) if last else ())
            opt.step()
            logged = [x for st in stages for x in st.loss_log]
            for st in stages:
                st.loss_log.clear()
            everyone: list = [None] * world
            dist.all_gather_object(everyone, logged)
            flat = [x for got in everyone for x in got]
            losses.append(sum(flat) / len(flat))
        closures: list = [None] * world  # weight-gradient GEMMs each rank's W ran: the split survived AC + compile
        dist.all_gather_object(closures, pipe.store.closures_run)
        if rank == 0:
            out["pipeline"], out["w_closures"] = losses, closures
        dist.barrier()  # no rank tears its gloo connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


def single_process(args: argparse.Namespace) -> list[float]:
    """The same model, batches and optimizer in one process. The pipeline's gradient is the sum of its
    micro-batch mean losses, averaged over the dp replicas: ``microbatches`` x the batch mean here."""
    config = model_config()
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        tokens, labels = batch(args, step)
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels)
        (args.microbatches * loss).backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    init = local_init_method()
    with torch.multiprocessing.Manager() as manager:
        out = manager.dict()
        spawn_local_ranks(run_rank, args.pp * args.dp, (args, init, out))
        pipeline, closures = list(out["pipeline"]), list(out["w_closures"])
    reference = single_process(args)
    compiled = f"compiled ({args.backend})" if args.compile else "not compiled"
    print(f"Llama, ZB-V, pp={args.pp} x fsdp={args.dp} on the user's DeviceMesh, per-block AC, {compiled}")
    print(f"{'step':>4}  {'pipeline loss':>14}  {'one process':>12}  {'rel. diff':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(pipeline, reference)):
        worst = max(worst, abs(a - b) / abs(b))
        print(f"{step:>4}  {a:>14.6f}  {b:>12.6f}  {abs(a - b) / abs(b):>9.1e}")
    print(f"largest relative difference {worst:.1e}")
    print(f"weight-gradient GEMMs run in W over {args.steps} steps, per rank: {closures}")
    if args.summary:
        Path(args.summary).write_text(json.dumps({"pipeline": pipeline, "single_process": reference,
                                                  "w_closures": closures,
                                                  "compile": args.backend if args.compile else None,
                                                  "pp": args.pp, "dp": args.dp, "schedule": "zbv"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
