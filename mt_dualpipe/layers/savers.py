"""The activation-memory savers: options of the shared modules that keep less for backward, any family.

DeepSeek-V3's report (§3.2.3, §3.3.2) lists most of them; each is one name a family config switches on
(``memory_savers``, ``"all"`` names every one), and each module's ``saved_per_token`` declaration says
what it then keeps, so the planner counts any family with them from the modules themselves:

- ``norm``: every RMSNorm keeps only its input and is recomputed in B (``norm.RMSNorm(recompute=True)``);
- ``swiglu``: each SwiGLU (dense FFN, routed and shared experts) keeps only its two inputs, in E4M3 with
  1×128 scales when its linears are FP8, and recomputes silu(gate)·up in B (``mlp.SwiGLUMLP``);
- ``combine``: the gate weight multiplies the SwiGLU output before the down-projection, so the combine
  is a plain sum that keeps no expert outputs (exact gradients: the weight's comes from the product the
  SwiGLU rebuilds; ``moe.MoEBlock``);
- ``router``: a router that computes its affinities in float32 keeps its input as given, in the model
  dtype, rather than float32 copies of the input and weight (``router.Router(upcast=True, keep_input=True)``,
  DeepSeek-V3's; a router that multiplies in the model dtype keeps nothing more anyway);
- ``attention``: the core attention keeps q, k and v only and re-runs itself in B (a flash-style
  kernel's footprint; the forward is the eager one, so logits are unchanged; ``attention_core``);
- ``loss``: the cross-entropies keep the model-dtype logits and rebuild the float32 log-softmax in B
  (vocab × 4 bytes per token and head otherwise; ``head.lm_loss``);
- ``mla_input``: with FP8 linears, an attention's input projections share one E4M3 copy of their input
  (MLA's two down-projections), as a SwiGLU's up-projections always do.
"""

from __future__ import annotations

from collections.abc import Iterable

MEMORY_SAVERS = ("norm", "swiglu", "combine", "router", "attention", "loss", "mla_input")


def parse_memory_savers(value: str | Iterable[str]) -> frozenset[str]:
    """A set of ``MEMORY_SAVERS`` names from a comma-separated string or an iterable; ``"all"`` is every
    saver, ``"none"`` or empty none. An unknown name raises ``ValueError`` naming the known ones."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else list(value)
    out: set[str] = set()
    for name in names:
        if name in ("", "none"):
            continue
        if name == "all":
            out.update(MEMORY_SAVERS)
        elif name in MEMORY_SAVERS:
            out.add(name)
        else:
            raise ValueError(f"unknown memory saver {name!r}; choose from {', '.join(MEMORY_SAVERS)} or 'all'")
    return frozenset(out)


class SaverSwitches:
    """For a family config (a frozen dataclass with a ``memory_savers`` field): ``saves(name)``, and
    ``check_savers()`` for its ``__post_init__`` (a string or iterable becomes a frozenset; unknown names
    raise)."""

    memory_savers: frozenset[str]

    def check_savers(self) -> None:
        object.__setattr__(self, "memory_savers", parse_memory_savers(self.memory_savers))

    def saves(self, name: str) -> bool:
        """Whether the memory saver ``name`` (``MEMORY_SAVERS``) is on."""
        return name in self.memory_savers
