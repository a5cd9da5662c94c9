"""Split backward against the full backward on one GPT stage: is I + W the price of B?

Run:  python benchmarks/split_backward.py [--repeats 30] [--device cpu|cuda] [--dtype fp32|bf16]
                                          [--dim 256 --layers 2 --seq 128 --batch 8]

What is measured
----------------
One pipeline stage of a GPT-2 (`get_model("gpt2", "tiny", dim=..., n_layers=...)`,
`TransformerBlock`s built from its spec list, as `PipelineModule` builds them), in
one process, three ways:

- middle: `--layers` blocks; the input is an activation (a leaf that requires
  grad, as the engine receives it), the output's grad a fixed random tensor;
- last: the same blocks plus the final norm, the tied head and the loss;
- first: the embedding plus the blocks: the input is token ids, so I has
  nothing to compute and W does the whole backward.

For each, a round is: forward (not timed), B = `torch.autograd.backward`
(what the engine runs for a full backward); forward again, I =
`pipekit.split_backward.backward_input` (its graph walk included), W =
`backward_weight`; every other round runs the split first. Gradients are
zeroed between (not timed). On the CPU a call's time is this process's CPU
time (`time.process_time`, one intra-op thread by default, and CPU autograd
runs on the calling thread), so time lost to other processes on a shared
machine is left out; on a GPU it is wall time around a synchronised call. After 3 warm-up rounds, `--repeats` rounds; the table gives the median
times, the median over rounds of each round's (I + W) / B (drifting machine
load disturbs it less than a ratio of medians), and the same ratio of the
fastest times (min I + min W) / min B, the least disturbed by other work on a
shared machine. The target is (I + W) / B <= 1.15. The 1-minute load average
is printed: above the core count, caches are shared and times still move.

Not measured: communication, the schedule (what the split buys: see
`pipekit plan --schedule zb_h1`), memory held between I and W, torch.compile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_overhead import load_average, machine, table  # noqa: E402

from pipekit.models import get_model, model_loss, model_specs  # noqa: E402
from pipekit.split_backward import backward_input, backward_weight  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_stage(kind: str, args) -> tuple[list, torch.nn.Module, object]:
    """(layers, a module holding their parameters, the loss) of a first, middle or last stage."""
    cfg = get_model("gpt2", "tiny", dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq)
    specs = model_specs(cfg)
    blocks = list(range(1, 1 + args.layers))
    keep = {"first": [0, *blocks], "middle": blocks, "last": [*blocks, len(specs) - 2, len(specs) - 1]}[kind]
    built, tied = {}, {}
    for i in keep:
        spec = specs[i]
        key = getattr(spec, "key", None)
        if key is not None and key in tied:
            built[i] = tied[key]
        else:
            built[i] = spec.build(seed=0, index=i, device=args.device).to(DTYPES[args.dtype])
            if key is not None:
                tied[key] = built[i]
    layers = [(specs[i], built[i]) for i in keep]
    holder = torch.nn.ModuleList(dict.fromkeys(built.values()))
    loss = model_loss(cfg).build(seed=0, index=len(specs), device=args.device) if kind == "last" else None
    return layers, holder, loss


def run_stage(layers, x):
    for spec, module in layers:
        fn = getattr(spec, "forward_fn", None)
        x = fn(module, x) if fn is not None else module(x)
    return x


def time_call(fn, device) -> float:
    """Seconds `fn` takes: CPU time of this process on the CPU (time spent descheduled by
    other work on a shared machine does not count), wall time around a synchronised GPU."""
    if device.type != "cuda":
        start = time.process_time()
        fn()
        return time.process_time() - start
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(kind: str, args) -> dict:
    device = torch.device(args.device)
    layers, holder, loss_fn = build_stage(kind, args)
    params = list(holder.parameters())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
    hidden = torch.randn(args.batch, args.seq, args.dim, generator=gen).to(device, DTYPES[args.dtype])

    def forward():
        x = ids[:, :-1] if kind == "first" else hidden.detach().requires_grad_()
        out = run_stage(layers, x)
        if kind == "last":
            return x, [loss_fn(out.float(), ids[:, 1:])], [None]
        return x, [out], [torch.ones_like(out) * 1e-3]

    def full():
        x, outs, grads = forward()
        return lambda: torch.autograd.backward(outs, grads)

    state = {}

    def split_input():
        x, outs, grads = forward()
        inputs = [] if kind == "first" else [x]
        return lambda: state.update(work=backward_input(outs, grads, inputs, params)[1])

    def timed_full():
        holder.zero_grad(set_to_none=True)
        return time_call(full(), device)

    def timed_split():
        holder.zero_grad(set_to_none=True)
        i = time_call(split_input(), device)
        return i, time_call(lambda: backward_weight(state.pop("work")), device)

    times = {"B": [], "I": [], "W": [], "ratio": []}
    for r in range(3 + args.repeats):
        if r % 2:
            (i, w), b = timed_split(), timed_full()
        else:
            b, (i, w) = timed_full(), timed_split()
        if r >= 3:
            for key, value in (("B", b), ("I", i), ("W", w), ("ratio", (i + w) / b)):
                times[key].append(value)
    med = {k: statistics.median(v) * (1 if k == "ratio" else 1e3) for k, v in times.items()}
    return {"stage": kind, "B_ms": med["B"], "I_ms": med["I"], "W_ms": med["W"],
            "I_plus_W_over_B": med["ratio"],
            "min_I_plus_min_W_over_min_B": (min(times["I"]) + min(times["W"])) / min(times["B"]),
            "params": sum(p.numel() for p in params)}


def check_gradients(args) -> float:
    """The split gives the full backward's gradients (largest relative difference)."""
    device = torch.device(args.device)
    layers, holder, _ = build_stage("middle", args)
    params = list(holder.parameters())
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=DTYPES[args.dtype], requires_grad=True)
    g = torch.randn_like(x)
    run_stage(layers, x).backward(g)
    want = [p.grad.clone() for p in params] + [x.grad.clone()]
    holder.zero_grad(set_to_none=True)
    x2 = x.detach().requires_grad_()
    gx, work = backward_input([run_stage(layers, x2)], [g], [x2], params)
    backward_weight(work)
    got = [p.grad for p in params] + [gx[0]]
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, want))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on the CPU")
    p.add_argument("--out", default=None, help="JSON file (default: results/split_backward_<device>.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = load_average()
    rows = [measure(kind, args) for kind in ("middle", "last", "first")]
    load_after = load_average()
    error = check_gradients(args)
    body = [[r["stage"], f"{r['params']:,}", f"{r['B_ms']:.2f}", f"{r['I_ms']:.2f}", f"{r['W_ms']:.2f}",
             f"{r['I_ms'] + r['W_ms']:.2f}", f"{r['I_plus_W_over_B']:.3f}",
             f"{r['min_I_plus_min_W_over_min_B']:.3f}"] for r in rows]
    print(f"GPT-2 stage: dim={args.dim}, {args.layers} blocks, batch {args.batch} x {args.seq} tokens, "
          f"{args.dtype} on {args.device}, {args.threads} thread(s); median of {args.repeats} rounds; "
          f"1-min load average {load_before:.2f} before, {load_after:.2f} after, {machine()['cores']} cores")
    print(table(["stage", "params", "B ms", "I ms", "W ms", "I + W ms", "(I + W) / B, median per round",
                 "fastest: (I + W) / B"], body))
    print(f"split vs full gradients (middle stage): largest relative difference {error:.2e}")
    info = {**machine(), "threads_per_rank": args.threads, "device": args.device, "args": vars(args),
            "load_average_before": load_before, "load_average_after": load_after}
    info.pop("backend", None)  # one process, no communication
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else RESULTS / f"split_backward_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "rows": rows, "max_relative_grad_error": error}, indent=1))


if __name__ == "__main__":
    main()
