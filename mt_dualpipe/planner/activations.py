"""Bytes a decoder layer saves for its backward, per token, under each recompute policy.

Counted tensor by tensor from what the integrations' modules hand autograd (``integrations/
deepseek_v3/{mla,moe,model}.py``, ``integrations/llama/model.py``; the policies are applied by
``integrations/recompute.py``), so the estimate follows the code rather than a fitted constant:

- **RMSNorm** (``F.rms_norm`` decomposed): its input, the normalised input (for the weight's
  gradient) and the per-row reciprocal RMS (compute dtype); its output is saved by the linear(s)
  that read it, as a *linear input*.
- **Linear inputs** are cached in ``lin`` bytes (the model dtype, 1 with FP8 caching).
- **Core attention**: the two einsum operands (q and k, or Llama's q and the group-repeated k), the
  softmax probabilities in the compute dtype (float32; a model-dtype copy as well when the model is
  not float32), the repeated/contiguous v, and the causal mask (one bool per key per sequence).
- **RoPE**: cos and sin of the sequence (compute dtype), shared by every head of the layer.
- **MLA**: the wkv_a output (latent + decoupled rope key, the kv RMSNorm input), the q and kv
  latents' norms and the up-projections' inputs.
- **SwiGLU** (dense FFN, each expert, shared experts): the gate and up products and silu(gate)
  (model dtype), and the down-projection's input.
- **MoE routing** (never recomputed): the router input in the compute dtype, the affinities, the
  chosen ids and gate weights, the normalisation's sum, the balance loss's per-token terms, the
  gather index of the dispatch, the dispatched rows (the experts' inputs, one buffer), and for the
  combine the unsort index, the weights and the gathered expert outputs.

Recompute policies: ``"selective"`` for MLA (DeepSeek-V3) recomputes the attention RMSNorm and
MLA's projections (``Block.normed_qkv``): only its input and the q/k/v the attention core reads
stay; for other attention (Llama) it recomputes the core attention and the SwiGLU product, keeping
their inputs (q, k, v at their own head counts; gate and up). ``"full"`` keeps each recomputed
region's input: a dense layer keeps its input only; a MoE layer keeps the attention sublayer's
input, and its router, dispatch and combine still save what they save (they are never re-run),
while the experts keep only the dispatched rows.

The integrations run an eager core attention (einsum, softmax, einsum: the S×S probabilities are
saved); ``Dtypes.fused_attention`` models a flash-style kernel instead (q, k, v, the output and
one log-sum-exp per head), which is what DeepSeek-V3's production training keeps.

Sequence-level tensors (cos/sin, the mask) are spread over the ``micro_batch_size`` sequences of
a micro-batch. Parameters autograd references (norm weights, a float32 copy of the router weight)
are not activations and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX = 8.0  # int64 indices
MASK = 1.0   # a bool


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: ``elem`` activations (model dtype), ``lin`` cached linear inputs (FP8: 1),
    ``comp`` RoPE/softmax/router (float32); ``fused_attention``: a flash-style core attention."""

    elem: float = 2.0
    lin: float = 2.0
    comp: float = 4.0
    fused_attention: bool = False


ATTENTION_KINDS = ("eager", "fused")


def attention_kind(name: str) -> bool:
    """True for a fused (flash-style) core attention; ``ScheduleError`` for an unknown name."""
    if name not in ATTENTION_KINDS:
        from ..schedules.errors import ScheduleError

        raise ScheduleError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {name!r}")
    return name == "fused"


def rms_norm(d: int, t: Dtypes) -> float:
    """Input, normalised input and the reciprocal RMS of one RMSNorm over ``d`` features."""
    return 2 * d * t.elem + t.comp


def swiglu(ffn: int, t: Dtypes, recompute_product: bool = False) -> float:
    """One SwiGLU MLP's saved tensors past its input: gate and up (+ silu(gate) unless the product is
    recomputed) and the down-projection's input."""
    return (2 if recompute_product else 3) * ffn * t.elem + ffn * t.lin


def core_attention(heads: int, dqk: int, v_store: int, seq: int, mbs: int, t: Dtypes) -> float:
    """QKᵀ operands, probabilities (compute dtype, plus a model-dtype copy), the causal mask and the
    storage the ·V einsum's v lives in (``v_store`` elements per token). A fused (flash) core keeps
    q, k, v and one log-sum-exp per head instead of the probabilities and the mask."""
    if t.fused_attention:
        return heads * (2 * dqk + v_store // heads) * t.elem + heads * t.comp
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


def mla_saved(a: Attention, seq: int, mbs: int, t: Dtypes, recompute: str) -> float:
    """MLA sublayer (DeepSeek-V3): attention norm, projections, core, output projection's input."""
    h = a.hidden
    if recompute == "full":
        return h * t.elem
    # v is a slice of wkv_b's output: with one sequence per micro-batch the einsum reads it as a view
    # (the whole k_nope|v buffer stays), with more it copies v out
    v_store = a.heads * (a.dv + (a.dqk - a.rope_dim if mbs == 1 and not t.fused_attention else 0))
    kept = core_attention(a.heads, a.dqk, v_store, seq, mbs, t) + a.heads * a.dv * t.lin
    if recompute == "selective":  # normed_qkv recomputed: its input stays
        return h * t.elem + kept
    proj = rms_norm(h, t) + h * t.lin + rope(a.rope_dim, mbs, t)
    if a.q_lora:
        proj += rms_norm(a.q_lora, t) + a.q_lora * t.lin
    proj += (a.kv_lora + a.rope_dim) * t.elem + a.kv_lora * t.elem + t.comp + a.kv_lora * t.lin  # kv norm, wkv_b
    return proj + kept


def gqa_saved(a: Attention, seq: int, mbs: int, t: Dtypes, recompute: str) -> float:
    """GQA sublayer (Llama): norm, q/k/v projections' input, RoPE, core, output projection's input."""
    h, d = a.hidden, a.dqk
    if recompute == "full":
        return h * t.elem
    front = rms_norm(h, t) + h * t.lin + rope(d, mbs, t) + a.heads * a.dv * t.lin
    if recompute == "selective":  # the core's inputs: q, k and v at their own head counts
        return front + (a.heads * d + a.kv_heads * (d + a.dv)) * t.elem
    return front + core_attention(a.heads, d, a.heads * a.dv, seq, mbs, t)  # k and v repeated per group


def attention_saved(a: Attention, seq: int, mbs: int, t: Dtypes, recompute: str) -> float:
    fn = mla_saved if a.kind == "mla" else gqa_saved
    return fn(a, seq, mbs, t, recompute)


def dense_ffn_saved(hidden: int, ffn: int, t: Dtypes, recompute: str, product_recomputed: bool) -> float:
    """FFN sublayer of a dense layer: its norm, the up-projections' input and the SwiGLU (nothing
    under "full": the whole layer is one recomputed region, counted by the attention's input)."""
    if recompute == "full":
        return 0.0
    return rms_norm(hidden, t) + hidden * t.lin + swiglu(ffn, t, product_recomputed)


@dataclass(frozen=True)
class Moe:
    hidden: int
    experts: int
    topk: int
    ffn: int
    shared_ffn: int = 0


def moe_saved(m: Moe, t: Dtypes, recompute: str) -> float:
    """FFN sublayer of a MoE layer: norm, routing, dispatch, experts, combine."""
    h, k = m.hidden, m.topk
    out = rms_norm(h, t) + h * t.comp  # the router reads the norm output in the compute dtype
    if m.shared_ffn and t.lin != t.comp:
        out += h * t.lin  # the shared expert's own copy of its input
    out += m.experts * t.comp + k * t.comp + 3 * t.comp + 2 * k * INDEX  # router, balance terms, gather index
    out += k * h * t.lin  # dispatched rows: the experts' inputs
    if recompute != "full":
        out += k * swiglu(m.ffn, t) + (swiglu(m.shared_ffn, t) if m.shared_ffn else 0.0)
    return out + k * INDEX + k * t.elem + k * h * t.elem  # combine: unsort index, weights, gathered rows


def head_saved(hidden: int, vocab: int, t: Dtypes) -> float:
    """Final norm, the head's input, the log-probabilities (compute dtype) and the targets."""
    return rms_norm(hidden, t) + hidden * t.lin + vocab * t.comp + INDEX


def mtp_extra_saved(hidden: int, vocab: int, t: Dtypes) -> float:
    """One MTP depth besides its block: the embedding's ids, the two input norms (the hidden half's
    input is the previous head's norm output, already saved), the projection's input and a head."""
    return INDEX + rms_norm(hidden, t) + (hidden * t.elem + t.comp) + 2 * hidden * t.lin + head_saved(hidden, vocab, t)
