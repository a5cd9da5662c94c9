"""Zero-bubble schedules: split backward (I, W) from the IR to the engine.

Without processes: the action tables of ZB-H1, ZBV and DualPipe-V, the V
placement, exact simulated makespans under the paper's cost model (F = I = W
= 1, a full backward B = 2) against 1F1B's, peak activations, sweeps through
the validator, registering a schedule and loading one from a table.

With processes (one spawned gloo group of 2 for the module): each schedule
trains the toy LM for a few AdamW steps in float64 and every rank checks
losses, every local gradient and weight against one plain process within
1e-10, including the V placement that puts the tied embedding and head on
rank 0, a weight tied at three places, activation checkpointing, ZeRO's
gradient hooks, and a schedule loaded from a hand-written table.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_parity import CFG, GLOBAL_BATCH, SEED, SEQ, TOL

import pipekit
from pipekit.models.toy import TokenEmbedding, lm_loss, synthetic_batches, toy_lm
from pipekit.optim import ZeroOptimizer
from pipekit.schedules import (
    SCHEDULES,
    Action,
    Kind,
    ScheduleError,
    build_schedule,
    generate,
    load_schedule,
    one_f_one_b,
    plan_report,
    register_schedule,
    render_text,
    resolve_placement,
    schedule_from_table,
    simulate,
    v_placement,
)
from pipekit.spec import TiedLayerSpec
from pipekit.testing import Reference, in_float64, run_distributed

PAPER = {"F": 1, "I": 1, "W": 1, "B": 2}  # Qi et al.'s cost model: F = B(input) = W


def text(ranks):
    return [" ".join(str(a) for a in actions) for actions in ranks]


# ---------------------------------------------------------------- the IR


def test_full_and_split_backward_are_different_kinds():
    assert [str(Action.parse(t)) for t in ("0B1", "0I1", "0W1")] == ["0B1", "0I1", "0W1"]
    assert {Action.parse(t).kind for t in ("0B1", "0I1", "0W1")} == {Kind.B, Kind.I, Kind.W}
    kinds = lambda name: {a.kind for row in generate(name, 3, 6) for a in row}  # noqa: E731
    assert kinds("1f1b") == kinds("gpipe") == {Kind.F, Kind.B}
    assert kinds("zb_h1") == kinds("zbv") == {Kind.F, Kind.I, Kind.W}
    assert kinds("dualpipe_v") == {Kind.F, Kind.B, Kind.I, Kind.W}


def test_v_placement():
    assert v_placement(2) == (0, 1, 1, 0)
    assert v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v_placement(2, 3) == (0, 1, 1, 0, 0, 1)
    assert resolve_placement("v", 3) == (0, 1, 2, 2, 1, 0)
    assert resolve_placement("looping", 2, 2) == (0, 1, 0, 1)
    assert resolve_placement(build_schedule("zbv", 2, 4), 2) == (0, 1, 1, 0)
    assert build_schedule("zbv", 3, 6).local_stages(0) == [0, 5]


@pytest.mark.parametrize(
    "args, message",
    [
        (("zigzag", 2), "unknown placement 'zigzag'; choose one of: looping, v"),
        (((0, 1, 1), 2), "puts [1, 2] stages on ranks 0..1"),
        (((0, 2), 2), "must map every virtual stage to a rank 0..1"),
        (((0, 1, 1, 0), 2, 1), "puts 2 stages on each rank, but chunks_per_rank=1"),
    ],
)
def test_bad_placements_are_named(args, message):
    with pytest.raises(ScheduleError) as err:
        resolve_placement(*args)
    assert message in str(err.value)


# ---------------------------------------------------------------- generators

TABLE = [
    (
        "zb_h1",
        3,
        4,
        [
            "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
            "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
            "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
        ],
    ),
    (
        "zbv",
        2,
        4,
        [
            "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
            "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
        ],
    ),
    (
        "dualpipe_v",
        2,
        4,
        [
            "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
            "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
        ],
    ),
]


@pytest.mark.parametrize("name, pp, m, expected", TABLE)
def test_generated_actions(name, pp, m, expected):
    schedule = build_schedule(name, pp, m)
    assert text(schedule.compute_actions(r) for r in range(pp)) == expected
    assert text(generate(name, pp, m)) == expected


def test_zb_h1_is_1f1b_with_the_backward_split():
    """Drop the Ws and read I as B: 1F1B's order, action for action."""
    for pp, m in [(2, 3), (4, 8), (5, 3)]:
        undone = [[Action(a.stage, Kind.B, a.microbatch) if a.kind is Kind.I else a
                   for a in row if a.kind is not Kind.W] for row in generate("zb_h1", pp, m)]
        assert undone == one_f_one_b(pp, m)


@pytest.mark.parametrize("pp", range(1, 7))
def test_zero_bubble_schedules_validate_over_a_sweep(pp):
    for m in range(1, 14):
        for name in ("zb_h1", "zbv") + (("dualpipe_v",) if m >= 2 * pp else ()):
            schedule = build_schedule(name, pp, m)  # generate -> lower -> validate
            assert schedule.forward_only().backward is False


# ---------------------------------------------------------------- simulated against the paper


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16])
def test_zb_h1_bubble_is_a_third_of_1f1b(pp, m):
    """ZB-H1: 3m + pp - 1 once m >= pp (1F1B: 3m + 3(pp - 1)); below that the warmup bounds it."""
    zb, base = simulate(build_schedule("zb_h1", pp, m), PAPER), simulate(build_schedule("1f1b", pp, m), PAPER)
    assert base.makespan == 3 * m + 3 * (pp - 1)
    assert zb.makespan == 3 * m + (pp - 1) + max(0, pp - m)
    if m >= pp:
        idle = lambda r: r.makespan - 3 * m  # noqa: E731 - every rank works 3m and waits the rest
        assert idle(zb) * 3 == idle(base)
        assert zb.bubble_per_rank == pytest.approx([(pp - 1) / (3 * m + pp - 1)] * pp, abs=1e-12)
    assert zb.peak_activations == [min(m, pp)] * pp  # 1F1B's peak (on its rank 0), on every rank


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("extra", [-1, 0, 1, 5])
def test_zbv_makespan_is_work_plus_the_first_activations_trip(pp, extra):
    """ZBV with F = I = W = 1 per chunk: every rank works 6m; the last rank cannot start
    before pp - 1, and with m >= 2pp - 1 nothing else waits: 6m + pp - 1, the least
    possible. 1F1B on the same model (a stage = two chunks, F = 2, B = 4) takes
    6m + 6(pp - 1). Peak: 2pp chunk activations per rank, 1F1B's rank-0 peak."""
    m = max(1, 2 * pp + extra)
    result = simulate(build_schedule("zbv", pp, m), PAPER)
    assert result.makespan == 6 * m + pp - 1
    assert all(result.makespan * b == pytest.approx(pp - 1) for b in result.bubble_per_rank)
    assert result.peak_activations == [2 * pp] * pp
    base = simulate(build_schedule("1f1b", pp, m), {"F": 2, "B": 4})
    assert base.makespan == 6 * m + 6 * (pp - 1)
    assert max(base.peak_activations) * 2 == 2 * pp  # its rank 0 holds pp stages of two chunks each


def test_zbv_with_few_microbatches_still_runs():
    """Fewer than 2pp - 1 microbatches: the same order with the missing ones left out."""
    assert [simulate(build_schedule("zbv", 4, m), PAPER).makespan for m in (1, 2, 3, 4, 5)] == [18, 22, 26, 30, 34]


@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_dualpipe_v_makespan(pp, m):
    """Without overlapping F with B, DualPipe-V also reaches 6m + pp - 1, holding one more activation."""
    result = simulate(build_schedule("dualpipe_v", pp, m), PAPER)
    assert result.makespan == 6 * m + pp - 1
    assert result.peak_activations == [2 * pp + 1] * pp


def test_plan_report_and_drawing_show_split_backward():
    report = plan_report("zbv", 2, 4, costs=PAPER)
    assert (report["chunks_per_rank"], report["placement"], report["makespan"]) == (2, [0, 1, 1, 0], 25)
    chart = render_text(simulate(build_schedule("zb_h1", 3, 4), PAPER).timeline)
    assert chart.splitlines()[2].startswith("rank 2 |..............F0-----I0-----F1-----I1-----F2-----I2-----W0")


# ---------------------------------------------------------------- your own schedule


def _split_1f1b(pp, microbatches):
    """1F1B with each backward split and its W right after the I."""
    def split(a):
        if a.kind is Kind.F:
            return [a]
        return [Action(a.stage, Kind.I, a.microbatch), Action(a.stage, Kind.W, a.microbatch)]

    return [[b for a in row for b in split(a)] for row in one_f_one_b(pp, microbatches)]


def _broken(pp, microbatches):
    return [[a for a in row if a.kind is not Kind.W] for row in _split_1f1b(pp, microbatches)]


def test_register_a_schedule_of_your_own():
    register_schedule("test_split_1f1b", _split_1f1b, replace=True)
    assert "test_split_1f1b" in SCHEDULES
    schedule = build_schedule("test_split_1f1b", 3, 5)
    assert simulate(schedule, PAPER).makespan == 3 * 5 + 2 * (3 - 1)  # an I hands its grad on a unit before B would
    with pytest.raises(ScheduleError, match="already registered"):
        register_schedule("test_split_1f1b", _split_1f1b)
    register_schedule("test_broken", _broken, replace=True)
    with pytest.raises(ScheduleError, match=r"stage 0 microbatch 0 \(rank 0\) needs either B .* found \['I'\]"):
        build_schedule("test_broken", 2, 2)
    with pytest.raises(ScheduleError, match="unknown placement 'diagonal'"):
        register_schedule("test_diag", _split_1f1b, placement="diagonal")


ZBV_PP2_M2 = """
# ZBV, pp=2, 2 microbatches: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1
1F0, 2F0, 1F1, 2F1, 2I0, 2W0, 1I0, 1W0, 2I1, 2W1, 1I1, 1W1
"""


def test_a_schedule_from_an_action_table(tmp_path):
    schedule = schedule_from_table(ZBV_PP2_M2, name="mine")
    assert (schedule.pp, schedule.chunks_per_rank, schedule.microbatches, schedule.placement) == (2, 2, 2, (0, 1, 1, 0))
    assert schedule.ranks == build_schedule("zbv", 2, 2).ranks  # lowered on load, as a generator's would be
    path = tmp_path / "zbv.csv"
    path.write_text("\n".join(",".join(str(a) for a in row) for row in schedule.ranks))  # lowered programs load too
    again = load_schedule(path)
    assert again.name == "zbv" and again.ranks == schedule.ranks


@pytest.mark.parametrize(
    "table, message",
    [
        ("0F0 0W0 0I0", "0W0 needs 0I0 earlier (weight grad after input grad)"),
        ("0F0 0B0\n0F1 0B1", "stage 0 runs on two ranks, 0 and 1"),
        ("0F0 0B0 0X0", "line 1: cannot parse action '0X0'"),
        ("0F0 1F0 1B0 0B0\n2F0 2B0 3F0 3B0", "rank 0 step 1: 1F0 runs on rank 0 but stage 1 is placed on rank 1"),
        ("# nothing\n", "the action table is empty"),
    ],
)
def test_a_bad_table_is_refused_on_load(table, message):
    with pytest.raises(ScheduleError) as err:
        schedule_from_table(table, placement=(0, 1, 1, 0) if "3F0" in table else None)
    assert message in str(err.value)


# ---------------------------------------------------------------- the engine


def _module(**kwargs):
    return pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, **kwargs)


def test_engine_runs_the_module_s_schedule_object_or_name():
    schedule = build_schedule("zb_h1", 1, 4)
    engine = pipekit.PipelineEngine(_module(schedule=schedule))
    assert engine.schedule is schedule and engine.num_microbatches == 4
    assert [str(a) for a in engine.eval_actions] == ["0F0", "0F1", "0F2", "0F3"]
    assert pipekit.PipelineEngine(_module(schedule="zb_h1", microbatches=4)).schedule == schedule
    with pytest.raises(ValueError, match="microbatches=2, but schedule 'zb_h1' runs 4"):
        _module(schedule=schedule, microbatches=2)
    with pytest.raises(ValueError, match="schedule 'zb_h1' is for pp=2, but the topology has pp=1"):
        _module(schedule=build_schedule("zb_h1", 2, 4))
    with pytest.raises(TypeError, match="a registered name .* or a pipekit.schedules.Schedule, got int"):
        _module(schedule=42)


# ---------------------------------------------------------------- the engine, against one process

STEPS = 2


def _tied_mix(module: TokenEmbedding, x):
    """A third use of the embedding matrix, in the middle: h + 0.1 tanh(h E^T) E."""
    h, pos = x
    return h + 0.1 * torch.tanh(h @ module.weight.t()) @ module.weight, pos


def _specs(model: str) -> list:
    specs = toy_lm(CFG)
    if model == "tied3":  # embedding, a middle mixing layer and the head share one matrix
        middle = TiedLayerSpec("embed", TokenEmbedding, CFG.vocab, CFG.dim, forward_fn=_tied_mix)
        specs = specs[:3] + [middle] + specs[3:]
    return specs


def _schedule(how, pp: int, microbatches: int):
    if isinstance(how, tuple):  # ("table", text)
        return schedule_from_table(how[1])
    return build_schedule(how, pp, microbatches)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


@in_float64
def run_case(pp, dp, how, microbatches, model="toy", zero_stage=None, by_name=False, **kwargs) -> dict:
    """Train at a layout with AdamW (or ZeroOptimizer) and compare with one process."""
    specs = _specs(model)
    topo = pipekit.Topology(pp=pp, dp=dp)
    schedule = _schedule(how, pp, microbatches)
    if by_name:  # the name route: the module builds the schedule from its name
        module = pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=topo, seed=SEED, schedule=how,
                                        microbatches=microbatches, **kwargs)
        assert module.schedule == schedule
    else:
        module = pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=topo, seed=SEED, schedule=schedule, **kwargs)
    if zero_stage is None:
        opt = adamw(module.parameters())
    else:
        opt = ZeroOptimizer(module, "adamw", stage=zero_stage, bucket_mb=0.002, lr=0.01, weight_decay=0.1)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    ref = Reference(specs, lm_loss, adamw, seed=SEED)
    data = synthetic_batches(CFG.vocab, GLOBAL_BATCH, SEQ, seed=3)
    for _ in range(STEPS):
        ref.train_beside(engine, next(data))
        ref.compare(module, topo, grads=zero_stage is None)  # ZeRO moves gradients into its buckets
    ref.eval_beside(engine, next(data))
    return {**ref.worst, "tied_groups": len(module.tie_groups)}


@in_float64
def wrong_placement_message() -> str:
    """A looping module handed a V schedule by the engine: refused before running anything (the
    engine takes no schedule of its own, so a second, differently placed one cannot arise)."""
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=pipekit.Topology(pp=2),
                                    schedule="interleaved_1f1b", microbatches=4)
    try:
        pipekit.PipelineEngine(module, optimizer=None, schedule="zbv", num_microbatches=4)
    except TypeError as e:
        return str(e)
    return "no error"


TIED3_PARTITION = [0, 3, 6, 9, 12]  # stage 0: embed..MLP (rank 0); 1: mix..Project (rank 1); 3: ..head (rank 0)

# (label, pp, dp, schedule, microbatches, extra run_case kwargs)
CASES = [
    ("zb_h1", 2, 1, "zb_h1", 4, {}),
    ("zb_h1 + checkpointing", 2, 1, "zb_h1", 4, {"activation_checkpoint_interval": 2}),
    ("zbv: tied pair on rank 0", 2, 1, "zbv", 4, {}),
    ("zbv by name, checkpointing MLPs", 2, 1, "zbv", 2, {"by_name": True, "checkpoint_layers": "MLPBlock"}),
    ("zbv, tied at three places", 2, 1, "zbv", 4, {"model": "tied3", "partition": TIED3_PARTITION}),
    ("dualpipe_v", 2, 1, "dualpipe_v", 4, {}),
    ("table", 2, 1, ("table", ZBV_PP2_M2), 2, {}),
    ("zbv, ZeRO-1", 2, 1, "zbv", 4, {"zero_stage": 1}),
    ("zb_h1, ZeRO-2", 2, 1, "zb_h1", 4, {"zero_stage": 2}),
    ("zbv at pp=1 x dp=2", 1, 2, "zbv", 2, {}),
]


def all_cases() -> tuple[list[dict], str]:
    results = [run_case(pp, dp, how, m, **kw) for _, pp, dp, how, m, kw in CASES]
    return results, wrong_placement_message()


@pytest.fixture(scope="module")
def distributed_results():
    return run_distributed(all_cases, 2, timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_engine_matches_one_process(distributed_results, index):
    label, *_, kwargs = CASES[index]
    compared = ("loss", "weight", "eval_loss") + (() if "zero_stage" in kwargs else ("grad",))
    for rank, (results, _) in enumerate(distributed_results):
        worst = results[index]
        for what in compared:
            assert worst[what] <= TOL, f"rank {rank}, {label}: {what} differs by {worst[what]:.3g}"
    if "three places" in label:
        assert all(results[index]["tied_groups"] == 1 for results, _ in distributed_results)  # both ranks hold it
    if "rank 0" in label:
        assert [results[index]["tied_groups"] for results, _ in distributed_results] == [0, 0]  # one rank only


def test_engine_refuses_a_schedule_placed_differently_from_the_module(distributed_results):
    message = distributed_results[0][1]
    assert "PipelineEngine takes no schedule= or num_microbatches=" in message
    assert "declare it there: PipelineModule(..., schedule=..., microbatches=...)" in message
