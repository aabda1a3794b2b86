"""Colours and labels shared by every renderer, so the terminal, SVG and trace views agree.

Each compute kind has its own hue; an op on a rank's second stage (DualPipe's reverse chain, a V
schedule's way back, interleaving's next chunk) uses a light tint of the same hue, so a reader
sees the kind first and which of the rank's stages second. An FB unit takes the colour of its
forward half. Where colour is not available (text piped to a file) the same facts are written:
a kind code per op (``CODES``) and ``'`` after the micro-batch of a second-stage op.
"""

from __future__ import annotations

from ..schedules.ops import COMM_KINDS, OpKind
from ..schedules.timeline import TimelineEvent

KINDS = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.FB)
KIND_NAMES = {
    OpKind.F: "forward",
    OpKind.B: "backward for input",
    OpKind.W: "backward for weights",
    OpKind.BW: "full backward",
    OpKind.FB: "overlapped F&B",
}
# kind -> (colour of a rank's first stage, light tint for its second stage)
PALETTE = {
    OpKind.F: ("#f4a259", "#fbd9b0"),
    OpKind.B: ("#5b8fd9", "#bcd2f3"),
    OpKind.W: ("#5fb54c", "#c3e6ba"),
    OpKind.BW: ("#9467c9", "#d6c6ee"),
    OpKind.FB: ("#e0606b", "#f5bcc1"),
}
CODES = {OpKind.F: "F", OpKind.B: "B", OpKind.W: "W", OpKind.BW: "b", OpKind.REDUCE_GRAD: "R"}
"""One-letter codes of the plain-text views (b: full backward, as in ``mt-dualpipe show``; R: a
stage's data-parallel gradient reduction)."""
REDUCE_COLOUR = "#b8860b"
"""A ``REDUCE_GRAD`` (data-parallel gradient reduction) on a rank's communication lane: dark gold,
apart from every compute hue and from the grey of point-to-point communication."""
REDUCE_NAME = "stage 3's data-parallel gradient reduction (comm stream, under its rank)"
SECOND_STAGE = "'"
"""Marks an op of a rank's second stage in the plain-text views."""
SECOND_STAGE_NAME = "the rank's second stage (chain 1, a V's way back, the next chunk)"
COMM_COLOUR = "#9e9e9e"
UNKNOWN_COLOUR = "#cccccc"


def colour(kind: str, slot: int) -> str:
    """Fill colour of an op of ``kind`` on the rank's stage ``slot`` (0 first; slots past 1 reuse the tints)."""
    pair = PALETTE.get(kind)
    if kind == OpKind.REDUCE_GRAD:
        return REDUCE_COLOUR
    if pair is None:
        return COMM_COLOUR if kind in COMM_KINDS or kind == OpKind.COMM else UNKNOWN_COLOUR
    return pair[slot % 2]


def cell_label(event: TimelineEvent) -> str:
    """The micro-batch number(s) written inside a cell: ``3``, or ``3+14`` for an FB pair; a
    stage's gradient reduction (once per stage, not per micro-batch) writes ``R/s3``."""
    if event.op == OpKind.REDUCE_GRAD:
        return reduce_label(event.stage)
    if event.pair is not None:
        return f"{event.mb}+{event.pair[3]}"
    return str(event.mb)


def stage_label(event: TimelineEvent) -> str:
    """The stage(s) of a cell: ``s5``, or ``s0+s3`` for an FB pair."""
    if event.pair is not None:
        return f"s{event.stage}+s{event.pair[2]}"
    return f"s{event.stage}"


def reduce_label(stage: int) -> str:
    """A stage's gradient reduction in every view (diagram cells, ``mt-dualpipe show``'s op list)."""
    return f"{CODES[OpKind.REDUCE_GRAD]}/s{stage}"


def plain_label(kind: str, mb: int, second: bool) -> str:
    """One op in the plain-text views: its code, micro-batch and ``'`` on a rank's second stage."""
    return f"{CODES.get(kind, '?')}{mb}{SECOND_STAGE if second else ''}"


def describe(event: TimelineEvent) -> str:
    """One-line description for tooltips and trace slice names."""
    head = f"{event.op}(c{event.chain},s{event.stage},m{event.mb})"
    if event.pair is not None:
        kind, c, s, m = event.pair
        head = f"FB[F(c{event.chain},s{event.stage},m{event.mb}) + {kind}(c{c},s{s},m{m})]"
    return head


def fmt_time(value: float) -> str:
    """Compact number for titles and axis ticks (cost units or seconds)."""
    if value == 0:
        return "0"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    return f"{value:.3g}"
