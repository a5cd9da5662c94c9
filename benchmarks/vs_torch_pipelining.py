"""pipekit against torch.distributed.pipelining: tokens/s of one GPT at pp=2, six schedules, on CPU.

Run:  python benchmarks/vs_torch_pipelining.py [--quick] [--steps N] [--shapes compute,overhead]
                                               [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1,zbv,dualpipe_v]

What is measured
----------------
One optimizer step of the same GPT-2 (8 pre-norm blocks, 4 heads, vocabulary
512, learned positions; embedding and LM head UNTIED, because torch's
pipelining does not sum the gradients of a weight shared by two stages),
AdamW (lr 1e-3), on one fixed batch of random token ids, in two shapes:

  compute   d=256, seq 128, M=8 microbatches of 4 x 128 tokens  (4096 tokens/step)
  overhead  d=64,  seq 32,  M=16 microbatches of 1 x 32 tokens  (512 tokens/step)

Runs, all in one spawned gloo group of 2 ranks, one intra-op thread each:
  * pipekit pp=2: `PipelineModule(schedule=<the Schedule>)` + `PipelineEngine`,
    for gpipe, 1f1b, interleaved_1f1b (2 chunks per rank), zb_h1, zbv and
    dualpipe_v (both on the V placement: rank 0 holds stages 0 and 3, rank 1
    stages 1 and 2);
  * torch pp=2: `PipelineStage`s holding the same layers (same cuts, same
    seeded init, so the same weights) driven by torch's closest schedule:
    ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble with one stage per rank (its ZB1P is ZB-H1),
    ScheduleZBVZeroBubble, ScheduleDualPipeV; each with the same loss_fn,
    wrapped in the same zero_grad / optimizer step / loss all-reduce that
    pipekit's `train_batch` does;
  * one process (the baseline): the whole model as one `nn.Sequential` in a
    plain loop over the same M microbatches (gradient accumulation, loss
    weighted 1/M), on rank 0 while rank 1 waits in the next barrier; and the
    same loop on both ranks at once (the busy-cores baseline).

Layers are cut at the same boundaries for both libraries: the 8 blocks spread
evenly over the 2 or 4 virtual stages, the embedding on the first, the final
LayerNorm and the head on the last (`partition(..., "type:TransformerBlock")`).

Timing: each run takes one first step (torch's shape inference happens here;
a torch schedule that fails is reported and dropped on every rank), then the
rest of the warm-ups, then the timed steps in alternating rounds (every run
takes a few steps, then the next run, and so on), so that all runs share the
drift of a noisy machine. A barrier, not timed, precedes every step; a step's
time is its slowest rank's; tokens/s = tokens per step / median step time.
"pipekit/torch, fastest steps" is the same ratio from each run's fastest step,
the figure least disturbed by other work on a shared machine.
Every run takes the same steps from the same weights on the same batch, so
their final losses must agree (float32 rounding apart); they are printed.

Bubble bound: the best speedup over one process a schedule allows, pp * (1 -
bubble), where bubble = 1 - (busy time of all ranks) / (pp * makespan) is the
schedule's bubble fraction simulated by `pipekit.schedules.simulate` with unit
costs per virtual stage F=1, B=2 (I=W=1 when the backward is split), free
communication. One process does the same busy work back to back, so pp * (1 -
bubble) = one-process time / pipeline makespan. It ignores communication, the
engine's own overhead, imbalance between stages (the embedding, head and loss
are not free), the optimizer step and this machine's sharing of 2 cores
between 2 ranks and gloo's threads: a ceiling, not a prediction. The last of
those is measured apart: "1 process, both cores busy" runs the same plain loop on
both ranks at once (each its own copy), and "of the bound (busy cores)" is the
speedup over that per-process rate divided by the bubble bound, so what a core
loses when the other one works too is not counted against the schedule.

Not measured: GPUs, NCCL, more than 2 ranks, tensor or data parallelism,
memory, the tied embedding, process start-up. The machine's 1-, 5- and
15-minute load averages before and after are printed and saved; with other
work on the 2 cores the pp=2 figures are inflated and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import pipekit
from pipekit.models import GPT2Config, gpt2_loss, gpt2_specs
from pipekit.partition import partition
from pipekit.schedules import build_schedule, simulate
from pipekit.spec import build_layer
from pipekit.testing import reference_model, run_distributed

PP, SEED, LR = 2, 0, 1e-3
LAYERS, HEADS, VOCAB = 8, 4, 512
RESULTS = Path(__file__).parent / "results" / "vs_torch_pipelining.json"
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v")
CHUNKS = {"interleaved_1f1b": 2}  # the others take their own (1, or 2 on the V)
# pipekit schedule -> the closest torch.distributed.pipelining schedule (all exist in torch 2.13)
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",  # with one stage per rank: ZB1P, i.e. ZB-H1
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipe_v": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")  # the rest take a list of stages
BASELINE = "1 process"
BUSY = "1 process, both cores busy"  # the same loop on every rank at once: what a core does when both work


@dataclass(frozen=True)
class Shape:
    dim: int
    seq: int
    microbatches: int
    micro_batch: int  # sequences per microbatch

    @property
    def tokens(self) -> int:
        return self.microbatches * self.micro_batch * self.seq


SHAPES = {
    "compute": Shape(dim=256, seq=128, microbatches=8, micro_batch=4),
    "overhead": Shape(dim=64, seq=32, microbatches=16, micro_batch=1),
}


# ---- the model, the batch, the cuts ---------------------------------------
def gpt_specs(shape: Shape) -> list:
    """The untied GPT-2 of `shape`: [embedding, 8 blocks, LayerNorm, head]."""
    cfg = GPT2Config(vocab_size=VOCAB, max_seq_len=shape.seq, n_layers=LAYERS, dim=shape.dim, n_heads=HEADS,
                     tie_embeddings=False)
    return gpt2_specs(cfg)


def make_loss():
    """Mean next-token cross-entropy over the (unsplit) vocabulary, as pipekit's GPT uses."""
    return gpt2_loss().build(seed=SEED, index=0)


def make_batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of random ids (B, T) and their next tokens, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (shape.microbatches * shape.micro_batch, shape.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def schedule_of(name: str, shape: Shape):
    return build_schedule(name, PP, shape.microbatches, CHUNKS.get(name))


def cuts(specs: list, num_stages: int) -> list[int]:
    """Stage boundaries shared by both libraries: the blocks spread evenly."""
    return partition(specs, num_stages, "type:TransformerBlock")


# ---- one step of each run ----------------------------------------------------
def pipekit_step(name: str, shape: Shape, batch):
    schedule = schedule_of(name, shape)
    specs = gpt_specs(shape)
    module = pipekit.PipelineModule(specs, loss_fn=gpt2_loss(), topology=pipekit.Topology(pp=PP),
                                    partition=cuts(specs, len(schedule.placement)), schedule=schedule, seed=SEED)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    return lambda: engine.train_batch(batch, reduce_loss=True)


def torch_stage_modules(name: str, shape: Shape) -> tuple[dict[int, nn.Module], int]:
    """This rank's stages as {stage index: nn.Sequential of its layers}, placed where
    pipekit's schedule places them, and the number of stages."""
    placement = schedule_of(name, shape).placement
    specs = gpt_specs(shape)
    bounds = cuts(specs, len(placement))
    rank = dist.get_rank()
    local = [s for s, r in enumerate(placement) if r == rank]
    modules = {s: nn.Sequential(*[build_layer(specs, i, seed=SEED) for i in range(bounds[s], bounds[s + 1])])
               for s in local}
    return modules, len(placement)


def torch_step(name: str, shape: Shape, batch):
    """One optimizer step of torch.distributed.pipelining on this rank's stages."""
    import torch.distributed.pipelining as tp

    modules, num_stages = torch_stage_modules(name, shape)
    stages = [tp.PipelineStage(m, s, num_stages, torch.device("cpu")) for s, m in modules.items()]
    cls = getattr(tp, TORCH_SCHEDULES[name])
    arg = stages[0] if cls.__name__ in SINGLE_STAGE else stages
    sched = cls(arg, n_microbatches=shape.microbatches, loss_fn=make_loss())
    opt = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=LR)
    first, last = 0 in modules, num_stages - 1 in modules
    x, y = batch

    def step():
        opt.zero_grad(set_to_none=True)
        losses: list = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), return_outputs=False, **kwargs)
        opt.step()
        return _loss_everywhere(losses)

    return step


def _loss_everywhere(losses: list) -> float:
    """The mean microbatch loss of the last stage, given to every rank (as pipekit does)."""
    total = torch.stack(losses).double().mean() if losses else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def one_process_step(shape: Shape, batch, everywhere: bool = False):
    """The baseline on rank 0: the whole model, a plain loop over the same microbatches.
    Other ranks do nothing (they wait in the barrier before the next step); `everywhere`: every
    rank runs its own copy at the same time (the busy baseline)."""
    if dist.get_rank() != 0 and not everywhere:
        return lambda: float("nan")
    model = reference_model(gpt_specs(shape), SEED)
    loss_fn, opt = make_loss(), torch.optim.AdamW(model.parameters(), lr=LR)
    xs, ys = (t.chunk(shape.microbatches) for t in batch)

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        for x, y in zip(xs, ys):
            loss = loss_fn(model(x), y)
            (loss / shape.microbatches).backward()
            losses.append(loss.detach())
        opt.step()
        return torch.stack(losses).mean().item()

    return step


# ---- timing -----------------------------------------------------------------
def round_sizes(steps: int, rounds: int) -> list[int]:
    """`steps` split into `rounds` near-equal rounds (no empty ones)."""
    rounds = min(rounds, steps)
    return [steps // rounds + (k < steps % rounds) for k in range(rounds)]


def timed(fn) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = fn()
    return time.perf_counter() - start, loss


def time_alternating(fns: dict, warmup: int, steps: int, rounds: int) -> dict:
    """name -> {"times": this rank's step seconds, "loss": the last step's loss}.
    The first step was taken already; `warmup - 1` more, then the timed rounds."""
    for fn in fns.values():
        for _ in range(warmup - 1):
            timed(fn)
    out = {name: {"times": [], "loss": float("nan")} for name in fns}
    for size in round_sizes(steps, rounds):
        for name, fn in fns.items():
            for _ in range(size):
                seconds, out[name]["loss"] = timed(fn)
                out[name]["times"].append(seconds)
    return out


def first_steps(makers: dict) -> tuple[dict, dict]:
    """Build every run and take its first step; (step fns, errors) with the errors of
    every rank, so that all ranks drop the same runs."""
    fns, errors = {}, {}
    for name, make in makers.items():
        try:
            fn = make()
            timed(fn)
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            errors[name] = f"rank {dist.get_rank()}: {type(e).__name__}: {str(e)[:400]}"
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    errors = {k: v for e in gathered for k, v in e.items()}
    return {k: fn for k, fn in fns.items() if k not in errors}, errors


def shape_worker(shape: Shape, schedules: list[str], cfg: dict) -> dict:
    batch = make_batch(shape)
    makers = {BASELINE: lambda: one_process_step(shape, batch),
              BUSY: lambda: one_process_step(shape, batch, everywhere=True)}
    for name in schedules:
        makers[f"pipekit {name}"] = lambda n=name: pipekit_step(n, shape, batch)
        makers[f"torch {name}"] = lambda n=name: torch_step(n, shape, batch)
    fns, errors = first_steps(makers)
    return {"runs": time_alternating(fns, cfg["warmup"], cfg["steps"], cfg["rounds"]), "errors": errors}


def worker(shapes: dict, schedules: list[str], cfg: dict) -> dict:
    """Everything at pp=2, in one spawned gloo group (spawning costs seconds)."""
    return {key: shape_worker(shape, schedules, cfg) for key, shape in shapes.items()}


# ---- analysis ----------------------------------------------------------------
def bubble_bound(name: str, shape: Shape) -> tuple[float, float]:
    """(simulated bubble fraction at unit costs, pp * (1 - bubble))."""
    bubble = simulate(schedule_of(name, shape)).bubble_fraction
    return bubble, PP * (1 - bubble)


def run_summary(per_rank: list[dict], key: str, shape: Shape) -> dict | None:
    """Median step (slowest rank per step; rank 0 alone for the baseline) and tokens/s."""
    if key not in per_rank[0]["runs"]:
        return None
    ranks = per_rank[:1] if key == BASELINE else per_rank
    steps = [max(ts) for ts in zip(*(r["runs"][key]["times"] for r in ranks))]
    step = statistics.median(steps)
    return {"step_s": step, "step_s_min": min(steps), "step_s_max": max(steps), "steps": len(steps),
            "tokens_per_s": shape.tokens / step, "final_loss": per_rank[0]["runs"][key]["loss"]}


def shape_rows(per_rank: list[dict], shape: Shape, schedules: list[str]) -> tuple[dict, list[dict]]:
    base, busy = run_summary(per_rank, BASELINE, shape), run_summary(per_rank, BUSY, shape)
    rows = []
    for name in schedules:
        ours, theirs = (run_summary(per_rank, f"{lib} {name}", shape) for lib in ("pipekit", "torch"))
        bubble, bound = bubble_bound(name, shape)
        rows.append({"schedule": name, "torch_schedule": TORCH_SCHEDULES[name], "pipekit": ours, "torch": theirs,
                     "torch_error": per_rank[0]["errors"].get(f"torch {name}"),
                     "pipekit_error": per_rank[0]["errors"].get(f"pipekit {name}"),
                     "ratio": _ratio(ours, theirs), "ratio_fastest": _fastest_ratio(ours, theirs),
                     "pipekit_vs_1_process": _ratio(ours, base),
                     "torch_vs_1_process": _ratio(theirs, base), "bubble_fraction": bubble, "bubble_bound": bound,
                     "pipekit_vs_busy": _ratio(ours, busy), "torch_vs_busy": _ratio(theirs, busy), "busy": busy})
    return base, rows


def _ratio(a: dict | None, b: dict | None) -> float | None:
    return a["tokens_per_s"] / b["tokens_per_s"] if a and b else None


def _fastest_ratio(a: dict | None, b: dict | None) -> float | None:
    """Throughput ratio of the fastest steps: the one least disturbed by other work."""
    return b["step_s_min"] / a["step_s_min"] if a and b else None


def target_checks(results: dict) -> list[str]:
    """The issue's targets, each with the figure it rests on."""
    lines = []
    for key, r in results.items():
        for row in r["rows"]:
            if row["ratio"] is not None:
                need = 1.2 if key == "overhead" else 1.0
                lines.append(_check(f"{key}: pipekit/torch {row['schedule']}", row["ratio"], need))
            if row["schedule"] == "zbv" and row["pipekit_vs_1_process"] is not None:
                lines.append(_check(f"{key}: pipekit zbv vs 1 process", row["pipekit_vs_1_process"], 1.9))
    return lines


def _check(what: str, value: float, need: float) -> str:
    return f"- {what}: {value:.2f}x (target >= {need}x) {'met' if value >= need else 'NOT met'}"


# ---- report -------------------------------------------------------------------
def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _rate(run: dict | None, error: str | None) -> str:
    if run is not None:
        return f"{run['tokens_per_s']:,.0f}"
    return f"failed: {error[:120]}" if error else "-"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(speedup: float | None, bound: float) -> str:
    return "-" if speedup is None else f"{100 * speedup / bound:.0f}%"


def throughput_table(rows: list[dict]) -> str:
    body = [[r["schedule"], r["torch_schedule"], _rate(r["pipekit"], r["pipekit_error"]),
             _rate(r["torch"], r["torch_error"]), _x(r["ratio"]), _x(r["ratio_fastest"]), _x(r["pipekit_vs_1_process"]),
             _x(r["torch_vs_1_process"]), f"{r['bubble_bound']:.2f}x ({100 * r['bubble_fraction']:.1f}% bubble)",
             _pct(r.get("pipekit_vs_1_process"), r["bubble_bound"]), _pct(r.get("pipekit_vs_busy"), r["bubble_bound"]),
             _pct(r.get("torch_vs_busy"), r["bubble_bound"])]
            for r in rows]
    headers = ["schedule", "torch counterpart", "pipekit tok/s", "torch tok/s", "pipekit/torch",
               "pipekit/torch, fastest steps", "pipekit vs 1 process", "torch vs 1 process", "bubble bound",
               "pipekit, of the bound", "pipekit, of the bound (busy cores)", "torch, of the bound (busy cores)"]
    return table(headers, body)


def loss_table(base: dict | None, rows: list[dict]) -> str:
    ref = base["final_loss"] if base else float("nan")

    def cell(run):
        return "-" if run is None else f"{run['final_loss']:.6f} ({run['final_loss'] - ref:+.1e})"

    body = [[r["schedule"], cell(r["pipekit"]), cell(r["torch"])] for r in rows]
    return table([f"final loss (vs 1 process {ref:.6f})", "pipekit", "torch"], body)


def shape_report(key: str, shape: Shape, r: dict, cfg: dict) -> str:
    base = r["baseline"]
    head = (f"### {key}: d={shape.dim}, {shape.microbatches} microbatches of {shape.micro_batch} x {shape.seq} "
            f"tokens ({shape.tokens} tokens/step), pp={PP}; median of {cfg['steps']} steps after {cfg['warmup']} "
            f"warm-ups, {len(round_sizes(cfg['steps'], cfg['rounds']))} alternating rounds")
    base_line = (f"1 process (plain loop, 1 thread): {base['tokens_per_s']:,.0f} tok/s "
                 f"(median step {base['step_s'] * 1e3:.1f} ms)" if base else "1 process: failed")
    busy = r["rows"][0].get("busy") if r["rows"] else None
    if busy:
        base_line += (f"; the same loop on both ranks at once (both cores busy, as in a pipeline): "
                      f"{busy['tokens_per_s']:,.0f} tok/s per process (median step {busy['step_s'] * 1e3:.1f} ms)")
    return "\n\n".join([head, base_line, throughput_table(r["rows"]), loss_table(base, r["rows"])])


def report(results: dict, cfg: dict, info: dict) -> str:
    load = info["load_average"]
    busy = load["before"][0] > 0.5 * info["cores"]  # "after" includes this run's own 2 ranks
    parts = [f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, gloo, 1 thread per rank; "
             f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}"
             + (" -- WARNING: other work shared the CPUs, pp=2 figures are inflated" if busy else "")]
    parts += [shape_report(key, SHAPES[key], r, cfg) for key, r in results.items()]
    parts.append("Targets:\n" + "\n".join(target_checks(results)))
    return "\n\n".join(parts)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    return {"cpu": cpu, "processor": platform.processor(), "cores": torch.multiprocessing.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(), "pipekit": pipekit.__version__,
            "threads_per_rank": 1, "backend": "gloo", **_git_state()}


def _git_state() -> dict:
    """The commit and whether pipekit/ differs from it (read-only git commands)."""
    def git(*args):
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return run.stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "pipekit_dirty": bool(git("diff", "--name-only", "HEAD", "--", "pipekit"))}
    except OSError:
        return {}


# ---- command line -------------------------------------------------------------
def _names(text: str, allowed, what: str, p) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        p.error(f"--{what}: got {text!r}; choose from {', '.join(allowed)}")
    return names


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    p.add_argument("--quick", action="store_true", help="smoke mode: 2 timed steps after 1 warm-up (~1-2 min)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: compute, overhead")
    p.add_argument("--schedules", default=",".join(SCHEDULE_NAMES),
                   help=f"comma-separated, of: {', '.join(SCHEDULE_NAMES)}")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS})")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    return {"steps": min(a.steps, 2) if a.quick else a.steps, "warmup": 1 if a.quick else 2,
            "rounds": 2 if a.quick else 4, "quick": a.quick, "out": a.out,
            "shapes": _names(a.shapes, SHAPES, "shapes", p),
            "schedules": _names(a.schedules, SCHEDULE_NAMES, "schedules", p),
            "command": " ".join(["python", *sys.argv])}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    started, load_before = time.perf_counter(), load_average()
    shapes = {k: SHAPES[k] for k in cfg["shapes"]}
    timing = {k: cfg[k] for k in ("steps", "warmup", "rounds")}
    per_rank = run_distributed(worker, PP, shapes, cfg["schedules"], timing, timeout=7200, op_timeout=300)
    results = {}
    for key, shape in shapes.items():
        base, rows = shape_rows([r[key] for r in per_rank], shape, cfg["schedules"])
        results[key] = {"shape": asdict(shape), "baseline": base, "rows": rows, "errors": per_rank[0][key]["errors"]}
    info = {**machine(), "load_average": {"before": load_before, "after": load_average()}}
    print(report(results, timing, info))
    elapsed = time.perf_counter() - started
    out = {"machine": info, "command": cfg["command"], "timing": timing, "pp": PP, "quick": cfg["quick"],
           "model": {"layers": LAYERS, "heads": HEADS, "vocab": VOCAB, "tied": False, "optimizer": f"AdamW lr={LR}"},
           "torch_schedules": TORCH_SCHEDULES, "results": results, "elapsed_s": elapsed}
    cfg["out"].parent.mkdir(parents=True, exist_ok=True)
    cfg["out"].write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {cfg['out']} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
