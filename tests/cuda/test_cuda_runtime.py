"""The CUDA paths, on a machine that has a GPU (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs them).

* FP8: on an SM90+ GPU the recipe's GEMMs run torch's block-scaled ``scaled_mm`` and agree with the
  emulation (the CPU reference) on aligned and ragged shapes, with no shape falling back.
* The runtime on one GPU: a one-rank NCCL group runs DualPipeV and ZB-V (both stages of the V on the
  GPU, the comm stream active), generic split and deferred W; loss and gradients equal the same
  model run plainly on the GPU, and the FP8 stages equal their single-process run.
* Two NCCL ranks when the machine has two GPUs.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.parallel.local_ranks import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@contextlib.contextmanager
def _one_rank_nccl():
    """A world of one NCCL rank in this process (the runtime's CUDA path with no peer)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _exact_fp32():
    """TF32 off: the pipelined and the plain run must do the same float32 arithmetic."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ----- FP8 ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="block-scaled FP8 GEMMs need SM90+")
@pytest.mark.parametrize("m, n, k", [(256, 512, 1024), (200, 300, 136), (7, 129, 128)])
def test_block_scaled_scaled_mm_is_chosen_and_equals_the_emulation(m, n, k):
    from mt_dualpipe.fp8 import quantize_blocks, quantize_tiles, resolve_gemm
    from mt_dualpipe.fp8.backends import emulated_gemm

    name, gemm = resolve_gemm("cuda")
    assert name == "scaled_mm"
    g = torch.Generator(device="cuda").manual_seed(0)
    a = quantize_tiles(torch.randn(m, k, device="cuda", generator=g))
    w = torch.randn(n, k, device="cuda", generator=g)
    before = gemm.fallbacks
    for b in (quantize_blocks(w), quantize_tiles(w)):  # forward / dgrad operand, wgrad operand
        got, want = gemm(a, b), emulated_gemm(a, b)
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
    assert gemm.fallbacks == before, "no GEMM of these shapes may fall back to the emulation"


# ----- the runtime on one GPU ------------------------------------------------------------------------------------
def _config(**kw):
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config

    base = dict(dim=128, n_layers=4, vocab_size=256, inter_dim=256, moe_inter_dim=128, max_seq_len=64)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


def _batches(config, num_mb: int, seq: int = 32):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (num_mb, seq + 1), generator=g).cuda()
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("schedule, defer", [("dualpipev", True), ("dualpipev", False), ("zbv", True)])
def test_deepseek_v3_pipeline_on_one_gpu_equals_the_plain_model(schedule, defer):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Model, criterion_for, stages_for_rank
    from mt_dualpipe.schedules.registry import build_schedule

    num_mb, config = 4, _config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config).cuda()
    x, y = _batches(config, num_mb)
    ref_losses = []
    for m in range(num_mb):  # the reference: each micro-batch backpropagated as is, gradients summed
        loss = model(x[m:m + 1], y[m:m + 1])
        loss.backward()
        ref_losses.append(loss.detach())
    with _one_rank_nccl():
        sched = build_schedule(schedule, 1, num_mb)
        mods = [m.cuda() for m in stages_for_rank(config, sched, 0, source=model.cpu(), defer_weight_grads=defer)]
        model.cuda()
        pipe = Pipeline(mods, sched, timeout=60)
        assert pipe.p2p.device.type == "cuda" and dist.get_backend() == "nccl"
        loss, _ = pipe.step(x, num_chunks=num_mb, criterion=criterion_for(mods), labels=(y,))
        assert len(pipe.store) == 0
    torch.testing.assert_close(loss, torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    checked = 0
    for st in mods:
        for name, p in st.named_parameters():
            torch.testing.assert_close(p.grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
            checked += 1
    assert checked > 20


def test_fp8_stages_on_one_gpu_run_the_kernel_and_match_the_plain_fp8_model():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("block-scaled FP8 GEMMs need SM90+")
    from mt_dualpipe import Pipeline
    from mt_dualpipe.fp8 import FP8Linear, convert_to_fp8
    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Model, criterion_for, stages_for_rank
    from mt_dualpipe.schedules.registry import build_schedule

    num_mb, config = 4, _config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    plain = copy.deepcopy(model)
    convert_to_fp8(plain)
    plain.cuda()
    x, y = _batches(config, num_mb)
    ref = torch.stack([plain(x[m:m + 1], y[m:m + 1]).detach() for m in range(num_mb)])
    with _one_rank_nccl():
        sched = build_schedule("dualpipev", 1, num_mb)
        mods = [m.cuda() for m in stages_for_rank(config, sched, 0, source=model, fp8=True)]
        fp8 = [m for st in mods for m in st.modules() if isinstance(m, FP8Linear)]
        assert fp8 and all(lin.active_backend == "scaled_mm" for lin in fp8)
        pipe = Pipeline(mods, sched, timeout=60)
        loss, _ = pipe.step(x, num_chunks=num_mb, criterion=criterion_for(mods), labels=(y,))
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=1e-4)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for st in mods for p in st.parameters()
               if p.requires_grad)


def _two_rank_worker(rank: int, port: int, queue) -> None:
    from mt_dualpipe import DualPipeV

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    full = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).cuda()
    x, t = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    ref = full(x)
    torch.nn.functional.mse_loss(ref, t, reduction="sum").backward()
    local = torch.nn.Sequential(copy.deepcopy(full[rank]), copy.deepcopy(full[3 - rank]))
    for p in local.parameters():
        p.grad = None
    pipe = DualPipeV(local)
    crit = lambda out, lab: torch.nn.functional.mse_loss(out, lab, reduction="sum")  # noqa: E731
    pipe.step(x if rank == 0 else None, num_chunks=4, criterion=crit, labels=(t if rank == 0 else None,))
    err = max((a.grad - b.grad).abs().max().item()
              for a, b in zip(local.parameters(), [*full[rank].parameters(), *full[3 - rank].parameters()]))
    dist.destroy_process_group()
    queue.put((rank, err))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_dualpipev_over_two_nccl_ranks():
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(err < 1e-4 for err in results.values()), results
