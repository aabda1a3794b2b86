"""The runtime's exception types.

``PipelineError`` is a misuse or a broken invariant (bad inputs, a non-tensor stage output, a shape
that differs from what the peer expects); ``PipelineTimeoutError`` is a point-to-point wait that
took longer than the pipeline's ``timeout``, ``PipelineCommError`` one that failed because the peer
went away. Both name the rank and the instruction, so a failed
multi-rank run says where it stopped instead of hanging.
"""


class PipelineError(RuntimeError):
    """The pipeline cannot run the step as asked."""


class PipelineCommError(PipelineError):
    """A send or receive failed: the peer closed the connection (it failed or exited)."""


class PipelineTimeoutError(PipelineCommError):
    """A send or receive did not complete within the pipeline's timeout."""
