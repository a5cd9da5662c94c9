"""The early offloaded step (`optimizer.offload_overlap`): step time with it against without, at pp=2.

    python benchmarks/offload_overlap.py [--dim 512] [--layers 4] [--steps 8] [--clip 0] [--offload cpu|nvme]

What is measured: 2 gloo ranks (pp=2, 1F1B, 4 microbatches of 2 x 64 tokens), a Llama of
`--layers` blocks (untied embeddings, so no stage waits for a tied partner before its step),
ZeRO-1 with `offload=cpu` (or `--offload nvme`: the state in files under a temporary
directory), AdamW. Each rank builds two engines from the same seed, one with
`offload_overlap` and one without, and times their `train_batch` in alternating rounds (a
barrier, not timed, before each step) after one first step each; a step's time is its slower
rank's, the table gives the median and the p10-p90 spread. For the early runs each rank also
reports, per step, how long its early host step took and how long it had begun before the
verdict arrived (the world's non-finite check and global norm): time the step spent inside
the other stage's cooldown instead of after it. `--clip 0` turns clipping off (every early step
kept); with clipping acting (`--clip 0.01`) the early step is put back and stepped again,
which costs more than it hides. The last lines check that both engines end with the same
weights, bit for bit.

On this 2-core CPU machine the early step's thread shares the cores with both ranks' compute
(the device is the host): the figure says whether the hiding works on an idle core, not what
a GPU run saves, where the host step runs beside the device's backward.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch


def worker(dim: int, layers: int, steps: int, clip: float, offload: str, root: str) -> dict:
    import torch.distributed as dist

    import pipekit
    from pipekit.checkpoint import full_state_dict
    from pipekit.models import get_model, model_loss, model_specs
    from pipekit.optim import ZeroOptimizer

    cfg = get_model("llama", "tiny", vocab_size=256, max_seq_len=64, n_layers=layers, dim=dim, n_heads=8,
                    n_kv_heads=4, hidden=dim * 8 // 3)
    topo = pipekit.Topology(pp=2)

    def engine(overlap: bool):
        module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=0,
                                        schedule="1f1b", microbatches=4)
        zero = ZeroOptimizer(module, "adamw", stage=1, lr=1e-3, clip_grad_norm=clip or None, offload=offload,
                             offload_dir=os.path.join(root, str(overlap)), offload_overlap=overlap)
        return pipekit.PipelineEngine(module, optimizer=zero)

    engines = {"after the verdict": engine(False), "early (offload_overlap)": engine(True)}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (8, 65), generator=gen) for _ in range(steps + 1)]
    times: dict[str, list[float]] = {k: [] for k in engines}
    hidden, early_ms, kept = [], [], []
    for i, ids in enumerate(batches):
        for name, e in engines.items():
            dist.barrier()
            t = time.perf_counter()
            e.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))
            took = time.perf_counter() - t
            if i == 0:
                continue  # the first step makes the Adam state
            times[name].append(took)
            early = e.optimizer.offload.last_early
            if early is not None:
                hidden.append((min(early.done, early.verdict) - early.started) * 1e3)
                early_ms.append((early.done - early.started) * 1e3)
                kept.append(early.kept)
    weights = [full_state_dict(e.module) for e in engines.values()]
    same = all(torch.equal(t, weights[1][n]) for n, t in weights[0].items())
    return {"times": times, "hidden": hidden, "early_ms": early_ms, "kept": kept, "same": same,
            "params": sum(p.numel() for p in engines["after the verdict"].module.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--clip", type=float, default=0.0, help="gradient clipping norm (0: none)")
    ap.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from pipekit.testing import run_distributed

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        out = run_distributed(worker, 2, args.dim, args.layers, args.steps, args.clip, args.offload, root,
                              timeout=1800)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"Llama dim {args.dim} x {args.layers} blocks, pp=2 1F1B, 4 microbatches of 2 x 64 tokens, ZeRO-1, "
          f"offload={args.offload}, AdamW, clip {args.clip or 'off'}; parameters per rank {[r['params'] for r in out]}")
    print("| step | median ms | p10-p90 ms |")
    print("|---|---|---|")
    for name in out[0]["times"]:
        slowest = [max(r["times"][name][i] for r in out) * 1e3 for i in range(args.steps)]
        q = statistics.quantiles(slowest, n=10) if len(slowest) > 1 else slowest * 9
        print(f"| {name} | {statistics.median(slowest):.1f} | {q[0]:.1f}-{q[-1]:.1f} |")
    for rank, r in enumerate(out):
        print(f"rank {rank} (stage {rank}): early step median {statistics.median(r['early_ms']):.1f} ms, begun "
              f"before the verdict by median {statistics.median(r['hidden']):.1f} ms, kept {sum(r['kept'])} of "
              f"{len(r['kept'])}")
    print(f"same weights, bit for bit: {all(r['same'] for r in out)}")


if __name__ == "__main__":
    main()
