"""Backward passes of one stage: fused (BW), and split into B (input grads) and W (weight grads).

All calls go straight to the autograd engine (as deepseek's ``run_backward`` does): a sent
output's storage may already be released, and the engine only needs its graph, not its values.

Generic split (any ``nn.Module``). Call a graph node an *input node* when a stage input's gradient
is reachable from it. B runs the engine from the stage outputs restricted to the stage inputs, so
every node computes only the outputs the inputs need: a linear layer's node computes its input
gradient and skips its weight-gradient GEMM. The *frontier* nodes are the input nodes with an edge
into a weight-only part of the graph; B's engine call also captures the gradient arriving at each
of them (as extra engine inputs, before the node's tensor hooks) and keeps the graph. W re-runs
each frontier node from that captured gradient, restricted to the weights below it, so the node
now computes only its weight gradients; one engine call per frontier node, because a combined
call would also flow from one frontier node down the input path into the next and count that one
twice. Roots that reach no input go to W whole.

A frontier node whose weights are all vectors (a norm's weight and bias) has nothing worth
deferring: re-running it in W would cost an engine call (about 30 us on CPU) for an elementwise
reduction. B's engine call computes those gradients along with the input gradient (as extra engine
inputs, not accumulated) and W only accumulates them (``accumulate.py``: directly, or where a hook
observes a weight through one engine call for all of them, so its hooks still fire at W); as the
fast path computes its cheap owners' gradients in B.
A frontier node that is a custom ``autograd.Function`` (a ``torch.compile``'d region's
``CompiledFunctionBackward`` is one) computes every gradient at once, so re-running it in W would
repeat B's work: it is held the same way. That is right for a compiled region's norm weights; for matrix
weights the stage warns once, since their GEMMs then run in B (``runtime/compiled.py`` keeps the
linears of compiled regions out of the graph, so that their GEMMs split as in eager). The split
falls back to a full backward in B (W then has nothing left) when two frontier nodes reach the
same weight; the stage warns once with the reason: a W left empty is never silent. Layers that
want the split anyway use the fast path (``WeightGradStore``, see ``weight_grad.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .accumulate import accumulate

_Variable = torch.autograd.Variable  # its engine is looked up per call, as torch.autograd.backward does: a
# profiler or counter that swaps ``Variable._execution_engine`` sees the runtime's calls too


def run_backward(tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor | None]) -> None:
    """Backward from ``tensors`` with ``grad_tensors``, accumulating into every leaf's ``.grad``.

    The same contract as deepseek DualPipe's ``run_backward``, for ``overlapped_forward_backward`` hooks.
    """
    _Variable._execution_engine.run_backward(tuple(tensors), tuple(grad_tensors), False, False, (), True, True)


def backward_roots(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    """The (output, grad) pairs a backward starts from: outputs that need a grad and got one."""
    roots, gs = [], []
    for t, g in zip(outputs, grads):
        if g is not None and t.requires_grad:
            roots.append(t)
            gs.append(g)
    return roots, gs


def has_reentrant_checkpoint(roots: Sequence[torch.Tensor]) -> bool:
    """Whether the graph below ``roots`` holds a ``torch.utils.checkpoint(..., use_reentrant=True)`` region.

    Such a region re-runs its forward and calls ``backward`` itself when the engine reaches it,
    which torch refuses inside a backward that names its ``inputs`` (what the split B does). A
    stage that uses it gets its weight gradients in B instead (see ``Stage.backward``).
    """
    seen = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return False


def full_backward(roots: Sequence[Any], grads: Sequence[torch.Tensor | None],
                  inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """BW: one engine call accumulating every gradient; returns the inputs' gradients."""
    if roots:
        _Variable._execution_engine.run_backward(tuple(roots), tuple(grads), False, False, (), True, True)
    return [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]


class _Split:
    """What W needs from a split B: per frontier node, its captured grads and the weights below it; and the
    gradients B computed for weights it holds (``held``), which W only accumulates."""

    __slots__ = ("calls", "shared", "held")

    def __init__(self, calls: list[tuple[tuple, tuple, tuple]], shared: Any = None,
                 held: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.calls = calls  # (edges, grads, weights) per engine call; weights () = every leaf reached
        self.shared = shared  # B's SharedRecompute: W reuses what B's checkpoint recompute made
        self.held = held or []  # (weight, gradient), each weight once

    def run(self) -> None:
        if self.held:
            with torch.no_grad():
                accumulate(self.held)
            self.held = []
        with self.shared if self.shared is not None else nullcontext():
            for edges, grads, weights in self.calls:
                _Variable._execution_engine.run_backward(edges, grads, True, False, weights, True, True)
        self.calls = []


def _analyse(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]):
    """Classify the graph below ``roots``: input nodes, frontier nodes and the weights under them.

    Runs on every split B (each micro-batch has its own graph), so it is kept lean: a leaf input
    is recognised by identity at its ``AccumulateGrad`` node (``get_gradient_edge`` would make a
    view per input to find that node), and each node's children are listed once. A per-stage cache
    would need a key that proves the graph is the same, i.e. a walk of every node, which costs
    about half of this analysis.
    """
    input_nodes = set()  # grad_fn of non-leaf inputs
    input_leaves = set()  # id() of leaf inputs, matched at their AccumulateGrad nodes
    for x in inputs:
        if x.grad_fn is None:
            input_leaves.add(id(x))
        else:
            input_nodes.add(x.grad_fn)
    starts = [t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node for t in roots]
    reaches_input, weights_under, children = _classify(starts, input_nodes, input_leaves)
    return starts, reaches_input, children, _frontier(reaches_input, weights_under, children, input_nodes)


def _classify(starts: list, input_nodes: set, input_leaves: set) -> tuple[dict, dict, dict]:
    """Post-order walk below ``starts``: per node, whether it reaches an input; per weight-only
    node, the weight leaves below it; per node, its children (listed once).

    A node is on the stack once to list its children (pushed back under them) and once more to be
    classified after them; a node with no children is classified at once. A node pushed twice by two
    parents is skipped the second time: it is classified by then (no node is below its own parent).
    """
    reaches_input: dict[Any, bool] = {}
    weights_under: dict[Any, frozenset] = {}  # for weight-only nodes: the leaves they reach
    children: dict[Any, list] = {}
    stack = list(starts)
    push, pop = stack.append, stack.pop
    empty = frozenset()
    while stack:  # iterative post-order DFS: children are classified before their parent
        node = pop()
        if node in reaches_input:
            continue
        kids = children.get(node)
        if kids is None:  # first visit: list the children once, then classify them first
            kids = children[node] = [c for c, _ in node.next_functions if c is not None]
            if kids:
                push(node)
                for c in kids:
                    if c not in reaches_input:
                        push(c)
                continue
        if node in input_nodes:
            reaches_input[node] = True
        elif not kids:  # a leaf's AccumulateGrad (a weight, or an input), or a node with nothing below
            v = getattr(node, "variable", None)
            hit = v is not None and id(v) in input_leaves
            reaches_input[node] = hit
            if not hit:
                weights_under[node] = empty if v is None else frozenset((node,))
        else:
            hit = False
            for c in kids:
                if reaches_input[c]:
                    hit = True
                    break
            reaches_input[node] = hit
            if not hit:
                weights_under[node] = empty.union(*[weights_under[c] for c in kids])
    return reaches_input, weights_under, children


def _frontier(reaches_input: dict, weights_under: dict, children: dict, input_nodes: set) -> list:
    """Nodes on a path to an input whose other children lead only to weights, with those weights."""
    empty = frozenset()
    frontier = []
    for node, hit in reaches_input.items():
        if not hit or node in input_nodes:
            continue
        below = [weights_under[c] for c in children[node] if not reaches_input[c]]
        if below:
            leaves = empty.union(*below)
            if leaves:
                frontier.append((node, leaves))
    return frontier


def _captured_by_engine(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                        req: Sequence[torch.Tensor], frontier: list) -> dict[Any, tuple]:
    """B's engine call, which also captures the gradient arriving at each frontier node.

    The frontier nodes' input slots are passed to the engine as extra ``inputs`` (one
    ``GradientEdge`` per slot), so no hook is registered per B. The engine captures them before
    the node's tensor hooks run, so W's re-run of the node applies those hooks exactly once (a
    node pre-hook would see the gradient after them, and W would apply them a second time).
    Returns the captures per node, and the inputs' gradients under the key None.
    """
    edges = []
    slots = []
    for node, _ in frontier:
        n = len(node._input_metadata)
        slots.append(n)
        edges.extend(GradientEdge(node, k) for k in range(n))
    got = _Variable._execution_engine.run_backward(tuple(roots), tuple(grads), True, False, tuple(req) + tuple(edges),
                                                   True, False)
    out: dict[Any, tuple] = {None: got[:len(req)]}
    pos = len(req)
    for (node, _), n in zip(frontier, slots):
        gs = got[pos:pos + n]
        pos += n
        if any(g is not None for g in gs):
            out[node] = gs
    return out


def _captured_by_prehooks(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                          req: Sequence[torch.Tensor], frontier: list) -> dict[Any, tuple]:
    """``_captured_by_engine`` for an autograd whose nodes lack ``_input_metadata``: node pre-hooks."""
    captured: dict[Any, tuple] = {}
    handles = [node.register_prehook(lambda g, node=node: captured.__setitem__(node, g)) for node, _ in frontier]
    try:
        captured[None] = _Variable._execution_engine.run_backward(tuple(roots), tuple(grads), True, False, tuple(req),
                                                                  True, False)
    finally:
        for h in handles:
            h.remove()
    return captured


def _weight_groups(frontier: list, children: dict, reaches_input: dict) -> tuple[list[list[int]], str | None]:
    """The frontier nodes (indices into ``frontier``) grouped by the weights they share, one W engine call per
    group, or why no such grouping is exact.

    Nodes that reach a common weight (the experts of a grouped 3-D weight, each using its slice) run in one W
    call: the engine sums their contributions in the weight's input buffer and accumulates it once, as a plain
    backward does (one ``.grad`` accumulation, one post-accumulate hook call), where a call per node would
    accumulate once per node. One call over a group is exact when no member reaches another: from each member's
    captured gradient the engine flows only down that member's weight-only branches (the input path below it holds
    no other member), so every weight gets each member's contribution once. When a member does reach another (a
    weight reused deeper in the same stage), the call would count the lower member twice: the split is refused.
    """
    owner: dict[Any, int] = {}
    parent = list(range(len(frontier)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (_, leaves) in enumerate(frontier):
        for leaf in leaves:
            j = owner.setdefault(leaf, i)
            if j != i:
                parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(frontier)):
        groups.setdefault(root(i), []).append(i)
    out = list(groups.values())
    shared = [g for g in out if len(g) > 1]
    if not shared:
        return out, None
    for g in shared:
        if any(_opaque(frontier[i][0]) for i in g):
            node = next(frontier[i][0] for i in g if _opaque(frontier[i][0]))
            return out, (f"{type(node).__name__}, a custom autograd.Function whose backward computes every gradient "
                         "at once, shares a weight with another node of the graph")
    below = _frontier_below(frontier, children, reaches_input)
    for g in shared:
        mask = 0
        for i in g:
            mask |= 1 << i
        for i in g:
            if below[frontier[i][0]] & mask:
                return out, (f"two of its graph's nodes (one is {type(frontier[i][0]).__name__}) reach the same "
                             "weight and one reaches the other, which one W call over both would count twice")
    return out, None


def _frontier_below(frontier: list, children: dict, reaches_input: dict) -> dict[Any, int]:
    """Per node on the input path, the frontier nodes strictly below it (a bit mask over ``frontier``'s indices).

    ``reaches_input`` lists nodes children first (``_classify`` fills it in post-order), so one pass suffices; a
    frontier node reaches an input, so every node on a path to one does too and the walk skips the rest."""
    bit = {node: 1 << i for i, (node, _) in enumerate(frontier)}
    below: dict[Any, int] = {}
    reached: dict[Any, int] = {}  # below, plus the node's own bit
    for node, hit in reaches_input.items():
        if not hit:
            continue
        m = 0
        for c in children.get(node, ()):
            m |= reached.get(c, 0)
        below[node] = m
        reached[node] = m | bit.get(node, 0)
    return below


def _opaque(node: Any) -> bool:
    """A custom ``autograd.Function``'s node (a compiled region's ``CompiledFunctionBackward`` is one): its
    backward computes every gradient at once, so re-running it in W would repeat all of B's work."""
    return isinstance(node, BackwardCFunction)


def _gemm_weights_in_b(frontier: list) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """Why some matrix weights get their gradients in B, and which (None: only vectors, e.g. norms', do)."""
    for node, leaves in frontier:
        matrices = tuple(leaf.variable for leaf in leaves if leaf.variable.dim() >= 2)
        if _opaque(node) and matrices:
            return (f"they are below {type(node).__name__}, a custom autograd.Function (a torch.compile'd region "
                    "holding a matrix product is one) whose backward computes every gradient at once, so W only "
                    "accumulates them. Give its matrix products their own autograd nodes (an nn.Linear outside the "
                    "autograd.Function) or defer them (mt_dualpipe.runtime.defer_weight_grads) to run them in W",
                    matrices)
    return None


def _rerun_or_held(frontier: list, groups: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The groups whose nodes W re-runs, and the weights B's own engine call computes the gradients of: those
    of an opaque node (alone in its group) and of groups whose weights are all vectors."""
    rerun, held = [], {}
    for group in groups:
        leaves = [leaf for i in group for leaf in frontier[i][1]]
        if _opaque(frontier[group[0]][0]) or all(leaf.variable.dim() <= 1 for leaf in leaves):
            held.update((leaf, None) for leaf in leaves)
        else:
            rerun.append(group)
    return rerun, [leaf.variable for leaf in held]


def _group_calls(frontier: list, groups: list[list[int]], captured: dict[Any, tuple]) -> list[tuple]:
    """W's engine calls: one per group of frontier nodes sharing weights (``_weight_groups``), from the gradients
    B captured at its nodes, restricted to the weights below them."""
    calls = []
    for group in groups:
        edges, gs, weights = [], [], {}
        for i in group:
            node, leaves = frontier[i]
            for k, g in enumerate(captured.get(node) or ()):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    gs.append(g)
            weights.update((leaf, None) for leaf in leaves)
        if edges:
            calls.append((tuple(edges), tuple(gs), tuple(leaf.variable for leaf in weights)))
    return calls


def split_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], why: list[tuple[str, tuple[torch.Tensor, ...]]] | None = None,
                   shared: Any = None) -> tuple[list[torch.Tensor | None], _Split | None]:
    """B of the generic split: the inputs' gradients now, and what W needs later (None: nothing left).

    ``why``: where weight gradients get computed in B, (the reason, those weights) is appended to it (the stage
    names them in a warning: a weight left in B is never silent). ``shared``: a
    ``checkpoint_reuse.SharedRecompute`` when the stage's forward ran checkpointed regions, so that W reuses B's
    recompute.
    """
    req = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not roots:
        return [None] * len(inputs), None
    if not req:  # nothing to hand back: all the work is weight gradients, done at W
        return [None] * len(inputs), _Split([(tuple(roots), tuple(grads), ())])
    starts, reaches_input, children, frontier = _analyse(roots, req)
    groups, reason = _weight_groups(frontier, children, reaches_input)
    if reason is not None:
        if why is not None:
            why.append((f"the B/W split falls back to a full backward, since {reason}. Wrap its linears with "
                        "mt_dualpipe.runtime.defer_weight_grads to split them anyway",
                        tuple(leaf.variable for _, leaves in frontier for leaf in leaves)))
        return full_backward(roots, grads, inputs), None
    if why is not None and (late := _gemm_weights_in_b(frontier)):
        why.append(late)
    rerun, held = _rerun_or_held(frontier, groups)
    nodes = [frontier[i] for g in rerun for i in g]
    capture = _captured_by_engine if all(hasattr(node, "_input_metadata") for node, _ in nodes) \
        else _captured_by_prehooks  # an autograd without per-node input metadata: capture with node pre-hooks
    with shared.keeping([node for node, _ in nodes]) if shared is not None else nullcontext():
        captured = capture(roots, grads, req + held, nodes)
    got = captured.pop(None)
    # computed by B's run of their node (an opaque one, or vectors only): W only accumulates them
    pairs = [(w, g) for w, g in zip(held, got[len(req):]) if g is not None]
    got = got[:len(req)]
    calls = _group_calls(frontier, rerun, captured)
    for root, start, g in zip(roots, starts, grads):
        if not reaches_input.get(start, False):
            calls.append(((root,), (g,), ()))
    it = iter(got)
    input_grads = [next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]
    return input_grads, (_Split(calls, shared, pairs) if calls or pairs else None)
