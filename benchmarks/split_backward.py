"""Split backward against the full backward on one GPT stage: is I + W the price of B?

Run:  python benchmarks/split_backward.py [--sizes small,d256] [--repeats 30] [--device cpu|cuda]
                                          [--dtype fp32|bf16] [--dim 256 --layers 2 --seq 128 --batch 8]

What is measured
----------------
One pipeline stage of a GPT-2 (`get_model("gpt2", "tiny", dim=..., n_layers=...)`,
`TransformerBlock`s built from its spec list, as `PipelineModule` builds them), in
one process, at each named size of `SIZES` (by default `small`, where the cost of
calling the autograd engine and walking the graph shows, and `d256`, where the
matmuls dominate; `d512` on request; `--dim` and friends set one size of your own),
three ways:

- middle: the size's blocks; the input is an activation (a leaf that requires
  grad, as the engine receives it), the output's grad a fixed random tensor;
- last: the same blocks plus the final norm, the tied head and the loss;
- first: the embedding plus the blocks: the input is token ids, so I has
  nothing to compute and W does the whole backward.

For each, a round is: forward (not timed), B = `torch.autograd.backward`
(what the engine runs for a full backward); forward again, I =
`pipekit.split_backward.backward_input` (its graph walk included; the plan for
the graph's shape is worked out in the first warm-up round and cached, as for
every microbatch after a stage's first in training), W = `backward_weight`;
every other round runs the split first. Gradients are zeroed between (not
timed). B and W each end with the graph freed, as the engine's B and W actions
do (a few percent of B at the small size). On the CPU a call's time is this
process's CPU time (`time.process_time`, one intra-op thread by default, and CPU
autograd runs on the calling thread), so time lost to other processes on a
shared machine is left out; on a GPU it is wall time around a synchronised
call. After 3 warm-up rounds, `--repeats` rounds; the table gives the median
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
from pipekit.models import get_model, model_loss, model_specs  # noqa: E402
from pipekit.split_backward import backward_input, backward_weight  # noqa: E402
from pipeline_overhead import load_average, machine, table  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZES = {  # name -> stage shape
    "small": {"dim": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 1},  # overhead-bound
    "d256": {"dim": 256, "heads": 4, "layers": 2, "seq": 128, "batch": 8},  # the size README.md quotes
    "d512": {"dim": 512, "heads": 8, "layers": 2, "seq": 128, "batch": 8},  # results/split_backward_cpu_dim512.json
}
SHAPE = ("dim", "heads", "layers", "seq", "batch")


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
        held = dict(zip(("x", "outs", "grads"), forward()))

        def run():  # the graph's last references go inside the timed call, as W's go in W
            outs, grads = held.pop("outs"), held.pop("grads")
            held.clear()
            torch.autograd.backward(outs, grads)

        return run

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
    p.add_argument("--sizes", default="small,d256", help=f"comma-separated names from {', '.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    for name in SHAPE:
        p.add_argument(f"--{name}", type=int, default=None, help="one size of your own (the rest from d256)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on the CPU")
    p.add_argument("--out", default=None, help="JSON file (default: results/split_backward_<device>.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    own = {k: getattr(args, k) for k in SHAPE if getattr(args, k) is not None}
    names = ["custom"] if own else [n.strip() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES and n != "custom"]
    if unknown:
        p.error(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    load_before = load_average()
    sizes = []
    for name in names:
        shape = {**SIZES["d256"], **own} if name == "custom" else SIZES[name]
        run = argparse.Namespace(**{**vars(args), **shape})
        torch.manual_seed(0)
        rows = [measure(kind, run) for kind in ("middle", "last", "first")]
        sizes.append({"size": name, **shape, "rows": rows, "max_relative_grad_error": check_gradients(run)})
    load_after = load_average()
    print(f"GPT-2 stage, {args.dtype} on {args.device}, {args.threads} thread(s); median of {args.repeats} rounds; "
          f"1-min load average {load_before:.2f} before, {load_after:.2f} after, {machine()['cores']} cores")
    body = [[size["size"], f"{size['dim']}", f"{size['layers']}", f"{size['batch']} x {size['seq']}", r["stage"],
             f"{r['params']:,}", f"{r['B_ms']:.2f}", f"{r['I_ms']:.2f}", f"{r['W_ms']:.2f}",
             f"{r['I_ms'] + r['W_ms']:.2f}", f"{r['I_plus_W_over_B']:.3f}", f"{r['min_I_plus_min_W_over_min_B']:.3f}"]
            for size in sizes for r in size["rows"]]
    print(table(["size", "dim", "blocks", "tokens", "stage", "params", "B ms", "I ms", "W ms", "I + W ms",
                 "(I + W) / B, median per round", "fastest: (I + W) / B"], body))
    for size in sizes:
        print(f"split vs full gradients ({size['size']}, middle stage): largest relative difference "
              f"{size['max_relative_grad_error']:.2e}")
    info = {**machine(), "threads_per_rank": args.threads, "device": args.device, "args": vars(args),
            "load_average_before": load_before, "load_average_after": load_after}
    info.pop("backend", None)  # one process, no communication
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else RESULTS / f"split_backward_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "sizes": sizes}, indent=1))


if __name__ == "__main__":
    main()
