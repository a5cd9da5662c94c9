"""ZeRO-3 inside pipeline stages: pipekit stage 3 against stage 1 and against a torchtitan-style
FSDP2 + torch.distributed.pipelining step, pp=2 x dp=2, on CPU.

Run:  python benchmarks/zero3_vs_torch.py [--quick] [--steps N] [--shape compute|small]

What is measured
----------------
One optimizer step (1F1B, AdamW lr 1e-3 weight decay 0.01, fp32) of the untied
GPT of benchmarks/vs_torch_pipelining.py (8 pre-norm blocks, 4 heads, vocabulary
512), on 4 gloo ranks (1 thread each) laid out pp=2 x dp=2 (rank = pp_rank * 2
+ dp_rank, pipekit's order and that of `init_device_mesh(("pp", "dp"))`). The
global batch is that of vs_torch_pipelining's shape (compute: 32 x 128 tokens),
one fixed batch of random ids; each dp rank takes its half of the rows and
splits it into the same M microbatches (compute: 8 of 2 x 128 tokens per dp
rank). Stage boundaries: the blocks spread evenly, the embedding on stage 0,
the final LayerNorm and the head on stage 1, the same seeded weights
(`vs_torch_pipelining.cuts`, `pipekit.spec.build_layer`).

Runs, alternating in one spawned group:
  * pipekit ZeRO-1: `PipelineModule(topology=Topology(pp=2, dp=2),
    schedule=1f1b)` + `ZeroOptimizer(module, "adamw", stage=1)` +
    `PipelineEngine.train_batch(..., reduce_loss=True)`;
  * pipekit ZeRO-3: the same with `stage=3` (each layer of the stage
    `fully_shard`-ed over its dp group, gathered once per step, its gradients
    accumulated over the microbatches and reduce-scattered once at the step's end);
  * torch (torchtitan-style): a 2-D `init_device_mesh("cpu", (2, 2),
    mesh_dim_names=("pp", "dp"))`; the stage's layers as an `nn.Sequential`,
    `fully_shard` on each TransformerBlock and then on the Sequential (its root,
    holding the embedding or the final norm and head) over the dp submesh, with
    `reshard_after_forward=False` (torchtitan's default when pp > 1); a
    `PipelineStage` over the pp submesh's group; `Schedule1F1B` with the same
    loss and microbatches (it turns off FSDP's gradient sync for all but the
    step-end reduce-scatter, and divides the gradients by M); torch AdamW on the
    shards; zero_grad / schedule step / optimizer step / the loss averaged over
    dp and given to every rank (what pipekit's `reduce_loss=True` does).

Timing (`vs_torch_pipelining.first_steps` and `time_alternating`): one first
step each (a run that fails is reported, with its error, and dropped on every
rank), the rest of the warm-ups, then the timed steps in alternating rounds;
a barrier, not timed, before every step; a step's time is its slowest rank's;
the table gives the median and the fastest step. All runs start from the same
weights and take the same steps on the same batch, so their losses after the
last step must agree (float32 rounding apart): printed, with the largest
difference, and flagged when over 1e-4.

Not measured: GPUs, NCCL, memory (benchmarks/zero_memory.py), other schedules,
bf16, more than 4 ranks. Four single-threaded ranks share this machine's
cores (2 on the VM these figures come from), so the step times compare the
runs under the same contention, not what pp or dp gain; the load averages
before and after are printed and saved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import pipekit
from pipekit.models import gpt2_loss
from pipekit.optim import ZeroOptimizer
from pipekit.schedules import build_schedule
from pipekit.spec import build_layer
from pipekit.testing import run_distributed
from vs_torch_pipelining import (
    SEED,
    SHAPES,
    Shape,
    cuts,
    first_steps,
    gpt_specs,
    load_average,
    machine,
    make_batch,
    make_loss,
    round_sizes,
    run_summary,
    table,
    time_alternating,
)

PP, DP, LR, WD = 2, 2, 1e-3, 0.01
# "small": the compute shape at half the width and sequence, for a slower or busier machine
SIZES = {"compute": SHAPES["compute"], "small": Shape(dim=128, seq=64, microbatches=8, micro_batch=4)}
RUNS = {"pipekit ZeRO-1": "pipekit, ZeroOptimizer stage 1",
        "pipekit ZeRO-3": "pipekit, ZeroOptimizer stage 3 (FSDP2 per layer)",
        "torch FSDP2 + pipelining": "torchtitan-style: fully_shard per block + root, PipelineStage, Schedule1F1B"}
LOSS_TOLERANCE = 1e-4
RESULTS = Path(__file__).parent / "results"


def local_batch(shape: Shape, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's rows of the global batch (the same split for every run)."""
    x, y = make_batch(shape)
    rows = slice(dp_rank * len(x) // DP, (dp_rank + 1) * len(x) // DP)
    return x[rows], y[rows]


def pipekit_step(shape: Shape, stage: int):
    specs = gpt_specs(shape)
    topo = pipekit.Topology(pp=PP, dp=DP)
    module = pipekit.PipelineModule(specs, loss_fn=gpt2_loss(), topology=topo, partition=cuts(specs, PP),
                                    schedule=build_schedule("1f1b", PP, shape.microbatches), seed=SEED)
    opt = ZeroOptimizer(module, "adamw", stage=stage, lr=LR, weight_decay=WD)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    batch = local_batch(shape, topo.dp_rank)
    return lambda: engine.train_batch(batch, reduce_loss=True)


def torch_step(shape: Shape):
    """torchtitan's FSDP2 + PP recipe on this rank's stage."""
    import torch.distributed.pipelining as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    specs = gpt_specs(shape)
    bounds = cuts(specs, PP)
    model = nn.Sequential(*[build_layer(specs, i, seed=SEED) for i in range(bounds[pp_rank], bounds[pp_rank + 1])])
    for layer in model:
        if type(layer).__name__ == "TransformerBlock":
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    stage = tp.PipelineStage(model, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = tp.Schedule1F1B(stage, n_microbatches=shape.microbatches, loss_fn=make_loss())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    x, y = local_batch(shape, dp_rank)
    first, last = pp_rank == 0, pp_rank == PP - 1

    def step():
        opt.zero_grad(set_to_none=True)
        losses: list = []
        sched.step(*((x,) if first else ()), return_outputs=False, **({"target": y, "losses": losses} if last else {}))
        opt.step()
        mean = torch.stack(losses).double().mean() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(mean)  # the last stage's dp ranks hold a loss each, the others 0
        return mean.item() / DP

    return step


def worker(shape: Shape, cfg: dict) -> dict:
    makers = {"pipekit ZeRO-1": lambda: pipekit_step(shape, 1), "pipekit ZeRO-3": lambda: pipekit_step(shape, 3),
              "torch FSDP2 + pipelining": lambda: torch_step(shape)}
    fns, errors = first_steps(makers)
    return {"runs": time_alternating(fns, cfg["warmup"], cfg["steps"], cfg["rounds"]), "errors": errors}


# ---- report -------------------------------------------------------------------
def rows_of(per_rank: list[dict], shape: Shape) -> list[dict]:
    rows = [{"run": name, "what": what, "result": run_summary(per_rank, name, shape),
             "error": per_rank[0]["errors"].get(name)} for name, what in RUNS.items()]
    stage1 = rows[0]["result"]
    for r in rows:
        res = r["result"]
        r["vs_stage1"] = res["step_s"] / stage1["step_s"] if res and stage1 else None
    return rows


def loss_spread(rows: list[dict]) -> float | None:
    losses = [r["result"]["final_loss"] for r in rows if r["result"]]
    return max(losses) - min(losses) if len(losses) > 1 else None


def step_table(rows: list[dict]) -> str:
    def cells(r):
        res = r["result"]
        if res is None:
            return [f"failed: {(r['error'] or 'no result')[:300]}", "-", "-", "-", "-"]
        return [f"{res['step_s'] * 1e3:,.0f} ms", f"{res['step_s_min'] * 1e3:,.0f} ms",
                "-" if r["vs_stage1"] is None else f"{r['vs_stage1']:.2f}", f"{res['tokens_per_s']:,.0f}",
                f"{res['final_loss']:.7f}"]

    return table(["run", "median step", "fastest step", "step / ZeRO-1", "tok/s", "loss after the last step"],
                 [[r["run"], *cells(r)] for r in rows])


def report(shape: Shape, rows: list[dict], cfg: dict, info: dict) -> str:
    load = info["load_average"]
    busy = load["before"][0] > 0.5 * info["cores"]
    spread = loss_spread(rows)
    agree = ("-" if spread is None else
             f"{spread:.1e} ({'within' if spread <= LOSS_TOLERANCE else 'OVER'} {LOSS_TOLERANCE:g})")
    return "\n\n".join([
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, gloo, 1 thread per rank, "
        f"{PP * DP} ranks; load average (1, 5, 15 min) before {load['before']}, after {load['after']}"
        + (" -- WARNING: other work shared the CPUs, step times are inflated" if busy else ""),
        f"GPT d={shape.dim}, 8 blocks, untied, fp32, AdamW; pp={PP} x dp={DP}, 1F1B, global batch "
        f"{shape.microbatches * shape.micro_batch} x {shape.seq} tokens ({shape.tokens} tokens/step), "
        f"{shape.microbatches} microbatches of {shape.micro_batch // DP} x {shape.seq} per dp rank; median of "
        f"{cfg['steps']} steps after {cfg['warmup']} warm-ups, {len(round_sizes(cfg['steps'], cfg['rounds']))} "
        "alternating rounds, slowest rank per step",
        step_table(rows),
        f"Largest difference between the runs' losses after the last step: {agree}",
    ])


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16, help="timed steps per run (default 16)")
    p.add_argument("--quick", action="store_true", help="smoke mode: 2 timed steps after 1 warm-up")
    p.add_argument("--shape", default="compute", choices=list(SIZES),
                   help="compute: vs_torch_pipelining's (d=256, 32 x 128 tokens); small: d=128, 32 x 64")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for zero3_vs_torch.json and .md")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    return {"steps": min(a.steps, 2) if a.quick else a.steps, "warmup": 1 if a.quick else 2,
            "rounds": 2 if a.quick else 4, "quick": a.quick, "shape": a.shape, "out": a.out,
            "command": " ".join(["python", *sys.argv])}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    shape = SIZES[cfg["shape"]]
    started, load_before = time.perf_counter(), load_average()
    timing = {k: cfg[k] for k in ("steps", "warmup", "rounds")}
    per_rank = run_distributed(worker, PP * DP, shape, timing, timeout=1800, op_timeout=300)
    rows = rows_of(per_rank, shape)
    info = {**machine(), "load_average": {"before": load_before, "after": load_average()}}
    text = report(shape, rows, timing, info)
    print(text)
    elapsed = time.perf_counter() - started
    out = {"machine": info, "command": cfg["command"], "timing": timing, "pp": PP, "dp": DP, "quick": cfg["quick"],
           "shape": {"name": cfg["shape"], **asdict(shape)}, "optimizer": f"AdamW lr={LR} weight_decay={WD}",
           "rows": rows, "loss_spread": loss_spread(rows), "elapsed_s": elapsed}
    cfg["out"].mkdir(parents=True, exist_ok=True)
    (cfg["out"] / "zero3_vs_torch.json").write_text(json.dumps(out, indent=2) + "\n")
    (cfg["out"] / "zero3_vs_torch.md").write_text(f"`{cfg['command']}`\n\n{text}\n")
    print(f"\nwrote {cfg['out'] / 'zero3_vs_torch.json'} and zero3_vs_torch.md in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
