"""Pipeline engine overhead per action, and measured vs simulated bubble, on CPU.

Run:  python benchmarks/pipeline_overhead.py [--steps N] [--quick]

What is measured
----------------
1. Overhead per action. The model is 8 near-free layers (each multiplies a
   (2, 4) float32 microbatch by a 1-element parameter), M=8 microbatches, MSE
   loss, SGD. One timed step is a whole optimizer step: zero_grad, the action
   list, waiting for posted sends, the mean loss given to every rank (one
   all-reduce at pp=2) and the optimizer step. Steps are timed after a
   warm-up; a barrier (not timed) precedes each step; a step's time is its
   slowest rank's; the tables give the median over steps. "us / compute
   action" is step time / F and B actions on one rank (16); "us / action"
   is step time / all actions on one rank including SEND/RECV (16 at pp=1,
   32 at pp=2). Rows: a plain eager loop over the same 8 F+B in one process
   (the floor: no engine), pipekit pp=1 in this process, and at pp=2 over gloo
   (2 spawned workers) pipekit and torch.distributed.pipelining
   (PipelineStage + Schedule1F1B / ScheduleGPipe with a loss_fn), the latter
   wrapped in the same zero_grad / optimizer step / loss all-reduce. Both
   start from the same weights; their losses after the same steps are
   reported as a check that they do the same work. A second table splits
   pipekit's pp=2 step by action kind from its recorded timeline.
2. Bubble, 1F1B, pp=2, M=8, with residual MLP blocks of real work (a few ms
   per F on one thread). The engine's timeline is recorded for several steps;
   ranks share the host's monotonic clock, so each step is placed on one time
   axis whose origin is the earliest `train_batch` entry. Makespan = origin
   to the last F/B end on any rank; bubble of rank r = 1 - (its F+B time) /
   makespan; pipeline bubble = 1 - (all F+B time) / (pp * makespan), as in
   `pipekit.schedules.simulate`. The schedule is then simulated with costs
   F, B = the measured mean F and B durations, with comm latency 0 and with
   the measured latency (median of RECV end - matching SEND start over the
   RECVs that were already waiting when the SEND was posted), beside the
   unit-cost theory (p-1)/(m+p-1) = 1/9.

What is not measured: GPUs, NCCL, more than 2 ranks, message size or
bandwidth (the near-free messages are 32 bytes), memory, process start-up
and the first steps (shape inference, gloo connection set-up). The makespan
ignores what `train_batch` does after the last action (waiting for sends,
loss all-reduce, optimizer step); that is reported separately. On a
2-core machine the 2 ranks and gloo's threads share the cores, so figures
vary by several percent between runs.
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
def time_steps(step, warmup: int, steps: int, sync=None) -> tuple[list[float], float]:
    """Run `step` warmup + steps times; return the timed durations (s) and the last loss."""
    for _ in range(warmup):
        step()
    times, loss = [], float("nan")
    for _ in range(steps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return times, loss


def pipekit_engine(specs, schedule: str, topology=None, record: bool = False) -> pipekit.PipelineEngine:
    module = pipekit.PipelineModule(specs, loss_fn=mse, topology=topology, partition="uniform", seed=SEED)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    return pipekit.PipelineEngine(module, optimizer=opt, schedule=schedule, num_microbatches=MICROBATCHES, record_timeline=record)


def pipekit_step(engine, batch):
    return lambda: engine.train_batch(iter([batch]))


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
        engine.train_batch(iter([batch]))
    out = []
    for _ in range(steps):
        dist.barrier()
        entered = time.perf_counter()
        engine.train_batch(iter([batch]))
        wall = time.perf_counter() - entered
        events = [(e.action, e.start, e.end) for e in engine.timeline]
        out.append({"entered": entered, "wall": wall, "events": events})
    return out


# ---- the pp=2 worker ----------------------------------------------------
def pp2_worker(cfg: dict) -> dict:
    """Everything at pp=2, in one spawned gloo group (spawning costs seconds)."""
    topo = pipekit.Topology(pp=PP)
    free = make_batch(NEAR_FREE["rows"], NEAR_FREE["width"])
    out: dict = {"pipekit": {}, "torch": {}}
    for schedule in ("1f1b", "gpipe"):
        engine = pipekit_engine(near_free_specs(), schedule, topo)
        out["pipekit"][schedule] = time_steps(pipekit_step(engine, free), cfg["warmup"], cfg["steps"], dist.barrier)
    engine = pipekit_engine(near_free_specs(), "1f1b", topo, record=True)
    out["breakdown"] = recorded_steps(engine, free, cfg["warmup"], cfg["steps"])
    mlp = make_batch(MLP["rows"], MLP["width"])
    out["bubble"] = recorded_steps(pipekit_engine(mlp_specs(), "1f1b", topo, record=True), mlp, 2, cfg["bubble_steps"])
    for schedule in ("1f1b", "gpipe"):
        try:
            step = torch_pipelining_step(schedule, free)
            out["torch"][schedule] = time_steps(step, cfg["warmup"], cfg["steps"], dist.barrier)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            out["torch"][schedule] = f"{type(e).__name__}: {e}"
    return out


def single_process(cfg: dict) -> dict:
    """The eager floor and pipekit pp=1, in this process on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        free = make_batch(NEAR_FREE["rows"], NEAR_FREE["width"])
        engine = pipekit_engine(near_free_specs(), "1f1b")
        return {
            "eager": time_steps(eager_step(free), cfg["warmup"], cfg["steps"]),
            "pipekit": time_steps(pipekit_step(engine, free), cfg["warmup"], cfg["steps"]),
        }
    finally:
        torch.set_num_threads(threads)


# ---- analysis: overhead -------------------------------------------------
def action_counts(pp: int, schedule: str = "1f1b") -> tuple[int, int]:
    """(compute actions, all actions) on rank 0; every rank has as many here."""
    sched = build_schedule(schedule, pp, MICROBATCHES)
    return len(sched.compute_actions(0)), len(sched.ranks[0])


def overhead_row(run: str, pp: int, per_rank_times: list[list[float]], loss: float) -> dict:
    steps = [max(ts) for ts in zip(*per_rank_times)]  # a step takes as long as its slowest rank
    step = statistics.median(steps)
    compute, total = action_counts(pp)
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
        overhead_row("pipekit 1f1b", 1, [single["pipekit"][0]], single["pipekit"][1]),
    ]
    for schedule in ("1f1b", "gpipe"):
        rows.append(overhead_row(f"pipekit {schedule}", PP, [r["pipekit"][schedule][0] for r in pp2], pp2[0]["pipekit"][schedule][1]))
        got = [r["torch"][schedule] for r in pp2]
        name = f"torch.distributed.pipelining {'Schedule1F1B' if schedule == '1f1b' else 'ScheduleGPipe'}"
        if any(isinstance(g, str) for g in got):
            rows.append({"run": name, "pp": PP, "error": next(g for g in got if isinstance(g, str))})
        else:
            rows.append(overhead_row(name, PP, [g[0] for g in got], got[0][1]))
    return rows


def breakdown(pp2: list[dict]) -> list[dict]:
    """Mean us per action kind on each rank, the time between actions, and after them."""
    rows = []
    for rank, result in enumerate(pp2):
        steps = result["breakdown"]
        per_kind: dict[str, list[float]] = {}
        gaps, after, wall = [], [], []
        for s in steps:
            for action, start, end in s["events"]:
                per_kind.setdefault(_kind_group(action), []).append(end - start)
            busy = sum(e - b for _, b, e in s["events"])
            last = s["events"][-1][2]
            gaps.append((last - busy) / len(s["events"]))
            after.append(s["wall"] - last)
            wall.append(s["wall"])
        row = {"rank": rank, **{k: statistics.mean(v) * 1e6 for k, v in sorted(per_kind.items())}}
        row.update(gap_per_action=statistics.median(gaps) * 1e6, after_actions=statistics.median(after) * 1e6,
                   step=statistics.median(wall) * 1e6)
        rows.append(row)
    return rows


def _kind_group(action: str) -> str:
    kind = Action.parse(action).kind
    return {Kind.SEND_F: "SEND", Kind.SEND_B: "SEND", Kind.RECV_F: "RECV", Kind.RECV_B: "RECV"}.get(kind, kind.value)


# ---- analysis: bubble ---------------------------------------------------
def measured_bubble(pp2: list[dict]) -> dict:
    """Per-step makespan and bubbles on the shared clock, averaged over the recorded steps."""
    steps = list(zip(*[r["bubble"] for r in pp2]))  # steps[k][rank]
    makespans, bubbles, pipeline, walls = [], [], [], []
    durations: dict[str, list[float]] = {"F": [], "B": []}
    latencies = []
    for ranks in steps:
        origin = min(s["entered"] for s in ranks)
        events = [[(Action.parse(a), s["entered"] - origin + b, s["entered"] - origin + e) for a, b, e in s["events"]] for s in ranks]
        compute = [[ev for ev in evs if ev[0].is_compute] for evs in events]
        makespan = max(e for evs in compute for _, _, e in evs)
        busy = [sum(e - b for _, b, e in evs) for evs in compute]
        makespans.append(makespan)
        bubbles.append([1 - x / makespan for x in busy])
        pipeline.append(1 - sum(busy) / (len(ranks) * makespan))
        walls.append(max(s["wall"] for s in ranks))
        for a, b, e in (ev for evs in compute for ev in evs):
            durations[a.kind.value].append(e - b)
        latencies += _latencies(events)
    return {
        "makespan_s": statistics.mean(makespans),
        "bubble_per_rank": [statistics.mean(col) for col in zip(*bubbles)],
        "bubble_fraction": statistics.mean(pipeline),
        "train_batch_wall_s": statistics.mean(walls),
        "mean_F_s": statistics.mean(durations["F"]),
        "mean_B_s": statistics.mean(durations["B"]),
        "comm_latency_s": statistics.median(latencies) if latencies else 0.0,
        "comm_latency_samples": len(latencies),
        "steps": len(steps),
    }


def _latencies(events: list[list]) -> list[float]:
    """RECV end - matching SEND start, for RECVs already waiting when the SEND was posted."""
    sends = {a: b for evs in events for a, b, _ in evs if a.kind in (Kind.SEND_F, Kind.SEND_B)}
    out = []
    for a, b, e in (ev for evs in events for ev in evs):
        if a.kind in (Kind.RECV_F, Kind.RECV_B) and b <= sends[matching_send(a)]:
            out.append(e - sends[matching_send(a)])
    return out


def simulated_bubbles(measured: dict) -> list[dict]:
    sched = build_schedule("1f1b", PP, MICROBATCHES)
    costs = {"F": measured["mean_F_s"], "B": measured["mean_B_s"]}
    rows = [{"run": "measured", "makespan_s": measured["makespan_s"],
             "bubble_per_rank": measured["bubble_per_rank"], "bubble_fraction": measured["bubble_fraction"]}]
    for latency in (0.0, measured["comm_latency_s"]):
        sim = simulate(sched, costs, comm_latency=latency)
        rows.append({"run": f"simulated, measured F/B, comm latency {latency * 1e6:.0f} us", "makespan_s": sim.makespan,
                     "bubble_per_rank": sim.bubble_per_rank, "bubble_fraction": sim.bubble_fraction})
    rows.append({"run": "theory, unit costs: (p-1)/(m+p-1)", "makespan_s": None, "bubble_per_rank": None,
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
            body.append([r["run"], r["pp"], f"did not run: {r['error'][:120]}", "", "", ""])
            continue
        spread = f"{r['step_us_p10']:.0f}-{r['step_us_p90']:.0f}"
        body.append([r["run"], r["pp"], f"{r['step_us']:.0f}", spread, f"{r['us_per_compute_action']:.1f}", f"{r['us_per_action']:.1f}"])
    return table(["run", "pp", "step us (median)", "p10-p90", "us / compute action", "us / action"], body)


def breakdown_table(rows: list[dict]) -> str:
    body = [[r["rank"], *(f"{r.get(k, 0):.1f}" for k in ("F", "B", "SEND", "RECV", "gap_per_action", "after_actions", "step"))] for r in rows]
    return table(["rank", "F", "B", "SEND", "RECV (incl. wait)", "gap between actions", "after last action", "step"], body)


def bubble_table(rows: list[dict]) -> str:
    def pct(x):
        return f"{100 * x:.1f}%"

    body = []
    for r in rows:
        per_rank = " / ".join(pct(b) for b in r["bubble_per_rank"]) if r["bubble_per_rank"] else "-"
        makespan = f"{r['makespan_s'] * 1e3:.1f}" if r["makespan_s"] is not None else "-"
        body.append([r["run"], makespan, per_rank, pct(r["bubble_fraction"])])
    return table(["1F1B, pp=2, m=8", "makespan ms", "bubble rank 0 / 1", "pipeline bubble"], body)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": torch.multiprocessing.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "pipekit": pipekit.__version__, "commit": commit,
            "threads_per_rank": 1, "backend": "gloo"}


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps per near-free run (default 300)")
    p.add_argument("--quick", action="store_true", help="smoke mode: few steps, seconds")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    a = p.parse_args(argv)
    steps = min(a.steps, 20) if a.quick else a.steps
    return {"steps": steps, "warmup": 3 if a.quick else 20, "bubble_steps": 2 if a.quick else 10,
            "out": a.out, "command": "python " + " ".join(sys.argv)}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    started = time.perf_counter()
    single = single_process(cfg)
    pp2 = run_distributed(pp2_worker, PP, {k: cfg[k] for k in ("steps", "warmup", "bubble_steps")}, timeout=600)
    overhead, split = overhead_rows(single, pp2), breakdown(pp2)
    measured = measured_bubble(pp2)
    bubbles = simulated_bubbles(measured)
    info = machine()
    print(f"## Pipeline overhead ({info['cpu']}, {info['cores']} cores, torch {info['torch']}, 1 thread per rank)\n")
    print(f"Near-free layers, M={MICROBATCHES}, float32, {cfg['steps']} timed steps:\n")
    print(overhead_table(overhead), "\n")
    print("pipekit 1f1b pp=2, mean us per action kind (timeline recorded):\n")
    print(breakdown_table(split), "\n")
    print(f"Bubble: {MLP['blocks']} MLP blocks (width {MLP['width']}, {MLP['rows']} rows per microbatch), "
          f"{measured['steps']} steps; mean F {measured['mean_F_s'] * 1e3:.2f} ms, mean B {measured['mean_B_s'] * 1e3:.2f} ms, "
          f"comm latency {measured['comm_latency_s'] * 1e6:.0f} us (median of {measured['comm_latency_samples']}), "
          f"train_batch wall {measured['train_batch_wall_s'] * 1e3:.1f} ms:\n")
    print(bubble_table(bubbles))
    elapsed = time.perf_counter() - started
    result = {"machine": info, "command": cfg["command"], "config": {k: cfg[k] for k in ("steps", "warmup", "bubble_steps")},
              "near_free": NEAR_FREE, "mlp": MLP, "microbatches": MICROBATCHES, "pp": PP, "overhead": overhead,
              "breakdown_us": split, "bubble_measured": measured, "bubble": bubbles, "elapsed_s": elapsed}
    cfg["out"].parent.mkdir(parents=True, exist_ok=True)
    cfg["out"].write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {cfg['out']} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
