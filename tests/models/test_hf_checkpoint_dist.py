"""Checkpoints over several gloo ranks: expert-parallel ranks read only their experts; a DualPipe
pipeline saved from every rank (mirrored stages, EP shards) loads back as the original model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, build_stages, stages_for_rank
from mt_dualpipe.models.hf_checkpoint import Checkpoint, save_pipeline_checkpoint
from mt_dualpipe.schedules import build_schedule
from tests.helpers.dist import run_ranks

torch.set_num_threads(1)


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=64, n_layers=4, vocab_size=128, inter_dim=128, moe_inter_dim=32, max_seq_len=64)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


def _ep_load_worker(rank, world, path):
    config = small_config()
    ckpt = Checkpoint(path)
    (stage,) = build_stages(config, 2, checkpoint=ckpt, indices=[1], ep_group=dist.group.WORLD)
    per_rank = config.n_routed_experts // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    experts = {n.split(".mlp.experts.")[1].split(".")[0] for n in ckpt.read_names if ".mlp.experts." in n}
    assert experts == {str(e) for e in mine}, experts
    full = DeepSeekV3Model.from_pretrained(path)
    for k, v in stage.state_dict().items():
        assert torch.equal(v, full.state_dict()[k]), k
    return len(ckpt.read_names)


def test_expert_parallel_ranks_read_only_their_experts(tmp_path):
    config = small_config()
    torch.manual_seed(0)
    DeepSeekV3Model(config).save_pretrained(tmp_path, max_shard_size=100_000)
    counts = run_ranks(_ep_load_worker, 2, str(tmp_path), timeout=240)
    assert counts[0] == counts[1]


def _save_worker(rank, world, path, schedule):
    config = small_config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    sched = build_schedule(schedule, world, 4)
    mods = stages_for_rank(config, sched, rank, source=model)
    save_pipeline_checkpoint(mods, path)
    back = DeepSeekV3Model.from_pretrained(path)
    return all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("schedule, files", [
    ("1f1b", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
    # DualPipe: rank 0 holds stage 0 of one direction and stage 1 of the other, i.e. every tensor once;
    # the mirrored copies on rank 1 are not written again
    ("dualpipe", ["model-00001-of-00002.safetensors"]),
])
def test_pipeline_saved_from_every_rank_round_trips(tmp_path, schedule, files):
    assert run_ranks(_save_worker, 2, str(tmp_path / "ckpt"), schedule, timeout=240) == [True, True]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors")) == files
