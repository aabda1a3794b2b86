"""The schedule compiler: pure Python, no torch.

Build a schedule, validate it, lower it to a program with communication, simulate it, save it::

    from mt_dualpipe.schedules import build_schedule, simulate, lower, Costs
    s = build_schedule("dualpipe", 8, 20)
    print(simulate(s, Costs(1, 1, 1)).makespan)   # 66.0
"""

from .costs import Costs
from .data_parallel import add_grad_reduction
from .errors import ScheduleError
from .ir import FB, Comm, CommBatch, Op, Program, Schedule
from .lower import lower
from .ops import OpKind
from .registry import accepts, build_schedule, list_schedules, schedule_info
from .simulate import SimResult, simulate
from .timeline import Timeline, TimelineEvent
from .validate import validate, validate_program

__all__ = [
    "Costs", "ScheduleError", "Op", "FB", "Comm", "CommBatch", "Schedule", "Program", "lower",
    "build_schedule", "list_schedules", "schedule_info", "accepts", "simulate", "SimResult",
    "Timeline", "TimelineEvent", "validate", "validate_program", "add_grad_reduction", "OpKind",
]
