"""Schedules without processes: action tables, lowering, validation, simulation, drawing."""

import json
from fractions import Fraction

import pytest

from pipekit.schedules import (
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    TimelineEvent,
    build_schedule,
    generate,
    gpipe,
    interleaved_1f1b,
    looping_placement,
    lower,
    one_f_one_b,
    plan_report,
    render_text,
    schedule_from_table,
    simulate,
    to_chrome_trace,
    validate,
)


def text(ranks):
    return [" ".join(str(a) for a in actions) for actions in ranks]


def parse(rows):
    return [[Action.parse(t) for t in row.split()] for row in rows]


# ---------------------------------------------------------------- Action text


@pytest.mark.parametrize(
    "text_form, action",
    [
        ("0F1", Action(0, Kind.F, 1)),
        ("3B0", Action(3, Kind.B, 0)),
        ("12W7", Action(12, Kind.W, 7)),
        ("1I2", Action(1, Kind.I, 2)),
        ("0SEND_F1", Action(0, Kind.SEND_F, 1)),
        ("4RECV_F0", Action(4, Kind.RECV_F, 0)),
        ("1SEND_B3", Action(1, Kind.SEND_B, 3)),
        ("2RECV_B5", Action(2, Kind.RECV_B, 5)),
    ],
)
def test_action_text_round_trip(text_form, action):
    assert str(action) == text_form
    assert Action.parse(text_form) == action
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("bad", ["", "F1", "0F", "0X1", "0f1", "a0F1", "0F1x", "-1F0", "0SEND1", "0 F 1"])
def test_action_parse_rejects_bad_text(bad):
    with pytest.raises(ValueError, match="cannot parse action") as err:
        Action.parse(bad)
    assert repr(bad) in str(err.value)
    assert isinstance(err.value, ScheduleError)


def test_action_parse_points_the_old_fused_form_at_b():
    with pytest.raises(ScheduleError, match="the full backward is 'B' \\('1B2'\\)"):
        Action.parse("1BW2")


def test_action_coerces_and_rejects_kind_strings():
    assert Action(0, "F", 1) == Action(0, Kind.F, 1)
    with pytest.raises(ScheduleError, match="unknown action kind 'Q'"):
        Action(0, "Q", 1)


# ---------------------------------------------------------------- generators

COMPUTE_TABLE = [
    ("gpipe", 2, 2, 1, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]),
    ("gpipe", 1, 3, 1, ["0F0 0F1 0F2 0B0 0B1 0B2"]),
    ("1f1b", 2, 3, 1, ["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"]),
    ("1f1b", 3, 2, 1, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2B0 2F1 2B1"]),
    (
        "1f1b",
        4,
        5,
        1,
        [
            "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0B2 0B3 0B4",
            "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1B3 1B4",
            "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2B4",
            "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4",
        ],
    ),
    ("interleaved_1f1b", 2, 2, 2, ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]),
    (
        "interleaved_1f1b",
        2,
        4,
        2,
        [
            "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
            "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
        ],
    ),
]


@pytest.mark.parametrize("name, pp, m, v, expected", COMPUTE_TABLE)
def test_generated_compute_actions(name, pp, m, v, expected):
    assert text(generate(name, pp, m, v)) == expected
    schedule = build_schedule(name, pp, m, v)
    assert text(schedule.compute_actions(r) for r in range(pp)) == expected


def test_named_generators_match_generate():
    assert gpipe(3, 4) == generate("gpipe", 3, 4)
    assert one_f_one_b(3, 4) == generate("1f1b", 3, 4)
    assert interleaved_1f1b(3, 6, 2) == generate("interleaved_1f1b", 3, 6, 2)


@pytest.mark.parametrize("pp, m", [(1, 1), (2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_interleaved_with_one_chunk_is_1f1b(pp, m):
    assert interleaved_1f1b(pp, m, 1) == one_f_one_b(pp, m)


def test_looping_placement():
    assert looping_placement(4, 1) == (0, 1, 2, 3)
    assert looping_placement(2, 3) == (0, 1, 0, 1, 0, 1)


def test_schedule_accessors():
    s = build_schedule("interleaved_1f1b", 2, 2, 2)
    assert isinstance(s, Schedule) and s.num_stages == 4
    assert [s.stage_rank(k) for k in range(4)] == [0, 1, 0, 1]
    assert s.local_stages(1) == [1, 3]
    assert all(a.is_compute for a in s.compute_actions(0))
    with pytest.raises(ScheduleError, match="stage 4"):
        s.stage_rank(4)
    with pytest.raises(ScheduleError, match="rank 2"):
        s.local_stages(2)


# ---------------------------------------------------------------- lowering

LOWERED_TABLE = [
    (
        "1f1b",
        2,
        2,
        1,
        [
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        ],
    ),
    (
        "interleaved_1f1b",
        2,
        2,
        2,
        [
            "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 "
            "2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 "
            "3RECV_F1 3F1 3B1 3SEND_B1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1",
        ],
    ),
    ("gpipe", 1, 2, 1, ["0F0 0F1 0B0 0B1"]),
    ("interleaved_1f1b", 1, 1, 2, ["0F0 1F0 1B0 0B0"]),
]


@pytest.mark.parametrize("name, pp, m, v, expected", LOWERED_TABLE)
def test_lowered_actions(name, pp, m, v, expected):
    assert text(build_schedule(name, pp, m, v).ranks) == expected


def test_lowering_holds_a_send_until_its_pair_order_allows():
    # Rank 0 finishes F1 before F0, but rank 1 receives microbatch 0 first.
    compute = parse(["0F1 0F0 0B0 0B1", "1F0 1F1 1B0 1B1"])
    lowered = lower(compute, (0, 1))
    assert text(lowered)[0] == "0F1 0F0 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
    validate(lowered, (0, 1), 2)


def test_lowering_rejects_a_message_nobody_produces():
    with pytest.raises(ScheduleError, match="never sends 0SEND_F1"):
        lower(parse(["0F0 0B0 0B1", "1F0 1F1 1B0 1B1"]), (0, 1))


def test_lowering_rejects_comm_actions_in_its_input():
    with pytest.raises(ScheduleError, match="compute actions only"):
        lower(parse(["0F0 0SEND_F0"]), (0,))


# ---------------------------------------------------------------- validation


def _sweep():
    for pp in range(1, 9):
        for m in range(1, 33):
            yield "gpipe", pp, m, 1
            yield "1f1b", pp, m, 1
            if m % pp == 0:
                for v in (2, 3, 4):  # one chunk is refused: that is 1f1b
                    yield "interleaved_1f1b", pp, m, v


def test_every_generator_validates_over_a_sweep():
    count = 0
    for name, pp, m, v in _sweep():
        schedule = build_schedule(name, pp, m, v)  # generate -> lower -> validate
        assert len(schedule.ranks) == pp and sum(map(len, schedule.ranks)) >= 2 * pp * m * v
        count += 1
    assert count > 700


GOOD_1F1B = [
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
]


@pytest.mark.parametrize(
    "rows, placement, m, message",
    [
        pytest.param(
            ["0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1", GOOD_1F1B[1]],
            (0, 1),
            2,
            "rank 0 -> rank 1, message 0: rank 0 sends 0SEND_F1 but rank 1 receives 1RECV_F0",
            id="swapped-pair-order",
        ),
        pytest.param(
            [GOOD_1F1B[0], "1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"],
            (0, 1),
            2,
            "rank 1 step 4: 1F1 needs 1RECV_F1 earlier (its input); it is missing",
            id="missing-recv",
        ),
        pytest.param(
            ["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
            (0, 1),
            1,
            "deadlock: rank 0 waits on 0RECV_B0 (step 0) from rank 1; "
            "rank 1 waits on 1RECV_F0 (step 0) from rank 0",
            id="deadlock-both-receive-first",
        ),
        pytest.param(
            ["0B0 0F0"],
            (0,),
            1,
            "rank 0 step 0: 0B0 needs 0F0 earlier (backward needs its forward); it is at step 1",
            id="b-before-f",
        ),
        pytest.param(
            ["0F0 0B0", "1F0 1B0"],
            (0, 1),
            1,
            "rank 0 step 1: 0B0 needs 0RECV_B0 earlier (its output grad); it is missing",
            id="unlowered",
        ),
        pytest.param(
            ["0F0 1F0 1B0"],
            (0, 0),
            1,
            "stage 0 microbatch 0 (rank 0) needs either B (full backward) or I and W (split backward), found none",
            id="missing-b",
        ),
        pytest.param(["0F0 0B0 0I0 0W0"], (0,), 1, "found ['B', 'I', 'W']", id="b-and-split"),
        pytest.param(["0F0 0B0 0W0"], (0,), 1, "found ['B', 'W']", id="w-after-full-b"),
        pytest.param(["0F0 0I0"], (0,), 1, "found ['I']", id="i-without-w"),
        pytest.param(["0F0 0W0 0I0"], (0,), 1, "0W0 needs 0I0 earlier (weight grad after input grad)", id="w-before-i"),
        pytest.param(["0F0 0F0 0B0"], (0,), 1, "0F0 appears 2 times", id="duplicate"),
        pytest.param(["1F0 1B0", "0F0 0B0"], (0, 1), 1, "stage 1 is placed on rank 1", id="wrong-rank"),
        pytest.param(["0F0 0B0 0F3 0B3"], (0,), 2, "names microbatch 3; valid are 0..1", id="bad-microbatch"),
        pytest.param(["0F0 0SEND_F0 1F0 1B0 0B0"], (0, 0), 1, "talks to stage 1 on the same rank", id="local-send"),
        pytest.param(["0F0 0B0 0SEND_B0"], (0,), 1, "talks to stage -1, which does not exist", id="send-off-the-end"),
        pytest.param(
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0"],
            (0, 1),
            1,
            "rank 1 -> rank 0, message 0: rank 1 sends nothing but rank 0 receives 0RECV_B0",
            id="missing-send",
        ),
        pytest.param(["0F0 0B0"], (0, 3), 1, "placement (0, 3)", id="bad-placement"),
    ],
)
def test_validate_catches_broken_schedules(rows, placement, m, message):
    with pytest.raises(ScheduleError) as err:
        validate(parse(rows), placement, m)
    assert message in str(err.value)


def test_validate_accepts_split_and_full_backward():
    split = parse(["0F0 0SEND_F0 0RECV_B0 0I0 0W0", "1RECV_F0 1F0 1I0 1SEND_B0 1W0"])
    full = parse(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    mixed = parse(["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0I1 0W1", "1RECV_F0 1F0 1I0 1SEND_B0 "
                   "1RECV_F1 1F1 1B1 1SEND_B1 1W0"])
    validate(split, (0, 1), 1)
    validate(full, (0, 1), 1)
    validate(mixed, (0, 1), 2)


def test_validate_forward_only_programs():
    validate(parse(["0F0 0SEND_F0", "1RECV_F0 1F0"]), (0, 1), 1, backward=False)
    with pytest.raises(ScheduleError, match="a forward-only program has no backward, found \\['B'\\]"):
        validate(parse(["0F0 0B0"]), (0,), 1, backward=False)


# ---------------------------------------------------------------- simulation


def _schedule(rows, placement, m, name="hand"):
    pp = max(placement) + 1
    return Schedule(name, pp, len(placement) // pp, m, tuple(placement), tuple(tuple(r) for r in parse(rows)))


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, 31])
def test_1f1b_bubble_is_exact(pp, m):
    result = simulate(build_schedule("1f1b", pp, m))
    assert result.makespan == 3 * (m + pp - 1)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert result.peak_activations == [min(m, pp - r) for r in range(pp)]


@pytest.mark.parametrize("pp, m", [(1, 1), (2, 5), (4, 8), (8, 3)])
def test_gpipe_bubble_and_memory(pp, m):
    result = simulate(build_schedule("gpipe", pp, m))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert result.peak_activations == [m] * pp


def test_bubble_figures_pp4_m8():
    """Under F=1, B=2 per virtual stage the bubble is (p-1)/(v*m + p-1) for all three."""
    figures = {
        v: simulate(build_schedule("interleaved_1f1b" if v > 1 else "1f1b", 4, 8, v)).bubble_fraction
        for v in (1, 2, 4)
    }
    assert simulate(build_schedule("gpipe", 4, 8)).bubble_fraction == pytest.approx(3 / 11)
    assert figures[1] == pytest.approx(3 / 11)
    assert figures[2] == pytest.approx(3 / 19)
    assert figures[4] == pytest.approx(3 / 35)
    # As a fraction of the (longer) step, the bubble shrinks by 1.73x and 3.18x...
    assert figures[1] / figures[2] == pytest.approx(19 / 11)
    assert figures[1] / figures[4] == pytest.approx(35 / 11)


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_cuts_idle_time_by_v(v):
    """...while idle time for the same model (each chunk costs 1/v) shrinks by exactly v."""
    base = simulate(build_schedule("1f1b", 4, 8))
    costs = {"F": Fraction(1, v), "B": Fraction(2, v)}
    inter = simulate(build_schedule("interleaved_1f1b", 4, 8, v), costs)
    idle = lambda r: r.makespan * r.bubble_fraction  # noqa: E731
    assert idle(base) == pytest.approx(9.0)
    assert idle(base) / idle(inter) == pytest.approx(v)
    assert inter.makespan == pytest.approx(24 + 9 / v)


def test_interleaved_peak_activations():
    assert simulate(build_schedule("interleaved_1f1b", 4, 8, 2)).peak_activations == [11, 9, 7, 5]


def test_simulate_costs_latency_and_timeline():
    s = build_schedule("1f1b", 2, 2)
    result = simulate(s, {"F": 1, "B": 1}, comm_latency=0.5)
    assert all(isinstance(e, TimelineEvent) for e in result.timeline)
    assert {e.action for e in result.timeline} == {str(a) for r in range(2) for a in s.compute_actions(r)}
    first = {(e.rank, e.action): (e.start, e.end) for e in result.timeline}
    assert first[(1, "1F0")] == (1.5, 2.5)  # 0F0 ends at 1, plus latency
    assert result.makespan == pytest.approx(7.0)
    assert len(result.bubble_per_rank) == 2


def test_simulate_split_backward_memory():
    s = _schedule(["0F0 0SEND_F0 0RECV_B0 0I0 0W0", "1RECV_F0 1F0 1I0 1SEND_B0 1W0"], (0, 1), 1)
    result = simulate(s)
    assert result.makespan == 5
    assert result.bubble_fraction == pytest.approx(0.4)
    assert result.bubble_per_rank == pytest.approx([0.4, 0.4])
    assert result.peak_activations == [1, 1]


def test_a_schedule_that_deadlocks_cannot_be_made():
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits on 0RECV_B0"):
        _schedule(["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], (0, 1), 1)


@pytest.mark.parametrize(
    "costs, message",
    [({"X": 1}, "unknown cost key 'X'"), ({"F": -1}, "cost of F must be a number >= 0, got -1")],
)
def test_simulate_rejects_bad_costs(costs, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(build_schedule("gpipe", 1, 1), costs)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, message",
    [
        (("zb1p", 2, 4), "unknown schedule 'zb1p'; choose one of: gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv"),
        (("1f1b", 0, 4), "pp must be >= 1, got 0"),
        (("gpipe", 2, 0), "microbatches must be >= 1, got 0"),
        (("1f1b", 2, -3), "microbatches must be >= 1, got -3"),
        (("1f1b", "2", 4), "pp must be an integer >= 1, got '2'"),
        (("interleaved_1f1b", 2, 4, 0), "chunks_per_rank must be >= 1, got 0"),
        (("gpipe", 2, 4, 2), "gpipe runs 1 chunk per rank, got chunks_per_rank=2; only "
                              "interleaved_1f1b, zbv, dualpipe_v take chunks_per_rank=2"),
        (("1f1b", 2, 4, 3), "got chunks_per_rank=3; only interleaved_1f1b takes chunks_per_rank=3"),
        (("zbv", 2, 4, 1), "zbv runs 2 chunks per rank, got chunks_per_rank=1"),
        (("dualpipe_v", 2, 3), "dualpipe_v needs at least 2*pp=4 microbatches, got 3"),
        (
            ("interleaved_1f1b", 4, 6, 2),
            "interleaved_1f1b needs the microbatch count to be a multiple of pp=4, got 6; try 4 or 8",
        ),
        (("interleaved_1f1b", 4, 2, 2), "interleaved_1f1b needs at least pp=4 microbatches, got 2"),
    ],
)
def test_bad_input_messages(args, message):
    with pytest.raises(ScheduleError) as err:
        build_schedule(*args)
    assert message in str(err.value)
    with pytest.raises(ValueError):
        generate(*args)


def test_schedules_names():
    assert list(SCHEDULES)[:6] == ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v"]
    assert "zbv" in SCHEDULES and "zigzag" not in SCHEDULES


# ---------------------------------------------------------------- reports and drawing


def test_plan_report_is_json():
    report = plan_report("interleaved_1f1b", 2, 4, 2)
    decoded = json.loads(json.dumps(report))
    assert decoded["schedule"] == "interleaved_1f1b" and decoded["chunks_per_rank"] == 2
    assert decoded["costs"]["F"] == 1 and decoded["costs"]["B"] == 2
    assert decoded["actions"][1] == COMPUTE_TABLE[-1][-1][1].split()
    assert len(decoded["peak_activations"]) == len(decoded["bubble_per_rank"]) == 2
    assert decoded["makespan"] == pytest.approx(simulate(build_schedule("interleaved_1f1b", 2, 4, 2)).makespan)
    assert set(decoded["timeline"][0]) == {"rank", "action", "start", "end"}
    assert plan_report("1f1b", 2, 2, costs={"F": 2})["costs"]["F"] == 2


def test_chrome_trace():
    events = simulate(build_schedule("1f1b", 2, 2)).timeline
    trace = json.loads(json.dumps(to_chrome_trace(events)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events) == 8
    first = next(e for e in spans if e["name"] == "1B0")
    assert (first["pid"], first["tid"], first["ts"], first["dur"], first["cat"]) == (0, 1, 2e6, 2e6, "B")
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_render_text():
    events = simulate(build_schedule("1f1b", 4, 4)).timeline
    chart = render_text(events, width=60)
    lines = chart.splitlines()
    assert len(lines) == 5 and lines[0].startswith("rank 0 |")
    rows = [line.split("|")[1] for line in lines[:4]]
    assert len({len(r) for r in rows}) == 1 and len(rows[0]) <= 60
    assert rows[3].startswith("......F0B0--F1B1--")  # rank 3 waits 3 units, then alternates F and B
    assert lines[-1].rstrip().endswith("21")
    assert render_text([]) == "(empty timeline)"
    narrow = render_text(events, width=10)
    assert all(len(line.split("|")[1]) == 10 for line in narrow.splitlines()[:4])
    measured = [TimelineEvent(0, "step", 0.0, 0.25), TimelineEvent(1, "0F0", 0.1, 0.2)]
    assert "step" in render_text(measured, width=40)


def test_schedules_package_imports_no_torch():
    import ast
    import pathlib

    import pipekit.schedules

    for path in pathlib.Path(pipekit.schedules.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports {names}"


# ---------------------------------------------------------------- overlap (OVERLAP actions)


def test_an_overlap_pairs_a_forward_with_another_backward_and_reads_back_from_its_text():
    pair = Action.parse("3B2+0F5")
    assert pair.kind is Kind.OVERLAP and str(pair) == "0F5+3B2" and pair == Action.parse("0F5+3B2")
    assert pair.parts == (Action(0, Kind.F, 5), Action(3, Kind.B, 2)) and (pair.stage, pair.microbatch) == (0, 5)
    assert Action.parse("0F1+0I0").parts[1].kind is Kind.I
    with pytest.raises(ScheduleError, match="a backward needs its own forward done"):
        Action.parse("0F1+0B1")
    with pytest.raises(ScheduleError, match=r"pairs a forward \(F\) with a backward \(B or I\), got 0F1 and 0W0"):
        Action.parse("0F1+0W0")
    with pytest.raises(ScheduleError, match="made by Action.overlap"):
        Action(0, Kind.OVERLAP, 1)


def test_overlap_pairs_neighbours_keeps_every_action_and_only_pairs_that_can_run():
    plain, paired = build_schedule("1f1b", 2, 4), build_schedule("1f1b", 2, 4, overlap=True)
    assert text([paired.compute_actions(r) for r in range(2)]) == [
        "0F0 0F1+0B0 0F2+0B1 0F3+0B2 0B3",
        # the last rank's backward needs the forward before it; a B0 beside F1 would wait on rank 0's
        # pair F1+B0, which waits for this B0: a deadlock, so the pair is not made
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    ]
    assert paired.overlaps and not plain.overlaps
    assert text(paired.ranks)[0].startswith("0F0 0SEND_F0 0RECV_B0 0F1+0B0 0SEND_F1 0RECV_B1 0F2+0B1")
    for name, pp, m in (("dualpipe_v", 2, 8), ("zbv", 2, 4), ("interleaved_1f1b", 2, 4), ("1f1b", 4, 8)):
        s = build_schedule(name, pp, m, overlap=True)
        base = build_schedule(name, pp, m)
        for r in range(pp):  # the same actions in the same order, some of them side by side
            flat = [p for a in s.compute_actions(r) for p in a.parts]
            assert sorted(map(str, flat)) == sorted(map(str, base.compute_actions(r))), (name, r)
        assert s.overlaps, name
        assert s.forward_only().ranks == base.forward_only().ranks
    dual = build_schedule("dualpipe_v", 2, 8, overlap=True)
    assert all(sum(a.kind is Kind.OVERLAP for a in row) >= 5 for row in dual.ranks)  # DualPipe's steady state


def test_a_table_can_hold_pairs_and_a_dependent_pair_is_refused():
    ok = schedule_from_table("0F0 0F1+0B0 0B1")
    assert ok.overlaps and text(ok.ranks) == ["0F0 0F1+0B0 0B1"]
    with pytest.raises(ScheduleError, match=r"0B1 needs 0F1 earlier"):  # B1 beside F2 needs F1 done first
        schedule_from_table("0F0 0F2+0B1 0B0 0F1 0B2", microbatches=3)
    with pytest.raises(ScheduleError, match="deadlock"):  # the last rank's pair waits for rank 0's
        schedule_from_table("0F0 0F1+0B0 0B1\n1F0 1F1+1B0 1B1")


def test_the_simulator_hides_each_sides_communication_behind_the_others_compute():
    from pipekit.schedules.simulate import overlap_duration

    assert overlap_duration(1.0, 2.0) == 3.0  # nothing to hide: one after the other
    assert overlap_duration(1.0, 2.0, 0.4, 0.5) == pytest.approx(2.1)  # both computes; the comms hidden
    assert overlap_duration(1.0, 2.0, 0.9, 1.5) == 2.4  # the communication lane is the longer
    assert overlap_duration(0.2, 2.0, 0.0, 1.9) == 2.0  # never shorter than the backward alone
    with pytest.raises(ScheduleError, match=r"the forward's communication \(2\) must lie within 0 and its cost"):
        overlap_duration(1, 2, 2, 0)
    costs, comm = {"F": 1.0, "B": 2.0}, {"F": 0.4, "B": 0.5}
    plain = simulate(build_schedule("1f1b", 1, 4), costs, comm=comm)
    paired = simulate(build_schedule("1f1b", 1, 4, overlap=True), costs, comm=comm)
    assert plain.makespan == 12.0 and paired.makespan == pytest.approx(1 + 3 * 2.1 + 2)
    assert simulate(build_schedule("1f1b", 1, 4, overlap=True), costs).makespan == 12.0
    assert paired.peak_activations == [2]
    assert "F1B0" in render_text(paired.timeline, width=80)
