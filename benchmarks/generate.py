"""Tokens/s of `pipekit generate`'s decoding with the KV cache against rerunning the model, small Llama on CPU.

    python benchmarks/generate.py [--new-tokens 256] [--prompt 16] [--repeats 3] [--threads 2]

What is measured: `pipekit.run.generate.sample`, greedy, one sequence, one process, float32,
on a small Llama (dim 256, 4 layers, 4 heads of which 2 kv heads, SwiGLU width 768, byte
vocabulary, max_seq_len 512; seeded random weights): `--prompt` tokens in, `--new-tokens`
out, no stop token. The two sides:

- KV cache (`cache=True`, what generate does for a model with attention): the prompt's
  forward once, then one token's forward per new token, attending over the cached keys;
- recompute (`cache=False`, generate before the cache): the whole sequence so far rerun
  for every new token (the sequence stays within max_seq_len, so no window slides).

The figure is new tokens per second over the whole call (prompt included), the best of
`--repeats` runs, the sides taken in turn (so a busy machine slows both alike); both give
the same tokens (checked). Limits: CPU only, batch 1, no sampling cost beyond argmax, one
model size; the recompute side's cost grows with the square of the length, so the ratio
depends on `--new-tokens`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def small_llama():
    from pipekit.models import get_model, model_specs
    from pipekit.testing import reference_model

    cfg = get_model("llama", "tiny", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, hidden=768, max_seq_len=512)
    return reference_model(model_specs(cfg), seed=0).eval(), cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/generate.json"))
    args = ap.parse_args()
    from pipekit.run.generate import sample

    torch.set_num_threads(args.threads)
    module, cfg = small_llama()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    sides = {"KV cache": True, "recompute": False}
    best = dict.fromkeys(sides, float("inf"))
    tokens = {}
    for _ in range(args.repeats):
        for name, cache in sides.items():
            began = time.perf_counter()
            tokens[name] = sample(module, prompt, args.new_tokens, max_len=cfg.max_seq_len, temperature=0,
                                  cache=cache)
            best[name] = min(best[name], time.perf_counter() - began)
    same = tokens["KV cache"] == tokens["recompute"]
    rows = {name: {"seconds": s, "new_tokens_per_s": args.new_tokens / s} for name, s in best.items()}
    speedup = best["recompute"] / best["KV cache"]
    command = ("python benchmarks/generate.py " + " ".join(sys.argv[1:])).strip()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"`{command}` on {machine}, {args.threads} threads, on commit {commit}; Llama dim 256, 4 layers, "
          f"max_seq_len 512, float32; prompt {args.prompt} tokens, {args.new_tokens} new, greedy; "
          f"best of {args.repeats}\n")
    print("| decoding | s | new tokens/s |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']:.2f} | {r['new_tokens_per_s']:,.1f} |")
    print(f"\nKV cache {speedup:.1f}x faster; the same tokens: {same}")
    if not same:
        sys.exit("the KV cache gave other tokens than recomputing: a bug")
    report = {"command": command, "machine": machine, "on_commit": commit, "args": vars(args),
              "model": {"family": "llama", "dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                        "hidden": 768, "max_seq_len": 512, "dtype": "float32"},
              "rows": rows, "speedup": speedup, "same_tokens": same}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
