"""Tiny fp64 models, data and single-process references for the data-parallel tests (tests/parallel).

Every data-parallel run is compared with ``reference``: the same model on one process over the
full global batch, loss = mean squared error over all global rows. A rank that sees ``rows`` of
those rows in ``micro`` micro-batches uses ``local_loss`` (sum of squared errors / the rows a
replica sees), so summing its micro-batch gradients and averaging over the replicas gives exactly
the reference gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mt_dualpipe.runtime import PipelineError

H = 8
GLOBAL_ROWS = 16


class Block(nn.Module):
    def __init__(self, h: int = H):
        super().__init__()
        self.a = nn.Linear(h, 2 * h)
        self.b = nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def make_model(seed: int = 0, blocks: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(blocks)]).double()


def global_batch(seed: int = 1, rows: int = GLOBAL_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, generator=g, dtype=torch.float64),
            torch.randn(rows, H, generator=g, dtype=torch.float64))


def local_loss(out: torch.Tensor, y: torch.Tensor, replica_rows: int) -> torch.Tensor:
    """This micro-batch's share of its replica's mean loss (so micro-batch grads sum exactly)."""
    return ((out - y) ** 2).sum() / (replica_rows * out.shape[-1])


def replica_rows(x: torch.Tensor, replica: int, replicas: int) -> slice:
    n = x.shape[0] // replicas
    return slice(replica * n, (replica + 1) * n)


def reference(steps: int, optimizer: str = "adamw", seed: int = 0, blocks: int = 2,
              batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Sequential:
    """The model after ``steps`` single-process steps over the full global batch (one per step)."""
    model = make_model(seed, blocks)
    opt = make_optimizer(optimizer, list(model.parameters()))
    for step in range(steps):
        x, y = batches[step] if batches else global_batch(1 + step)
        opt.zero_grad()
        local_loss(model(x), y, x.shape[0]).backward()
        opt.step()
    return model


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    raise ValueError(kind)


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Module-level factory (picklable) for ZeroOptimizer."""
    return make_optimizer("adamw", params)


def reference_grads(seed: int = 0, blocks: int = 2) -> list[torch.Tensor]:
    model = make_model(seed, blocks)
    x, y = global_batch(1)
    local_loss(model(x), y, x.shape[0]).backward()
    return [p.grad.clone() for p in model.parameters()]


# ----- pipeline x tensor parallel (tests/parallel/test_tensor_parallel.py) ---------------------------------
TP_ROWS, TP_SEQ, TP_CHUNKS = 4, 8, 4  # rows per data-parallel replica


def tp_llama_config():
    """A Llama small enough for 4 fp64 ranks on 2 cores, every head count divisible by tp=2 (GQA 2:1)."""
    from mt_dualpipe.models.llama import LlamaConfig

    return LlamaConfig.preset("tiny", num_hidden_layers=4, vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_attention_heads=4, num_key_value_heads=2)


def tp_llama_batch(dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels of the global batch (``TP_ROWS`` rows per replica)."""
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, tp_llama_config().vocab_size, (TP_ROWS * dp, TP_SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def tp_llama_model():
    """The fp64 single-process model (seed 0); pipeline ranks copy their stages from it."""
    from mt_dualpipe.models.llama import LlamaForCausalLM

    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # initialised in fp64, as the ranks' stages are
    try:
        torch.manual_seed(0)
        return LlamaForCausalLM(tp_llama_config())
    finally:
        torch.set_default_dtype(saved)


def tp_llama_reference(dp: int = 1, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """Parameters after one SGD step of the single-process model on what the pipeline's gradient is:
    the micro-batch losses summed per replica, averaged over the ``dp`` replicas."""
    model = tp_llama_model()
    x, y = tp_llama_batch(dp)
    n = TP_CHUNKS * dp
    loss = sum(model(xm, ym) for xm, ym in zip(x.chunk(n), y.chunk(n))) / dp
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def tp_pipeline_step(rank: int, world: int, schedule: str, defer: bool, dp: int = 1, lr: float = 0.1) -> dict:
    """One SGD step of a PP2 x DP x TP2 pipeline of ``tp_llama_model``'s stages; gathered parameters and counters."""
    from mt_dualpipe import Pipeline
    from mt_dualpipe.models.llama import criterion_for, stages_for_rank
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.parallel.tensor_parallel import full_parameters, parallelize_llama_stage, tensor_parallel_params
    from mt_dualpipe.schedules import OpKind, schedule_info

    torch.set_default_dtype(torch.float64)
    dims = init_parallel(pp=2, dp=dp, tp=2)
    place = schedule_info(schedule).layout(2)
    stages = stages_for_rank(tp_llama_config(), place, dims.coord("pp"), source=tp_llama_model(),
                             defer_weight_grads=defer)
    for st in stages:
        parallelize_llama_stage(st, dims.submesh("tp"))
    from mt_dualpipe.runtime.stage import Stage

    pipe = Pipeline(stages, schedule, mesh=dims, fuse_backward=False)  # every W of the schedule runs as a W
    from torch.distributed.tensor.debug import CommDebugMode

    in_w = [False]
    w_collectives = [0]
    real_weight = Stage.weight

    def weight(self: Stage, mb: int) -> None:  # marks W and counts its collectives (this spawned rank only)
        in_w[0] = True
        try:
            with CommDebugMode() as comm:
                real_weight(self, mb)
            w_collectives[0] += comm.get_total_counts()
        finally:
            in_w[0] = False

    Stage.weight = weight
    seen: list[tuple[bool, bool]] = []  # per firing of a sharded weight's post-accumulate hook: (grad there, in W)
    sharded = [p for n, p in stages[0].named_parameters() if n in tensor_parallel_params(stages[0])]
    sharded[0].register_post_accumulate_grad_hook(lambda p: seen.append((p.grad is not None, in_w[0])))
    x, y = tp_llama_batch(dp)
    pipe.step(x, num_chunks=TP_CHUNKS, criterion=criterion_for(stages), labels=(y,))
    opt = torch.optim.SGD([p for st in stages for p in st.parameters()], lr=lr, foreach=False)
    opt.step()
    params = {}
    for st in stages:
        params.update(full_parameters(st))
    program = pipe.executor(TP_CHUNKS).program.schedule
    return {"params": params, "sharded": sum(len(tensor_parallel_params(st)) for st in stages),
            "closures_run": pipe.store.closures_run, "hook_saw_grad": seen, "w_collectives": w_collectives[0],
            "w_ops": sum(op.kind is OpKind.W for op in program.ranks[dims.coord("pp")]),
            "first_stage_w_ops": sum(op.kind is OpKind.W and (op.chain, op.stage) == place.local_stages(
                dims.coord("pp"))[0] for op in program.ranks[dims.coord("pp")]),
            "stage_layers": [len(st.model.layers) for st in stages], "chains": len(place.ranks),
            "holds_first": place.ranks[0][0] == dims.coord("pp")}


# ----- expert parallel and tied weights through the Pipeline (test_pipeline_expert_parallel, test_tied_weights) -----
class TiedStage(nn.Module):
    """A stage of the tied toy: ``tied`` in (first stage), a ``Block``, ``tied`` out (last stage).

    Every stage declares the tie; only the first and the last hold ``tied`` — the single-process
    model (``TiedModel``) uses one ``tied`` linear at both ends.
    """

    tied_parameters = ("tied.weight", "tied.bias")

    def __init__(self, block: nn.Module, tied: nn.Module | None, first: bool, last: bool):
        super().__init__()
        self.block = block
        if tied is not None:
            self.tied = tied
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tied(x) if self.first else x
        x = self.block(x)
        return self.tied(x) if self.last else x


class TiedModel(nn.Module):
    """The single-process reference: one linear used at both ends of ``n`` blocks."""

    def __init__(self, n: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.tied = nn.Linear(H, H).double()
        self.blocks = nn.ModuleList(Block().double() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tied(x)
        for b in self.blocks:
            x = b(x)
        return self.tied(x)

    def stage(self, s: int) -> TiedStage:
        """A fresh copy of stage ``s`` (its own parameters, equal to this model's)."""
        import copy

        n = len(self.blocks)
        tied = copy.deepcopy(self.tied) if s in (0, n - 1) else None
        return TiedStage(copy.deepcopy(self.blocks[s]), tied, s == 0, s == n - 1)


class ExpertStage(nn.Module):
    """``h = tanh(dense(x))``, then ``h + sum_e expert_e(h)`` with expert ``e`` held by ep rank ``e``.

    Every row goes to every expert through a differentiable all-to-all over ``group`` (so an
    expert's gradient on its rank sums all ep ranks' rows, as in a real MoE layer, while the
    result does not depend on how rows are split into replicas and micro-batches). The expert
    is marked ``"expert"`` (``set_weight_kind``).
    """

    def __init__(self, dense: nn.Module, expert: nn.Module, group):
        super().__init__()
        from mt_dualpipe.parallel import set_weight_kind

        self.dense, self.expert, self.group = dense, expert, group
        set_weight_kind(self.expert, "expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed.nn.functional as dnn

        h = torch.tanh(self.dense(x))
        ep = dist.get_world_size(self.group)
        rows = h.repeat(ep, 1)  # chunk j goes to ep rank j
        got = dnn.all_to_all_single(torch.empty_like(rows), rows, group=self.group)  # every rank's rows
        done = self.expert(got)
        back = dnn.all_to_all_single(torch.empty_like(done), done, group=self.group)  # my rows, expert j's output
        return h + back.view(ep, *h.shape).sum(0)


class ExpertModel(nn.Module):
    """The single-process reference of ``n`` ``ExpertStage`` layers with ``ep`` experts each."""

    def __init__(self, n: int, ep: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.dense = nn.ModuleList(nn.Linear(H, H).double() for _ in range(n))
        self.experts = nn.ModuleList(nn.ModuleList(nn.Linear(H, H).double() for _ in range(ep)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for dense, experts in zip(self.dense, self.experts):
            h = torch.tanh(dense(x))
            x = h + sum(e(h) for e in experts)
        return x

    def stage(self, s: int, ep_rank: int, group) -> ExpertStage:
        """A fresh copy of stage ``s`` as ep rank ``ep_rank`` holds it (expert ``ep_rank`` only)."""
        import copy

        return ExpertStage(copy.deepcopy(self.dense[s]), copy.deepcopy(self.experts[s][ep_rank]), group)

    def expert_params(self, s: int, ep_rank: int) -> list[torch.Tensor]:
        return list(self.experts[s][ep_rank].parameters())


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Module-level SGD factory (lr 0.1) for ``Pipeline.build_optimizer``."""
    return make_optimizer("sgd", params)


def reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: str = "sgd",
                   steps: int = 1) -> nn.Module:
    """``model`` after ``steps`` single-process steps on the global batch ``(x, y)`` (the mean loss)."""
    opt = make_optimizer(optimizer, list(model.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        local_loss(model(x), y, x.shape[0]).backward()
        opt.step()
    return model


def pipeline_share(placement, pp: int, replica: int, replicas: int, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[tuple, tuple]:
    """(inputs, labels) a pipeline rank passes with ``dp_batch="local"``: its replica's rows, then the
    share of the chain it feeds / ends (chains split a replica's rows evenly, as DualPipe's halves)."""
    rows = replica_rows(x, replica, replicas)
    xs, ys = x[rows], y[rows]
    chains = len(placement)
    first = [c for c, ch in enumerate(placement) if ch[0] == pp]
    last = [c for c, ch in enumerate(placement) if ch[-1] == pp]
    inputs = (xs.chunk(chains)[first[0]],) if first else ()
    labels = (ys.chunk(chains)[last[0]],) if last else ()
    return inputs, labels


def tp_refusals(rank: int, world: int) -> dict[str, str]:
    """PP2 x TP2: the messages of what the tensor-parallel pipeline refuses (per rank)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from mt_dualpipe import Pipeline
    from mt_dualpipe.models.llama import LlamaStage
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.parallel.tensor_parallel import parallelize_llama_stage

    dims = init_parallel(pp=2, tp=2)
    out: dict[str, str] = {}
    try:  # one key/value head cannot be split over two tp ranks
        config = tp_llama_config().replace(num_key_value_heads=1)
        parallelize_llama_stage(LlamaStage(config, 0, 2, [0]), dims.submesh("tp"))
    except ValueError as exc:
        out["heads"] = str(exc)
    block = make_model()[dims.coord("pp")]
    parallelize_module(block, dims.submesh("tp"), {"a": ColwiseParallel(), "b": RowwiseParallel()})
    try:
        Pipeline([block], "1f1b", mesh=dims, dp_mode="zero1")
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        out["zero1"] = str(exc)
    if dims.coord("pp") == 0:  # the first stage returns a DTensor: refused at its F, before anything is sent
        block.b = parallelize_module(Block().double().b, dims.submesh("tp"), RowwiseParallel(use_local_output=False))
    pipe = Pipeline([block], "1f1b", mesh=dims, timeout=5)
    x, y = global_batch()
    try:
        pipe.step(x, num_chunks=2, criterion=lambda o, t: local_loss(o, t, x.shape[0]), labels=(y,))
    except Exception as exc:  # noqa: BLE001
        out["dtensor"] = f"{type(exc).__name__}: {exc}"
    return out


def error_message(fn, errors: tuple[type[BaseException], ...] = (PipelineError, ValueError)) -> str:
    """The message of the ``errors`` ``fn`` raises, or "no error" (worker processes return it for an exact check)."""
    try:
        fn()
    except errors as exc:
        return str(exc)
    return "no error"


def rank_micro_batches(sched, pp_rank: int, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...], list[int]]:
    """One replica's ``(inputs, targets)`` micro-batches as a pipeline rank passes them to ``step``: the inputs
    of the chains whose first stage it holds, the targets of those whose last stage it holds (each in the
    order ``sched.microbatches_of`` gives), and the chains it ends (empty: it computes no loss)."""
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == pp_rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == pp_rank]
    inputs = [torch.cat([micro_batches[m][0] for m in sched.microbatches_of(first[0])])] if first else []
    labels = (torch.cat([micro_batches[m][1] for m in sched.microbatches_of(last[0])]),) if last else ()
    return inputs, labels, last


def assert_params_match(mods, ref: nn.Module, label: str) -> dict[str, int]:
    """Every parameter of the stage modules ``mods`` equals the same-named one of ``ref`` (float64 after a
    step: rtol 1e-9); returns how many were checked per weight kind (``"dense"``, ``"expert"``)."""
    from mt_dualpipe.parallel import weight_kind

    checked = {"dense": 0, "expert": 0}
    for mod in mods:
        for name, p in mod.named_parameters():
            torch.testing.assert_close(p.detach(), ref.get_parameter(name).detach(), rtol=1e-9, atol=1e-11,
                                       msg=lambda m, name=name: f"{label}, {name}: {m}")
            checked[weight_kind(p)] += 1
    return checked
