"""The DeepSeek-V3 example end to end: short runs spawn their ranks, train and write the summary
(--fp8 under Rewind with a checkpoint; --no-rewind on real text); a rerun with --checkpoint-dir
resumes; a NaN injected at one step is rewound and its batch skipped, and the steps before it match
the clean run bit for bit; with expert parallelism an exception on one rank is rewound too (the EP
all-to-all times out, the groups are rebuilt)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mt_dualpipe.data.text import PackedText, load_tokenizer
from mt_dualpipe.layers.savers import MEMORY_SAVERS
from tests.helpers.scripts import load_script
from tests.helpers.text import train_tokenizer, write_corpus

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deepseek_v3_repro.py"
TINY = ["--ranks", "2", "--micro-batch-size", "1", "--seq-len", "16", "--no-progress"]


def run_example(*args: str, summary: Path) -> tuple[dict, str]:
    cmd = [sys.executable, str(SCRIPT), *TINY, *args, "--summary", str(summary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(summary.read_text()), done.stdout


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[dict, str, Path, Path]:
    """Three FP8 steps under Rewind with a checkpoint every 3 steps and a timeline:
    (summary, stdout, timeline file, checkpoint folder). One run serves the summary, FP8 and timeline checks
    and is the start of the resumed run below."""
    tmp = tmp_path_factory.mktemp("first")
    data, out = run_example("--steps", "3", "--fp8", *_checkpoints(tmp / "ckpt"), "--timeline", str(tmp / "t.json"),
                            summary=tmp / "a.json")
    return data, out, tmp / "t.json", tmp / "ckpt"


def _checkpoints(folder: Path) -> list[str]:
    return ["--snapshot-every", "3", "--checkpoint-dir", str(folder)]


@pytest.fixture(scope="module")
def resumed(first_run, tmp_path_factory) -> tuple[dict, dict, str]:
    """The first run, then a rerun to step 5 that resumes from its checkpoint:
    (first run's summary, rerun's summary, rerun's stdout). The reference for the rewound run."""
    first, _, _, ckpt = first_run
    again, out = run_example("--steps", "5", "--fp8", *_checkpoints(ckpt),
                             summary=tmp_path_factory.mktemp("again") / "b.json")
    return first, again, out


def test_example_writes_summary_timeline_and_fp8_line(first_run):
    data, out, timeline, _ = first_run
    assert data["schedule"] == "dualpipe" and data["ranks"] == 2 and data["microbatches"] == 4
    # DualPipe ranks carry equal loads whatever the layout; the balanced default then evens the stages:
    # three blocks before the last stage's block + head + MTP + losses, not two
    assert data["layout"] == "Et*3|tmL" and data["first_step"] == 0
    assert data["modelled_cost_per_rank"] == pytest.approx([0.5, 0.5])
    assert len(data["loss"]) == len(data["mtp_loss"]) == len(data["expert_load_max_violation"]) == 3
    assert all(2.0 < v < 10.0 for v in data["loss"] + data["mtp_loss"])
    assert all(v >= 0.0 for v in data["expert_load_max_violation"])
    assert data["tokens_per_s"] > 0
    assert 0.0 <= data["bubble_rate"]["measured"] < 1.0 and data["bubble_rate"]["simulated"] is not None
    assert data["rewind"] is True and data["snapshot_every"] == 3
    assert data["rewinds"] == 0 and data["skipped_batches"] == [] and data["faults"] == []
    # the FP8 backend line: printed once (rank 0), recorded in the summary
    assert data["fp8"] is True and data["fp8_backend"].startswith("fp8 backend on cpu: ")
    assert data["fp8_gemm"] in ("emulated", "scaled_mm")
    assert out.count("fp8 backend on cpu: ") == 1
    # the start line: schedule, ranks, micro-batches, layout, parameters per rank
    first, second = out.splitlines()[:2]
    assert first.startswith("dualpipe · 2 ranks · 4 micro-batches of 1x16 tokens · layout Et*3|tmL · params/rank ")
    assert first.endswith("rewind: snapshot every 3 steps")
    s0, s1 = (f"{100 * c:.0f} %" for c in data["modelled_cost_per_stage"])
    assert second == f"modelled cost per stage: s0 Et*3 {s0} · s1 tmL {s1} · per rank: 50 % / 50 %"
    events = json.loads(timeline.read_text())["events"]
    assert {e["op"] for e in events} >= {"F", "FB"}  # DualPipe ran overlapped F&B units
    assert "bubble rate measured / simulated" in out
    # the simulation uses the run's per-stage costs and hop latency; the rest of the measured bubble is named
    bub = data["bubble_rate"]
    assert bub["hop_latency_s"] >= 0.0 and len(bub["stage_costs_s"]["f"]) == 2
    assert bub["simulated"] >= bub["simulated_compute_only"]
    parts = (bub["simulated_compute_only"] + bub["communication"] + bub["op_time_variance"] + bub["runtime_overhead"]
             + bub["gradient_reduction"])
    assert bub["gradient_reduction"] > 0  # DualPipe all-reduces its mirrored stages' gradients after their last B
    assert parts == pytest.approx(bub["measured"])
    assert f"bubble: {bub['explanation']}" in out
    assert data["data"] == "synthetic" and data["val_loss"] == [None, None]


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
def test_compiled_blocks_train_like_eager(first_run, tmp_path):
    """``--compile``: each block's memory-bound parts compiled (aot_eager: inductor's graphs, compiled fast), the
    linears kept eager for W; the first steps' losses are the eager run's bit for bit. No float tolerance
    would do: the second step's loss follows an optimizer step on FP8 gradients, where a one-ulp change can
    move an element by a whole E4M3 step; aot_eager runs the eager kernels in the eager order, so the two
    runs agree exactly on any CPU (``tests/models/test_compile.py`` says how)."""
    eager = first_run[0]
    data, _ = run_example("--steps", "2", "--fp8", "--compile", "aot_eager", summary=tmp_path / "c.json")
    assert data["compile"] == "aot_eager" and eager["compile"] is None
    assert data["loss"] == eager["loss"][:2]
    assert data["mtp_loss"] == eager["mtp_loss"][:2]


def test_rerun_with_checkpoint_dir_resumes(resumed):
    first, again, out = resumed
    assert first["rewind"] is True and first["rewinds"] == 0 and first["skipped_batches"] == []
    assert first["checkpoints_written"] == 1 and first["resumed_from"] is None and len(first["loss"]) == 3
    assert again["resumed_from"] == 3 and again["first_step"] == 3 and len(again["loss"]) == 2
    assert "resumed from the checkpoint of step 3" in out


@pytest.mark.slow  # NaN rewinds by default: tests/resilience/test_resilience_dist.py, test_rewind_mesh.py
def test_inject_nan_rewinds_once_and_skips_the_batch(tmp_path, resumed):
    data, out = run_example("--steps", "5", "--fp8", "--snapshot-every", "3", "--inject-nan", "4",
                            summary=tmp_path / "s.json")
    assert data["rewinds"] == 1 and data["skipped_batches"] == [4]
    (fault,) = data["faults"]
    assert (fault["step"], fault["position"], fault["rewound_to"], fault["skipped"]) == (4, 4, 3, True)
    assert fault["kind"] == "nonfinite_loss" and fault["ranks"] == [0, 1]
    assert "step 4: non-finite loss" in out and "rewound to step 3, batch 4 skipped" in out
    assert "rewinds / skipped batches" in out
    assert len(data["loss"]) == 5  # the rewound step 3 appears once: the history was rolled back with it
    # steps 0-3 (3 replayed after the rewind) are bit-identical to the clean runs (the resumed one included);
    # step 4 read batch 5 instead
    first, again, _ = resumed
    clean_loss, clean_mtp = first["loss"] + again["loss"], first["mtp_loss"] + again["mtp_loss"]
    assert data["loss"][:4] == clean_loss[:4] and data["mtp_loss"][:4] == clean_mtp[:4]
    assert data["loss"][4] != clean_loss[4]


@pytest.mark.slow  # tests/resilience/test_rewind_mesh.py covers an exception with rebuild by default
def test_inject_error_with_expert_parallelism_rebuilds_and_rewinds(tmp_path):
    """An exception on one rank of a 2 x ep 2 run: its EP partner's all-to-all times out (instead of blocking
    forever), every rank rebuilds its pipeline and EP groups, rewinds once and finishes the run."""
    data, out = run_example("--ep", "2", "--steps", "5", "--snapshot-every", "3", "--inject-error", "4",
                            "--timeout", "5", summary=tmp_path / "s.json")
    assert data["ep"] == 2 and data["rewinds"] == 1 and data["skipped_batches"] == [4]
    (fault,) = data["faults"]
    assert (fault["step"], fault["position"], fault["rewound_to"], fault["skipped"]) == (4, 4, 3, True)
    assert fault["kind"] == "exception" and fault["ranks"] == [0, 1, 2, 3]
    assert "rank 3: InjectedFault: injected fault (rank 3, step 4" in fault["cause"]
    # rank 3's EP partner stopped waiting for it in an expert all-to-all, with a timeout error naming it
    assert "rank 2: PipelineTimeoutError: rank 2 (EP rank 0 of an EP group of 2): waited more than 5s for the " \
           "expert all-to-all (" in fault["cause"]
    assert "rewound to step 3, batch 4 skipped" in out
    assert len(data["loss"]) == 5 and all(2.0 < v < 10.0 for v in data["loss"])


def test_real_text_with_a_bpe_tokenizer_reports_held_out_loss(tmp_path):
    """--corpus FOLDER --tokenizer tokenizer.json on ZB-V: the model takes the tokenizer's vocabulary, trains
    on packed text, and the held-out loss (forward-only pipeline steps) starts near ln V and falls."""
    files = write_corpus(tmp_path / "corpus", files=2, lines=150)
    tok = train_tokenizer(files, tmp_path / "tok" / "tokenizer.json")
    data, out = run_example("--schedule", "zbv", "--steps", "4", "--no-rewind", "--corpus", str(tmp_path / "corpus"),
                            "--tokenizer", str(tok.parent), "--val-every", "10", summary=tmp_path / "s.json")
    packed = PackedText(files, 16, 8, tokenizer=load_tokenizer(tok), val_every=10)
    assert data["data"] == {"corpus": [str(tmp_path / "corpus")], "files": 2, "tokenizer": str(tok), "vocab_size": 300,
                            "train_sequences": packed.num_train, "held_out_sequences": packed.num_val,
                            "val_every": 10}
    assert data["config"]["vocab_size"] == 300
    assert data["rewind"] is False and data["snapshot_every"] is None and data["fp8"] is False
    assert out.splitlines()[0].endswith("rewind: off")
    before, after = data["val_loss"]
    assert abs(before - math.log(300)) < 0.3 and after < before - 0.5
    assert re.search(rf"validation loss \(before → after\) +│ +{before:.3f} → {after:.3f}", out)
    # ZB-V's balanced default: rank 0 no longer holds the embedding, the head and MTP on top of two blocks
    assert data["layout"] != "Et|t|t|tmL" and max(data["modelled_cost_per_rank"]) < 0.56


@pytest.mark.slow  # per-stage HF save and load across ranks: tests/models/test_hf_checkpoint_dist.py
def test_save_pretrained_then_fine_tune_from_it(tmp_path):
    """--save-pretrained writes a Hugging Face checkpoint from both pipeline ranks; --from-pretrained starts
    from it: the fine-tuning run's first loss equals the single-process model loaded from the same folder on
    the same batch (ZB-V: each rank loads its own two stages only)."""
    from types import SimpleNamespace

    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Model

    ckpt = tmp_path / "ckpt"
    first, out = run_example("--steps", "3", "--no-rewind", "--save-pretrained", str(ckpt), summary=tmp_path / "a.json")
    assert f"checkpoint written to {ckpt} (Hugging Face layout)" in out and first["save_pretrained"] == str(ckpt)
    assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors.index.json").is_file()
    tuned, _ = run_example("--schedule", "zbv", "--steps", "1", "--no-rewind", "--from-pretrained", str(ckpt),
                           summary=tmp_path / "b.json")
    assert tuned["from_pretrained"] == str(ckpt)
    loaded = {k: v for k, v in tuned["config"].items() if k != "hf_extra"}  # hf_extra: config.json's other keys
    assert loaded == {k: v for k, v in first["config"].items() if k != "hf_extra"}
    model = DeepSeekV3Model.from_pretrained(ckpt)
    example = _example_module()
    args = SimpleNamespace(seed=0, dp=1, ep=1, micro_batch_size=1, seq_len=16, num_mb=tuned["microbatches"])
    x, y = example.step_batch(args, SimpleNamespace(data=None, config=model.config), 0, 0)
    with torch.no_grad():
        want = sum(float(model.losses(model.hidden(xm), ym).main)
                   for xm, ym in zip(x.tensor_split(args.num_mb), y.tensor_split(args.num_mb))) / args.num_mb
    assert tuned["loss"][0] == pytest.approx(want, rel=1e-5)
    assert want < first["loss"][0] - 0.01  # the checkpoint holds the trained weights, not the seed's


def _example_module():
    return load_script(SCRIPT, "deepseek_v3_repro")


@pytest.mark.parametrize("argv, message", [
    (["--inject-nan", "3", "--no-rewind"], "--inject-nan demonstrates Rewind; drop --no-rewind"),
    (["--steps", "5", "--inject-nan", "5"], "--inject-nan STEP must be a step of this run, 0..4, got 5"),
    (["--inject-error", "3", "--no-rewind"], "--inject-error demonstrates Rewind; drop --no-rewind"),
    (["--steps", "5", "--inject-error", "5"], "--inject-error STEP must be a step of this run, 0..4, got 5"),
    (["--timeout", "0"], "--timeout must be positive, got 0"),
    (["--snapshot-every", "0"], "--snapshot-every must be >= 1, got 0"),
    (["--checkpoint-dir", "x", "--no-rewind"], "--checkpoint-dir is written by Rewind; drop --no-rewind"),
    (["--tokenizer", "tok.json"], "--tokenizer needs --corpus (the text it tokenizes)"),
    (["--corpus", "x", "--val-every", "1"], "--val-every must be >= 2 and --val-batches >= 0, got 1 and 2"),
    (["--layers", "0"], "DeepSeekV3Config.n_layers must be >= 1, got 0 (--layers sets n_layers)"),
    (["--from-pretrained", "ckpt", "--layers", "8"], "--layers and --vocab-size set a preset's shape; "
                                                     "--from-pretrained takes the checkpoint's"),
    (["--corpus", "x", "--vocab-size", "128"], "--vocab-size sets the synthetic task's vocabulary; with --corpus it "
                                               "is the tokenizer's"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _example_module().parse_args(argv)
    assert message in capsys.readouterr().err


def test_memory_savers_lower_the_recorded_peak_as_the_planner_says(tmp_path):
    """--memory-savers all: the same loss (the savers change what backward keeps, not the math, up to
    float rounding), a lower recorded activation peak, and the planner's peak for the run within 10 %; with
    --core-attention flash as well, the runtime records what the planner counts for a fused core."""
    peaks = {}
    for savers, core in (("none", "eager"), ("all", "eager"), ("all", "flash")):
        data, out = run_example("--steps", "1", "--memory-savers", savers, "--core-attention", core,
                                summary=tmp_path / f"{savers}-{core}.json")
        recorded, planned = data["activation_peak_bytes_per_rank"], data["planned_activation_peak_bytes_per_pp_rank"]
        assert len(planned) == data["pp"] and "planner's peak per rank" in out
        for got, want in zip(recorded, planned):
            assert want == pytest.approx(got, rel=0.10), (savers, core, recorded, planned)
        peaks[savers, core] = (max(recorded), data["loss"])
        assert data["memory_savers"] == (sorted(MEMORY_SAVERS) if savers == "all" else [])
    assert peaks["all", "eager"][0] < 0.8 * peaks["none", "eager"][0]
    for key in (("all", "eager"), ("all", "flash")):
        assert peaks[key][1] == pytest.approx(peaks["none", "eager"][1], rel=1e-5)


@pytest.mark.parametrize("argv, message", [
    # the command: the tiny preset's 4 layers cannot fill DualPipe's 8 stages
    (["--pp", "8", "--microbatches", "32"],
     "error: --pp 8 runs dualpipe on 8 stages per chain; its balanced cut E|||t|t|t|t|mL leaves stages 1, 2 without "
     "a layer, and a stage between the first (embedding) and the last (head, MTP, losses) holds no parameter without "
     "one. The 'tiny' preset has 4 layers; the deepest pp they fill under dualpipe is 6. Pass --layers 6 (the "
     "fewest that fill pp 8) or --pp 6"),
    # a V holds 2 stages per rank: 4 layers fill ZB-V at pp 3 at most, pp 4 needs 6
    (["--pp", "4", "--schedule", "zbv"], "The 'tiny' preset has 4 layers; the deepest pp they fill under zbv is 3. "
                                         "Pass --layers 6 (the fewest that fill pp 4) or --pp 3"),
    (["--pp", "8", "--layers", "5"], "leaves stage 1 without a layer"),
    # a recompute policy needs a block on the first stage too: ZB-V's balanced cut keeps it to the embedding
    (["--pp", "8", "--schedule", "zbv", "--layers", "14", "--recompute", "selective"],
     "its balanced cut E|t|t|t|t|t|t|t|t|t|t|t|t|t|t|mL leaves stage 0 without a layer, and --recompute selective "
     "needs one on the first stage too (an embedding-only stage has nothing to recompute). The 'tiny' preset "
     "(--layers 14) has 14 layers; the deepest pp they fill under zbv is 4. Pass --layers 22 (the fewest that fill "
     "pp 8) or --pp 4"),
    (["--pp", "4", "--layout", "Et|||tttmL"], "--layout Et|||tttmL leaves stages 1, 2 without a layer, and a stage "
                                              "between the first (embedding) and the last (head, MTP, losses) holds "
                                              "no parameter without one. The 'tiny' preset has 4 layers. Pass a "
                                              "--layout with a block ('t') in each of stages 1..2"),
])
def test_a_stage_without_a_layer_is_refused_before_any_process_starts(argv, message):
    """The demo refuses, once and before spawning, a run whose cut leaves a stage between the embedding's and
    the head's without a block, naming the stages, the layer count, the deepest pp they fill and what to pass
    (never a data-parallel mode: there is none at dp 1)."""
    with pytest.raises(SystemExit) as exc:
        _example_module().main(argv)
    assert message in str(exc.value.code) and "dp_mode" not in str(exc.value.code)


def test_the_suggested_layers_fill_the_pipeline():
    """What the refusal suggests passes the check: --layers 6 at pp 8 under DualPipe, 14 under ZB-V and DualPipeV,
    and 30 at pp 16, put a block on every stage (22 at pp 8 under ZB-V with recompute, the first stage
    included); the deepest pp it names does too."""
    demo = _example_module()
    for schedule, pp, layers, recompute in (("dualpipe", 8, 6, "none"), ("zbv", 8, 14, "none"),
                                            ("dualpipev", 8, 14, "none"), ("dualpipev", 16, 30, "none"),
                                            ("dualpipe", 6, None, "none"), ("zbv", 8, 22, "selective")):
        extra = ["--layers", str(layers)] if layers else []
        args = demo.parse_args(["--pp", str(pp), "--schedule", schedule, "--recompute", recompute, *extra])
        assert demo.depth_problem(args) is None, (schedule, pp, layers)
    args = demo.parse_args(["--pp", "8", "--schedule", "zbv", "--layers", "13"])
    assert "Pass --layers 14 (the fewest that fill pp 8) or --pp 7" in demo.depth_problem(args)


@pytest.mark.slow  # 8 processes, about 20 s on 2 busy cores; the refusal and the fill are checked above by default
def test_pp8_dualpipe_matches_one_process_and_learns(tmp_path):
    """The demo at pp 8 (8 processes, DualPipe, --layers 6: a block on every stage between the embedding's and
    the head's): its first loss equals the single-process model's on the same batch, and the loss falls."""
    from types import SimpleNamespace

    from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model

    data, out = run_example("--pp", "8", "--layers", "6", "--vocab-size", "128", "--steps", "6", "--no-rewind",
                            summary=tmp_path / "s.json")
    assert (data["pp"], data["schedule"], data["microbatches"]) == (8, "dualpipe", 16)
    assert data["layout"] == "E|t|t|t|t|t|t|mL" and data["config"]["n_layers"] == 6
    assert out.splitlines()[0].startswith("dualpipe · 8 ranks · 16 micro-batches of 1x16 tokens · layout E|t|t|t|")
    torch.manual_seed(0)  # the demo's seed: every rank builds this model and keeps its stages
    model = DeepSeekV3Model(DeepSeekV3Config.preset("tiny", n_layers=6, vocab_size=128, max_seq_len=64))
    args = SimpleNamespace(seed=0, dp=1, ep=1, micro_batch_size=1, seq_len=16, num_mb=16)
    x, y = _example_module().step_batch(args, SimpleNamespace(data=None, config=model.config), 0, 0)
    with torch.no_grad():
        want = sum(float(model.losses(model.hidden(xm), ym).main)
                   for xm, ym in zip(x.tensor_split(16), y.tensor_split(16))) / 16
    assert data["loss"][0] == pytest.approx(want, rel=1e-5)
    assert data["loss"][-1] < data["loss"][0] - 0.1 and data["mtp_loss"][-1] < data["mtp_loss"][0] - 0.1
