"""``Rewind``: a training-step wrapper that detects faults, agrees on them across ranks, and
returns every rank to the last good snapshot.

One call of ``Rewind.step(batch_fn)`` is one attempt at one optimizer step::

    batch  = batch_fn(position)                # position: the data index; skipped ones are passed over
    loss   = pipeline.step(*inputs, num_chunks=..., criterion=..., labels=labels)
    report = local checks (non-finite input / loss / gradient, or the exception the step raised)
    verdict = agree(report)                    # one small all_gather: identical on every rank
                                               # (optimizer.step() of a locally good step overlaps it)
    ok:    [sync_mirrored_grads()]; grad_hook(); optimizer.step(); maybe snapshot / checkpoint
    fault: log, count, skip the batch (skip_policy="skip") or not ("retry"),
           rebuild the pipeline's communication if a step raised, restore the snapshot

``run(batch_fn, num_steps)`` calls ``step`` until ``num_steps`` optimizer steps have succeeded.
Steps are counted from 0: "step k" is the attempt that would complete optimizer step k+1. The
optimizer only ever applies gradients the ranks agreed are good, and the replay after a rewind is
bit-exact (modules, optimizer, RNG states and data position are all restored), so a run that hit
a fault at step k and skipped its batch ends with exactly the parameters of a clean run that
never saw that batch.

The pipeline is duck-typed: anything with ``step(*inputs, num_chunks, criterion=None, labels=(),
return_outputs=False) -> (loss, outputs)``; the local modules are ``modules=`` or, by default, the
stage modules of ``pipeline.module`` (``mt_dualpipe.Pipeline`` and ``LocalPipeline`` have it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
import torch.nn as nn

from ..parallel.stage_sync import DP_MODES, RetakesParameters
from ..runtime.errors import PipelineError
from ..runtime.modules import DualPipe, Pipeline
from .agree import Agreement, AgreementError, LocalReport, Verdict
from .checkpoint import CheckpointError, CheckpointManager
from .detect import FaultKind, LossSpikeDetector, grad_sq_norm, loss_stats, nonfinite_inputs
from .faults import FaultInjector
from .local import LocalPipeline
from .names import StateNames
from .regroup import rebuild_on_mesh, refresh_sync_groups
from .snapshot import Snapshot, restore_snapshot, take_snapshot

log = logging.getLogger("mt_dualpipe.resilience")

SKIP_POLICIES = ("skip", "retry")


class RewindError(RuntimeError):
    """Training stopped: too many consecutive faults, or the ranks could not agree (broken group)."""


@dataclass
class FaultEvent:
    """One fault and what was done about it (the same on every rank)."""

    step: int
    position: int
    kind: FaultKind
    ranks: list[int]
    cause: str
    rewound_to: int
    skipped: bool
    consecutive: int


@dataclass
class StepResult:
    """The outcome of one ``Rewind.step`` call."""

    step: int                 # the step attempted (0-based)
    position: int             # the data position it read
    ok: bool
    loss: float | None        # mean of every loss value the ranks computed (None: no criterion anywhere)
    grad_norm: float          # norm of all ranks' local gradients together
    fault: FaultEvent | None = None


def _split_batch(batch: Any) -> tuple[tuple, tuple]:
    """(inputs, labels) from what ``batch_fn`` returned: a dict with "inputs"/"labels", a pair, or inputs."""
    if isinstance(batch, dict):
        unknown = set(batch) - {"inputs", "labels"}
        if unknown:
            raise ValueError(f"batch_fn returned a dict with keys {sorted(unknown)}; allowed: 'inputs', 'labels'")
        inputs, labels = batch.get("inputs", ()), batch.get("labels", ())
    elif isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(b, (tuple, list)) for b in batch):
        inputs, labels = batch
    else:
        inputs, labels = batch, ()
    as_tuple = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (() if v is None else (v,))
    return as_tuple(inputs), as_tuple(labels)


@runtime_checkable
class Rebuildable(Protocol):
    """A pipeline that can give itself again on a fresh process group (``Pipeline.rebuilt``)."""

    def rebuilt(self, group: dist.ProcessGroup | None = None) -> Any:
        ...


def _local_modules(pipeline: Any, modules: Sequence[nn.Module] | None) -> list[nn.Module]:
    if modules is not None:
        return list(modules)
    if isinstance(pipeline, (Pipeline, LocalPipeline)):  # the stage modules
        return list(pipeline.module)
    if isinstance(pipeline, nn.Module):
        return [pipeline]
    raise ValueError("pass modules=[...] (the rank's local stage modules): the pipeline is not an nn.Module")


@dataclass
class RewindConfig:
    """Everything ``Rewind`` takes besides the pipeline and the optimizer (checked on construction).

    Fields:
      num_chunks, criterion: passed to ``pipeline.step``.
      modules: the rank's local stage modules (default: ``pipeline.module`` when it is an
        ``nn.ModuleList``, as in ``mt_dualpipe.Pipeline``, else ``[pipeline]`` for an ``nn.Module``).
      snapshot_every: take an in-memory snapshot after every N successful steps (and at step 0).
      keep: how many snapshots to keep; the n-th consecutive fault rewinds n snapshots back
        (bounded by what is kept), so a state that was already bad gets left behind.
      checkpoint_dir: also write every ``checkpoint_every``-th snapshot there, asynchronously, and
        resume from the newest complete checkpoint on construction (``resume=True``). A checkpoint
        is committed (becomes the one a restart resumes from) as soon as its write finishes, by a
        background thread; a kill before that loses it, so at most about one ``checkpoint_every``
        interval plus the write time is lost.
      keep_checkpoints: complete checkpoints kept on disk.
      spike_zscore, window: a loss more than ``spike_zscore`` standard deviations above the mean of
        the last ``window`` good losses is a fault (None: off). Detection starts once
        ``min(window, 10)`` good losses are known.
      max_retries: rewinds allowed in a row; one more consecutive fault raises ``RewindError``.
      skip_policy: "skip" (the offending batch is never read again) or "retry" (replay it; for
        transient faults).
      group: the process group whose ranks rewind together (None: the whole world). Rewind creates
        its own gloo groups for agreement and checkpoints, so construct it on every rank in the
        same order. With a mesh (``Pipeline(mesh=...)``) it must cover every rank of the mesh: the
        data-parallel replicas rewind together (Rewind then also bounds each data-parallel wait by
        the pipeline's timeout, see ``regroup.py``).
      timeout: bound, in seconds, of the agreement and checkpoint collectives (default: the
        pipeline's ``timeout`` + 60, or 600). Must exceed the pipeline's point-to-point timeout.
      rebuild: ``rebuild(pipeline) -> pipeline``, called on every rank after a step raised on any
        rank; it must give the pipeline fresh communication where the failed step left it broken.
        "auto" (default): ``pipeline.rebuilt()`` for a pipeline that has it (``mt_dualpipe.Pipeline``:
        fresh groups for its data-parallel reductions too), nothing for other objects; None: keep
        the pipeline as is (a ``Pipeline`` opens a fresh point-to-point link by itself in the step
        after a failed one, ``runtime/link.py``).
      sync_mirrored: call ``pipeline.sync_mirrored_grads()`` (DualPipe) once the verdict is ok,
        before ``grad_hook`` and ``optimizer.step()`` (always on the current, maybe rebuilt, pipeline).
      grad_hook: called after the verdict is ok and before ``optimizer.step()`` (e.g. gradient
        clipping); it may use collectives.
      stateful: extra objects with ``state_dict``/``load_state_dict`` (lr schedulers) to snapshot.
      skip: data positions never to read (e.g. to reproduce a run that skipped a batch).
      check_inputs: flag NaN/inf in a rank's inputs as a fault ("non-finite input").
      snapshot_device: where snapshots are kept ("cpu"; None: next to the parameters).
      faults: a ``FaultInjector`` (tests and demos).
      overlap_optimizer: run ``optimizer.step()`` of a step this rank saw as good while the ranks
        exchange their verdicts (the exchange mostly waits for the slowest rank); a fault agreed
        afterwards undoes it with the snapshot restore every fault does. Not done when
        ``grad_hook`` is set or ``sync_mirrored`` applies: they must see the agreed verdict first.
    """

    num_chunks: int = 1
    criterion: Callable | None = None
    modules: Sequence[nn.Module] | None = None
    snapshot_every: int = 10
    keep: int = 2
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    resume: bool = True
    spike_zscore: float | None = 6.0
    window: int = 50
    max_retries: int = 3
    skip_policy: str = "skip"
    group: dist.ProcessGroup | None = None
    timeout: float | None = None
    rebuild: Callable[[Any], Any] | None | str = "auto"
    grad_hook: Callable[[], None] | None = None
    sync_mirrored: bool = True
    stateful: dict[str, Any] | None = None
    skip: Sequence[int] = ()
    check_inputs: bool = True
    snapshot_device: str | None = "cpu"
    faults: FaultInjector | None = None
    overlap_optimizer: bool = True

    def __post_init__(self) -> None:
        for name, minimum in (("snapshot_every", 1), ("keep", 1), ("max_retries", 0), ("num_chunks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer of at least {minimum}, got {value!r}")
        if self.skip_policy not in SKIP_POLICIES:
            raise ValueError(f"skip_policy must be one of {', '.join(SKIP_POLICIES)}, got {self.skip_policy!r}")
        if self.checkpoint_every is None:
            self.checkpoint_every = self.snapshot_every
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1 or every % self.snapshot_every:
            raise ValueError(f"checkpoint_every must be a positive multiple of snapshot_every={self.snapshot_every}, "
                             f"got {every!r}")
        if self.rebuild != "auto" and self.rebuild is not None and not callable(self.rebuild):
            raise ValueError(f"rebuild must be a callable, None or 'auto', got {self.rebuild!r}")


class Rewind:
    """Fault-tolerant training steps over ``pipeline`` (see the module docstring).

    ``Rewind(pipeline, optimizer, config)`` with a ``RewindConfig``, or with its fields as keyword
    arguments (``Rewind(pipe, opt, num_chunks=8, criterion=loss_fn)``); keywords given with a
    config replace its fields.
    """

    def __init__(self, pipeline: Any, optimizer: Any, config: RewindConfig | None = None, **options: Any):
        if config is None:
            config = RewindConfig(**options)
        elif options:
            config = dataclasses.replace(config, **options)
        self.config = cfg = config
        self.pipeline = pipeline
        self.optimizer = optimizer
        self.num_chunks = cfg.num_chunks
        self.criterion = cfg.criterion
        self.modules = _local_modules(pipeline, cfg.modules)
        self.snapshot_every, self.keep = cfg.snapshot_every, cfg.keep
        self.checkpoint_every: int = cfg.checkpoint_every or cfg.snapshot_every  # __post_init__ set it
        self.max_retries, self.skip_policy = cfg.max_retries, cfg.skip_policy
        rebuild = _auto_rebuild(pipeline) if cfg.rebuild == "auto" else cfg.rebuild
        assert not isinstance(rebuild, str)  # RewindConfig accepts no other string than "auto"
        self.rebuild: Callable[[Any], Any] | None = rebuild
        self.grad_hook, self.sync_mirrored = cfg.grad_hook, cfg.sync_mirrored
        self.stateful = dict(cfg.stateful or {})
        self.check_inputs = cfg.check_inputs
        self.overlap_optimizer = cfg.overlap_optimizer
        self.snapshot_device = cfg.snapshot_device
        self.faults = faults = cfg.faults
        self.spikes = LossSpikeDetector(cfg.spike_zscore, cfg.window)
        timeout = cfg.timeout
        if timeout is None:
            timeout = (pipeline.timeout if isinstance(pipeline, Pipeline) else 540.0) + 60.0
        ranks = None
        if dist.is_available() and dist.is_initialized():
            group = cfg.group
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            _check_covers_mesh(pipeline, ranks)
            if isinstance(pipeline, Pipeline) and pipeline.mesh is not None:  # bound every dp wait (regroup.py)
                refresh_sync_groups(pipeline, pipeline.timeout)
        self.names = StateNames.of(pipeline, self.modules, optimizer)
        self.agreement = Agreement(ranks, timeout)
        self.rank = self.agreement.rank

        self.step_index = 0       # optimizer steps done
        self.position = 0         # next data position to read
        self.skipped: set[int] = set(int(s) for s in cfg.skip)
        self.events: list[FaultEvent] = []
        self.counters: Counter[str] = Counter()
        # seconds the training thread spent in Rewind's own work: checks, agreement, snapshot, checkpoint, rewind
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._streak = 0          # consecutive faults
        self._streak_step = -1    # the step of the last fault
        self.snapshots: list[Snapshot] = []
        self.resumed_from: int | None = None  # the checkpoint step this run resumed from
        self.checkpoints: CheckpointManager | None = None
        if faults is not None:
            faults.attach(self.modules)
        if cfg.checkpoint_dir is not None:
            self._open_checkpoints(cfg, ranks, timeout)
        if not self.snapshots:
            self._snapshot()

    def _open_checkpoints(self, cfg: RewindConfig, ranks: list[int] | None, timeout: float) -> None:
        assert cfg.checkpoint_dir is not None  # only called with one
        faults = cfg.faults
        self.checkpoints = CheckpointManager(cfg.checkpoint_dir, cfg.keep_checkpoints, ranks, timeout,
                                             before_commit=faults.before_commit if faults else None)
        latest = self.checkpoints.latest() if cfg.resume else None
        if latest is not None:  # into the live objects: a named checkpoint reshards to this layout
            step, position, extra = self.checkpoints.load_into(latest, self.modules, self.optimizer, self.names,
                                                               self.stateful)
            _refresh_shards(self.optimizer)
            self.step_index, self.position = step, position
            self.spikes.load(extra.get("loss_history", []))
            self.skipped |= set(extra.get("skipped", []))
            self.resumed_from = latest
            self.snapshots = []
            self._snapshot()
            self.counters["resumed"] += 1
            log.info("rank %d: resumed from checkpoint step %d in %s", self.rank, latest, cfg.checkpoint_dir)

    # ----- state --------------------------------------------------------------------------------
    def _extra(self) -> dict[str, Any]:
        return {"skipped": sorted(self.skipped), "loss_history": self.spikes.state()}

    def _snapshot(self) -> Snapshot:
        spare = None
        if len(self.snapshots) >= self.keep:  # the oldest goes; its buffers take the new copy
            spare = self.snapshots.pop(0)
            if self.checkpoints is not None and self.checkpoints.holds(spare):
                spare = None  # still being written
        snap = take_snapshot(self.step_index, self.position, self.modules, self.optimizer, self.stateful,
                             self._extra(), device=self.snapshot_device, reuse=spare)
        self.snapshots.append(snap)
        self.counters["snapshots"] += 1
        return snap

    def _restore(self, snap: Snapshot) -> None:
        restore_snapshot(snap, self.modules, self.optimizer, self.stateful)
        _refresh_shards(self.optimizer)
        self.step_index, self.position = snap.step, snap.position
        self.spikes.load(snap.extra.get("loss_history", []))
        # skipping is knowledge, not state: positions found bad since the snapshot stay skipped
        self.skipped |= set(snap.extra.get("skipped", []))

    @property
    def checkpoint_mode(self) -> str | None:
        """How checkpoints are written: "dcp.async_save" or "thread+dcp.save" (None: no checkpoint_dir)."""
        return self.checkpoints.mode if self.checkpoints else None

    # ----- stepping -----------------------------------------------------------------------------
    def _next_position(self) -> int:
        pos = self.position
        while pos in self.skipped:
            pos += 1
        return pos

    def step(self, batch_fn: Callable[[int], Any]) -> StepResult:
        """Attempt one optimizer step on ``batch_fn(position)``; on a fault, rewind (see the module docstring)."""
        step, pos = self.step_index, self._next_position()
        clock = time.perf_counter
        t0 = clock()
        with self._checkpoint_errors(step):
            if self.checkpoints is not None and self.checkpoints.poll() is not None:
                self.counters["checkpoints"] += 1
        if self.faults is not None:
            self.faults.begin_step(step)
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds["checkpoint"] += clock() - t0
        report = self._attempt(batch_fn, pos)
        t5 = clock()
        early = self._overlaps(report)
        try:
            pending = self.agreement.start(step, report)
            if early:  # overlaps the wait for the other ranks; a fault undoes it (the snapshot restore)
                t = clock()
                self.optimizer.step()
                t5 += clock() - t
            verdict = self.agreement.finish(pending)
        except AgreementError as exc:
            self.counters["agreement_failures"] += 1
            self._abandon_checkpoint()
            raise RewindError(str(exc)) from exc
        self.seconds["agreement"] += clock() - t5
        self._check_spike(verdict)
        if not verdict.ok:
            t = clock()
            result = self._on_fault(step, pos, verdict)
            self.seconds["rewind"] += clock() - t
            return result
        self._apply(step, pos, verdict, stepped=early)
        return StepResult(step, pos, True, verdict.loss, verdict.grad_norm)

    def _overlaps(self, report: LocalReport) -> bool:
        """Whether this step's ``optimizer.step()`` runs while the verdicts are exchanged.

        Only for a step this rank saw as good, and never when something must see the agreed verdict
        before the optimizer: ``grad_hook`` and DualPipe's mirrored-gradient sync may use
        collectives, which a rank that faulted would not join.
        """
        return (self.overlap_optimizer and report.kind == FaultKind.OK and self.grad_hook is None
                and not self._mirrored_sync() and _steps_without_collectives(self.pipeline))

    def _mirrored_sync(self) -> bool:
        """Whether Rewind sums DualPipe's mirrored copies itself (not with a mesh: the step's REDUCE_GRAD did)."""
        return self.sync_mirrored and isinstance(self.pipeline, DualPipe) and not self.pipeline.grad_syncs

    def _attempt(self, batch_fn: Callable[[int], Any], pos: int) -> LocalReport:
        """Read the batch, run the pipeline's step and check it here: this rank's report."""
        clock = time.perf_counter
        report = LocalReport()
        try:
            inputs, labels = _split_batch(batch_fn(pos))
            t2 = clock()
            if self.check_inputs:
                bad = nonfinite_inputs(inputs)
                if bad is not None:
                    report.fault(FaultKind.NONFINITE_INPUT, bad)
            t3 = clock()
            loss, _ = self.pipeline.step(*inputs, num_chunks=self.num_chunks, criterion=self.criterion,
                                         labels=labels)
        except Exception as exc:  # the step's own error (the p2p timeout included) becomes a fault
            report.fault(FaultKind.EXCEPTION, _describe(exc))
            t2 = t3 = clock()
        t4 = clock()
        if report.kind != FaultKind.EXCEPTION:
            report.loss_sum, report.loss_count, finite = loss_stats(loss)
            if not finite:
                report.fault(FaultKind.NONFINITE_LOSS, "loss is NaN or infinite")
            report.grad_sq = grad_sq_norm(self.modules, _reduced_shards(self.pipeline))
            if not math.isfinite(report.grad_sq):
                report.fault(FaultKind.NONFINITE_GRAD, "a local gradient is NaN or infinite")
        self.seconds["checks"] += (t3 - t2) + (clock() - t4)
        return report

    def _check_spike(self, verdict: Verdict) -> None:
        """An agreed good loss far above the recent ones is a fault too (the same on every rank)."""
        if verdict.ok and verdict.loss is not None:
            spike, z = self.spikes.is_spike(verdict.loss)
            if spike:
                verdict.kind = FaultKind.LOSS_SPIKE
                verdict.messages = {-1: f"loss {verdict.loss:.6g} has z-score {z:.1f} > {self.spikes.zscore:g} "
                                        f"over the last {len(self.spikes.history)} good steps"}

    def _apply(self, step: int, pos: int, verdict: Verdict, stepped: bool = False) -> None:
        """The agreed-good step: mirrored gradients, hook, optimizer (unless ``stepped`` already),
        then maybe a snapshot and a checkpoint."""
        clock = time.perf_counter
        if not stepped:
            if self._mirrored_sync():
                self.pipeline.sync_mirrored_grads()  # DualPipe: sum the gradients of the mirrored stage copies
            if self.grad_hook is not None:
                self.grad_hook()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if verdict.loss is not None:
            self.spikes.push(verdict.loss)
        self.step_index, self.position = step + 1, pos + 1
        if self.step_index > self._streak_step:
            self._streak = 0
        self.counters["steps"] += 1
        if self.step_index % self.snapshot_every == 0:
            t = clock()
            snap = self._snapshot()
            t7 = clock()
            self.seconds["snapshot"] += t7 - t
            if self.checkpoints is not None and self.step_index % self.checkpoint_every == 0:
                with self._checkpoint_errors(step):
                    self.checkpoints.save(snap, self.names)
                self.seconds["checkpoint"] += clock() - t7

    def _on_fault(self, step: int, pos: int, verdict: Verdict) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        self._streak += 1
        self._streak_step = max(self._streak_step, step)
        self.counters["faults"] += 1
        self.counters[verdict.kind.name.lower()] += 1
        cause = verdict.describe()
        if self._streak > self.max_retries:
            event = FaultEvent(step, pos, verdict.kind, verdict.faulty_ranks, cause, -1, False, self._streak)
            self.events.append(event)
            log.error("rank %d: step %d (data position %d): %s; giving up", self.rank, step, pos, cause)
            raise RewindError(f"step {step} (data position {pos}): {cause}; stopped after {self._streak} consecutive "
                              f"faults (max_retries={self.max_retries})")
        skip = self.skip_policy == "skip"
        if skip:
            self.skipped.add(pos)
            self.counters["skipped_batches"] += 1
        if verdict.kind == FaultKind.EXCEPTION and self.rebuild is not None:
            self.pipeline = self.rebuild(self.pipeline)
            self.counters["rebuilds"] += 1
        index = max(0, len(self.snapshots) - self._streak)
        target = self.snapshots[index]
        del self.snapshots[index + 1:]  # newer snapshots belong to the abandoned timeline
        self._restore(target)
        self.counters["rewinds"] += 1
        event = FaultEvent(step, pos, verdict.kind, verdict.faulty_ranks, cause, target.step, skip, self._streak)
        self.events.append(event)
        log.warning("rank %d: step %d (data position %d): %s; rewound to step %d%s", self.rank, step, pos, cause,
                    target.step, f", batch {pos} skipped" if skip else ", batch will be retried")
        return StepResult(step, pos, False, verdict.loss, verdict.grad_norm, event)

    def run(self, batch_fn: Callable[[int], Any], num_steps: int,
            on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        """Call ``step`` until ``step_index == num_steps`` (steps in total: a resumed run counts those done
        before the crash); returns every attempt's result."""
        results = []
        while self.step_index < num_steps:
            res = self.step(batch_fn)
            results.append(res)
            if on_step is not None:
                on_step(res)
        return results

    @contextlib.contextmanager
    def _checkpoint_errors(self, step: int) -> Iterator[None]:
        try:
            yield
        except CheckpointError as exc:
            self.counters["checkpoint_failures"] += 1
            raise RewindError(f"step {step}: {exc}") from exc

    def _abandon_checkpoint(self) -> None:
        """Before giving up: commit the checkpoint in flight if it can still complete, else log why not."""
        if self.checkpoints is None:
            return
        try:
            if self.checkpoints.wait() is not None:
                self.counters["checkpoints"] += 1
        except CheckpointError as exc:
            log.error("rank %d: %s", self.rank, exc)

    def close(self) -> None:
        """Wait for the checkpoint being written and commit it."""
        if self.checkpoints is not None and self.checkpoints.wait() is not None:
            self.counters["checkpoints"] += 1

    def __enter__(self) -> Rewind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _steps_without_collectives(pipeline: Any) -> bool:
    """Whether ``optimizer.step()`` posts no collective (no mesh, or an all-reduce mode: no ZeRO-1 gather)."""
    return (not isinstance(pipeline, Pipeline) or pipeline.dp_mode is None
            or DP_MODES[pipeline.dp_mode].reduces_by == "all_reduce")


def _check_covers_mesh(pipeline: Any, ranks: list[int]) -> None:
    """With a mesh every rank must rewind together: a fault on one replica would otherwise leave the
    others stepping on (and, in zero1, gathering parameters from a replica that rewound)."""
    need = pipeline.mesh_ranks if isinstance(pipeline, Pipeline) else None
    if need is not None and not set(need) <= set(ranks):
        raise ValueError(f"Rewind's group spans ranks {sorted(ranks)} but the pipeline's mesh spans {list(need)}: "
                         "every data-parallel replica must agree on each step (pass group=None for the whole world)")


def _reduced_shards(pipeline: Any) -> list[Any]:
    """The ZeRO-1 gradient shards of the pipeline's syncs (after zero1's reduce-scatter ``.grad`` is None)."""
    return pipeline.reduced_gradient_shards() if isinstance(pipeline, Pipeline) else []


def _refresh_shards(optimizer: Any) -> None:
    """ZeRO-1 keeps its own copy of this rank's parameter shards: take them again from the restored parameters."""
    if isinstance(optimizer, RetakesParameters):
        optimizer.refresh_shards()


def rebuild_pipeline(old: Any, group: dist.ProcessGroup | None = None) -> Any:
    """``old.rebuilt(group)``: the same pipeline on a fresh process group (see ``Pipeline.rebuilt``).

    On a mesh (``Pipeline(mesh=...)``): fresh groups for every pipeline line and every data-parallel
    reduction, the sync objects (and so the optimizers built on them) kept (``regroup.rebuild_on_mesh``).

    Kept for callers that pass it as ``rebuild=``; the pipeline itself knows how to rebuild.
    """
    if not isinstance(old, Rebuildable):
        raise TypeError(f"rebuild_pipeline needs a pipeline with a rebuilt() method (mt_dualpipe.Pipeline), got "
                        f"{type(old).__name__}; pass rebuild=")
    if isinstance(old, Pipeline) and old.mesh is not None:  # every pipeline line and every dp group (regroup.py)
        return rebuild_on_mesh(old, group, old.timeout)
    return old.rebuilt(group)


def _auto_rebuild(pipeline: Any) -> Callable[[Any], Any] | None:
    """``pipeline.rebuilt()`` for pipelines that can rebuild themselves, None (keep as is) for anything else."""
    return rebuild_pipeline if isinstance(pipeline, Rebuildable) else None


def fresh_group(ranks: Sequence[int] | None = None, backend: str | None = None,
                timeout: float | None = None) -> dist.ProcessGroup:
    """A new process group over ``ranks`` (default: the world) for a rebuilt pipeline (collective)."""
    kwargs: dict[str, Any] = {"ranks": list(ranks) if ranks is not None else None, "backend": backend}
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    return dist.new_group(**kwargs)


def _describe(exc: BaseException) -> str:
    """The fault's cause: the root exception's type and message, and where the runtime says it happened.

    The runtime wraps errors raised inside a stage as ``PipelineError("rank r F(chain c, stage s,
    mb m) in Module: ...") from exc``; the cause named first is the original one.
    """
    root = exc
    while root.__cause__ is not None and isinstance(root, PipelineError):
        root = root.__cause__
    first = str(root).strip().splitlines()[0][:300] if str(root).strip() else ""
    text = f"{type(root).__name__}: {first}"
    if root is not exc:
        text += f" (at {str(exc).strip().splitlines()[0].split(': ')[0][:120]})"
    return text

