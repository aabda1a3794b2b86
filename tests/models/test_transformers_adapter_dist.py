"""The transformers adapter on 2 gloo ranks: six families the library has no native family for, each loaded with
``mt_dualpipe.from_pretrained`` from a folder transformers wrote, cut with ``mt_dualpipe.stages_for_rank`` and
trained one step under ZB-V and DualPipeV with 4 micro-batches and the library's loss
(``mt_dualpipe.criterion_for(stages, normalizer=step_normalizer(labels))``). The step's loss and every gradient
equal transformers' own model on the whole batch (float64: 1e-12; Gemma3's float32 norms: see
``gemma3_tolerance``) and, every family to 1e-12, transformers run on the same micro-batches. One set of ranks
runs every family and schedule (transformers is imported once per rank); each case checks its own results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import hf_adapter
from tests.helpers.dist import run_ranks
from tests.helpers.hf_reference import relative_error

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

SCHEDULES = ("zbv", "dualpipev")
FLOAT32_EPS = torch.finfo(torch.float32).eps


def gemma3_tolerance(num_layers: int) -> float:
    """Gemma3's RMSNorm computes in float32 whatever the model dtype (``x.float()``, then ``type_as``), so the
    whole batch and a micro-batch of it can round a norm's output differently by one float32 unit (eps/2
    relative); each layer has four such norms (input, post-attention, pre- and post-feed-forward), plus q/k norms
    and the final norm, and a gradient passes each twice (forward and backward). The tolerance allows one unit of
    every one of them: 2 * (6 * layers + 1) * eps32, 5.9e-6 for 4 layers."""
    return 2 * (6 * num_layers + 1) * FLOAT32_EPS


def tolerance(name: str) -> float:
    return gemma3_tolerance(4) if name == "gemma3_text" else 1e-12


def _step(sched, stages, x, y, rank):
    import mt_dualpipe
    from mt_dualpipe import Pipeline
    from mt_dualpipe.layers import step_normalizer

    pipe = Pipeline(stages, sched, timeout=120)
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
    pick = lambda t, c: torch.cat([torch.tensor_split(t, hf_adapter.NUM_MB)[m]  # noqa: E731
                                   for m in sched.microbatches_of(c)])
    criterion = mt_dualpipe.criterion_for(stages, normalizer=step_normalizer(y))
    loss, _ = pipe.step(*([pick(x, first[0])] if first else []), num_chunks=hf_adapter.NUM_MB,
                        criterion=criterion, labels=(pick(y, last[0]),) if last else ())
    grads: dict[str, torch.Tensor] = {}
    for st in stages:
        for n, p in st.named_parameters():
            grads.setdefault(n, p.grad.clone())  # a tied copy on this rank holds the summed gradient too
    return {"loss": None if loss is None else float(loss.sum()), "grads": grads,
            "tied": sorted({n for st in stages for n in st.tied_parameters})}


def _worker(rank: int, world: int, folders: dict[str, str]) -> dict:
    import mt_dualpipe
    from mt_dualpipe.schedules.registry import build_schedule

    out = {}
    for name, folder in folders.items():
        model = mt_dualpipe.from_pretrained(folder, dtype=torch.float64, **hf_adapter.FAMILIES[name][2])
        x, y = hf_adapter.batch(model.config.hf.pad_token_id)
        for schedule in SCHEDULES:
            sched = build_schedule(schedule, world, hf_adapter.NUM_MB)
            out[name, schedule] = _step(sched, mt_dualpipe.stages_for_rank(model, sched, rank), x, y, rank)
    return out


def reference(ref, x, y, micro_batches: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' model: the step's token-mean loss and its gradients, over the whole batch in one call or
    ``micro_batches`` calls (each micro-batch's target sum over the step's target count)."""
    ref.zero_grad()
    total, count = 0.0, int((y != -100).sum())
    for xm, ym in zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches)):
        logits = ref(xm).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten(), ignore_index=-100, reduction="sum") / count
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in ref.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the ranks' results, per family transformers' loss and gradients on the whole batch, and on its
    micro-batches one by one)."""
    folders, want, per_micro_batch = {}, {}, {}
    for name in hf_adapter.FAMILIES:
        folder = hf_adapter.save_tiny(name, tmp_path_factory.mktemp(name))
        ref = hf_adapter.load_reference(name, folder)
        x, y = hf_adapter.batch(ref.config.pad_token_id)
        want[name] = reference(ref, x, y)
        per_micro_batch[name] = reference(ref, x, y, hf_adapter.NUM_MB)
        folders[name] = str(folder)
    results = run_ranks(_worker, 2, folders, timeout=600)
    return results, want, per_micro_batch


def errors(got_loss: float, got: dict[str, torch.Tensor], want: tuple[float, dict[str, torch.Tensor]]
           ) -> tuple[float, float]:
    """(relative loss error, worst relative gradient error)."""
    return (abs(got_loss - want[0]) / abs(want[0]), max(relative_error(got[n], g) for n, g in want[1].items()))


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(hf_adapter.FAMILIES))
def test_pipelined_step_equals_transformers(runs, name, schedule):
    results, want, per_micro_batch = runs
    losses = [r[name, schedule]["loss"] for r in results if r[name, schedule]["loss"] is not None]
    got: dict[str, torch.Tensor] = {}
    for r in results:
        for n, g in r[name, schedule]["grads"].items():
            got.setdefault(n, g)
    assert sorted(got) == sorted(want[name][1])
    loss_error, grad_error = errors(sum(losses), got, want[name])
    mb_loss_error, mb_grad_error = errors(sum(losses), got, per_micro_batch[name])
    print(f"{name} {schedule}: loss {loss_error:.2e}, worst gradient {grad_error:.2e} (relative to transformers on "
          f"the whole batch); {mb_loss_error:.2e}, {mb_grad_error:.2e} (on its micro-batches)")
    assert loss_error < tolerance(name) and grad_error < tolerance(name), (loss_error, grad_error)
    assert mb_loss_error < 1e-12 and mb_grad_error < 1e-12, (mb_loss_error, mb_grad_error)  # Gemma3's too
    tied = hf_adapter.hf_config(name).tie_word_embeddings
    assert [r[name, schedule]["tied"] for r in results] == ([["model.embed_tokens.weight"], []] if tied else [[], []])
    pad = hf_adapter.hf_config(name).pad_token_id
    if pad is not None and not tied:  # the pad row of the embedding gets no gradient (tied: the head's only)
        assert not got["model.embed_tokens.weight"][pad].any()
