"""Cluster descriptions for the planner (the cluster is a model: nothing is launched).

Reads SimuMax's system JSON layout: ``num_per_node``; ``accelerator.mem_gbs``;
``accelerator.op.<matmul|fp8_matmul|sdp_fwd|sdp_bwd|default>.{tflops, efficient_factor}``;
``networks.<high_intra_node|inter_node>.bandwidth.{gbps, efficient_factor, latency_us}``
(``gbps`` there is GB/s per GPU, as in SimuMax's files).

Presets (dense tensor-core peaks from NVIDIA's datasheets; the efficiencies are typical achieved
fractions, not measurements):
- ``h800``: H800 SXM, 80 GB, 989 TFLOPS BF16 / 1979 FP8, NVLink 400 GB/s (the H800's cut-down
  NVLink, DeepSeek-V3 report section 3.1), 8 per node, one 400 Gb/s InfiniBand NIC per GPU
  (50 GB/s).
- ``h100``: H100 SXM, 80 GB, 989 / 1979 TFLOPS, NVLink 900 GB/s, 400 Gb/s IB per GPU.
- ``a100``: A100 SXM 80 GB, 312 TFLOPS BF16 (no FP8: FP8 runs at the BF16 rate), NVLink 600 GB/s,
  200 Gb/s IB per GPU (25 GB/s).
- ``h200``: H200 SXM, 141 GB, the H100's tensor cores (989 / 1979 TFLOPS), 4.8 TB/s HBM3e, NVLink 900 GB/s.

Achieved, not peak (``mm_rate``): a GEMM's achieved throughput is a fraction of the datasheet peak
that depends on the GPU and the precision, so each preset carries its own ``mm_efficiency`` (BF16)
and ``fp8_efficiency`` (FP8), read off published kernel benchmarks at training-sized shapes
(thousands of tokens by hidden sizes of 4k-16k):

- A100 BF16 0.60 (about 190 TFLOPS): cuBLAS on large BF16 GEMMs reaches 230-260 TFLOPS at
  square 8k shapes, less at the thin shapes of a micro-batch. Not fitted to a published run: at it,
  the Zero Bubble paper's A100 runs (hidden 2,304-6,144, Megatron-LM) land 2-12 % slower than
  published and Megatron-LM's GPT-3 175B example (hidden 12,288, TP8) 8 % faster
  (``benchmarks/results/planner_calibration.md``).
- H100/H800/H200 BF16 0.66 (about 650 TFLOPS): NVIDIA's Transformer Engine / cuBLASLt figures for
  Hopper BF16 GEMMs at LLM shapes are 600-750 TFLOPS (NVIDIA H100 Tensor Core GPU architecture
  whitepaper and TE benchmarks); Llama 3's 400 TFLOPS per GPU overall (Llama 3 paper, Table 4) is
  this less its communication and bubble.
- H800 FP8 0.55 (about 1,090 TFLOPS): DeepGEMM's README (DeepSeek, 2025) lists 1,000-1,550 TFLOPS
  for its fine-grained-scaled FP8 GEMMs on H800 at DeepSeek-V3's shapes, the grouped MoE GEMMs
  1,200-1,300, and the weight-gradient (k-grouped) ones lower; FP8 with 1x128 / 128x128 scales is
  not 2x BF16, because the promotion of partial sums to CUDA cores (DeepSeek-V3 report, section
  3.3.2) and the thinner per-expert GEMMs take their share. The H100/H200 presets take the same
  fraction (same tensor cores).

Memory-bound work (norms, SwiGLU, FP8 casts, MoE permutes, the optimizer step) is priced by bytes
over ``hbm_gbs`` x ``hbm_efficiency`` (datasheet HBM bandwidth: A100 80 GB 2,039 GB/s; H100/H800
SXM 3,350 GB/s; H200 4,800 GB/s; elementwise kernels reach about 80 % of it).

``sms`` and ``comm_sms``: DualPipe's overlapped chunks run the all-to-all kernels on SMs taken from
the computation (DeepSeek-V3 report, section 3.2.2: 20 of the H800's 132 SMs), so overlapped
compute runs at (sms - comm_sms) / sms of its rate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path

from ..schedules.errors import ScheduleError


@dataclass(frozen=True)
class SystemSpec:
    name: str
    gpu_memory_gb: float
    tflops_bf16: float
    tflops_fp8: float
    mm_efficiency: float = 0.6
    attn_efficiency: float = 0.5
    intra_gbs: float = 400.0       # GB/s per GPU inside a node
    inter_gbs: float = 50.0        # GB/s per GPU between nodes
    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.7
    latency_us: float = 20.0
    gpus_per_node: int = 8
    mem_factor: float = 0.94       # usable fraction of the GPU memory (allocator, context, buffers)
    fp8_efficiency: float | None = None  # achieved fraction of the FP8 peak (None: ``mm_efficiency``)
    hbm_gbs: float = 3350.0        # HBM bandwidth, GB/s (datasheet)
    hbm_efficiency: float = 0.8    # fraction of it elementwise / memory-bound kernels reach
    sms: int = 132                 # streaming multiprocessors (H100/H800 SXM: 132)
    comm_sms: int = 20             # SMs DualPipe's overlapped communication takes (DeepSeek-V3 report 3.2.2)

    def tflops(self, dtype: str) -> float:
        return self.tflops_fp8 if dtype == "fp8" else self.tflops_bf16

    def efficiency(self, dtype: str) -> float:
        """Achieved fraction of ``tflops(dtype)`` for training GEMMs (per precision: see the module doc)."""
        if dtype == "fp8" and self.fp8_efficiency is not None:
            return self.fp8_efficiency
        return self.mm_efficiency

    def mm_rate(self, dtype: str) -> float:
        """Achieved matmul FLOP/s in ``dtype`` (FP32 training runs at the BF16 figures: CPU runs only)."""
        return self.tflops(dtype) * 1e12 * self.efficiency(dtype)

    def hbm_rate(self) -> float:
        """Achieved bytes per second of memory-bound kernels."""
        return self.hbm_gbs * 1e9 * self.hbm_efficiency

    def overlap_share(self) -> float:
        """The fraction of the SMs left to compute while DualPipe's communication runs beside it."""
        return (self.sms - self.comm_sms) / self.sms if self.sms > self.comm_sms > 0 else 1.0

    def link(self, across_nodes: bool) -> tuple[float, float]:
        """(effective bytes per second, latency seconds) of one GPU's link."""
        if across_nodes:
            return self.inter_gbs * 1e9 * self.inter_efficiency, self.latency_us * 1e-6
        return self.intra_gbs * 1e9 * self.intra_efficiency, self.latency_us * 1e-6 / 2

    def to_simumax(self) -> dict:
        return {
            "sys_name": self.name, "num_per_node": self.gpus_per_node,
            "accelerator": {"backend": "cuda", "mem_gbs": self.gpu_memory_gb, "op": {
                "default": {"tflops": self.tflops_bf16, "efficient_factor": self.mm_efficiency},
                "matmul": {"tflops": self.tflops_bf16, "efficient_factor": self.mm_efficiency},
                "fp8_matmul": {"tflops": self.tflops_fp8, "efficient_factor": self.efficiency("fp8")},
                "sdp_fwd": {"tflops": self.tflops_bf16, "efficient_factor": self.attn_efficiency}}},
            "networks": {
                "high_intra_node": {"bandwidth": {"gbps": self.intra_gbs, "efficient_factor": self.intra_efficiency,
                                                  "latency_us": self.latency_us / 2}},
                "inter_node": {"bandwidth": {"gbps": self.inter_gbs, "efficient_factor": self.inter_efficiency,
                                             "latency_us": self.latency_us}}},
        }

    @classmethod
    def from_simumax(cls, data: dict, name: str | None = None) -> SystemSpec:
        try:
            acc = data["accelerator"]
            ops = acc.get("op", {})
            mm = ops.get("matmul", ops.get("default"))
            fp8 = ops.get("fp8_matmul", mm)
            sdp = ops.get("sdp_fwd", mm)
            nets = data.get("networks", {})
            intra = nets.get("high_intra_node", nets.get("low_intra_node", {})).get("bandwidth", {})
            inter = nets.get("inter_node", {}).get("bandwidth", {})
            return cls(
                name=name or data.get("sys_name", "system"), gpu_memory_gb=float(acc["mem_gbs"]),
                tflops_bf16=float(mm["tflops"]), tflops_fp8=float(fp8["tflops"]),
                mm_efficiency=float(mm.get("efficient_factor", 0.6)),
                attn_efficiency=float(sdp.get("efficient_factor", 0.5)),
                fp8_efficiency=float(fp8["efficient_factor"]) if "efficient_factor" in fp8 else None,
                intra_gbs=float(intra.get("gbps", 400.0)), inter_gbs=float(inter.get("gbps", 50.0)),
                intra_efficiency=float(intra.get("efficient_factor", 0.8)),
                inter_efficiency=float(inter.get("efficient_factor", 0.7)),
                latency_us=float(inter.get("latency_us", 20.0)),
                gpus_per_node=int(data.get("num_per_node", 8)), mem_factor=float(data.get("mem_factor", 0.94)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"system description is not in SimuMax's layout (need accelerator.mem_gbs, "
                                f"accelerator.op.matmul.tflops, networks.inter_node.bandwidth.gbps): {exc}") from exc

    def replace(self, **kw: object) -> SystemSpec:
        return _replace(self, **{k: v for k, v in kw.items() if v is not None})


HOPPER_BF16 = 0.66  # achieved BF16 GEMM fraction on H100/H800/H200 (module doc: Transformer Engine / cuBLAS figures)
HOPPER_FP8 = 0.55   # achieved FP8 fraction with fine-grained scaling (module doc: DeepGEMM README, H800)

PRESETS = {
    "h800": SystemSpec("h800", 80, 989, 1979, HOPPER_BF16, intra_gbs=400, inter_gbs=50,
                       fp8_efficiency=HOPPER_FP8, hbm_gbs=3350),
    "h100": SystemSpec("h100", 80, 989, 1979, HOPPER_BF16, intra_gbs=900, inter_gbs=50,
                       fp8_efficiency=HOPPER_FP8, hbm_gbs=3350),
    "h200": SystemSpec("h200", 141, 989, 1979, HOPPER_BF16, intra_gbs=900, inter_gbs=50,
                       fp8_efficiency=HOPPER_FP8, hbm_gbs=4800),
    "a100": SystemSpec("a100", 80, 312, 312, 0.6, intra_gbs=600, inter_gbs=25, hbm_gbs=2039, sms=108),
}


def load_system(name_or_path: str) -> SystemSpec:
    """A preset (h800, h100, h200, a100) or a SimuMax system JSON file."""
    if name_or_path.lower() in PRESETS:
        return PRESETS[name_or_path.lower()]
    path = Path(name_or_path)
    if not path.exists():
        raise ScheduleError(f"system {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    try:
        return SystemSpec.from_simumax(json.loads(path.read_text()), name=path.stem)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"system file {path} is not valid JSON: {exc}") from exc


def parse_size_gb(text: str | float) -> float:
    """'80GB', '80', '80 GiB' -> 80.0 (GB and GiB both read as the same 'GB' the datasheets use)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(g|gb|gib)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ScheduleError(f"--gpu-memory must look like '80GB' or '80', got {text!r}")
    return float(m.group(1))
