"""Per-rank memory of ZeroOptimizer stages 0-3 against the ZeRO paper and the planner, and step time against torch.

Run:  python benchmarks/zero_memory.py [--steps 8] [--warmup 2] [--dp 1 2 4]

What is measured
----------------
One spawned gloo group per dp size N (1 thread per rank, pp=1), everything
for that N inside it. The model is a GPT-2 (`get_model("gpt2", "tiny",
n_layers=4, dim=256)`: byte vocabulary, tied embedding/head, Psi = 3,257,856
parameters, counted from the built module).

1. Memory. For stage 0, 1, 2 and two gradient dtypes, a bf16 model
   (`precision="bf16"`) and `ZeroOptimizer(module, "adamw", stage=s,
   grad_dtype=g, bucket_mb=0.25)` take one `train_batch` (one microbatch of one
   16-token row per rank: memory does not depend on the batch), so that the
   AdamW state exists and stage 2 has run its reductions; then each
   rank reports `opt.memory_bytes()`: params, grads (stage 2: its gradient
   shard plus the peak of full buckets in flight, shown apart), master,
   optimizer state (exp_avg, exp_avg_sq; the scalar step counters are left
   out). The table gives the largest rank (they differ by at most padding).
   Formulas, per rank, Psi parameters:
     grad_dtype=bf16 (the ZeRO paper's mixed-precision Adam, 16-bit
     gradients): 16 Psi; 4 Psi + 12 Psi/N; 2 Psi + 14 Psi/N.
     grad_dtype=fp32 (pipekit's default, from the zero.py docstring):
     18 Psi; 6 Psi + 12 Psi/N; 2 Psi + 16 Psi/N.
   Buckets are padded to a multiple of N, so measured can sit slightly above
   the formula (not with this model: its buckets need no padding).
   Stage 2 also holds the buckets in flight: at most max_inflight=2 reduced
   plus the one filling, O(bucket size) whatever Psi. bucket_mb=0.25 keeps
   that small beside this small model's 6.5 MB of bf16 (13 MB of fp32)
   gradients, as a 25 MB bucket is beside a billion-parameter model's.
   Also reported, not in `memory_bytes`: with bf16 gradients the step casts
   this rank's owned gradient to an fp32 copy (`master.grad`) for the
   update, freed at the end of the step (a peak during the step only).
2. Against torch. The same model in fp32 (ZeroRedundancyOptimizer keeps no
   master weights, so fp32 is the like-for-like case), the same initial
   weights, the same batches (global batch 8 x 64 tokens, split over dp, one
   microbatch), AdamW with the same hyperparameters:
     pipekit: PipelineModule (fp32) + ZeroOptimizer stage 1 (default
       bucket_mb=25) + PipelineEngine.train_batch; on gloo each bucket is
       all-reduced (its reduce-scatter is slower there), started during
       the backward pass once it and every bucket before it in the
       optimizer's order are complete, and the updated shards are shared
       by N broadcasts (instead of an all-gather);
     torch: `reference_model(specs, seed)` (the spec list as one
       nn.Sequential) in DDP (gradient_as_bucket_view=True, default 25 MB
       buckets) + ZeroRedundancyOptimizer(AdamW,
       parameters_as_bucket_view=True: one broadcast per rank instead of
       one per parameter); a step is zero_grad, forward, loss, backward,
       step, and the loss averaged over dp (pipekit's train_batch also
       all-reduces its loss).
   After `--warmup` steps each, the two alternate step by step (the first
   to go swaps every step) for `--steps` steps each; a barrier, not timed,
   precedes each step; a step's time is its slowest rank's; the table gives
   the median and the min-max. Memory per rank: pipekit from
   `memory_bytes()`; torch: parameter bytes, gradient bytes (DDP's buckets,
   which the gradients are views of) and the tensors in
   `optim.optim.state` for this rank's shard (largest rank shown: torch
   shards whole parameters greedily, pipekit flat equal shards). Formula
   for both: 4 Psi + 4 Psi + 8 Psi/N. The loss after the last step of each
   is printed as a check that they do the same work.
3. Stage 3 (each layer FSDP2-sharded over dp, `pipekit.optim.fsdp`). Memory:
   the bf16 model of 1. with `ZeroOptimizer(module, "adamw", stage=3,
   grad_dtype=g, reshard_after_forward=r)` for (g, r) in STAGE3, one
   train_batch of one microbatch. Two views per rank:
     between steps: `opt.memory_bytes()` (FSDP's local parameter shard, the
       gradient shard FSDP reduce-scattered, the fp32 master shard, Adam's
       moments), against 2/N + g/N + 4/N + 8/N bytes per parameter: 16 Psi/N
       with bf16 gradients (the ZeRO paper's), 18 Psi/N with fp32 ones;
       also what FSDP still holds whole then (0 when it has resharded);
     in the step: what FSDP holds whole, summed over its parameters'
       storages: the unsharded gradients (`unsharded_accumulated_grad`, in
       the reduce dtype, plus any `.grad` not yet folded into it) just before
       the optimizer step (the benchmark wraps
       `ZeroOptimizer._take_sharded_grads`, which reduce-scatters: nothing is
       reduced before then, so it is their peak), and the gathered parameters
       (`_unsharded_param`) at their peak: the most held at once, measured
       there and just before every reshard of a layer (the benchmark wraps
       each FSDP param group's `reshard`). Formulas: 2 Psi gathered without
       reshard_after_forward (every layer stays gathered to the step's end),
       g Psi of gradients (0 at dp=1, where FSDP shards nothing and stage 3
       is stage 0).
   Against the planner: `pipekit.plan.memory.memory_plan` for the same model at
   pp=1 x dp, train.precision=bf16 (the engine's fp32 reduce dtype, so only
   the fp32-gradient rows), ZeRO-3, optimizer.reshard_after_forward=r (at
   dp=1 its stage-0 row, what stage 3 runs there): params, grads, master,
   optimizer, gathered and unsharded grads, measured / predicted, target
   within 10%. Activations are not compared (the memory rows measure model
   state only).
   Step time: the timed runs of 2. alternate with two more, fp32, the same
   weights and batches: `ZeroOptimizer(stage=3)` under the same engine, and
   a torchtitan-style loop on `reference_model` (`fully_shard` per
   transformer block, then the root, which holds the tied embedding/head
   and the final norm; torch AdamW on the shards; zero_grad, forward, loss,
   backward, step). Memory between steps: both 16 Psi/N.
4. Collectives. What the two steps communicate, timed alone on this
   backend: all_reduce, reduce_scatter_tensor and all_gather_into_tensor of
   a Psi-element fp32 buffer, and N broadcasts of its N slices (what
   ZeroRedundancyOptimizer sends after its step); median of 5 after a
   barrier, slowest rank. Both steps send an all_reduce and N broadcasts
   on gloo; the reduce-scatter and all-gather columns show why pipekit
   avoids them there.

Not measured: GPUs, NCCL, peak allocator memory (activations, temporaries,
communication buffers, FSDP's all-gather and reduce-scatter buffers: these
are the bytes each optimizer holds by design, not a high-water mark of the
process), fp16 loss scaling, more than one microbatch, pp or tp > 1, bf16
step times (this CPU has no bf16 matmul units, so they would time the
emulation). N ranks share this machine's cores: at dp=4 four processes run
on 2 cores, so the step times compare the runs under the same contention,
not what dp gains.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import pipekit
from pipekit.config import load_run
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer
from pipekit.plan import memory as memplan
from pipekit.plan import planner, profiler
from pipekit.testing import reference_model, run_distributed
from pipeline_overhead import load_average, machine, table

MODEL = dict(n_layers=4, dim=256)  # Psi = 3,257,856 with the tiny flavour's byte vocabulary
SEED, LR, WD = 0, 1e-3, 0.1
BUCKET_MB = 0.25  # memory rows: small beside the model's gradients
MEMORY_BATCH = (1, 16)  # (rows, tokens) per rank for the memory rows
GLOBAL_BATCH, SEQ = 8, 64  # timed runs, split over dp
GRAD_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLUMNS = ("params", "grads", "master", "optimizer_state")
TARGET = 0.05  # measured within 5% of the formula
PLAN_TARGET = 0.10  # stage 3: each component within 10% of pipekit.plan.memory's prediction
STAGE3 = (("bf16", False), ("fp32", False), ("fp32", True))  # (grad dtype, reshard_after_forward) of the rows
RESULTS = Path(__file__).parent / "results"


# ---- formulas -----------------------------------------------------------
def formula_bytes_per_param(stage: int, n: int, grad_bytes: int) -> dict:
    """ZeRO's bytes per parameter on one rank: bf16 params, `grad_bytes` gradients,
    fp32 master and Adam state (m, v); stage 1 shards master and state, stage 2 gradients too."""
    return {"params": 2.0, "grads": grad_bytes / (n if stage == 2 else 1),
            "master": 4.0 / (n if stage >= 1 else 1), "optimizer_state": 8.0 / (n if stage >= 1 else 1)}


def fp32_stage1_bytes_per_param(n: int) -> dict:
    """An fp32 model at stage 1 (pipekit or ZeroRedundancyOptimizer): no separate master copy."""
    return {"params": 4.0, "grads": 4.0, "master": 0.0, "optimizer_state": 8.0 / n}


# ---- memory rows (in a worker) ------------------------------------------
def memory_row(cfg, topo, stage: int, grad_name: str) -> dict:
    """One bf16 step at `stage` with `grad_name` gradients; this rank's bytes by column."""
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    precision="bf16")
    opt = ZeroOptimizer(module, "adamw", stage=stage, grad_dtype=GRAD_DTYPES[grad_name], bucket_mb=BUCKET_MB,
                        lr=LR, weight_decay=WD)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    ids = torch.randint(0, cfg.vocab_size, (MEMORY_BATCH[0], MEMORY_BATCH[1] + 1),
                        generator=torch.Generator().manual_seed(topo.dp_rank))
    engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]), reduce_loss=True)
    mem = opt.memory_bytes()
    # the step's transient fp32 copy of the owned gradient (freed at the end of the step)
    fp32_grad_copy = sum(b.master.numel() * b.master.element_size() for b in opt.buckets
                         if opt.grad_dtype != opt.master_dtype)
    row = {"stage": stage, "grad_dtype": grad_name, "psi": sum(p.numel() for p in module.parameters()),
           "buckets": len(opt.buckets), "inflight_bytes": opt.peak_inflight_bytes if stage == 2 else 0,
           "fp32_grad_copy_bytes": fp32_grad_copy, **mem}
    del engine, opt, module
    gc.collect()
    return row


def fsdp_held_bytes(layers) -> dict:
    """Bytes FSDP holds whole on this rank now, over the layers it shards: the gathered
    parameters (the storage of each parameter's unsharded copy) and the unsharded gradients
    (the accumulated ones in the reduce dtype, and any not yet folded in). Each storage once;
    a freed one has 0 bytes. FSDP's internals: `fully_shard.state(layer)._fsdp_param_group`."""
    storages: dict[str, dict[int, int]] = {"gathered": {}, "unsharded_grads": {}}

    def add(kind, t):
        if t is not None:
            s = t.untyped_storage()
            storages[kind][s.data_ptr()] = s.nbytes()

    for layer in layers:
        for fp in fully_shard.state(layer)._fsdp_param_group.fsdp_params:  # type: ignore[attr-defined]
            full = getattr(fp, "_unsharded_param", None)
            add("gathered", full)
            add("unsharded_grads", None if full is None else full.grad)
            add("unsharded_grads", fp.unsharded_accumulated_grad)
    return {kind: sum(v for ptr, v in found.items() if ptr) for kind, found in storages.items()}


def stage3_memory_row(cfg, topo, grad_name: str, reshard: bool) -> dict:
    """One bf16 step at stage 3: this rank's persistent bytes (`memory_bytes`, between steps)
    and what FSDP holds whole at the end of the step's backward passes (measured just before
    the optimizer takes the gradients: the step's peak of both, since nothing is resharded
    or reduced before then)."""
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    precision="bf16")
    largest = max(sum(p.numel() for p in m.parameters()) for m in [*module.layers.values(), *module.tied.values()])
    opt = ZeroOptimizer(module, "adamw", stage=3, grad_dtype=GRAD_DTYPES[grad_name], reshard_after_forward=reshard,
                        lr=LR, weight_decay=WD)
    held = {"gathered": 0, "unsharded_grads": 0}  # dp=1: FSDP shards nothing, the optimizer never calls it
    take, layers = opt._take_sharded_grads, opt.sharded_layers

    def measured_take():
        held.update(fsdp_held_bytes(layers))
        take()

    opt._take_sharded_grads = measured_take  # type: ignore[method-assign]
    peak = {"gathered": 0}  # the most held gathered at once: just before each reshard frees a layer

    def watched(group):
        reshard = group.reshard

        def measured_reshard():
            peak["gathered"] = max(peak["gathered"], fsdp_held_bytes(layers)["gathered"])
            reshard()
        return measured_reshard

    for layer in layers:
        group = fully_shard.state(layer)._fsdp_param_group  # type: ignore[attr-defined]
        group.reshard = watched(group)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    ids = torch.randint(0, cfg.vocab_size, (MEMORY_BATCH[0], MEMORY_BATCH[1] + 1),
                        generator=torch.Generator().manual_seed(topo.dp_rank))
    engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]), reduce_loss=True)
    after = fsdp_held_bytes(layers)
    held["gathered"] = max(held["gathered"], peak["gathered"])
    row = {"stage": 3, "grad_dtype": grad_name, "reshard_after_forward": reshard,
           "psi": sum(p.numel() for p in module.parameters()), "sharded_layers": len(opt.sharded_layers),
           "largest_layer": largest,
           **opt.memory_bytes(), "gathered": held["gathered"], "unsharded_grads": held["unsharded_grads"],
           "held_after_step": after["gathered"] + after["unsharded_grads"]}
    del engine, opt, module
    gc.collect()
    return row


# ---- pipekit vs torch (in a worker) ---------------------------------------
def batches(cfg, steps: int, rank: int, dp: int) -> list:
    """The same global batches for both runs; this rank's rows of each."""
    gen = torch.Generator().manual_seed(SEED + 1)
    rows = slice(rank * GLOBAL_BATCH // dp, (rank + 1) * GLOBAL_BATCH // dp)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)[rows]
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def pipekit_run(cfg, topo, stage: int = 1):
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=SEED)
    opt = ZeroOptimizer(module, "adamw", stage=stage, lr=LR, weight_decay=WD)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    return (lambda batch: engine.train_batch(iter([batch]), reduce_loss=True)), opt.memory_bytes


def torch_run(cfg):
    model = reference_model(model_specs(cfg), SEED)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, parameters_as_bucket_view=True,
                                  lr=LR, weight_decay=WD)
    loss_fn = model_loss(cfg).build()

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().double()
        dist.all_reduce(mean)
        return (mean / dist.get_world_size()).item()

    def memory():
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        state = [v for s in opt.optim.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.numel() > 1]  # the scalar step counters left out, as pipekit does
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return {"params": nbytes(model.parameters()), "grads": nbytes(grads), "master": 0,
                "optimizer_state": nbytes(state)}

    return step, memory


def fsdp2_run(cfg):
    """torchtitan's recipe on the plain model: `fully_shard` each transformer block, then the
    root (the tied embedding/head and the final norm), over all ranks; AdamW on the shards."""
    model = reference_model(model_specs(cfg), SEED)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        if type(block).__name__ == "TransformerBlock":
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    loss_fn = model_loss(cfg).build()

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().double()
        dist.all_reduce(mean)
        return (mean / dist.get_world_size()).item()

    def memory():
        def nbytes(tensors):
            return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else
                       t.numel() * t.element_size() for t in tensors)

        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return {"params": nbytes(model.parameters()), "grads": nbytes(grads), "master": 0,
                "optimizer_state": nbytes(state)}

    return step, memory


def compare_with_torch(cfg, topo, warmup: int, steps: int) -> dict:
    """Every run alternating with the others step by step (the order reversed every step)."""
    runs = {"pipekit": pipekit_run(cfg, topo), "torch": torch_run(cfg), "pipekit_stage3": pipekit_run(cfg, topo, 3),
            "torch_fsdp2": fsdp2_run(cfg)}
    data = batches(cfg, warmup + steps, topo.dp_rank, topo.dp)
    times = {name: [] for name in runs}
    losses = {}
    for i, batch in enumerate(data):
        for name in (list(runs) if i % 2 == 0 else list(reversed(runs))):
            dist.barrier()
            start = time.perf_counter()
            losses[name] = runs[name][0](batch)
            times[name].append(time.perf_counter() - start)
    slowest = torch.tensor([times[name][warmup:] for name in runs], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: {"step_s": slowest[i].tolist(), "final_loss": losses[name], "memory": runs[name][1]()}
            for i, name in enumerate(runs)}


def collective_ms(numel: int, reps: int = 5) -> dict:
    """Median ms (slowest rank) of each collective the two steps use, on a `numel`-element fp32 buffer."""
    n, r = dist.get_world_size(), dist.get_rank()
    full = torch.randn(numel // n * n)
    shard = full.chunk(n)[r].clone()
    ops = {"all_reduce": lambda: dist.all_reduce(full),
           "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
           "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
           "broadcast x N": lambda: [dist.broadcast(part, src=i) for i, part in enumerate(full.chunk(n))]}
    out = {}
    for name, op in ops.items():
        times = torch.zeros(reps, dtype=torch.float64)
        for i in range(reps):
            dist.barrier()
            start = time.perf_counter()
            op()
            times[i] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out[name] = statistics.median(times.tolist()) * 1e3
    return out


def dp_worker(warmup: int, steps: int) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_tensor collectives are deprecated
    cfg = get_model("gpt2", "tiny", **MODEL)
    topo = pipekit.Topology(pp=1, dp=dist.get_world_size())
    memory = [memory_row(cfg, topo, stage, g) for g in GRAD_DTYPES for stage in (0, 1, 2)]
    stage3 = [stage3_memory_row(cfg, topo, g, reshard) for g, reshard in STAGE3]
    versus = compare_with_torch(cfg, topo, warmup, steps)
    collectives = collective_ms(memory[0]["psi"]) if topo.dp > 1 else None
    return {"memory": memory, "stage3": stage3, "versus_torch": versus, "collectives_ms": collectives}


# ---- rows ------------------------------------------------------------------
def memory_rows(dp: int, per_rank: list[dict]) -> list[dict]:
    rows = []
    for i, first in enumerate(per_rank[0]["memory"]):
        ranks = [r["memory"][i] for r in per_rank]
        top = max(ranks, key=lambda r: sum(r[c] for c in COLUMNS))
        grad_bytes = torch.finfo(GRAD_DTYPES[first["grad_dtype"]]).bits // 8
        formula = {c: b * first["psi"] for c, b in formula_bytes_per_param(first["stage"], dp, grad_bytes).items()}
        total = sum(top[c] for c in COLUMNS)
        rows.append({"dp": dp, "stage": first["stage"], "grad_dtype": first["grad_dtype"], "psi": first["psi"],
                     "buckets": first["buckets"], **{c: top[c] for c in COLUMNS}, "total": total,
                     "inflight": top["inflight_bytes"], "fp32_grad_copy": top["fp32_grad_copy_bytes"],
                     "formula": formula, "formula_total": sum(formula.values()),
                     "ratio": total / sum(formula.values()),
                     "ratio_without_inflight": (total - top["inflight_bytes"]) / sum(formula.values()),
                     "per_rank_total": [sum(r[c] for c in COLUMNS) for r in ranks]})
    return rows


VERSUS = (("pipekit", "pipekit ZeroOptimizer stage 1"), ("torch", "torch DDP + ZeroRedundancyOptimizer"))
STAGE3_VERSUS = (("pipekit", "pipekit ZeroOptimizer stage 1"), ("pipekit_stage3", "pipekit ZeroOptimizer stage 3"),
                 ("torch_fsdp2", "torch FSDP2 (fully_shard per block) + AdamW"))


def fp32_bytes_per_param(run: str, n: int) -> float:
    """An fp32 model's persistent bytes per parameter: stage 1 (pipekit, ZeroRedundancyOptimizer)
    8 + 8/N; fully sharded (pipekit stage 3, FSDP2) 16/N."""
    return 16.0 / n if run in ("pipekit_stage3", "torch_fsdp2") else sum(fp32_stage1_bytes_per_param(n).values())


def versus_rows(dp: int, psi: int, per_rank: list[dict], runs=VERSUS) -> list[dict]:
    rows = []
    for name, label in runs:
        formula = fp32_bytes_per_param(name, dp) * psi
        mems = [r["versus_torch"][name]["memory"] for r in per_rank]
        top = max(mems, key=lambda m: sum(m[c] for c in COLUMNS))
        steps = per_rank[0]["versus_torch"][name]["step_s"]  # already the slowest rank's
        total = sum(top[c] for c in COLUMNS)
        rows.append({"dp": dp, "run": label, **{c: top[c] for c in COLUMNS}, "total": total,
                     "formula_total": formula, "ratio": total / formula,
                     "state_per_rank": [m["optimizer_state"] for m in mems],
                     "step_s_median": statistics.median(steps), "step_s_min": min(steps), "step_s_max": max(steps),
                     "step_s": steps, "final_loss": per_rank[0]["versus_torch"][name]["final_loss"]})
    return rows


def planner_prediction(dp: int, reshard: bool) -> dict:
    """pipekit.plan.memory's bytes per rank for this model at pp=1 x dp, bf16 (fp32 gradients, the
    engine's reduce dtype), one microbatch of MEMORY_BATCH, ZeRO-3 (at dp=1 the plan has only
    stage 0: what stage 3 runs there), no checkpointing; `optimizer.reshard_after_forward` as the run's."""
    run = load_run(None, ["model.family=gpt2", "model.flavour=tiny", *(f"model.{k}={v}" for k, v in MODEL.items()),
                          "parallel.pp=1", f"parallel.dp={dp}", "train.precision=bf16", "optimizer.name=adamw",
                          f"optimizer.zero_stage={3 if dp > 1 else 0}", f"optimizer.reshard_after_forward={reshard}",
                          f"train.micro_batch={MEMORY_BATCH[0]}",
                          f"train.seq_len={MEMORY_BATCH[1]}", "schedule.microbatches=1", "data.source=synthetic",
                          "logging.out_dir=null"])
    prof = profiler.flop_layers(run)
    comm = profiler.CommModel()
    cands = planner.plan(run, prof, comm, schedules=["1f1b"], partitions=["parameters"], microbatches=[1])
    rows = memplan.memory_plan(run, prof, comm, cands, float("inf"))
    row = next(r for r in rows if r.option.zero == (3 if dp > 1 else 0) and not r.option.ac)
    return {k: getattr(row.memory, k) for k in memplan.COMPONENTS}


def stage3_rows(dp: int, per_rank: list[dict]) -> list[dict]:
    """Per stage-3 setting, the largest rank's bytes; formulas and the planner's prediction."""
    rows = []
    for i, first in enumerate(per_rank[0]["stage3"]):
        ranks = [r["stage3"][i] for r in per_rank]
        top = max(ranks, key=lambda r: sum(r[c] for c in (*COLUMNS, "gathered", "unsharded_grads")))
        psi, g = first["psi"], torch.finfo(GRAD_DTYPES[first["grad_dtype"]]).bits // 8
        whole = 1 if dp > 1 else 0  # dp=1: FSDP shards nothing, nothing is gathered
        persistent = sum(top[c] for c in COLUMNS)
        formula = {"params": 2 * psi / dp, "grads": g * psi / dp, "master": 4 * psi / dp,
                   "optimizer_state": 8 * psi / dp,
                   "gathered": 2 * (first["largest_layer"] if first["reshard_after_forward"] else psi) * whole,
                   "unsharded_grads": g * psi * whole}
        persistent_formula = sum(formula[c] for c in COLUMNS)
        peak = persistent + top["gathered"] + top["unsharded_grads"]
        row = {"dp": dp, "stage": 3, "grad_dtype": first["grad_dtype"],
               "reshard_after_forward": first["reshard_after_forward"], "psi": psi,
               **{c: top[c] for c in (*COLUMNS, "gathered", "unsharded_grads")},
               "persistent": persistent, "persistent_formula": persistent_formula,
               "persistent_ratio": persistent / persistent_formula, "step_peak": peak,
               "step_peak_formula": sum(formula.values()), "step_peak_ratio": peak / sum(formula.values()),
               "formula": formula, "held_after_step": max(r["held_after_step"] for r in ranks),
               "per_rank_persistent": [sum(r[c] for c in COLUMNS) for r in ranks]}
        if first["grad_dtype"] == "fp32":  # the planner models the engine's fp32 reduce dtype only
            plan = planner_prediction(dp, first["reshard_after_forward"])
            measured = {"params": top["params"], "grads": top["grads"], "master": top["master"],
                        "optimizer": top["optimizer_state"], "gathered": top["gathered"],
                        "unsharded_grads": top["unsharded_grads"]}
            row["plan"] = plan
            row["plan_ratio"] = {k: (v / plan[k] if plan[k] else (1.0 if v == 0 else float("inf")))
                                 for k, v in measured.items()}
            plan_state = sum(plan[k] for k in measured)
            row["plan_state_total"] = plan_state
            row["plan_ratio"]["total"] = sum(measured.values()) / plan_state
        rows.append(row)
    return rows


# ---- report ----------------------------------------------------------------
def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def formula_text(stage: int, grad_dtype: str) -> str:
    return {("bf16", 0): "16Ψ", ("bf16", 1): "4Ψ+12Ψ/N", ("bf16", 2): "2Ψ+14Ψ/N",
            ("fp32", 0): "18Ψ", ("fp32", 1): "6Ψ+12Ψ/N", ("fp32", 2): "2Ψ+16Ψ/N"}[(grad_dtype, stage)]


def memory_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        grads = mb(r["grads"]) + (f" ({mb(r['inflight'])} in flight)" if r["stage"] == 2 else "")
        flag = "" if abs(r["ratio"] - 1) <= TARGET else " **miss**"
        body.append([r["grad_dtype"], r["stage"], r["dp"], mb(r["params"]), grads, mb(r["master"]),
                     mb(r["optimizer_state"]), mb(r["total"]), f"{formula_text(r['stage'], r['grad_dtype'])} = "
                     f"{mb(r['formula_total'])}", f"{r['ratio']:.3f}{flag}", mb(r["fp32_grad_copy"])])
    return table(["grads", "stage", "dp", "params MB", "grads MB", "master MB", "Adam state MB", "total MB",
                  "formula MB", "measured / formula", "fp32 grad copy during the step MB (not in total)"], body)


def versus_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        body.append([r["dp"], r["run"], mb(r["params"]), mb(r["grads"]), mb(r["optimizer_state"]), mb(r["total"]),
                     f"8Ψ+8Ψ/N = {mb(r['formula_total'])}", f"{r['ratio']:.3f}",
                     f"{r['step_s_median'] * 1e3:.0f}", f"{r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f}",
                     f"{r['final_loss']:.6f}"])
    return table(["dp", "run", "params MB", "grads MB", "Adam state MB", "total MB", "formula MB",
                  "measured / formula", "step ms (median)", "min-max", "loss after last step"], body)


def versus_stage3_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        f = "16Ψ/N" if "stage 3" in r["run"] or "FSDP2" in r["run"] else "8Ψ+8Ψ/N"
        body.append([r["dp"], r["run"], mb(r["params"]), mb(r["grads"]), mb(r["optimizer_state"]), mb(r["total"]),
                     f"{f} = {mb(r['formula_total'])}", f"{r['ratio']:.3f}", f"{r['step_s_median'] * 1e3:.0f}",
                     f"{r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f}", f"{r['final_loss']:.6f}"])
    return table(["dp", "run", "params MB", "grads MB", "Adam state MB", "total MB (between steps)", "formula MB",
                  "measured / formula", "step ms (median)", "min-max", "loss after last step"], body)


def stage3_memory_table(rows: list[dict]) -> str:
    """Between steps (`memory_bytes`) and at the end of the backward passes (+ what FSDP holds whole)."""
    body = []
    for r in rows:
        n = "16" if r["grad_dtype"] == "bf16" else "18"
        g = "2" if r["grad_dtype"] == "bf16" else "4"
        whole = r["dp"] > 1
        body.append([r["grad_dtype"], "yes" if r["reshard_after_forward"] else "no", r["dp"], mb(r["params"]),
                     mb(r["grads"]), mb(r["master"]), mb(r["optimizer_state"]), mb(r["persistent"]),
                     f"{n}Ψ/N = {mb(r['persistent_formula'])}", f"{r['persistent_ratio']:.3f}",
                     mb(r["held_after_step"]),
                     mb(r["gathered"]) + ((" (2 x largest layer)" if r["reshard_after_forward"] else " (2Ψ)")
                                          if whole else ""),
                     mb(r["unsharded_grads"]) + (f" ({g}Ψ)" if whole else ""), mb(r["step_peak"]),
                     f"{r['step_peak_ratio']:.3f}"])
    return table(["grads", "reshard after forward", "dp", "params MB", "grads MB", "master MB", "Adam state MB",
                  "total MB between steps", "formula MB", "measured / formula", "FSDP holds whole after the step MB",
                  "gathered params in the step MB", "unsharded grads in the step MB", "peak state MB",
                  "peak / formula"], body)


def plan_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if "plan" not in r:
            continue
        ratio, plan = r["plan_ratio"], r["plan"]
        cells = []
        for k, measured in (("params", r["params"]), ("grads", r["grads"]), ("master", r["master"]),
                            ("optimizer", r["optimizer_state"]), ("gathered", r["gathered"]),
                            ("unsharded_grads", r["unsharded_grads"])):
            flag = "" if abs(ratio[k] - 1) <= PLAN_TARGET else " **miss**"
            cells.append(f"{mb(measured)} / {mb(plan[k])} = {ratio[k]:.3f}{flag}")
        flag = "" if abs(ratio["total"] - 1) <= PLAN_TARGET else " **miss**"
        body.append([r["dp"], "yes" if r["reshard_after_forward"] else "no", *cells, f"{ratio['total']:.3f}{flag}"])
    return table(["dp", "reshard after forward", "params", "grads", "master", "Adam state", "gathered",
                  "unsharded grads", "state total / plan"], body)


def collectives_table(collectives: dict) -> str:
    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast x N")
    body = [[dp, *(f"{ms[k]:.1f}" for k in names)] for dp, ms in collectives.items()]
    return table(["dp", *(f"{k} ms" for k in names)], body)


def verdicts(memory: list[dict], versus: list[dict], stage3: list[dict] | None = None) -> list[str]:
    out = []
    for r in stage3 or []:
        what = f"stage 3, {r['grad_dtype']} grads, reshard_after_forward={r['reshard_after_forward']}, dp={r['dp']}"
        if abs(r["persistent_ratio"] - 1) > TARGET:
            out.append(f"- {what}: between steps measured / formula {r['persistent_ratio']:.3f}, outside {TARGET:.0%}.")
        for k, ratio in r.get("plan_ratio", {}).items():
            if abs(ratio - 1) > PLAN_TARGET:
                out.append(f"- {what}: {k} measured / planner {ratio:.3f}, outside {PLAN_TARGET:.0%}.")
    for r in memory:
        if abs(r["ratio"] - 1) > TARGET:
            why = (f"; without the {mb(r['inflight'])} MB of buckets in flight {r['ratio_without_inflight']:.3f}"
                   if r["inflight"] else "")
            out.append(f"- {r['grad_dtype']} grads, stage {r['stage']}, dp={r['dp']}: measured / formula "
                       f"{r['ratio']:.3f}, outside {TARGET:.0%}{why}.")
    for dp in sorted({r["dp"] for r in versus}):
        pk, th = (next(r for r in versus if r["dp"] == dp and r["run"].startswith(p)) for p in ("pipekit", "torch"))
        if pk["step_s_median"] > th["step_s_median"]:
            out.append(f"- dp={dp}: pipekit stage 1 median step {pk['step_s_median'] * 1e3:.1f} ms is slower than "
                       f"ZeroRedundancyOptimizer's {th['step_s_median'] * 1e3:.1f} ms "
                       f"({pk['step_s_median'] / th['step_s_median']:.3f}x; "
                       f"min-max {pk['step_s_min'] * 1e3:.0f}-{pk['step_s_max'] * 1e3:.0f} "
                       f"vs {th['step_s_min'] * 1e3:.0f}-{th['step_s_max'] * 1e3:.0f} ms).")
    return out or ["- none: every memory figure is within its target and pipekit's step is no slower."]


def report(memory: list[dict], versus: list[dict], collectives: dict, cfg: dict, info: dict,
           stage3: list[dict], versus3: list[dict]) -> str:
    psi = memory[0]["psi"]
    loaded = info["load_average_after"] > 1.5 * info["cores"]
    return "\n\n".join([
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, gloo, 1 thread per rank; "
        f"1-min load average {info['load_average_before']:.2f} before, {info['load_average_after']:.2f} after"
        + (" -- WARNING: other work shared the CPUs, step times are inflated" if loaded else "") + ".",
        f"Model: GPT-2 tiny flavour with n_layers={MODEL['n_layers']}, dim={MODEL['dim']} "
        f"(tied embedding/head), Ψ = {psi:,} parameters. MB = 10^6 bytes, per rank (the largest rank).",
        f"Memory: bf16 model, AdamW, `ZeroOptimizer(..., grad_dtype=g, bucket_mb={BUCKET_MB:g})`, after one "
        f"train_batch. Stage 2's grads include the peak of full buckets in flight (shown in brackets). "
        f"bf16 rows compare with the ZeRO paper's formulas, fp32 rows with zero.py's.",
        memory_table(memory),
        f"Against torch, fp32 model, stage 1, global batch {GLOBAL_BATCH} x {SEQ} tokens, one microbatch: "
        f"{cfg['steps']} timed steps each after {cfg['warmup']} warm-up steps, alternating; step time = slowest rank.",
        versus_table([r for r in versus if r["run"] in dict(VERSUS).values()]),
        "ZeRO stage 3 (FSDP2 per layer), bf16 model, AdamW, `ZeroOptimizer(..., stage=3, grad_dtype=g, "
        "reshard_after_forward=r)`, one train_batch of one microbatch. Between steps: `memory_bytes()` "
        "(this rank's shards), against 16Ψ/N (bf16 grads, the ZeRO paper's) or 18Ψ/N (fp32 grads: "
        "2/N + 4/N + 4/N + 8/N bytes per parameter). In the step: what FSDP holds whole: the gathered "
        "parameters at their peak (the most at once, measured before every reshard of a layer and before the "
        "step's reduce-scatter; formula 2Ψ, the rank's whole stage, without reshard_after_forward) and the "
        "unsharded accumulated gradients just before the optimizer step reduce-scatters them (gΨ in the "
        "reduce dtype); peak state = between steps + both, against 2Ψ (with reshard_after_forward: twice "
        "the largest layer) + gΨ + the between-steps formula. "
        "At dp=1 FSDP shards nothing (stage 3 is stage 0 there: 16Ψ or 18Ψ).",
        stage3_memory_table(stage3),
        "Against the planner (`pipekit.plan.memory.memory_plan`, the same model at pp=1 x dp, train.precision=bf16: "
        "fp32 gradients, so the fp32 rows only; ZeRO-3 with optimizer.reshard_after_forward as the run's; "
        f"at dp=1 its stage-0 row): measured / predicted MB per component, target within {PLAN_TARGET:.0%}:",
        plan_table(stage3),
        f"Stage 3 against stage 1, fp32 model, pp=1, global batch {GLOBAL_BATCH} x {SEQ} tokens, one "
        "microbatch, and a torchtitan-style FSDP2 loop on the plain model (fully_shard per transformer "
        "block, then the root; torch AdamW): the same weights and batches, alternating step by step with "
        "the runs above; memory between steps (the largest rank):",
        versus_stage3_table(versus3),
        "Collectives alone, one Ψ-element fp32 buffer (13 MB), median ms, slowest rank. On gloo both "
        "steps send all_reduce (started during the backward pass) + broadcast x N; pipekit uses them "
        "instead of reduce_scatter_tensor and all_gather_into_tensor:",
        collectives_table(collectives),
        "Figures that miss a target:\n" + "\n".join(verdicts(memory, versus, stage3)),
    ])


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per run and dp (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="dp sizes (default 1 2 4); must divide 8")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for zero_memory.json and .md")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {a.steps} and {a.warmup}")
    bad = [n for n in a.dp if n < 1 or GLOBAL_BATCH % n]
    if bad:
        p.error(f"--dp {bad[0]} does not divide the global batch of {GLOBAL_BATCH}; try 1, 2, 4 or 8")
    return {"steps": a.steps, "warmup": a.warmup, "dp": a.dp, "out": a.out,
            "command": " ".join(["python", *sys.argv])}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    started, load_before = time.perf_counter(), load_average()
    memory, versus, collectives, stage3, versus3 = [], [], {}, [], []
    for dp in cfg["dp"]:
        per_rank = run_distributed(dp_worker, dp, cfg["warmup"], cfg["steps"], timeout=900, op_timeout=300)
        memory += memory_rows(dp, per_rank)
        versus += versus_rows(dp, per_rank[0]["memory"][0]["psi"], per_rank)
        stage3 += stage3_rows(dp, per_rank)
        versus3 += versus_rows(dp, per_rank[0]["memory"][0]["psi"], per_rank, STAGE3_VERSUS)
        if per_rank[0]["collectives_ms"] is not None:
            collectives[dp] = per_rank[0]["collectives_ms"]
    memory.sort(key=lambda r: (r["grad_dtype"] != "bf16", r["stage"], r["dp"]))
    info = {**machine(), "load_average_before": load_before, "load_average_after": load_average()}
    stage3.sort(key=lambda r: (r["grad_dtype"] != "bf16", r["reshard_after_forward"], r["dp"]))
    text = report(memory, versus, collectives, cfg, info, stage3, versus3)
    print(text)
    elapsed = time.perf_counter() - started
    result = {"machine": info, "command": cfg["command"], "model": {"family": "gpt2", "flavour": "tiny", **MODEL},
              "bucket_mb": BUCKET_MB, "memory_batch": MEMORY_BATCH, "global_batch": [GLOBAL_BATCH, SEQ],
              "steps": cfg["steps"], "warmup": cfg["warmup"], "memory": memory, "versus_torch": versus,
              "stage3": stage3, "versus_stage3": versus3, "collectives_ms": collectives,
              "elapsed_s": elapsed}
    cfg["out"].mkdir(parents=True, exist_ok=True)
    (cfg["out"] / "zero_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (cfg["out"] / "zero_memory.md").write_text(text + "\n")
    print(f"\nwrote {cfg['out'] / 'zero_memory.json'} and zero_memory.md in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
