"""The planner's predicted step time against the measured one, per schedule, on CPU.

Run:  python benchmarks/plan_accuracy.py [--shape compute|overhead|tiny] [--steps N] [--schedules a,b]

What is measured
----------------
For a GPT config at pp=2 (the shapes of benchmarks/vs_torch_pipelining.py:
"compute" = 8 layers, d=256, 4 heads, vocab 512, seq 128, 8 microbatches of 4
sequences; "overhead" = the same with d=64, 16 microbatches of 1 x 32 tokens;
"tiny" = configs/gpt2_tiny.yaml; "uneven" = 6 layers, d=128, vocab 16384, so
the tied embedding and head weigh alike in parameters but the head costs far
more time), the planner (`pipekit.plan.planner`, what
`pipekit plan CONFIG` prints) predicts the step time of each schedule from a
profile of the layers in this process (one thread) and a measured gloo
ping-pong. Then two spawned gloo workers (one thread each) build the same model
with `pipekit.run.loop.build` (AdamW under ZeroOptimizer, the config's partition)
and time `train_batch(reduce_loss=True)` plus a one-element all-reduce (what
`pipekit train` does per step: the loss on every rank, the stop-request check)
on synthetic batches: a barrier before each step, a
step's time is its slowest rank's, median of N steps after 2 warm-ups.
Each `--partitions` method (e.g. `parameters,profile`) is predicted and then
run with the boundaries the plan chose. Reported: predicted, measured, their
ratio, per stage and action kind the measured compute time against the
profiled one (medians over the timed steps), and the makespan and tail
(optimizer step and the step's collectives) the prediction is made of.

Not measured: `pipekit train`'s data loading and logging, GPUs, more than 2 ranks. The machine's 2 cores hold
both workers and gloo's threads; the 1-minute load average is printed before
and after, and anything else running inflates the measured figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from pipekit.config import load_run
from pipekit.plan import planner, profiler
from pipekit.schedules import Action
from pipekit.testing import run_distributed

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt2_tiny.yaml"
COMMON = ["data.source=synthetic", "logging.out_dir=null", "parallel.pp=2", "optimizer.warmup_steps=0"]
SHAPES = {
    "compute": ["model.n_layers=8", "model.dim=256", "model.n_heads=4", "model.vocab_size=512",
                "model.max_seq_len=128", "train.seq_len=128", "train.micro_batch=4", "schedule.microbatches=8"],
    "overhead": ["model.n_layers=8", "model.dim=64", "model.n_heads=4", "model.vocab_size=512",
                 "model.max_seq_len=128", "train.seq_len=32", "train.micro_batch=1", "schedule.microbatches=16"],
    "tiny": [],
    # uneven cost per parameter: a wide vocabulary makes the tied embedding (a cheap lookup) and the
    # head (a big matmul and the loss) weigh alike in parameters but not in time
    "uneven": ["model.n_layers=6", "model.dim=128", "model.n_heads=4", "model.vocab_size=16384",
               "model.max_seq_len=128", "train.seq_len=128", "train.micro_batch=4", "schedule.microbatches=8"],
}
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v"]
RESULTS = Path(__file__).parent / "results"


def _overrides(shape: str, schedule: str) -> list[str]:
    chunks = ["schedule.chunks_per_rank=2"] if schedule == "interleaved_1f1b" else []
    return [*COMMON, *SHAPES[shape], f"schedule.name={schedule}", *chunks]


def _measure(overrides: list[str], steps: int, warmup: int = 2) -> dict:
    """On each worker: build the config's engine and time train_batch."""
    from pipekit.run.loop import batches, build
    from pipekit.topology import Topology

    run = load_run(str(CONFIG), overrides)
    topo = Topology(pp=run.pp, dp=run.dp, tp=run.tp, device="cpu")
    engine = build(run, topo)
    data = batches(run, topo)
    laps, busy = [], {}
    for i in range(warmup + steps):
        engine.record_timeline = i >= warmup
        batch = next(data)
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(batch, reduce_loss=True)  # as pipekit train: the loss on every rank
        stop = torch.zeros(1)
        dist.all_reduce(stop)  # and pipekit train's per-step check for a stop request
        laps.append(time.perf_counter() - t0)
        step_busy: dict[str, float] = {}
        for e in engine.timeline:  # compute time per (stage, kind), summed over microbatches
            a = Action.parse(e.action)
            if a.is_compute:
                key = f"{a.stage}{a.kind.value}"
                step_busy[key] = step_busy.get(key, 0.0) + e.end - e.start
        sends = [e.end - e.start for e in engine.timeline if "SEND" in e.action]
        gaps = [b.start - a.end for a, b in zip(engine.timeline, engine.timeline[1:])]
        step_busy["send"] = sum(sends) / max(1, len(sends))  # mean time to post one send
        step_busy["gap"] = sum(gaps) / max(1, len(gaps))  # mean engine time between two actions
        for key, seconds in step_busy.items():
            busy.setdefault(key, []).append(seconds)
    slowest = torch.tensor(laps, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    last = [(e.rank, e.action, e.start + engine.step_start, e.end + engine.step_start) for e in engine.timeline]
    return {"steps": slowest[warmup:].tolist(), "boundaries": list(engine.module.boundaries), "last_step": last,
            "busy": {k: statistics.median(v) for k, v in busy.items()}}


def _predict(run, profile, comm, schedule: str, method: str) -> planner.Candidate:
    found = planner.plan(run, profile, comm, schedules=[schedule], partitions=[method],
                         microbatches=[run.schedule.microbatches])
    mine = [c for c in found if c.micro_batch == run.config.train.micro_batch
            and (schedule != "interleaved_1f1b" or c.chunks_per_rank == run.schedule.chunks_per_rank)]
    return mine[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="compute")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--partitions", default="parameters", help="e.g. parameters,profile")
    ap.add_argument("--alone", action="store_true",
                    help="profile in this process alone (default: two ranks side by side, as pipekit plan does)")
    ap.add_argument("--png", default=None,
                    help="draw the first run's predicted timeline above its last measured step (matplotlib)")
    args = ap.parse_args()
    names = [(n, p) for n in args.schedules.split(",") for p in args.partitions.split(",")]
    load = [os.getloadavg()[0]]
    base = load_run(str(CONFIG), _overrides(args.shape, "1f1b"))
    if args.alone:
        profile, comm = profiler.profile_layers(base), profiler.measure_comm()
    else:
        profile, comm = profiler.profile_on_two_ranks(base)
    print(f"profile: {profile.source}; comm: latency {comm.latency * 1e6:.0f} us, collective "
          f"{comm.collective * 1e6:.0f} us, bandwidth {comm.bandwidth / 1e9:.2f} GB/s")
    rows = []
    for name, method in names:
        planned = load_run(str(CONFIG), _overrides(args.shape, name))
        c = _predict(planned, profile, comm, name, method)
        cut = f"schedule.partition={','.join(map(str, c.boundaries))}"  # where the plan cut, profiled or not
        got_all = run_distributed(_measure, 2, [*_overrides(args.shape, name), cut], args.steps, timeout=900)
        got = got_all[0]
        measured = statistics.median(got["steps"])
        busy = {k: v for r in run for k, v in r["busy"].items()} if (run := got_all) else {}
        stages = planner.stage_costs([replace(c, **{k: getattr(c, k) / planned.tp for k in profiler.KINDS})
                                      for c in profile.at(c.micro_batch)], c.boundaries)
        print(f"    per action, rank 0/1: posting a send {got_all[0]['busy'].pop('send') * 1e6:.0f}/"
              f"{got_all[1]['busy'].pop('send') * 1e6:.0f} us (modelled {comm.send_overhead * 1e6:.0f}), between "
              f"actions {got_all[0]['busy'].pop('gap') * 1e6:.0f}/{got_all[1]['busy'].pop('gap') * 1e6:.0f} us "
              f"(modelled {comm.action_overhead * 1e6:.0f} per action)")
        busy = {k: v for r in got_all for k, v in r["busy"].items()}
        for key, seconds in sorted(busy.items()):
            stage, kind = int(key[:-1]), key[-1]
            planned = getattr(stages[stage], kind) * c.microbatches
            print(f"    stage {stage} {kind}: measured {seconds * 1e3:7.1f} ms  profiled {planned * 1e3:7.1f} ms  "
                  f"ratio {seconds / planned if planned else float('nan'):.2f}")
        assert got["boundaries"] == c.boundaries, (got["boundaries"], c.boundaries)
        rows.append({"schedule": name, "partition": method, "boundaries": c.boundaries,
                     "predicted_ms": c.step_seconds * 1e3, "measured_ms": measured * 1e3,
                     "ratio": c.step_seconds / measured, "makespan_ms": c.makespan * 1e3,
                     "tail_ms": c.tail_seconds * 1e3, "bubble": c.bubble_fraction,
                     "p10_ms": _pct(got["steps"], 0.1) * 1e3, "p90_ms": _pct(got["steps"], 0.9) * 1e3})
        r = rows[-1]
        if args.png and len(rows) == 1:
            _picture(args.png, args.shape, name, c, [e for g in got_all for e in g["last_step"]], r)
        print(f"{name:17s} {method:10s} {c.boundaries}  predicted {r['predicted_ms']:8.1f} ms  "
              f"measured {r['measured_ms']:8.1f} ms "
              f"(p10-p90 {r['p10_ms']:.1f}-{r['p90_ms']:.1f})  predicted/measured {r['ratio']:.3f}", flush=True)
    load.append(os.getloadavg()[0])
    print("\n| schedule | partition | predicted ms | measured ms | predicted / measured |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['partition']} {r['boundaries']} | {r['predicted_ms']:.1f} | "
              f"{r['measured_ms']:.1f} | {r['ratio']:.3f} |")
    print(f"\nload average before/after: {load[0]:.2f} / {load[1]:.2f} (2 cores)")
    if max(load) > 2.5:
        print("warning: the machine was busy; the measured times are inflated", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"plan_accuracy_{args.shape}.json").write_text(json.dumps({
        "shape": args.shape, "rows": rows, "load_average": load, "profile": profile.source,
        "comm": {"latency": comm.latency, "bandwidth": comm.bandwidth, "collective": comm.collective},
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
    }, indent=1))
    return 0


def _picture(path: str, shape: str, name: str, c, measured: list, row: dict) -> None:
    """The plan's timeline over the last measured step's (both ranks, on one clock from the step's start)."""
    from pipekit.schedules import TimelineEvent, render_png

    t0 = min(start for _, _, start, _ in measured)
    events = [TimelineEvent(rank, action, start - t0, end - t0) for rank, action, start, end in measured]
    render_png(c.timeline, path, f"{name}, {shape} shape, pp=2: predicted (makespan {c.makespan * 1e3:.0f} ms; "
               f"step with optimizer and collectives {row['predicted_ms']:.0f} ms)", unit="ms",
               compare=[(f"measured, last timed step (median step {row['measured_ms']:.0f} ms; grey: SEND/RECV, "
                         "a RECV box is time spent waiting)", events)])
    print(f"wrote {path}")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


if __name__ == "__main__":
    sys.exit(main())
