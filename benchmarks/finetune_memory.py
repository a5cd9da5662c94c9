"""Memory per rank, full fine-tuning against LoRA rank 16: from the memory plan at Llama-3 8B
shapes, and the plan against the bytes a tiny Llama really holds after one step on CPU.

    python benchmarks/finetune_memory.py [--out benchmarks/results/finetune_memory.json]

(a) The plan (`pipekit.plan.memory.memory_plan`, nothing allocated: the model is built on the
meta device and fine-tuned there as `pipekit train` fine-tunes it): Llama-3 8B shapes (dim
4096, 32 layers, 32 heads, 8 kv heads, hidden 14336, vocab 128256), bf16 weights with fp32
gradients, master weights and AdamW moments, ZeRO-0, 1F1B over 16 microbatches of one
8192-token row, at pp=4 and pp=8 (tp=1, dp=1), activation checkpointing off and on; the
worst rank's bytes. LoRA: rank 16 on attention q, k, v, o and the MLP's gate, up, down, every
other weight frozen (its bf16 bytes alone).

(b) Measured: a tiny Llama (dim 512, 4 layers, 8 heads, 4 kv heads, hidden 1536, byte vocab),
one process, float32 AdamW, built by `pipekit.run.loop.build` (the training command's own
path: the module, `prepare_weights`, `ZeroOptimizer`) and trained one step
(`PipelineEngine.train_batch`). Counted: every distinct tensor storage reachable from the
parameters, their `.grad`, the optimizer's buckets (flat parameter, gradient and master
buffers) and its state (moments), each once; against the plan's params + grads + master +
optimizer for the same config (`state_memory` of `layer_params`). Each case runs in a fresh
process, which also reports its resident-set growth from before the model was built to after
the step (`VmRSS`, after a warm-up build and step of a smaller model of the case loaded every
code path, and with freed heap handed back first with glibc's `malloc_trim`; it still holds
whatever else the process keeps, the autograd engine's and the allocator's own: a
cross-check, not the figure).

Limits: the plan's activations are the meta count (`meta_activations`); the CUDA context,
workspaces and the allocator's fragmentation are not modelled on either side.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGETS = r"attn\.(q|k|v|o)$|mlp\.(gate|up|down)$"
LORA = ["model.lora.rank=16", "model.lora.alpha=32", f"model.lora.targets={TARGETS}"]
QUIET = ["data.source=synthetic", "logging.out_dir=null"]
STATE = ("params", "grads", "master", "optimizer")
TINY = [*QUIET, "model.family=llama", "model.flavour=tiny", "model.dim=512", "model.n_layers=4", "model.n_heads=8",
        "model.n_kv_heads=4", "model.hidden=1536", "train.seq_len=64", "model.max_seq_len=64", "train.micro_batch=2",
        "schedule.microbatches=2", "schedule.name=1f1b", "parallel.pp=1", "parallel.dp=1", "parallel.tp=1",
        "train.precision=fp32", "train.dtype=float32", "train.device=cpu", "optimizer.name=adamw"]


def planned_8b(pp: int, lora: bool) -> dict:
    """The memory plan's worst rank at Llama-3 8B shapes, pp ranks, AC off and on (see the docstring)."""
    from pipekit.config import load_run
    from pipekit.plan import memory as memplan
    from pipekit.plan import planner, profiler

    run = load_run(os.path.join(ROOT, "configs", "llama3_8b.yaml"),
                   [*QUIET, f"parallel.pp={pp}", "parallel.tp=1", "parallel.dp=1", "train.precision=bf16",
                    "schedule.name=1f1b", "schedule.chunks_per_rank=1", "schedule.microbatches=16",
                    "train.micro_batch=1", "train.seq_len=8192", *(LORA if lora else [])])
    prof = profiler.flop_layers(run)
    cands = planner.plan(run, prof, profiler.CommModel(), schedules=["1f1b"], partitions=["parameters"],
                         microbatches=[16])
    rows = memplan.memory_plan(run, prof, profiler.CommModel(), cands, 1e15)
    total = sum(memplan.layer_params(run), memplan.Params())
    out: dict = {"trained_params": total.trained, "frozen_params": total.frozen_dense + total.frozen_expert}
    for r in rows:
        m = r.memory
        out["AC on" if r.option.ac else "AC off"] = {
            **{k: getattr(m, k) for k in memplan.COMPONENTS}, "state": sum(getattr(m, k) for k in STATE),
            "total": m.total, "step_seconds_at_1_tflops": r.step_seconds}
    return out


def _rss() -> int:
    """This process's resident bytes, after handing freed heap back to the system (glibc's
    `malloc_trim`: freed temporaries of the build and the step's activations would count)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def _storages(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage counted once, whole)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measured_tiny(lora: bool) -> dict:
    """One case of (b), in this process: the real bytes after one step, and the plan's."""
    from pipekit.config import load_run
    from pipekit.models import model_vocab, synthetic_batches
    from pipekit.plan import memory as memplan
    from pipekit.run.loop import build
    from pipekit.topology import Topology

    def trained(overrides: list[str]):
        run = load_run(None, [*TINY, *(LORA if lora else []), *overrides])
        engine = build(run, Topology(alone=True))
        cfg = run.config.train
        rows = cfg.micro_batch * run.config.schedule.microbatches
        engine.train_batch(next(synthetic_batches(model_vocab(run.model), rows, cfg.seq_len, seed=cfg.seed)))
        return run, engine

    torch.set_num_threads(1)
    warm = trained(["model.dim=64", "model.hidden=96"])  # every code path loaded first: its pages are RSS too
    del warm
    before = _rss()
    run, engine = trained([])
    after = _rss()
    params = list(engine.module.parameters())
    opt = engine.optimizer
    buckets = [t for b in opt.buckets for t in vars(b).values() if torch.is_tensor(t)]
    moments = [t for s in (opt.inner.state.values() if opt.inner is not None else ()) for t in s.values()
               if torch.is_tensor(t) and t.numel() > 1]  # a step counter is not state of a size
    real = {"params": _storages(params), "grads": _storages(p.grad for p in params if p.grad is not None),
            "params_grads_buffers": _storages([*params, *(p.grad for p in params if p.grad is not None), *buckets]),
            "optimizer_state": _storages(moments)}
    real["total"] = _storages([*params, *(p.grad for p in params if p.grad is not None), *buckets, *moments])
    plan = memplan.state_memory(memplan.rank_params(run, memplan.layer_params(run)), run, 0)
    planned = {k: getattr(plan, k) for k in STATE}
    planned["total"] = sum(planned.values())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad),
            "frozen": sum(p.numel() for p in params if not p.requires_grad),
            "real_bytes": real, "plan_bytes": planned, "plan_over_real": planned["total"] / real["total"],
            "rss_growth_bytes": after - before, "plan_over_rss_growth": planned["total"] / (after - before)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "finetune_memory.json"))
    ap.add_argument("--case", choices=["full", "lora"], help=argparse.SUPPRESS)  # (b) in a fresh process
    args = ap.parse_args()
    if args.case:
        print(json.dumps(measured_tiny(args.case == "lora")))
        return 0
    gib = 2**30
    plan = {}
    for pp in (4, 8):
        full, lora = planned_8b(pp, False), planned_8b(pp, True)
        plan[f"pp={pp}"] = {"full": full, "lora16": lora, "ratio": {
            ac: {k: full[ac][k] / lora[ac][k] for k in ("state", "total")} for ac in ("AC off", "AC on")}}
        for ac in ("AC off", "AC on"):
            print(f"plan, Llama-3 8B, pp={pp}, {ac}: full {full[ac]['total'] / gib:.2f} GiB per rank "
                  f"(state {full[ac]['state'] / gib:.2f}), LoRA-16 {lora[ac]['total'] / gib:.2f} GiB "
                  f"(state {lora[ac]['state'] / gib:.2f}): {full[ac]['total'] / lora[ac]['total']:.2f}x less "
                  f"(state {full[ac]['state'] / lora[ac]['state']:.2f}x)", flush=True)
    measured = {}
    for case in ("full", "lora"):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", case], capture_output=True,
                              text=True)
        if done.returncode:
            sys.exit(f"the measured {case} case failed:\n{done.stderr}")
        measured[case] = json.loads(done.stdout.strip().splitlines()[-1])
        m = measured[case]
        print(f"measured, tiny Llama float32 AdamW, {case}: real {m['real_bytes']['total'] / 2**20:.3f} MiB, "
              f"plan {m['plan_bytes']['total'] / 2**20:.3f} MiB (plan / real {m['plan_over_real']:.4f}); "
              f"RSS growth {m['rss_growth_bytes'] / 2**20:.1f} MiB", flush=True)
    measured["full_over_lora_real"] = measured["full"]["real_bytes"]["total"] / measured["lora"]["real_bytes"]["total"]
    result = {"command": "python benchmarks/finetune_memory.py",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
              "lora": LORA, "plan_llama3_8b_bf16_adamw_zero0_1f1b_16x8192": plan,
              "measured_tiny_llama_fp32": {"config": TINY, **measured},
              "targets": {"plan_full_over_lora_total_at_least": 3.0, "measured_within": 0.10}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
