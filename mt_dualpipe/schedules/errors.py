"""The one exception type of the schedule compiler.

Every bad parameter, invalid schedule or deadlock is reported as a ``ScheduleError`` whose message
says what was wrong and what is allowed, so callers never see a bare ``AssertionError`` or a hang.
"""


class ScheduleError(ValueError):
    """A schedule cannot be built, validated, lowered or simulated as asked."""
