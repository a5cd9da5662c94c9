"""Grouped matrix products over variable-size groups: the seam where kernels plug in.

A gemm is a function `fn(x_NI, w_EIO, sizes) -> y_NO`: the rows of `x` come
sorted by expert, `sizes[e]` of them for expert e (zeros allowed, summing to
N), and rows of group e are multiplied by `w[e]`. `sizes` is an int64 tensor
on x's device when the counts are data (dropless dispatch: they never leave
the device) or a list of Python ints known from the shapes (capacity mode);
a gemm that needs them on the host calls `host_sizes` (a named host sync, one
per tensor however many gemms read it).
Autograd must flow to `x` and `w`. It computes only (no communication; moving
rows between ranks is the dispatcher's job, dispatch.py). `MoEMLP(gemm=name)`
picks one from `GEMMS`; register new ones with `register_gemm`.

  loop        a Python loop of `x[a:b] @ w[e]` over contiguous slices; any
              device and dtype (float64 included). Empty groups still enter
              the graph, so `w` always gets a gradient and every rank's
              backward reaches its collectives. Reads device sizes on the
              host (one sync per layer call).
  grouped_mm  `torch._grouped_mm` (one call for all groups): CUDA in bf16 in
              practice; torch 2.13 also runs it on CPU in float32/bf16. It
              needs rows of x and w[e] whose byte lengths are multiples of 16
              (else, and for float64, the loop runs). Under torch.compile it
              runs in bf16 only (its meta function, which tracing runs, takes
              nothing else): a compiled float32/float16 call takes the loop. A
              (device, dtype) where its forward raises is remembered and the
              loop runs from then on; a refusal in its backward is not caught.
              Offsets computed on the device: no host sync.
  megablocks  `grouped_gemm.ops.gmm` through megablocks (CUDA, bf16); only
              when asked for by name, never required; on a CPU tensor it runs
              the loop. Not exercised by pipekit's tests (no CUDA there). Its
              `gmm` takes the sizes on the host: one sync per layer call.
  triton      pipekit/kernels/grouped_gemm.py: Triton programs for the forward, the
              input and the weight gradient, group offsets kept on the device; by
              `use_triton` (CUDA in fp32/fp16/bf16, or kernels='triton' under
              TRITON_INTERPRET=1), else the loop (float64, CPU in "auto"). Also takes
              `sizes` as an int tensor on x's device.
  auto        triton when kernels are forced to "triton" (`model.kernels=triton`,
              PIPEKIT_KERNELS; float64 excepted), else grouped_mm where it runs,
              else loop. In kernels "auto" it never picks triton.

Autocast covers neither `torch._grouped_mm` nor a Triton gemm, so under autocast
(on x's device) grouped_mm and triton first cast x and w to autocast's dtype, as
autocast does for a matmul (float64 stays float64); the loop's matmuls are
autocast's own.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

from ..kernels.dispatch import kernels_mode, use_triton
from ..kernels.grouped_gemm import Sizes, autocast_operands, grouped_gemm, grouped_gemm_reference, host_sizes

GroupedMM = Callable[[torch.Tensor, torch.Tensor, Sizes], torch.Tensor]


loop_mm = grouped_gemm_reference  # the gemm "loop", and the Triton gemm's reference


def sizes_on(sizes: Sizes, device: torch.device) -> torch.Tensor:
    """`sizes` as an int64 tensor on `device`, without a host sync once warm: a tensor is
    moved (already there in practice); a list is copied once per distinct list and device
    (a blocking copy, which on a GPU waits for its queue) and cached: capacity mode's sizes
    are the same list every call."""
    if isinstance(sizes, torch.Tensor):
        return sizes.to(device)
    return _list_on(tuple(int(s) for s in sizes), device)


@functools.lru_cache(maxsize=16)
def _list_on(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).to(device)


def group_of_rows(sizes: Sizes, rows: int, device: torch.device) -> torch.Tensor:
    """(rows,) int64, the group of each row (`sizes[e]` rows of group e in turn), on `device`; no host sync."""
    sizes_E = sizes_on(sizes, device)
    groups_E = torch.arange(sizes_E.numel(), device=device)
    return torch.repeat_interleave(groups_E, sizes_E, output_size=rows)


_REFUSED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) where _grouped_mm raised


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` may run on these operands (dtype, 16-byte alignment, no earlier
    refusal; under torch.compile bf16 only, the one dtype its meta function takes)."""
    if not hasattr(torch, "_grouped_mm") or (x.device.type, x.dtype) in _REFUSED or x.dtype != w.dtype:
        return False
    if x.dtype not in ((torch.bfloat16,) if torch.compiler.is_compiling() else GROUPED_MM_DTYPES):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[-1]))


GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what it may run in eagerly


def torch_grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    x_NI, w_EIO = autocast_operands(x_NI, w_EIO)
    if not grouped_mm_runs(x_NI, w_EIO):
        return loop_mm(x_NI, w_EIO, sizes)
    offs = sizes_on(sizes, x_NI.device).cumsum(0, dtype=torch.int32)
    try:
        return _ContiguousGrad.apply(torch._grouped_mm(x_NI.contiguous(), w_EIO.contiguous(), offs=offs))
    except RuntimeError:  # this (device, dtype) is not supported by this build: loop from now on
        _REFUSED.add((x_NI.device.type, x_NI.dtype))
        return loop_mm(x_NI, w_EIO, sizes)


class _ContiguousGrad(torch.autograd.Function):
    """Identity; makes the incoming gradient contiguous (_grouped_mm's backward rejects an
    expanded one, such as the gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def megablocks_available() -> bool:
    return importlib.util.find_spec("megablocks") is not None


def megablocks_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    if x_NI.device.type != "cuda":
        return loop_mm(x_NI, w_EIO, sizes)
    from megablocks import grouped_gemm_util as gg  # noqa: PLC0415 - optional, CUDA only

    if not gg.grouped_gemm_is_available():
        raise RuntimeError("gemm='megablocks' needs the grouped_gemm package (pip install grouped_gemm)")
    return gg.ops.gmm(x_NI.contiguous(), w_EIO.contiguous(), torch.tensor(host_sizes(sizes), dtype=torch.int64),
                  trans_b=False)


def auto_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    if kernels_mode() == "triton" and use_triton(x_NI, w_EIO):  # model.kernels=triton: every kernel Triton
        return grouped_gemm(x_NI, w_EIO, sizes)
    return torch_grouped_mm(x_NI, w_EIO, sizes)


GEMMS: dict[str, GroupedMM] = {"auto": auto_mm, "loop": loop_mm, "grouped_mm": torch_grouped_mm,
                               "megablocks": megablocks_mm, "triton": grouped_gemm}


def register_gemm(name: str, fn: GroupedMM) -> None:
    """Add (or replace) a grouped matmul selectable as `MoEMLP(..., gemm=name)`."""
    GEMMS[name] = fn


def check_gemm(name: str) -> None:
    """ValueError for an unknown gemm, or for megablocks when it is not installed."""
    if name not in GEMMS:
        raise ValueError(f"gemm={name!r} is not one of {sorted(GEMMS)}")
    if name == "megablocks" and not megablocks_available():
        raise ValueError("gemm='megablocks' needs the megablocks package, which is not installed "
                         "(pip install megablocks); gemm='auto' needs nothing extra")
