"""Rotary position embedding, Llama's convention (Hugging Face `rotate_half`).

The head dim is treated as two halves [x1, x2]; frequency i (i < head_dim/2)
rotates the pair (x1[i], x2[i]) by angle pos * theta^(-2i/head_dim). Positions
are 0..seq_len-1 (`rotary_cos_sin`), or given per token (`rotary_cos_sin_at`:
packed documents, each restarting at 0, and the new tokens of incremental decoding at
L..L+n-1 behind a KV cache; the same table row for the same position, bitwise).

Frequency scaling (`RopeScaling`, what a Hugging Face config calls `rope_scaling` or
`rope_parameters`): "linear" divides every frequency by `factor` (positions
interpolated); "llama3" (Llama 3.1, 3.2, 3.3) divides the low frequencies (wavelength
above original_max_positions / low_freq_factor) by `factor`, keeps the high ones
(wavelength below original_max_positions / high_freq_factor) and blends between them,
as Meta's reference and transformers compute it. Other kinds (yarn, dynamic,
longrope) are refused by `rope_scaling_of`, naming the ones that are.

`apply_rotary` and `rotate_half` live in `pipekit.kernels.rotary` (the Triton kernel
beside its reference, which is the math this file always had) and are re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.rotary import apply_rotary, rotate_half  # the kernel: Triton on a GPU, this math on CPU

__all__ = ["RopeScaling", "apply_rotary", "inv_frequencies", "rope_scaling_of", "rotary_cos_sin",
           "rotary_cos_sin_at", "rotate_half"]

SCALINGS = ("linear", "llama3")  # the rope_type values pipekit computes


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled (see the module docstring); `rope_type` as Hugging
    Face names it. `low_freq_factor`, `high_freq_factor` and `original_max_positions` are
    llama3's (Llama 3.1's values by default)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        if self.rope_type not in SCALINGS:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not implemented; valid: {list(SCALINGS)} "
                             f"(or no scaling)")
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"rope scaling factor must be a finite number >= 1, got {self.factor!r}")
        if self.rope_type == "llama3":
            if not (0 < self.low_freq_factor < self.high_freq_factor):
                raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                 f"{self.low_freq_factor!r} and {self.high_freq_factor!r}")
            if self.original_max_positions < 1:
                raise ValueError(f"llama3 rope scaling needs original_max_position_embeddings >= 1, got "
                                 f"{self.original_max_positions!r}")

    def as_dict(self) -> dict[str, Any]:
        """The Hugging Face form (`rope_scaling` / `rope_parameters` keys, without rope_theta)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_positions}


_SCALING_KEYS = {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings", "rope_theta"}


def rope_scaling_of(d: Any) -> RopeScaling | None:
    """A `RopeScaling` from its Hugging Face dict form (`rope_type` or the older `type`;
    "default" or None: no scaling; `rope_theta` inside it is ignored here); a RopeScaling
    passes through. Unknown kinds and keys raise a one-line ValueError."""
    if d is None or isinstance(d, RopeScaling):
        return d
    d = dict(d)
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in SCALINGS:
        raise ValueError(f"rope scaling type {kind!r} is not implemented; valid: {list(SCALINGS)} (or 'default': "
                         f"none)")
    unknown = sorted(set(d) - _SCALING_KEYS)
    if unknown:
        raise ValueError(f"rope scaling {kind!r} has unknown key(s) {unknown}; valid keys: {sorted(_SCALING_KEYS)}")
    if "factor" not in d:
        raise ValueError(f"rope scaling {kind!r} needs a 'factor'")
    if kind == "linear":
        return RopeScaling("linear", float(d["factor"]))
    missing = sorted({"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(d))
    if missing:
        raise ValueError(f"llama3 rope scaling needs {missing} besides 'factor'")
    return RopeScaling("llama3", float(d["factor"]), float(d["low_freq_factor"]), float(d["high_freq_factor"]),
                       int(d["original_max_position_embeddings"]))


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                    device: torch.device | str | None = None, work: torch.dtype = torch.float32) -> torch.Tensor:
    """The (head_dim/2,) rotation frequencies theta^(-2i/head_dim), scaled by `scaling`, in `work`."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got head_dim={head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(work) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (head_dim/2,)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_positions
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)  # low frequencies divided
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0,
                   device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32,
                   scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim), in `dtype`.

    Computed in float32 like HF (in float64 when `dtype` is float64), then cast.
    """
    work = torch.promote_types(dtype, torch.float32)
    inv_freq = inv_frequencies(head_dim, theta, scaling, device, work)  # (head_dim/2,)
    positions = torch.arange(seq_len, device=device, dtype=torch.int64).to(work)
    freqs = torch.outer(positions, inv_freq)  # (T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_cos_sin_at(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
                      dtype: torch.dtype = torch.float32,
                      scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables at integer `positions` (..., T): each (..., T, head_dim), in `dtype`.

    The rows of `rotary_cos_sin` at those positions, computed the same way (the same
    values for the same position, bitwise)."""
    work = torch.promote_types(dtype, torch.float32)
    inv_freq = inv_frequencies(head_dim, theta, scaling, positions.device, work)  # (head_dim/2,)
    freqs = positions.to(work).unsqueeze(-1) * inv_freq  # (..., T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)
