"""The kernels on CPU: the chunked linear cross-entropy's peak memory against the eager loss, alone and
as a model's head and loss (`fused_loss`), and the Triton programs' agreement with their references in
Triton's interpreter.

Run:  python benchmarks/kernels.py [--vocab 50257 128256] [--tokens 1024] [--dim 256] [--threads 1]
                                   [--step-vocab 50257]

What is measured
----------------
1. Memory (real on a CPU). Forward + backward of the loss of N tokens (1 in 8
   ignored) through a (V, D) float32 head, `mean` reduction, at each vocabulary:
     eager:   `linear_cross_entropy_eager`, i.e. `F.cross_entropy(h @ w.T, labels)`
              with autograd: the (N, V) logits exist, and so do their softmax
              and their gradient during backward;
     chunked: `linear_cross_entropy` on its PyTorch side (what a CPU user gets)
              at the default chunk (`default_chunk_tokens`: Liger's rule, chunk
              logits about as large as h, but at least 64 tokens) and at
              `--chunk-tokens`.
   Each variant runs in a fresh Python process (one intra-op thread by
   default). The process makes h, w and the labels, runs the loss once on a
   tiny slice (so that lazy initialisation is not counted), reads its peak
   resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), then runs
   the full forward and backward and reads it again: "peak above inputs" is
   the difference, the memory the loss needed beyond h, w and the labels,
   gradients of h and w included (they are the same N*D + V*D floats for
   every variant, shown apart). Why RSS and not tracemalloc: torch's CPU
   allocations do not go through Python's allocator, so tracemalloc sees
   none of them. The inputs are made without temporaries (w is scaled in
   place), so the baseline peak is the inputs' and not some freed buffer's.
   What RSS can get wrong: heap memory freed before the baseline and reused
   later is not counted (a few MiB at most here: torch's import and the tiny
   warm-up), and freed heap pages that glibc keeps stay counted; the large
   buffers (tens of MiB and up) are mmapped and returned on free.
   Wall time of the forward + backward is shown too (one run, informative only).
2. A whole training step (real on a CPU), at `--step-vocab`: a small Llama
   (2 blocks, dim `--dim`, untied head, float32) trained by a one-process
   PipelineEngine (AdamW) on N = `--tokens` tokens (4 rows, 1 label in 8
   ignored), with `fused_loss` off (the head's (N, Vp) logits, then the
   vocab-parallel cross-entropy) and on (`FusedLinearCrossEntropy`, the chunked
   loss at its default chunk). Each in a fresh process: one warm-up step on
   1 x 8 tokens (the optimizer's state and the gradients exist after it), then
   the peak RSS of the next full step above the peak so far ("peak above
   warm-up": activations, logits and the loss's buffers; the gradients and the
   state are there in both), and the median wall time of 3 full steps.
3. Correctness in the interpreter (TRITON_INTERPRET=1, in its own process):
   for each kernel listed in CHECKS, the largest absolute difference of the
   output and of every gradient between the Triton side and the reference, in
   float32, at awkward shapes.
Results: benchmarks/results/kernels_cpu.json, and markdown tables on stdout.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_overhead import load_average, machine, table  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIB = 2 ** 20


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_memory(variant: str, vocab: int, tokens: int, dim: int, chunk: int | None, threads: int) -> dict:
    """One variant's peak RSS above its inputs (run this in a fresh process)."""
    from pipekit.kernels import kernels, linear_cross_entropy, linear_cross_entropy_eager
    from pipekit.kernels.linear_cross_entropy import default_chunk_tokens

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    h = torch.randn(tokens, dim, requires_grad=True)
    w = torch.randn(vocab, dim).mul_(dim ** -0.5).requires_grad_()  # in place: no (V, D) temporary in the baseline
    labels = torch.randint(0, vocab, (tokens,))
    labels[::8] = -100

    def loss_of(h_, w_, y_):
        if variant == "eager":
            return linear_cross_entropy_eager(h_, w_, y_)
        with kernels("torch"):
            return linear_cross_entropy(h_, w_, y_, chunk_tokens=chunk)

    loss_of(h[:2].detach().requires_grad_(), w[:64].detach().requires_grad_(), labels[:2] % 64).backward()
    before = _maxrss_bytes()
    start = time.perf_counter()
    loss = loss_of(h, w, labels)
    loss.backward()
    seconds = time.perf_counter() - start
    return {"variant": variant, "vocab": vocab, "tokens": tokens, "dim": dim,
            "chunk_tokens": chunk if variant != "eager" else None,
            "default_chunk_tokens": default_chunk_tokens(tokens, vocab, dim),
            "peak_above_inputs_bytes": _maxrss_bytes() - before, "grads_bytes": 4 * (tokens + vocab) * dim,
            "logits_bytes": 4 * tokens * vocab, "seconds": seconds, "loss": loss.item()}


def measure_step(fused: bool, vocab: int, tokens: int, dim: int, threads: int) -> dict:
    """A small Llama's training step with the head fused into the loss or not (run this in a fresh process)."""
    import statistics

    import pipekit
    from pipekit.models import get_model, model_loss, model_specs

    torch.set_num_threads(threads)
    rows, seq = 4, tokens // 4
    cfg = get_model("llama", "tiny", vocab_size=vocab, max_seq_len=seq, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2,
                    hidden=2 * dim, fused_loss=fused)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=0)
    engine = pipekit.PipelineEngine(module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    gen = torch.Generator().manual_seed(0)

    def batch(r: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (r, t + 1), generator=gen)
        labels = ids[:, 1:].clone()
        labels.view(-1)[::8] = -100
        return ids[:, :-1].contiguous(), labels

    engine.train_batch(batch(1, 8))  # warm-up: optimizer state, gradients, lazy initialisation
    before = _maxrss_bytes()
    seconds, losses = [], []
    for i in range(3):
        data = batch(rows, seq)
        start = time.perf_counter()
        losses.append(float(engine.train_batch(data)))
        seconds.append(time.perf_counter() - start)
        if i == 0:
            peak = _maxrss_bytes() - before
    return {"fused_loss": fused, "vocab": vocab, "padded_vocab": cfg.padded_vocab, "tokens": rows * seq, "dim": dim,
            "peak_above_warmup_bytes": peak, "logits_bytes": 4 * rows * seq * cfg.padded_vocab,
            "step_seconds": statistics.median(seconds), "losses": losses}


# kernel -> function returning rows {kernel, shape, diffs: {output or gradient name: largest |Triton - reference|}};
# other kernels add theirs
def _check_linear_ce() -> list[dict]:
    from pipekit.kernels import kernels, linear_cross_entropy, linear_cross_entropy_reference

    rows = []
    for n, d, v, chunk, vocab_size in [(37, 16, 77, 8, None), (1, 16, 77, 8, None), (23, 8, 80, 7, 77),
                                       (6, 8, 50257, 4, None)]:
        torch.manual_seed(0)
        h, w = torch.randn(n, d), torch.randn(v, d) * d ** -0.5
        labels = torch.randint(0, vocab_size or v, (n,))
        if n > 1:
            labels[::4] = -100
        weights = torch.rand(n) + 0.5
        out = []
        for side in ("torch", "triton"):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            with kernels(side):
                fn = linear_cross_entropy_reference if side == "torch" else linear_cross_entropy
                loss = fn(hh, ww, labels, weights_N=weights, chunk_tokens=chunk, vocab_size=vocab_size)
            loss.backward()
            out.append((loss.detach(), hh.grad, ww.grad))
        diffs = {k: (a - b).abs().max().item() for k, a, b in zip(("loss", "dh", "dw"), *out)}
        rows.append({"kernel": "linear_cross_entropy", "shape": f"N={n} D={d} V={v} chunk={chunk}"
                     + (f" vocab_size={vocab_size}" if vocab_size else ""), "diffs": diffs})
    return rows


def _check_moe() -> list[dict]:
    """The grouped GEMM against loop_mm, and the MoE permute / unpermute against their references."""
    from pipekit.kernels import (
        grouped_gemm,
        kernels,
        moe_permute,
        moe_permute_reference,
        moe_unpermute,
        moe_unpermute_reference,
    )
    from pipekit.moe.grouped import loop_mm

    def diffs(names, fn, ref, inputs, args):
        out = []
        for side, f in (("triton", fn), ("torch", ref)):
            leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
            with kernels(side):
                y = f(*leaves, *args)
            grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], torch.ones_like(y) * 0.5)
            out.append((y.detach(), *grads))
        return {k: (a - b).abs().max().item() if a.numel() else 0.0 for k, a, b in zip(names, *out)}

    rows = []
    for sizes, n_in, n_out in [([0, 5, 1, 0, 37], 24, 40), ([0, 0, 50, 0], 70, 130), ([7], 24, 40)]:
        torch.manual_seed(0)
        x, w = torch.randn(sum(sizes), n_in), torch.randn(len(sizes), n_in, n_out)
        rows.append({"kernel": "grouped_gemm", "shape": f"sizes={sizes} I={n_in} O={n_out}",
                     "diffs": diffs(("y", "dx", "dw"), grouped_gemm, loop_mm, [x, w], [sizes])})
    torch.manual_seed(0)
    token_N = torch.tensor([0, 0, 1, 3, 3, 5, 7, 7, 8, 12, 2, 2, 4])[torch.randperm(13)]
    x, y, weight = torch.randn(13, 300), torch.randn(13, 300), torch.rand(13)
    rows.append({"kernel": "moe_permute", "shape": "T=13 N=13 D=300, tokens routed 0-2 times",
                 "diffs": diffs(("x_ND", "dx"), moe_permute, moe_permute_reference, [x, token_N], [])})
    rows.append({"kernel": "moe_unpermute", "shape": "T=13 N=13 D=300, tokens routed 0-2 times",
                 "diffs": diffs(("out", "dy", "dweight"), moe_unpermute, moe_unpermute_reference,
                                [y, token_N, weight], [13, torch.float32])})
    return rows


CHECKS = {"linear_cross_entropy": _check_linear_ce}
CHECKS["moe"] = _check_moe


def _fresh(argv: list[str], env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[50257, 128256])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=256, help="the second chunked variant's chunk")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument("--step-vocab", type=int, nargs="*", default=[50257],
                   help="vocabularies of the whole-training-step comparison (none: leave it out)")
    p.add_argument("--skip-correctness", action="store_true", help="leave out the interpreter's table")
    p.add_argument("--out", default=str(RESULTS / "kernels_cpu.json"))
    p.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)  # internal: one variant, in a fresh process
    args = p.parse_args(argv)
    if args.measure:
        kind, *rest = args.measure
        if kind == "correctness":
            print(json.dumps([row for check in CHECKS.values() for row in check()]))
        elif kind == "step":
            print(json.dumps(measure_step(rest[1] == "fused", int(rest[0]), args.tokens, args.dim, args.threads)))
        else:
            chunk = int(rest[1]) if rest[1] != "default" else None
            print(json.dumps(measure_memory(kind, int(rest[0]), args.tokens, args.dim, chunk, args.threads)))
        return

    load_before = load_average()
    memory = []
    for vocab in args.vocab:
        for variant, chunk in (("eager", "default"), ("chunked", "default"), ("chunked", str(args.chunk_tokens))):
            memory.append(_fresh(["--measure", variant, str(vocab), chunk, "--tokens", str(args.tokens),
                                  "--dim", str(args.dim), "--threads", str(args.threads)]))
    steps = [_fresh(["--measure", "step", str(vocab), variant, "--tokens", str(args.tokens), "--dim", str(args.dim),
                     "--threads", str(args.threads)]) for vocab in args.step_vocab for variant in ("unfused", "fused")]
    correctness = [] if args.skip_correctness else _fresh(["--measure", "correctness"], {"TRITON_INTERPRET": "1"})
    load_after = load_average()

    eager = {r["vocab"]: r["peak_above_inputs_bytes"] for r in memory if r["variant"] == "eager"}
    body = []
    for r in memory:
        chunk = "-" if r["variant"] == "eager" else r["chunk_tokens"] or f"{r['default_chunk_tokens']} (default)"
        body.append([f"{r['vocab']:,}", r["variant"], chunk, f"{r['logits_bytes'] / MIB:.0f}",
                     f"{r['grads_bytes'] / MIB:.0f}", f"{r['peak_above_inputs_bytes'] / MIB:.0f}",
                     f"{r['peak_above_inputs_bytes'] / eager[r['vocab']]:.2f}", f"{r['seconds']:.2f}",
                     f"{r['loss']:.6f}"])
    print(f"linear + cross-entropy, float32 on CPU, N={args.tokens} tokens, D={args.dim}, {args.threads} thread(s); "
          f"peak RSS above the inputs, one fresh process per row; 1-min load average {load_before:.2f} before, "
          f"{load_after:.2f} after")
    print(table(["vocab", "variant", "chunk tokens", "(N, V) logits MiB", "dh + dw MiB", "peak above inputs MiB",
                 "/ eager", "fwd+bwd s", "loss"], body))
    if steps:
        off = {r["vocab"]: r for r in steps if not r["fused_loss"]}
        print(f"\na training step of a small Llama (2 blocks, D={args.dim}, untied head, float32, AdamW, one "
              f"process) on {steps[0]['tokens']} tokens, fused_loss off / on; peak RSS above the warm-up step's, "
              "median of 3 steps")
        print(table(["vocab (padded)", "fused_loss", "(N, Vp) logits MiB", "peak above warm-up MiB", "/ off",
                     "step s", "/ off", "losses"],
                    [[f"{r['vocab']:,} ({r['padded_vocab']:,})", "on" if r["fused_loss"] else "off",
                      f"{r['logits_bytes'] / MIB:.0f}", f"{r['peak_above_warmup_bytes'] / MIB:.0f}",
                      f"{r['peak_above_warmup_bytes'] / off[r['vocab']]['peak_above_warmup_bytes']:.2f}",
                      f"{r['step_seconds']:.2f}", f"{r['step_seconds'] / off[r['vocab']]['step_seconds']:.2f}",
                      " ".join(f"{x:.6f}" for x in r["losses"])] for r in steps]))
    if correctness:
        print("\nTriton (interpreter) against the reference, float32, largest absolute difference")
        print(table(["kernel", "shape", "largest absolute difference"],
                    [[r["kernel"], r["shape"], ", ".join(f"{k} {v:.1e}" for k, v in r["diffs"].items())]
                     for r in correctness]))
    info = {**machine(), "threads_per_rank": args.threads, "args": {k: v for k, v in vars(args).items()
                                                                   if k != "measure"},
            "load_average_before": load_before, "load_average_after": load_after,
            "command": "python benchmarks/kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    info.pop("backend", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "linear_cross_entropy_memory": memory, "training_step": steps,
                               "interpreter_correctness": correctness}, indent=1))


if __name__ == "__main__":
    main()
