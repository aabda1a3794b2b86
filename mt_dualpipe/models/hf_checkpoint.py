"""Hugging Face checkpoints in and out: sharded safetensors with ``model.safetensors.index.json``.

Why lazy: a pipeline rank needs only its stages' tensors. ``Checkpoint`` reads the index (a few KB)
and opens a shard with ``safe_open`` only when one of the requested names lives there, reading just
those names; a stage therefore never materialises another stage's weights, and an expert-parallel
rank reads only its own experts (the names it asks for). ``load_module`` fills a module whose
parameter names map to checkpoint names through a model-specific ``to_hf`` function, checks every
shape first and raises ``CheckpointError`` naming the file and tensor on any mismatch, missing name,
missing or truncated shard — never a silently half-loaded model.

FP8 checkpoints (the released DeepSeek-V3): a weight stored as E4M3 with a float32
``<name>_scale_inv`` of one scale per 128×128 block is dequantised (``w = fp8 · scale_inv`` per
block, exactly this project's ``quantize_blocks`` layout); a target that is an ``FP8Linear`` instead
receives the FP8 data and scales as its quantised weight, with no re-quantisation.

Saving: ``save_tensors`` shards a name → tensor dict by size and writes the index;
``save_pipeline_checkpoint`` has every pipeline rank write the tensors it owns (the lowest rank
holding a name owns it) into its own shard and rank 0 write the index and ``config.json``.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..fp8.convert import convert_to_fp8
from ..fp8.linear import FP8Linear
from ..fp8.quantize import QTensor, dequantize, quantize_blocks

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128
DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file and tensor."""


def check_fp8_quantization(quant: Mapping[str, Any]) -> None:
    """Accept only the block-scaled E4M3 format the released DeepSeek-V3 uses (128×128 weight blocks)."""
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported; only 'fp8' "
                         "(E4M3 weights with 128x128 block scales) can be loaded")
    fmt = quant.get("fmt", "e4m3")
    block = list(quant.get("weight_block_size") or [])
    if fmt != "e4m3" or block != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"quantization_config fmt={fmt!r}, weight_block_size={block} is not supported; only "
                         f"fmt='e4m3' with weight_block_size=[{FP8_BLOCK}, {FP8_BLOCK}]")


class Checkpoint:
    """A checkpoint folder: ``config.json`` plus one ``model.safetensors`` or index-listed shards.

    Reads nothing but the index until ``read`` is called; ``read_names`` lists every tensor read, so
    tests and benchmarks can see what a rank touched.
    """

    def __init__(self, path: str | os.PathLike, window_bytes: int = 64 * 1024 ** 2) -> None:
        self.path = Path(path)
        self.window_bytes = window_bytes
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist")
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {exc}") from None
        elif (self.path / SINGLE_NAME).is_file():
            with self._open(SINGLE_NAME) as f:
                self.weight_map = {name: SINGLE_NAME for name in f.keys()}
        else:
            raise CheckpointError(f"{self.path} holds neither {INDEX_NAME} nor {SINGLE_NAME}")
        self.read_names: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def config(self) -> dict[str, Any]:
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise CheckpointError(f"{self.path} has no config.json")
        return json.loads(cfg.read_text())

    def _open(self, filename: str) -> Any:
        file = self.path / filename
        if not file.is_file():
            raise CheckpointError(f"shard {file} is missing (listed in {INDEX_NAME})")
        try:
            return safe_open(str(file), framework="pt")
        except Exception as exc:  # SafetensorError: truncated header or data
            raise CheckpointError(f"shard {file} cannot be read as safetensors (truncated or corrupt?): "
                                  f"{exc}") from None

    def missing(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if n not in self.weight_map]

    def _by_file(self, names: Iterable[str]) -> dict[str, list[str]]:
        names = list(dict.fromkeys(names))
        absent = self.missing(names)
        if absent:
            raise CheckpointError(f"{self.path}: {len(absent)} tensor(s) not in the checkpoint, e.g. {absent[:3]}")
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_map[n], []).append(n)
        return dict(sorted(by_file.items()))

    def _check_listed(self, f: Any, filename: str, names: list[str]) -> None:
        present = set(f.keys())
        for n in names:
            if n not in present:
                raise CheckpointError(f"tensor {n} is listed in {INDEX_NAME} under {filename} but the shard does "
                                      "not hold it")

    def shapes(self, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """Shapes from the shard headers only (no tensor data is read)."""
        out: dict[str, tuple[int, ...]] = {}
        for filename, group in self._by_file(names).items():
            with self._open(filename) as f:
                self._check_listed(f, filename, group)
                for n in group:
                    out[n] = tuple(f.get_slice(n).get_shape())
        return out

    def read(self, names: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for ``names``, one shard open at a time, in shard order.

        A tensor from ``safe_open`` is a view of the memory-mapped shard; its pages stay resident (and
        count in the RSS) while the shard is open, so the shard is closed and reopened after every
        ``window_bytes`` read: a reader's peak is its own tensors plus one window (or its largest tensor).
        """
        for filename, group in self._by_file(names).items():
            pending = deque(group)
            while pending:
                with self._open(filename) as f:
                    self._check_listed(f, filename, pending)
                    taken = 0
                    while pending and (taken == 0 or taken < self.window_bytes):
                        n = pending.popleft()
                        try:
                            t = f.get_tensor(n)
                        except Exception as exc:
                            raise CheckpointError(f"tensor {n} in {self.path / filename} cannot be read: "
                                                  f"{exc}") from None
                        taken += t.numel() * t.element_size()
                        self.read_names.append(n)
                        yield n, t
                        del t


def dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data`` (E4M3) times its per-128×128-block ``scale_inv``, as ``dtype``."""
    return dequantize(QTensor(data, scale_inv.float(), "block")).to(dtype)


def _state_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def _owner(module: nn.Module, key: str) -> nn.Module:
    return module.get_submodule(key.rpartition(".")[0]) if "." in key else module


def _check_shapes(ckpt: Checkpoint, names: Mapping[str, str], targets: Mapping[str, torch.Tensor],
                  scales: set[str]) -> None:
    shapes = ckpt.shapes(list(names) + sorted(scales))
    for name, key in names.items():
        want = tuple(targets[key].shape)
        if shapes[name] != want:
            raise CheckpointError(f"tensor {name} in {ckpt.weight_map[name]} has shape {shapes[name]}, but the "
                                  f"model's {key} needs {want}")
        if name + SCALE_SUFFIX in scales:
            blocks = tuple(-(-d // FP8_BLOCK) for d in want)
            if shapes[name + SCALE_SUFFIX] != blocks:
                raise CheckpointError(f"tensor {name}{SCALE_SUFFIX} in {ckpt.weight_map[name + SCALE_SUFFIX]} has "
                                      f"shape {shapes[name + SCALE_SUFFIX]}, but {want} needs one scale per "
                                      f"128x128 block {blocks}")


def load_module(module: nn.Module, checkpoint: Checkpoint | str | os.PathLike, to_hf: Callable[[str], str],
                *, skip: Callable[[str], bool] | None = None) -> list[str]:
    """Fill ``module``'s parameters and persistent buffers from ``checkpoint``; returns the names read.

    ``to_hf`` maps a state-dict key to its checkpoint name; ``skip(key)`` keys are left as they are
    (e.g. a bias the checkpoint format does not store). Every name must be present and every shape
    (read from the shard headers) must match before any tensor is read or copied. FP8 weights with a
    ``_scale_inv`` are dequantised into the parameter's dtype, or handed to an ``FP8Linear`` owner as
    its quantised weight.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    targets = {k: v for k, v in _state_targets(module).items() if skip is None or not skip(k)}
    names = {to_hf(k): k for k in targets}
    absent = ckpt.missing(names)
    if absent:
        keys = [names[n] for n in absent]
        raise CheckpointError(f"{ckpt.path}: {len(absent)} tensor(s) this module needs are not in the checkpoint, "
                              f"e.g. {absent[:3]} (for {keys[:3]})")
    scales = {n + SCALE_SUFFIX for n in names if n + SCALE_SUFFIX in ckpt}
    _check_shapes(ckpt, names, targets, scales)
    data: dict[str, torch.Tensor] = {}
    scale: dict[str, torch.Tensor] = {}
    wanted = list(names) + sorted(scales)
    with torch.no_grad():
        for name, tensor in ckpt.read(wanted):
            if name in scales:
                scale[name[:-len(SCALE_SUFFIX)]] = tensor
            elif name + SCALE_SUFFIX in scales:
                data[name] = tensor
            else:
                targets[names[name]].copy_(tensor)
                continue
            base = name[:-len(SCALE_SUFFIX)] if name in scales else name
            if base in data and base in scale:
                _assign_fp8(module, names[base], targets[names[base]], data.pop(base), scale.pop(base))
    return wanted


def _assign_fp8(module: nn.Module, key: str, target: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    owner = _owner(module, key)
    if isinstance(owner, FP8Linear) and key.endswith("weight"):
        owner.load_quantized(data, scale)
    else:
        target.copy_(dequantize_fp8(data, scale, target.dtype))


def build_on_meta(factory: Callable[[], nn.Module], *, dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu", fp8: bool = False) -> nn.Module:
    """``factory()`` built on the meta device (no init pass), given storage on ``device`` in ``dtype``.

    ``fp8`` converts the linears to ``FP8Linear`` first, so that an FP8 checkpoint's weights and
    block scales can then be loaded into them as stored. The caller loads the tensors.
    """
    with torch.device("meta"):
        module = factory()
    if dtype is not None:
        module.to(dtype)
    materialize(module, device)
    if fp8:
        convert_to_fp8(module)
    return module


def open_checkpoint(checkpoint: str | os.PathLike | Checkpoint) -> Checkpoint:
    """A ``Checkpoint`` for a folder (or the one given)."""
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def build_loaded(factory: Callable[[], nn.Module], checkpoint: str | os.PathLike | Checkpoint, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu", fp8: bool = False,
                 to_checkpoint: Callable[[str], str] = lambda key: key) -> nn.Module:
    """``factory()`` built on meta, given storage, optionally converted to FP8, then loaded with this module's
    own tensors and nothing else. ``to_checkpoint``: our state-dict key -> the checkpoint's name (identity
    for the families whose module names are transformers')."""
    module = build_on_meta(factory, dtype=dtype, device=device, fp8=fp8)
    load_module(module, open_checkpoint(checkpoint), to_checkpoint)
    return module


def materialize(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give a module built on the meta device real (uninitialised) storage, non-persistent buffers zeroed:
    the loader overwrites every parameter and persistent buffer, so no init pass is wasted."""
    persistent = set(module.state_dict(keep_vars=True))
    module.to_empty(device=device)
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name not in persistent:
                buf.zero_()
    return module


# ----- saving ------------------------------------------------------------------------------------------
def _fp8_pairs(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    q = quantize_blocks(tensor.detach().float())
    return [(name, q.data), (name + SCALE_SUFFIX, q.scale)]


def prepare_tensors(named: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None,
                    fp8: Callable[[str], bool] | None = None,
                    keep_fp32: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint-ready tensors: contiguous CPU copies, cast to ``dtype`` (except ``keep_fp32`` names,
    kept at float32 or wider), and names ``fp8`` selects stored as E4M3 with 128×128 block scales."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named:
        t = t.detach()
        if fp8 is not None and fp8(name) and t.dim() == 2:
            out.update(_fp8_pairs(name, t.cpu()))
            continue
        if dtype is not None and t.is_floating_point():
            keep = keep_fp32 is not None and keep_fp32(name)
            t = t.to(torch.promote_types(dtype, torch.float32) if keep and dtype.itemsize < 4 else dtype)
        out[name] = t.to("cpu").contiguous().clone()
    return out


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_index(path: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def write_config(path: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """``config.json``; with ``tensors``, ``torch_dtype`` names their most common floating dtype (what
    transformers' ``dtype="auto"`` loads)."""
    config = dict(config)
    if tensors:
        counts: dict[torch.dtype, int] = {}
        for t in tensors.values():
            if t.is_floating_point() and t.element_size() > 1:
                counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
        if counts:
            config["torch_dtype"] = str(max(counts, key=counts.__getitem__)).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, config: Mapping[str, Any] | None,
                 *, max_shard_size: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``tensors`` as ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size`` bytes
    (a larger single tensor gets its own shard), the index and ``config.json``; returns the folder."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, max_shard_size)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / filename), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = filename
            total += tensors[n].numel() * tensors[n].element_size()
    write_index(out, weight_map, total)
    if config is not None:
        write_config(out, config, tensors)
    return out


def save_pipeline_checkpoint(stages: Sequence[nn.Module], path: str | os.PathLike, *,
                             group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                             fp8: bool = False) -> Path:
    """Save a pipeline's stages as one Hugging Face checkpoint; every rank of ``group`` must call it.

    Each stage provides ``hf_state_dict()`` (checkpoint name -> tensor) and ``config.to_hf()``. Names
    held by several ranks (DualPipe's mirrored stages, expert-parallel and data-parallel replicas) are
    written once, by the lowest rank holding them; each rank writes its names into its own shard and
    rank 0 writes the index and ``config.json`` once every shard is on disk. Without a process group
    (or world size 1) it is a plain single-process save.
    """
    if not stages:
        raise ValueError("save_pipeline_checkpoint needs this rank's stage modules (got none)")
    named: dict[str, torch.Tensor] = {}
    for st in stages:
        named.update(st.hf_state_dict())
    config = stages[0].config
    hf_config = config.to_hf()
    fp8_pred = getattr(stages[0], "fp8_checkpoint_names", None) if fp8 else None
    if fp8:
        hf_config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    tensors = prepare_tensors(named.items(), dtype=dtype, fp8=fp8_pred,
                              keep_fp32=getattr(stages[0], "fp32_checkpoint_names", None))
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    if group is None or dist.get_world_size(group) == 1:
        return save_tensors(tensors, path, hf_config, max_shard_size=2 ** 62)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, sizes, group=group)
    owner: dict[str, int] = {}
    for r, got in enumerate(gathered):
        for n in got:
            owner.setdefault(n, r)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    mine = {n: t for n, t in tensors.items() if owner[n] == rank}
    filename = f"model-{rank + 1:05d}-of-{world:05d}.safetensors"
    if mine:
        save_file(mine, str(out / filename), metadata={"format": "pt"})
    dist.barrier(group=group)
    if rank == 0:
        weight_map = {n: f"model-{r + 1:05d}-of-{world:05d}.safetensors" for n, r in owner.items()}
        write_index(out, weight_map, sum(gathered[r][n] for n, r in owner.items()))
        write_config(out, hf_config, tensors)
    dist.barrier(group=group)
    return out
