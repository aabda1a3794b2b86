"""Running graphviz: detect the ``dot`` program and turn DOT source into SVG/PNG/PDF bytes.

The python ``graphviz`` package only writes DOT text; the drawing itself needs the graphviz
programs. When they are missing every graphviz output fails with one line saying how to install
them, while the terminal view and the JSON trace keep working.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import graphviz

from ..schedules.errors import ScheduleError

GRAPHVIZ_FORMATS = ("svg", "png", "pdf")
SOURCE_FORMATS = ("dot", "gv")
INSTALL_HINT = (
    "graphviz's `dot` program was not found on PATH; install graphviz (apt-get install graphviz, "
    "brew install graphviz or conda install -c conda-forge graphviz) to write SVG/PNG, "
    "or write a .json trace or use the terminal view, which need no graphviz"
)


class GraphvizNotFound(RuntimeError):
    """The graphviz programs are not installed; the message is the one-line install hint."""


def require_dot() -> None:
    """Raise ``GraphvizNotFound`` when the ``dot`` program is not on PATH."""
    if shutil.which("dot") is None:
        raise GraphvizNotFound(INSTALL_HINT)


def quote(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_graph(path: str | Path, source: str, *, engine: str = "dot", pinned: bool = False) -> str:
    """Write ``source`` to ``path``: the DOT text itself for .dot/.gv, else graphviz's drawing.

    ``pinned`` runs ``engine -n2``: every node keeps the position given in its ``pos`` attribute,
    which is how the to-scale diagrams are drawn without a layout pass.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt in SOURCE_FORMATS:
        path.write_text(source, encoding="utf-8")
        return str(path)
    if fmt not in GRAPHVIZ_FORMATS:
        raise ScheduleError(f"cannot draw {path.name!r}: graphviz output must end in "
                         f"{', '.join('.' + f for f in GRAPHVIZ_FORMATS + SOURCE_FORMATS)}")
    require_dot()

    data = graphviz.pipe(engine, fmt, source.encode("utf-8"), neato_no_op=2 if pinned else None, quiet=True)
    path.write_bytes(data)
    return str(path)
