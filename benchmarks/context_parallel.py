"""Context-parallel attention on CPU: bytes sent per rank against the formulas, and time at equal tokens per rank.

    python benchmarks/context_parallel.py [--tokens-per-rank 1024] [--steps 5] [--warmup 1] [--quick]

What is measured: one attention layer's core only (`pipekit.layers.context.attention_core`,
no projections), forward + backward, float32, B=1, Hq=8 query heads over Hkv=2 kv heads of
64 dims, causal, no documents; every rank holds `--tokens-per-rank` tokens (T_local), so
cp ranks attend over a sequence of T = cp * T_local tokens. cp=1 is "sdpa" in one process
(`F.scaled_dot_product_attention`, is_causal); cp in {2, 4} runs "ring" and "ulysses" on cp
gloo processes of one thread each. The modes alternate step by step after `--warmup`
steps; the table gives the median step of the slowest rank (a barrier, untimed, before
each step).

Bytes: `sent_bytes()` over one forward and its backward, per rank, against the module
docstring's formulas (K/V the local blocks, dK/dV in float32; Ulysses with the kv heads
repeated to the fewest cp divides):
  ring     forward (cp-1) * bytes(k, v); backward (cp-1) * bytes(k, v) + cp * bytes(dk, dv)
  ulysses  forward and backward (cp-1)/cp * bytes(q, k, v, out)
Exactness: each rank's output against SDPA over the whole sequence in one process.

Limits: the attention core alone (a model's layers, its loss and the engine are not here);
CPU and gloo, so the ring's overlap of transfer and block compute is what gloo's
background threads give; the block math is materialised per block (no flash kernel); on a
machine with fewer cores than cp the ranks share cores and the times say little.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HQ, HKV, HEAD_DIM = 8, 2, 64


def full_inputs(T: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = [(1, HQ, T, HEAD_DIM), (1, HKV, T, HEAD_DIM), (1, HKV, T, HEAD_DIM), (1, HQ, T, HEAD_DIM)]
    return tuple(torch.randn(s, generator=g) for s in shapes)


def formula(mode: str, cp: int, T_local: int) -> tuple[int, int]:
    """Bytes one rank sends in forward and in backward, float32."""
    kv = 2 * HKV * T_local * HEAD_DIM * 4
    if mode == "ring":
        return (cp - 1) * kv, (cp - 1) * kv + cp * kv
    kv_heads = HKV if HKV % cp == 0 else HKV * cp // math.gcd(HKV, cp)
    per_pass = (2 * HQ + 2 * kv_heads) * T_local * HEAD_DIM * 4 * (cp - 1) // cp
    return per_pass, per_pass


def worker(modes: list[str], T_local: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from pipekit.layers.context import attention_core, reset_sent_bytes, sent_bytes, shard_sequence

    group, cp = dist.group.WORLD, dist.get_world_size()
    rank = dist.get_rank()
    full = full_inputs(cp * T_local)
    local = [shard_sequence(t, cp, rank, dim=2) for t in full]
    out: dict = {m: {"seconds": []} for m in modes}
    want = shard_sequence(attention_core(*full[:3]), cp, rank, dim=2)
    for m in modes:
        reset_sent_bytes()
        q, k, v = (t.clone().requires_grad_() for t in local[:3])
        y = attention_core(q, k, v, mode=m, group=group)
        forward = sent_bytes()
        y.backward(local[3])
        out[m].update(bytes=(forward, sent_bytes() - forward), error=(y - want).abs().max().item())
    for step in range(warmup + steps):
        for m in modes:
            q, k, v = (t.clone().requires_grad_() for t in local[:3])
            dist.barrier()
            began = time.perf_counter()
            attention_core(q, k, v, mode=m, group=group).backward(local[3])
            if step >= warmup:
                out[m]["seconds"].append(time.perf_counter() - began)
    return out


def one_process(T: int, warmup: int, steps: int) -> float:
    from pipekit.layers.context import attention_core

    torch.set_num_threads(1)
    full = full_inputs(T)
    times = []
    for step in range(warmup + steps):
        q, k, v = (t.clone().requires_grad_() for t in full[:3])
        began = time.perf_counter()
        attention_core(q, k, v).backward(full[3])
        if step >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-rank", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 64 tokens per rank, 1 step, writes nothing")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/context_parallel.json"))
    args = ap.parse_args()
    from pipekit.testing import run_distributed

    T_local, steps, warmup = (64, 1, 1) if args.quick else (args.tokens_per_rank, args.steps, args.warmup)
    rows = {"sdpa cp=1": {"seconds": one_process(T_local, warmup, steps), "bytes": (0, 0), "formula": (0, 0)}}
    for cp in (2, 4):
        per_rank = run_distributed(worker, cp, ["ring", "ulysses"], T_local, warmup, steps, timeout=1800,
                                   op_timeout=600)
        for m in ("ring", "ulysses"):
            slowest = [max(r[m]["seconds"][i] for r in per_rank) for i in range(steps)]
            rows[f"{m} cp={cp}"] = {"seconds": statistics.median(slowest), "bytes": per_rank[0][m]["bytes"],
                                    "bytes_same_on_every_rank": len({r[m]["bytes"] for r in per_rank}) == 1,
                                    "formula": formula(m, cp, T_local),
                                    "max_error_vs_one_process": max(r[m]["error"] for r in per_rank)}
    command = ("python benchmarks/context_parallel.py " + " ".join(sys.argv[1:])).strip()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"`{command}` on {machine}, on commit {commit}; attention core fwd+bwd, float32, B=1, Hq={HQ}, "
          f"Hkv={HKV}, d={HEAD_DIM}, {T_local} tokens per rank; median of {steps}, slowest rank\n")
    print("| mode | ms | sent fwd / bwd (bytes) | formula fwd / bwd | max error |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        err = r.get("max_error_vs_one_process")
        print(f"| {name} | {r['seconds'] * 1e3:.1f} | {r['bytes'][0]:,} / {r['bytes'][1]:,} | "
              f"{r['formula'][0]:,} / {r['formula'][1]:,} | {'' if err is None else f'{err:.2g}'} |")
    if any(tuple(r["bytes"]) != tuple(r["formula"]) for r in rows.values()):
        sys.exit("bytes sent differ from the formula")
    if not args.quick:
        report = {"command": command, "machine": machine, "on_commit": commit, "args": vars(args), "rows": rows}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
