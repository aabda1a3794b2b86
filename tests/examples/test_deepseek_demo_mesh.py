"""The DeepSeek-V3 demo on a pp x dp x ep mesh: its knobs, their errors, and a short ZeRO-1 run whose summary
carries the launch tuple ``mt-dualpipe plan --json`` uses and every rank's optimizer-state bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deepseek_v3_repro.py"
SMALL = ["--micro-batch-size", "1", "--seq-len", "16", "--no-progress"]


def _demo():
    return load_script(SCRIPT, "deepseek_v3_repro_mesh")


def run_demo(*args: str, summary: Path) -> tuple[dict, str]:
    cmd = [sys.executable, str(SCRIPT), *SMALL, *args, "--summary", str(summary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(summary.read_text()), done.stdout


def test_pp2_ep2_zero1_summary_carries_the_launch_tuple_and_state_bytes(tmp_path):
    data, out = run_demo("--pp", "2", "--ep", "2", "--dp-mode", "zero1", "--steps", "2", summary=tmp_path / "s.json")
    assert data["launch"] == {"pp": 2, "dp": 1, "ep": 2, "tp": 1, "schedule": "dualpipe", "microbatches": 4,
                              "dp_mode": "zero1", "recompute": "none"}
    assert (data["pp"], data["dp"], data["ep"], data["ranks"]) == (2, 1, 2, 2)
    assert data["global_batch"] == 1 * 4 * 2  # micro-batch size x micro-batches x dp x ep
    assert len(data["loss"]) == 2 and all(2.0 < v < 10.0 for v in data["loss"])
    assert data["rewind"] is True and data["rewinds"] == 0
    state, params = data["optimizer_state_bytes_per_rank"], data["parameters_per_rank"]
    assert len(state) == len(params) == 4 and all(b > 0 for b in state)
    # AdamW keeps two fp32 moments per parameter. ZeRO-1 shards each weight's over every rank reducing its gradient
    # (DualPipe's two copies x the EP pair for dense weights, the two copies for an expert, all four copies of the
    # tied embedding): the four ranks together hold the state of one model, all-reduce would hold 4 ranks' worth
    torch.manual_seed(0)
    model_params = sum(p.numel() for p in DeepSeekV3Model(DeepSeekV3Config.preset("tiny", max_seq_len=64)).parameters())
    assert sum(state) == pytest.approx(8 * model_params, rel=1e-3)
    assert all(b < 0.5 * 8 * n for b, n in zip(state, params))
    assert out.startswith("dualpipe · 2 ranks x ep 2 (zero1) · 4 micro-batches of 1x16 tokens")


@pytest.mark.slow
def test_zero1_exception_rebuilds_pipeline_and_optimizer_then_rewinds(tmp_path):
    """An exception on rank 3 of pp 2 x ep 2 with ZeRO-1: every rank rebuilds its pipeline on fresh pp and EP
    groups and its optimizer from the new pipeline's gradient syncs, restores the snapshot into it and goes on."""
    data, out = run_demo("--pp", "2", "--ep", "2", "--dp-mode", "zero1", "--steps", "4", "--snapshot-every", "2",
                         "--inject-error", "3", "--timeout", "5", summary=tmp_path / "s.json")
    assert data["rewinds"] == 1 and data["skipped_batches"] == [3]
    (fault,) = data["faults"]
    assert (fault["kind"], fault["step"], fault["rewound_to"], fault["ranks"]) == ("exception", 3, 2, [0, 1, 2, 3])
    assert "rank 3: InjectedFault: injected fault (rank 3, step 3" in fault["cause"]
    assert len(data["loss"]) == 4 and all(2.0 < v < 10.0 for v in data["loss"])
    assert "rewound to step 2, batch 3 skipped" in out


@pytest.mark.parametrize("argv, message", [
    (["--dp", "3", "--global-batch", "8"],
     "--global-batch 8 does not split over dp x ep = 3 x 1 = 3 replicas x 4 micro-batches: use a positive multiple "
     "of 12"),
    (["--ep", "2", "--global-batch", "12"],
     "--global-batch 12 does not split over dp x ep = 1 x 2 = 2 replicas x 4 micro-batches: use a positive multiple "
     "of 8"),
    (["--global-batch", "16", "--micro-batch-size", "2"],
     "--micro-batch-size 2 disagrees with --global-batch 16 = 1 replicas x 4 micro-batches x 4; give one of them"),
    (["--dp-mode", "fsdp"], "--dp-mode fsdp is not supported for DeepSeek-V3 stages"),
    (["--ep", "3"], "--ep 3 does not divide the 16 routed experts of the 'tiny' preset: use an --ep that divides 16"),
    (["--preset", "huge"], "unknown DeepSeek-V3 preset 'huge'; choose one of ['671b', 'tiny']"),
    (["--dp", "0"], "--pp, --dp, --ep and --steps must be >= 1, got 2, 0, 1 and 50"),
    (["--schedule", "zbv", "--virtual-stages", "2"], "--virtual-stages is an option of interleaved-1f1b, not of 'zbv'"),
])
def test_bad_mesh_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _demo().parse_args(argv)
    assert message in capsys.readouterr().err


def test_mesh_options_resolve_the_batch_and_keep_the_old_flag():
    demo = _demo()
    args = demo.parse_args(["--ranks", "3"])
    assert (args.pp, args.ranks, args.dp, args.ep, args.replicas) == (3, 3, 1, 1, 1)
    assert args.micro_batch_size == 4 and args.global_batch == 4 * 6  # default: 2 x pp micro-batches of 4
    args = demo.parse_args(["--pp", "2", "--dp", "2", "--ep", "2", "--global-batch", "32", "--schedule", "zbv"])
    assert args.replicas == 4 and args.micro_batch_size == 32 // (4 * 8)  # zbv: 2 x 2 stages x pp micro-batches


def test_under_torchrun_the_world_size_fixes_pp(monkeypatch, capsys):
    demo = _demo()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert demo.parse_args(["--dp", "2", "--ep", "2"]).pp == 2
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(SystemExit):
        demo.parse_args(["--dp", "2", "--ep", "2"])
    assert "torchrun started 6 processes, not a multiple of --dp x --ep = 2 x 2" in capsys.readouterr().err


def test_replicas_split_one_global_batch():
    """dp x ep replicas train on contiguous shares of one seeded global batch: together the same sequences a
    single pipeline with dp x ep times the micro-batch size would see, whatever the split."""
    from types import SimpleNamespace

    demo = _demo()
    run = SimpleNamespace(data=None, config=SimpleNamespace(vocab_size=128))
    split = SimpleNamespace(seed=3, dp=2, ep=2, micro_batch_size=1, seq_len=8, num_mb=4)
    whole = SimpleNamespace(seed=3, dp=1, ep=1, micro_batch_size=4, seq_len=8, num_mb=4)
    shares = [demo.step_batch(split, run, 5, r) for r in range(4)]
    assert all(x.shape == (4, 8) for x, _ in shares)
    x, y = demo.step_batch(whole, run, 5, 0)
    assert torch.equal(torch.cat([s[0] for s in shares]), x) and torch.equal(torch.cat([s[1] for s in shares]), y)
    assert not torch.equal(shares[0][0], shares[1][0])
    assert not torch.equal(demo.step_batch(whole, run, 6, 0)[0], x)  # the next data position: another batch
