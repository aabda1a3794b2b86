"""Bytes a decoder layer saves for its backward, per token, under each recompute policy.

For a model given as a JSON description (SimuMax's layout, the bundled ``deepseek_v3_671b``): a family's own
model reads its modules' ``saved_per_token`` declarations instead (``models/*/spec.py``,
``ModelSpec.declared_saved``), which state the same rules module by module. Counted tensor by tensor from what
the modules hand autograd (``layers/{mla,moe,router,mlp,norm}.py``; the policies are applied by
``models/recompute.py``), so the estimate follows the code rather than a fitted constant:

- **RMSNorm** (``F.rms_norm`` decomposed, in the compute dtype): its input upcast to float32 (the
  input itself in a float32 model, a new copy otherwise), the normalised input (for the weight's
  gradient) and the per-row reciprocal RMS; its output (cast back to the model dtype) is saved by
  the linear(s) that read it, as a *linear input*.
- **Linear inputs** are cached in ``lin`` bytes (the model dtype; with FP8 caching ``FP8_LIN``: the
  E4M3 copy ``FP8Linear`` keeps for dW plus one float32 scale per 1×128 tile). An FP8 linear
  quantises its own input, so an input read by several FP8 linears is stored once per reader (MLA's
  q and kv down-projections, Llama's q/k/v and gate/up), except where the module quantises it once
  for both (DeepSeek's SwiGLU ``MLP``: w1 and w3 share one copy). The output head and the router are
  not converted to FP8 (``convert_to_fp8``'s skip list): their inputs stay in the model dtype.
- **Core attention**: the two einsum operands (q and k, or Llama's q and the group-repeated k), the
  softmax probabilities in the compute dtype (float32; a model-dtype copy as well when the model is
  not float32), the repeated/contiguous v, and the causal mask (one bool per key per sequence).
- **RoPE**: cos and sin of the sequence (compute dtype), shared by every head of the layer.
- **MLA**: the kv_a_proj_with_mqa output (latent + decoupled rope key, the kv RMSNorm input), the q and kv
  latents' norms and the up-projections' inputs.
- **SwiGLU** (dense FFN, each expert, shared experts): the gate and up products and silu(gate)
  (model dtype), and the down-projection's input. A **GeLU MLP** (``use_swiglu: false``, GPT-style)
  keeps the GeLU's input and the down-projection's input.
- **MoE routing** (never recomputed): the router input in the compute dtype (and, in a model that is
  not float32, the router weight's float32 copy, once per micro-batch), the affinities, the
  chosen ids and gate weights, the normalisation's sum, the balance loss's per-token terms, the
  gather index of the dispatch, the dispatched rows (the experts' inputs, one buffer), and for the
  combine the unsort index, the weights and the gathered expert outputs.

Recompute policies: ``"selective"`` for MLA (DeepSeek-V3) recomputes MLA from its latents
(``layers.mla.MLAttention.attend``: the latents' RMSNorms, the up-projections, RoPE and
the core attention; report §3.2.3): the attention norm, the down-projections' input, the two
latents and the output projection's input stay, q/k/v and the probabilities do not (a fused core
keeps its log-sum-exp as well and re-runs only the up-projections: its backward rebuilds the
probabilities anyway); for other attention (Llama) it recomputes the core attention and the
SwiGLU product, keeping their inputs (q, k, v at their own head counts; gate and up). ``"full"``
keeps each recomputed region's input: a dense layer keeps its input only; a MoE layer keeps the
attention sublayer's input, and its router, dispatch and combine still save what they save (they
are never re-run), while the experts keep only the dispatched rows.

The families run an eager core attention (einsum, softmax, einsum: the S×S probabilities are
saved); ``Dtypes.fused_attention`` models a flash-style kernel instead (q, k, v, the output and
one log-sum-exp per head), which is what DeepSeek-V3's production training keeps.

Sequence-level tensors (cos/sin, the mask) are spread over the ``micro_batch_size`` sequences of
a micro-batch. Parameters autograd references (norm weights) are not activations and are not
counted; neither is ``FP8Linear``'s cached E4M3 copy of its weight (one per weight version, shared
by every micro-batch: weight memory, ``estimate.weight_bytes``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..schedules.errors import ScheduleError

INDEX = 8.0  # int64 indices
MASK = 1.0   # a bool
FP8_TILE = 128
FP8_LIN = 1.0 + 4.0 / FP8_TILE
"""Bytes per element of an FP8-cached linear input: E4M3 + a float32 scale per 1×128 tile
(``fp8/quantize.py``; exact when the feature count is a multiple of 128, as in
DeepSeek-V3)."""


SAVERS = ("norm", "swiglu", "combine", "router", "attention", "loss", "mla_input")
"""DeepSeek-V3's activation savers, as ``models.deepseek_v3.config.MEMORY_SAVERS`` names them."""

_savers: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("memory_savers", default=frozenset())


def active_savers() -> frozenset[str]:
    """The savers counted by ``Dtypes`` built now (``memory_savers``); none outside it."""
    return _savers.get()


@contextlib.contextmanager
def memory_savers(names: Iterable[str] | str) -> Iterator[frozenset[str]]:
    """Count DeepSeek-V3's memory savers ``names`` (``SAVERS``, ``"all"``, or a comma-separated string)
    in every estimate made inside the block, as the modules built with ``DeepSeekV3Config(memory_savers=
    names)`` keep them. A context rather than an argument so every ``Dtypes`` the planner builds for one
    plan sees the same set; the savers describe DeepSeek-V3's modules (Llama's are unchanged by them)."""
    raw = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    got: set[str] = set()
    for name in raw:
        if name == "all":
            got.update(SAVERS)
        elif name in SAVERS:
            got.add(name)
        elif name not in ("", "none"):
            raise ScheduleError(f"unknown memory saver {name!r}; choose from {', '.join(SAVERS)} or 'all'")
    token = _savers.set(frozenset(got))
    try:
        yield frozenset(got)
    finally:
        _savers.reset(token)


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: ``elem`` activations (model dtype), ``lin`` cached linear inputs (FP8:
    ``FP8_LIN``), ``comp`` RoPE/softmax/router/norms (float32); ``fused_attention``: a flash-style
    core attention; ``fp8``: the linears are ``FP8Linear`` (each quantises and keeps its own input)."""

    elem: float = 2.0
    lin: float = 2.0
    comp: float = 4.0
    fused_attention: bool = False
    fp8: bool = False
    savers: frozenset[str] = field(default_factory=active_savers)

    def saves(self, name: str) -> bool:
        return name in self.savers

    def linear_input(self, d: int, readers: int = 1) -> float:
        """Bytes one token's ``d``-feature input keeps for the ``readers`` linears that read it: one
        shared storage in the model dtype, one FP8 copy per reader with FP8 caching."""
        return d * self.lin * (readers if self.fp8 else 1)


ATTENTION_KINDS = ("eager", "fused")


def attention_kind(name: str) -> bool:
    """True for a fused (flash-style) core attention; ``ScheduleError`` for an unknown name."""
    if name not in ATTENTION_KINDS:
        raise ScheduleError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {name!r}")
    return name == "fused"


def rms_norm(d: int, t: Dtypes, input_saved: bool = False) -> float:
    """Float32 input, normalised input and the reciprocal RMS of one RMSNorm over ``d`` features.
    ``input_saved``: the input is already counted elsewhere, which is its float32 view only in a
    float32 model (otherwise the norm keeps its own upcast copy). With the ``"norm"`` saver the norm
    keeps its input only (``layers.norm.RMSNorm(recompute=True)``), nothing if that is counted elsewhere."""
    if t.saves("norm"):
        return 0.0 if input_saved else d * t.elem
    upcast = 0.0 if input_saved and t.elem == t.comp else d * t.comp
    return upcast + d * t.comp + t.comp


def swiglu(ffn: int, t: Dtypes, recompute_product: bool = False, weighted: bool = False) -> float:
    """One SwiGLU MLP's saved tensors past its input: gate and up (+ silu(gate) unless the product is
    recomputed) and the down-projection's input. The ``"swiglu"`` saver (DeepSeek's ``MLP``) keeps gate
    and up only, in E4M3 + 1×128 scales with FP8 linears (``moe.SwiGLU``). ``weighted``: the routed
    expert's output is scaled by its gate weight before the down-projection (``"combine"``): without the
    saver the unscaled product is kept too (the weight itself is counted by ``moe_saved``)."""
    if t.saves("swiglu"):  # with FP8 the down-projection's input is rebuilt in B too (``fp8_swiglu_down``)
        return 2 * ffn * FP8_LIN if t.fp8 else 2 * ffn * t.elem + ffn * t.lin
    return (2 if recompute_product else 3) * ffn * t.elem + ffn * t.lin + (ffn * t.elem if weighted else 0.0)


def gelu(ffn: int, t: Dtypes) -> float:
    """One GeLU MLP's saved tensors past its input: the GeLU's input (the up-projection's output, kept for
    the GeLU's derivative) and the down-projection's input (the GeLU's output): two ``ffn`` tensors, where a
    SwiGLU keeps three (``swiglu``)."""
    return ffn * t.elem + ffn * t.lin


def eager_score_bytes(t: Dtypes) -> float:
    """Bytes this library's eager core (``layers.attention_core.eager_core``) moves per S×S score element in
    F between its two products: the scale (read, write), the causal ``masked_fill`` (read, write), the
    softmax into the compute dtype (read ``elem``, write ``comp``) and its cast back (read ``comp``, write
    ``elem``; none in a model already in the compute dtype). Priced by ``estimate`` at the HBM's rate, as
    every memory-bound kernel is (the backward twice)."""
    cast = t.comp + t.elem if t.comp != t.elem else 0.0
    return 2 * t.elem + 2 * t.elem + (t.elem + t.comp) + cast


def core_attention(heads: int, dqk: int, v_store: int, seq: int, mbs: int, t: Dtypes) -> float:
    """QKᵀ operands, probabilities (compute dtype, plus a model-dtype copy), the causal mask and the
    storage the ·V einsum's v lives in (``v_store`` elements per token). A fused (flash) core keeps
    q, k, v and one log-sum-exp per head instead of the probabilities and the mask; the ``"attention"``
    saver (``layers.attention_core``, ``"recomputed"``) keeps q, k and a contiguous v, and rebuilds the rest in B."""
    if t.fused_attention or t.saves("attention"):
        return heads * (2 * dqk + v_store // heads) * t.elem + (heads * t.comp if t.fused_attention else 0.0)
    probs = heads * seq * (t.comp + (t.elem if t.elem != t.comp else 0.0))
    return heads * 2 * dqk * t.elem + v_store * t.elem + probs + seq * MASK / mbs


def rope(dim: int, mbs: int, t: Dtypes) -> float:
    """cos and sin, (seq, dim / 2) each, per sequence."""
    return dim * t.comp / mbs


@dataclass(frozen=True)
class Attention:
    """Attention shapes: ``kind`` "mla" or "gqa" (MHA is GQA with as many kv heads as heads)."""

    kind: str
    hidden: int
    heads: int
    kv_heads: int
    dqk: int            # query/key head dim (MLA: nope + rope)
    dv: int
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0   # MLA's decoupled rope dim; GQA's rope covers dqk


def mla_readers(a: Attention, t: Dtypes) -> int:
    """FP8 copies of MLA's input: one per down-projection (``q_a_proj``, ``kv_a_proj_with_mqa``), one shared by
    both with the ``"mla_input"`` saver (``MLA.latents``; without a query LoRA ``q_proj`` and
    ``kv_a_proj_with_mqa`` keep one each)."""
    return 1 if t.saves("mla_input") and a.q_lora else 2


def mla_saved(a: Attention, seq: int, mbs: int, t: Dtypes, recompute: str) -> float:
    """MLA sublayer (DeepSeek-V3): attention norm, projections, core, output projection's input."""
    h = a.hidden
    if recompute == "full":
        return h * t.elem
    # v is a slice of kv_b_proj's output: with one sequence per micro-batch the einsum reads it as a view
    # (the whole k_nope|v buffer stays), with more it copies v out
    flash = t.fused_attention or t.saves("attention")
    v_store = a.heads * (a.dv + (a.dqk - a.rope_dim if mbs == 1 and not flash else 0))
    kept = core_attention(a.heads, a.dqk, v_store, seq, mbs, t) + a.heads * a.dv * t.lin
    if recompute == "selective":  # MLA.attend recomputed: the latents (its inputs) stay, q/k/v do not
        kept = rms_norm(h, t) + t.linear_input(h, mla_readers(a, t)) + (a.q_lora + a.kv_lora + a.rope_dim) * t.elem \
            + a.heads * a.dv * t.lin
        # a fused core also keeps its log-sum-exp per head (its output is wo's input): its backward rebuilds
        # the probabilities from the recomputed q, k and that, so the core's forward is not re-run
        return kept + (a.heads * t.comp if t.fused_attention else 0.0)
    proj = rms_norm(h, t) + t.linear_input(h, mla_readers(a, t)) + rope(a.rope_dim, mbs, t)  # q/kv down-projections
    if a.q_lora:
        proj += rms_norm(a.q_lora, t) + a.q_lora * t.lin
    # the kv norm reads the latent slice of kv_a_proj_with_mqa's output: a float32 model saves that view (the whole
    # latent|rope buffer's storage), another model the slice's float32 copy
    # (with the "norm" saver the norm keeps that view: the whole buffer)
    if t.saves("norm"):
        proj += (a.kv_lora + a.rope_dim) * t.elem + a.kv_lora * t.lin
        return proj + kept
    kv_in = (a.kv_lora + a.rope_dim) * t.elem if t.elem == t.comp else a.kv_lora * t.comp
    proj += kv_in + a.kv_lora * t.comp + t.comp + a.kv_lora * t.lin  # kv norm, kv_b_proj's input
    return proj + kept


def gqa_saved(a: Attention, seq: int, mbs: int, t: Dtypes, recompute: str) -> float:
    """GQA sublayer (Llama): norm, q/k/v projections' input, RoPE, core, output projection's input."""
    h, d = a.hidden, a.dqk
    if recompute == "full":
        return h * t.elem
    front = rms_norm(h, t) + t.linear_input(h, 3) + rope(d, mbs, t) + a.heads * a.dv * t.lin  # q/k/v, o
    if recompute == "selective":  # the core's inputs: q, k and v at their own head counts
        return front + (a.heads * d + a.kv_heads * (d + a.dv)) * t.elem
    return front + core_attention(a.heads, d, a.heads * a.dv, seq, mbs, t)  # k and v repeated per group


def attention_saved(a: Attention, seq: int, mbs: int, t: Dtypes, recompute: str) -> float:
    fn = mla_saved if a.kind == "mla" else gqa_saved
    return fn(a, seq, mbs, t, recompute)


def dense_ffn_saved(hidden: int, ffn: int, t: Dtypes, recompute: str, product_recomputed: bool,
                    up_readers: int = 1, gated: bool = True) -> float:
    """FFN sublayer of a dense layer: its norm, the up-projections' input and the SwiGLU (``gated``) or
    GeLU MLP (nothing under "full": the whole layer is one recomputed region, counted by the attention's
    input). ``up_readers``: FP8 copies of the up-projections' input (1: DeepSeek's ``MLP`` shares one)."""
    if recompute == "full":
        return 0.0
    mlp = swiglu(ffn, t, product_recomputed) if gated else gelu(ffn, t)
    return rms_norm(hidden, t) + t.linear_input(hidden, up_readers) + mlp


@dataclass(frozen=True)
class Moe:
    hidden: int
    experts: int
    topk: int
    ffn: int
    shared_ffn: int = 0


def moe_saved(m: Moe, t: Dtypes, recompute: str, seq: int = 1, mbs: int = 1) -> float:
    """FFN sublayer of a MoE layer: norm, routing, dispatch, experts, combine. The dispatched rows are
    kept once, as the experts' inputs (their bf16 buffer, or with FP8 each expert's one FP8 copy)."""
    h, k = m.hidden, m.topk
    # under "full" the experts and the shared expert are recomputed regions: each keeps its input as
    # given (model dtype), not the FP8 copy its linears would keep
    cached = t.elem if recompute == "full" else t.lin
    shared_copy = bool(m.shared_ffn) and t.lin != t.comp
    out = rms_norm(h, t)
    if t.saves("router") and t.saves("norm"):  # rebuilt in B from the norm's input, which the norm keeps
        pass
    elif t.saves("router"):  # the norm output as given: the shared expert's input already, unless that is FP8
        out += 0.0 if shared_copy and cached == t.elem else h * t.elem
    else:
        out += h * t.comp  # the router reads the norm output in the compute dtype
        if t.elem != t.comp:  # ... with its weight cast to it: one copy per micro-batch
            out += m.experts * h * t.comp / (seq * mbs)
    if shared_copy:
        out += h * cached  # the shared expert's own copy of its input
    out += m.experts * t.comp + k * t.comp + 3 * t.comp + 2 * k * INDEX  # router, balance terms, gather index
    out += k * h * cached  # dispatched rows: the experts' inputs
    weighted = t.saves("combine")
    if recompute != "full":
        out += k * swiglu(m.ffn, t, weighted=weighted) + (swiglu(m.shared_ffn, t) if m.shared_ffn else 0.0)
    if weighted:  # the rows' gate weights (pair index, model-dtype copy) reach the experts; a plain sum
        return out + k * INDEX + k * INDEX + k * t.elem
    return out + k * INDEX + k * t.elem + k * h * t.elem  # combine: unsort index, weights, gathered rows


def head_saved(hidden: int, vocab: int, t: Dtypes, norm_recomputed: bool = False) -> float:
    """Final norm, the head's input (never FP8: model dtype), the log-probabilities (compute dtype)
    and the targets. The pipeline's last stage builds its final norm without the ``"norm"`` saver
    (``stages.py``); an MTP depth's norm has it (``norm_recomputed``). With the ``"loss"`` saver the
    cross-entropy keeps the model-dtype logits instead of the float32 log-probabilities."""
    plain = Dtypes(t.elem, t.lin, t.comp, t.fused_attention, t.fp8, t.savers - {"norm"})
    probs = vocab * (t.elem if t.saves("loss") else t.comp)
    return rms_norm(hidden, t if norm_recomputed else plain) + hidden * t.elem + probs + INDEX


def mtp_extra_saved(hidden: int, vocab: int, t: Dtypes) -> float:
    """One MTP depth besides its block: the embedding's ids, the two input norms (the hidden half's
    input is the previous head's norm output, already saved), the projection's input and a head."""
    return INDEX + rms_norm(hidden, t) + rms_norm(hidden, t, input_saved=True) + 2 * hidden * t.lin \
        + head_saved(hidden, vocab, t, norm_recomputed=True)


# ----- what a deferred W keeps from B until it runs -----------------------------------------------------
# A split B frees the graph, but the weight-gradient GEMMs queued for W hold the input of every linear
# layer that defers (``DeferredLinear``; the cheap owners, norms, the router and embeddings, get their
# gradients in B). Whether that input was saved in F or recomputed in B, it stays until W: the same
# bytes under every recompute policy. Per token, in ``lin`` bytes; a storage read by several linears
# (q/kv down-projections, gate/up) counts once.

def attention_w_held(a: Attention, t: Dtypes) -> float:
    """MLA: the down-projections' input, the two latents' norms (up-projections' inputs), wo's input;
    GQA: the q/k/v projections' input and o_proj's input (with FP8, one copy per projection)."""
    out = (a.heads * a.dv + (a.q_lora + a.kv_lora if a.kind == "mla" else 0)) * t.lin
    return out + t.linear_input(a.hidden, mla_readers(a, t) if a.kind == "mla" else 3)


def dense_ffn_w_held(hidden: int, ffn: int, t: Dtypes, up_readers: int = 1) -> float:
    """gate/up's input (the FFN norm's output) and the down-projection's input."""
    return t.linear_input(hidden, up_readers) + ffn * t.lin


def moe_w_held(m: Moe, t: Dtypes) -> float:
    """The dispatched rows (the experts' inputs, one buffer), each routed expert's down-projection
    input, and the shared experts' input and down-projection input."""
    out = m.topk * (m.hidden + m.ffn)
    if m.shared_ffn:
        out += m.hidden + m.shared_ffn
    return out * t.lin


def head_w_held(hidden: int, t: Dtypes) -> float:
    """The head's input (a deferring ``nn.Linear``, never FP8)."""
    return hidden * t.elem
