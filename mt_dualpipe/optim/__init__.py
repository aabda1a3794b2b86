"""Memory-saving optimizer pieces for training with mt_dualpipe.

``AdamWBF16``: AdamW whose two moments are stored in bfloat16 (4 bytes of state per parameter
instead of 8), the update itself computed in float32 (DeepSeek-V3 report §3.3.1).
``CpuEMA``: an exponential moving average of the parameters kept on the CPU and updated by a
background thread after each step, so it costs neither accelerator memory nor step time.
"""

from ..parallel.zero import optimizer_state_bytes
from .adamw import AdamWBF16
from .ema import CpuEMA

__all__ = ["AdamWBF16", "CpuEMA", "optimizer_state_bytes"]
