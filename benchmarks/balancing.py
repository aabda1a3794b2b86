"""Expert-balancing strategies side by side: the tiny DeepSeek-V3 trained with each for the same steps.

Same seed, same batches (a fixed random bigram language, so the loss can fall), AdamW. After every
step the routed-token counts of every MoE layer give the max expert-load violation
(max(load)/mean(load) − 1, mean over layers), then the strategy's bias update runs. One table:
max violation (mean over the last quarter of the steps, and the last step), dropped (token, expert)
pairs (capacity strategies), final loss (mean of the last 5 steps). ``--png`` also draws the load
of each expert of the first MoE layer over the steps, one panel per strategy.

``--ep N`` trains on N gloo processes with the routed experts sharded over the expert-parallel
group (tokens reach them by all-to-all) and each rank holding 1/N of every batch's sequences: the
batch-wise auxiliary loss counts the loads of every EP rank, the bias update, the violation and
the dropped pairs use the loads summed over the ranks, replicated weights take the ranks' mean
gradient and experts the sum of what every rank's tokens sent them over N (the gradient of the
mean loss), and the loss is the ranks' mean. Without ``--ep`` everything runs in one process.

    python benchmarks/balancing.py [--steps 60] [--strategies aux_free,seq_aux,...] [--ep 2] [--png load.png]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mt_dualpipe.layers.balance import STRATEGIES  # noqa: E402
from mt_dualpipe.layers.moe_state import dropped_fraction, moe_layers  # noqa: E402
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, update_expert_bias  # noqa: E402


def bigram_batches(vocab: int, batch: int, seq: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches of (batch, seq+1) tokens drawn from a fixed sparse random bigram table."""
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(vocab, vocab, generator=g) ** 16  # peaked transitions: a learnable language
    table /= table.sum(1, keepdim=True)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch, 1), generator=g)
        cols = [tok]
        for _ in range(seq):
            cols.append(torch.multinomial(table[cols[-1].squeeze(1)], 1, generator=g))
        out.append(torch.cat(cols, 1))
    return out


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _sync_grads(model: torch.nn.Module, group) -> None:
    """Gradients of the ranks' mean loss: replicated weights average, expert shards divide their sum."""
    world = dist.get_world_size(group)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not _is_expert(name):
            dist.all_reduce(p.grad, group=group)
        p.grad /= world


def _sum_over(group, *values: torch.Tensor) -> None:
    for v in values:
        dist.all_reduce(v, group=group)


def train(config: DeepSeekV3Config, batches: list[torch.Tensor], lr: float, group=None) -> dict:
    """Train with one strategy; ``group``: the expert-parallel group (None: one process, every expert)."""
    torch.manual_seed(0)
    model = DeepSeekV3Model(config).train()
    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    if group is not None:  # this rank's shard of the same model: a shard's keys are a subset of the full model's
        full = model.state_dict()
        model = DeepSeekV3Model(config, ep_group=group).train()
        model.load_state_dict({k: full[k] for k in model.state_dict()})
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    first = moe_layers(model)[0]
    losses, violations, loads, dropped, routed = [], [], [], 0, 0
    for tokens in batches:
        tokens = tokens[rank::world]  # this rank's share of the batch's sequences
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        loss = loss.detach()
        if group is not None:
            _sync_grads(model, group)
            _sum_over(group, loss, *(m.gate.load for m in moe_layers(model)))
            loss /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_layer = [float(m.gate.load.max() / m.gate.load.mean() - 1) for m in moe_layers(model)]
        violations.append(sum(per_layer) / len(per_layer))
        loads.append(first.gate.load.clone())
        counts = torch.tensor(dropped_fraction(model), dtype=torch.float64)
        if group is not None:
            _sum_over(group, counts)
        dropped, routed = dropped + int(counts[0]), routed + int(counts[1])
        update_expert_bias(model)
        losses.append(float(loss))
    quarter = max(1, len(batches) // 4)
    return {"violation_tail": sum(violations[-quarter:]) / quarter, "violation_last": violations[-1],
            "dropped": dropped, "routed": routed, "loss": sum(losses[-5:]) / len(losses[-5:]),
            "loads": torch.stack(loads)}


def _ep_worker(rank: int, world: int, port: int, jobs: list, batches: list[torch.Tensor], lr: float,
               out_path: str) -> None:
    """One EP rank: every strategy in turn; rank 0 writes the results to ``out_path``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {name: train(config, batches, lr, dist.group.WORLD) for name, config in jobs}
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()  # no rank tears its gloo connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


def train_ep(jobs: list, batches: list[torch.Tensor], lr: float, ep: int) -> dict[str, dict]:
    """``train`` of each (name, config) on ``ep`` gloo processes; the results as rank 0 saw them."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.pt")
        mp.spawn(_ep_worker, args=(ep, port, jobs, batches, lr, out_path), nprocs=ep, join=True)
        return torch.load(out_path)


def draw(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3), sharey=True, squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        loads = res["loads"]
        im = ax.imshow((loads / loads.mean(1, keepdim=True)).t().numpy(), aspect="auto", cmap="magma", vmin=0, vmax=3)
        ax.set_title(name)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("expert (first MoE layer)")
    fig.colorbar(im, ax=axes[0].tolist(), label="load / mean load")
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--gamma", type=float, default=1e-2,
                   help="bias update speed for the strategies that use one (V3 trains 14.8T tokens at 1e-3; "
                        "a short run needs a faster one)")
    p.add_argument("--png", default=None, help="write the load-per-expert heat maps here")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (gloo processes); 1: one process")
    args = p.parse_args(argv)
    if args.ep < 1 or args.batch % args.ep:
        raise SystemExit(f"--ep must be >= 1 and divide --batch ({args.batch}), got {args.ep}")
    torch.set_num_threads(1)
    base = DeepSeekV3Config.preset("tiny", dim=64, inter_dim=128, moe_inter_dim=32, vocab_size=64, n_layers=3,
                                   n_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                   qk_rope_head_dim=8, v_head_dim=16, mtp_depth=1)
    batches = bigram_batches(base.vocab_size, args.batch, args.seq, args.steps)
    jobs = []
    for name in args.strategies.split(","):
        config = base.with_balance(name)
        if config.bias_update_speed > 0:
            config = config.replace(bias_update_speed=args.gamma)
        jobs.append((name, config))
    if args.ep > 1:
        results = train_ep(jobs, batches, args.lr, args.ep)
    else:
        results = {name: train(config, batches, args.lr) for name, config in jobs}
    from rich.console import Console
    from rich.table import Table

    where = f", ep {args.ep} (gloo)" if args.ep > 1 else ""
    table = Table(title=f"Expert balancing, tiny DeepSeek-V3{where}, {args.steps} steps x {args.batch}x{args.seq} "
                        f"tokens, γ={args.gamma:g}")
    for col in ("strategy", "max violation (last 25 %)", "max violation (last step)", "dropped pairs",
                "final loss"):
        table.add_column(col, justify="right" if col != "strategy" else "left")
    for name, res in results.items():
        drop = f"{res['dropped']} ({100 * res['dropped'] / res['routed']:.1f}%)" if res["routed"] else "0"
        table.add_row(name, f"{res['violation_tail']:.3f}", f"{res['violation_last']:.3f}", drop, f"{res['loss']:.4f}")
    Console().print(table)
    if args.png:
        draw(results, args.png)
        print(f"wrote {args.png}")
    return results


if __name__ == "__main__":
    main()
