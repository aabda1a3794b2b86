"""The runtime's exception types.

``PipelineError`` is a misuse or a broken invariant (bad inputs, a non-tensor stage output, a shape
that differs from what the peer expects); ``PipelineTimeoutError`` is a point-to-point wait that
took longer than the pipeline's ``timeout``, ``PipelineCommError`` one that failed because the peer
went away. Both name the rank and the instruction, so a failed
multi-rank run says where it stopped instead of hanging. ``PipelinePeerError`` is what every other
rank raises when one rank's step failed (``comm.py``, "When a rank fails").
"""


class PipelineError(RuntimeError):
    """The pipeline cannot run the step as asked."""


class PipelineCommError(PipelineError):
    """A send or receive failed: the peer closed the connection (it failed or exited)."""


class PipelineTimeoutError(PipelineCommError):
    """A send or receive did not complete within the pipeline's timeout."""


class PipelinePeerError(PipelineError):
    """Another rank of the pipeline failed this step, so this rank stopped it too.

    ``rank`` is the pipeline rank that failed and ``cause`` the line it reported: its op and the
    original exception's type and message (the message says both as well).
    """

    def __init__(self, message: str, rank: int = -1, cause: str = ""):
        super().__init__(message)
        self.rank, self.cause = rank, cause
