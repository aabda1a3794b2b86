"""The user-facing modules: ``Pipeline`` (any schedule), ``DualPipe`` and ``DualPipeV`` (drop-ins).

They are thin: build the schedule for the step's number of micro-batches, lower it once, split the
inputs and labels into micro-batches (``microbatches.py``: batched tensors, or lists with one tensor
per micro-batch), run the ``Executor`` and stack the losses. Which rank gets
what follows from the placement alone: a rank passes inputs for the chain whose first stage it
holds and labels for the chain whose last stage it holds, and gets that chain's losses (and
outputs) back, in micro-batch order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.device import backend_for, module_device
from ..parallel.layout import DEFAULT_BUCKET_BYTES
from ..parallel.mesh import ParallelDims, from_device_mesh
from ..parallel.stage_sync import GroupUse, StageGradSync, stage_params
from ..schedules.errors import ScheduleError
from ..schedules.fuse import fuse_adjacent_backward
from ..schedules.ir import Schedule
from ..schedules.lower import lower
from ..schedules.registry import build_schedule, schedule_info
from .comm import P2P
from .data_parallel import (
    DP_BATCH,
    DP_MODES,
    PipelineGroups,
    Reductions,
    build_reductions,
    check_mesh,
    find_ties,
    needs_reductions,
    rank_label,
    refuse_wrapped,
)
from .errors import PipelineError, PipelinePeerError
from .executor import Executor
from .microbatches import MicrobatchError, is_ragged, joined, replica_share, split
from .step_checks import NOT_HELD, UNEXPECTED, Given, StepCheck, StepVerifier, given, mixed_forms
from .timeline import gather_timeline
from .weight_grad import WeightGradStore

if TYPE_CHECKING:
    from ..parallel.zero import PipelineOptimizer


class Pipeline(nn.Module):
    """Run any schedule (a registered name or a ``Schedule``) on ``process_group``.

    ``stage_modules``: the modules of the stages this rank runs, in the order of
    ``schedule.local_stages(rank)``. ``schedule_options`` go to ``build_schedule`` for a name.
    ``timeout`` (seconds) bounds every point-to-point wait. Set ``record_timeline = True`` to have
    each step's measured ``Timeline`` in ``self.timeline`` on the pipeline's first rank.
    ``peak_activations`` is this rank's peak of in-flight stage activations in the last training
    step (+1 at F, -1 at W or BW: the simulator's count). With ``record_activation_bytes = True``
    a training step also records ``peak_activation_bytes``: this rank's peak of saved-activation
    bytes (``activation_bytes.py``; off by default: its hooks hide any the caller set). A batch
    must split into ``num_chunks`` equal micro-batches along ``batch_dim`` unless ``allow_uneven``
    (the first ``size % num_chunks`` micro-batches then get one row more; the losses are still summed
    per micro-batch).

    A schedule given by name is built on every rank; for a searched one (``auto``) build it once
    and pass the same ``Schedule`` everywhere. An unknown name or option, or a number of modules
    that is not this rank's number of stages, fails here rather than at the first step.
    ``needs_inputs`` / ``needs_labels`` say whether ``step()`` needs the batch's inputs / the
    criterion and labels on this rank; ``split_model`` cuts a stack of layers into this rank's
    stage modules; ``rebuilt()`` gives the same pipeline on a fresh process group.
    ``fuse_backward`` (default True): a B that the program follows directly with its own W runs as one
    BW (``schedules/fuse.py``: the same order and gradients, without the split's cost); False keeps
    every split the schedule has.

    Data parallel (``data_parallel.py``): ``mesh=init_parallel(pp=P, dp=D)`` — or a ``DeviceMesh``
    the user built, read by its dimension names (``parallel/mesh_roles.py``) — runs the schedule on
    the mesh's pp group (``process_group=`` stays the pp-only way) and reduces each stage's
    gradients over its data-parallel group at the stage's ``REDUCE_GRAD`` op, right after its last
    W/BW of the step, asynchronously; ``step()`` returns once every reduction is complete.
    ``dp_mode``: ``"allreduce"`` (default; ``.grad`` is the replicas' average, step any optimizer),
    ``"zero1"`` (reduce-scatter: step ``parallel.ZeroOptimizer.for_module(module, sync, factory)``
    with ``sync`` from ``stage_syncs``) or ``"fsdp"`` (stages wrapped with ``fully_shard``, kept
    unsharded for the step, reduce-scattered after the last W). ``dp_batch="global"``: every
    replica passes the global batch and takes its dp share; ``"local"``: each passes its own.
    Stages wrapped in ``DistributedDataParallel`` are refused (its hooks miss the deferred W).
    With ``ep > 1`` the batch splits over the ``dp * ep`` replicas (replica ``dp_coord * ep +
    ep_coord``); parameters marked ``set_weight_kind(p, "expert")`` reduce over copies x dp, the
    rest over copies x dp x ep, both divided by dp x ep. ``build_optimizer(factory)`` gives one
    optimizer for all of this rank's stages (ZeRO-1 shards in zero1 mode).

    Tied weights: a stage module may declare ``tied_parameters`` (parameter FQNs within it); the
    copies of such a name in every stage are one weight, their gradients summed once per step
    (after the last W of every local holder, with or without a mesh; ``data_parallel.find_ties``).
    """

    def __init__(self, stage_modules: Sequence[nn.Module], schedule: str | Schedule,
                 process_group: dist.ProcessGroup | None = None, *, rank_mapping: Sequence[int] | None = None,
                 batch_dim: int = 0, timeout: float = 300.0, schedule_options: dict | None = None,
                 allow_uneven: bool = False, mesh: ParallelDims | DeviceMesh | None = None,
                 dp_mode: str | None = None, dp_batch: str = "global", bucket_bytes: int | None = None,
                 fuse_backward: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise PipelineError("torch.distributed is not initialized; call dist.init_process_group first")
        self.module = nn.ModuleList(stage_modules)
        if isinstance(mesh, DeviceMesh):  # the user's own mesh, read by its dimension names (parallel/mesh_roles.py)
            mesh = from_device_mesh(mesh)
        process_group = _pp_group(mesh, dp_mode, dp_batch, process_group)
        self.group = process_group or dist.distributed_c10d._get_default_group()
        self.num_ranks = dist.get_world_size(self.group)
        mapping = list(rank_mapping) if rank_mapping is not None else list(range(self.num_ranks))
        if sorted(mapping) != list(range(self.num_ranks)):
            raise PipelineError(f"rank_mapping must be a permutation of 0..{self.num_ranks - 1}, got {mapping}")
        inverse = [0] * self.num_ranks
        for group_rank, pp_rank in enumerate(mapping):
            inverse[pp_rank] = group_rank
        self.rank = mapping[dist.get_rank(self.group)]
        self.rank_name = rank_label(self.rank, dist.get_rank())
        peers = [dist.get_global_rank(self.group, inverse[p]) for p in range(self.num_ranks)]
        if isinstance(schedule, Schedule) and schedule.num_ranks != self.num_ranks:
            raise PipelineError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks but the process group "
                                f"has {self.num_ranks}")
        self.schedule = schedule
        self.schedule_options = dict(schedule_options or {})
        self.placement = _placement_of(schedule, self.num_ranks, self.schedule_options)
        local = [(c, s) for c, chain in enumerate(self.placement) for s, r in enumerate(chain) if r == self.rank]
        if len(local) != len(self.module):
            name = schedule.name if isinstance(schedule, Schedule) else schedule
            raise PipelineError(
                f"{self.rank_name} runs {len(local)} stage(s) {local} of schedule {name!r} but was given "
                f"{len(self.module)} module(s); pass one module per stage, in (chain, stage) order")
        self._setup_data_parallel(mesh, dp_mode, dp_batch, bucket_bytes, local, peers)
        self.batch_dim = batch_dim
        self.allow_uneven = allow_uneven
        self.fuse_backward = fuse_backward  # read when an executor is built (the first step per num_chunks)
        self.rank_mapping = None if rank_mapping is None else mapping
        self.device = module_device(self.module)
        wanted, have = backend_for(self.device), dist.get_backend(self.group)
        if wanted not in str(have):
            raise PipelineError(f"the stage modules are on {self.device}, which needs a {wanted!r} process group, "
                                f"but the group's backend is {have!r}; init the group with backend={wanted!r}")
        self.p2p = P2P(self.rank, peers, self.group, self.device, timeout)
        self.p2p.on_agreement = StepVerifier(self.rank, [(chain[0], chain[-1]) for chain in self.placement])
        self.p2p.rank_name = self.rank_name
        self.store = WeightGradStore()
        self._executors: dict[int, Executor] = {}
        self.record_timeline = False
        self.timeline = None
        self.peak_activations: int | None = None
        self.record_activation_bytes = False
        self.peak_activation_bytes: int | None = None

    def _setup_data_parallel(self, mesh: ParallelDims | None, dp_mode: str | None, dp_batch: str,
                             bucket_bytes: int | None, local: list[tuple[int, int]], peers: list[int]) -> None:
        """The data-parallel side (see ``data_parallel.py``): refuse wrapped stages, find tied weights, build
        one sync per stage (collective over the world when a mesh or ties ask for groups)."""
        refuse_wrapped(list(self.module), dp_mode if mesh is not None else None, self.rank_name)
        self.mesh, self.dp_batch = mesh, dp_batch
        self.dp_mode = (dp_mode or "allreduce") if mesh is not None else None
        self.replicas, self.replica = 1, 0
        if mesh is not None:  # the batch splits over the dp x ep replicas (the ep ranks run different rows)
            self.replicas, self.replica = mesh.dp * mesh.ep, mesh.coord("dp") * mesh.ep + mesh.coord("ep")
            if mesh.pp != self.num_ranks:
                raise PipelineError(f"the mesh has pp={mesh.pp} but the pipeline group has {self.num_ranks} ranks")
        ties, experts = find_ties(list(self.module), local, self.group, self.rank, self.rank_name)
        self.ties = ties
        self.reductions = Reductions()
        if needs_reductions(mesh, self.dp_mode, ties, experts, self.group):
            groups = mesh if mesh is not None else PipelineGroups(self.rank, peers)
            self.reductions = build_reductions(mesh, groups, self.placement, local, list(self.module),
                                               self.dp_mode or "allreduce", bucket_bytes or DEFAULT_BUCKET_BYTES,
                                               self.rank_name, ties)
        self.grad_syncs: dict[tuple[int, int], StageGradSync] = self.reductions.syncs
        self.data_parallel = bool(self.grad_syncs)  # lower with one REDUCE_GRAD per stage

    # ----- what resilience (and any training loop) may ask of the data-parallel side ------------------
    @property
    def mesh_ranks(self) -> tuple[int, ...] | None:
        """Every global rank of the pipeline's mesh (None without a mesh): the ranks that must step together."""
        if self.mesh is None:
            return None
        return tuple(sorted(int(r) for r in self.mesh.mesh.mesh.reshape(-1).tolist()))

    def reduced_gradient_shards(self) -> list[torch.Tensor]:
        """After a step: the reduced gradient chunks the syncs hold where ``.grad`` was emptied (ZeRO-1), each once."""
        seen: set[int] = set()
        out = []
        for sync in self.grad_syncs.values():
            for g in sync.reduced_shards():
                if id(g) not in seen:
                    seen.add(id(g))
                    out.append(g)
        return out

    def sync_groups(self) -> list[GroupUse]:
        """Every process group the stages' syncs post on, each ``(key, ranks)`` once, in a fixed order."""
        uses = {(u.key, u.ranks): u for sync in self.grad_syncs.values() for u in sync.process_groups()}
        return [uses[k] for k in sorted(uses, key=repr)]

    def replace_sync_group(self, use: GroupUse, group: dist.ProcessGroup) -> None:
        """Post ``use``'s collectives on ``group`` (a fresh group over the same ranks) from now on."""
        for sync in self.grad_syncs.values():
            sync.replace_group(use.key, group)

    def build_optimizer(self, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> PipelineOptimizer:
        """One optimizer (``parallel.PipelineOptimizer``) for every stage this rank holds, in every dp mode.

        ``factory(params)`` builds a ``torch.optim`` optimizer over the tensors it is given: once
        over the plain parameters (allreduce, fsdp, no mesh) and, in zero1 mode, once per reduced
        group over this rank's shards (each weight kind over its own group). Tied weights are
        stepped once (their representative) and copied into the other copies. The object has
        ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``, ``state_bytes`` and
        ``param_groups``. Build it again after ``rebuilt()`` (the new pipeline has new syncs), unless it
        was rebuilt with ``keep_syncs=True``.
        """
        from ..parallel.zero import PipelineOptimizer  # lazy: DTensor/DCP state (~1 s a process), for training only

        params = self.reductions.params
        if not params:  # no reductions built (no mesh, no ties): every parameter once, named by its stage
            local = [s for c, chain in enumerate(self.placement) for s, r in enumerate(chain) if r == self.rank]
            seen: set[int] = set()
            params = []
            for s, m in zip(local, self.module):
                names = {id(p): n for n, p in m.named_parameters()}
                params += [(f"stage{s}.{names[id(p)]}", p, None) for p in stage_params(m) if id(p) not in seen]
                seen.update(id(p) for p in stage_params(m))
        return PipelineOptimizer(params, factory, self.dp_mode or "allreduce", self.reductions.ties)

    @property
    def stage_syncs(self) -> list[StageGradSync | None]:
        """The gradient-sync object of each stage module (``self.module`` order), None where it has none."""
        local = [(c, s) for c, chain in enumerate(self.placement) for s, r in enumerate(chain) if r == self.rank]
        return [self.grad_syncs.get(cs) for cs in local]

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank holds a chain's first stage, so ``step()`` needs the batch's inputs here."""
        return any(chain[0] == self.rank for chain in self.placement)

    @property
    def needs_labels(self) -> bool:
        """Whether this rank holds a chain's last stage: it computes the loss, so ``step()`` needs
        ``criterion`` here (and ``labels`` when the criterion takes any)."""
        return any(chain[-1] == self.rank for chain in self.placement)

    def rebuilt(self, group: dist.ProcessGroup | None = None, *, keep_syncs: bool = False) -> Pipeline:
        """The same pipeline (stage modules, schedule, options, timeout, mapping) on a fresh process group.

        What a fault-tolerant loop needs after a step raised: a timed-out or failed point-to-point
        wait leaves the old group unusable (gloo closes the pair). ``group`` defaults to a new
        group over the same ranks and backend, created collectively (``dist.new_group``), so call
        it on every rank. The subclass (``DualPipe``, ``DualPipeV``) is kept. With a mesh every
        pipeline line's new group is created on every rank, in one order (``new_group`` is
        collective over the world); ``resilience.rebuild_pipeline`` also renews the reductions' groups.
        ``keep_syncs=True``: the new pipeline reduces with this one's sync objects (so an optimizer built on
        them keeps working); give them fresh groups with ``replace_sync_group``.
        """
        if group is None and self.mesh is not None:
            lines = self.mesh.mesh.mesh.reshape(self.num_ranks, -1).t().tolist()  # one per (dp, ep, tp)
            made = [dist.new_group(line, backend=dist.get_backend(self.group)) for line in lines]
            group = next(g for g, line in zip(made, lines) if dist.get_rank() in line)
        elif group is None:
            group = dist.new_group(ranks=dist.get_process_group_ranks(self.group),
                                   backend=dist.get_backend(self.group))
        new = type(self).__new__(type(self))
        Pipeline.__init__(new, list(self.module), self.schedule, group, rank_mapping=self.rank_mapping,
                          batch_dim=self.batch_dim, timeout=self.timeout, schedule_options=self.schedule_options,
                          allow_uneven=self.allow_uneven, mesh=self.mesh,
                          dp_mode=self.dp_mode if self.mesh is not None else None, dp_batch=self.dp_batch)
        new.record_timeline = self.record_timeline
        new.record_activation_bytes = self.record_activation_bytes
        new.fuse_backward = self.fuse_backward
        if keep_syncs:  # no executor is built yet: the next step lowers with these
            new.reductions, new.grad_syncs = self.reductions, self.grad_syncs
        return new

    @property
    def timeout(self) -> float:
        return self.p2p.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.p2p.timeout = float(seconds)

    def executor(self, num_chunks: int) -> Executor:
        """The executor (schedule built and lowered once) for ``num_chunks`` micro-batches."""
        if num_chunks not in self._executors:
            if isinstance(self.schedule, Schedule):
                if num_chunks != self.schedule.num_microbatches:
                    raise PipelineError(f"schedule {self.schedule.name!r} has {self.schedule.num_microbatches} "
                                        f"micro-batches but step got num_chunks={num_chunks}")
                sched = self.schedule
            else:
                sched = build_schedule(self.schedule, self.num_ranks, num_chunks, **self.schedule_options)
            program = lower(sched, data_parallel=self.data_parallel)
            if self.fuse_backward:
                program = fuse_adjacent_backward(program)
            ex = Executor(program, self.rank, list(self.module), self.p2p, self.store, syncs=self.grad_syncs,
                          rank_name=self.rank_name)
            self._executors[num_chunks] = ex
        return self._executors[num_chunks]

    def _chain_here(self, sched: Schedule, position: int) -> int | None:
        """The chain whose first (position 0) or last (position -1) stage is on this rank, if any."""
        chains = [c for c, ranks in enumerate(sched.placement) if ranks[position] == self.rank]
        if len(chains) > 1:
            raise PipelineError(f"{self.rank_name} holds the {'first' if position == 0 else 'last'} stage of chains "
                                f"{chains}; a rank may feed (or end) at most one chain")
        return chains[0] if chains else None

    def step(self, *inputs: torch.Tensor | Sequence[torch.Tensor] | None, num_chunks: int,
             criterion: Callable | None = None, labels: Sequence[torch.Tensor | Sequence[torch.Tensor] | None] = (),
             return_outputs: bool = False) -> tuple[Any, Any]:
        """One training step (or, under ``torch.no_grad()``, an inference step) over ``num_chunks`` micro-batches.

        ``inputs`` are needed only on a rank holding a chain's first stage (``needs_inputs``) and
        are split into that chain's micro-batches along ``batch_dim``; ``labels`` likewise on a rank
        holding a chain's last stage (``needs_labels``), where ``criterion(*outputs, *labels)`` gives
        each micro-batch's loss, a scalar in a training step. Gradients are those of the sum of the
        micro-batch losses. Returns ``(loss, outputs)``: the stacked losses of the chain ending on
        this rank (None elsewhere or without criterion) and, with ``return_outputs``, its outputs
        concatenated along ``batch_dim`` (one tensor if the stage returns one). An output that cannot
        be concatenated (0-dim, or shapes that vary between micro-batches) comes back as a list
        with one tensor per micro-batch instead.

        Ragged micro-batches: in place of each batched tensor pass a list with one tensor per
        micro-batch of the rank's chain (``num_chunks`` of them; DualPipe: the ``num_chunks / 2`` of
        the chain the rank feeds or ends), whose shapes may differ between micro-batches, e.g.
        ``step([x0, x1, x2], num_chunks=3, criterion=f, labels=([y0, y1, y2],))``. Every rank passes
        lists then; losses come back in the lists' order and outputs as a list per output, one
        tensor per micro-batch. With ``dp_batch="global"`` each replica takes its rows of every
        micro-batch. A schedule with a ``microbatch_order`` runs the micro-batches (lists or row
        blocks) in its order; losses and outputs come back in the caller's (``_fed``).

        Mistakes made on one rank only (``num_chunks``, missing labels, a batch that does not split,
        a different batch size, a list of the wrong length, lists on one rank and batched tensors
        on another) make every rank raise at the step's start, naming the rank.
        """
        forward_only = not torch.is_grad_enabled()
        prepared = _Prepared()
        if self.replicas > 1 and self.dp_batch == "global":
            try:
                label = (f"dp*ep = {self.mesh.dp}*{self.mesh.ep} = {self.replicas}" if self.mesh.ep > 1
                         else f"dp={self.replicas}")
                inputs = replica_share(inputs, self.replica, self.replicas, self.batch_dim, "inputs", label)
                labels = replica_share(labels, self.replica, self.replicas, self.batch_dim, "labels", label)
            except PipelineError as exc:
                prepared.problem, prepared.problem_code = exc, 2
                self._fail_together(prepared.check(num_chunks, not forward_only), exc)
            except Exception as exc:  # noqa: BLE001 - any error here must stop every rank, named
                self._fail_unexpectedly(prepared, num_chunks, forward_only, exc)
        try:
            self._prepare(prepared, inputs, num_chunks, criterion, labels, forward_only)
        except (PipelineError, ScheduleError) as exc:
            prepared.problem = exc
        except Exception as exc:  # noqa: BLE001 - any error here must stop every rank, named
            self._fail_unexpectedly(prepared, num_chunks, forward_only, exc)
        check = prepared.check(num_chunks, not forward_only)
        if prepared.problem is not None:
            self._fail_together(check, prepared.problem)
        ex, sched, last = prepared.executor, prepared.executor.program.schedule, prepared.last
        try:
            res = ex.run(prepared.inputs, prepared.labels, criterion, forward_only, return_outputs,
                         self.record_timeline, check.row(), self.record_activation_bytes)
        except BaseException as exc:
            self.store.clear()
            raised = self.p2p.fail(exc)  # tell the peers, or name the peer that failed (comm.py)
            self.p2p.forget()  # the ranks may disagree on what was learned: learn again next step
            if raised is exc:
                raise
            raise raised from (None if isinstance(raised, PipelinePeerError) else exc)
        if not forward_only:
            self.peak_activations = res.peak_activations
            self.peak_activation_bytes = res.peak_activation_bytes
        if self.record_timeline:
            self.timeline = gather_timeline(res.events, sched.name, sched.num_ranks, sched.num_microbatches,
                                            self.rank, self.p2p.meta_group, self.p2p.peers_global[0])
        loss = outputs = None
        if last is not None:
            mbs = _fed(sched, last)
            if criterion is not None:
                loss = torch.stack([res.losses[m] for m in mbs])
            if return_outputs:
                agreed = self.p2p.on_agreement  # the step's rows: whether any rank passed lists
                ragged = isinstance(agreed, StepVerifier) and agreed.ragged
                outputs = joined([res.outputs[m] for m in mbs], self.batch_dim, ragged)
        return loss, outputs

    def _prepare(self, out: _Prepared, inputs: Sequence[Any], num_chunks: int, criterion: Callable | None,
                 labels: Sequence[Any], forward_only: bool) -> None:
        """Everything a step checks on this rank alone; fills ``out`` (its ``problem`` code says how far it got)."""
        out.problem_code = 5
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise PipelineError(f"num_chunks must be a positive integer, got {num_chunks!r}")
        ex = out.executor = self.executor(num_chunks)
        sched = ex.program.schedule
        first, last = out.first, out.last = self._chain_here(sched, 0), self._chain_here(sched, -1)
        out.given_inputs = given(inputs, self.batch_dim, first is not None)
        out.given_labels = given(labels, self.batch_dim, last is not None)
        if first is not None:
            out.problem_code = 1
            if not inputs or all(x is None for x in inputs):
                raise PipelineError(f"{self.rank_name} holds the first stage of chain {first} and needs the step's "
                                    "inputs")
            out.inputs = self._microbatches(out, inputs, sched, first, "inputs")
        if last is not None:
            out.problem_code = 4
            if not forward_only and criterion is None:
                raise PipelineError(f"{self.rank_name} holds the last stage of chain {last}: a training step needs "
                                    "criterion here")
            out.labels = self._microbatches(out, labels, sched, last, "labels")
        if first is not None and last is not None and any(y is not None for y in labels) \
                and is_ragged(inputs) != is_ragged(labels):
            out.problem_code = 8  # stopped here, before a criterion meets them; _fail_together names every rank's forms
            form = ("lists of micro-batches", "batched tensors")
            raise PipelineError(f"{self.rank_name} passed its inputs as {form[not is_ragged(inputs)]} but its "
                                f"labels as {form[not is_ragged(labels)]}; pass both the same way: lists with one "
                                "tensor per micro-batch (labels=([y0, y1, ...],)) or batched tensors")
        out.problem_code = 0

    def _microbatches(self, out: _Prepared, values: Sequence[Any], sched: Schedule, chain: int,
                      what: str) -> dict[int, tuple]:
        """``values`` cut into the micro-batches of ``chain``, keyed by the schedule's micro-batch ids."""
        mbs = _fed(sched, chain)
        hint = "" if len(mbs) == sched.num_microbatches else (
            f"{self.rank_name} {'feeds' if what == 'inputs' else 'ends'} chain {chain}, which runs {len(mbs)} of the "
            f"step's num_chunks={sched.num_microbatches} micro-batches")
        try:
            return dict(zip(mbs, split(values, len(mbs), self.batch_dim, what, self.allow_uneven, hint)))
        except MicrobatchError as exc:
            out.problem_code = {"type": 9, "mixed": 8, "count": 6 if what == "inputs" else 7}.get(
                exc.kind, 2 if what == "inputs" else 3)
            raise PipelineError(str(exc)) from None  # the kind was for the code; the user sees a PipelineError

    def _fail_unexpectedly(self, prepared: _Prepared, num_chunks: Any, forward_only: bool, exc: Exception) -> None:
        """An error the step's own checks did not foresee while preparing the step (splitting the inputs, say):
        every rank stops, and the others name it (its text goes on the link's board, ``link.py``)."""
        problem = PipelineError(f"{self.rank_name} while preparing the step: {type(exc).__name__}: {exc}")
        problem.__cause__ = exc
        prepared.problem, prepared.problem_code = problem, UNEXPECTED
        self._fail_together(prepared.check(num_chunks, not forward_only), problem,
                            str(problem).splitlines()[0][:500])

    def _fail_together(self, check: StepCheck, problem: BaseException, report: str | None = None) -> None:
        """Take part in the step-start agreement (so the other ranks fail at once too), then raise ``problem``,
        or the agreed error when the ranks mixed lists of micro-batches with batched tensors (its root cause).
        ``report``: the line the peers' errors quote (written on the link's board before the agreement)."""
        verifier = self.p2p.on_agreement
        if isinstance(verifier, StepVerifier):
            verifier.seen = None
        try:
            self.p2p.begin_step(None, check.row(), report)
            self.p2p.settle()
        except Exception:  # noqa: BLE001 - this rank's own problem is the error to report
            pass
        finally:
            self.p2p.forget()
        mixed = mixed_forms(verifier.seen) if isinstance(verifier, StepVerifier) else None
        if mixed:
            raise PipelineError(mixed) from problem
        raise problem


class _Prepared:
    """What ``Pipeline._prepare`` found out about a step on this rank."""

    def __init__(self) -> None:
        self.executor: Executor | None = None
        self.first: int | None = None
        self.last: int | None = None
        self.inputs: dict[int, tuple] = {}
        self.labels: dict[int, tuple] = {}
        self.given_inputs = self.given_labels = Given(NOT_HELD, NOT_HELD)
        self.problem: BaseException | None = None
        self.problem_code = 0

    def check(self, num_chunks: Any, training: bool) -> StepCheck:
        n = num_chunks if isinstance(num_chunks, int) and not isinstance(num_chunks, bool) else 0
        code = self.problem_code if self.problem is not None else 0
        x, y = self.given_inputs, self.given_labels
        return StepCheck(n, int(training), x.rows, y.rows, code, x.count, y.count, x.split, y.split)


def _fed(sched: Schedule, chain: int) -> list[int]:
    """The slots (the ops' micro-batch ids) of ``chain``, in the order of the caller's micro-batches.

    The caller's m-th micro-batch of the chain (its m-th row block, or list entry) runs in the m-th
    slot here, and losses and outputs come back through the same list, so the caller never sees
    the schedule's order. A schedule that chose an order of the step's micro-batches
    (``Schedule.microbatch_order``: slot s runs the micro-batch that arrived ``arrival_of(s)``-th)
    gets them in that order: the chain's slots sorted by arrival. Without one, slot = arrival.
    """
    return sorted(sched.microbatches_of(chain), key=sched.arrival_of)


def _pp_group(mesh: ParallelDims | None, dp_mode: str | None, dp_batch: str,
              process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The pipeline's group: the mesh's pp group when a mesh is given (checked), else ``process_group``."""
    if dp_mode is not None and dp_mode not in DP_MODES:
        raise PipelineError(f"unknown dp_mode {dp_mode!r}; allowed: {', '.join(DP_MODES)}")
    if dp_batch not in DP_BATCH:
        raise PipelineError(f"unknown dp_batch {dp_batch!r}; allowed: {', '.join(DP_BATCH)}")
    if mesh is None:
        if dp_mode is not None:
            raise PipelineError(f"dp_mode={dp_mode!r} needs mesh= (mt_dualpipe.parallel.init_parallel(pp=..., dp=...))")
        return process_group
    check_mesh(mesh)
    pp = mesh.group("pp")
    if process_group is not None and dist.get_process_group_ranks(process_group) != dist.get_process_group_ranks(pp):
        raise PipelineError(f"process_group spans global ranks {dist.get_process_group_ranks(process_group)} but the "
                            f"mesh's pp group spans {dist.get_process_group_ranks(pp)}; pass mesh= alone (the "
                            "pipeline runs on its pp group) or a group over the same ranks")
    return process_group or pp


def _placement_of(schedule: str | Schedule, num_ranks: int, options: dict) -> tuple[tuple[int, ...], ...]:
    """The schedule's placement, checked at construction: an unknown name or option fails here."""
    if isinstance(schedule, Schedule):
        return tuple(tuple(c) for c in schedule.placement)
    if not isinstance(schedule, str):
        raise PipelineError(f"schedule must be a registered name or a Schedule, got {type(schedule).__name__}")
    try:
        info = schedule_info(schedule)
    except ScheduleError as exc:
        raise PipelineError(str(exc)) from None
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        hint = f"allowed: {', '.join(info.options)}" if info.options else "it takes no options"
        raise PipelineError(f"schedule {schedule!r} got unknown option(s) {', '.join(unknown)}; {hint}")
    try:
        return info.layout(num_ranks, **options).ranks
    except ScheduleError as exc:
        raise PipelineError(f"schedule {schedule!r} on {num_ranks} ranks: {exc}") from None


class DualPipe(Pipeline):
    """Drop-in for deepseek-ai/DualPipe: ``modules`` = (the module of stage r, the module of stage P-1-r).

    ``step(*inputs, num_chunks=M, ...)``: M micro-batches in total, M/2 entering at each end. The
    first rank's inputs feed chain 0 and the last rank's chain 1; the loss (stacked per
    micro-batch) comes back on the first and last rank, the first rank's belonging to the last
    rank's inputs and vice versa; labels likewise. A module class with
    ``overlapped_forward_backward`` runs the F&B units itself (deepseek's contract). Call
    ``sync_mirrored_grads()`` after the step: rank r and P-1-r hold copies of the same layers.
    """

    def __init__(self, modules: tuple[nn.Module, nn.Module], batch_dim: int = 0,
                 process_group: dist.ProcessGroup | None = None, rank_mapping: Sequence[int] | None = None,
                 *, timeout: float = 300.0, mesh: ParallelDims | DeviceMesh | None = None,
                 dp_mode: str | None = None, dp_batch: str = "global"):
        if len(modules) != 2:
            raise PipelineError(f"DualPipe takes two modules (stage r, stage P-1-r), got {len(modules)}")
        super().__init__(list(modules), "dualpipe", process_group, rank_mapping=rank_mapping, batch_dim=batch_dim,
                         timeout=timeout, mesh=mesh, dp_mode=dp_mode, dp_batch=dp_batch)

    def sync_mirrored_grads(self) -> None:
        """Sum the gradients of the mirrored stage copies so the optimizer sees the full gradient.

        Not with ``mesh=``: the step's REDUCE_GRAD ops already summed the copies (and averaged the replicas).
        """
        if self.grad_syncs:
            why = "mesh=" if self.mesh is not None else "tied_parameters"
            raise PipelineError(f"{self.rank_name}: this DualPipe was built with {why}, so step() already summed the "
                                "mirrored copies at each stage's REDUCE_GRAD; do not call sync_mirrored_grads()")
        mirror = self.num_ranks - 1 - self.rank
        mine = [p for m in self.module for p in m.parameters()]
        flat = [p.grad if p.grad is not None else torch.zeros_like(p) for p in mine]
        send = torch.cat([g.reshape(-1) for g in flat]) if flat else torch.zeros(0)
        recv = torch.empty_like(send)
        peer = self.p2p.peers_global[mirror]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, self.group),
                                        dist.P2POp(dist.irecv, recv, peer, self.group)])
        for w in works:
            w.wait()
        # the mirror's module 1 is this rank's module 0 and vice versa
        n1 = sum(p.numel() for p in self.module[1].parameters())  # = the mirror's module 0
        theirs = torch.cat([recv[n1:], recv[:n1]])
        offset = 0
        for p, g in zip(mine, flat):
            n = p.numel()
            p.grad = g + theirs[offset: offset + n].view_as(p)
            offset += n


class DualPipeV(Pipeline):
    """Drop-in for DualPipeV: ``modules`` = (the module of stage r, the module of stage 2P-1-r).

    One chain of 2P stages in a V; inputs, labels, loss and outputs live on rank 0.
    ``num_chunks`` is the number of micro-batches (at least 2P).
    """

    def __init__(self, modules: tuple[nn.Module, nn.Module], batch_dim: int = 0,
                 process_group: dist.ProcessGroup | None = None, rank_mapping: Sequence[int] | None = None,
                 *, timeout: float = 300.0, mesh: ParallelDims | DeviceMesh | None = None,
                 dp_mode: str | None = None, dp_batch: str = "global"):
        if len(modules) != 2:
            raise PipelineError(f"DualPipeV takes two modules (stage r, stage 2P-1-r), got {len(modules)}")
        super().__init__(list(modules), "dualpipev", process_group, rank_mapping=rank_mapping, batch_dim=batch_dim,
                         timeout=timeout, mesh=mesh, dp_mode=dp_mode, dp_batch=dp_batch)
