"""What a plan says of the model family it planned: the family's name, the code that holds a rank's experts,
where its saved bytes come from, what its selective recompute rebuilds, the activation savers its modules
have, and the example whose tiny preset runs the plan's miniature.

The planner sits below ``models`` in the layer order and runs without torch, so it cannot ask a family: each
family's entry in the one registry (``models/registry.py``: ``Family.planned``) holds its ``PlannedFamily``, and
``models/planner_specs.py`` puts it on the ``ModelSpec`` it builds (``ModelSpec.facts``). Tests hold them to the
families (``tests/planner/test_family_facts.py``: the tiny presets' shapes, and that a saver listed for a family
changes what its model keeps while every other saver does not). Only what a description read from JSON needs
lives here: DeepSeek-V3's facts (the bundled DeepSeek-V3 model is such a description, with MLA attention) and
``DESCRIPTION``, a model the runtime has no family for, planned with the shared modules' formulas and given no
miniature.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.errors import ScheduleError
from .activations import SAVERS
from .model import ModelSpec

FAMILY_EXAMPLE = "examples/train_family.py"
"""The example that trains any family on the shared decoder stages (``--family MODEL_TYPE``, its tiny preset)."""


@dataclass(frozen=True)
class PlannedFamily:
    """One family as the plan describes it."""

    model_type: str              # the registry's key (``models/registry.py``: FAMILIES); "" for a bare description
    title: str                   # how the plan names it
    experts_code: str            # the code that holds a rank's routed experts (memory_terms' "kept by")
    saved_code: str              # where the bytes its layers save per token come from
    selective: str               # what selective recompute rebuilds in B
    savers: tuple[str, ...]      # the activation savers its modules have (``layers/savers.py``), in SAVERS order
    example: str | None = None   # the script that runs its tiny preset (None: no miniature)
    tiny_experts: int = 0        # routed experts of that tiny preset (0: dense); the miniature's ep divides them
    tiny_layers: int = 0         # decoder layers of that tiny preset
    flash_core: bool = False     # its modules offer the flash-style core the planner's "fused" attention counts

    @property
    def owner(self) -> str:
        """The title as a possessive ("Qwen3-MoE's"), or "the shared modules'" for a bare description."""
        return f"{self.title}'s" if self.model_type else "the shared modules'"

    def memory_savers(self, asked: str) -> str:
        """``asked`` (``--memory-savers``: "auto", "all", "none" or a comma-separated list) in this family's
        terms: "all" is the family's savers; a saver its modules do not have is one clear error, as is an
        unknown name. "auto" is left to the caller (``cli/plan_cmd.py``: none unless nothing fits)."""
        if asked == "auto":
            return asked
        names = [n.strip() for n in asked.split(",") if n.strip() and n.strip() != "none"]
        out: set[str] = set()
        for name in names:
            if name == "all":
                out.update(self.savers)
            elif name not in SAVERS:
                raise ScheduleError(f"unknown memory saver {name!r}; choose from {', '.join(self.savers)} or 'all'")
            elif name not in self.savers:
                raise ScheduleError(f"memory saver {name!r} is not one of {self.owner}: its modules have "
                                    f"{', '.join(self.savers)} ('all' is those)")
            else:
                out.add(name)
        return ",".join(s for s in SAVERS if s in out) or "none"


SHARED_SELECTIVE = "the core attention and each SwiGLU product (layers/attention.py, layers/mlp.py)"
"""What selective recompute rebuilds in the families on the shared layer (``models/recompute.py``)."""
SHARED_SAVERS = ("norm", "swiglu", "attention", "loss")
"""The savers every family on the shared layer has: its RMSNorms, SwiGLUs, core attention and the stages' loss."""

DEEPSEEK_V3 = PlannedFamily(
    "deepseek_v3", "DeepSeek-V3", "layers/moe.py: MoEBlock over its ep group, configured by models/deepseek_v3/moe.py",
    "planner/activations.py (the bundled description; a DeepSeek-V3 config is counted from its modules' "
    "declarations, equal at 671B)",
    "q, k, v rebuilt from the MLA latents in B (their RMSNorms and the up-projections)", SAVERS,
    example="examples/deepseek_v3_repro.py", tiny_experts=16, tiny_layers=4, flash_core=True)

DESCRIPTION = PlannedFamily(
    "", "model description", "the rank's experts, sharded over its ep group", "planner/activations.py",
    "the core attention and the SwiGLU product", tuple(s for s in SAVERS if s != "mla_input"))
"""A model read from JSON with no family: the planner's formulas of the shared modules (no MLA input saver, which
only MLA has), and no example to run it in miniature."""


def family_of(model: ModelSpec) -> PlannedFamily:
    """The family ``model`` describes: its own (``ModelSpec.facts``, from its entry in ``models/registry.py``),
    DeepSeek-V3 for a description with MLA attention (the one family with MLA; the bundled DeepSeek-V3 model is
    such a description), else ``DESCRIPTION``."""
    if model.facts is not None:
        return model.facts
    return DEEPSEEK_V3 if model.attention_type == "mla" else DESCRIPTION
