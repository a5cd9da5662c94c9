"""Rotary position embedding, Llama's convention (Hugging Face `rotate_half`).

The head dim is treated as two halves [x1, x2]; frequency i (i < head_dim/2)
rotates the pair (x1[i], x2[i]) by angle pos * theta^(-2i/head_dim). Positions
are 0..seq_len-1 (`rotary_cos_sin`), or given per token (`rotary_cos_sin_at`:
packed documents, each restarting at 0, and the new tokens of incremental decoding at
L..L+n-1 behind a KV cache; the same table row for the same position, bitwise). Not
implemented: Llama-3's frequency scaling ("rope_scaling" with factor / low and high
frequency factors).

`apply_rotary` and `rotate_half` live in `pipekit.kernels.rotary` (the Triton kernel
beside its reference, which is the math this file always had) and are re-exported here.
"""

from __future__ import annotations

import torch

from ..kernels.rotary import apply_rotary, rotate_half  # the kernel: Triton on a GPU, this math on CPU

__all__ = ["apply_rotary", "rotary_cos_sin", "rotary_cos_sin_at", "rotate_half"]


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0,
                   device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim), in `dtype`.

    Computed in float32 like HF (in float64 when `dtype` is float64), then cast.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got head_dim={head_dim}")
    work = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(work) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (head_dim/2,)
    positions = torch.arange(seq_len, device=device, dtype=torch.int64).to(work)
    freqs = torch.outer(positions, inv_freq)  # (T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_cos_sin_at(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables at integer `positions` (..., T): each (..., T, head_dim), in `dtype`.

    The rows of `rotary_cos_sin` at those positions, computed the same way (the same
    values for the same position, bitwise)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got head_dim={head_dim}")
    work = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).to(work) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (head_dim/2,)
    freqs = positions.to(work).unsqueeze(-1) * inv_freq  # (..., T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)
