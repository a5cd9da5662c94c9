"""The one rule that picks a kernel's side: Triton or its PyTorch reference.

Every kernel in this package calls `use_triton(*tensors)` once per call and runs
its Triton program when it says so, else the reference beside it:

    mode      float64     CUDA tensors, fp32/fp16/bf16      anything else (CPU, ...)
    auto      reference   Triton (when triton imports)     reference
    triton    reference   Triton                           Triton only under TRITON_INTERPRET=1
    torch     reference   reference                        reference

float64 always takes the reference, so the float64 layout-parity suites keep
their meaning whatever the mode; so do meta tensors (no data: the engine runs the
layers on them to learn the stages' shapes, at pp > 1, whatever the mode). The mode is process-wide: `set_kernels(mode)`
(what `model.kernels` in a config does in every worker), else the environment
variable PIPEKIT_KERNELS (read at each call; a config with model.kernels unset
takes it, checked before any worker starts), else "auto"; `kernels(mode)` sets
it for a block.
Forcing "triton" where it cannot run raises, naming what is missing, instead of
falling back silently.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MODES = ("auto", "triton", "torch")
ENV = "PIPEKIT_KERNELS"
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_mode: str | None = None  # set_kernels' choice; None: the environment's


def _checked(mode: str, where: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{where}={mode!r} is not one of {list(MODES)}")
    return mode


def env_mode() -> str | None:
    """PIPEKIT_KERNELS' mode, or None when it is unset; ValueError naming it when it is no mode."""
    raw = os.environ.get(ENV)
    return None if raw is None or raw == "" else _checked(raw, ENV)


def set_kernels(mode: str | None) -> None:
    """Pick the kernels' side for this process ("auto", "triton", "torch"); None: back to
    the environment variable PIPEKIT_KERNELS (or "auto")."""
    global _mode
    _mode = None if mode is None else _checked(mode, "kernels")


def kernels_mode() -> str:
    """The mode in force: set_kernels', else PIPEKIT_KERNELS', else "auto"."""
    if _mode is not None:
        return _mode
    return env_mode() or "auto"


@contextmanager
def kernels(mode: str | None) -> Iterator[None]:
    """`set_kernels(mode)` inside the block (None: the environment's); the previous choice after it."""
    global _mode
    previous = _mode
    set_kernels(mode)
    try:
        yield
    finally:
        _mode = previous


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported here (it is optional off Linux)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton programs run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_blocker(on_cuda: bool, name: str = "kernels='triton'") -> str | None:
    """Why forcing Triton (`name`, as the caller spells the setting) cannot run here, or None:
    the package is missing, or the tensors are not on CUDA and the interpreter is off."""
    if not triton_available():
        return f"{name} needs the triton package, which is not installed; use auto (Triton where it can run) or torch"
    if not on_cuda and not interpreting():
        return (f"{name} on the CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
                "imported, or use auto (the PyTorch references on the CPU)")
    return None


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when a kernel called on `tensors` should run its Triton program (the table in
    this module's docstring). RuntimeError when "triton" is forced where it cannot run."""
    mode = kernels_mode()
    if mode == "torch" or any(t.dtype == torch.float64 or t.is_meta for t in tensors):
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    fits = all(t.dtype in TRITON_DTYPES or not (t.dtype.is_floating_point or t.dtype.is_complex) for t in tensors)
    if mode == "auto":
        return on_cuda and fits and triton_available()
    blocker = triton_blocker(on_cuda)
    if blocker is not None:
        raise RuntimeError(blocker)
    if not fits:
        dtypes = sorted({str(t.dtype) for t in tensors})
        raise RuntimeError(f"kernels='triton' takes float32, float16 or bfloat16 tensors, got {dtypes}")
    return True
