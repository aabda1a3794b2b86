"""Per-stage checkpoint loading against "load the whole model, then slice", time and peak memory per rank.

Writes a synthetic Llama-architecture Hugging Face checkpoint (bf16, sharded safetensors + index) of
about ``--size-gb`` GB, then for each of ``--stages`` pipeline stages runs, in a fresh subprocess
(one per rank, so peak RSS is that rank's alone):

* ``per-stage``: ``build_stages(config, S, indices=[s], checkpoint=path)`` — the stage is built on the
  meta device and reads only its own tensors through the index (``safe_open``);
* ``whole+slice``: ``LlamaForCausalLM.from_pretrained(path)`` then ``build_stages(..., source=model)``.

It prints one table: load time, peak RSS above the process's post-import baseline, the stage's own
parameter bytes, and their ratio (per-stage should be close to 1; whole+slice near S + 1). The
default 2 GB fits a 24 GB machine with room to spare (whole+slice peaks near 2x the checkpoint in one
process); raise ``--size-gb`` on bigger machines. The checkpoint was just written, so reads come from
the page cache for both methods::

    python benchmarks/checkpoint_load.py                 # ~2 GB, 4 stages
    python benchmarks/checkpoint_load.py --size-gb 0.3   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from mt_dualpipe.models.hf_checkpoint import write_config, write_index  # noqa: E402
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM, build_stages  # noqa: E402

SHARD_BYTES = 256 * 1024 ** 2


def config_for(size_gb: float) -> LlamaConfig:
    """A Llama config (hidden 2048, GQA 16:4) whose bf16 weights take about ``size_gb`` GB."""
    base = LlamaConfig.preset("tiny", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                              num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=1)
    per_layer = 2 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632)
    fixed = 2 * 2 * 32000 * 2048
    layers = max(4, round((size_gb * 1e9 - fixed) / per_layer))
    return base.replace(num_hidden_layers=layers)


def write_checkpoint(config: LlamaConfig, path: Path) -> int:
    """Random bf16 tensors for every parameter, shard by shard (never the whole model in memory)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        files.append(list(shard))
        save_file(shard, str(path / f"part-{len(files)}.safetensors"))
        shard, size = {}, 0

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    weight_map = {}
    for i, names in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (path / f"part-{i}.safetensors").rename(path / final)
        weight_map.update({n: final for n in names})
    write_index(path, weight_map, total)
    write_config(path, config.to_hf())
    return total


def peak_rss_mb() -> float:
    """This process image's peak RSS (``VmHWM``). Not ``ru_maxrss``: Linux carries that across fork and
    exec, so a child would report its parent's peak (here: the checkpoint writer's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1024 ** 2


def child(method: str, path: str, stages: int, index: int) -> None:
    """One rank: load stage ``index`` by ``method``; prints a JSON line."""
    torch.set_default_dtype(torch.bfloat16)
    torch.set_num_threads(1)
    config = LlamaConfig.from_hf(path)
    base = current_rss_mb()
    t0 = time.perf_counter()
    if method == "per-stage":
        (stage,) = build_stages(config, stages, indices=[index], checkpoint=path, defer_weight_grads=False)
    else:
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        (stage,) = build_stages(config, stages, indices=[index], source=model, defer_weight_grads=False)
        del model
    seconds = time.perf_counter() - t0
    own = sum(p.numel() * p.element_size() for p in stage.state_dict().values()) / 1024 ** 2
    print(json.dumps({"seconds": seconds, "peak_mb": peak_rss_mb() - base, "stage_mb": own}))


def run_child(method: str, path: Path, stages: int, index: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", method, str(path), str(stages), str(index)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp)
        config = config_for(args.size_gb)
        t0 = time.perf_counter()
        total = write_checkpoint(config, path)
        shards = len(list(path.glob("model-*.safetensors")))
        console.print(f"synthetic checkpoint: {total / 1e9:.2f} GB bf16, {config.num_hidden_layers} layers, "
                      f"{shards} shards, written in {time.perf_counter() - t0:.1f} s")
        table = Table(title=f"loading stage s of {args.stages} (one subprocess per rank)")
        for col in ("method", "stage", "time s", "peak RSS MB", "stage MB", "peak / stage"):
            table.add_column(col, justify="right")
        worst: dict[str, float] = {}
        for method in ("per-stage", "whole+slice"):
            for s in range(args.stages):
                r = run_child(method, path, args.stages, s)
                ratio = r["peak_mb"] / r["stage_mb"] if r["stage_mb"] else math.nan
                worst[method] = max(worst.get(method, 0.0), r["peak_mb"])
                table.add_row(method, str(s), f"{r['seconds']:.2f}", f"{r['peak_mb']:.0f}", f"{r['stage_mb']:.0f}",
                              f"{ratio:.2f}")
        console.print(table)
        console.print(f"largest per-rank peak: per-stage {worst['per-stage']:.0f} MB, whole+slice "
                      f"{worst['whole+slice']:.0f} MB (checkpoint {total / 1024 ** 2:.0f} MB)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
