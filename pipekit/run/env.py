"""`pipekit env`: what this machine can run, in the manner of DeepSpeed's ds_report."""

from __future__ import annotations

import importlib
import os
import platform
import sys

import torch
import torch.distributed as dist

from .. import __version__
from ..topology import count_visible_gpus, resolve_device


def _version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None
    return getattr(module, "__version__", "installed")


def _triton_usable(cuda: bool) -> str:
    if not _version("triton"):
        return "no (triton not installed)"
    if cuda:
        return "yes (CUDA)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter only (TRITON_INTERPRET=1, slow; for tests)"
    return "no (no CUDA device; set TRITON_INTERPRET=1 to run kernels in the interpreter)"


def auto_device_text(gpus: int) -> str:
    """What `train.device=auto` gives on a node with `gpus` visible GPUs (see resolve_device)."""
    device, _ = resolve_device("auto", 1, gpus)
    if device == "cpu":
        return "cpu with gloo (no CUDA device visible)"
    return f"cuda with NCCL for up to {gpus} worker{'s' if gpus > 1 else ''} per node; cpu with gloo beyond that"


def report() -> list[tuple[str, str]]:
    """(what, finding) rows: versions, devices, backends and the optional packages."""
    cuda = torch.cuda.is_available()
    rows = [
        ("pipekit", f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"),
        ("python", f"{sys.version.split()[0]} ({platform.platform()})"),
        ("torch", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})"),
        ("CUDA devices",
         ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else "none"),
        ("NCCL",
         ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "not available"),
        ("gloo", "available" if dist.is_gloo_available() else "not available"),
        ("train.device=auto picks", auto_device_text(count_visible_gpus())),
        ("CPU cores", str(os.cpu_count())),
        ("triton", _version("triton") or "not installed"),
        ("Triton kernels usable", _triton_usable(cuda)),
        ("megablocks (optional MoE backend)", _version("megablocks") or "not installed"),
    ]
    for name in ("omegaconf", "numpy", "einops", "safetensors", "transformers", "tokenizers", "tensorboard", "tqdm"):
        rows.append((name, _version(name) or "not installed"))
    return rows


def format_report(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
