"""Tokens/s and MFU of GPT-2 124M on one GPU: pipekit against a plain PyTorch loop, fp32 / bf16 / bf16 + compile.

    python benchmarks/gpu_throughput.py --json benchmarks/results/gpu_throughput.json    # one GPU
    python benchmarks/gpu_throughput.py --device cpu --flavour tiny --seq 64 --steps 3   # CPU smoke run, ~2 min

What is measured: one optimizer step (forward, backward and AdamW over a
batch of M microbatches of B x T tokens; default 4 x 8 x 1024 = 32,768
tokens) for each mode, done two ways on the same model (the same spec list
and seed) and the same batch, one after the other in this process (on a GPU
the initial weights differ: pipekit draws each layer's on the device,
`reference_model` on the CPU; on the CPU the fp32 losses agree):

- plain: the spec list as one `nn.Sequential` (`pipekit.testing.reference_model`)
  and its loss, gradient accumulation over the M microbatches (each loss
  divided by M), `torch.optim.AdamW` (fused on CUDA). bf16 is
  `torch.autocast(device, bfloat16)`: fp32 weights, bf16 matmuls.
- pipekit: `PipelineModule` + `PipelineEngine` at pp=1 (1F1B over the same M
  microbatches). fp32 steps a plain `torch.optim.AdamW` (fused on CUDA); the
  bf16 modes are `precision="bf16"` (bf16 weights, activations and
  gradients) with `pipekit.optim.ZeroOptimizer(stage=0)`: fp32 master
  weights and gradient buckets, its wrapped AdamW stepping a few flat buckets.

The two bf16 recipes differ (autocast against bf16 weights with fp32
masters), as the two ways are normally used. "+compile" is `nn.Module.compile`
on every layer that has parameters (embedding, each block, final LayerNorm;
the tied head's matmul stays eager), in place: `PipelineModule(compile=True)`
on one side and the same calls on the `nn.Sequential`'s layers on the other.
When `pipekit.optim.ZeroOptimizer` cannot be imported, the pipekit bf16 rows
say so and the rest still runs.

Timing: `--warmup` steps (compilation happens in the first; its time is the
`first step s` column), then the median of `--steps` steps, each between two
`torch.cuda.synchronize()`. tokens/s = tokens per step / median step time.
MFU = `flops_per_token(cfg, T)` x tokens/s / 989 TFLOP/s, the dense BF16 peak
of an H100/H200 SXM; the fp32 rows (no TF32) are measured against the same
peak, so they read low by design. Peak memory is
`torch.cuda.max_memory_allocated` over the run. The final loss of each run is
printed so that a wrong run shows. Not measured: data loading (the batch is
built once, on the device), evaluation, checkpointing, anything multi-GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import pipekit
from pipekit.models import flops_per_token, get_model, model_loss, model_specs
from pipekit.testing import reference_model

PEAK_FLOPS = 989e12  # dense BF16, H100 / H200 SXM
MODES = ("fp32", "bf16", "bf16+compile")
SEED, LR, WEIGHT_DECAY = 0, 3e-4, 0.1


def zero_optimizer_missing() -> str | None:
    """Why `pipekit.optim.ZeroOptimizer` (which the pipekit bf16 modes need) cannot be imported, or None."""
    try:
        from pipekit.optim import ZeroOptimizer  # noqa: F401
    except ImportError as e:
        return f"pipekit.optim.ZeroOptimizer is not importable ({e})"
    return None


def compile_layers(model: torch.nn.Sequential) -> None:
    """`nn.Module.compile` every layer with parameters, as `PipelineModule(compile=True)` does
    (a tied layer's shared module once; its use through `forward_fn` stays eager)."""
    seen = set()
    for layer in model:
        target = getattr(layer, "module", layer)  # reference_model wraps tied layers
        if id(target) not in seen and any(True for _ in target.parameters()):
            target.compile()
            seen.add(id(target))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device, warmup: int, steps: int) -> dict:
    """Run `step()` warmup + steps times; the first step's time, the median of the last `steps`, the last loss."""
    times, loss = [], None
    for _ in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"first_step_s": times[0], "step_s": statistics.median(times[warmup:]), "loss": loss}


def plain_run(cfg, mode: str, batch, args, device: torch.device) -> dict:
    """The plain PyTorch loop: nn.Sequential, gradient accumulation, AdamW, autocast for bf16."""
    model = reference_model(model_specs(cfg), SEED).to(device)
    loss_fn = model_loss(cfg).build()
    if mode.endswith("+compile"):
        compile_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if mode.startswith("bf16") else nullcontext()
    xs, ys = (t.chunk(args.microbatches) for t in batch)

    def step() -> float:
        total = torch.zeros((), device=device)
        for x, y in zip(xs, ys):
            with amp:
                logits = model(x)
            loss = loss_fn(logits.float(), y)  # the loss in fp32, as the engine computes it
            (loss / args.microbatches).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item() / args.microbatches

    return timed(step, device, args.warmup, args.steps)


def pipekit_run(cfg, mode: str, batch, args, device: torch.device, fused_adamw: bool = False) -> dict:
    """pipekit at pp=1: PipelineModule + PipelineEngine; ZeroOptimizer for the bf16 modes, and for
    any mode with `fused_adamw` (pipekit's Triton AdamW over the flat master shards)."""
    precision = "bf16" if mode.startswith("bf16") else "fp32"
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED, precision=precision,
                                    compile=mode.endswith("+compile"), schedule="1f1b", microbatches=args.microbatches,
                                    topology=pipekit.Topology(pp=1, dp=1, device=device.type))
    if precision == "fp32" and not fused_adamw:
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda")
    else:
        from pipekit.optim import ZeroOptimizer

        opt = ZeroOptimizer(module, "adamw", stage=0, lr=LR, weight_decay=WEIGHT_DECAY, fused=fused_adamw)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    return timed(lambda: engine.train_batch(iter([batch]), reduce_loss=True), device, args.warmup, args.steps)


def measure(run, cfg, mode: str, batch, args, device: torch.device) -> dict:
    """One run in a clean state: its timings, tokens/s, MFU and peak memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    out = run(cfg, mode, batch, args, device)
    tokens = args.microbatches * args.micro_batch * args.seq
    out["tokens_per_s"] = tokens / out["step_s"]
    out["mfu"] = flops_per_token(cfg, args.seq) * out["tokens_per_s"] / PEAK_FLOPS
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def machine(device: torch.device) -> dict:
    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    info = {"torch": torch.__version__, "python": platform.python_version(), "cpu_cores": os.cpu_count(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"}
    try:
        info |= {"commit": git("rev-parse", "--short", "HEAD"),
                 "pipekit_dirty": bool(git("status", "--porcelain", "--", "pipekit"))}
    except OSError:
        pass
    return info


def table(rows: list[dict], device: torch.device) -> str:
    cuda = device.type == "cuda"
    lines = ["| mode | run | tokens/s | pipekit / plain | step ms (median) | first step s | MFU | peak GiB "
             "| final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['mode']} | {r['run']} | skipped: {r['skipped']} | | | | | | |")
            continue
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else ("1.00" if r["run"] == "plain" else "-")
        mfu = f"{r['mfu']:.1%}" if cuda else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if cuda else "-"
        lines.append(
            f"| {r['mode']} | {r['run']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['step_s'] * 1e3:.1f} | "
            f"{r['first_step_s']:.1f} | {mfu} | {peak} | {r['loss']:.4f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--flavour", choices=("124m", "tiny"), default="124m", help="GPT-2 size (default 124m)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run, compilation included (default 3)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step, M (default 4)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per microbatch, B (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence, T (default 1024)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and the machine to this JSON file")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--modes: {bad or 'none given'} not among {', '.join(MODES)}")
    for name in ("steps", "microbatches", "micro_batch", "seq"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 1:
        p.error(f"--warmup must be >= 1 (the first step compiles and allocates), got {a.warmup}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; "
                "use --device cpu (with --flavour tiny --seq 64 for a smoke run)")
    return a


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cfg = get_model("gpt2", args.flavour)
    if args.seq > cfg.max_seq_len:
        raise SystemExit(f"--seq {args.seq} exceeds the {args.flavour} model's max_seq_len={cfg.max_seq_len}")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.microbatches * args.micro_batch, args.seq + 1), generator=gen)
    batch = (ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device))

    started, rows, missing = time.perf_counter(), [], zero_optimizer_missing()
    for mode in args.modes:
        plain = {"mode": mode, "run": "plain", **measure(plain_run, cfg, mode, batch, args, device)}
        if mode.startswith("bf16") and missing:
            ours = {"mode": mode, "run": "pipekit", "skipped": missing}
        else:
            ours = {"mode": mode, "run": "pipekit", **measure(pipekit_run, cfg, mode, batch, args, device)}
            ours["ratio"] = ours["tokens_per_s"] / plain["tokens_per_s"]
        rows += [plain, ours]
        print(f"{mode}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)

    info = machine(device)
    tokens = args.microbatches * args.micro_batch * args.seq
    print(f"GPT-2 {args.flavour}, {args.microbatches} microbatches x {args.micro_batch} x {args.seq} tokens = "
          f"{tokens:,} tokens per step, AdamW; median of {args.steps} steps after {args.warmup} warm-up; "
          f"{info['device']}, torch {info['torch']}"
          + (f"; MFU vs {PEAK_FLOPS / 1e12:.0f} TFLOP/s" if device.type == "cuda" else "") + "\n")
    print(table(rows, device))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()}
        result = {"machine": info, "command": " ".join(["python", *sys.argv]), "config": config,
                  "tokens_per_step": tokens, "flops_per_token": flops_per_token(cfg, args.seq),
                  "peak_flops": PEAK_FLOPS, "rows": rows, "elapsed_s": time.perf_counter() - started}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
