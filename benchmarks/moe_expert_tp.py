"""Expert work per rank at tp=2, with and without expert tensor parallelism, on CPU.

Run:  python benchmarks/moe_expert_tp.py    # ~1 min; --quick: a smoke run (writes nothing); --steps, --warmup

What is measured
----------------
2 gloo processes (1 intra-op thread each) form one tp group and hold the SAME
tokens (as the tp ranks of one stage replica do). One MoE layer, float32,
SwiGLU experts, E=8, top-2, 4096 tokens, dim 512, expert hidden 1024 (the
first case of moe_dispatch.py), built two ways from the same seed:

  replicated   `MoEMLP(...)`: every tp rank runs every expert whole (pipekit's
               behaviour under tp without `parallel.expert_tp`).
  expert-TP    `MoEMLP(..., expert_tp_group=tp group)`: each expert's hidden
               dim split over the 2 ranks (column-parallel w_gate / w_up,
               row-parallel w_down), one all-reduce of the expert rows forward
               and one of their gradient backward.

For each, two timings of forward + backward (zero_grad, out = f(x),
(out * g).sum().backward()), alternating the variants step by step, barrier
(untimed) before each step, the slowest rank's time, median over `--steps`:
"experts" runs only `layer.experts` on the rows the dispatcher sorted by
expert (the expert FLOPs and, with expert-TP, its two all-reduces); "layer"
the whole MoE layer (router, dispatch, experts, combine). Expert GFLOP per
rank is counted, not measured: 3 matmuls of 2 * rows * dim * hidden/etp
FLOPs each forward, twice that backward. Outputs of the two variants are
compared as a same-work check.

Not measured: GPUs, bf16, ep > 1 beside tp, more than 2 ranks. The two
processes share this machine's cores with whatever else runs on it (the
load average is reported).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe_dispatch
from pipekit import LayerSpec
from pipekit.auxloss import metrics
from pipekit.moe import MoEMLP
from pipekit.testing import run_distributed
from pipeline_overhead import load_average, machine, table

SEED = 0
RESULTS = Path(__file__).parent / "results"
CASE = dict(n_experts=8, top_k=2, dim=512, hidden=1024, tokens=4096)
QUICK_CASE = dict(n_experts=8, top_k=2, dim=64, hidden=128, tokens=512)
VARIANTS = ("replicated", "expert-TP")


def build(case: dict, tp_group) -> MoEMLP:
    return LayerSpec(MoEMLP, case["dim"], case["hidden"], case["n_experts"], case["top_k"],
                     expert_tp_group=tp_group).build(seed=SEED, index=1)


def timed(fn, params, g) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward of `fn()` (after a barrier), and its output."""
    for p in params:
        p.grad = None
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    (out * g[: out.shape[0]]).sum().backward()
    return time.perf_counter() - start, out.detach()


def worker(case: dict, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    layers = {"replicated": build(case, None), "expert-TP": build(case, dist.group.WORLD)}
    gen = torch.Generator().manual_seed(100)  # the same tokens on both ranks, as on tp ranks
    times: dict[str, list[float]] = {f"{v}/{part}": [] for v in VARIANTS for part in ("experts", "layer")}
    diff = 0.0
    for i in range(warmup + steps):
        x = torch.randn(case["tokens"], case["dim"], generator=gen)
        g = torch.randn(case["tokens"] * case["top_k"], case["dim"], generator=gen)
        outs = {}
        for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
            layer = layers[v]
            with torch.no_grad():
                x_MD, sizes, _ = layer.dispatcher.dispatch(x, layer.router(x))
            x_MD.requires_grad_(True)
            t_exp, outs[v] = timed(lambda layer=layer, x_MD=x_MD, sizes=sizes: layer.experts(x_MD, sizes),
                                   list(layer.parameters()), g)
            t_layer, _ = timed(lambda layer=layer, x=x: layer(x), list(layer.parameters()), g)
            if i >= warmup:
                times[f"{v}/experts"].append(t_exp)
                times[f"{v}/layer"].append(t_layer)
        diff = max(diff, (outs["expert-TP"] - outs["replicated"]).abs().max().item())
    metrics.pop()
    keys = sorted(times)
    slowest = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = int(sum(sizes))
    return {"times": dict(zip(keys, slowest.tolist())), "max_abs_diff": diff, "rows": rows}


def expert_gflop(case: dict, rows: int, etp: int) -> float:
    """Forward + backward FLOPs of the experts on one rank: 3 matmuls of 2*rows*dim*hidden/etp, x3."""
    return 3 * 3 * 2 * rows * case["dim"] * case["hidden"] / etp / 1e9


def result_rows(case: dict, res: dict) -> list[dict]:
    out = []
    for v, etp in zip(VARIANTS, (1, 2)):
        exp, lay = res["times"][f"{v}/experts"], res["times"][f"{v}/layer"]
        out.append({"variant": v, **case, "tp": 2, "etp": etp, "rows": res["rows"],
                    "expert_gflop_per_rank": expert_gflop(case, res["rows"], etp),
                    "experts_s": exp, "experts_s_median": statistics.median(exp),
                    "layer_s": lay, "layer_s_median": statistics.median(lay),
                    "max_abs_diff_vs_replicated": res["max_abs_diff"]})
    for r in out:
        r["experts_vs_replicated"] = r["experts_s_median"] / out[0]["experts_s_median"]
        r["layer_vs_replicated"] = r["layer_s_median"] / out[0]["layer_s_median"]
    return out


def report(rows: list[dict], cfg: dict, info: dict) -> str:
    c = rows[0]
    body = [[r["variant"], f"{r['expert_gflop_per_rank']:.1f}", f"{r['experts_s_median'] * 1e3:.0f}",
             f"{r['experts_vs_replicated']:.2f}x", f"{r['layer_s_median'] * 1e3:.0f}",
             f"{r['layer_vs_replicated']:.2f}x"] for r in rows]
    return "\n\n".join([
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}; 1-min load average "
        f"{info['load_average_before']:.2f} before, {info['load_average_after']:.2f} after.",
        f"tp=2 (2 gloo processes, 1 thread each, the same {c['tokens']} tokens), one MoE layer, E={c['n_experts']}, "
        f"top-{c['top_k']}, dim {c['dim']}, hidden {c['hidden']}, float32, forward + backward, slowest rank, median "
        f"of {cfg['steps']} steps after {cfg['warmup']}; max |out expert-TP - out replicated| = "
        f"{rows[1]['max_abs_diff_vs_replicated']:.1e}. Command: `{cfg['command']}`",
        table(["variant", "expert GFLOP / rank", "experts ms", "vs replicated", "whole layer ms", "vs replicated"],
              body),
    ])


def parse_args(argv=None) -> dict:
    return moe_dispatch.parse_args(argv, doc=__doc__, warmup=1, out=RESULTS, name="moe_expert_tp")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    case = QUICK_CASE if cfg["quick"] else CASE
    load_before = load_average()
    res = run_distributed(worker, 2, case, cfg["warmup"], cfg["steps"], timeout=600, op_timeout=300)[0]
    rows = result_rows(case, res)
    info = {**machine(), "threads_per_rank": 1, "load_average_before": load_before,
            "load_average_after": load_average()}
    text = report(rows, cfg, info)
    print(text)
    if not cfg["quick"]:
        cfg["out"].mkdir(parents=True, exist_ok=True)
        (cfg["out"] / "moe_expert_tp.json").write_text(json.dumps({"rows": rows, "machine": info,
                                                                   "command": cfg["command"]}, indent=1))
        (cfg["out"] / "moe_expert_tp.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
