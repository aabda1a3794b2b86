"""The schedule compiler core: DualPipe/DualPipeV orders and figures, validate, lower, JSON, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mt_dualpipe.schedules import (
    FB,
    Comm,
    CommBatch,
    Costs,
    Op,
    Program,
    Schedule,
    ScheduleError,
    build_schedule,
    list_schedules,
    lower,
    simulate,
    validate,
    validate_program,
)
from mt_dualpipe.schedules.interchange import schedule_to_dict

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


def unit() -> Costs:
    return Costs(1, 1, 1)


# ---------------------------------------------------------------- DualPipe / DualPipeV --------
@pytest.mark.parametrize("name,P,M", [("dualpipe", 8, 20), ("dualpipev", 4, 10)])
def test_matches_reference_order(name: str, P: int, M: int) -> None:
    golden = GOLDEN / f"{name}_P{P}_M{M}.json"
    if not golden.exists():
        pytest.skip(f"golden file {golden} not present")
    expected = json.loads(golden.read_text())
    assert schedule_to_dict(build_schedule(name, P, M)) == expected
    # and the golden file itself parses, validates and simulates to the documented figures
    s = Schedule.from_json(golden.read_text())
    validate(s)
    r = simulate(s, unit())
    assert r.makespan == 66 and r.busy == [60] * P and max(r.peak_activations) == 9


def test_dualpipe_p8_m20_figures() -> None:
    r = simulate(build_schedule("dualpipe", 8, 20), unit())
    assert r.makespan == 66
    assert r.busy == [60] * 8
    assert r.makespan_bubble == [6] * 8
    assert r.bubble_rate == pytest.approx(6 / 66)
    assert r.peak_activations == [9] * 8
    assert r.span_bubble == [6, 5, 4, 3, 3, 4, 5, 6]


@pytest.mark.parametrize("P", [2, 4, 8, 16])
@pytest.mark.parametrize("extra", [0, 2, 6])
def test_dualpipe_formula(P: int, extra: int) -> None:
    M = 2 * P + extra
    r = simulate(build_schedule("dualpipe", P, M), unit())
    FBc, BW, W = 3, 2, 1
    bubble = (P // 2 - 1) * (FBc + BW - 3 * W)
    assert r.busy == [3 * M] * P
    assert r.makespan == 3 * M + bubble
    assert r.peak_activations == [P + 1] * P


@pytest.mark.parametrize("P", [2, 4, 8, 16])
@pytest.mark.parametrize("extra", [0, 1, 6])
def test_dualpipev_formula(P: int, extra: int) -> None:
    M = 2 * P + extra
    r = simulate(build_schedule("dualpipev", P, M), unit())
    S = 2 * P
    assert r.busy == [6 * M] * P
    assert r.makespan == 6 * M + (S // 2 - 1) * (3 + 2 - 3)
    assert max(r.peak_activations) == S + 1


@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (2, 3, 1), (1, 1, 0.5)])
def test_dualpipe_bubble_nonuniform(f: float, b: float, w: float) -> None:
    P, M = 8, 20
    r = simulate(build_schedule("dualpipe", P, M), Costs(f, b, w))
    fb, bw = f + b + w, b + w
    # the paper's closed form is exact for uniform costs and an upper bound otherwise
    assert r.makespan - r.busy[0] <= (P // 2 - 1) * (fb + bw - 3 * w) + 1e-9
    assert r.makespan - r.busy[0] >= (P // 2 - 1) * (fb + bw - 3 * w) - max(b, f)


def test_dualpipev_p4_m8() -> None:
    r = simulate(build_schedule("dualpipev", 4, 8), unit())
    assert (r.makespan, max(r.peak_activations)) == (54, 9)


def test_dualpipe_placement_and_chains() -> None:
    s = build_schedule("dualpipe", 4, 8)
    assert s.placement == ((0, 1, 2, 3), (3, 2, 1, 0))
    assert s.microbatch_chain == (0, 0, 0, 0, 1, 1, 1, 1)
    assert s.local_stages(1) == [(0, 1), (1, 2)]
    assert s.local_stages(3) == [(0, 3), (1, 0)]


# ---------------------------------------------------------------- parameter errors -------------
@pytest.mark.parametrize("name,P,M,opts,message", [
    ("dualpipe", 5, 20, {}, "dualpipe needs an even number of ranks, got 5"),
    ("dualpipe", 4, 9, {}, "even number of micro-batches"),
    ("dualpipe", 4, 6, {}, "at least 2\\*num_ranks = 8 micro-batches, got 6"),
    ("dualpipev", 4, 7, {}, "at least 2\\*num_ranks = 8 micro-batches, got 7"),
    ("dualpipe", 0, 8, {}, "num_ranks must be at least 1, got 0"),
    ("dualpipe", 4, 2.5, {}, "num_microbatches must be an integer, got 2.5"),
    ("dualpipe", 4, 8, {"virtual_stages": 2}, "unknown option\\(s\\) virtual_stages; it takes no options"),
    ("nope", 4, 8, {}, "unknown schedule 'nope'; available: .*dualpipe"),
])
def test_bad_parameters(name: str, P: object, M: object, opts: dict, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, P, M, **opts)


def test_bad_costs() -> None:
    s = build_schedule("dualpipev", 2, 4)
    with pytest.raises(ScheduleError, match="costs.f has 3 per-stage values but the chain has 4 stages"):
        simulate(s, Costs(f=[1, 1, 1]))
    with pytest.raises(ScheduleError, match="costs.b must be non-negative"):
        simulate(s, Costs(b=-1))
    with pytest.raises(ScheduleError, match="--costs takes 3 to 5 numbers"):
        Costs.parse("1,2")
    with pytest.raises(ScheduleError, match="--costs must be numbers"):
        Costs.parse("1,x,2")


def test_per_stage_costs_heavier_last_stage() -> None:
    s = build_schedule("dualpipev", 2, 4)
    base = simulate(s, unit())
    heavy = simulate(s, Costs(f=[1, 1, 1, 2], b=[1, 1, 1, 2], w=1))
    assert heavy.busy[0] == base.busy[0] + 2 * 4  # stage 3 lives on rank 0; +1 F and +1 B per micro-batch
    assert heavy.busy[1] == base.busy[1]


def test_comm_latency_and_a2a() -> None:
    s = build_schedule("dualpipe", 4, 8)
    base = simulate(s, unit())
    slow = simulate(s, Costs(1, 1, 1, comm=0.5))
    assert slow.makespan > base.makespan and slow.busy == base.busy
    a2a = simulate(s, Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5))
    lone_f = sum(1 for ops in s.ranks[:1] for i in ops if type(i) is Op and i.kind == "F")
    lone_b = sum(1 for ops in s.ranks[:1] for i in ops if type(i) is Op and i.kind in ("B", "BW"))
    assert a2a.busy[0] == pytest.approx(base.busy[0] + 0.5 * (lone_f + lone_b))


# ---------------------------------------------------------------- validate -------------------
def tiny(ranks: list[list]) -> Schedule:
    return Schedule("hand", 2, 1, ((0, 1),), (0,), ranks)


def test_validate_accepts_minimal() -> None:
    validate(tiny([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("F", 0, 1, 0), Op("B", 0, 1, 0), Op("W", 0, 1, 0)]]))


@pytest.mark.parametrize("ranks,message", [
    ([[Op("F", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]], r"rank 0: \(c0,s0,m0\) lacks a BW, or a B and a W"),
    ([[Op("F", 0, 0, 0), Op("B", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]], r"\(c0,s0,m0\) lacks W"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0), Op("F", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]],
     r"rank 0 op 2 F\(c0,s0,m0\): duplicate, already at rank 0 op 0"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0), Op("F", 0, 1, 0)], [Op("BW", 0, 1, 0)]],
     r"rank 0 op 2 F\(c0,s1,m0\): the placement puts chain 0 stage 1 on rank 1"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("F", 0, 1, 3), Op("BW", 0, 1, 0)]], r"micro-batch 3 out of range"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("BW", 0, 1, 0), Op("F", 0, 1, 0)]],
     r"deadlock: rank 1 op 0 BW\(c0,s1,m0\) waits for F\(c0,s1,m0\), which rank 1 runs later or never"),
    ([[Op("F", 0, 0, 0), Op("W", 0, 0, 0), Op("B", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]],
     r"rank 0 op 1 W\(c0,s0,m0\) waits for B\(c0,s0,m0\), which rank 0 runs later"),
    ([[FB(Op("F", 0, 0, 0), Op("BW", 0, 0, 0))], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]],
     r"an FB pairs two different micro-batches"),
])
def test_validate_errors(ranks: list, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(tiny(ranks))


def test_deadlock_cycle_is_named() -> None:
    # each rank first runs a forward whose input the other rank only produces in its second op
    s = Schedule("hand", 2, 2, ((0, 1), (1, 0)), (0, 1), [
        [Op("F", 1, 1, 1), Op("F", 0, 0, 0), Op("BW", 1, 1, 1), Op("BW", 0, 0, 0)],
        [Op("F", 0, 1, 0), Op("F", 1, 0, 1), Op("BW", 0, 1, 0), Op("BW", 1, 0, 1)],
    ])
    with pytest.raises(ScheduleError, match=r"deadlock: ranks wait in a cycle (0 -> 1 -> 0|1 -> 0 -> 1)") as exc:
        validate(s)
    assert "rank 0 op 0 F(c1,s1,m1) waits for F(c1,s0,m1) on rank 1" in str(exc.value)
    assert "rank 1 op 0 F(c0,s1,m0) waits for F(c0,s0,m0) on rank 0" in str(exc.value)


# ---------------------------------------------------------------- lower ----------------------
def all_buildable(P: int, M: int) -> list[Schedule]:
    out = []
    for info in list_schedules():
        if info.name == "auto":
            continue
        try:
            out.append(build_schedule(info.name, P, M))
        except ScheduleError:
            pass
    return out


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_lowered_programs_validate(P: int, M: int) -> None:
    schedules = all_buildable(P, M)
    assert any(s.name == "dualpipe" for s in schedules)
    for s in schedules:
        p = lower(s)
        validate_program(p)
        assert simulate(p, unit()).makespan == simulate(s, unit()).makespan
        # one send and one receive per cross-rank edge
        edges = sum(1 for c, chain in enumerate(s.placement) for m in s.microbatches_of(c)
                    for st_ in range(len(chain) - 1) if chain[st_] != chain[st_ + 1])
        assert p.num_comm_ops() == 4 * edges, s.name


def test_lowered_sends_follow_producers_and_recvs_precede_consumers() -> None:
    p = lower(build_schedule("dualpipe", 4, 8))
    for prog in p.ranks:
        done: set = set()
        for ins in prog:
            if type(ins) is CommBatch:
                for c in ins.ops:
                    if c.kind == "SEND_F":
                        assert ("F", c.chain, c.stage, c.mb) in done
                    elif c.kind == "SEND_B":
                        assert ("B", c.chain, c.stage, c.mb) in done
                    elif c.kind == "RECV_F":
                        assert ("F", c.chain, c.stage, c.mb) not in done
                    else:
                        assert ("B", c.chain, c.stage, c.mb) not in done
            else:
                for op in ((ins.f, ins.b) if type(ins) is FB else (ins,)):
                    done.add(("B" if op.kind == "BW" else op.kind, op.chain, op.stage, op.mb))


def test_lowering_posts_receives_as_early_as_the_order_allows() -> None:
    """A receive sits right after the last local op that starts before its producer ends (reference run)."""
    s = build_schedule("dualpipe", 8, 20)
    p = lower(s)
    ref = simulate(s, unit())
    starts: list[list[float]] = [[] for _ in range(8)]
    for e in ref.timeline:
        starts[e.rank].append(e.start)
    start = {(r, k): t for r in range(8) for k, t in enumerate(starts[r])}
    end_of: dict = {}
    for e in ref.timeline:
        end_of[(e.op if e.op != "FB" else "F", e.chain, e.stage, e.mb)] = e.end
        if e.pair:
            end_of[("B" if e.pair[0] == "BW" else e.pair[0], *e.pair[1:])] = e.end
    for e in ref.timeline:
        if e.op == "BW":
            end_of[("B", e.chain, e.stage, e.mb)] = e.end
    prefetched = 0
    for r, prog in enumerate(p.ranks):
        k = 0  # index of the next compute op
        for ins in prog:
            if type(ins) is not CommBatch:
                k += 1
                continue
            for c in ins.ops:
                if not c.kind.startswith("RECV"):
                    continue
                producer = (("F", c.chain, c.stage - 1, c.mb) if c.kind == "RECV_F"
                            else ("B", c.chain, c.stage + 1, c.mb))
                t = end_of[producer]
                assert k == 0 or start[(r, k - 1)] < t  # cannot move before the previous op
                assert (r, k) not in start or start[(r, k)] >= t  # the next op starts after the transfer
                consumer_index = next(j for j, item in enumerate(p.compute_ops(r))
                                      for op in ((item.f, item.b) if type(item) is FB else (item,))
                                      if (op.chain, op.stage, op.mb) == (c.chain, c.stage, c.mb)
                                      and (op.kind == "F") == (c.kind == "RECV_F"))
                prefetched += consumer_index > k
    assert prefetched > 0


def test_broken_program_order_is_a_deadlock() -> None:
    s = build_schedule("dualpipe", 2, 4)
    p = lower(s)
    # move rank 0's first receive batch after the op that consumes it
    prog = p.ranks[1]
    i = next(i for i, ins in enumerate(prog) if type(ins) is CommBatch and ins.ops[0].kind == "RECV_F")
    prog[i], prog[i + 1] = prog[i + 1], prog[i]
    with pytest.raises(ScheduleError, match="receive is not posted before it"):
        validate_program(p)


def test_crossed_channel_order_is_caught() -> None:
    p = lower(build_schedule("gpipe", 2, 4))
    prog = p.ranks[1]
    idx = [i for i, ins in enumerate(prog) if type(ins) is CommBatch and ins.ops[0].kind == "RECV_F"]
    first, second = prog[idx[0]], prog[idx[1]]
    # post both receives up front, in crossed order: m1 first, then m0
    prog[idx[0]] = CommBatch(second.ops + first.ops)
    del prog[idx[1]]
    with pytest.raises(ScheduleError, match=r"channel rank 0 -> rank 1: send #0 carries .* must pair up in order"):
        validate_program(p)


def test_rendezvous_deadlock_detected() -> None:
    """Each rank posts a lone receive from the other before its send: fine for buffered sends,
    a deadlock under rendezvous semantics (each comm stream is stuck on its receive)."""
    F0, F1, B0, B1 = Op("F", 0, 0, 0), Op("F", 1, 1, 1), Op("BW", 1, 1, 1), Op("BW", 0, 0, 0)
    G0, G1, C0, C1 = Op("F", 1, 0, 1), Op("F", 0, 1, 0), Op("BW", 0, 1, 0), Op("BW", 1, 0, 1)
    sched = Schedule("hand", 2, 2, ((0, 1), (1, 0)), (0, 1), [[F0, F1, B0, B1], [G0, G1, C0, C1]])
    validate(sched)
    prog = Program(sched, [
        [CommBatch((Comm("RECV_F", 1, 1, 1, 1),)), F0, CommBatch((Comm("SEND_F", 1, 0, 0, 0),)), F1, B0,
         CommBatch((Comm("SEND_B", 1, 1, 1, 1),)), CommBatch((Comm("RECV_B", 1, 0, 0, 0),)), B1],
        [CommBatch((Comm("RECV_F", 0, 0, 1, 0),)), G0, CommBatch((Comm("SEND_F", 0, 1, 0, 1),)), G1, C0,
         CommBatch((Comm("SEND_B", 0, 0, 1, 0),)), CommBatch((Comm("RECV_B", 0, 1, 0, 1),)), C1],
    ])
    with pytest.raises(ScheduleError, match="deadlock under rendezvous point-to-point semantics") as exc:
        validate_program(prog)
    assert ("rank 0 instruction 3 F(c1,s1,m1) waits for comm batch 0 (the receive of F(c1,s0,m1) from rank 1) "
            "to complete") in str(exc.value)
    # the lowered program of the same schedule is fine
    validate_program(lower(sched))


# ---------------------------------------------------------------- interchange ----------------
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_json_round_trip(P: int, M: int) -> None:
    for s in all_buildable(P, M):
        text = s.to_json()
        back = Schedule.from_json(text)
        assert back.to_json() == text
        assert back.ranks == s.ranks and back.placement == s.placement
        d = json.loads(text)
        assert d["format"] == "mt-dualpipe.schedule/1"
        assert set(d) == {"format", "name", "num_ranks", "num_microbatches", "placement", "microbatch_chain", "ranks"}


@pytest.mark.parametrize("text,message", [
    ("{", "schedule is not valid JSON"),
    ('{"format": "x"}', 'must have "format": "mt-dualpipe.schedule/1"'),
    ('{"format": "mt-dualpipe.schedule/1", "name": "a"}', "lacks the field"),
    ('{"format": "mt-dualpipe.schedule/1", "name": "a", "num_ranks": 1, "num_microbatches": 1, "placement": [[0]],'
     ' "microbatch_chain": [0], "ranks": [[{"op": "X", "chain": 0, "stage": 0, "mb": 0}]]}', "op must be one of"),
])
def test_json_errors(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_json(text)


def test_pipelining_csv() -> None:
    csv = build_schedule("dualpipev", 2, 4).to_pipelining_csv()
    rows = csv.strip().split("\n")
    assert len(rows) == 2
    assert rows[0].split(",")[:4] == ["0F0", "0F1", "0F2", "3F0"]
    assert sum(len(r.split(",")) for r in rows) == 4 * 4 * 3 - sum(
        1 for ops in build_schedule("dualpipev", 2, 4).ranks for i in ops
        for p in ((i.f, i.b) if type(i) is FB else (i,)) if p.kind == "BW")
    with pytest.raises(ScheduleError, match="only single-chain schedules"):
        build_schedule("dualpipe", 2, 4).to_pipelining_csv()


# ---------------------------------------------------------------- properties -----------------
@st.composite
def schedule_case(draw):
    names = [i.name for i in list_schedules() if i.name != "auto"]
    name = draw(st.sampled_from(names))
    P = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    M = draw(st.integers(1, 24))
    return name, P, M


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schedule_case(), f=st.floats(0.1, 3), b=st.floats(0.1, 3), w=st.floats(0.0, 3), comm=st.floats(0, 1))
def test_property_valid_schedules_run(case, f, b, w, comm) -> None:
    name, P, M = case
    try:
        s = build_schedule(name, P, M)
    except ScheduleError as exc:  # a refusal must say why, never be an AssertionError
        assert str(exc)
        return
    validate(s)
    p = lower(s)
    validate_program(p)
    r = simulate(s, Costs(f, b, w, comm=comm))
    assert len(r.timeline) == s.num_ops()
    n_parts = sum(2 if type(i) is FB else 1 for ops in s.ranks for i in ops)
    assert n_parts == sum(len(s.placement[c]) for c in s.microbatch_chain) * 2 + sum(
        1 for ops in s.ranks for i in ops for q in ((i.f, i.b) if type(i) is FB else (i,)) if q.kind == "W")
    assert r.makespan >= max(r.busy) - 1e-9
    assert all(x >= -1e-9 for x in r.span_bubble)


# ---------------------------------------------------------------- command line ---------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mt_dualpipe", *args], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


def test_cli_list_show_compare_export(tmp_path: Path) -> None:
    out = run_cli("list")
    assert out.returncode == 0 and "dualpipev" in out.stdout and "M >= 2P" in out.stdout
    out = run_cli("show", "dualpipe", "-p", "8", "-m", "20")
    assert out.returncode == 0 and "makespan 66" in out.stdout and "9.09 %" in out.stdout
    out = run_cli("compare", "-p", "8", "-m", "20")
    assert out.returncode == 0 and "dualpipe" in out.stdout and "★" in out.stdout
    path = tmp_path / "s.json"
    out = run_cli("export", "dualpipe", "-p", "4", "-m", "8", "-o", str(path))
    assert out.returncode == 0, out.stderr
    assert Schedule.from_json(path.read_text()).ranks == build_schedule("dualpipe", 4, 8).ranks
    out = run_cli("show", "dualpipe", "-p", "5", "-m", "20")
    assert out.returncode == 2 and "dualpipe needs an even number of ranks, got 5" in out.stderr
    for sub in ("list", "show", "compare", "export"):
        assert run_cli(sub, "--help").returncode == 0
