"""Peak host memory and step time of ZeroOptimizer with `nvme` (and `cpu`) offload against none.

    python benchmarks/offload_memory.py [--layers 72] [--dim 2048] [--steps 3] [--bucket-mb 25]

What is measured: one process per offload kind (a fresh interpreter each, so that one
kind's peak is not another's), one plain model: `--layers` bias-free nn.Linear(dim, dim)
with a ReLU between them (72 x 2048 x 2048 = 302M float32 parameters: 1.2 GB of weights,
2.4 GB of AdamW state), `ZeroOptimizer(model, "adamw", stage=0, offload=kind,
bucket_mb=--bucket-mb, offload_dir=a temporary directory on this disk)`, `--steps`
steps of one batch of 8 rows. Each process reports its resident memory (VmRSS) after
building the model (the weights), its peak (VmHWM) while the optimizer is made (the
buckets and, offloaded, the host copies: nvme writes each out as it is made), its peak
over the steps (VmHWM reset through /proc/self/clear_refs after the optimizer is made), the time of each step
after the first (the first creates the Adam state), and the optimizer-state bytes (8 per
parameter: exp_avg, exp_avg_sq). "state gone" = (peak(none) - peak(kind)) / state bytes:
the share of the optimizer state's bytes (and, for nvme, of its separate float32 master
copy) that did not stay in memory.

Target (issue 25): nvme offload removes >= 90% of the optimizer-state bytes from RSS. On
this CPU-only machine `cpu` offload keeps the state in the same memory (the host is the
device): its row shows the cost of the host copy of the master weights it keeps, not a
saving. The step time of nvme includes writing and reading the state (12 bytes per
parameter each way per step) through the page cache of this machine's disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(kind: str, layers: int, dim: int, steps: int, bucket_mb: float) -> dict:
    from pipekit.optim import ZeroOptimizer

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(dim, dim, bias=False),
                                                                      torch.nn.ReLU())])
    n = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as root:
        built = _kib("VmRSS")
        opt = ZeroOptimizer(model, "adamw", stage=0, lr=1e-4, bucket_mb=bucket_mb, offload=kind,
                            offload_dir=root if kind == "nvme" else None)
        made = _kib("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from VmRSS: the steps' own peak
        times = []
        x = torch.randn(8, dim)
        for _ in range(steps):
            start = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            times.append(time.perf_counter() - start)
        mem = opt.memory_bytes()
    return {"kind": kind, "params": n, "state_bytes": 8 * n, "rss_built_mb": built / 1024,
            "peak_built_mb": made / 1024, "peak_mb": _kib("VmHWM") / 1024, "step_s": times[1:],
            "first_step_s": times[0], "memory_bytes": mem}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=72)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--kinds", nargs="+", default=["none", "cpu", "nvme"])
    ap.add_argument("--out", default="benchmarks/results/offload_memory.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.layers, a.dim, a.steps, a.bucket_mb)))
        return
    rows = []
    for kind in a.kinds:
        done = subprocess.run([sys.executable, __file__, "--worker", kind, "--layers", str(a.layers), "--dim",
                               str(a.dim), "--steps", str(a.steps), "--bucket-mb", str(a.bucket_mb)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["kind"] == "none"), None)
    print(f"{'offload':8} {'params':>8} {'state GB':>9} {'model MB':>9} {'made MB':>9} {'peak MB':>9} "
          f"{'state gone':>11} {'step s':>8}")
    for r in rows:
        gone = (base["peak_mb"] - r["peak_mb"]) * 2**20 / r["state_bytes"] if base else float("nan")
        r["state_gone"] = gone
        step = sum(r["step_s"]) / max(1, len(r["step_s"]))
        print(f"{r['kind']:8} {r['params'] / 1e6:7.0f}M {r['state_bytes'] / 1e9:9.2f} {r['rss_built_mb']:9.0f} "
              f"{r['peak_built_mb']:9.0f} {r['peak_mb']:9.0f} {gone:10.1%} {step:8.2f}")
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or 'CPU'}",
            "torch": torch.__version__, "command": " ".join(sys.argv)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
