"""The built-in schedules, one list: every family module's ``SCHEDULES``, in the order ``list`` shows them.

A new family is one module with its generators and its ``SCHEDULES``, plus one line here
(``docs/architecture.md``, "A new schedule family"). The registry imports this list; no family
imports the registry back.
"""

from __future__ import annotations

from . import dualpipe, gpipe, interleaved, one_f_one_b, zero_bubble
from .auto import build as auto_build
from .info import ScheduleInfo

BUILTIN: tuple[ScheduleInfo, ...] = (
    *auto_build.SCHEDULES,
    *dualpipe.SCHEDULES,
    *gpipe.SCHEDULES,
    *interleaved.SCHEDULES,
    *one_f_one_b.SCHEDULES,
    *zero_bubble.SCHEDULES,
)
