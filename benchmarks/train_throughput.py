"""Tokens/s of `pipekit train` on the tiny GPT-2 at several layouts, against a plain PyTorch loop.

    python benchmarks/train_throughput.py [--steps 40] [--config configs/gpt2_tiny.yaml]

What is measured: for each (pp, tp, dp) in {(1,1,1), (2,1,1), (1,2,1), (1,1,2)}
one real `pipekit train` run (its own workers, one intra-op thread each, as
torchrun sets), with validation off; throughput is taken from its
metrics.jsonl between the 5th step and the last (start-up and warm-up left
out). The baseline is the same model (the same spec list, built as one
`nn.Sequential`) trained by a plain loop — AdamW, the same batch shape —
in this process with torch's default thread count. Ratios are pipekit /
baseline from the same run of this script. On a CPU with few cores, more
workers compete for the same cores: the figures say what the engine costs,
not what parallelism gains.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
SKIP = 5  # steps left out of the steady-state rate


def pipekit_rate(config: str, pp: int, tp: int, dp: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pipekit.cli", "train", config, f"parallel.pp={pp}", f"parallel.tp={tp}",
               f"parallel.dp={dp}", f"train.steps={steps}", "data.val_every=0", "logging.progress=false",
               "logging.log_every=1", f"logging.out_dir={out}", "schedule.microbatches=4",
               f"train.micro_batch={8 // dp}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_recs = [r for r in recs if "step" in r]
    a, b = steps_recs[SKIP - 1], steps_recs[-1]
    tokens_per_step = b["tokens_per_s"] * b["elapsed_s"] / b["step"]
    return tokens_per_step * (b["step"] - a["step"]) / (b["elapsed_s"] - a["elapsed_s"])


def baseline_rate(config: str, steps: int) -> float:
    """The same model and batch shape in a plain single-process PyTorch training loop."""
    from pipekit.config import load_run
    from pipekit.data import BatchSampler, TokenDataset, default_corpus_dir
    from pipekit.models import model_loss, model_specs
    from pipekit.testing import reference_model

    run = load_run(config, ["parallel.pp=1", "schedule.microbatches=4", "train.micro_batch=8"])
    cfg, mcfg = run.config, run.model
    model = reference_model(model_specs(mcfg), seed=0)
    loss_fn = model_loss(mcfg).build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = BatchSampler(TokenDataset(default_corpus_dir()), cfg.train.global_batch, cfg.train.seq_len)
    times = []
    for _ in range(steps):
        x, y = next(data)
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return cfg.train.global_batch * cfg.train.seq_len * (steps - SKIP) / sum(times[SKIP:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/gpt2_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/train_throughput.json"))
    args = ap.parse_args()
    base = baseline_rate(args.config, args.steps)
    rows = [{"layout": "plain PyTorch loop (1 process)", "tokens_per_s": base, "ratio": 1.0}]
    for pp, tp, dp in LAYOUTS:
        rate = pipekit_rate(args.config, pp, tp, dp, args.steps)
        rows.append({"layout": f"pipekit pp={pp} tp={tp} dp={dp}", "tokens_per_s": rate, "ratio": rate / base})
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(f"tiny GPT-2, global batch 32 x 128 tokens, steady state after step {SKIP}; {machine}\n")
    print("| run | tokens/s | vs plain loop |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "steps": args.steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
