"""What an op *means*: its kind, what it waits for, what it makes, what it costs, what it holds.

This is the one place that knows the pipeline's dependency rule. Every pass (validation,
lowering, simulation, the ``auto`` search), the runtime's executor and the diagrams ask it
instead of re-deriving the rule:

* ``F(c, s, m)`` needs the activation of ``F(c, s-1, m)`` (none on the first stage);
* ``B(c, s, m)`` and ``BW(c, s, m)`` need the activation of their own ``F(c, s, m)`` and the
  input-gradient of ``B(c, s+1, m)`` (none on the last stage: the loss is local);
* ``W(c, s, m)`` needs its own ``B(c, s, m)``;
* an ``FB`` unit runs an F and a B/BW of other micro-batches together and needs both parts' inputs.

What ops exchange are *signals*: ``ACT`` (an F's output activation) and ``GRAD`` (a B's or BW's
input-gradient). A signal crossing ranks is exactly one transfer of the lowered program
(``SEND_F``/``RECV_F`` for ``ACT``, ``SEND_B``/``RECV_B`` for ``GRAD``).

Activation memory (the rule the simulator counts and the runtime records): an F holds one unit of
activations from its start until its stage's W (or BW) of the same micro-batch ends.

Flat numbering, shared by every pass that keeps arrays instead of dictionaries: the op
``(c, s, m)`` is ``u = (c * S + s) * M + m`` and its signals are ``2u`` (ACT) and ``2u + 1`` (GRAD).

Adding an op kind means adding a member to ``OpKind`` and a ``KindRule`` to ``RULES`` (what it
needs, what it makes, its activation effect and its cost); see docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from .costs import StageCosts
    from .ir import ComputeItem, Op


class OpKind(str, Enum):
    """Every op kind of schedules and programs. Members compare equal to their plain strings."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    COMM = "COMM"
    REDUCE_GRAD = "REDUCE_GRAD"

    __hash__ = str.__hash__  # C-level hash, equal to the plain string's: keys mix freely, lookups stay fast

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


F, B, W, BW, FB = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.FB
SEND_F, RECV_F, SEND_B, RECV_B = OpKind.SEND_F, OpKind.RECV_F, OpKind.SEND_B, OpKind.RECV_B
REDUCE_GRAD = OpKind.REDUCE_GRAD

COMPUTE_KINDS: tuple[OpKind, ...] = (F, B, W, BW)
"""Kinds of a plain compute ``Op`` (an ``FB`` pairs two of them)."""
STAGE_KINDS: tuple[OpKind, ...] = (REDUCE_GRAD,)
"""Kinds that act once per (chain, stage) and step, not per micro-batch (their ``mb`` is 0)."""
WEIGHT_GRAD_KINDS: tuple[OpKind, ...] = (W, BW)
"""Kinds after which a micro-batch's weight gradient is accumulated."""
BACKWARD_KINDS: tuple[OpKind, ...] = (B, BW)
"""Kinds that produce an input-gradient (B alone, or B and W fused)."""
COMM_KINDS: tuple[OpKind, ...] = (SEND_F, RECV_F, SEND_B, RECV_B)


class Signal(str, Enum):
    """What one op hands to another: F's output activation or B's input-gradient."""

    ACT = "F"
    GRAD = "B"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


ACT, GRAD = Signal.ACT, Signal.GRAD


class Need(NamedTuple):
    """One input of an op: ``signal`` of ``(chain, stage, mb)``, made on ``rank``."""

    signal: Signal
    chain: int
    stage: int
    mb: int
    rank: int

    def __str__(self) -> str:
        return f"{self.signal.value}(c{self.chain},s{self.stage},m{self.mb})"


@dataclass(frozen=True)
class KindRule:
    """The meaning of one compute kind.

    ``needs``: the signals it waits for, as (signal, stage offset) — an offset that leaves the
    chain means "available at once" (the batch's input, the local loss). ``makes``: the signal it
    produces, or None. ``holds``/``frees``: activation units added when it starts / released when
    it ends. ``cost``: its time under ``StageCosts`` for its stage, exposed all-to-all included.
    ``sends_to``: the stage offset its signal travels to (+1 downstream, -1 upstream).
    ``stream``: "compute" (occupies the rank) or "collective" (posted without blocking the rank,
    run on its communication stream in post order, complete once every chain's copy of the stage
    has posted — a data-parallel gradient reduction over the stage's replicas).
    ``w_part``: the weight-gradient share of ``cost`` (what ``Costs.mb_scale_w`` scales; the rest
    scales with ``Costs.mb_scale``); ``scaled``: False for a kind whose time is per stage and step,
    not per micro-batch.
    """

    kind: OpKind
    needs: tuple[tuple[Signal, int], ...]
    makes: Signal | None
    holds: int
    frees: int
    cost: Callable[[StageCosts, int], float]
    sends_to: int = 0
    stream: str = "compute"
    w_part: Callable[[StageCosts, int], float] = lambda c, s: 0.0
    scaled: bool = True

    def scaled_cost(self, costs: StageCosts, stage: int, scale: float = 1.0, scale_w: float = 1.0) -> float:
        """``cost`` of one micro-batch whose factors are ``scale`` (F/B work) and ``scale_w`` (W work)."""
        total = self.cost(costs, stage)
        if not self.scaled or scale == scale_w == 1.0:
            return total
        w = self.w_part(costs, stage)
        return (total - w) * scale + w * scale_w


RULES: dict[str, KindRule] = {
    F: KindRule(F, ((ACT, -1),), ACT, 1, 0, lambda c, s: c.f[s] + c.a2a_f[s], sends_to=+1),
    B: KindRule(B, ((ACT, 0), (GRAD, +1)), GRAD, 0, 0, lambda c, s: c.b[s] + c.a2a_b[s] + c.recompute[s],
                sends_to=-1),
    W: KindRule(W, ((GRAD, 0),), None, 0, 1, lambda c, s: c.w[s], w_part=lambda c, s: c.w[s]),
    BW: KindRule(BW, ((ACT, 0), (GRAD, +1)), GRAD, 0, 1,
                 lambda c, s: c.b[s] + c.w[s] + c.a2a_b[s] + c.recompute[s], sends_to=-1,
                 w_part=lambda c, s: c.w[s]),
    # one per (chain, stage) and step, placed after the stage's last W/BW on its rank (program
    # order is its only local input); see data_parallel.add_grad_reduction
    REDUCE_GRAD: KindRule(REDUCE_GRAD, (), None, 0, 0, lambda c, s: c.dp_sync[s], stream="collective",
                          scaled=False),
}
"""One entry per compute kind; keyed by the plain string so that ``RULES[op.kind]`` is one dict hit."""

SEND_RECV: dict[Signal, tuple[OpKind, OpKind]] = {ACT: (SEND_F, RECV_F), GRAD: (SEND_B, RECV_B)}
"""The comm kinds that carry a signal across ranks: (sender's kind, receiver's kind)."""

SIGNAL_OF_COMM: dict[str, Signal] = {SEND_F: ACT, RECV_F: ACT, SEND_B: GRAD, RECV_B: GRAD}

SENDS_TO: dict[Signal, int] = {r.makes: r.sends_to for r in RULES.values() if r.makes is not None}
"""Where each signal travels: ACT to the next stage (+1), GRAD to the previous one (-1)."""


class CommShape(NamedTuple):
    """How a comm op ``(kind, peer, c, s, m)`` relates to the signal it carries.

    The signal is that of stage ``s + producer`` (``producer`` is 0 for a send, -sends_to for a
    receive); the peer runs stage ``s + peer_offset``; ``bit`` is the signal's key bit.
    """

    signal: Signal
    producer: int
    peer_offset: int
    bit: int
    is_send: bool


def comm_shape(kind: str) -> CommShape | None:
    """The shape of a comm kind, or None for anything that is not a comm kind."""
    sig = SIGNAL_OF_COMM.get(kind)
    if sig is None:
        return None
    d = SENDS_TO[sig]
    is_send = kind == SEND_RECV[sig][0]
    return CommShape(sig, 0 if is_send else -d, d if is_send else -d, int(sig is GRAD), is_send)


COMM_SHAPES: dict[str, CommShape] = {k: comm_shape(k) for k in COMM_KINDS}

COMPLETE_SETS: tuple[frozenset[str], ...] = (frozenset((F, BW)), frozenset((F, B, W)))
"""The kinds one (chain, stage, micro-batch) runs in a complete schedule: F and BW, or F, B and W."""


def rule(kind: str) -> KindRule:
    """The rule of a compute kind; ``ValueError`` naming the allowed kinds for anything else."""
    r = RULES.get(kind)
    if r is None:
        raise ValueError(f"unknown op kind {kind!r}; allowed F, B, W, BW (and FB pairs)")
    return r


def parts(item: ComputeItem) -> tuple[Op, ...]:
    """The plain ops of a compute item: itself, or the two halves of an FB unit."""
    return (item.f, item.b) if item.kind == "FB" else (item,)


def needs(op: Op, num_stages: int) -> tuple[tuple[Signal, int, int, int], ...]:
    """The signals ``op`` waits for, as (signal, chain, stage, mb), in a fixed order."""
    _, c, s, m = op
    out = []
    for sig, ds in rule(op.kind).needs:
        t = s + ds
        if 0 <= t < num_stages:
            out.append((sig, c, t, m))
    return tuple(out)


def producers(op: Op, placement: Sequence[Sequence[int]]) -> tuple[Need, ...]:
    """What ``op`` waits for, each with the rank that makes it."""
    chain = placement[op.chain]
    return tuple(Need(sig, c, s, m, chain[s]) for sig, c, s, m in needs(op, len(chain)))


def item_producers(item: ComputeItem, placement: Sequence[Sequence[int]]) -> tuple[Need, ...]:
    """What a compute item (an op or an FB unit) waits for."""
    return tuple(n for op in parts(item) for n in producers(op, placement))


def makes(op: Op) -> tuple[Signal, int, int, int] | None:
    """The signal ``op`` produces, as (signal, chain, stage, mb), or None (a W makes nothing others need)."""
    sig = rule(op.kind).makes
    return None if sig is None else (sig, op.chain, op.stage, op.mb)


def destination(op: Op, placement: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """Where ``op``'s signal goes: (consumer stage, its rank), or None when it stays in the chain's ends."""
    r = rule(op.kind)
    if not r.sends_to:
        return None
    chain = placement[op.chain]
    t = op.stage + r.sends_to
    if not 0 <= t < len(chain):
        return None
    return t, chain[t]


def signal_key(sig: Signal, chain: int, stage: int, mb: int, num_stages: int, num_microbatches: int) -> int:
    """The flat index of a signal: ``2u`` for ACT, ``2u + 1`` for GRAD."""
    u = (chain * num_stages + stage) * num_microbatches + mb
    return 2 * u + (sig is GRAD or sig == "B")


def signal_name(key: int, num_stages: int, num_microbatches: int) -> str:
    """The op that makes signal ``key``: ``F(c..,s..,m..)`` for an activation, ``B(...)`` for a gradient."""
    u, bit = divmod(key, 2)
    cs, m = divmod(u, num_microbatches)
    c, s = divmod(cs, num_stages)
    return f"{'B' if bit else 'F'}(c{c},s{s},m{m})"


def op_cost(item: ComputeItem, costs: StageCosts,
            scales: tuple[Sequence[float], Sequence[float]] | None = None) -> float:
    """Time of an op or an FB unit (an FB hides the all-to-all; ``costs.fb`` if given).

    ``scales``: per micro-batch slot, the (F/B, W) factors (``StageCosts.slot_scales``); None: all 1.
    """
    if item.kind == "FB":
        f, b = item.f, item.b
        if scales is None:
            return costs.fb_cost(f.stage, b.kind, b.stage)
        k, kw = scales
        return costs.fb_cost(f.stage, b.kind, b.stage, k[f.mb], k[b.mb], kw[b.mb])
    if scales is None:
        return rule(item.kind).cost(costs, item.stage)
    return rule(item.kind).scaled_cost(costs, item.stage, scales[0][item.mb], scales[1][item.mb])


def activation_effect(item: ComputeItem) -> tuple[int, int]:
    """(units held from the item's start, units released at its end)."""
    held = freed = 0
    for op in parts(item):
        r = rule(op.kind)
        held += r.holds
        freed += r.frees
    return held, freed


COLLECTIVE = -2
"""``OpTable.walk_table``'s ``made`` for a collective op: posted without blocking the rank."""


class OpTable:
    """The dependency rule compiled for one placement: flat signal keys, producing ranks, costs.

    Building it costs one pass over the placement; ``compile`` then resolves an item in a few dict
    hits. Passes that walk hundreds of thousands of ops (simulate, validate, lower) use it so that
    the rule stays in this module and their loops stay branch-free on the op kind.
    """

    def __init__(self, placement: Sequence[Sequence[int]], num_microbatches: int,
                 costs: StageCosts | None = None) -> None:
        self.placement = placement
        self.S = len(placement[0])
        self.M = num_microbatches
        self.rank_of = [r for chain in placement for r in chain]  # by c * S + s
        self.costs = costs
        S = self.S
        # per kind: the (signal bit, stage offset) of each need, the signal bit it makes
        self._needs = {k: tuple((int(sig is GRAD), ds) for sig, ds in r.needs) for k, r in RULES.items()}
        self._makes = {k: (-1 if r.makes is None else int(r.makes is GRAD)) for k, r in RULES.items()}
        self._cost = {}
        if costs is not None:
            for k, r in RULES.items():
                self._cost[k] = [r.cost(costs, s) for s in range(S)]
        self._templates: dict[str, list[tuple]] | None = None

    def waits(self, op: Op) -> list[tuple[int, int, int]]:
        """(signal key, producing rank, producing stage) for each input of a plain op."""
        kind, c, s, m = op
        S, M = self.S, self.M
        out = []
        for bit, ds in self._needs[kind]:
            t = s + ds
            if 0 <= t < S:
                cs = c * S + t
                out.append((2 * (cs * M + m) + bit, self.rank_of[cs], t))
        return out

    def made(self, op: Op) -> int:
        """The signal key a plain op makes, or -1."""
        kind, c, s, m = op
        bit = self._makes[kind]
        return -1 if bit < 0 else 2 * ((c * self.S + s) * self.M + m) + bit

    def cost(self, op: Op) -> float:
        return self._cost[op.kind][op.stage]

    def templates(self) -> dict[str, list[tuple]]:
        """Per kind, per ``c * S + s``: (waits, makes, cost, holds, frees) with keys for micro-batch 0.

        A plain op ``(kind, c, s, m)`` waits for ``key + 2 * m`` of each ``(key, rank, stage)`` in
        ``waits`` and makes ``key + 2 * m`` of each key in ``makes``: the hot loops of the passes
        add the offset instead of resolving every op. Built once per table (callers only read it).
        """
        if self._templates is not None:
            return self._templates
        S, M = self.S, self.M
        out: dict[str, list[tuple]] = {}
        for kind, r in RULES.items():
            per = []
            for cs in range(len(self.rank_of)):
                c, s = divmod(cs, S)
                waits = []
                for bit, ds in self._needs[kind]:
                    t = s + ds
                    if 0 <= t < S:
                        waits.append((2 * (c * S + t) * M + bit, self.rank_of[c * S + t], t))
                bit = self._makes[kind]
                made = () if bit < 0 else (2 * cs * M + bit,)
                cost = self._cost[kind][s] if self.costs is not None else 0.0
                per.append((tuple(waits), made, cost, r.holds, r.frees))
            out[kind] = per
        self._templates = out
        return out

    def walk_table(self, latency: Sequence[float],
                   scales: tuple[Sequence[float], Sequence[float]] | None = None) -> dict[str, list[tuple]]:
        """``templates`` shaped for an event walk: per kind, per ``c * S + s``,
        (waits, made, costs, holds, frees) where each wait is (key, hop, rank) — ``hop`` the
        latency added when the producer is on another rank (``latency[producing stage]``, else 0)
        — ``made`` is the one key a plain op makes, -1 for none, or ``COLLECTIVE`` for a kind
        posted to the communication stream (``KindRule.stream == "collective"``), and ``costs[m]``
        the op's time for micro-batch slot ``m`` (``scales``: its (F/B, W) factors, as
        ``StageCosts.slot_scales`` gives them; None: every slot costs the same).
        """
        out: dict[str, list[tuple]] = {}
        M, sc = self.M, self.costs
        for kind, per in self.templates().items():
            rows = []
            rule_ = RULES[kind]
            for cs, (waits, made, cost, holds, frees) in enumerate(per):
                me = self.rank_of[cs]
                hops = tuple((k, latency[st] if rk != me else 0.0, rk) for k, rk, st in waits)
                if scales is None or sc is None or not rule_.scaled:
                    durs = [cost] * M
                else:
                    s = cs % self.S
                    durs = [rule_.scaled_cost(sc, s, k, kw) for k, kw in zip(*scales)]
                if rule_.stream == "collective":
                    rows.append((hops, COLLECTIVE, durs, holds, frees))
                else:
                    rows.append((hops, made[0] if made else -1, durs, holds, frees))
            out[kind] = rows
        return out
