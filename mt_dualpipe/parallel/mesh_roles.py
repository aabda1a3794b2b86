"""A user's ``DeviceMesh``, read as the runtime's (pp, dp, ep, tp) roles by its dimension names.

Users who already build their mesh — torchtitan's ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``,
its expert meshes with ``"efsdp"`` / ``"ep"``, Megatron-style ``("pp", "dp", "tp")``, or a 2-D
``("dp", "pp")`` in any order — pass it as is (``init_parallel(mesh=...)``, ``Pipeline(mesh=...)``).
Each dimension name has one role:

* ``pp`` — the pipeline;
* ``dp``, ``dp_replicate``, ``dp_shard``, ``fsdp``, ``efsdp`` — data parallel: full-model replicas
  (``dp_replicate``) and the ranks ``fully_shard`` shards over (``dp_shard`` / ``fsdp``; ``efsdp``
  the same for expert weights) all replicate what the optimizer steps, so their sizes multiply
  into the runtime's ``dp``;
* ``ep`` — expert parallel; ``tp`` — tensor parallel;
* ``cp`` — context parallel, which the runtime does not run: accepted at size 1 only.

A name may also be a flattened dimension (``mesh[("dp_replicate", "dp_shard")]._flatten("dp")``
then ``mesh["pp", "dp"]``): only the names of the mesh passed in count. Any other name, a missing
``pp``, a role named twice in a way that would count ranks twice (``dp`` beside ``dp_shard``; both
``dp_shard`` and ``fsdp``), or a mesh that does not span the world, is one error naming the
dimension and what is allowed. ``canonical_order`` is the pure part (names and sizes in, axis
order out), so it is tested without processes; ``mesh.init_parallel`` builds the runtime's own
``(pp, dp, ep, tp)`` mesh over the same ranks from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROLES: dict[str, str] = {
    "pp": "pp",
    "dp": "dp", "dp_replicate": "dp", "dp_shard": "dp", "fsdp": "dp", "efsdp": "dp",
    "ep": "ep",
    "tp": "tp",
    "cp": "cp",
}
"""Dimension name -> the runtime role it plays (torchtitan's and Megatron's names)."""

_SAME_RANKS = (("dp", "dp_replicate"), ("dp", "dp_shard"), ("dp", "fsdp"), ("dp", "efsdp"), ("dp_shard", "fsdp"),
               ("dp_shard", "efsdp"), ("fsdp", "efsdp"))
"""Pairs of names that describe (part of) the same ranks: both on one mesh would count them twice."""


@dataclass(frozen=True)
class MeshRoles:
    """How a named mesh maps onto (pp, dp, ep, tp): the sizes, and the axes of each role in order."""

    pp: int
    dp: int
    ep: int
    tp: int
    axes: tuple[tuple[int, ...], ...]  # per role (pp, dp, ep, tp): the mesh axes it spans, outermost first


def canonical_order(names: Sequence[str] | None, sizes: Sequence[int]) -> MeshRoles:
    """The roles of a mesh with dimension ``names`` and ``sizes`` (raises ``ValueError`` naming what is wrong)."""
    if names is None:
        raise ValueError("the DeviceMesh has no dimension names: build it with mesh_dim_names=(...) naming each "
                         f"dimension one of {', '.join(ROLES)}")
    names, sizes = tuple(names), tuple(int(s) for s in sizes)
    unknown = [n for n in names if n not in ROLES]
    if unknown:
        raise ValueError(f"mesh dimension {unknown[0]!r} has no role in the pipeline runtime; the names it reads "
                         f"are {', '.join(ROLES)} (torchtitan's and Megatron's)")
    shown = "(" + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)) + ")"
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"the mesh {shown} is ambiguous: it names {twice[0]!r} twice; give each dimension "
                         "its own name")
    clash = [(a, b) for a, b in _SAME_RANKS if a in names and b in names]
    if clash:
        raise ValueError(f"the mesh {shown} is ambiguous: it names both {clash[0][0]!r} and {clash[0][1]!r}, "
                         "which would count data-parallel ranks twice; pass the mesh with each rank set named "
                         "once (e.g. ('pp', 'dp_replicate', 'dp_shard', 'tp'), or ('pp', 'dp') with 'dp' flattened)")
    if "pp" not in names:
        raise ValueError(f"the mesh {shown} has no pipeline dimension: name one of its "
                         "dimensions 'pp' (a pipeline of one stage per rank needs pp=1 to be named too)")
    cp = [s for n, s in zip(names, sizes) if n == "cp"]
    if cp and cp[0] != 1:
        raise ValueError(f"the mesh has cp={cp[0]}: context parallelism is not run by the pipeline runtime; "
                         "build the mesh without 'cp' (or with cp=1)")
    axes = tuple(tuple(i for i, n in enumerate(names) if ROLES[n] == role) for role in ("pp", "dp", "ep", "tp"))
    size = [1, 1, 1, 1]
    for r, ax in enumerate(axes):
        for i in ax:
            size[r] *= sizes[i]
    return MeshRoles(size[0], size[1], size[2], size[3], axes)
