"""Saved activation bytes per rank under context parallelism, against 1/cp and against the memory plan.

    python benchmarks/context_memory.py [--seq 1024 2048 4096] [--cp 1 2 4] [--mode ring] [--budget-mb 64]

What is measured: a Llama (`--layers` blocks of dim `--dim`, 8 query heads over 4 kv heads,
SwiGLU; float32) built as `pipekit train` builds it (`load_run` + `PipelineModule`, pp=1)
on cp gloo processes of one thread each (`Topology(cp=cp, cp_mode=--mode)`; cp=1: one
process, SDPA), one microbatch of one row of `seq` tokens cut by the engine's own layout
(`shard_sequence`: chunks i and 2cp-1-i), one forward in train mode through every layer and
the loss under `SavedStorages` (pipekit.plan.profiler: the bytes autograd keeps for
backward, each storage once, parameters left out). Per rank (the largest), against:
  - 1/cp of the cp=1 figure at the same seq ("vs 1/cp": measured / (cp1 / cp));
  - the memory plan (`pipekit.plan.memory.meta_activations` of the same run, which counts
    the layers on the meta device at seq / cp tokens).
The ring's block in flight is a buffer, not saved for backward: it is not in these bytes.
"Longest seq within budget": the largest measured seq whose saved bytes per rank fit in
`--budget-mb`, per cp.

Limits: activations saved for backward only (not the transient buffers of a step, not the
optimizer's state); one row; CPU and gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch


def _overrides(seq: int, cp: int, mode: str, layers: int, dim: int) -> list[str]:
    return ["model.family=llama", f"model.n_layers={layers}", f"model.dim={dim}", "model.n_heads=8",
            "model.n_kv_heads=4", f"model.hidden={dim * 3}", "model.vocab_size=512", f"model.max_seq_len={seq}",
            f"train.seq_len={seq}", "parallel.pp=1", f"parallel.cp={cp}", f"parallel.cp_mode={mode}",
            "train.micro_batch=1", "schedule.microbatches=1", "data.source=synthetic", "checkpoint.every=0",
            "data.val_every=0"]


def measure(seq: int, cp: int, mode: str, layers: int, dim: int) -> int:
    """This rank's saved bytes for one row of `seq` tokens (inside a cp-rank group, or alone)."""
    import pipekit
    from pipekit.config import load_run
    from pipekit.layers.context import shard_sequence
    from pipekit.models import model_loss, model_specs
    from pipekit.plan.profiler import SavedStorages

    torch.set_num_threads(1)
    run = load_run(None, _overrides(seq, cp, mode, layers, dim))
    topo = pipekit.Topology(pp=1, dp=1, cp=cp, cp_mode=mode)
    module = pipekit.PipelineModule(model_specs(run.model), loss_fn=model_loss(run.model), topology=topo, seed=0,
                                    schedule="1f1b", microbatches=1)
    module.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (1, seq + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    if cp > 1:
        x, y = shard_sequence(x, cp, topo.cp_rank), shard_sequence(y, cp, topo.cp_rank)
    counter = SavedStorages(list(module.parameters()))
    with counter:
        out = x
        for i in range(len(module.specs)):
            out = module.run_layer(i, out)
        module.loss_fn(out, y)
    total = counter.total
    counter.close()
    return total


def planned(seq: int, cp: int, mode: str, layers: int, dim: int) -> int:
    from pipekit.config import load_run
    from pipekit.plan.memory import meta_activations

    run = load_run(None, _overrides(seq, cp, mode, layers, dim))
    return sum(saved for saved, _ in meta_activations(run, 1, False))


def _group(seqs: list[int], cp: int, mode: str, layers: int, dim: int) -> list[int]:
    return [measure(seq, cp, mode, layers, dim) for seq in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mode", default="ring", choices=["ring", "ulysses"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--out", default="benchmarks/results/context_memory.json")
    a = ap.parse_args()
    from pipekit.spawn import run_distributed

    rows = []
    base: dict[int, int] = {}
    for cp in a.cp:
        if cp == 1:
            per_rank = [_group(a.seq, 1, a.mode, a.layers, a.dim)]
        else:
            per_rank = run_distributed(_group, cp, a.seq, cp, a.mode, a.layers, a.dim, timeout=1200)
        for i, seq in enumerate(a.seq):
            worst = max(r[i] for r in per_rank)
            if cp == 1:
                base[seq] = worst
            plan = planned(seq, cp, a.mode, a.layers, a.dim)
            rows.append({"cp": cp, "seq": seq, "saved_mb": worst / 2**20, "plan_mb": plan / 2**20,
                         "vs_1_over_cp": worst / (base[seq] / cp) if seq in base else None,
                         "vs_plan": worst / plan})
    print(f"{'cp':>3} {'seq':>6} {'saved MB/rank':>14} {'vs 1/cp':>8} {'plan MB':>8} {'vs plan':>8}")
    for r in rows:
        ratio = f"{r['vs_1_over_cp']:.3f}" if r["vs_1_over_cp"] is not None else "-"
        print(f"{r['cp']:>3} {r['seq']:>6} {r['saved_mb']:14.2f} {ratio:>8} {r['plan_mb']:8.2f} {r['vs_plan']:8.3f}")
    longest = {cp: max([r["seq"] for r in rows if r["cp"] == cp and r["saved_mb"] <= a.budget_mb], default=None)
               for cp in a.cp}
    print(f"longest measured seq within {a.budget_mb:g} MB of saved activations per rank: "
          + ", ".join(f"cp={cp}: {seq}" for cp, seq in longest.items()))
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
            "command": " ".join(sys.argv)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "longest_within_budget": longest}, f, indent=1)


if __name__ == "__main__":
    main()
