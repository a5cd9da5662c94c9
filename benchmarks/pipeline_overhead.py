"""Pipeline engine overhead per action, and measured vs simulated bubble, on CPU.

Run:  python benchmarks/pipeline_overhead.py [--steps N] [--quick]

What is measured
----------------
1. Overhead per action. The model is 8 near-free layers (each multiplies a
   (2, 4) float32 microbatch by a 1-element parameter), M=8 microbatches, MSE
   loss, SGD. A timed step is a whole optimizer step: zero_grad, the action
   list, waiting for posted sends, the mean loss given to every rank (an
   all-reduce at pp=2; pipekit also all-reduces its gradient norm) and the
   optimizer step. After one first step and a warm-up, the runs are timed in
   alternating rounds (so they share the drift of a noisy machine); a
   barrier, not timed, precedes each step; a step's time is its slowest
   rank's; tables give the median over steps and the p10-p90 spread.
   "us / compute action" = step time / F and B actions on one rank (16);
   "us / action" = step time / all actions on one rank incl. SEND/RECV (16
   at pp=1, 32 at pp=2); "over floor" = (step - eager step) / 16. Rows: a
   plain eager loop over the same 8 F+B in one process (the floor, no
   engine); pipekit pp=1 in this process; at pp=2 over gloo (2 spawned
   workers) pipekit and torch.distributed.pipelining (PipelineStage +
   Schedule1F1B / ScheduleGPipe with a loss_fn), the latter wrapped in the
   same zero_grad / optimizer step / loss all-reduce. Both start from the
   same weights and take the same steps; their final losses are printed as
   a check that they do the same work. A second table splits pipekit's pp=2
   1F1B step by action kind, from its recorded timeline.
2. Bubble, 1F1B, pp=2, M=8, with residual MLP blocks of real work (a few ms
   per F on one thread). The engine's timeline is recorded for several steps;
   ranks share the host's monotonic clock, so each step is put on one time
   axis whose origin is the earliest `train_batch` entry. Makespan = origin
   to the last F/B end on any rank; bubble of rank r = 1 - (its F+B time) /
   makespan; pipeline bubble = 1 - (all F+B time) / (pp * makespan), as in
   `pipekit.schedules.simulate`. Predictions beside it: `simulate` with costs
   F, B = the measured mean F and B, with comm latency 0 and with the
   measured latency (median of RECV end - matching SEND start over the RECVs
   that were already waiting when the SEND was posted); a replay through the
   simulator's executor with each action's own mean duration plus its SEND's
   posting time; and the unit-cost theory (p-1)/(m+p-1) = 1/9.

Not measured: GPUs, NCCL, more than 2 ranks, message size or bandwidth (the
near-free messages are 32 bytes), memory, process start-up and the first
steps (shape inference, gloo connection set-up). The makespan leaves out
what `train_batch` does after the last action (waiting for sends, loss and
grad-norm all-reduces, optimizer step); the step wall time is given beside
it. The machine has 2 cores for 2 ranks plus gloo's threads, and anything
else running on it inflates the pp=2 figures by tens of percent: the 1-min
load average before and after is printed, with a warning when it is high.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import pipekit
from pipekit.partition import partition
from pipekit.schedules import Action, Kind, build_schedule, simulate
from pipekit.schedules.execute import execute
from pipekit.schedules.ir import matching_send
from pipekit.spec import LayerSpec
from pipekit.testing import run_distributed

PP, MICROBATCHES, SEED, LR = 2, 8, 0, 0.01
NEAR_FREE = dict(layers=8, rows=2, width=4)  # per microbatch: (2, 4)
MLP = dict(blocks=6, rows=32, width=256)  # 3 blocks per stage
RESULTS = Path(__file__).parent / "results" / "pipeline_overhead.json"


# ---- models -------------------------------------------------------------
class Scale(nn.Module):
    """x * w with a 1-element w: a layer that costs next to nothing."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(1))

    def forward(self, x):
        return x * self.w


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(x))), hidden 4x: a few ms per forward on one thread."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def near_free_specs() -> list:
    return [LayerSpec(Scale) for _ in range(NEAR_FREE["layers"])]


def mlp_specs() -> list:
    return [LayerSpec(MLPBlock, MLP["width"]) for _ in range(MLP["blocks"])]


def mse(out, target):
    return ((out - target) ** 2).mean()


def make_batch(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed (inputs, labels) batch of M microbatches, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    n = rows * MICROBATCHES
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


# ---- timing -------------------------------------------------------------
def time_interleaved(step_fns: dict, warmup: int, steps: int, rounds: int, sync=None) -> dict:
    """Time each `step_fns[name]()` `steps` times, in `rounds` alternating rounds so
    that every run sees the same drift of a noisy machine. Returns
    name -> (durations in s, last loss)."""
    for fn in step_fns.values():
        for _ in range(warmup):
            fn()
    out = {name: ([], float("nan")) for name in step_fns}
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for name, fn in step_fns.items():
            times, _ = out[name]
            for _ in range(per_round):
                if sync is not None:
                    sync()
                start = time.perf_counter()
                loss = fn()
                times.append(time.perf_counter() - start)
            out[name] = (times, loss)
    return out


def pipekit_engine(specs, schedule: str, topology=None, record: bool = False) -> pipekit.PipelineEngine:
    module = pipekit.PipelineModule(specs, loss_fn=mse, topology=topology, partition="uniform", seed=SEED,
                                    schedule=schedule, microbatches=MICROBATCHES)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    return pipekit.PipelineEngine(module, optimizer=opt, record_timeline=record)


def pipekit_step(engine, batch):
    return lambda: engine.train_batch(iter([batch]), reduce_loss=True)


def eager_step(batch):
    """The floor: the same 8 F+B on one nn.Sequential in a plain loop, no engine."""
    specs = near_free_specs()
    model = nn.Sequential(*[s.build(seed=SEED, index=i) for i, s in enumerate(specs)])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = (t.chunk(MICROBATCHES) for t in batch)

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        for x, y in zip(xs, ys):
            loss = mse(model(x), y)
            (loss / MICROBATCHES).backward()
            losses.append(loss.detach())
        opt.step()
        return torch.stack(losses).mean().item()

    return step


def torch_pipelining_step(schedule: str, batch):
    """One optimizer step of torch.distributed.pipelining on this rank's half of the near-free model."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, pp = dist.get_rank(), dist.get_world_size()
    specs = near_free_specs()
    lo, hi = partition(specs, pp, "uniform")[rank : rank + 2]
    stage_module = nn.Sequential(*[specs[i].build(seed=SEED, index=i) for i in range(lo, hi)])
    stage = PipelineStage(stage_module, rank, pp, torch.device("cpu"))
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches=MICROBATCHES, loss_fn=mse)
    opt = torch.optim.SGD(stage_module.parameters(), lr=LR)
    x, y = batch

    def step():
        opt.zero_grad(set_to_none=True)
        losses: list = []
        args = (x,) if rank == 0 else ()
        kwargs = {"target": y, "losses": losses} if rank == pp - 1 else {}
        sched.step(*args, return_outputs=False, **kwargs)
        opt.step()
        total = torch.stack(losses).double().mean() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total)  # every rank gets the loss, as pipekit's train_batch does
        return total.item()

    return step


def recorded_steps(engine, batch, warmup: int, steps: int) -> list[dict]:
    """Steps with the engine's timeline: entry time on the host clock, wall time, events."""
    for _ in range(warmup):
        engine.train_batch(iter([batch]), reduce_loss=True)
    out = []
    for _ in range(steps):
        dist.barrier()
        entered = time.perf_counter()
        engine.train_batch(iter([batch]), reduce_loss=True)
        wall = time.perf_counter() - entered
        events = [(e.action, e.start, e.end) for e in engine.timeline]
        out.append({"entered": entered, "wall": wall, "events": events})
    return out


# ---- the pp=2 worker ----------------------------------------------------
def pp2_worker(cfg: dict) -> dict:
    """Everything at pp=2, in one spawned gloo group (spawning costs seconds)."""
    topo = pipekit.Topology(pp=PP)
    free = make_batch(NEAR_FREE["rows"], NEAR_FREE["width"])
    fns = {f"pipekit {s}": pipekit_step(pipekit_engine(near_free_specs(), s, topo), free) for s in ("1f1b", "gpipe")}
    for fn in fns.values():
        fn()  # the first step, as for torch below
    errors = {}
    for schedule in ("1f1b", "gpipe"):
        try:
            fn = torch_pipelining_step(schedule, free)
            fn()  # first step: torch's shape inference; fails here if it cannot run
            fns[f"torch {schedule}"] = fn
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            errors[f"torch {schedule}"] = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    errors = _errors_on_any_rank(errors)
    fns = {name: fn for name, fn in fns.items() if name not in errors}  # every rank runs the same steps
    times = time_interleaved(fns, cfg["warmup"], cfg["steps"], cfg["rounds"], dist.barrier)
    engine = pipekit_engine(near_free_specs(), "1f1b", topo, record=True)
    mlp = make_batch(MLP["rows"], MLP["width"])
    return {
        "times": times,
        "errors": errors,
        "breakdown": recorded_steps(engine, free, cfg["warmup"], cfg["steps"] // 2),
        "bubble": recorded_steps(pipekit_engine(mlp_specs(), "1f1b", topo, record=True), mlp, 2, cfg["bubble_steps"]),
    }


def _errors_on_any_rank(errors: dict) -> dict:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    return {k: v for e in gathered for k, v in e.items()}


def single_process(cfg: dict) -> dict:
    """The eager floor and pipekit pp=1, in this process on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        free = make_batch(NEAR_FREE["rows"], NEAR_FREE["width"])
        fns = {"eager": eager_step(free), "pipekit 1f1b": pipekit_step(pipekit_engine(near_free_specs(), "1f1b"), free)}
        for fn in fns.values():
            fn()  # the first step, as at pp=2
        return time_interleaved(fns, cfg["warmup"], cfg["steps"], cfg["rounds"])
    finally:
        torch.set_num_threads(threads)


# ---- analysis: overhead -------------------------------------------------
def action_counts(pp: int, schedule: str = "1f1b") -> tuple[int, int]:
    """(compute actions, all actions) on rank 0; every rank has as many here."""
    sched = build_schedule(schedule, pp, MICROBATCHES)
    return len(sched.compute_actions(0)), len(sched.ranks[0])


def overhead_row(run: str, pp: int, per_rank_times: list[list[float]], loss: float, schedule: str = "1f1b") -> dict:
    steps = [max(ts) for ts in zip(*per_rank_times)]  # a step takes as long as its slowest rank
    step = statistics.median(steps)
    compute, total = action_counts(pp, schedule)  # torch's runs do the same logical actions
    return {
        "run": run,
        "pp": pp,
        "step_us": step * 1e6,
        "step_us_p10": _quantile(steps, 0.1) * 1e6,
        "step_us_p90": _quantile(steps, 0.9) * 1e6,
        "us_per_compute_action": step * 1e6 / compute,
        "us_per_action": step * 1e6 / total,
        "compute_actions": compute,
        "actions": total,
        "final_loss": loss,
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overhead_rows(single: dict, pp2: list[dict]) -> list[dict]:
    rows = [
        overhead_row("eager loop, no engine (floor)", 1, [single["eager"][0]], single["eager"][1]),
        overhead_row("pipekit 1f1b", 1, [single["pipekit 1f1b"][0]], single["pipekit 1f1b"][1]),
    ]
    rows += _pp2_rows(pp2)
    floor = rows[0]["step_us"]
    for r in rows:
        if "error" not in r:
            r["us_over_floor_per_compute_action"] = (r["step_us"] - floor) / r["compute_actions"]
    return rows


def _pp2_rows(pp2: list[dict]) -> list[dict]:
    rows = []
    torch_names = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
    for schedule in ("1f1b", "gpipe"):
        key = f"pipekit {schedule}"
        rows.append(overhead_row(key, PP, [r["times"][key][0] for r in pp2], pp2[0]["times"][key][1], schedule))
        key, name = f"torch {schedule}", f"torch.distributed.pipelining {torch_names[schedule]}"
        error = next((r["errors"][key] for r in pp2 if key in r["errors"]), None)
        if error is not None:
            rows.append({"run": name, "pp": PP, "error": error})
        else:
            rows.append(overhead_row(name, PP, [r["times"][key][0] for r in pp2], pp2[0]["times"][key][1], schedule))
    return rows


def breakdown(pp2: list[dict]) -> list[dict]:
    """Per rank: median and mean us per action kind, the loop's time between
    actions, and the time after the last action (sends, loss all-reduce, step)."""
    rows = []
    for rank, result in enumerate(pp2):
        steps = result["breakdown"]
        per_kind: dict[str, list[float]] = {}
        gaps, after, wall = [], [], []
        for s in steps:
            for action, start, end in s["events"]:
                per_kind.setdefault(_kind_group(action), []).append(end - start)
            inside = sum(e - b for _, b, e in s["events"])
            last = s["events"][-1][2]
            gaps.append((last - inside) / len(s["events"]))
            after.append(s["wall"] - last)
            wall.append(s["wall"])
        row = {"rank": rank}
        for kind, ds in sorted(per_kind.items()):
            row[kind] = {"median": statistics.median(ds) * 1e6, "mean": statistics.mean(ds) * 1e6}
        row.update(gap_per_action=statistics.median(gaps) * 1e6, after_actions=statistics.median(after) * 1e6,
                   step=statistics.median(wall) * 1e6)
        rows.append(row)
    return rows


def _kind_group(action: str) -> str:
    kind = Action.parse(action).kind
    return {Kind.SEND_F: "SEND", Kind.SEND_B: "SEND", Kind.RECV_F: "RECV", Kind.RECV_B: "RECV"}.get(kind, kind.value)


# ---- analysis: bubble ---------------------------------------------------
def aligned_steps(pp2: list[dict]) -> list[list[list[tuple]]]:
    """steps[k][rank] = [(Action, start, end)] on one clock whose 0 is the step's earliest entry."""
    out = []
    for ranks in zip(*[r["bubble"] for r in pp2]):
        origin = min(s["entered"] for s in ranks)
        out.append([[(Action.parse(a), s["entered"] - origin + b, s["entered"] - origin + e) for a, b, e in s["events"]]
                    for s in ranks])
    return out


def bubble_of(events: list[list[tuple]]) -> dict:
    """Makespan and bubbles of one step's per-rank events, as `simulate` defines them."""
    compute = [[ev for ev in evs if ev[0].is_compute] for evs in events]
    makespan = max(e for evs in compute for _, _, e in evs)
    busy = [sum(e - b for _, b, e in evs) for evs in compute]
    return {"makespan_s": makespan, "bubble_per_rank": [1 - x / makespan for x in busy],
            "bubble_fraction": 1 - sum(busy) / (len(events) * makespan)}


def measured_bubble(pp2: list[dict]) -> dict:
    """Bubbles of the recorded MLP steps, averaged over steps, and the costs to simulate them with."""
    steps = aligned_steps(pp2)
    per_step = [bubble_of(events) for events in steps]
    durations: dict[str, list[float]] = {}
    latencies = []
    for events in steps:
        for a, b, e in (ev for evs in events for ev in evs):
            durations.setdefault(str(a), []).append(e - b)
        latencies += _latencies(events)
    by_kind = {k: [d for a, ds in durations.items() for d in ds if Action.parse(a).kind.value == k] for k in ("F", "B")}
    return {
        "makespan_s": statistics.mean(p["makespan_s"] for p in per_step),
        "bubble_per_rank": [statistics.mean(col) for col in zip(*(p["bubble_per_rank"] for p in per_step))],
        "bubble_fraction": statistics.mean(p["bubble_fraction"] for p in per_step),
        "train_batch_wall_s": statistics.mean(max(r["bubble"][k]["wall"] for r in pp2) for k in range(len(steps))),
        "mean_F_s": statistics.mean(by_kind["F"]),
        "mean_B_s": statistics.mean(by_kind["B"]),
        "mean_per_action_s": {a: statistics.mean(ds) for a, ds in durations.items()},
        "per_rank_split_s": _per_rank_split(steps),
        "comm_latency_s": statistics.median(latencies) if latencies else 0.0,
        "comm_latency_mean_s": statistics.mean(latencies) if latencies else 0.0,
        "comm_latency_samples": len(latencies),
        "steps": len(steps),
    }


def _per_rank_split(steps) -> list[dict]:
    """Mean seconds per step each rank spends in F+B, SEND, RECV, and between actions."""
    out = []
    for rank in range(len(steps[0])):
        split = {"compute": 0.0, "SEND": 0.0, "RECV": 0.0, "between": 0.0}
        for events in steps:
            evs = events[rank]
            for a, b, e in evs:
                split["compute" if a.is_compute else _kind_group(str(a))] += (e - b) / len(steps)
            split["between"] += (evs[-1][2] - evs[0][1] - sum(e - b for _, b, e in evs)) / len(steps)
        out.append(split)
    return out


def _latencies(events: list[list]) -> list[float]:
    """RECV end - matching SEND start, for RECVs already waiting when the SEND was posted."""
    sends = {a: b for evs in events for a, b, _ in evs if a.kind in (Kind.SEND_F, Kind.SEND_B)}
    out = []
    for a, b, e in (ev for evs in events for ev in evs):
        if a.kind in (Kind.RECV_F, Kind.RECV_B) and b <= sends[matching_send(a)]:
            out.append(e - sends[matching_send(a)])
    return out


def replay(schedule, mean_per_action: dict, latency: float) -> dict:
    """The simulator's model run with every compute action's own measured mean
    duration (so rank imbalance and per-microbatch differences count), plus the
    mean time spent posting the SEND that follows it (the simulator's SENDs are
    free). RECVs still cost nothing beyond waiting for their SEND + latency."""
    cost = {}
    for actions in schedule.ranks:
        for prev, a in zip((None, *actions), actions):
            if a.is_compute:
                cost[a] = mean_per_action[str(a)]
            elif a.kind in (Kind.SEND_F, Kind.SEND_B) and prev is not None and prev.is_compute:
                cost[prev] += mean_per_action[str(a)]
    times = execute(schedule.ranks, schedule.placement, lambda a: cost.get(a, 0.0), latency)
    busy_only = {a: mean_per_action[str(a)] for a in cost}  # a bubble counts F/B time only, as measured
    events = [[(a, b, b + busy_only.get(a, e - b)) if a.is_compute else (a, b, e) for a, (b, e) in zip(acts, ts)]
              for acts, ts in zip(schedule.ranks, times)]
    return bubble_of(events)


def bubble_rows(measured: dict) -> list[dict]:
    sched = build_schedule("1f1b", PP, MICROBATCHES)
    costs = {"F": measured["mean_F_s"], "B": measured["mean_B_s"]}
    latency = measured["comm_latency_s"]
    keys = ("makespan_s", "bubble_per_rank", "bubble_fraction")
    rows = [{"run": "measured (engine timeline)", **{k: measured[k] for k in keys}}]
    for lat in (0.0, latency):
        sim = simulate(sched, costs, comm_latency=lat)
        rows.append({"run": f"simulate(): mean F, B; comm latency {lat * 1e6:.0f} us", "makespan_s": sim.makespan,
                     "bubble_per_rank": sim.bubble_per_rank, "bubble_fraction": sim.bubble_fraction})
    rows.append({"run": f"replay: each action's own mean + SEND posting; latency {latency * 1e6:.0f} us",
                 **replay(sched, measured["mean_per_action_s"], latency)})
    rows.append({"run": "theory, unit costs: (p-1)/(m+p-1) = 1/9", "makespan_s": None, "bubble_per_rank": None,
                 "bubble_fraction": (PP - 1) / (MICROBATCHES + PP - 1)})
    return rows


# ---- report -------------------------------------------------------------
def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def overhead_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["run"], r["pp"], f"did not run: {r['error'][:160]}", "", "", "", ""])
            continue
        spread = f"{r['step_us_p10']:.0f}-{r['step_us_p90']:.0f}"
        body.append([r["run"], r["pp"], f"{r['step_us']:.0f}", spread, f"{r['us_per_compute_action']:.0f}",
                     f"{r['us_per_action']:.0f}", f"{r['us_over_floor_per_compute_action']:.0f}"])
    headers = ["run", "pp", "step us (median)", "p10-p90", "us / compute action", "us / action",
               "over floor, us / compute action"]
    return table(headers, body)


def loss_check(rows: list[dict]) -> str:
    done = [r for r in rows if "error" not in r]
    spread = max(r["final_loss"] for r in done) - min(r["final_loss"] for r in done)
    return (f"Same work check: loss after the last step, every run: {done[0]['final_loss']:.6f} "
            f"(largest difference between runs {spread:.1e}).")


def breakdown_table(rows: list[dict]) -> str:
    def cell(r, kind):
        return f"{r[kind]['median']:.0f} / {r[kind]['mean']:.0f}" if kind in r else "-"

    body = [[r["rank"], *(cell(r, k) for k in ("F", "B", "SEND", "RECV")),
             f"{r['gap_per_action']:.1f}", f"{r['after_actions']:.0f}", f"{r['step']:.0f}"] for r in rows]
    return table(["rank", "F", "B", "SEND", "RECV (incl. wait)", "between actions", "after last action", "step"], body)


def bubble_table(rows: list[dict]) -> str:
    def pct(x):
        return f"{100 * x:.1f}%"

    body = []
    for r in rows:
        per_rank = " / ".join(pct(b) for b in r["bubble_per_rank"]) if r["bubble_per_rank"] else "-"
        makespan = f"{r['makespan_s'] * 1e3:.1f}" if r["makespan_s"] is not None else "-"
        body.append([r["run"], makespan, per_rank, pct(r["bubble_fraction"])])
    return table(["1F1B, pp=2, m=8", "makespan ms", "bubble rank 0 / 1", "pipeline bubble"], body)


def split_table(measured: dict) -> str:
    body = [[rank, *(f"{split[k] * 1e3:.1f}" for k in ("compute", "SEND", "RECV", "between"))]
            for rank, split in enumerate(measured["per_rank_split_s"])]
    return table(["rank", "F+B ms", "SEND ms", "RECV ms (incl. wait)", "between actions ms"], body)


def load_average() -> float:
    """1-minute load average: above the core count, other work shared the CPUs."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": torch.multiprocessing.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "pipekit": pipekit.__version__, **_git_state(),
            "threads_per_rank": 1, "backend": "gloo"}


def _git_state() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "pipekit_dirty": bool(git("status", "--porcelain", "--", "pipekit"))}
    except OSError:
        return {}


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="timed steps per near-free run (default 400)")
    p.add_argument("--quick", action="store_true", help="smoke mode: a few steps of everything, seconds")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="JSON output (default benchmarks/results/pipeline_overhead.json)")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    quick = a.quick
    return {"steps": min(a.steps, 20) if quick else a.steps, "warmup": 3 if quick else 20, "rounds": 2 if quick else 5,
            "bubble_steps": 2 if quick else 10, "out": a.out, "command": " ".join(["python", *sys.argv])}


def report(overhead, split, measured, bubbles, cfg, info) -> str:
    busy = info["load_average_after"] > 1.5 * info["cores"]
    m = measured
    return "\n\n".join([
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, gloo, 1 thread per rank; "
        f"1-min load average {info['load_average_before']:.2f} before, {info['load_average_after']:.2f} after"
        + (" -- WARNING: other work shared the CPUs, figures are inflated" if busy else "") + ".",
        f"Near-free layers (8 x Scale, (2, 4) float32 per microbatch), M={MICROBATCHES}, "
        f"{cfg['steps']} timed steps each, interleaved in {cfg['rounds']} rounds:",
        overhead_table(overhead),
        loss_check(overhead),
        "pipekit 1f1b pp=2, per action kind, us (median / mean over recorded steps):",
        breakdown_table(split),
        f"Bubble, 1F1B pp=2 m=8: {MLP['blocks']} MLP blocks (width {MLP['width']}, {MLP['rows']} rows per microbatch), "
        f"{m['steps']} recorded steps; mean F {m['mean_F_s'] * 1e3:.2f} ms, mean B {m['mean_B_s'] * 1e3:.2f} ms, "
        f"comm latency {m['comm_latency_s'] * 1e6:.0f} us median / {m['comm_latency_mean_s'] * 1e6:.0f} us mean "
        f"({m['comm_latency_samples']} waiting RECVs); train_batch wall {m['train_batch_wall_s'] * 1e3:.1f} ms:",
        bubble_table(bubbles),
        "Where each rank's step goes (mean per step, first to last action):",
        split_table(measured),
    ])


def main(argv=None) -> None:
    cfg = parse_args(argv)
    started, load_before = time.perf_counter(), load_average()
    single = single_process(cfg)
    worker_cfg = {k: cfg[k] for k in ("steps", "warmup", "rounds", "bubble_steps")}
    pp2 = run_distributed(pp2_worker, PP, worker_cfg, timeout=900)
    overhead, split = overhead_rows(single, pp2), breakdown(pp2)
    measured = measured_bubble(pp2)
    bubbles = bubble_rows(measured)
    info = {**machine(), "load_average_before": load_before, "load_average_after": load_average()}
    print(report(overhead, split, measured, bubbles, cfg, info))
    elapsed = time.perf_counter() - started
    result = {"machine": info, "command": cfg["command"], "config": worker_cfg, "near_free": NEAR_FREE, "mlp": MLP,
              "microbatches": MICROBATCHES, "pp": PP, "overhead": overhead, "breakdown_us": split,
              "bubble_measured": measured, "bubble": bubbles, "elapsed_s": elapsed}
    cfg["out"].parent.mkdir(parents=True, exist_ok=True)
    cfg["out"].write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {cfg['out']} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
