"""The default DeepSeek-V3 stage layout is balanced per rank by modelled cost (issue: V schedules put the
embedding, head and MTP all on rank 0)."""

from __future__ import annotations

import itertools
import time

import pytest

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, parse_layout, stages_for_rank
from mt_dualpipe.models.deepseek_v3.stage_balance import (
    balance,
    balanced_layout,
    layout_cost,
    piece_costs,
    stage_weights,
)
from mt_dualpipe.schedules import build_schedule

TINY = DeepSeekV3Config.preset("tiny", max_seq_len=64)
SMALL_VOCAB = DeepSeekV3Config.preset("tiny", vocab_size=64, max_seq_len=32)  # benchmarks/moe_overlap.py's sizes


def brute_force_best_max_rank(config, placement) -> float:
    costs, weights = piece_costs(config), stage_weights(placement)
    S = len(placement[0])
    return min(max(layout_cost(costs, c, weights).ranks)
               for c in itertools.product(range(config.n_layers + 1), repeat=S) if sum(c) == config.n_layers)


def test_tail_and_blocks_weigh_what_the_model_says():
    pc = piece_costs(TINY)
    moe = pc.blocks[1]
    assert pc.blocks[0] < moe  # the dense first layer is cheaper than a MoE layer at the tiny preset
    assert pc.tail > 2 * moe   # head + MTP (a MoE block, a projection, the head again) + two losses
    assert pc.embedding < 0.01 * moe
    assert pc.total == pytest.approx(pc.embedding + sum(pc.blocks) + pc.tail)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_no_longer_load_rank0_with_embedding_head_and_mtp(name):
    placement = build_schedule(name, 2, 8).placement
    old = layout_cost(piece_costs(TINY), parse_layout(TINY, 4), stage_weights(placement))
    new = balance(TINY, placement)
    assert old.counts == (1, 1, 1, 1)
    assert old.spread > 1.9                    # rank 0 carried about twice rank 1's cost
    assert new.spread < 1.05 and new.spread < old.spread
    assert max(new.ranks) == pytest.approx(brute_force_best_max_rank(TINY, placement))
    assert sum(new.ranks) == pytest.approx(1.0) and sum(new.counts) == TINY.n_layers


@pytest.mark.parametrize("name,P", [("1f1b", 2), ("1f1b", 4), ("zbv", 4), ("interleaved-1f1b", 2), ("dualpipe", 4)])
def test_balanced_layout_is_the_best_per_rank_and_never_worse_than_counting_blocks(name, P):
    placement = build_schedule(name, P, 4 * P).placement
    S = len(placement[0])
    old = layout_cost(piece_costs(TINY), parse_layout(TINY, S), stage_weights(placement))
    new = balance(TINY, placement)
    assert max(new.ranks) == pytest.approx(brute_force_best_max_rank(TINY, placement))
    assert max(new.ranks) <= max(old.ranks) + 1e-12


def test_dualpipe_ranks_are_equal_so_the_heaviest_stage_decides():
    """Each DualPipe rank runs stage r of one chain and P-1-r of the other: rank loads never differ, and the
    layout then minimises the heaviest stage (at the tiny preset: three blocks before the tail, not two)."""
    placement = build_schedule("dualpipe", 2, 4).placement
    assert stage_weights(placement) == [{0: 0.5, 1: 0.5}, {1: 0.5, 0: 0.5}]
    got = balance(TINY, placement)
    assert got.ranks[0] == pytest.approx(got.ranks[1])
    assert got.counts == (3, 1)
    assert max(got.stages) < max(layout_cost(piece_costs(TINY), [2, 2], stage_weights(placement)).stages)


@pytest.mark.parametrize("name,P", [("zbv", 16), ("1f1b", 16)])
def test_large_model_search_is_quick_and_never_worse_than_counting_blocks(name, P):
    """61 layers over 32 (or 16) stages is past the exhaustive search: the block-move search must not end
    worse than the block-count layout it may start from (1F1B: the count layout leaves the tail-heavy last
    stage 15 % above the mean; the search gets the heaviest rank down to one block's granularity)."""
    config = DeepSeekV3Config.preset("671b")
    placement = build_schedule(name, P, 2 * P).placement
    S = len(placement[0])
    t0 = time.perf_counter()
    new = balance(config, placement)
    assert time.perf_counter() - t0 < 10.0
    old = layout_cost(piece_costs(config), parse_layout(config, S), stage_weights(placement))
    assert sum(new.counts) == config.n_layers and len(new.counts) == S
    assert new.key() <= old.key()
    if name == "1f1b":
        assert max(new.ranks) < max(old.ranks) and new.spread < old.spread


def test_stages_for_rank_defaults_to_the_balanced_layout():
    sched = build_schedule("zbv", 2, 4)
    counts = balanced_layout(TINY, sched.placement)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    for rank in range(2):
        mods = stages_for_rank(TINY, sched, rank)
        for (_, stage), mod in zip(sched.local_stages(rank), mods):
            want = [str(i) for i in range(starts[stage], starts[stage] + counts[stage])]
            assert list(mod.model.layers) == want


def test_unequal_chains_are_refused():
    with pytest.raises(ValueError, match=r"placement must list chains of equal length, got \(\(0, 1\), \(0,\)\)"):
        balanced_layout(TINY, ((0, 1), (0,)))


def test_f_and_b_units_give_a_block_to_the_partner_of_a_communicating_stage():
    """Under DualPipeV's F&B units rank 0 pairs stage 0 with stage 3. At the overlap benchmark's sizes the cost
    balance alone leaves stage 0 the embedding (nothing to hide stage 3's all-to-alls behind); with ``fb_units``
    the cut is the best-balanced one among those where every stage beside a partner holding MoE blocks holds a
    block (the MTP module counts as one)."""
    from mt_dualpipe.planner.stage_cut import unit_pairs
    from mt_dualpipe.schedules.registry import has_fb_units

    assert has_fb_units("dualpipe") and has_fb_units("dualpipev")
    assert not has_fb_units("zbv") and not has_fb_units("1f1b") and not has_fb_units("no such schedule")
    placement = build_schedule("dualpipev", 2, 8).placement
    assert unit_pairs(placement) == ((0, 3), (1, 2))
    assert balance(SMALL_VOCAB, placement).counts == (0, 2, 1, 1)
    got = balance(SMALL_VOCAB, placement, fb_units=True)
    costs, weights = piece_costs(SMALL_VOCAB), stage_weights(placement)

    def allowed(counts) -> bool:
        moe = [sum(1 for i in range(sum(counts[:s]), sum(counts[:s + 1])) if i >= SMALL_VOCAB.n_dense_layers) > 0
               for s in range(4)]
        moe[3] = True  # the MTP module is an MoE block
        block = [c > 0 for c in counts]
        block[3] = True
        return all(not (moe[a] and not block[b]) and not (moe[b] and not block[a]) for a, b in ((0, 3), (1, 2)))

    layouts = [c for c in itertools.product(range(5), repeat=4) if sum(c) == SMALL_VOCAB.n_layers]
    assert allowed(got.counts) and got.counts[0] > 0
    assert max(got.ranks) == pytest.approx(min(max(layout_cost(costs, c, weights).ranks)
                                               for c in layouts if allowed(c)))
    assert balance(SMALL_VOCAB, build_schedule("zbv", 2, 8).placement).counts == (0, 2, 1, 1)
    # DualPipe's mirrored chains already give both stages MoE blocks: the rule changes nothing there
    dual = build_schedule("dualpipe", 2, 8).placement
    assert balance(SMALL_VOCAB, dual, fb_units=True).counts == balance(SMALL_VOCAB, dual).counts == (3, 1)


@pytest.mark.parametrize("name,P", [("dualpipev", 16), ("dualpipe", 16)])
def test_the_f_and_b_rule_changes_no_cut_at_full_scale(name, P):
    """At 671B the first stage holds blocks anyway, so the cut the planner's 671B figures rest on stays."""
    config = DeepSeekV3Config.preset("671b")
    placement = build_schedule(name, P, 2 * P).placement
    assert balance(config, placement, fb_units=True).counts == balance(config, placement).counts


def test_stages_for_rank_takes_the_f_and_b_cut_on_dualpipev():
    sched = build_schedule("dualpipev", 2, 8)
    counts = balanced_layout(SMALL_VOCAB, sched.placement, fb_units=True)
    assert counts != balanced_layout(SMALL_VOCAB, sched.placement)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    for rank in range(2):
        mods = stages_for_rank(SMALL_VOCAB, sched, rank)
        for (_, stage), mod in zip(sched.local_stages(rank), mods):
            assert list(mod.model.layers) == [str(i) for i in range(starts[stage], starts[stage] + counts[stage])]
