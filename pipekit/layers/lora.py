"""Low-rank adapters (LoRA) and their weight-decomposed form (DoRA) on the tensor-parallel linears.

An adapted linear computes, beside its frozen weight W (out, in) and bias b,

    LoRA   y = x W^T + b + s * B(A(drop(x)))                       s = alpha / rank
    DoRA   y = x W^T + b + (g - 1) * x W^T + g * s * B(A(drop(x)))   g = m / ||W + s B A||_row

with A (rank, in) drawn as PEFT draws it (kaiming-uniform, a=sqrt(5)) and B (out, rank) zero, so
training starts from the model itself; DoRA's magnitude m (out,) starts at ||W||_row and its
norm is detached in backward (as in the DoRA paper, section 4.3, and PEFT). The parameter names
are PEFT's (`lora_A.weight`, `lora_B.weight`, `lora_magnitude_vector`) in the linear's `lora`
submodule (`layers.3.attn.q.lora.lora_A.weight`), so checkpoints line up across layouts and the
adapter exports to PEFT by renaming alone.

Sharded like the layer they adapt. Column-parallel (out split): B and m are split along their
rows as W is, A is whole on every tp rank. Row-parallel (in split): A is split along its
columns as W is, B and m are whole. The update is added where the layer's own partial
products are, before the row layer's all-reduce (or reduce-scatter), so tp=N computes what
tp=1 computes; the factor that is whole over tp (A of a column layer, B and m of a row
layer) then gets only this rank's part of its gradient, so it is marked `tp_partial` and
the optimizer sums its gradient over tp (as it does for sequence-parallel norms). DoRA's
row norms of a row-parallel layer are summed over tp (one all-reduce of `out` floats per
forward, no gradient). A's full tensor is drawn from a generator seeded by the train seed
and the layer's stable name, so every layout draws the same adapter.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import TensorParallelModule, _mark_tp_shard, group_size, mark_tp_partial, reduce_from_tp, tp_slice


class _Weight(nn.Module):
    """A module holding one `weight`: PEFT's `lora_A` / `lora_B` are nn.Linear, named so."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


class LoRA(nn.Module):
    """The adapter of one linear layer (`ColumnParallelLinear` or `RowParallelLinear`), built for
    its tp shard; `delta(x, y0)` is what the layer adds to its partial output (see the module
    docstring). `seed`: the full A's generator seed."""

    def __init__(self, layer, rank: int, alpha: float, dropout: float, dora: bool, seed: int):
        super().__init__()
        self.rank, self.scale, self.dora = rank, alpha / rank, dora
        self.row = hasattr(layer, "input_is_parallel")  # RowParallelLinear: its input is split
        self._group = layer._tp_group
        out_f, in_f = layer.out_features, layer.in_features
        w = layer.weight
        gen = torch.Generator().manual_seed(seed)
        full_a = torch.empty(rank, in_f, dtype=torch.float64)
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on a (rank, in) weight
        full_a = full_a.uniform_(-bound, bound, generator=gen).to(w.dtype)
        group = self._group.value
        if self.row:
            a, b = tp_slice(full_a, 1, group), torch.zeros(out_f, rank, dtype=w.dtype)
        else:
            a, b = full_a, torch.zeros(w.shape[0], rank, dtype=w.dtype)
        self.lora_A, self.lora_B = _Weight(a.clone().to(w.device)), _Weight(b.to(w.device))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        if group_size(group) > 1:
            if self.row:
                _mark_tp_shard(self.lora_A.weight, 1)
                mark_tp_partial(self.lora_B.weight)
            else:
                _mark_tp_shard(self.lora_B.weight, 0)
                mark_tp_partial(self.lora_A.weight)
        if dora:
            with torch.no_grad():
                self.lora_magnitude_vector = nn.Parameter(self._row_norm(w.detach(), extra=None))
            if group_size(group) > 1 and self.row:
                mark_tp_partial(self.lora_magnitude_vector)
            elif group_size(group) > 1:
                _mark_tp_shard(self.lora_magnitude_vector, 0)

    def _row_norm(self, w: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """||w + extra||_row over the whole input dimension (summed over tp for a row layer)."""
        full = w if extra is None else w + extra
        sq = full.pow(2).sum(dim=1)
        if self.row:
            sq = reduce_from_tp(sq, self._group.value)
        return sq.sqrt()

    def delta(self, x: torch.Tensor, y0: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """What the layer adds to its (partial) output x W^T (`y0`, needed by DoRA) for input x."""
        up = F.linear(F.linear(self.dropout(x), self.lora_A.weight), self.lora_B.weight)
        if not self.dora:
            return self.scale * up
        assert y0 is not None
        with torch.no_grad():
            lora_w = self.lora_B.weight @ self.lora_A.weight  # (out, in), this rank's part
            norm = self._row_norm(weight, self.scale * lora_w)
        g = self.lora_magnitude_vector / norm  # (out,) or this rank's rows
        return (g - 1) * y0 + g * self.scale * up

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}" + (", dora=True" if self.dora else "")


def adapter_seed(base_seed: int, name: str) -> int:
    """The seed of the full A of the linear named `name` (its stable name): the same in every layout."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def adaptable(module: nn.Module) -> bool:
    """Whether `module` can carry an adapter: a column- or row-parallel linear of pipekit's
    (a tp module with a `lora` slot: `pipekit.layers.linear`)."""
    return isinstance(module, TensorParallelModule) and hasattr(module, "lora") and hasattr(module, "in_features")


def add_adapters(model: nn.Module, targets: str, rank: int, alpha: float, dropout: float = 0.0,
                 dora: bool = False, seed: int = 0, skip: tuple[str, ...] = ()) -> list[str]:
    """Give every adaptable linear of `model` whose stable name matches the regex `targets`
    (`re.search`; names such as `layers.3.attn.q`, `layers.3.mlp.fc`) a LoRA adapter and freeze
    every other parameter of the model, as PEFT does. Names matching one of `skip` are left
    alone (the caller's reasons: a fused head). Returns the adapted names (possibly none: this
    rank's stages may hold no target; the caller checks that the whole model has one)."""
    pattern = re.compile(targets)
    found = [(n, m) for n, m in model.named_modules() if adaptable(m) and pattern.search(n)
             and not any(n.startswith(s) for s in skip)]
    for p in model.parameters():
        p.requires_grad_(False)
    for name, layer in found:
        layer.lora = LoRA(layer, rank, alpha, dropout, dora, adapter_seed(seed, name))
    return [n for n, _ in found]


def freeze(model: nn.Module, pattern: str) -> list[str]:
    """Stop training the parameters whose names match the regex `pattern` (`re.search`); returns them."""
    regex = re.compile(pattern)
    hit = [(n, p) for n, p in model.named_parameters() if regex.search(n)]
    for _, p in hit:
        p.requires_grad_(False)
    return [n for n, _ in hit]


def merge_adapters(state_dict: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict (every tensor whole, stable names) with each adapter folded into the
    weight it adapts and removed: W' = W + s B A (LoRA), or W' = m * (W + s B A) / ||W + s B A||_row
    (DoRA); `scale` = s = alpha / rank. Computed in float64, cast back to W's dtype."""
    out = {k: v for k, v in state_dict.items() if ".lora." not in k}
    for key in [k for k in state_dict if k.endswith(".lora.lora_A.weight")]:
        base = key[: -len(".lora.lora_A.weight")]
        a, b = state_dict[key], state_dict[f"{base}.lora.lora_B.weight"]
        w = state_dict[f"{base}.weight"]
        merged = w.double() + scale * (b.double() @ a.double())
        if f"{base}.lora.lora_magnitude_vector" in state_dict:
            m = state_dict[f"{base}.lora.lora_magnitude_vector"].double()
            merged = merged * (m / merged.norm(dim=1)).unsqueeze(1)
        out[f"{base}.weight"] = merged.to(w.dtype)
    return out
