"""The runtime: executes one rank's lowered ``Program`` on torch.distributed.

``Pipeline``, ``DualPipe`` and ``DualPipeV`` (in ``modules``) are the entry points; ``run_backward``
and ``WeightGradStore`` are what an ``overlapped_forward_backward`` hook or a layer with a deferred
weight gradient uses; ``DeferredLinear`` / ``defer_weight_grads`` give any model of ``nn.Linear``
layers a real B/W split; ``split_model`` cuts a stack of layers into a rank's stage modules.
Importable on CPU without CUDA.
"""

from .backward import run_backward
from .deferred import DeferredLinear, defer_weight_grads
from .errors import PipelineCommError, PipelineError, PipelinePeerError, PipelineTimeoutError
from .modules import DualPipe, DualPipeV, Pipeline
from .split import split_model
from .weight_grad import WeightGradStore

__all__ = ["Pipeline", "DualPipe", "DualPipeV", "run_backward", "WeightGradStore", "DeferredLinear",
           "defer_weight_grads", "split_model", "PipelineError", "PipelineCommError", "PipelineTimeoutError",
           "PipelinePeerError"]
