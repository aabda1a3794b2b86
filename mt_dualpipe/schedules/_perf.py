"""Pause Python's cyclic garbage collector during the compiler's big passes.

Lowering a 64-rank x 1024-micro-batch schedule allocates a few hundred thousand small tuples;
each allocation burst triggers generational collections that rescan all of them, which costs
about as much as the pass itself. The passes create no reference cycles, so pausing the
collector while they run is safe; it is re-enabled (if it was on) when they return or raise.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def gc_paused(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return wrapper  # type: ignore[return-value]
