"""Tokens/s of MoEMLP's dropless dispatch against the naive per-expert mask loop, and ep=2 against ep=1, on CPU.

Run:  python benchmarks/moe_dispatch.py    # ~2-3 min; --quick: a smoke run (writes nothing); --steps, --warmup

What is measured
----------------
One step is forward + backward of one MoE layer, float32, on a fresh
(tokens, dim) input: zero_grad, out = layer(x), (out * g).sum().backward().
Every variant uses the same weights (one `pipekit.moe.MoEMLP`, SwiGLU experts,
softmax router with renormalised top-k, no shared experts, the aux loss
attached with coefficient 0.01) and the same router, so they differ only in
how tokens reach their experts and come back:

  naive mask loop    HF Mixtral's `MixtralSparseMoeBlock` shape: for each
                     expert, `torch.where(experts_TK == e)` over ALL token-slots
                     (a boolean mask over every token), gather those rows,
                     run the expert (`w[e]` of the stacked weights, as
                     transformers 5's MixtralExperts indexes its 3D
                     parameters), `index_add` its weighted output.
  pipekit, loop      `MoEMLP(gemm="loop")`: one stable sort of the slots by
                     expert, one gather, a loop of matmuls over contiguous
                     slices (weights unbound once, so backward stacks the E
                     weight gradients instead of adding E zero-padded
                     ones), one index_add.
  pipekit, grouped_mm  `MoEMLP(gemm="grouped_mm")`: the same permutation,
                     each projection one `torch._grouped_mm` call (this torch
                     runs it on CPU float32 for 16-byte-aligned rows).

Cases: E=8, top-2, 4096 tokens, dim 512, expert hidden 1024 (Mixtral-shaped);
fine-grained E=64, top-6, 4096 tokens, dim 512, hidden 256 (DeepSeek-shaped:
many small experts, ~1.5x the expert FLOPs of the first case). One process,
torch's default intra-op threads (the machine's cores). After `--warmup`
steps each, the variants alternate step by step for `--steps` steps each; the
table gives the median step and tokens/s = tokens / median step. The outputs
of the variants are compared as a same-work check.

Expert parallelism: 2 gloo processes (1 thread each), each with its OWN 4096
tokens of the first case. ep=1: every rank runs all 8 experts on its tokens;
ep=2: rank r holds experts [4r, 4r+4) and tokens travel by all_to_all
(counts, then rows; and back; the same again in backward). Alternating,
barrier (untimed) before each step, slowest rank's time; "all_to_all ms" is
the time inside the exchanges (count and row all_to_alls, forward and
backward), largest rank. Outputs of ep=2 and ep=1 are compared.

Overlap (issue 17): the same layer and tokens through pipekit's engine, 2 gloo
processes (1 thread each) at dp=2, each step its rank's 4096 tokens as
`--microbatches` (4) microbatches of 1024, 1F1B at pp=1, with and without
`schedule.overlap` (the forward of microbatch m+1 runs beside the backward of
m on a second thread, the backward's collectives on twin groups: F0, F1+B0,
F2+B1, F3+B2, B3). "actions ms" is the engine's action loop (every forward and
backward, the loss; the timeline's last end), slowest rank, median; "step ms"
adds the optimizer step (SGD) and, at ep=1, the all-reduce of the replicated
experts' gradients, which ep=2 does not need. The four variants alternate
step by step; the losses of every variant are compared to ep=1 without
overlap.

Host reads per step: the Tensor methods that read a value on the host
(`.item()`, `.tolist()`, ...; on a GPU each waits for the device's queue)
counted during each timed step (`pipekit.testing.HostReads`), by pipekit's
call sites; the table gives them per step (one layer call). Dropless ep=1
reads nothing with grouped_mm (device offsets) and once with the loop (it
slices on the host); ep=2 reads the exchange sizes once (the loop adds its
one). The naive loop's `torch.where` reads inside torch (E times a step on a
GPU), which this count cannot see; it shows 0.

Not measured: GPUs, bf16, megablocks, capacity mode, more than 2 ranks, overlap at pp > 1, the
router's own cost apart from the dispatch. Two processes share this
machine's 2 cores: ep=2 vs ep=1 shows the exchange's cost at equal compute
per rank, not what spreading experts over more devices saves in memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipekit import LayerSpec
from pipekit.auxloss import attach, metrics
from pipekit.moe import MoEMLP, dispatch
from pipekit.moe.grouped import grouped_mm_runs
from pipekit.testing import HostReads, run_distributed
from pipeline_overhead import load_average, machine, table

SEED = 0
RESULTS = Path(__file__).parent / "results"
CASES = {
    "E=8, top-2": dict(n_experts=8, top_k=2, dim=512, hidden=1024, tokens=4096),
    "E=64, top-6": dict(n_experts=64, top_k=6, dim=512, hidden=256, tokens=4096),
    "E=64, top-8": dict(n_experts=64, top_k=8, dim=512, hidden=256, tokens=4096),
}
QUICK_CASES = {
    "E=8, top-2": dict(n_experts=8, top_k=2, dim=64, hidden=128, tokens=512),
    "E=64, top-6": dict(n_experts=64, top_k=6, dim=64, hidden=32, tokens=512),
}


def build(case: dict, gemm: str = "auto", ep_group=None) -> MoEMLP:
    return LayerSpec(MoEMLP, case["dim"], case["hidden"], case["n_experts"], case["top_k"], gemm=gemm,
                     ep_group=ep_group).build(seed=SEED, index=1)


def naive_forward(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """HF Mixtral's loop: per expert, a boolean mask over all token-slots, gather, compute, index_add."""
    x_TD = x.reshape(-1, x.shape[-1])
    routing = layer.router(x_TD)
    ex = layer.experts
    out = torch.zeros_like(x_TD)
    for e in range(ex.n_experts):
        token_idx, k_idx = torch.where(routing.experts_TK == e)
        if token_idx.numel() == 0:
            continue
        xe = x_TD[token_idx]
        ye = (F.silu(xe @ ex.w_gate[e]) * (xe @ ex.w_up[e])) @ ex.w_down[e]
        out = out.index_add(0, token_idx, ye * routing.weights_TK[token_idx, k_idx, None].to(ye.dtype))
    return attach(out, layer.router.loss(routing)).view_as(x)


def step(fn, layer, x, g, reads: HostReads) -> tuple[float, torch.Tensor, int]:
    """(seconds, output, host reads) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    reads.sites.clear()
    reads.on = True
    start = time.perf_counter()
    try:
        out = fn(x)
        (out * g).sum().backward()
    finally:
        reads.on = False
    return time.perf_counter() - start, out.detach(), reads.total()


# ---- one process: dispatch variants ----------------------------------------------
def dispatch_rows(name: str, case: dict, warmup: int, steps: int) -> list[dict]:
    layers = {"naive mask loop": build(case), "pipekit dropless, loop": build(case, "loop")}
    probe = torch.empty(1, case["dim"])
    if grouped_mm_runs(probe, torch.empty(1, case["dim"], case["hidden"])):
        layers["pipekit dropless, grouped_mm"] = build(case, "grouped_mm")
    fns = {k: (lambda x, moe=layer: naive_forward(moe, x)) if k.startswith("naive") else layer
           for k, layer in layers.items()}
    gen = torch.Generator().manual_seed(1)
    times = {k: [] for k in layers}
    host_reads = {k: [] for k in layers}
    outs = {}
    reads = HostReads()
    try:
        for i in range(warmup + steps):
            x = torch.randn(case["tokens"], case["dim"], generator=gen)
            g = torch.randn(case["tokens"], case["dim"], generator=gen)
            for k in (list(layers) if i % 2 == 0 else list(reversed(layers))):
                t, outs[k], n = step(fns[k], layers[k], x, g, reads)
                if i >= warmup:
                    times[k].append(t)
                    host_reads[k].append(n)
    finally:
        reads.restore()
    metrics.pop()
    base = outs["naive mask loop"]
    rows = []
    for k in layers:
        med = statistics.median(times[k])
        rows.append({"case": name, **case, "variant": k, "step_s": times[k], "step_s_median": med,
                     "host_reads_per_step": statistics.mean(host_reads[k]),
                     "tokens_per_s": case["tokens"] / med,
                     "max_abs_diff_vs_naive": (outs[k] - base).abs().max().item()})
    naive = rows[0]["step_s_median"]
    for r in rows:
        r["speedup_vs_naive"] = naive / r["step_s_median"]
    return rows


# ---- two processes: ep=2 against ep=1 --------------------------------------------------
class _CommTimer:
    """Wraps dispatch's all_to_all helpers to add up the seconds spent inside them."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("_all_to_all", "exchange_counts"):
            setattr(dispatch, name, self._timed(getattr(dispatch, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def ep_worker(case: dict, warmup: int, steps: int) -> dict:
    timer = _CommTimer()
    rank = dist.get_rank()
    layers = {1: build(case, ep_group=None), 2: build(case, ep_group=dist.group.WORLD)}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    times = {ep: [] for ep in layers}
    comm = {ep: [] for ep in layers}
    host_reads = {ep: [] for ep in layers}
    outs = {}
    reads = HostReads()
    for i in range(warmup + steps):
        x = torch.randn(case["tokens"], case["dim"], generator=gen)
        g = torch.randn(case["tokens"], case["dim"], generator=gen)
        for ep in ((1, 2) if i % 2 == 0 else (2, 1)):
            dist.barrier()
            timer.seconds = 0.0
            t, outs[ep], n = step(layers[ep], layers[ep], x, g, reads)
            if i >= warmup:
                times[ep].append(t)
                comm[ep].append(timer.seconds)
                host_reads[ep].append(n)
    reads.restore()
    metrics.pop()
    slowest = torch.tensor([times[1], times[2], comm[1], comm[2]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    diff = torch.tensor((outs[2] - outs[1]).abs().max().item(), dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"step_s": {1: slowest[0].tolist(), 2: slowest[1].tolist()},
            "comm_s": {1: slowest[2].tolist(), 2: slowest[3].tolist()}, "max_abs_diff": diff.item(),
            "host_reads": {ep: statistics.mean(host_reads[ep]) for ep in layers}}


def ep_rows(case: dict, warmup: int, steps: int) -> list[dict]:
    res = run_distributed(ep_worker, 2, case, warmup, steps, timeout=600, op_timeout=300)[0]
    rows = []
    for ep in (1, 2):
        med = statistics.median(res["step_s"][ep])
        rows.append({"ep": ep, **case, "step_s": res["step_s"][ep], "step_s_median": med,
                     "comm_s_median": statistics.median(res["comm_s"][ep]),
                     "host_reads_per_step": res["host_reads"][ep],
                     "tokens_per_s": 2 * case["tokens"] / med, "max_abs_diff_ep2_vs_ep1": res["max_abs_diff"]})
    for r in rows:
        r["relative_to_ep1"] = r["step_s_median"] / rows[0]["step_s_median"]
    return rows


# ---- two processes through the engine: ep and overlap ---------------------------------
class _SumLoss(torch.nn.Module):
    """sum(out * g): the benchmark's stand-in for a loss (g: fixed random output grads)."""

    def forward(self, out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (out * g).sum()


OVERLAP_VARIANTS = [(1, False), (1, True), (2, False), (2, True)]  # (ep, overlap)


def _overlap_engine(case: dict, ep: int, overlap: bool, microbatches: int):
    import pipekit
    from pipekit.schedules import build_schedule

    topo = pipekit.Topology(pp=1, dp=2, ep=ep)
    spec = LayerSpec(MoEMLP, case["dim"], case["hidden"], case["n_experts"], case["top_k"], ep_group=topo.ep_group)
    module = pipekit.PipelineModule([spec], loss_fn=_SumLoss(), topology=topo, seed=SEED,
                                    schedule=build_schedule("1f1b", 1, microbatches, overlap=overlap))
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-6)
    return pipekit.PipelineEngine(module, optimizer=optimizer, record_timeline=True)


def overlap_worker(case: dict, warmup: int, steps: int, microbatches: int) -> dict:
    engines = {v: _overlap_engine(case, *v, microbatches) for v in OVERLAP_VARIANTS}
    gen = torch.Generator().manual_seed(200 + dist.get_rank())  # each rank its own tokens
    actions: dict = {v: [] for v in engines}
    whole: dict = {v: [] for v in engines}
    losses: dict = {v: [] for v in engines}
    for i in range(warmup + steps):
        x = torch.randn(case["tokens"], case["dim"], generator=gen)
        g = torch.randn(case["tokens"], case["dim"], generator=gen)
        order = OVERLAP_VARIANTS if i % 2 == 0 else OVERLAP_VARIANTS[::-1]
        for v in order:
            dist.barrier()
            start = time.perf_counter()
            loss = engines[v].train_batch(iter([(x, g)]))
            elapsed = time.perf_counter() - start
            losses[v].append(float(loss))
            if i >= warmup:
                whole[v].append(elapsed)
                actions[v].append(max(e.end for e in engines[v].timeline))
    metrics.pop()
    out = {}
    for v in engines:
        slowest = torch.tensor([actions[v], whole[v]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[v] = {"actions_s": slowest[0].tolist(), "step_s": slowest[1].tolist(), "losses": losses[v]}
    return out


def overlap_rows(case: dict, warmup: int, steps: int, microbatches: int) -> list[dict]:
    res = run_distributed(overlap_worker, 2, case, warmup, steps, microbatches, timeout=900, op_timeout=300)[0]
    base = res[(1, False)]
    rows = []
    for ep, overlap in OVERLAP_VARIANTS:
        r = res[(ep, overlap)]
        rows.append({"ep": ep, "overlap": overlap, **case, "microbatches": microbatches,
                     "actions_s": r["actions_s"], "actions_s_median": statistics.median(r["actions_s"]),
                     "step_s": r["step_s"], "step_s_median": statistics.median(r["step_s"]),
                     "max_abs_loss_diff_vs_ep1": max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))})
    for r in rows:
        r["actions_vs_ep1"] = r["actions_s_median"] / rows[0]["actions_s_median"]
        r["step_vs_ep1"] = r["step_s_median"] / rows[0]["step_s_median"]
    return rows


def overlap_table(rows: list[dict]) -> str:
    body = [[r["ep"], "yes" if r["overlap"] else "no", f"{r['actions_s_median'] * 1e3:.0f}",
             f"{min(r['actions_s']) * 1e3:.0f}-{max(r['actions_s']) * 1e3:.0f}", f"{r['actions_vs_ep1']:.2f}x",
             f"{r['step_s_median'] * 1e3:.0f}", f"{r['step_vs_ep1']:.2f}x", f"{r['max_abs_loss_diff_vs_ep1']:.1e}"]
            for r in rows]
    return table(["ep", "overlap", "actions ms (median, slowest rank)", "min-max", "actions vs ep=1",
                  "step ms (median)", "step vs ep=1", "max |loss - ep=1 loss|"], body)


# ---- report -------------------------------------------------------------------------
def dispatch_table(rows: list[dict]) -> str:
    body = [[r["case"], f"{r['tokens']}", f"{r['dim']} / {r['hidden']}", r["variant"],
             f"{r['step_s_median'] * 1e3:.0f}", f"{min(r['step_s']) * 1e3:.0f}-{max(r['step_s']) * 1e3:.0f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['speedup_vs_naive']:.2f}x", f"{r['max_abs_diff_vs_naive']:.1e}",
             f"{r['host_reads_per_step']:g}"]
            for r in rows]
    return table(["case", "tokens", "dim / hidden", "variant", "fwd+bwd ms (median)", "min-max", "tokens/s",
                  "vs naive", "max |out - naive|", "host reads / step"], body)


def ep_table(rows: list[dict]) -> str:
    body = [[r["ep"], f"{r['step_s_median'] * 1e3:.0f}", f"{min(r['step_s']) * 1e3:.0f}-{max(r['step_s']) * 1e3:.0f}",
             f"{r['comm_s_median'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['relative_to_ep1']:.2f}x",
             f"{r['host_reads_per_step']:g}"]
            for r in rows]
    return table(["ep", "fwd+bwd ms (median, slowest rank)", "min-max", "all_to_all ms (median)",
                  "tokens/s (both ranks)", "step vs ep=1", "host reads / step (rank 0)"], body)


def report(drows: list[dict], erows: list[dict], orows: list[dict], cfg: dict, info: dict) -> str:
    loaded = info["load_average_after"] > 1.5 * info["cores"]
    c = erows[0]
    return "\n\n".join([
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}; 1-min load average "
        f"{info['load_average_before']:.2f} before, {info['load_average_after']:.2f} after"
        + (" -- WARNING: other work shared the CPUs, times are inflated" if loaded else "") + ".",
        f"One MoE layer (SwiGLU experts, softmax top-k, float32), forward + backward; {cfg['steps']} timed steps "
        f"per variant after {cfg['warmup']} warm-up steps, alternating; one process, "
        f"{torch.get_num_threads()} intra-op threads.",
        dispatch_table(drows),
        f"Expert parallelism, 2 gloo processes (1 thread each), each its own {c['tokens']} tokens, E={c['n_experts']}, "
        f"top-{c['top_k']}, dim {c['dim']}, hidden {c['hidden']}; max |out ep=2 - out ep=1| = "
        f"{erows[1]['max_abs_diff_ep2_vs_ep1']:.1e}:",
        ep_table(erows),
        f"Through the engine, dp=2, each rank {c['tokens']} tokens a step in {orows[0]['microbatches']} microbatches, "
        "1F1B at pp=1, SGD; overlap: a forward beside the previous microbatch's backward:",
        overlap_table(orows),
    ])


def parse_args(argv=None, *, doc: str = __doc__, warmup: int = 2, out: Path = RESULTS,
               name: str = "moe_dispatch") -> dict:
    """The MoE benchmarks' command line (this one's, and moe_expert_tp.py's with its own
    docstring, warm-up and result name)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps first (default {warmup})")
    p.add_argument("--quick", action="store_true", help="smoke mode: small shapes, 2 steps, seconds")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step in the overlap table (default 4)")
    p.add_argument("--out", type=Path, default=out, help=f"folder for {name}.json and .md")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.microbatches < 2:
        p.error(f"--steps must be >= 1, --warmup >= 0 and --microbatches >= 2 (overlap pairs two), got {a.steps}, "
                f"{a.warmup} and {a.microbatches}")
    steps, warmup = (2, 1) if a.quick else (a.steps, a.warmup)
    return {"steps": steps, "warmup": warmup, "quick": a.quick, "out": a.out, "microbatches": a.microbatches,
            "command": " ".join(["python", *sys.argv])}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    cases = QUICK_CASES if cfg["quick"] else CASES
    started, load_before = time.perf_counter(), load_average()
    drows = [r for name, case in cases.items() for r in dispatch_rows(name, case, cfg["warmup"], cfg["steps"])]
    erows = ep_rows(cases["E=8, top-2"], cfg["warmup"], cfg["steps"])
    orows = overlap_rows(cases["E=8, top-2"], cfg["warmup"], cfg["steps"], cfg["microbatches"])
    info = {**machine(), "threads_per_rank": 1, "threads_single_process": torch.get_num_threads(),
            "load_average_before": load_before, "load_average_after": load_average()}
    text = report(drows, erows, orows, cfg, info)
    print(text)
    elapsed = time.perf_counter() - started
    if cfg["quick"]:
        print(f"\n--quick: smoke run in {elapsed:.0f} s, nothing written")
        return
    result = {"machine": info, "command": cfg["command"], "steps": cfg["steps"], "warmup": cfg["warmup"],
              "dispatch": drows, "expert_parallel": erows, "overlap": orows, "elapsed_s": elapsed}
    cfg["out"].mkdir(parents=True, exist_ok=True)
    (cfg["out"] / "moe_dispatch.json").write_text(json.dumps(result, indent=2) + "\n")
    (cfg["out"] / "moe_dispatch.md").write_text(text + "\n")
    print(f"\nwrote {cfg['out'] / 'moe_dispatch.json'} and moe_dispatch.md in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
