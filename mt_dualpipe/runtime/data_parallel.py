"""Data-parallel replicas of a pipeline: one gradient-sync object per local stage, built from a mesh.

A ``Pipeline`` given ``mesh=`` (``parallel.init_parallel``) runs its schedule on the mesh's ``pp``
group and reduces each stage's gradients over that stage's data-parallel group at the stage's
``REDUCE_GRAD`` op (``schedules.data_parallel``: right after the stage's last W/BW on the rank), so
the collective overlaps the rest of the pipeline's drain. What reduces and how is chosen here, once:

* the groups come from ``ParallelDims.stage_sync_groups``: a stage held by one pipeline rank
  reduces over dp; DualPipe's mirrored copies (the same stage in two chains, on ranks r and P-1-r)
  share one group over copies x dp, so the copies are summed once and the replicas averaged;
* ``dp_mode`` (a key of ``parallel.modes.DP_MODES``, the one list of modes) picks the sync
  object: ``GradSync`` all-reduce (DDP semantics), ``GradSync`` zero1 (reduce-scatter; step with
  ``parallel.ZeroOptimizer``), or ``FSDPStageSync`` for stages the user wrapped with ``fully_shard``
  (unsharded for the step, reduce-scattered after the last W). Every one of them is a
  ``parallel.stage_sync.StageGradSync``: the executor, the optimizer and resilience ask only that.

A stage without a trainable parameter (no parameters at all, say a slicing head, or only frozen
ones) has nothing to reduce, in any mode: it gets no ``GradSync`` (nor needs ``fully_shard``), and
its ``REDUCE_GRAD`` runs an empty ``StageSync``; it runs as a pass-through of the gradient syncs,
so a mesh never refuses what the same pipeline without one runs. Refusing it instead would need
the model's facts (how many layers could fill the stages), which the runtime does not have: a
model's stage builder or launcher says that (``examples/deepseek_v3_repro.py`` refuses a stage
its layer count leaves empty, naming the deepest pipeline it fills).

Why not ``DistributedDataParallel``: its reducer is driven by autograd hooks, which a deferred W
(gradients written after B, outside that backward) does not go through in DDP's order, and it
reduces once per backward, i.e. per micro-batch and before W — wrong gradients, no error. Such
stages are refused with a message pointing here.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..parallel.device import collective_device
from ..parallel.mesh import ParallelDims, SyncGroup
from ..parallel.stage_sync import DP_MODES, StageGradSync, stage_params
from ..parallel.weight_kinds import KINDS, weight_kind
from .errors import PipelineError

if TYPE_CHECKING:  # the sync classes load DTensor and FSDP (~1 s a process): built only with a mesh or ties
    from ..parallel.grad_sync import GradSync, TiedSync

__all__ = ["DP_BATCH", "DP_MODES", "PipelineGroups", "Reductions", "Tie", "build_reductions", "check_mesh",
           "declared_ties", "find_ties", "needs_reductions", "rank_label", "refuse_wrapped", "replica_slice",
           "stage_holders"]

DP_BATCH = ("global", "local")


def rank_label(pp_rank: int, global_rank: int) -> str:
    """How errors name a rank: its pipeline rank, and its global rank when that differs."""
    if pp_rank == global_rank:
        return f"rank {pp_rank}"
    return f"pipeline rank {pp_rank} (global rank {global_rank})"


def refuse_wrapped(modules: Sequence[nn.Module], dp_mode: str | None, label: str) -> None:
    """DDP-wrapped stages (silently wrong under a split backward) and FSDP stages without ``dp_mode='fsdp'``."""
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP loads ~0.8 s; only a Pipeline needs it

    for i, m in enumerate(modules):
        if isinstance(m, DistributedDataParallel):
            raise PipelineError(
                f"{label}: stage module {i} is wrapped in DistributedDataParallel, whose reducer runs from autograd "
                "hooks once per backward (per micro-batch, before the deferred W): the pipeline's gradients would be "
                "wrong. Pass the bare module (ddp.module) and give the Pipeline mesh=init_parallel(pp=..., dp=...) "
                "with dp_mode='allreduce' (or 'zero1' / 'fsdp'): the schedule then reduces each stage's gradients "
                "after its last W")
        if isinstance(m, FSDPModule) and not (dp_mode is not None and DP_MODES[dp_mode].needs_fully_shard):
            raise PipelineError(
                f"{label}: stage module {i} ({type(m).__name__}) is wrapped with fully_shard, which needs "
                f"dp_mode='fsdp' (got dp_mode={dp_mode!r}) and mesh=: FSDP's own hooks reshard after B, before W "
                "runs; the pipeline keeps the stage unsharded for the step and reduce-scatters after its last W")


def check_mesh(mesh: ParallelDims, num_pp_ranks: int | None = None) -> None:
    """A ``ParallelDims`` whose sizes agree with its device mesh and that this runtime supports."""
    sizes = (mesh.pp, mesh.dp, mesh.ep, mesh.tp)
    total = mesh.mesh.size()
    if total != mesh.pp * mesh.dp * mesh.ep * mesh.tp:
        raise PipelineError(f"the mesh has {total} ranks but pp*dp*ep*tp = {mesh.pp}*{mesh.dp}*{mesh.ep}*{mesh.tp} "
                            f"= {mesh.pp * mesh.dp * mesh.ep * mesh.tp}; build it with init_parallel")
    if tuple(mesh.mesh.shape) != sizes:
        raise PipelineError(f"the mesh's shape {tuple(mesh.mesh.shape)} is not (pp, dp, ep, tp) = {sizes}")
    if mesh.tp != 1 and mesh.ep != 1:  # tensor parallel: parallel/tensor_parallel.py
        raise PipelineError(f"Pipeline(mesh=) with tp={mesh.tp} supports ep=1 only, got ep={mesh.ep}: tensor-parallel "
                            "expert layers are not built (docs/architecture.md, 'Tensor parallel')")


def stage_holders(placement: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Per stage index, the pipeline ranks holding a copy of it: stage s of every chain is the same layers."""
    n = max(len(chain) for chain in placement)
    return [tuple(sorted({chain[s] for chain in placement if s < len(chain)})) for s in range(n)]


def _check_supported(module: nn.Module, dp_mode: str, where: str) -> None:
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP and DTensor load ~0.8 s; only with a mesh
    from torch.distributed.tensor import DTensor

    if not any(p.requires_grad for p in module.parameters()):
        return  # nothing to reduce in any mode (a parameterless or frozen stage): no sync, no fully_shard needed
    tp = [n for n, p in module.named_parameters() if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names
                                                                                       or ())]
    mode = DP_MODES[dp_mode]
    if tp and not mode.tensor_parallel:  # each tp rank all-reduces its local shard (parallel/tensor_parallel.py)
        able = [m.name for m in DP_MODES.values() if m.tensor_parallel]
        raise PipelineError(f"{where}: tensor-parallel (DTensor) parameters such as {tp[:2]} reduce over dp with "
                            f"{' or '.join(f'dp_mode={m!r}' for m in able)} only, got dp_mode={dp_mode!r}")
    if mode.needs_fully_shard:
        if not isinstance(module, FSDPModule):
            raise PipelineError(f"{where}: dp_mode='fsdp' needs stage modules wrapped with fully_shard(module, "
                                f"mesh=dims.submesh('dp')); got a plain {type(module).__name__}")
        return
    sharded = [n for n, p in module.named_parameters()  # tensor-parallel shards (a tp-only mesh) are allowed
               if isinstance(p, DTensor) and tuple(p.device_mesh.mesh_dim_names or ()) != ("tp",)]
    if sharded:
        raise PipelineError(f"{where}: dp_mode={dp_mode!r} reduces plain tensors but the module has DTensor "
                            f"parameters {sharded[:3]}; use dp_mode='fsdp' for fully_shard modules")


def replica_slice(values: Sequence[Any], replica: int, replicas: int, dim: int, what: str,
                  label: str | None = None) -> tuple:
    """This replica's contiguous share of every tensor of a global batch (None stays None).

    ``label`` names the replicas in the error (default ``dp=<replicas>``; ``dp*ep = 2*2 = 4`` with experts).
    """
    label = label or f"dp={replicas}"
    out = []
    for v in values:
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        if v.dim() <= dim or v.shape[dim] % replicas:
            size = "no such dim" if v.dim() <= dim else f"{v.shape[dim]} rows"
            raise PipelineError(f"{what} of shape {tuple(v.shape)}: a global batch of {size} along batch_dim={dim} "
                                f"does not split over the {label} data-parallel replicas; use a batch size "
                                f"divisible by {replicas} (or dp_batch='local' and pass each replica's own batch)")
        n = v.shape[dim] // replicas
        out.append(v.narrow(dim, replica * n, n))
    return tuple(out)


# ----- weights tied across stages -------------------------------------------------------------------
@dataclass(frozen=True)
class Tie:
    """Tied weights held by the same pipeline ranks: each named by its tie key (a stage's ``tied_parameters``:
    the parameter's FQN in its stage module, or the key a mapping gives it)."""

    names: tuple[str, ...]
    holders: tuple[int, ...]                  # pp ranks holding a copy
    stages: tuple[tuple[int, int], ...]       # every (chain, stage) holding a copy, pipeline-wide


def declared_ties(module: nn.Module) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """A stage module's ``tied_parameters`` as (FQN within the module, tie key) pairs, and a problem (or None).

    ``tied_parameters`` is a tuple of parameter FQNs (a copy is tied to every other stage's parameter of the same
    FQN) or a mapping {FQN: key} (tied to every other stage's parameter declared under the same key, whatever its
    name there: what ``split_model`` declares for a weight two stages share by identity)."""
    declared = getattr(module, "tied_parameters", ())
    kind = type(module).__name__
    if isinstance(declared, dict) and all(isinstance(f, str) and isinstance(k, str) for f, k in declared.items()):
        pairs = tuple(declared.items())
    elif isinstance(declared, (tuple, list)) and all(isinstance(n, str) for n in declared):
        pairs = tuple((n, n) for n in declared)
    else:
        return (), (f"tied_parameters of {kind} must be a tuple of parameter names (FQNs within the stage module) or a "
                    f"mapping of such names to tie keys, got {declared!r}")
    own = dict(module.named_parameters())
    return pairs, next((f"tied parameter {f!r} is marked 'expert' in {kind}: expert weights are sharded over ep, only "
                        "dense weights can be tied" for f, _ in pairs if f in own and weight_kind(own[f]) != "dense"),
                       None)


def _held(module: nn.Module, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str, nn.Parameter]]:
    """The declared (FQN, key) pairs this stage holds, with the parameter. A stage may declare a name it does not
    hold (one declaration on a model's stage class, a middle stage without the embedding); a key that no stage holds
    is refused in ``_group_ties``."""
    own = dict(module.named_parameters())
    return [(fqn, key, own[fqn]) for fqn, key in pairs if fqn in own]


def _gathered(payload: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``payload`` (picklable), by two plain ``all_gather``s (sizes, then bytes), on the
    group's collective device (cpu on gloo, the current GPU on NCCL: ``device.collective_device``).

    Not ``dist.all_gather_object``: on gloo with torch 2.13 a process that called it aborted at exit
    now and then ("terminate called without an active exception", about one run in four of
    examples/llama_fp8.py); these two tensor collectives do the same exchange without that.
    """
    device = collective_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(t.item()) for t in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    got = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(got, padded.to(device), group=group)
    return [pickle.loads(t[:k].cpu().numpy().tobytes()) for t, k in zip(got, lengths)]


def find_ties(modules: Sequence[nn.Module], local: Sequence[tuple[int, int]], group: dist.ProcessGroup,
              pp_rank: int, label: str) -> tuple[list[Tie], int]:
    """The pipeline's ties and its number of expert-kind parameters (collective over the pp ``group``).

    Every rank sends its stages' ``tied_parameters``; a key any stage declares ties every parameter
    declared under that key in any stage. A key held by one stage index only (its mirrored DualPipe copies
    aside) ties nothing and is refused: a declaration that ties nothing is a mistake, never a no-op. Problems
    found on one rank are raised on every rank, so no rank waits for a collective in vain.
    """
    mine = [(c, s, *declared_ties(m)) for (c, s), m in zip(local, modules)]
    experts = sum(1 for m in modules for p in m.parameters() if weight_kind(p) == "expert")
    first = _gathered((pp_rank, label, mine, experts), group)
    problems = [f"{lab}, stage (chain {c}, stage {s}): {err}" for _, lab, stages, _ in first
                for c, s, _, err in stages if err]
    if problems:
        raise PipelineError(problems[0])
    keys = sorted({k for _, _, stages, _ in first for _, _, pairs, _ in stages for _, k in pairs})
    total_experts = sum(e for *_, e in first)
    if not keys:
        return [], total_experts
    held = [(c, s, key, fqn, tuple(p.shape), str(p.dtype), p.requires_grad)
            for (c, s), module, (_, _, pairs, _) in zip(local, modules, mine) for fqn, key, p in _held(module, pairs)]
    copies = [(r, lab, *h) for r, lab, hs in _gathered((pp_rank, label, held), group) for h in hs]
    return _group_ties(keys, copies), total_experts


def _group_ties(keys: list[str], copies: list[tuple]) -> list[Tie]:
    """One ``Tie`` per set of holding pp ranks (checked: one shape and dtype per key, all trainable, on two
    stages at least). A copy is (pp rank, label, chain, stage, key, fqn, shape, dtype, requires_grad)."""
    by_holders: dict[tuple[int, ...], list[tuple[str, list[tuple]]]] = {}
    for key in keys:
        mine = [cp for cp in copies if cp[4] == key]
        if not mine:
            raise PipelineError(f"tied_parameters names {key!r}, which no stage module holds; a tuple names parameters "
                                "by their FQN within the stage module (as in module.named_parameters()), a "
                                "{FQN: key} mapping ties them under key")
        kinds = {(cp[6], cp[7]) for cp in mine}
        if len(kinds) > 1:
            where = "; ".join(f"{cp[1]}, stage (chain {cp[2]}, stage {cp[3]}) {cp[5]!r}: shape {cp[6]}, {cp[7]}"
                              for cp in mine)
            raise PipelineError(f"tied parameter {key!r} differs between its copies ({where}); tied copies must "
                                "have one shape and dtype")
        frozen = [cp for cp in mine if not cp[8]]
        if frozen:
            raise PipelineError(f"tied parameter {key!r} does not require grad in {frozen[0][1]}, stage (chain "
                                f"{frozen[0][2]}, stage {frozen[0][3]}); freeze every copy or none")
        if len({cp[3] for cp in mine}) < 2:
            cp = mine[0]
            raise PipelineError(f"tied parameter {key!r} is declared by stage {cp[3]} only ({cp[1]}, {cp[5]!r}); a tie "
                                "needs a copy on another stage declared under the same key (the same FQN, or the "
                                "same key of a {FQN: key} mapping): declare it there too, or drop the declaration")
        holders = tuple(sorted({cp[0] for cp in mine}))
        by_holders.setdefault(holders, []).append((key, mine))
    ties = []
    for holders, entries in sorted(by_holders.items()):
        stages = tuple(sorted({(cp[2], cp[3]) for _, mine in entries for cp in mine}))
        ties.append(Tie(tuple(k for k, _ in entries), holders, stages))
    return ties


class PipelineGroups:
    """``ParallelDims.stage_sync_groups`` for a pipeline without a mesh: copies summed, nothing averaged.

    A stage (or tie) held by several pipeline ranks gets a group over them (``dist.new_group``:
    every rank of the world calls it, so the pipeline group must be the whole world); one held
    by this rank alone needs no group (its local copies are summed in place).
    """

    def __init__(self, pp_rank: int, peers_global: Sequence[int]):
        self.pp_rank = pp_rank
        self.peers = list(peers_global)

    def stage_sync_groups(self, holders: Sequence[Sequence[int]], kind: str = "dense") -> dict[int, SyncGroup]:
        out = {}
        for i, pps in enumerate(holders):
            if len(pps) < 2:
                continue
            ranks = tuple(sorted(self.peers[p] for p in pps))
            group = dist.new_group(list(ranks))
            if self.pp_rank in pps:
                out[i] = SyncGroup(group, ranks, 1)
        return out


# ----- what each local stage reduces ----------------------------------------------------------------
@dataclass
class Reductions:
    """The sync object of each local stage (at its REDUCE_GRAD), and what an optimizer steps.

    ``params``: every trainable parameter of this rank's stages once — tied weights by their
    representative copy, named ``tied.<name>`` — as ``(name, parameter, sync)``, ``sync`` being
    the ``GradSync`` that reduces it (None: nothing to reduce, or FSDP). Stage parameters are
    named ``stage<s>.<fqn>`` (stage indices are unique across the pipeline; DualPipe's mirrored
    copies share theirs, as they are one weight).
    """

    syncs: dict[tuple[int, int], StageGradSync] = field(default_factory=dict)
    params: list[tuple[str, nn.Parameter, GradSync | None]] = field(default_factory=list)
    ties: list[TiedSync] = field(default_factory=list)


Groups = ParallelDims | PipelineGroups
"""Where a stage's sync groups come from: the mesh, or the pipeline's own ranks without one."""


def _needs_sync(g: SyncGroup | None) -> TypeGuard[SyncGroup]:
    """A group that sums over other ranks or divides (expert weights at dp=1, ep>1 still divide by ep)."""
    return g is not None and (len(g.ranks) > 1 or g.divide_by > 1)


def _kind_groups(groups: Groups, holders: list[tuple[int, ...]], mesh: ParallelDims | None
                 ) -> dict[str, dict[int, SyncGroup]]:
    """Per weight kind, the stage groups (collective; the expert groups only where ep > 1)."""
    dense = groups.stage_sync_groups(holders, "dense")
    expert = groups.stage_sync_groups(holders, "expert") if mesh is not None and mesh.ep > 1 else dense
    return {"dense": dense, "expert": expert}


def _tie_syncs(ties: list[Tie], groups: Groups, local: Sequence[tuple[int, int]], modules: Sequence[nn.Module],
               dp_mode: str, bucket_bytes: int) -> list[TiedSync]:
    """One ``TiedSync`` per tie this rank holds a copy of (collective: the groups of every tie are built)."""
    from ..parallel.grad_sync import TiedSync  # lazy: DTensor (~1 s a process), only where ties exist

    tie_groups = groups.stage_sync_groups([t.holders for t in ties], "dense") if ties else {}
    out = []
    for i, tie in enumerate(ties):
        held = []
        for (c, s), m in zip(local, modules):
            if (c, s) in tie.stages:
                held.append(((c, s), {key: p for _, key, p in _held(m, declared_ties(m)[0])}))
        if not held:
            continue
        g = tie_groups.get(i)
        copies = [[params[n] for _, params in held if n in params] for n in tie.names]
        if _needs_sync(g):
            sync = TiedSync(copies, [cs for cs, _ in held], g.group, names=tie.names, bucket_bytes=bucket_bytes,
                            mode=dp_mode, divide_by=g.divide_by)
        else:  # every copy on this rank and no replica: the local sum only
            sync = TiedSync(copies, [cs for cs, _ in held], None, names=tie.names, bucket_bytes=bucket_bytes)
        out.append(sync)
    return out


def build_reductions(mesh: ParallelDims | None, groups: Groups, placement: Sequence[Sequence[int]],
                     local: Sequence[tuple[int, int]], modules: Sequence[nn.Module], dp_mode: str,
                     bucket_bytes: int, label: str, ties: list[Tie]) -> Reductions:
    """The sync objects of this rank's stages (collective over the world: groups are created).

    Per local stage: one ``GradSync`` per weight kind present (dense over copies x dp x ep,
    expert over copies x dp, both dividing by dp x ep; one kind when ep = 1) — the stage's sync is
    that ``GradSync`` itself when it is the only one, else a ``StageSync`` of the parts and the
    ties the stage holds copies of. ``groups``: the mesh, or ``PipelineGroups`` without one.
    """
    from ..parallel.fsdp import FSDPStageSync  # lazy: FSDP and DTensor (~1 s a process), only with a mesh or ties
    from ..parallel.grad_sync import GradSync, StageSync  # lazy: as above

    by_kind = _kind_groups(groups, stage_holders(placement), mesh)
    tied = _tie_syncs(ties, groups, local, modules, dp_mode, bucket_bytes)
    out = Reductions(ties=tied)
    tied_ids = {id(p) for t in tied for c in t.copies for p in c}
    seen: set[int] = set()
    # by stage index: every rank lists the groups it shares with another in the same order (the
    # optimizer's ZeRO-1 gathers; NCCL wants one order across communicators)
    for (c, s), module in sorted(zip(local, modules), key=lambda item: item[0][1]):
        where = f"{label}, stage (chain {c}, stage {s})"
        if mesh is not None:
            _check_supported(module, dp_mode, where)
        names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in stage_params(module) if id(p) not in tied_ids and id(p) not in seen]
        seen.update(id(p) for p in params)
        ties_here = [t for t in tied if (c, s) in t.stages]
        if DP_MODES[dp_mode].needs_fully_shard:
            if not any(p.requires_grad for p in module.parameters()):
                continue  # nothing to reduce-scatter: the empty StageSync below stands at its REDUCE_GRAD
            g = by_kind["dense"][s]  # a mesh gives every stage its dp group
            out.syncs[(c, s)] = FSDPStageSync(module, bucket_bytes=bucket_bytes, divide_by=g.divide_by, group=g.group,
                                              key=("stage", s, "fsdp"))
            out.params += [(f"stage{s}.{names[id(p)]}", p, None) for p in params]
            continue
        parts = []
        one_kind = by_kind["expert"] is by_kind["dense"]
        split = {"dense": params} if one_kind else {k: [p for p in params if weight_kind(p) == k] for k in KINDS}
        for kind, mine in split.items():
            kind_group = by_kind[kind].get(s)
            sync = (GradSync(mine, kind_group.group, mode=dp_mode, bucket_bytes=bucket_bytes,
                             divide_by=kind_group.divide_by, key=("stage", s, kind))
                    if mine and _needs_sync(kind_group) else None)
            parts += [sync] if sync is not None else []
            out.params += [(f"stage{s}.{names[id(p)]}", p, sync) for p in mine]
        if len(parts) == 1 and not ties_here:
            out.syncs[(c, s)] = parts[0]
        elif parts or ties_here:
            out.syncs[(c, s)] = StageSync((c, s), parts, ties_here, mode=dp_mode)
    for t in tied:
        out.params += [(f"tied.{n}", rep, t.sync) for n, rep in zip(t.names, t.reps)]
    if out.syncs:  # every local stage has a REDUCE_GRAD once the program has them
        for cs in local:
            out.syncs.setdefault(cs, StageSync(cs, mode=dp_mode))
    return out


def needs_reductions(mesh: ParallelDims | None, dp_mode: str | None, ties: list[Tie], experts: int,
                     group: dist.ProcessGroup) -> bool:
    """Whether the pipeline reduces anything at REDUCE_GRAD (a mesh, or ties); refuses what it cannot reduce.

    The facts checked are the same on every rank (``find_ties`` gathered them), so every rank
    raises together.
    """
    tied = ", ".join(n for t in ties for n in t.names)
    if mesh is None:
        if ties and dist.get_world_size(group) != dist.get_world_size():
            raise PipelineError(f"tied parameters ({tied}) without mesh= need the pipeline group to span the whole "
                                f"world ({dist.get_world_size(group)} of {dist.get_world_size()} ranks here): their "
                                "groups are built over the world; pass mesh=init_parallel(pp=..., dp=...)")
        return bool(ties)
    if mesh.ep > 1 and experts == 0:
        raise PipelineError(f"the mesh has ep={mesh.ep} but no parameter of the pipeline's stages is marked 'expert': "
                            "mark the routed experts (sharded over dims.group('ep')) with "
                            "mt_dualpipe.parallel.set_weight_kind(experts, 'expert'), or use dp=... instead of ep for "
                            "a dense model (expert gradients must not be averaged with other ranks' experts)")
    mode = DP_MODES[dp_mode or "allreduce"]
    if ties and not mode.tied_weights:
        raise PipelineError(f"dp_mode={mode.name!r} cannot reduce tied parameters ({tied}): it shards each stage's "
                            f"copy on its own; use dp_mode {_able('tied_weights')}")
    if mesh.ep > 1 and not mode.expert_parallel:
        raise PipelineError(f"dp_mode={mode.name!r} with ep={mesh.ep} is not supported: fully_shard over dp would "
                            "average the dense weights over dp only, not dp x ep; use dp_mode "
                            f"{_able('expert_parallel')} (DeepSeek-V3 used zero1)")
    return True


def _able(flag: str) -> str:
    """The modes whose ``DataParallelMode.<flag>`` is set, for an error message: "'allreduce' or 'zero1'"."""
    return " or ".join(repr(m.name) for m in DP_MODES.values() if getattr(m, flag))
