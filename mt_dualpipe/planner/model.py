"""Model descriptions for the planner: parameters, FLOPs and saved activations per layer.

Reads SimuMax's model JSON layout (``hidden_size``, ``head_num``, ``layer_num``, ``dense_layers``,
``expert_num``, ``topk``, ``moe_ffn_hidden_size``, ``q_lora_rank``, ...), plus two keys of ours:
``mtp_depth`` (multi-token-prediction modules after the head) and ``max_routed_nodes``
(DeepSeek's node-limited routing), and an optional ``training`` block with the published run.
Megatron-LM's argument names and Hugging Face ``config.json`` names of the same quantities are
accepted too (``ALIASES``: ``ffn_hidden_size``, ``num_layers``, ``num_hidden_layers``, ...). Any
other key is an error that lists the accepted ones: a key dropped silently would change the
numbers without a word (an ignored ``ffn_hidden_size`` turned Llama-2-7B into 8.85 B parameters).
Keys starting with ``_`` are comments.

The pipeline is cut into "items": the embedding, every decoder layer, and the head (+ loss and
MTP modules). Each item knows its parameter count (split into expert and non-expert, since
experts are sharded by expert parallelism), its forward FLOPs per token (matmuls and core
attention separately: the backward splits them differently) and the bytes it saves for the
backward per token. The formulas count GEMM shapes; they reproduce DeepSeek-V3's published
671B total and ~37B activated parameters (see tests).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING

from ..schedules.errors import ScheduleError
from .activations import (
    INDEX,
    Attention,
    Dtypes,
    Moe,
    attention_kind,
    attention_saved,
    attention_w_held,
    dense_ffn_saved,
    dense_ffn_w_held,
    eager_score_bytes,
    head_saved,
    head_w_held,
    moe_saved,
    moe_w_held,
    mtp_extra_saved,
)

if TYPE_CHECKING:  # families.py reads ModelSpec: only the annotation here
    from .families import PlannedFamily

MODELS_DIR = Path(__file__).parent / "models"
MODEL_ALIASES = {"deepseek-v3": "deepseek_v3_671b", "deepseek-v3-671b": "deepseek_v3_671b",
                 "deepseek_v3": "deepseek_v3_671b", "qwen3-30b-a3b": "qwen3_30b_a3b", "qwen3-moe": "qwen3_30b_a3b"}
ALIASES = {
    # Megatron-LM argument names
    "num_layers": "layer_num", "ffn_hidden_size": "intermediate_size", "num_attention_heads": "head_num",
    "num_query_groups": "kv_head_num", "kv_channels": "head_size", "num_experts": "expert_num",
    "num_moe_experts": "expert_num", "moe_router_topk": "topk", "swiglu": "use_swiglu",
    "mtp_num_layers": "mtp_depth", "padded_vocab_size": "vocab_size",
    # Hugging Face config.json names
    "num_hidden_layers": "layer_num", "num_key_value_heads": "kv_head_num", "head_dim": "head_size",
    "n_routed_experts": "expert_num", "num_local_experts": "expert_num", "num_experts_per_tok": "topk",
    "moe_intermediate_size": "moe_ffn_hidden_size", "first_k_dense_replace": "dense_layers",
    "qk_nope_head_dim": "qk_head_dim", "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "num_nextn_predict_layers": "mtp_depth",
}
"""Other tools' names for a model field -> the field (SimuMax's name)."""
DESCRIPTIVE_KEYS = ("model_name", "name", "model_type")
"""Keys that name or classify the model without changing its numbers."""


def _hint(key: str, known: list[str]) -> str:
    """``'key'``, with the closest known key when one is close (a typo)."""
    close = get_close_matches(key, known, 1, 0.8)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


@dataclass(frozen=True)
class Item:
    """One pipeline-cuttable piece of the model (embedding, a decoder layer, or the head)."""

    name: str
    params: float            # non-expert parameters (replicated across data parallel)
    expert_params: float     # routed-expert parameters (sharded across expert parallel)
    mm_flops: float          # forward matmul FLOPs per token
    attn_flops: float        # forward core-attention FLOPs per token (at the full sequence length)
    act_bytes: float         # bytes saved for the backward per token
    moe: bool = False
    recompute_mm_flops: float = 0.0    # forward matmul FLOPs per token re-run in B by the recompute policy
    recompute_attn_flops: float = 0.0  # forward core-attention FLOPs per token re-run in B
    w_act_bytes: float = 0.0  # bytes per token a deferred W keeps from B until it runs (its linears' inputs)
    linear_params: float = 0.0  # of ``params``, those in linears FP8 training converts (each caches an FP8 copy)
    hbm_bytes: float = 0.0   # forward bytes per token moved by memory-bound kernels (``memory_bound_bytes``)
    bf16_mm_flops: float = 0.0  # of ``mm_flops``, those FP8 training keeps in BF16: the output head and the
    #                             MoE router (DeepSeek-V3 report 3.3.1: "embedding module, output head, MoE
    #                             gating modules ... retain their original precision")


def memory_bound_bytes(h: int, linear_inputs: float, ffn: float, routed_copies: int, elem: float, fp8: bool,
                       gated: bool = True) -> float:
    """Forward HBM bytes per token of one decoder layer's memory-bound kernels (priced in ``estimate`` by
    bytes over the GPU's HBM bandwidth; the backward moves about twice as much: it reads the saved
    tensor and the incoming gradient and writes the gradient).

    - two RMSNorms (read and write ``h``) and two residual adds (read ``2h``, write ``h``): ``10 h`` elements;
    - SwiGLU: reads gate and up, writes their product: ``3 ffn`` elements (``ffn``: the intermediate
      widths one token passes, the routed experts' ``topk x moe_ffn`` plus the shared expert's); a GeLU
      MLP (not ``gated``) reads one and writes one: ``2 ffn``;
    - MoE permutes: dispatch writes ``routed_copies`` rows of ``h`` (read once), combine reads them back
      and writes one: ``2 (copies + 1) h`` elements;
    - FP8 training: every linear input is cast (read ``elem``, write 1 byte; the 1x128 scales are 1/128
      more): ``linear_inputs`` elements (the widths of the distinct linear inputs).
    """
    elems = 10 * h + (3 if gated else 2) * ffn + (2 * (routed_copies + 1) * h if routed_copies else 0)
    cast = linear_inputs * (elem + 1 + 4 / 128) if fp8 else 0.0
    return elems * elem + cast


@dataclass
class ModelSpec:
    name: str
    hidden_size: int
    head_num: int
    layer_num: int
    vocab_size: int
    intermediate_size: int
    dense_layers: int = 0
    expert_num: int = 0
    topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    attention_type: str = "mha"
    kv_head_num: int | None = None
    head_size: int | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    use_swiglu: bool = True
    mtp_depth: int = 0
    max_routed_nodes: int = 0
    training: dict = field(default_factory=dict)
    source: str = ""  # the file (or bundled model) it was read from, for titles and messages
    # What the plan says of the family whose modules this describes: the code that keeps the memory terms, the
    # activation savers it offers, the example that runs its miniature (``planner/families.PlannedFamily``; the
    # family's entry in ``models/registry.py`` holds it and ``models/planner_specs.py`` sets it; None for a
    # description read from JSON, ``families.family_of`` then says which).
    facts: PlannedFamily | None = field(default=None, compare=False)
    # A family's own account of what its layers keep: (kind "dense"/"moe", recompute policy, seq, the plan's
    # ``Dtypes``) -> saved elements per token of the model dtype, from the modules' ``saved_per_token``
    # declarations (``mt_dualpipe/layers``). When given it replaces ``planner/activations.py``'s description of
    # the layer's saved bytes, so the planner counts what the runtime's modules declare (every family's
    # ``spec.py`` sets it). ``declared_head`` likewise for the head (part "head": final norm, head, loss) and
    # one MTP depth besides its block (part "mtp").
    declared_saved: Callable[..., float] | None = field(default=None, compare=False)
    declared_head: Callable[..., float] | None = field(default=None, compare=False)
    # Bytes an eager core's elementwise kernels move per S×S score element in F (None: this library's
    # ``eager_core``, ``activations.eager_score_bytes``); a published run's own layer sets its kernels' figure
    # (``planner/megatron_layer.py``: Megatron-LM's fused softmax and attention dropout).
    score_bytes: float | None = field(default=None, compare=False)

    # ----- loading --------------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> list[str]:
        """The model keys a description may give (SimuMax's names), besides ``DESCRIPTIVE_KEYS``."""
        return [f for f in cls.__dataclass_fields__
                if f not in ("name", "source", "facts", "declared_saved", "declared_head", "score_bytes")]

    @classmethod
    def canonical(cls, data: dict, where: str = "model description") -> dict:
        """``data`` with aliases renamed and comments dropped; ``ScheduleError`` for an unknown key or
        for an alias that disagrees with the field it names."""
        fields = cls.fields()
        out: dict = {}
        given_as: dict[str, str] = {}
        unknown = []
        for key, value in data.items():
            if key.startswith("_") or key in DESCRIPTIVE_KEYS:
                continue
            field_name = ALIASES.get(key, key)
            if field_name not in fields:
                unknown.append(key)
            elif field_name in out and out[field_name] != value:
                raise ScheduleError(f"{where} gives {field_name} twice with different values ({given_as[field_name]}="
                                    f"{out[field_name]!r} and {key}={value!r}); keep one")
            else:
                out[field_name] = value
                given_as[field_name] = key
        if unknown:
            hints = [_hint(k, fields + list(ALIASES)) for k in unknown]
            raise ScheduleError(f"{where} has unknown key(s) {', '.join(hints)}; accepted: {', '.join(fields)}, "
                                f"{', '.join(DESCRIPTIVE_KEYS)}; also accepted under Megatron / Hugging Face names: "
                                + ", ".join(f"{a} ({f})" for a, f in ALIASES.items()))
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> ModelSpec:
        """A model from a description in SimuMax's layout (or Megatron / Hugging Face names, ``ALIASES``)."""
        where = f"model description {source}" if source else "model description"
        kw = cls.canonical(data, where)
        need = ("hidden_size", "head_num", "layer_num", "vocab_size")
        missing = [k for k in need if k not in kw]
        if missing:
            raise ScheduleError(f"{where} lacks {', '.join(missing)} (SimuMax model layout: hidden_size, "
                                "head_num, layer_num, vocab_size, intermediate_size, expert_num, topk, ...)")
        kw["name"] = str(data.get("model_name", data.get("name", "model")))
        kw["source"] = source
        kw.setdefault("intermediate_size", 4 * int(kw["hidden_size"]))
        spec = cls(**kw)
        if spec.expert_num and not spec.topk:
            raise ScheduleError(f"{where}: a MoE model needs 'topk' (experts per token)")
        return spec

    @classmethod
    def load(cls, name_or_path: str) -> ModelSpec:
        """A bundled model ("deepseek-v3") or a JSON file in SimuMax's model layout."""
        key = MODEL_ALIASES.get(name_or_path.lower(), name_or_path)
        path = MODELS_DIR / f"{key}.json"
        if not path.exists():
            path = Path(name_or_path)
        if not path.exists():
            bundled = sorted(MODEL_ALIASES) + sorted(p.stem for p in MODELS_DIR.glob("*.json"))
            raise ScheduleError(f"model {name_or_path!r} is neither a bundled model ({', '.join(bundled)}) "
                                "nor a JSON file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"model file {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ScheduleError(f"model file {path} must hold a JSON object of model keys, got {type(data).__name__}")
        return cls.from_dict(data, source=path.name if path.parent == MODELS_DIR else str(path))

    @classmethod
    def from_deepseek_config(cls, cfg: object) -> ModelSpec:
        """From ``mt_dualpipe.models.deepseek_v3.DeepSeekV3Config`` (duck-typed, no torch import)."""
        return cls(name="deepseek_v3", hidden_size=cfg.dim, head_num=cfg.n_heads, layer_num=cfg.n_layers,
                   vocab_size=cfg.vocab_size, intermediate_size=cfg.inter_dim, dense_layers=cfg.n_dense_layers,
                   expert_num=cfg.n_routed_experts, topk=cfg.n_activated_experts,
                   moe_ffn_hidden_size=cfg.moe_inter_dim,
                   moe_shared_expert_intermediate_size=cfg.moe_inter_dim * cfg.n_shared_experts,
                   attention_type="mla", q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                   qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
                   v_head_dim=cfg.v_head_dim, mtp_depth=cfg.mtp_depth)

    @classmethod
    def from_llama_config(cls, cfg: object) -> ModelSpec:
        """From ``mt_dualpipe.models.llama.LlamaConfig`` (duck-typed, no torch import)."""
        return cls(name="llama", hidden_size=cfg.hidden_size, head_num=cfg.num_attention_heads,
                   layer_num=cfg.num_hidden_layers, vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size,
                   attention_type="gqa", kv_head_num=cfg.num_key_value_heads, head_size=cfg.dim_per_head)

    # ----- shapes ---------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.expert_num > 0

    def _dims(self) -> tuple[int, int]:
        """(query/key head dim, value head dim)."""
        if self.attention_type == "mla":
            return self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
        d = self.head_size or self.hidden_size // self.head_num
        return d, d

    def attention_params(self) -> float:
        h, n = self.hidden_size, self.head_num
        dqk, dv = self._dims()
        if self.attention_type == "mla":
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * dqk) if self.q_lora_rank \
                else h * n * dqk
            kv = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank \
                + self.kv_lora_rank * n * (self.qk_head_dim + dv)
            return q + kv + n * dv * h + h
        kvh = self.kv_head_num or n
        return h * n * dqk + 2 * h * kvh * dqk + n * dv * h + h

    def mlp_params(self, ffn: int) -> float:
        return (3 if self.use_swiglu else 2) * self.hidden_size * ffn

    def moe_layer(self, layer_id: int) -> bool:
        return self.is_moe and layer_id >= self.dense_layers

    def attention_shape(self) -> Attention:
        dqk, dv = self._dims()
        if self.attention_type == "mla":
            return Attention("mla", self.hidden_size, self.head_num, self.head_num, dqk, dv, self.q_lora_rank,
                             self.kv_lora_rank, self.qk_pos_emb_head_dim)
        return Attention("gqa", self.hidden_size, self.head_num, self.kv_head_num or self.head_num, dqk, dv)

    def selective_mm_flops(self) -> float:
        """Matmul FLOPs per token that ``"selective"`` recomputes: MLA's up-projections (DeepSeek-V3; an
        eager core is re-run too, counted as attention FLOPs); nothing for other attention, whose
        recomputed core attention counts as attention FLOPs."""
        if self.attention_type != "mla":
            return 0.0
        h, n = self.hidden_size, self.head_num
        dqk, dv = self._dims()
        q = self.q_lora_rank * n * dqk if self.q_lora_rank else h * n * dqk
        return 2 * (q + self.kv_lora_rank * n * (self.qk_head_dim + dv))

    def layer_item(self, layer_id: int, seq_len: int, act_unit: float, recompute: str, elem: float = 2.0,
                   micro_batch_size: int = 1, attention: str = "eager") -> Item:
        """One decoder layer. ``act_unit``: bytes per cached linear-input element (2 bf16, 1 FP8);
        ``elem``: bytes of the other saved elements (2 bf16, 4 fp32); ``attention``: "eager" (the
        models' einsum core, probabilities saved) or "fused" (flash-style). Saved bytes per token
        follow ``planner/activations.py``; ``recompute_*`` are the forward FLOPs the policy re-runs in B."""
        h, n = self.hidden_size, self.head_num
        dqk, dv = self._dims()
        attn_p = self.attention_params()
        attn_mm = 2 * (attn_p - h)
        attn_core = n * seq_len * (dqk + dv)  # causal: half of 2*s*(dqk+dv) per head and token
        t = Dtypes(elem=elem, lin=act_unit, comp=max(4.0, elem), fused_attention=attention_kind(attention),
                   fp8=act_unit < elem)
        act = attention_saved(self.attention_shape(), seq_len, micro_batch_size, t, recompute)
        w_held = attention_w_held(self.attention_shape(), t)
        mla = self.attention_type == "mla"
        if self.moe_layer(layer_id):
            ffn, k = self.moe_ffn_hidden_size, self.topk
            shared = self.moe_shared_expert_intermediate_size
            expert_p = self.expert_num * self.mlp_params(ffn)
            router = 2 * h * self.expert_num
            dense_p = self.mlp_params(shared) + h * self.expert_num + h
            mm = 2 * (k * self.mlp_params(ffn) + self.mlp_params(shared)) + router
            act += moe_saved(Moe(h, self.expert_num, k, ffn, shared), t, recompute, seq_len, micro_batch_size)
            w_held += moe_w_held(Moe(h, self.expert_num, k, ffn, shared), t)
            params, moe = (attn_p + dense_p, expert_p), True
        else:
            mm, router = 2 * self.mlp_params(self.intermediate_size), 0.0
            up_readers = 1 if mla else 2  # DeepSeek's MLP quantises gate/up's input once, Llama's each linear
            act += dense_ffn_saved(h, self.intermediate_size, t, recompute,
                                   product_recomputed=not mla and recompute == "selective", up_readers=up_readers,
                                   gated=self.use_swiglu)
            params, moe = (attn_p + self.mlp_params(self.intermediate_size) + h, 0.0), False
            w_held += dense_ffn_w_held(h, self.intermediate_size, t, up_readers)
        if self.declared_saved is not None:  # the family's modules say what they keep (elements, model dtype)
            act = self.declared_saved("moe" if moe else "dense", recompute, seq_len, t) * elem
        re_mm, re_attn = 0.0, 0.0
        if recompute == "full":  # everything but the router (the all-to-alls are not compute)
            re_mm, re_attn = attn_mm + mm - router, attn_core
        elif recompute == "selective":
            # the core is re-run, except MLA's with a fused kernel (whose backward rebuilds its probabilities)
            re_mm = self.selective_mm_flops() if mla else 0.0
            re_attn = 0.0 if mla and t.fused_attention else attn_core
        norms = h + (self.q_lora_rank + self.kv_lora_rank if mla else 0)  # norm weights inside attention_params
        ffn_linears = self.mlp_params(self.moe_shared_expert_intermediate_size if moe else self.intermediate_size)
        width = (self.topk * self.moe_ffn_hidden_size + self.moe_shared_expert_intermediate_size) if moe \
            else self.intermediate_size
        lin_in = (h + (self.q_lora_rank + self.kv_lora_rank if mla else 0) + n * dv  # attention's linears
                  + h * (1 + (self.topk if moe else 0)) + width)                   # the MLP's: input(s), down-proj
        hbm = memory_bound_bytes(h, lin_in, width, self.topk if moe else 0, elem, t.fp8, gated=self.use_swiglu)
        if not t.fused_attention:  # an eager core's softmax passes over the full S×S scores of every head
            hbm += n * seq_len * (eager_score_bytes(t) if self.score_bytes is None else self.score_bytes)
        return Item(f"layer{layer_id}", params[0], params[1], attn_mm + mm, attn_core, act, moe, re_mm, re_attn,
                    w_held, attn_p - norms + ffn_linears, hbm, router)

    def items(self, seq_len: int, act_unit: float = 2.0, recompute: str = "selective", elem: float = 2.0,
              micro_batch_size: int = 1, attention: str = "eager") -> list[Item]:
        """Embedding, the decoder layers, then the head (+ MTP modules), in pipeline order."""
        if recompute not in ("none", "selective", "full"):
            raise ScheduleError(f"recompute must be none, selective or full, got {recompute!r}")
        h, V = self.hidden_size, self.vocab_size
        t = Dtypes(elem=elem, lin=act_unit, comp=max(4.0, elem), fp8=act_unit < elem)
        out = [Item("embedding", V * h, 0.0, 0.0, 0.0, INDEX)]  # the token ids
        out += [self.layer_item(i, seq_len, act_unit, recompute, elem, micro_batch_size, attention)
                for i in range(self.layer_num)]
        # DeepSeek's head is a deferring linear (W keeps its input); Llama's criterion applies the head's
        # weight with F.linear, whose gradient is computed in B
        head_w = head_w_held(h, t) if self.attention_type == "mla" else 0.0
        # the loss: logits written in the model dtype, then read and rewritten in float32 by the softmax
        head_act = head_saved(h, V, t) if self.declared_head is None else self.declared_head("head", recompute,
                                                                                             seq_len, t) * elem
        mtp_act = mtp_extra_saved(h, V, t) if self.declared_head is None else self.declared_head("mtp", recompute,
                                                                                                  seq_len, t) * elem
        head = Item("head", V * h + h, 0.0, 2 * V * h, 0.0, head_act, w_act_bytes=head_w,
                    hbm_bytes=V * (elem + 2 * 4.0), bf16_mm_flops=2 * V * h)
        for d in range(self.mtp_depth):  # projection of [h; emb] and one more (MoE) block, the shared head
            block = self.layer_item(self.layer_num + d, seq_len, act_unit, recompute, elem, micro_batch_size,
                                    attention)
            proj = 2 * h * h + 3 * h  # the [h; emb] projection and its two input norms + the output norm
            head = Item("head+mtp", head.params + proj + block.params, head.expert_params + block.expert_params,
                        head.mm_flops + 2 * proj + block.mm_flops + 2 * V * h, head.attn_flops + block.attn_flops,
                        head.act_bytes + block.act_bytes + mtp_act, True,
                        head.recompute_mm_flops + block.recompute_mm_flops,
                        head.recompute_attn_flops + block.recompute_attn_flops,
                        head.w_act_bytes + block.w_act_bytes + 2 * h * act_unit + head_w,  # + projection, head inputs
                        block.linear_params + 2 * h * h, head.hbm_bytes + block.hbm_bytes + V * (elem + 8.0),
                        head.bf16_mm_flops + block.bf16_mm_flops + 2 * V * h)
        out.append(head)
        return out

    def total_params(self, include_mtp: bool = False) -> float:
        items = self.items(4096)
        total = sum(i.params + i.expert_params for i in items)
        if not include_mtp and self.mtp_depth:
            plain = replace(self, mtp_depth=0)
            total = sum(i.params + i.expert_params for i in plain.items(4096))
        return total

    def activated_params(self) -> float:
        """Parameters one token's forward touches (embedding and head included, MTP excluded)."""
        plain = replace(self, mtp_depth=0)
        return sum(i.mm_flops for i in plain.items(4096)) / 2 + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), MTP included."""
        return 3 * sum(i.mm_flops + i.attn_flops for i in self.items(seq_len))
