"""The one GPU command: pipekit's CUDA checks, end-to-end throughput, offload, its kernels' speed and memory.

    python benchmarks/gpu_suite.py                 # one GPU (an H200: at most ~8 minutes)
    python benchmarks/gpu_suite.py --quick         # smaller sizes, fewer repeats
    python benchmarks/gpu_suite.py --only checks   # one section: checks | end_to_end | offload | finetune | kernels
    python benchmarks/gpu_suite.py --cpu-smoke --out /tmp/gpu_suite.md   # every code path, tiny, on CPU

Writes one markdown report (default benchmarks/results/gpu_suite.md) and prints it at the end.
The file is rewritten whole (atomically) after every row, so a run killed part-way leaves
every row finished so far. Each section has its own deadline (its share of --budget-s,
`SHARES`, plus what the sections before it left unused): a row that would start after it is
reported as skipped, and a row still running at the deadline (plus a grace) is stopped and
reported as such. Inputs and models are built on the device (no large CPU randn). Dynamo is
reset before every torch.compile, so no compile inherits another's shapes (marked dynamic).
Sections, in the order they run:

checks      what needs CUDA, each PASS / FAIL (with the error) / SKIP, none stopping the suite:
            every kernel (rms_norm and layer_norm, plain and with the residual; apply_rotary;
            swiglu, geglu; linear_cross_entropy; the MoE "triton" grouped gemm when
            `pipekit.moe.GEMMS` has it) in bf16 and fp32 against its reference — outputs and
            every input gradient; fused AdamW (fp32, as master weights are) against
            torch.optim.AdamW after 3 steps, and its overflow skip; the NCCL path at world size 1
            (init_distributed over nccl, one PipelineEngine step on cuda); `torch._grouped_mm` in
            bf16 against the loop gemm; fp16 with ZeroOptimizer + LossScaler; torch.compile of a
            Llama block against eager.
            Error measure: max |got - want| / max |want| per tensor (scale-relative, so one
            number reads the same for outputs and gradients of any size); bounds: 1e-4 in fp32
            (another summation order, over up to ~8k rows in the weight gradients) and 2e-2 in
            bf16/fp16 (8 bits of mantissa: the two sides round at different places).
            A kernel check also fails when the op took its reference instead of its Triton
            program (its outputs' autograd node is not the Triton Function's).
end_to_end  tokens/s, MFU and peak memory of GPT-2 124M and a Mixtral-style MoE: the plain
            PyTorch loop against pipekit in fp32, bf16, bf16 + compile, bf16 + compile + kernels.
            The plain loop is what a user writes, nanoGPT's recipe: the model's layers as one
            nn.Sequential built on the GPU, `F.cross_entropy` on the full logits, gradient
            accumulation, `torch.optim.AdamW(fused=True)`, bf16 as `torch.autocast` (fp32
            weights, bf16 matmuls), "+compile" as `torch.compile` of the whole model. pipekit
            is its own recipe: bf16 weights with fp32 masters (`precision="bf16"`, ZeroOptimizer),
            compile per layer; its rows without "+kernels" force kernels="torch" with the plain
            head and loss, "+kernels" runs every Triton kernel, the fused head + loss
            (`model.fused_loss`) and the fused AdamW. "pipekit / plain" is tokens/s over the
            plain row of the same mode ("+kernels": the mode without them).
offload     `ZeroOptimizer(offload="cpu")` (master weights, AdamW state and the step on the host)
            against offload="none" on the GPU: device memory (max_memory_allocated over the
            run) and step time, GPT-2 1.5B shapes (bf16, pp=1) by default (`--offload-flavour`).
finetune    full fine-tuning against LoRA rank 16 (attention q, k, v, o and the MLP's gate, up,
            down; every other weight frozen, `pipekit.layers.lora.add_adapters`, as `model.lora`
            applies it) of a Llama of 1.1B parameters (dim 2048, 16 layers, 16 heads, 8 kv heads,
            hidden 5632, vocab 32000), bf16 weights, fp32 masters and AdamW state on the trained
            parameters, one microbatch of 4 x 1024 tokens, pp=1: device peak memory and step time.
kernels     each kernel's forward + backward time (torch.cuda.Event, median of N) and peak
            memory above its inputs (torch.cuda.max_memory_allocated) at realistic sizes: 8k
            tokens, d=4096 (SwiGLU hidden 14336), vocab 128,256 for the linear cross-entropy,
            64 experts top-8 for the gemm; bf16; pipekit's Triton side against torch eager (the
            reference) and Liger-Kernel when importable, and — in a second pass, after every
            other row, as it compiles each kernel — torch.compile of the reference. The fused
            linear cross-entropy's peak memory over eager's is printed under the table (target
            <= 1/4 at vocab 128k). Then one AdamW step of a d x hidden fp32 master shard cut in
            64k-element pieces (what ZeroOptimizer gives torch's AdamW): FusedAdamW (one launch
            over them) against torch.optim.AdamW foreach and fused.

--cpu-smoke runs all of it at tiny sizes on the CPU so that the script's logic is tested
without a GPU (tests/test_gpu_suite.py): Triton in its interpreter (TRITON_INTERPRET=1, set
here before triton is imported), float32 only (bf16 is wrong in the interpreter), gloo in
place of nccl, torch.compile with the "eager" backend (inductor on a CPU is too slow for a
smoke run), times by time.perf_counter and no memory figures. Its numbers mean nothing.
Without CUDA and without --cpu-smoke: one line and exit status 2.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # before anything imports triton: its interpreter is chosen at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_throughput, beside this file
import gpu_throughput as gt  # noqa: E402
import pipekit  # noqa: E402
from pipekit.atomic import write_atomic  # noqa: E402
from pipekit.kernels import (  # noqa: E402
    apply_rotary,
    apply_rotary_reference,
    geglu,
    geglu_reference,
    kernels,
    layer_norm,
    layer_norm_reference,
    linear_cross_entropy,
    linear_cross_entropy_eager,
    rms_norm,
    rms_norm_reference,
    swiglu,
    swiglu_reference,
)
from pipekit.kernels.adamw import FusedAdamW  # noqa: E402
from pipekit.kernels.dispatch import triton_available  # noqa: E402
from pipekit.layers.rotary import rotary_cos_sin  # noqa: E402
from pipekit.models import flops_per_token, get_model, model_loss, model_specs  # noqa: E402
from pipekit.testing import reference_model  # noqa: E402

SECTIONS = ("checks", "end_to_end", "offload", "finetune", "kernels")  # the order they run in
SHARES = {"checks": 0.2, "end_to_end": 0.4, "offload": 0.12, "finetune": 0.08,
          "kernels": 0.2}  # of --budget-s, each section's
GRACE_S = 30.0  # a row still running this long past its section's deadline is stopped
BOUND = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}  # scale-relative, module docstring
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_suite.md"
SEED, LR, WEIGHT_DECAY = 0, 3e-4, 0.1


@dataclass
class Sizes:
    """Every size the suite uses; `sizes(args)` picks the full, --quick or --cpu-smoke set."""
    check_tokens: int; check_dim: int; check_vocab: int  # noqa: E702
    tokens: int; dim: int; hidden: int; heads: int; kv_heads: int; vocab: int  # noqa: E702
    experts: int; top_k: int; expert_hidden: int  # noqa: E702
    repeats: int; e2e_flavour: str; e2e_steps: int; e2e_warmup: int  # noqa: E702
    e2e_microbatches: int; e2e_micro_batch: int; e2e_seq: int  # noqa: E702
    offload_flavour: str = "1.5b"; offload_micro_batch: int = 4; offload_seq: int = 1024  # noqa: E702
    offload_steps: int = 2  # noqa: E702
    finetune: str = "1b"; finetune_micro_batch: int = 4; finetune_seq: int = 1024; finetune_steps: int = 3  # noqa: E702


def sizes(args) -> Sizes:
    if args.cpu_smoke:
        return Sizes(33, 96, 77, 40, 64, 96, 2, 1, 131, 8, 2, 48, 2, "tiny", 1, 1, 2, 2, 16, "tiny", 2, 16, 1,
                     "tiny", 2, 16, 1)
    if args.quick:
        return Sizes(1025, 1024, 32000, 2048, 2048, 5632, 16, 4, 32000, 64, 8, 1024, 5, "124m", 3, 2, 2, 8, 1024,
                     args.offload_flavour or "774m", 2, 1024, 2)
    return Sizes(4097, 4096, 50257, 8192, 4096, 14336, 32, 8, 128256, 64, 8, 1536, 20, "124m", 5, 2, 4, 8, 1024,
                 args.offload_flavour or "1.5b", 4, 1024, 2)


# ---- the report, the clock --------------------------------------------------------------------------
class Report:
    """The report as it grows: the header, then each section's text so far. `write()` puts the
    whole of it in the file (atomically: a reader, or a run killed part-way, finds the last
    whole version, never half a row); every section calls it after each row."""

    def __init__(self, path: Path, header: str):
        self.path, self.header, self.bodies = path, header, {}

    def update(self, section: str, body: str) -> None:
        self.bodies[section] = body
        self.write()

    def text(self, footer: str = "") -> str:
        parts = [self.header, *(f"## {name}\n\n{body}" for name, body in self.bodies.items())]
        return "\n\n".join(parts + ([footer] if footer else [])) + "\n"

    def write(self, footer: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(self.path), self.text(footer))


class Deadline(Exception):
    """Raised in a row still running GRACE_S past its section's deadline."""


@dataclass
class Clock:
    """A section's deadline (time.monotonic()); `spent()` before a row, `limit()` around one."""
    deadline: float

    def spent(self) -> bool:
        return time.monotonic() > self.deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def limit(self):
        """Raise Deadline in the block when it runs GRACE_S past the deadline (SIGALRM: the main
        thread only, between Python bytecodes; elsewhere no limit)."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
            yield
            return

        def stop(signum, frame):
            raise Deadline(f"stopped {GRACE_S:.0f} s past the section's deadline")

        previous = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.0) + GRACE_S)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


SKIPPED = "skipped: the section's time budget is spent"


def fresh_compile() -> None:
    """Forget every graph dynamo has made (and the shapes it saw): a compile after another one
    would otherwise trace dynamic shapes for what changed between them."""
    import torch._dynamo

    torch._dynamo.reset()


# ---- device plumbing: every CUDA-specific line is here -------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on `device`: inputs are drawn where they are used."""
    return torch.Generator(device=device).manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0,
          grad: bool = False) -> torch.Tensor:
    """N(0, scale^2) of `shape` drawn on the generator's device, in `dtype`."""
    x = torch.randn(*shape, generator=gen, device=gen.device)
    return (x * scale if scale != 1.0 else x).to(dtype).requires_grad_(grad)


def elapsed_ms(fn, device: torch.device, repeats: int) -> float:
    """Median over `repeats` calls of fn() (after one untimed call): CUDA events on a GPU."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn, device: torch.device) -> float | None:
    """Peak memory allocated while fn() runs, above what was allocated before (None off CUDA)."""
    if device.type != "cuda":
        fn()
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def clean_device(device: torch.device) -> None:
    """Free what the last run left and start the peak-memory count again."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

# ---- checks ---------------------------------------------------------------------------------------
def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item() if want.numel() else 0.0


def errors_text(errs: list[float]) -> str:
    return "[" + ", ".join(f"{e:.2g}" for e in errs) + "]"


def forward_backward(fn, inputs: list[torch.Tensor], seed: int = 0, nodes: list | None = None) -> list[torch.Tensor]:
    """fn(*inputs)'s outputs, then the gradient of every floating input that requires one, for
    fixed random cotangents (the same for both sides of a comparison); the outputs' autograd
    node names are appended to `nodes` when given."""
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = fn(*xs)
    outs = list(out) if isinstance(out, tuple) else [out]
    if nodes is not None:
        nodes += [type(o.grad_fn).__name__ for o in outs]
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, cots)
    return [o.detach() for o in outs] + [x.grad for x in xs if x.requires_grad]


def compare(triton_fn, reference_fn, inputs: list[torch.Tensor], dtype: torch.dtype, node: str | None = None) -> str:
    """Raise when any output or gradient of the Triton side is off the reference by more than
    BOUND[dtype], or when `node` (the Triton autograd Function's name) made none of its outputs
    (the op took its reference instead); else the worst error, as the PASS line's detail."""
    nodes: list[str] = []
    with kernels("triton"):
        got = forward_backward(triton_fn, inputs, nodes=nodes)
    if node is not None and not any(n.startswith(node) for n in nodes):
        raise AssertionError(f"the Triton side did not run: the outputs come from {nodes}, not {node}")
    with kernels("torch"):
        want = forward_backward(reference_fn, inputs)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    if len(got) != len(want) or max(errs) > BOUND[dtype]:
        raise AssertionError(f"errors {errors_text(errs)} (outputs, then gradients) exceed "
                             f"{BOUND[dtype]:g}")
    return f"worst {max(errs):.2g} <= {BOUND[dtype]:g} over {len(got)} tensors"


def kernel_checks(sz: Sizes, device: torch.device, dtypes) -> list[tuple[str, Any]]:
    """(name, thunk) for every kernel check; each thunk returns its PASS detail or raises."""
    n, d, v = sz.check_tokens, sz.check_dim, sz.check_vocab
    gen = generator(device, 0)

    def t(*shape, dtype, scale=1.0):
        return randn(gen, *shape, dtype=dtype, scale=scale, grad=True)

    out: list[tuple[str, Any]] = []
    for dt in dtypes:
        name = str(dt).replace("torch.", "")
        x, r, w, b = t(n, d, dtype=dt), t(n, d, dtype=dt), t(d, dtype=dt), t(d, dtype=dt)
        out += [
            (f"rms_norm {name}", lambda x=x, w=w, dt=dt: compare(rms_norm, rms_norm_reference, [x, w], dt, "_NormFn")),
            (f"rms_norm + residual {name}", lambda x=x, w=w, r=r, dt=dt: compare(
                lambda a, c, e: rms_norm(a, c, 1e-6, e), lambda a, c, e: rms_norm_reference(a, c, 1e-6, e),
                [x, w, r], dt, "_NormFn")),
            (f"layer_norm {name}", lambda x=x, w=w, b=b, dt=dt: compare(layer_norm, layer_norm_reference,
                                                                         [x, w, b], dt, "_NormFn")),
            (f"layer_norm + residual {name}", lambda x=x, w=w, b=b, r=r, dt=dt: compare(
                lambda a, c, e, f: layer_norm(a, c, e, 1e-5, f),
                lambda a, c, e, f: layer_norm_reference(a, c, e, 1e-5, f), [x, w, b, r], dt, "_NormFn")),
            (f"swiglu {name}", lambda x=x, r=r, dt=dt: compare(swiglu, swiglu_reference, [x, r], dt, "_GLU")),
            (f"geglu {name}", lambda x=x, r=r, dt=dt: compare(geglu, geglu_reference, [x, r], dt, "_GLU")),
        ]
        seq, hd = max(n // 4, 1), 2 * (d // 64) + 2  # an awkward head_dim (130 at d=4096: no power of two)
        q, k = t(2, 4, seq, hd, dtype=dt), t(2, 2, seq, hd, dtype=dt)
        cos, sin = (tab.to(device, dt) for tab in rotary_cos_sin(seq, hd, 10000.0))
        out.append((f"apply_rotary {name}", lambda q=q, k=k, cos=cos, sin=sin, dt=dt: compare(
            lambda a, c: apply_rotary(a, c, cos, sin), lambda a, c: apply_rotary_reference(a, c, cos, sin),
            [q, k], dt, "_Rotary")))
        h, head = t(n, d, dtype=dt, scale=0.5), t(v, d, dtype=dt, scale=0.05)
        labels = torch.randint(0, v, (n,), generator=gen, device=device)
        labels[::7] = -100  # some ignored tokens
        out.append((f"linear_cross_entropy {name}", lambda h=h, head=head, labels=labels, dt=dt: compare(
            lambda a, c: linear_cross_entropy(a, c, labels), lambda a, c: linear_cross_entropy_eager(a, c, labels),
            [h, head], dt)))
        out.append((f"moe triton gemm {name}", lambda dt=dt: gemm_check(sz, device, dt)))
    out.append(("fused adamw float32", lambda: adamw_check(sz, device)))
    return out


def adamw_pieces(n: int, device: torch.device, piece: int = 1 << 16) -> list[torch.Tensor]:
    """An n-element fp32 master shard as pieces of `piece` elements (views of one buffer, as
    ZeroOptimizer's), each with its part of one flat gradient as .grad."""
    gen = generator(device, 0)
    flat, grad = (randn(gen, n) for _ in range(2))
    pieces = list(flat.split(piece))
    for p, g in zip(pieces, grad.split(piece)):
        p.grad = g
    return pieces


def adamw_check(sz: Sizes, device: torch.device) -> str:
    """FusedAdamW (Triton) against torch.optim.AdamW: 3 steps of a 3 x check_tokens x check_dim
    shard in 5 pieces (not a multiple of the block), then a step with the overflow flag set writes nothing."""
    n = 3 * sz.check_tokens * sz.check_dim + 5
    ours, theirs = adamw_pieces(n, device, n // 5 + 1), adamw_pieces(n, device, n // 5 + 1)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    with kernels("triton"):
        for _ in range(3):
            opt.step()
            ref.step()
        errs = [rel_err(torch.cat(ours), torch.cat(theirs))]
        errs += [rel_err(torch.cat([opt.state[p][k].view(-1) for p in ours]),
                         torch.cat([ref.state[p][k].view(-1) for p in theirs])) for k in ("exp_avg", "exp_avg_sq")]
        before = torch.cat(ours)
        opt.step(found_inf=torch.ones((), device=device))
    if max(errs) > BOUND[torch.float32] or not torch.equal(before, torch.cat(ours)):
        raise AssertionError(f"errors {errors_text(errs)} (weights, moments) exceed {BOUND[torch.float32]:g}, "
                             "or the step with found_inf set changed the weights")
    return f"{n} elements, 3 steps: worst {max(errs):.2g} <= {BOUND[torch.float32]:g}; found_inf skipped"


def gemm_check(sz: Sizes, device: torch.device, dtype: torch.dtype) -> str:
    from pipekit.moe import GEMMS
    from pipekit.moe.grouped import loop_mm

    if "triton" not in GEMMS:
        raise Skip("pipekit.moe.GEMMS has no 'triton' gemm (yet)")
    x, w, sizes_ = gemm_operands(sz.check_tokens, sz.experts, sz.check_dim // 4, sz.check_dim // 2, device, dtype)
    return compare(lambda a, c: GEMMS["triton"](a, c, sizes_), lambda a, c: loop_mm(a, c, sizes_), [x, w], dtype)


def gemm_operands(rows: int, experts: int, i: int, o: int, device, dtype):
    """x (rows, i), w (experts, i, o) and group sizes summing to rows, the first two groups empty."""
    cuts = torch.sort(torch.randint(0, rows + 1, (experts - 3,), generator=torch.Generator().manual_seed(1)))
    sizes_ = [0, 0] + [b - a for a, b in zip([0, *cuts.values.tolist()], [*cuts.values.tolist(), rows])]
    gen = generator(device, 1)
    return randn(gen, rows, i, dtype=dtype, grad=True), randn(gen, experts, i, o, dtype=dtype, scale=i**-0.5,
                                                              grad=True), sizes_


class Skip(Exception):
    """A check that does not apply here (reported SKIP, not FAIL)."""


def grouped_mm_check(sz: Sizes, device: torch.device, dtype: torch.dtype) -> str:
    from pipekit.moe.grouped import _REFUSED, grouped_mm_runs, loop_mm, torch_grouped_mm

    x, w, sizes_ = gemm_operands(sz.check_tokens, sz.experts, sz.check_dim // 4, sz.check_dim // 2, device, dtype)
    if not grouped_mm_runs(x, w):
        raise Skip(f"torch._grouped_mm does not run on {device.type} {dtype} here")
    got = forward_backward(lambda a, c: torch_grouped_mm(a, c, sizes_), [x, w])
    if (device.type, dtype) in _REFUSED:  # torch_grouped_mm fell back to the loop: nothing was compared
        raise AssertionError(f"torch._grouped_mm raised on {device.type} {dtype}; the loop ran in its place")
    want = forward_backward(lambda a, c: loop_mm(a, c, sizes_), [x, w])
    errs = [rel_err(g, e) for g, e in zip(got, want)]
    if max(errs) > BOUND[dtype]:
        raise AssertionError(f"errors {errors_text(errs)} exceed {BOUND[dtype]:g}")
    return f"worst {max(errs):.2g} <= {BOUND[dtype]:g} (output, dx, dw)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_check(device: torch.device) -> str:
    """init_distributed over nccl (gloo off CUDA) at world size 1, one engine step on the device."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        pipekit.init_distributed(backend=backend)
        if dist.get_backend() != backend:
            raise AssertionError(f"the group's backend is {dist.get_backend()}, not {backend}")
        one = torch.ones(1, device=device)
        dist.all_reduce(one)  # a collective really goes through the backend
        if one.item() != 1.0:
            raise AssertionError(f"all_reduce over one rank gave {one.item()}, not 1")
        loss = tiny_engine_losses(device, "fp32", None, steps=1)[0]
        return f"{backend}, world size {dist.get_world_size()}: one step, loss {loss:.4f}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(key, None)


def tiny_engine_losses(device: torch.device, precision: str, scaler, steps: int) -> list[float]:
    from pipekit.optim import ZeroOptimizer

    cfg = get_model("gpt2", "tiny", n_layers=2, dim=64, vocab_size=128, max_seq_len=32)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=0, precision=precision,
                                    microbatches=2, topology=pipekit.Topology(pp=1, dp=1, device=device.type))
    opt = ZeroOptimizer(module, "adamw", stage=0, lr=3e-3, loss_scaler=scaler)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    ids = torch.randint(0, cfg.vocab_size, (4, 33), generator=generator(device, 0), device=device)
    return [engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]), reduce_loss=True) for _ in range(steps)]


def fp16_check(device: torch.device) -> str:
    """fp16 weights with ZeroOptimizer + LossScaler: the loss stays finite and falls, the scale moves as DeepSpeed's."""
    from pipekit.optim import LossScaler

    scaler = LossScaler(initial_scale_power=16)
    losses = tiny_engine_losses(device, "fp16", scaler, steps=8)
    if not all(abs(x) < float("inf") for x in losses) or not losses[-1] < losses[0]:  # NaN fails both
        raise AssertionError(f"fp16 losses {errors_text(losses)} are not finite and falling")
    return (f"8 steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, scale 2^16 -> {scaler.scale:g}, "
            f"{scaler.skipped_steps} skipped")


def overlap_check(device: torch.device, steps: int) -> str:
    """schedule overlap (forwards on side streams beside backwards, `pipekit.comm.Lanes`) against no
    overlap: a Mixtral-style model, 1F1B at pp=1 over 4 microbatches, fp32, the same losses; the
    median step of each. One card, so ep=1: the all-to-all hidden behind compute needs two."""
    from pipekit.schedules import build_schedule

    cfg = get_model("mixtral", "tiny", n_layers=2, dim=128, hidden=256, n_heads=4, n_kv_heads=2, vocab_size=256,
                    max_seq_len=64, n_experts=8, top_k=2)
    ids = torch.randint(0, cfg.vocab_size, (8, 65), generator=generator(device, 0), device=device)
    batch = (ids[:, :-1], ids[:, 1:])
    out = {}
    for overlap in (False, True):
        module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=0,
                                        schedule=build_schedule("1f1b", 1, 4, overlap=overlap),
                                        topology=pipekit.Topology(pp=1, dp=1, device=device.type))
        engine = pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
        losses, times = [], []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            losses.append(engine.train_batch(batch, reduce_loss=True))
            times.append(time.perf_counter() - t0)
        out[overlap] = (losses, 1e3 * statistics.median(times[1:] or times))
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(out[True][0], out[False][0]))
    if diff > BOUND[torch.float32]:
        raise AssertionError(f"losses with overlap {errors_text(out[True][0])} differ from without "
                             f"{errors_text(out[False][0])} by {diff:.2g}")
    return (f"{steps} steps, losses agree to {diff:.2g}; median step {out[False][1]:.1f} ms without, "
            f"{out[True][1]:.1f} ms with overlap ({out[True][1] / out[False][1]:.2f}x)")


def compile_check(device: torch.device, backend: str) -> str:
    """torch.compile of one Llama block against the same block eager, forward and backward, fp32."""
    cfg = get_model("llama", "tiny", n_layers=1, dim=128)
    block = model_specs(cfg)[1].build(seed=0, index=1, device=device)  # embedding, block, norm, head
    fresh_compile()
    compiled = torch.compile(block, backend=backend)
    x = randn(generator(device, 0), 2, 48, cfg.dim, grad=True)
    with kernels("torch"):
        want = forward_backward(lambda a: block(a), [x]) + [p.grad for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        got = forward_backward(lambda a: compiled(a), [x]) + [p.grad for p in block.parameters()]
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    if max(errs) > BOUND[torch.float32]:
        raise AssertionError(f"errors {errors_text(errs)} exceed {BOUND[torch.float32]:g}")
    return f"backend {backend}: worst {max(errs):.2g} <= {BOUND[torch.float32]:g} over {len(got)} tensors"


def run_check(name: str, thunk, clock: Clock) -> dict:
    t0 = time.perf_counter()
    if clock.spent():
        return {"check": name, "status": "SKIP", "detail": SKIPPED, "s": 0.0}
    try:
        with clock.limit():
            detail, status = thunk(), "PASS"
    except Skip as e:
        detail, status = str(e), "SKIP"
    except Exception as e:  # noqa: BLE001 -- a failing check is reported, never stops the suite
        last = traceback.extract_tb(e.__traceback__)[-1]
        detail, status = f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})", "FAIL"
    finally:
        gc.collect()
    row = {"check": name, "status": status, "detail": " ".join(str(detail).split())[:600],
           "s": time.perf_counter() - t0}
    print(f"  {status} {name} ({row['s']:.1f} s)", file=sys.stderr)
    return row


def section_checks(sz: Sizes, device: torch.device, smoke: bool, report: Report, clock: Clock) -> None:
    dtypes = (torch.float32,) if smoke else (torch.bfloat16, torch.float32)
    checks = kernel_checks(sz, device, dtypes) if triton_available() else []
    if not triton_available():
        checks.append(("kernels", lambda: (_ for _ in ()).throw(Skip("triton is not installed"))))
    checks += [
        ("NCCL path at world size 1", lambda: nccl_check(device)),
        ("torch._grouped_mm vs the loop gemm " + ("fp32" if smoke else "bf16"),
         lambda: grouped_mm_check(sz, device, torch.float32 if smoke else torch.bfloat16)),
        ("fp16 + ZeroOptimizer + LossScaler", lambda: fp16_check(device)),
        ("torch.compile of a Llama block", lambda: compile_check(device, "eager" if smoke else "inductor")),
        ("schedule.overlap on side streams vs off (MoE, 1F1B)", lambda: overlap_check(device, 2 if smoke else 6)),
    ]
    lines = [f"Error: max |got - want| / max |want| per output and gradient; bounds {BOUND[torch.float32]:g} in "
             f"fp32, {BOUND[torch.bfloat16]:g} in bf16/fp16. Kernel checks at {sz.check_tokens} tokens, "
             f"d={sz.check_dim}, vocab {sz.check_vocab}.", "",
             "| check | result | detail | s |", "|---|---|---|---:|"]
    rows = []
    for name, thunk in checks:
        r = run_check(name, thunk, clock)
        rows.append(r)
        lines.append(f"| {r['check']} | {r['status']} | {r['detail'].replace('|', '/')} | {r['s']:.1f} |")
        report.update("checks", "\n".join(lines))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    report.update("checks", "\n".join(lines + ["", ", ".join(f"{v} {k}" for k, v in counts.items())]))


# ---- end to end -------------------------------------------------------------------------------------
def plain_model(cfg, device: torch.device) -> nn.Sequential:
    """The model's layers as one nn.Sequential, each built on `device` (seeded as pipekit seeds
    them), tied layers sharing one module: ids (B, T) -> logits (B, T, V)."""
    return reference_model(model_specs(cfg), SEED, device=device)


def plain_run(cfg, mode: str, batch, args, device: torch.device) -> dict:
    """What a user writes (nanoGPT's loop): the model, F.cross_entropy on its logits, gradient
    accumulation over the microbatches, AdamW (fused on CUDA); bf16 = torch.autocast (fp32
    weights); "+compile" = torch.compile of the whole model."""
    model = plain_model(cfg, device)
    if mode.endswith("+compile"):
        fresh_compile()
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode.startswith("bf16"))
    xs, ys = (t.chunk(args.microbatches) for t in batch)

    def step() -> float:
        total = torch.zeros((), device=device)
        for x, y in zip(xs, ys):
            with amp:
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / args.microbatches).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item() / args.microbatches

    with kernels("torch"):
        return gt.timed(step, device, args.warmup, args.steps)


def pipekit_run(cfg, mode: str, batch, args, device: torch.device) -> dict:
    """gpu_throughput.pipekit_run, with the kernels mode the row names: "+kernels" runs every
    kernel (kernels="triton", the fused head + loss `fused_loss`, the fused AdamW), the others
    kernels="torch" with the plain head, loss and optimizer."""
    base, on = mode.replace("+kernels", ""), "+kernels" in mode
    if base.endswith("+compile"):
        fresh_compile()
    with kernels("triton" if on else "torch"):
        return gt.pipekit_run(dataclasses.replace(cfg, fused_loss=on), base, batch, args, device, fused_adamw=on)


def measure(run, cfg, mode: str, batch, args, device: torch.device) -> dict:
    """One run in a clean state: its timings, tokens/s, MFU and peak memory."""
    clean_device(device)
    out = run(cfg, mode, batch, args, device)
    tokens = args.microbatches * args.micro_batch * args.seq
    out["tokens_per_s"] = tokens / out["step_s"]
    out["mfu"] = flops_per_token(cfg, args.seq) * out["tokens_per_s"] / gt.PEAK_FLOPS
    out["peak_memory_gib"] = peak_gib(device)
    return out


def e2e_models(sz: Sizes) -> dict:
    if sz.e2e_flavour == "tiny":
        return {"GPT-2 tiny": get_model("gpt2", "tiny", n_layers=2, dim=64, max_seq_len=32),
                "Mixtral-style tiny": get_model("mixtral", "tiny", max_seq_len=32)}
    return {"GPT-2 124M": get_model("gpt2", "124m"),
            # Mixtral-style, ~1B total / ~0.3B active: 8 experts top-2, GQA, Mistral's vocabulary
            "Mixtral-style 8x(1024->3584), 8 layers": get_model(
                "mixtral", "tiny", vocab_size=32000, max_seq_len=1024, n_layers=8, dim=1024, n_heads=16,
                n_kv_heads=4, hidden=3584)}


def e2e_batch(cfg, args, device: torch.device):
    """(ids, labels), drawn on the device."""
    ids = torch.randint(0, cfg.vocab_size, (args.microbatches * args.micro_batch, args.seq + 1),
                        generator=generator(device, 1), device=device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def section_end_to_end(sz: Sizes, device: torch.device, smoke: bool, report: Report, clock: Clock) -> None:
    modes = ["fp32", "fp32+kernels"] if smoke else ["fp32", "bf16", "bf16+compile", "bf16+compile+kernels"]
    args = SimpleNamespace(microbatches=sz.e2e_microbatches, micro_batch=sz.e2e_micro_batch, seq=sz.e2e_seq,
                           warmup=sz.e2e_warmup, steps=sz.e2e_steps)
    tokens = args.microbatches * args.micro_batch * args.seq
    lines = [f"One AdamW step over {args.microbatches} x {args.micro_batch} x {args.seq} = {tokens:,} tokens, median "
             f"of {args.steps} after {args.warmup} warm-up; MFU = flops_per_token x tokens/s / "
             f"{gt.PEAK_FLOPS / 1e12:.0f} TFLOP/s. plain: nanoGPT's loop (F.cross_entropy, fused AdamW, bf16 as "
             "autocast over fp32 weights, torch.compile of the whole model); pipekit: bf16 weights with fp32 "
             "masters, compile per layer; its rows without \"+kernels\" run kernels=\"torch\". pipekit / plain "
             "compares with the plain row of the same mode (\"+kernels\": its mode without them)."
             + (" --cpu-smoke: fp32 only (the interpreter's bf16 is wrong), no compile." if smoke else ""), "",
             "| model | mode | run | tokens/s | pipekit / plain | MFU | peak GiB | final loss |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for model_name, cfg in e2e_models(sz).items():
        batch = e2e_batch(cfg, args, device)
        plain_tps: dict[str, float] = {}
        for mode in modes:
            for run_name, run in (("plain", plain_run), ("pipekit", pipekit_run)):
                if run_name == "plain" and "+kernels" in mode:
                    continue  # its baseline is the plain row of the mode without kernels
                lines.append(e2e_row(model_name, cfg, mode, run_name, run, batch, args, device, clock, plain_tps))
                report.update("end_to_end", "\n".join(lines))
        lines.append(f"| {model_name} | | flops/token | {flops_per_token(cfg, args.seq):,} | | | | |")
        report.update("end_to_end", "\n".join(lines))


def e2e_row(model_name, cfg, mode, run_name, run, batch, args, device, clock: Clock, plain_tps: dict) -> str:
    """One end-to-end row (its table line): measured, or skipped, or the error it raised."""
    head = f"| {model_name} | {mode} | {run_name} |"
    if clock.spent():
        return f"{head} {SKIPPED} | | | | |"
    try:
        with clock.limit():
            r = measure(run, cfg, mode, batch, args, device)
    except Exception as e:  # noqa: BLE001 -- one failing row never stops the suite
        return f"{head} error: {type(e).__name__}: {' '.join(str(e).split())[:200]} | | | | |"
    finally:
        gc.collect()
    base = plain_tps.get(mode.replace("+kernels", ""))
    if run_name == "plain":
        plain_tps[mode] = r["tokens_per_s"]
    ratio = "1.00" if run_name == "plain" else (f"{r['tokens_per_s'] / base:.2f}" if base else "-")
    mfu = f"{r['mfu']:.1%}" if device.type == "cuda" else "-"
    peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
    print(f"  {model_name} {mode} {run_name}: {r['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    return f"{head} {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {peak} | {r['loss']:.4f} |"


# ---- offload ----------------------------------------------------------------------------------------
def offload_run(cfg, kind: str, sz: Sizes, device: torch.device) -> dict:
    """GPT-2 in bf16 at pp=1 through PipelineEngine, ZeroOptimizer(stage=0, offload=kind): the
    median step time after one warm-up step (which makes the AdamW state) and the device's peak
    memory over the whole run (model, state, activations)."""
    from pipekit.optim import ZeroOptimizer

    clean_device(device)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED, precision="bf16",
                                    schedule="1f1b", microbatches=1,
                                    topology=pipekit.Topology(pp=1, dp=1, device=device.type))
    opt = ZeroOptimizer(module, "adamw", stage=0, lr=LR, weight_decay=WEIGHT_DECAY, offload=kind)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    args = SimpleNamespace(microbatches=1, micro_batch=sz.offload_micro_batch, seq=sz.offload_seq)
    batch = e2e_batch(cfg, args, device)
    with kernels("torch"):
        r = gt.timed(lambda: engine.train_batch(iter([batch]), reduce_loss=True), device, 1, sz.offload_steps)
    r["peak_memory_gib"] = peak_gib(device)
    r["params"] = sum(p.numel() for p in module.parameters())
    return r


def section_offload(sz: Sizes, device: torch.device, smoke: bool, report: Report, clock: Clock) -> None:
    cfg = (get_model("gpt2", "tiny", n_layers=2, dim=64, max_seq_len=32) if sz.offload_flavour == "tiny"
           else get_model("gpt2", sz.offload_flavour))
    lines = [f"GPT-2 {sz.offload_flavour} in bf16 (fp32 masters), pp=1, one microbatch of {sz.offload_micro_batch} x "
             f"{sz.offload_seq} tokens, ZeroOptimizer(stage=0) AdamW: offload=\"cpu\" keeps the masters and the "
             "AdamW state on the host and steps there (pinned, asynchronous copies) against offload=\"none\". "
             f"Step: median of {sz.offload_steps} after one warm-up; device peak: max_memory_allocated over the "
             "run. Target (issue 25): cpu <= 1.15x none's step time."
             + (" --cpu-smoke: host and device are one, no memory figures." if smoke else ""), "",
             "| offload | parameters | step ms | step / none | device peak GiB | peak / none | final loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base: dict = {}
    for kind in ("none", "cpu"):
        if clock.spent():
            lines.append(f"| {kind} | {SKIPPED} | | | | | |")
        else:
            try:
                with clock.limit():
                    r = offload_run(cfg, kind, sz, device)
                clean_device(device)  # the run's model and state are gone by now
            except Exception as e:  # noqa: BLE001 -- reported in the row
                lines.append(f"| {kind} | error: {type(e).__name__}: {' '.join(str(e).split())[:200]} | | | | | |")
            else:
                base = base or r
                peak = r["peak_memory_gib"]
                ratio = f"{peak / base['peak_memory_gib']:.2f}" if peak is not None and base["peak_memory_gib"] else "-"
                lines.append(f"| {kind} | {r['params']:,} | {r['step_s'] * 1e3:.1f} | "
                             f"{r['step_s'] / base['step_s']:.2f} | {'-' if peak is None else f'{peak:.2f}'} | "
                             f"{ratio} | {r['loss']:.4f} |")
                print(f"  offload {kind}: {r['step_s'] * 1e3:.1f} ms", file=sys.stderr)
            finally:
                gc.collect()
        report.update("offload", "\n".join(lines))


# ---- fine-tuning ----------------------------------------------------------------------------------------
FINETUNE_TARGETS = r"attn\.(q|k|v|o)$|mlp\.(gate|up|down)$"  # benchmarks/finetune_memory.py's


def finetune_model(name: str):
    if name == "tiny":
        return get_model("llama", "tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=96, vocab_size=131,
                         max_seq_len=32)
    return get_model("llama", "tiny", dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, hidden=5632,
                     vocab_size=32000, max_seq_len=2048)


def finetune_run(cfg, lora: bool, sz: Sizes, device: torch.device) -> dict:
    """Llama in bf16 at pp=1 through PipelineEngine, ZeroOptimizer(stage=0) AdamW over the trained
    parameters (all of them, or LoRA-16's adapters): the median step after one warm-up and the
    device's peak memory over the whole run."""
    from pipekit.layers.lora import add_adapters
    from pipekit.optim import ZeroOptimizer

    clean_device(device)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED, precision="bf16",
                                    schedule="1f1b", microbatches=1,
                                    topology=pipekit.Topology(pp=1, dp=1, device=device.type))
    if lora:
        add_adapters(module, FINETUNE_TARGETS, 16, 32.0, seed=SEED)  # on the weights' device, in their dtype
    opt = ZeroOptimizer(module, "adamw", stage=0, lr=LR, weight_decay=WEIGHT_DECAY)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    args = SimpleNamespace(microbatches=1, micro_batch=sz.finetune_micro_batch, seq=sz.finetune_seq)
    batch = e2e_batch(cfg, args, device)
    with kernels("torch"):
        r = gt.timed(lambda: engine.train_batch(iter([batch]), reduce_loss=True), device, 1, sz.finetune_steps)
    r["peak_memory_gib"] = peak_gib(device)
    r["trained"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    r["params"] = sum(p.numel() for p in module.parameters())
    return r


def section_finetune(sz: Sizes, device: torch.device, smoke: bool, report: Report, clock: Clock) -> None:
    cfg = finetune_model(sz.finetune)
    lines = [f"Llama ({'tiny' if sz.finetune == 'tiny' else '1.1B: dim 2048, 16 layers, 16/8 heads, hidden 5632'}) "
             f"in bf16 (fp32 masters and AdamW state for the trained parameters), pp=1, one microbatch of "
             f"{sz.finetune_micro_batch} x {sz.finetune_seq} tokens: full fine-tuning against LoRA rank 16 on "
             "q, k, v, o, gate, up, down (every other weight frozen). Step: median of "
             f"{sz.finetune_steps} after one warm-up; device peak: max_memory_allocated over the run."
             + (" --cpu-smoke: no memory figures." if smoke else ""), "",
             "| run | trained / all parameters | step ms | step / full | device peak GiB | peak / full | final loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base: dict = {}
    for name, lora in (("full", False), ("LoRA-16", True)):
        if clock.spent():
            lines.append(f"| {name} | {SKIPPED} | | | | | |")
        else:
            try:
                with clock.limit():
                    r = finetune_run(cfg, lora, sz, device)
                clean_device(device)
            except Exception as e:  # noqa: BLE001 -- reported in the row
                lines.append(f"| {name} | error: {type(e).__name__}: {' '.join(str(e).split())[:200]} | | | | | |")
            else:
                base = base or r
                peak = r["peak_memory_gib"]
                ratio = f"{peak / base['peak_memory_gib']:.2f}" if peak is not None and base["peak_memory_gib"] else "-"
                lines.append(f"| {name} | {r['trained']:,} / {r['params']:,} | {r['step_s'] * 1e3:.1f} | "
                             f"{r['step_s'] / base['step_s']:.2f} | {'-' if peak is None else f'{peak:.2f}'} | "
                             f"{ratio} | {r['loss']:.4f} |")
                print(f"  finetune {name}: {r['step_s'] * 1e3:.1f} ms", file=sys.stderr)
            finally:
                gc.collect()
        report.update("finetune", "\n".join(lines))


# ---- kernels: time and memory ----------------------------------------------------------------------
def liger_functional():
    """liger_kernel.transformers.functional when it imports (and CUDA is here: Liger is CUDA-only), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from liger_kernel.transformers import functional
    except Exception:  # noqa: BLE001 -- absent or broken: the column says so
        return None
    return functional


def bench_cases(sz: Sizes, device: torch.device, dtype: torch.dtype, lf) -> list[tuple]:
    """(name, pipekit op, its reference, Liger's op or None, inputs) at the suite's sizes; `lf`:
    liger_kernel.transformers.functional, or None. Inputs are drawn on the device."""
    gen = generator(device, 0)
    n, d = sz.tokens, sz.dim

    def t(*shape, scale=1.0):
        return randn(gen, *shape, dtype=dtype, scale=scale, grad=True)

    hd = d // sz.heads
    seq = n // 2  # two sequences
    cos, sin = (tab.to(device, dtype) for tab in rotary_cos_sin(seq, hd, 500000.0))
    labels = torch.randint(0, sz.vocab, (n,), generator=gen, device=device)
    lig = lf is not None
    cases: list[tuple] = [
        ("rms_norm", rms_norm, rms_norm_reference, lig and (lambda x, w: lf.liger_rms_norm(x, w, 1e-6)),
         [t(n, d), t(d)]),
        ("layer_norm", layer_norm, layer_norm_reference, lig and (lambda x, w, b: lf.liger_layer_norm(x, w, b, 1e-5)),
         [t(n, d), t(d), t(d)]),
        ("apply_rotary", lambda q, k: apply_rotary(q, k, cos, sin), lambda q, k: apply_rotary_reference(q, k, cos, sin),
         lig and (lambda q, k: lf.liger_rope(q, k, cos[None], sin[None])),
         [t(2, sz.heads, seq, hd), t(2, sz.kv_heads, seq, hd)]),
        ("swiglu", swiglu, swiglu_reference, lig and lf.liger_swiglu, [t(n, sz.hidden), t(n, sz.hidden)]),
        ("geglu", geglu, geglu_reference, lig and lf.liger_geglu, [t(n, sz.hidden), t(n, sz.hidden)]),
        ("linear_cross_entropy", lambda h, w: linear_cross_entropy(h, w, labels),
         lambda h, w: linear_cross_entropy_eager(h, w, labels),
         lig and (lambda h, w: lf.liger_fused_linear_cross_entropy(h, w, labels)),
         [t(n, d, scale=0.5), t(sz.vocab, d, scale=0.02)]),
    ]
    from pipekit.moe import GEMMS
    from pipekit.moe.grouped import loop_mm

    if "triton" in GEMMS:
        x, w, sizes_ = gemm_operands(n * sz.top_k, sz.experts, d, sz.expert_hidden, device, dtype)
        cases.append((f"moe gemm ({sz.experts} experts, top-{sz.top_k})", lambda a, c: GEMMS["triton"](a, c, sizes_),
                      lambda a, c: loop_mm(a, c, sizes_), None, [x, w]))
    return cases


def fwd_bwd(fn, inputs: list[torch.Tensor]):
    """One forward + backward of fn(*inputs); the gradients are dropped after it, so that a
    step's peak memory is measured above the inputs alone."""
    def step():
        out = fn(*inputs)
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.backward([o.float().sum() for o in outs])
        for x in inputs:
            x.grad = None
    return step


def time_cell(mode: str, fn, inputs, sz: Sizes, device: torch.device, clock: Clock) -> tuple[str, float | None]:
    """(the table cell, the peak MiB or None) of one implementation of one kernel."""
    if clock.spent():
        return SKIPPED, None
    try:
        with clock.limit(), kernels(mode):
            step = fwd_bwd(fn, inputs)
            ms = elapsed_ms(step, device, sz.repeats)
            mib = peak_mib(step, device)
        return f"{ms:.3f} ms" + (f", {mib:,.0f} MiB" if mib is not None else ""), mib
    except Exception as e:  # noqa: BLE001 -- reported in the cell
        return f"error: {type(e).__name__}: {' '.join(str(e).split())[:120]}", None
    finally:
        gc.collect()


KERNEL_COLUMNS = ["pipekit triton", "torch eager", "torch.compile", "liger"]


def section_kernels(sz: Sizes, device: torch.device, smoke: bool, backend: str, report: Report,
                    clock: Clock) -> None:
    """The kernels' table, then the AdamW one. Every implementation but torch.compile first, over
    all kernels; then the torch.compile column (each kernel compiled afresh: the slow part)."""
    dtype = torch.float32 if smoke else torch.bfloat16
    lf = liger_functional()
    cases = bench_cases(sz, device, dtype, lf)
    rows = [{"kernel": name, "liger": "not installed" if lf is None else "-"} for name, *_ in cases]
    peaks: dict[tuple[str, str], float | None] = {}
    head = [f"Forward + backward (sum of the outputs), {str(dtype).replace('torch.', '')}, median of {sz.repeats} "
            f"after one warm-up; peak: max_memory_allocated above the inputs. {sz.tokens} tokens, d={sz.dim}, "
            f"hidden {sz.hidden}, {sz.heads}/{sz.kv_heads} heads, vocab {sz.vocab:,}, "
            f"gemm {sz.experts} experts top-{sz.top_k} ({sz.dim} -> {sz.expert_hidden}); "
            f"torch.compile backend {backend}, timed after every other column.", "",
            "| kernel | " + " | ".join(KERNEL_COLUMNS) + " |", "|---|" + "---|" * len(KERNEL_COLUMNS)]

    def show(tail: tuple[str, ...] = ()) -> None:
        table = [f"| {r['kernel']} | " + " | ".join(r.get(c, "-").replace("|", "/") for c in KERNEL_COLUMNS) + " |"
                 for r in rows]
        report.update("kernels", "\n".join(head + table + ["", fused_ce_ratio(peaks), *tail]))

    for row, (name, op, ref, liger, inputs) in zip(rows, cases):
        impls = {"pipekit triton": ("triton", op), "torch eager": ("torch", ref)}
        if liger:
            impls["liger"] = ("torch", liger)
        for label, (mode, fn) in impls.items():
            row[label], peaks[name, label] = time_cell(mode, fn, inputs, sz, device, clock)
        print(f"  timed {name}", file=sys.stderr)
        show()
    adamw = adamw_table(sz, device, clock)
    show(("", adamw))
    for row, (_, _, ref, _, inputs) in zip(rows, cases):
        if not clock.spent():
            fresh_compile()
        row["torch.compile"], _ = time_cell("torch", torch.compile(ref, backend=backend, dynamic=False), inputs,
                                            sz, device, clock)
        show(("", adamw))


def fused_ce_ratio(peaks: dict) -> str:
    """The line under the kernels' table: the fused linear cross-entropy's peak over eager's."""
    ours, eager = peaks.get(("linear_cross_entropy", "pipekit triton")), peaks.get(("linear_cross_entropy",
                                                                                   "torch eager"))
    if ours is None or not eager:
        return "linear_cross_entropy peak memory, pipekit / torch eager: - (no memory figures here)"
    return (f"linear_cross_entropy peak memory, pipekit / torch eager: {ours / eager:.3f} "
            f"(target <= 0.25): {ours:,.0f} / {eager:,.0f} MiB")


def adamw_table(sz: Sizes, device: torch.device, clock: Clock) -> str:
    """One AdamW step of a dim x hidden fp32 master shard in 64k-element pieces: FusedAdamW
    (Triton, one launch) against torch.optim.AdamW's foreach and fused implementations."""
    n = sz.dim * sz.hidden
    impls = {"pipekit triton": ("triton", FusedAdamW),
             "torch foreach": ("torch", lambda ps, **kw: torch.optim.AdamW(ps, foreach=True, **kw)),
             "torch fused": ("torch", lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw))}
    row = {"kernel": "adamw"}
    for label, (mode, make) in impls.items():
        if clock.spent():
            row[label] = SKIPPED
            continue
        try:
            with clock.limit():
                pieces = adamw_pieces(n, device)
                opt = make(pieces, lr=1e-3, weight_decay=0.1)
                with kernels(mode):
                    ms = elapsed_ms(opt.step, device, sz.repeats)
                    mib = peak_mib(opt.step, device)
            row[label] = f"{ms:.3f} ms" + (f", {mib:,.0f} MiB" if mib is not None else "")
        except Exception as e:  # noqa: BLE001 -- reported in the cell
            row[label] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
        gc.collect()
    print("  timed adamw", file=sys.stderr)
    cols = list(impls)
    return "\n".join([f"One optimizer step of {n:,} fp32 master weights (d x hidden) in 64k-element pieces, median "
                      f"of {sz.repeats}; peak: max_memory_allocated above the state.", "",
                      "| kernel | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols),
                      "| adamw | " + " | ".join(row[c].replace("|", "/") for c in cols) + " |"])


# ---- the command ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the report (default {DEFAULT_OUT})")
    p.add_argument("--only", choices=SECTIONS, action="append", help="run only this section (repeatable)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="every code path at tiny sizes on the CPU (Triton interpreter, fp32); numbers mean nothing")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="the sections' deadlines, as shares of this many seconds (default 420: the whole suite "
                        "then ends within ~8 minutes on an H200)")
    p.add_argument("--offload-flavour", choices=("124m", "355m", "774m", "1.5b"), default=None,
                   help="the GPT-2 of the offload rows (default 1.5b; --quick 774m)")
    return p.parse_args(argv)


def section_clocks(sections: list[str], started: float, budget: float) -> dict[str, float]:
    """Each section's deadline: the end of its share, the shares of the sections run laid end to end
    over `budget` (a section that ends early leaves its time to the next)."""
    total = sum(SHARES[s] for s in sections)
    ends, at = {}, started
    for s in sections:
        at += budget * SHARES[s] / total
        ends[s] = at
    return ends


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device is visible; this suite needs one (or run --cpu-smoke to exercise it on CPU)")
        return 2
    started = time.monotonic()
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", torch.cuda.current_device())
    sz, backend = sizes(args), ("eager" if args.cpu_smoke else "inductor")
    info = gt.machine(device)
    command = " ".join(["python", "benchmarks/gpu_suite.py", *(sys.argv[1:] if argv is None else argv)])
    smoke = ". **--cpu-smoke: tiny sizes on the CPU, the numbers mean nothing.**" if args.cpu_smoke else "."
    report = Report(args.out, f"# pipekit GPU suite\n\n`{command}`"
                    f" on {info['device']}, torch {info['torch']}, commit {info.get('commit', '?')}"
                    + (" (pipekit has uncommitted changes)" if info.get("pipekit_dirty") else "") + smoke)
    report.write()
    sections = [s for s in SECTIONS if s in (args.only or SECTIONS)]
    ends = section_clocks(sections, started, args.budget_s)
    for section in sections:
        t0, clock = time.monotonic(), Clock(ends[section])
        print(f"{section} ...", file=sys.stderr)
        try:
            if section == "checks":
                section_checks(sz, device, args.cpu_smoke, report, clock)
            elif section == "end_to_end":
                section_end_to_end(sz, device, args.cpu_smoke, report, clock)
            elif section == "offload":
                section_offload(sz, device, args.cpu_smoke, report, clock)
            elif section == "finetune":
                section_finetune(sz, device, args.cpu_smoke, report, clock)
            else:
                section_kernels(sz, device, args.cpu_smoke, backend, report, clock)
        except Exception:  # noqa: BLE001 -- a broken section is reported, the others still run
            report.bodies[section] = (report.bodies.get(section, "") + "\n\nFAIL: the section stopped:\n\n```\n"
                                      + traceback.format_exc()[-3000:] + "```")
        report.update(section, f"{report.bodies.get(section, '')}\n\n({time.monotonic() - t0:.0f} s)")
    footer = f"Total {time.monotonic() - started:.0f} s."
    report.write(footer)
    print(report.text(footer))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
