"""Valid tokens/s of packed rows (`data.pack=true`) against padded rows (one document a row), tiny Llama on CPU.

    python benchmarks/packing.py [--steps 20] [--batch 8] [--seq-len 512] [--threads 2]

What is measured: a skewed length mix (by default 90% short documents of 16-96
tokens, 10% long ones of 256-1024, so some are longer than a row), written as a
JSONL file of text lines and prepared with the byte tokenizer (`prepare_data`).
Both sides train the same tiny Llama (dim 128, 4 layers; the same seeded weights)
with AdamW on batches of the same shape (batch x seq_len), one process, in float32,
their steps taken in turn (so a busy machine slows both alike):

- packed: `BatchSampler(pack=True)`: whole documents first-fit into each row (a
  longer one cut into seq_len pieces), inputs (tokens, positions), attention within
  each document (SDPA with a block-diagonal boolean mask);
- padded: one document a row (drawn the same way, uniform with replacement), cut to
  seq_len + 1 tokens, the rest of the row padding with label -100, plain causal
  attention (SDPA is_causal).

The figure is valid (non-padding, label != -100) tokens per second of training
(forward, backward, optimizer step), over the steps after `--warmup`; "fill" is the
share of a batch's places that are valid tokens. Both sides do the same work per
step (the same shapes), so the ratio is what packing saves, less what the mask
costs over is_causal. Limits: one CPU process, one length mix, no data loading
time counted (the sampler's time is reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def skewed_corpus(path: str, n_docs: int, long_share: float, seed: int = 0) -> None:
    """A JSONL file of `n_docs` text lines: most 16-96 bytes, `long_share` of them 256-1024."""
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog while pipelines pack whole documents".split()
    with open(path, "w") as fh:
        for _ in range(n_docs):
            n = int(rng.integers(256, 1025) if rng.random() < long_share else rng.integers(16, 97))
            text = " ".join(rng.choice(words, size=n)).encode()[:n].decode()
            fh.write(json.dumps({"text": text}) + "\n")


def padded_batch(ds, batch: int, seq_len: int, step: int, seed: int):
    """One document a row (uniform, with replacement), cut to seq_len + 1 tokens, padded with label -100."""
    from pipekit.data import IGNORE_INDEX

    ends = np.asarray(ds.doc_ends)
    starts = np.concatenate([[0], ends[:-1]])
    usable = np.flatnonzero(ends - starts >= 2)
    rng = np.random.default_rng([seed, step])
    x = np.zeros((batch, seq_len), np.int64)
    y = np.full((batch, seq_len), IGNORE_INDEX, np.int64)
    for r, d in enumerate(rng.integers(0, len(usable), size=batch)):
        a, b = starts[usable[d]], ends[usable[d]]
        seg = ds.tokens[a:min(b, a + seq_len + 1)].astype(np.int64)
        x[r, : len(seg) - 1], y[r, : len(seg) - 1] = seg[:-1], seg[1:]
    return torch.from_numpy(x), torch.from_numpy(y)


def train_rates(sides: dict, steps: int, warmup: int, seq_len: int) -> dict:
    """Valid tokens/s of training the tiny Llama on each side's `batches(step)`: one model and
    AdamW per side (the same seeded weights), the sides' steps taken in turn, so that a busy
    machine slows both alike."""
    from pipekit.models import get_model, model_loss, model_specs
    from pipekit.testing import reference_model

    cfg = get_model("llama", "tiny", max_seq_len=seq_len)
    loss_fn = model_loss(cfg).build()
    runs = {}
    for name in sides:
        model = reference_model(model_specs(cfg), seed=0)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), dict.fromkeys(
            ("compute", "valid", "places", "sample"), 0.0))
    for step in range(steps + warmup):
        for name, batches in sides.items():
            model, opt, t = runs[name]
            began = time.perf_counter()
            x, y = batches(step)
            drawn = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if step >= warmup:
                t["compute"] += time.perf_counter() - drawn
                t["sample"] += drawn - began
                t["valid"] += int((y != -100).sum())
                t["places"] += y.numel()
    return {name: {"valid_tokens_per_s": t["valid"] / t["compute"], "fill": t["valid"] / t["places"],
                   "step_s": t["compute"] / steps, "sampler_ms_per_step": 1e3 * t["sample"] / steps}
            for name, (_, _, t) in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--long-share", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/packing.json"))
    args = ap.parse_args()
    from pipekit.data import BatchSampler, TokenDataset, prepare_data

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        skewed_corpus(os.path.join(tmp, "mix.jsonl"), args.docs, args.long_share)
        prepare_data([os.path.join(tmp, "mix.jsonl")], os.path.join(tmp, "data"), val_fraction=0.0)
        ds = TokenDataset(os.path.join(tmp, "data"))
        lengths = np.diff(np.concatenate([[0], ds.doc_ends]))
        packed = BatchSampler(ds, args.batch, args.seq_len, seed=1, pack=True)
        rows = train_rates({
            "padded (one document a row)": lambda k: padded_batch(ds, args.batch, args.seq_len, k, 1),
            "packed (data.pack=true)": packed.batch,
        }, args.steps, args.warmup, args.seq_len)
    base = rows["padded (one document a row)"]["valid_tokens_per_s"]
    command = "python benchmarks/packing.py " + " ".join(sys.argv[1:])
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    print(f"`{command.strip()}` on {machine}, {args.threads} threads; tiny Llama (dim 128, 4 layers), "
          f"batch {args.batch} x seq_len {args.seq_len}; {len(lengths)} documents, median {int(np.median(lengths))} "
          f"tokens, mean {lengths.mean():.0f}, max {lengths.max()}\n")
    print("| rows | valid tokens/s | fill | s/step | sampler ms/step | vs padded |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['valid_tokens_per_s']:,.0f} | {r['fill']:.1%} | {r['step_s']:.3f} | "
              f"{r['sampler_ms_per_step']:.1f} | {r['valid_tokens_per_s'] / base:.2f}x |")
    report = {"command": command.strip(), "machine": machine, "args": vars(args),
              "documents": {"n": int(len(lengths)), "median": float(np.median(lengths)),
                            "mean": float(lengths.mean()), "max": int(lengths.max())}, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
