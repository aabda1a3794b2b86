"""Colours and labels shared by every renderer, so the terminal, SVG and trace views agree.

Each compute kind has its own hue; chain 1 (DualPipe's reverse direction) uses a light tint of
the same hue, so a reader sees the kind first and the direction second. An FB unit takes the
colour of the chain of its forward half.
"""

from __future__ import annotations

from ..schedules.timeline import TimelineEvent

KINDS = ("F", "B", "W", "BW", "FB")
KIND_NAMES = {
    "F": "forward",
    "B": "backward for input",
    "W": "backward for weights",
    "BW": "full backward",
    "FB": "overlapped F&B",
}
# kind -> (chain 0 colour, chain 1 colour)
PALETTE = {
    "F": ("#f4a259", "#fbd9b0"),
    "B": ("#5b8fd9", "#bcd2f3"),
    "W": ("#5fb54c", "#c3e6ba"),
    "BW": ("#9467c9", "#d6c6ee"),
    "FB": ("#e0606b", "#f5bcc1"),
}
COMM_COLOUR = "#9e9e9e"
UNKNOWN_COLOUR = "#cccccc"


def colour(kind: str, chain: int) -> str:
    """Fill colour of an op of ``kind`` in ``chain`` (chains past 1 reuse the two tints)."""
    pair = PALETTE.get(kind)
    if pair is None:
        return COMM_COLOUR if kind.startswith(("SEND", "RECV")) else UNKNOWN_COLOUR
    return pair[chain % 2]


def event_colour(event: TimelineEvent) -> str:
    return colour(event.op, event.chain)


def cell_label(event: TimelineEvent) -> str:
    """The micro-batch number(s) written inside a cell: ``3``, or ``3+14`` for an FB pair."""
    if event.pair is not None:
        return f"{event.mb}+{event.pair[3]}"
    return str(event.mb)


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
