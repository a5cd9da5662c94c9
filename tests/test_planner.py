"""The planner: per-stage simulation, profiled and FLOP-counted layer costs, profile-guided
partitions (with a memory budget), `pipekit plan CONFIG`, and that the engine runs the
planned program in the planned order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipekit.cli import main
from pipekit.config import ConfigError, load_config, load_run
from pipekit.kernels import kernels_mode
from pipekit.partition import partition_weights
from pipekit.plan import planner, profiler
from pipekit.schedules import build_schedule, simulate
from pipekit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "configs" / "gpt2_tiny.yaml")
SMALL = ["data.source=synthetic", "logging.out_dir=null", "model.dim=32", "model.n_heads=2", "model.n_layers=4",
         "train.seq_len=16", "model.max_seq_len=16", "train.micro_batch=2", "schedule.microbatches=4"]
# Uneven cost per parameter: a wide vocabulary makes the tied embedding (cheap lookup) and
# head (an expensive matmul) weigh the same in parameters but not in time.
UNEVEN = [*SMALL, "model.vocab_size=1024", "model.n_layers=6"]


def _layer(name="L", f=1.0, b=2.0, i=1.0, w=1.0, params=10, saved=100, out=8):
    return profiler.LayerCost(name, params, f, b, i, w, saved, out)


# ---- simulation with per-stage costs -------------------------------------------------
def test_per_stage_costs_give_the_slow_stage_its_time():
    s = build_schedule("gpipe", 2, 2)
    even = simulate(s, {"F": 1, "B": 2})
    uneven = simulate(s, [{"F": 1, "B": 2}, {"F": 3, "B": 6}])
    assert even.makespan == 9  # (m + pp - 1) * (F + B)
    # stage 1 is the bottleneck: F0 of stage 0 (1), then 2 F of 3 and 2 B of 6 back to back, then B1 of stage 0 (2)
    assert uneven.makespan == 1 + 2 * 3 + 2 * 6 + 2


def test_latency_function_delays_each_message():
    s = build_schedule("1f1b", 2, 1)
    base = simulate(s).makespan
    assert simulate(s, comm_latency=lambda recv: 0.5).makespan == base + 2 * 0.5  # one F and one B message


def test_predict_counts_overhead_messages_and_tail():
    s = build_schedule("gpipe", 2, 1)
    layers = [_layer(f=1, b=2, out=0), _layer(f=1, b=2, out=0)]
    comm = profiler.CommModel(latency=0.25, bandwidth=1e30, collective=0.5, action_overhead=0.0,
                             send_overhead=0.0)
    p = planner.predict(s, layers, [0, 1, 2], comm, optimizer_seconds_per_param=0.01)
    # F0 (1), message (0.25), F1 + B1 (3), message (0.25), B0 (2): 6.5; then 3 collectives and 10 params' step
    assert p["makespan"] == pytest.approx(6.5)
    assert p["step"] == pytest.approx(6.5 + 3 * 0.5 + 10 * 0.01)


def test_activation_peaks_follow_the_schedule():
    gp, ofob = build_schedule("gpipe", 2, 4), build_schedule("1f1b", 2, 4)
    assert planner.activation_peaks(gp, [5, 7]) == [20, 28]
    assert planner.activation_peaks(ofob, [5, 7]) == [10, 7]


# ---- partitions ------------------------------------------------------------------------
def test_profile_boundaries_without_budget_balance_time():
    layers = [_layer(f=t, b=0) for t in (5, 1, 1, 1, 1, 1)]
    assert planner.profile_boundaries(layers, 2) == partition_weights([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]


def test_memory_budget_moves_layers_off_the_stage_that_holds_most_activations():
    run = load_run(GPT, SMALL)
    s = build_schedule("1f1b", 2, 4)  # stage 0 keeps 2 microbatches in flight, stage 1 one
    layers = [_layer(f=1, b=0, params=0, saved=10) for _ in range(6)]
    assert planner.profile_boundaries(layers, 2) == [0, 3, 6]
    # 2 * 30 > 50: stage 0 may hold at most 2 layers (2 * 20 <= 50); stage 1's 4 layers need 40
    assert planner.profile_boundaries(layers, 2, budget=50, schedule=s, run=run) == [0, 2, 6]
    with pytest.raises(ValueError, match="no partition of the 6 layers into 2 stages fits"):
        planner.profile_boundaries(layers, 2, budget=15, schedule=s, run=run)


def test_profile_beats_parameters_where_cost_per_parameter_differs():
    """FLOP-counted (deterministic): the tied head costs far more time than its parameter twin."""
    run = load_run(GPT, UNEVEN)
    prof = profiler.flop_layers(run, flops_per_second=1e9)  # compute-bound: messages are negligible,
    prof.optimizer_seconds_per_param = 0.0  # and so is the optimizer step
    found = planner.plan(run, prof, profiler.CommModel(), schedules=["1f1b"], partitions=["profile", "parameters"],
                         microbatches=[4])
    by = {c.partition: c for c in found}
    assert by["profile"].boundaries != by["parameters"].boundaries
    assert by["profile"].step_seconds < 0.9 * by["parameters"].step_seconds


# ---- profiles ---------------------------------------------------------------------------
def test_profile_times_the_kernels_side_the_run_takes(monkeypatch):
    """model.kernels applies to what `pipekit plan` and schedule.partition=profile time, as in train()."""
    seen = []
    real = profiler._profile_rows

    def spy(*args, **kwargs):
        seen.append(kernels_mode())
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "_profile_rows", spy)
    monkeypatch.delenv("PIPEKIT_KERNELS", raising=False)
    profiler.profile_layers(load_run(GPT, [*SMALL, "model.kernels=torch"]), reps=1)
    assert seen and set(seen) == {"torch"} and kernels_mode() == "auto"


def test_profile_measures_every_layer_and_scales_with_rows():
    run = load_run(GPT, SMALL)
    prof = profiler.profile_layers(run, reps=1)
    blocks = [c for c in prof.layers if c.name == "TransformerBlock"]
    assert len(prof.layers) == 4 + 3 and len(blocks) == 4
    assert all(c.F > 0 and c.B > 0 and c.I > 0 and c.W > 0 and c.saved_bytes > 0 for c in blocks)
    assert all(c.out_bytes == 2 * 16 * 32 * 4 for c in blocks)  # rows x seq x dim float32
    assert prof.loss.F > 0 and prof.optimizer_seconds_per_param > 0
    # identical blocks save the same bytes: the optimizer's flat parameter buffers (which the
    # parameters are views of once it is built) are not counted as a block's activations
    assert len({c.saved_bytes for c in blocks}) == 1
    double = prof.at(2 * prof.rows)
    assert [c.saved_bytes for c in double[1:5]] == [2 * c.saved_bytes for c in blocks]
    assert all(d.F >= c.F for d, c in zip(double, prof.at(prof.rows)))


def test_layer_costs_are_scaled_to_the_model_run_layer_after_layer():
    layers = [_layer("embed", f=1, b=2, i=0, w=2), _layer(f=2, b=4, i=2, w=2), _layer(f=3, b=6, i=4, w=2)]
    loss = _layer("loss", f=1, b=1, i=1, w=0)
    got, got_loss = profiler._calibrated(layers, loss, {"F": 14.0, "B": 26.0, "I": 14.0, "W": 6.0})
    # F over all layers and the loss: 7 -> 14; B: 13 -> 26; I and W over the layers after the first: 7 -> 14, 4 -> 6
    assert [c.F for c in got] == [2, 4, 6] and got_loss.F == 2
    assert [c.B for c in got] == [4, 8, 12] and got_loss.B == 2
    assert [c.I for c in got] == [0, 4, 8] and got_loss.I == 2
    assert [c.W for c in got] == [3, 3, 3] and got_loss.W == 0
    # a one-layer model has no split pass: I and W take the backward's factor
    (one,), _ = profiler._calibrated(layers[:1], loss, {"F": 4.0, "B": 6.0})
    assert (one.F, one.B, one.I, one.W) == (2, 4, 0, 4)


def test_chained_pass_times_every_kind():
    module, batch = profiler.whole_model(load_run(GPT, SMALL))
    x, labels = batch(2)
    got = profiler._chained(module, x, labels, 1, lambda: None)
    assert set(got) == {"F", "B", "I", "W"} and all(v > 0 for v in got.values())
    assert all(p.grad is None for p in module.parameters())  # nothing left behind for the next timing


def test_flop_profile_on_meta_counts_matmuls():
    prof = profiler.flop_layers(load_run(GPT, SMALL), flops_per_second=1.0)
    block = prof.layers[1]
    tokens, d = 2 * 16, 32
    # q, k, v, o (4 d^2) and the MLP (2 * 4 d^2) per token, 2 FLOPs per multiply-add, plus attention
    assert block.F >= 2 * tokens * 12 * d * d
    assert block.B == pytest.approx(2 * block.F, rel=0.05)
    assert block.saved_bytes > 0 and block.out_bytes == tokens * d * 4


# ---- the CLI ------------------------------------------------------------------------------
def test_plan_config_no_profile_json_png_trace(tmp_path, capsys):
    png, trace = tmp_path / "plan.png", tmp_path / "plan.json"
    assert main(["plan", GPT, *SMALL, "--no-profile", "--json", "--png", str(png), "--trace", str(trace)]) == 0
    report = json.loads(capsys.readouterr().out)
    cands = report["candidates"]
    assert {c["schedule"] for c in cands} >= {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v"}
    assert {c["microbatches"] for c in cands} == {1, 2, 4, 8}  # the divisors of 8 rows per replica
    steps = [c["step_seconds"] for c in cands]
    assert steps == sorted(steps) and report["recommended"] == cands[0]
    assert "schedule.name=" + cands[0]["schedule"] in report["command"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(e["ph"] == "X" for e in json.loads(trace.read_text())["traceEvents"])


def test_plan_config_text_and_budget(capsys):
    assert main(["plan", GPT, *SMALL, "--no-profile", "--memory-gb", "1e-9", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits" in out and "recommended:" in out and "rank 0 |" in out


@pytest.mark.parametrize("argv, message", [
    (["plan"], "give a training config"),
    (["plan", GPT, "--no-profile", "--memory-gb", "0"], "--memory-gb 0.0 must be a finite number > 0"),
    (["plan", GPT, "--no-profile", "--top", "0"], "--top 0 must be >= 1"),
    (["plan", GPT, "schedule.partition=bogus", "--no-profile"], "schedule.partition='bogus' must be"),
])
def test_plan_config_mistakes(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---- config -----------------------------------------------------------------------------
def test_config_partition_forms():
    assert load_config(GPT, ["schedule.partition=0,3,7"]).schedule.partition == "0,3,7"
    with pytest.raises(ConfigError, match=r"explicit boundaries \[0, 3\] have 2 entries; 2 stages need 3"):
        load_config(GPT, ["schedule.partition=0,3"])
    with pytest.raises(ConfigError, match="memory_budget_gb=1.0 applies to schedule.partition=profile"):
        load_config(GPT, ["schedule.memory_budget_gb=1"])
    with pytest.raises(ConfigError, match="memory_budget_gb=-1.0 must be a number > 0"):
        load_config(GPT, ["schedule.partition=profile", "schedule.memory_budget_gb=-1"])


def test_partition_profile_in_one_process():
    from pipekit.run.loop import partition_of

    run = load_run(GPT, [*UNEVEN, "parallel.pp=2", "schedule.partition=profile"])
    assert run.schedule == build_schedule("1f1b", 2, 4)
    bounds = partition_of(run)
    assert bounds[0] == 0 and bounds[-1] == 9 and len(bounds) == 3
    assert partition_of(load_run(GPT, ["schedule.partition=0,2,7"])) == [0, 2, 7]


# ---- the planned program is the one the engine runs --------------------------------------
def _run_planned(overrides: list[str]) -> list[str]:
    import torch.distributed as dist

    from pipekit.run.loop import batches, build
    from pipekit.topology import Topology

    run = load_run(GPT, overrides)
    topo = Topology(pp=2, device="cpu")
    engine = build(run, topo)
    engine.record_timeline = True
    engine.train_batch(next(batches(run, topo)))
    dist.barrier()
    return {"actions": [e.action for e in engine.timeline], "boundaries": list(engine.module.boundaries)}


def test_engine_runs_the_recommended_plan_in_the_planned_order():
    run = load_run(GPT, SMALL)
    found = planner.plan(run, profiler.flop_layers(run), profiler.CommModel(), microbatches=[4])
    for cand in (found[0], next(c for c in found if c.schedule == "zbv")):
        schedule = build_schedule(cand.schedule, 2, cand.microbatches, cand.chunks_per_rank)
        explicit = f"schedule.partition={','.join(map(str, cand.boundaries))}"
        overrides = [*SMALL, *[o for o in cand.overrides() if not o.startswith("schedule.partition")], explicit]
        ranks = run_distributed(_run_planned, 2, overrides, timeout=240)
        for r, got in enumerate(ranks):
            assert got["boundaries"] == cand.boundaries
            assert got["actions"] == [str(a) for a in schedule.ranks[r]]
            planned = [e.action for e in sorted((e for e in cand.timeline if e.rank == r), key=lambda e: e.start)]
            assert [a for a in got["actions"] if a in set(planned)] == planned


# ---- one memory count: the candidate table and the memory plan ---------------------------
LLAMA8B = str(ROOT / "configs" / "llama3_8b.yaml")
# Llama-3 8B at pp=4 x tp=8 x dp=2 (FLOP-counted on meta), checkpointing off so that the memory
# plan's recommended row (the fastest: ZeRO-0, SP off, AC off) has the config's own settings
LLAMA_ZBV = [LLAMA8B, "schedule.activation_checkpoint_interval=0", "--schedule", "zbv", "--microbatches", "16",
             "--memory-budget-gb", "80"]


def _key(c: dict) -> tuple:
    return (*(c[k] for k in ("schedule", "chunks_per_rank", "microbatches", "micro_batch", "partition")),
            tuple(c["boundaries"]))


def test_every_memory_figure_of_a_candidate_is_the_memory_plans_count(capsys):
    """Issue 27: the candidate table printed 136 GiB per rank and the memory plan 39.21 GiB for
    the same recommended candidate (tp=1 bytes against one tp rank's). One count now: each
    candidate's bytes per rank at the config's settings are the memory plan's row of it."""
    assert main(["plan", *LLAMA_ZBV, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows, mine = report["memory_plan"]["rows"], (0, False, False)  # the config's ZeRO stage, SP, AC
    assert "ZeRO-0, SP off, AC off" in report["candidates_memory"]
    by = {_key(c): c["memory_bytes"] for c in report["candidates"]}
    same = [r for r in rows if (r["zero_stage"], r["sequence_parallel"], r["activation_checkpointing"]) == mine]
    assert same and all(by[_key(r)] == pytest.approx(r["per_rank_total_bytes"]) for r in same)
    best = report["memory_plan"]["recommended"]
    assert (best["zero_stage"], best["sequence_parallel"], best["activation_checkpointing"]) == mine
    assert report["recommended"]["memory_bytes"] == pytest.approx(best["per_rank_total_bytes"])
    # and as printed: the candidate table's figure is the recommendation's
    assert main(["plan", *LLAMA_ZBV]) == 0
    out = capsys.readouterr().out
    said = out.split("\nrecommended: ")[1].split(" GiB of 80 per rank")[0].rsplit(" ", 1)[1]
    bounds = ",".join(map(str, best["boundaries"]))
    row = next(line.split() for line in out.splitlines() if f" {bounds} " in line and line.split()[0] == "zbv")
    assert row[-1] == said == f"{best['bytes']['total'] / 2**30:.2f}"
    assert "peak GiB/rank: the worst rank at the config's ZeRO-0, SP off, AC off" in out


@pytest.mark.parametrize("settings", [[], ["optimizer.zero_stage=1", "parallel.sequence_parallel=true",
                                           "schedule.activation_checkpoint_interval=1"]])
def test_run_memory_counts_the_configs_own_settings_as_the_memory_plan_does(settings):
    from pipekit.plan import memory as memplan

    run = load_run(GPT, [*SMALL, "parallel.tp=2", "parallel.dp=2", *settings])
    option = memplan.run_option(run)
    assert option == memplan.Option(1, True, True) if settings else memplan.Option(0, False, False)
    prof, comm = profiler.flop_layers(run, flops_per_second=1e9), profiler.CommModel()
    cands = planner.plan(run, prof, comm, schedules=["1f1b", "zbv"])
    memory, sources = memplan.run_memory(run, prof, cands)
    assert sources == {"counted on the meta device at tp=2"}
    mine = {id(c): m for c, m in zip(cands, memory)}
    rows = [r for r in memplan.memory_plan(run, prof, comm, cands, 2**30) if r.option == option]
    assert {r.candidate.schedule for r in rows} == {"1f1b", "zbv"}
    assert all(mine[id(r.candidate)] == pytest.approx(r.per_rank) for r in rows)


def test_checkpointing_the_memory_model_does_not_count_is_said():
    from pipekit.plan import memory as memplan

    run = load_run(GPT, [*SMALL, "schedule.activation_checkpoint_interval=2"])
    assert not memplan.run_option(run).ac
    assert memplan.unmodelled_checkpointing(run) == ("schedule.activation_checkpoint_interval=2 is not modelled: "
                                                    "counted without checkpointing")
    blocks = load_run(GPT, [*SMALL, "schedule.checkpoint_layers=Block$"])
    assert memplan.run_option(blocks).ac and memplan.unmodelled_checkpointing(blocks) is None
