"""Asynchronous on-disk checkpoints with an atomic commit.

Layout under ``checkpoint_dir``::

    step_00000020/          a complete checkpoint (only ever created by a rename)
        .metadata           torch.distributed.checkpoint metadata (written last by DCP)
        __0_0.distcp ...    tensor data, one file per rank
        skeleton_rank0.pt   each rank's snapshot skeleton (structure, non-tensor values, buffer layout)
        COMMIT              {"step": 20, "world_size": 2}
    .tmp_step_00000030/     a checkpoint being written

Named state (``names.py``): when the ranks' modules and optimizer state can be named globally
(``stage<s>.<fqn>``), those tensors are saved under their names (``model.stage0.0.weight``,
``optim.stage0.0.weight.exp_avg``; sharded ones as ``DTensor``s, so DCP records global offsets)
and only the rest (RNG states, ``stateful`` objects) per rank. Such a checkpoint loads at another
data-parallel size (``load_into``: the live objects' own layout is the template DCP fills, e.g.
ZeRO-1 shards at dp=2 into a plain optimizer at dp=1, and the reverse); ``COMMIT`` says
``"reshardable": true``. The RNG states of a rank that did not exist when it was written come
from the writer ``rank % old world size`` (random streams are exact only at the same size).

Writing: every rank writes its skeleton, then hands its snapshot's tensors (views, no copy) to
``torch.distributed.checkpoint.async_save`` (``mode == "dcp.async_save"``; when this torch lacks it,
a background thread runs ``dcp.save`` instead, ``mode == "thread+dcp.save"``), on a dedicated gloo
group so its collectives never interleave with training's. Training continues meanwhile; the
snapshot's buffers are private copies, so nothing is staged again (a no-op stager). When rank 0's save
completes, every rank's data is on disk (DCP gathers the ranks' write results before writing
``.metadata``); rank 0 then writes ``COMMIT`` and renames the folder to ``step_N`` — the commit —
at once, from a background thread (training learns of it at its next ``poll``). A
crash before the rename leaves only a ``.tmp_`` folder, which is ignored and cleaned up on the
next start; the previous complete checkpoint is never touched until a newer one is committed.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import inspect
import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..parallel.zero import PipelineOptimizer
from ..parallel.zero_state import init_optimizer_state
from .names import StateNames
from .snapshot import Snapshot, pack, restore_rng, restore_snapshot, tensor_refs, unpack

# single-process checkpoints pass no_dist=True on purpose; DCP still warns from its writer thread
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

_FINAL = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_"


_TAKES_STAGER = hasattr(dcp, "async_save") and "async_stager" in inspect.signature(dcp.async_save).parameters


class _NoStaging:
    """An ``AsyncStager`` that hands the state dict over as is (it is already a private copy)."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class NamedRef:
    """A tensor of a checkpoint skeleton saved under a global DCP key (``names.py``)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool  # a DTensor: only a template with the live layout can load it


def _split_named(payload: dict[str, Any], names: StateNames | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the payload with ``NamedRef``s for the globally named tensors, the DCP items of those tensors)."""
    items: dict[str, Any] = {}

    def ref(key: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        items[key] = v
        return NamedRef(key, tuple(v.shape), v.dtype, isinstance(v, DTensor))

    out = dict(payload)
    if names is None:
        return out, items
    out["modules"] = [{k: ref(f"model.{pre}{k}", v) for k, v in sd.items()}
                      for pre, sd in zip(names.prefixes, payload["modules"])]
    opt = payload["optimizer"]
    if opt is not None and names.optimizer is not None:
        out["optimizer"] = {"state": {k: {kk: ref(f"optim.{names.optimizer[k]}.{kk}", v) for kk, v in per.items()}
                                      for k, per in opt["state"].items()},
                            "param_groups": opt["param_groups"]}
    return out, items


def _named_refs(value: Any) -> list[NamedRef]:
    if isinstance(value, NamedRef):
        return [value]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _named_refs(v)]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _named_refs(v)]
    return []


def _fill_named(value: Any, loaded: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, NamedRef):
        return loaded[value.key]
    if isinstance(value, dict):
        return type(value)((k, _fill_named(v, loaded)) for k, v in value.items())
    if isinstance(value, list):
        return [_fill_named(v, loaded) for v in value]
    return value


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointManager:
    """Writes snapshots to ``directory`` asynchronously and finds / loads the latest complete one.

    ``ranks``: the global ranks that checkpoint together (None: the whole world, or a single
    process when torch.distributed is not initialized). Construct it on every rank of the default
    group in the same order (it creates a process group). ``before_commit(step)`` is a hook run on
    rank 0 just before the commit rename (fault injection uses it).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2, ranks: list[int] | None = None,
                 timeout: float = 600.0, use_async: bool = True,
                 before_commit: Callable[[int], None] | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep_checkpoints must be an integer of at least 1, got {keep!r}")
        self.directory = os.fspath(directory)
        self.keep = keep
        self.before_commit = before_commit
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = None
        self.rank, self.world_size = 0, 1
        if self.distributed:
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
            self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.mode = "dcp.async_save" if use_async and hasattr(dcp, "async_save") else "thread+dcp.save"
        self._pending: tuple[int, str, concurrent.futures.Future] | None = None
        self._pending_snapshot: Snapshot | None = None
        self.committed: list[int] = []
        self._reshardable = False  # of the write in flight: its COMMIT says so
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
            for entry in os.listdir(self.directory):  # leftovers of writes that never committed
                if entry.startswith(_TMP_PREFIX):
                    shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)
        self._barrier()

    def _barrier(self, what: str = "start") -> None:
        if self.group is not None:
            try:
                dist.barrier(group=self.group)
            except RuntimeError as exc:
                raise CheckpointError(f"the checkpoint ranks could not synchronize to {what} (a rank died or the "
                                      f"group is broken): {str(exc).splitlines()[0][:200]}") from exc

    # ----- writing ------------------------------------------------------------------------------
    def save(self, snap: Snapshot, names: StateNames | None = None) -> None:
        """Start writing ``snap`` (collective: every rank calls it for the same step); returns at once.

        ``names``: the global names of the snapshot's modules and optimizer state (``names.py``);
        with them the checkpoint is reshardable, without them everything is saved per rank."""
        if names is None and any(r.dtensor is not None for r in tensor_refs(snap.skeleton)):
            raise CheckpointError("the snapshot holds sharded (DTensor) state but its modules cannot be named per "
                                  "stage (the pipeline has no placement): nothing could load it back")
        self.wait()
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}{_name(snap.step)}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._barrier(f"write the checkpoint of step {snap.step}")
        rest, named = _split_named(snap.payload(), names)
        skeleton, buffers = pack(rest)  # the per-rank rest (RNG, stateful): small copies
        self._reshardable = names is not None and names.optimizer is not None
        meta = {"step": snap.step, "position": snap.position, "skeleton": skeleton, "world_size": self.world_size,
                "buffers": {name: (b.dtype, b.numel()) for name, b in buffers.items()}}
        torch.save(meta, os.path.join(tmp, f"skeleton_rank{self.rank}.pt"))
        # named tensors are views of the snapshot's buffers, private copies nobody writes to: no staging copy
        tensors = {**named, **{f"r{self.rank}.{name}": b.cpu() for name, b in buffers.items()}}
        kwargs: dict[str, Any] = {"checkpoint_id": tmp, "process_group": self.group, "no_dist": not self.distributed}
        if self.mode == "dcp.async_save":
            if _TAKES_STAGER:
                kwargs["async_stager"] = _NoStaging()
            fut = dcp.async_save(tensors, **kwargs)
            if not isinstance(fut, concurrent.futures.Future):  # AsyncSaveResponse in some versions
                fut = fut.upload_completion
        else:
            fut = concurrent.futures.Future()

            def run() -> None:
                try:
                    fut.set_result(dcp.save(tensors, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    fut.set_exception(exc)

            threading.Thread(target=run, name=f"checkpoint-{snap.step}", daemon=True).start()
        self._pending = (snap.step, tmp, self._commit_when_written(snap.step, tmp, fut))
        self._pending_snapshot = snap

    def _commit_when_written(self, step: int, tmp: str, written: concurrent.futures.Future
                             ) -> concurrent.futures.Future:
        """A background thread that commits (rank 0: ``COMMIT`` and the rename) as soon as the write ends.

        Committing at once, rather than at the training thread's next ``poll``, is what bounds the
        work a kill loses to the checkpoint interval plus the write time. The returned future
        completes with the step once committed, or with the write's (or the commit's) error.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                written.result()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                done.set_exception(CheckpointError(f"writing the checkpoint of step {step} to {tmp} failed: {exc}"))
                return
            try:
                if self.rank == 0:
                    self._commit(step, tmp)
                done.set_result(step)
            except BaseException as exc:  # noqa: BLE001
                done.set_exception(CheckpointError(f"committing the checkpoint of step {step} ({tmp}) failed: {exc}"))

        threading.Thread(target=run, name=f"checkpoint-commit-{step}", daemon=True).start()
        return done

    def holds(self, snap: Snapshot) -> bool:
        """Whether ``snap`` is being written (its buffers must not be reused yet)."""
        return self._pending is not None and self._pending_snapshot is snap

    def poll(self) -> int | None:
        """The step committed since the last call (the commit itself happens in the background), or None.

        Never blocks; raises ``CheckpointError`` if the write or the commit failed."""
        if self._pending is None or not self._pending[2].done():
            return None
        return self._finish()

    def wait(self) -> int | None:
        """Block until the write in flight (if any) is written and committed."""
        if self._pending is None:
            return None
        return self._finish()

    def _finish(self) -> int:
        """Wait for the commit of the write in flight (already done when ``poll`` calls it)."""
        assert self._pending is not None  # poll() and wait() call this only with a write in flight
        step, _, done = self._pending
        self._pending = self._pending_snapshot = None
        done.result()  # raises the write's or the commit's CheckpointError
        self.committed.append(step)
        return step

    def _commit(self, step: int, tmp: str) -> None:
        with open(os.path.join(tmp, "COMMIT"), "w") as f:
            json.dump({"step": step, "world_size": self.world_size,
                       "reshardable": self._reshardable}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if self.before_commit is not None:
            self.before_commit(step)
        final = os.path.join(self.directory, _name(step))
        if os.path.exists(final):  # the same step written again after a rewind: replace it
            old = os.path.join(self.directory, f"{_TMP_PREFIX}old_{_name(step)}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.directory)
        for old_step in self.complete_steps()[: -self.keep]:
            shutil.rmtree(os.path.join(self.directory, _name(old_step)), ignore_errors=True)

    # ----- reading ------------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the directory, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        steps = []
        for entry in os.listdir(self.directory):
            m = _FINAL.match(entry)
            if m and self._is_complete(os.path.join(self.directory, entry), int(m.group(1))):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _is_complete(self, path: str, step: int) -> bool:
        try:
            with open(os.path.join(path, "COMMIT")) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            return False
        return (marker.get("step") == step
                and (marker.get("world_size") == self.world_size or bool(marker.get("reshardable")))
                and os.path.exists(os.path.join(path, ".metadata")))

    def latest(self) -> int | None:
        """The newest complete checkpoint's step (rank 0 decides; every rank gets the same answer)."""
        steps = self.complete_steps() if self.rank == 0 else []
        value = steps[-1] if steps else -1
        if self.group is not None:
            t = torch.tensor([value], dtype=torch.int64)
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
            value = int(t)
        return None if value < 0 else value

    def _read_meta(self, step: int) -> tuple[str, dict[str, Any], int, int]:
        """(path, the skeleton this rank reads, its writer rank, the writers' world size)."""
        path = os.path.join(self.directory, _name(step))
        if not self._is_complete(path, step):
            raise CheckpointError(f"{path} is not a complete checkpoint (no COMMIT marker or .metadata, or written "
                                  f"by a different number of ranks than {self.world_size} without named state)")
        with open(os.path.join(path, "COMMIT")) as f:
            world = int(json.load(f)["world_size"])
        src = self.rank % world
        meta = torch.load(os.path.join(path, f"skeleton_rank{src}.pt"), weights_only=False)
        return path, meta, src, world

    def load(self, step: int) -> Snapshot:
        """Read this rank's snapshot of checkpoint ``step`` (collective; same number of ranks, no sharded state)."""
        path, meta, src, _ = self._read_meta(step)
        refs = _named_refs(meta["skeleton"])
        sharded = [r.key for r in refs if r.sharded]
        if sharded:
            raise CheckpointError(f"{path} holds sharded state ({sharded[0]}, ...): load it into the live modules and "
                                  "optimizer with load_into (Rewind does)")
        named = {r.key: torch.empty(r.shape, dtype=r.dtype) for r in refs}
        buffers = {f"r{src}.{name}": torch.empty(n, dtype=dtype) for name, (dtype, n) in meta["buffers"].items()}
        dcp.load({**named, **buffers}, checkpoint_id=path, process_group=self.group, no_dist=not self.distributed)
        local = {name: buffers[f"r{src}.{name}"] for name in meta["buffers"]}
        skeleton, flat = pack(_fill_named(unpack(meta["skeleton"], local), named))
        return Snapshot(meta["step"], meta["position"], skeleton, flat)

    def load_into(self, step: int, modules: Sequence[nn.Module], optimizer: Any, names: StateNames | None,
                  stateful: dict[str, Any] | None = None) -> tuple[int, int, dict[str, Any]]:
        """Load checkpoint ``step`` into the live ``modules``, ``optimizer``, ``stateful`` objects and the RNGs
        (collective). The live objects' own layout is DCP's template, so sharded state reshards to the
        current data-parallel size. Returns ``(step, position, extra)``."""
        path, meta, src, world = self._read_meta(step)
        saved = meta["skeleton"]
        if names is None or not _named_refs(saved.get("modules")):
            if world != self.world_size:
                raise CheckpointError(f"{path} was written by {world} ranks with per-rank state; it loads only on "
                                      f"{world} ranks (this run has {self.world_size})")
            snap = self.load(step)
            restore_snapshot(snap, modules, optimizer, stateful)
            return snap.step, snap.position, snap.extra
        states = [m.state_dict() for m in modules]
        template = names.model_entries(states)
        opt_named = bool(_named_refs(saved.get("optimizer")))
        osd = None
        if optimizer is not None and opt_named:
            osd = _initialised_state(optimizer)
            template.update(names.optimizer_entries(osd))
        buffers = {f"r{src}.{name}": torch.empty(n, dtype=dtype) for name, (dtype, n) in meta["buffers"].items()}
        dcp.load({**template, **buffers}, checkpoint_id=path, process_group=self.group,
                 no_dist=not self.distributed)
        for m, sd in zip(modules, states):
            m.load_state_dict(sd)
        local = unpack(saved, {name: buffers[f"r{src}.{name}"] for name in meta["buffers"]})
        if osd is not None:
            osd["param_groups"] = _hyperparameters(osd["param_groups"], saved["optimizer"]["param_groups"])
            optimizer.load_state_dict(osd)
        elif optimizer is not None and local.get("optimizer") is not None:
            if world != self.world_size:
                raise CheckpointError(f"{path}: the optimizer state was saved per rank (its parameters could not be "
                                      f"named); it loads only on {world} ranks")
            optimizer.load_state_dict(local["optimizer"])
        for k, obj in (stateful or {}).items():
            obj.load_state_dict(local["stateful"][k])
        restore_rng(local["rng"])
        return meta["step"], meta["position"], dict(local["extra"])

    def close(self) -> None:
        """Finish and commit the write in flight."""
        self.wait()


def _initialised_state(optimizer: Any) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every state tensor present (a plain optimizer creates its state lazily)."""
    for opt in optimizer.optimizers if isinstance(optimizer, PipelineOptimizer) else [optimizer]:
        if isinstance(opt, torch.optim.Optimizer):
            init_optimizer_state(opt, [p for g in opt.param_groups for p in g["params"]])
    return optimizer.state_dict()


def _hyperparameters(live: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live param groups with the saved hyperparameters (lr, betas, ...): group by group when the
    counts agree, else the first saved group's for all (another layout groups the parameters differently)."""
    pairs = zip(live, saved) if len(live) == len(saved) else ((g, saved[0]) for g in live)
    return [{**g, **{k: v for k, v in old.items() if k != "params"}} for g, old in pairs]
