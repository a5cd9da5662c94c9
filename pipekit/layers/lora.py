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

MoE experts (`pipekit.moe.Experts`, grouped weights w (E_local, in, out) applied as x w[e]) get
one adapter per expert and weight (`ExpertLoRA`): A (E_local, in, r) and B (E_local, r, out),
x w[e] + s * (x A[e]) B[e], run by the same grouped gemm as the weights. Their names are
`layers.3.mlp.experts.lora.w_gate_lora_A` / `_lora_B` (targets match `layers.3.mlp.experts.w_gate`);
expert e's A is drawn as a dense layer's (PEFT's (r, in) kaiming-uniform, transposed) from the
seed of the name and e's global index, so every ep size draws the same adapters. They are
expert-parallel like the weights (split over ep along dim 0) and, with expert tensor
parallelism, split as the weight they adapt (a column weight's B along its out dim, a row
weight's A along its in dim; the whole factor `tp_partial`); under sequence parallelism
(each tp rank routes its own tokens) both are summed over tp as the experts' weights are.
No DoRA on experts.
"""

from __future__ import annotations

import copy
import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import (
    TensorParallelModule,
    _mark_tp_shard,
    group_size,
    is_sequence_parallel,
    mark_sequence_parallel,
    mark_tp_partial,
    reduce_from_tp,
    shard_dim,
    tp_slice,
)


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


_MARKS = ("expert_parallel", "ep_shard_dim", "tp_shard_dim", "tp_partial", "sequence_parallel")


class ExpertLoRA(nn.Module):
    """The adapters of some of an `Experts` module's grouped weights (`weights`, e.g. ("w_gate",
    "w_down")), built for this rank's experts and expert-tp shard; `name`: the experts' stable
    name (the seeds). `delta(w, x, sizes, mm)` is what weight w's grouped product gains."""

    def __init__(self, experts: nn.Module, weights: list[str], rank: int, alpha: float, dropout: float,
                 seed: int, name: str):
        super().__init__()
        self.rank, self.scale, self.weights = rank, alpha / rank, tuple(weights)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        group = getattr(experts, "tp_group", None)
        n = group_size(group)
        first = int(getattr(experts, "first", 0))
        for w in self.weights:
            weight = getattr(experts, w)  # (E_local, in, out), maybe split over expert-tp along dim 1 or 2
            split = shard_dim(weight) if n > 1 else None
            n_local, in_f, out_f = weight.shape
            in_full = in_f * n if split == 1 else in_f
            a = torch.empty(n_local, in_full, rank, dtype=weight.dtype)
            bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) on one expert's (rank, in) weight
            for i in range(n_local):
                gen = torch.Generator().manual_seed(adapter_seed(seed, f"{name}.{w}.{first + i}"))
                full = torch.empty(rank, in_full, dtype=torch.float64).uniform_(-bound, bound, generator=gen)
                a[i] = full.t().to(weight.dtype)
            if split == 1:
                a = tp_slice(a, 1, group).clone()
            b = torch.zeros(n_local, rank, out_f, dtype=weight.dtype)
            pa, pb = nn.Parameter(a.to(weight.device)), nn.Parameter(b.to(weight.device))
            for p in (pa, pb):
                p.expert_parallel, p.ep_shard_dim = True, 0  # type: ignore[attr-defined]  # as the weights
            if is_sequence_parallel(weight):
                mark_sequence_parallel(pa, pb)
            elif split == 1:
                _mark_tp_shard(pa, 1)
                mark_tp_partial(pb)
            elif split == 2:
                _mark_tp_shard(pb, 2)
                mark_tp_partial(pa)
            self.register_parameter(f"{w}_lora_A", pa)
            self.register_parameter(f"{w}_lora_B", pb)

    def delta(self, w: str, x: torch.Tensor, sizes, mm) -> torch.Tensor:
        """s * (x A[e]) B[e] for the rows of each expert e (`mm`: the experts' grouped gemm)."""
        a, b = getattr(self, f"{w}_lora_A"), getattr(self, f"{w}_lora_B")
        return self.scale * mm(mm(self.dropout(x), a, sizes), b, sizes)

    def __deepcopy__(self, memo):
        """A deep copy keeps pipekit's marks, which torch's `Parameter.__deepcopy__` drops."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        for key, p in self._parameters.items():
            for mark in _MARKS:
                if p is not None and hasattr(p, mark):
                    setattr(new._parameters[key], mark, getattr(p, mark))
        return new

    def extra_repr(self) -> str:
        return f"{', '.join(self.weights)}: rank={self.rank}, scale={self.scale:g}"


def expert_weights(module: nn.Module) -> tuple[str, ...]:
    """The grouped weights of an experts module (`pipekit.moe.Experts`) that can carry adapters
    (none for any other module)."""
    return tuple(getattr(module, "adaptable_weights", ()))


def adaptable_names(model: nn.Module) -> list[str]:
    """The stable names `model.lora.targets` is matched against: every adaptable linear's
    (`layers.3.attn.q`) and every expert weight's (`layers.3.mlp.experts.w_gate`)."""
    out = []
    for n, m in model.named_modules():
        if n and adaptable(m):
            out.append(n)
        out += [f"{n}.{w}" if n else w for w in expert_weights(m)]
    return out


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
    (`re.search`; names such as `layers.3.attn.q`, `layers.3.mlp.fc`), and every expert weight
    (`layers.3.mlp.experts.w_gate`: one adapter per expert, `ExpertLoRA`), a LoRA adapter and freeze
    every other parameter of the model, as PEFT does. Names matching one of `skip` are left
    alone (the caller's reasons: a fused head). Returns the adapted names (possibly none: this
    rank's stages may hold no target; the caller checks that the whole model has one)."""
    pattern = re.compile(targets)
    found = [(n, m) for n, m in model.named_modules() if adaptable(m) and pattern.search(n)
             and not any(n.startswith(s) for s in skip)]
    experts = [(n, m, [w for w in expert_weights(m) if pattern.search(f"{n}.{w}")]) for n, m in model.named_modules()]
    experts = [(n, m, ws) for n, m, ws in experts if ws and not any(n.startswith(s) for s in skip)]
    if dora and experts:
        raise ValueError(f"DoRA is not supported on MoE experts ({experts[0][0]}.{experts[0][2][0]} matches "
                         f"targets={targets!r}); leave the experts out of the targets, or use dora=False")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, layer in found:
        layer.lora = LoRA(layer, rank, alpha, dropout, dora, adapter_seed(seed, name))
    for name, layer, weights in experts:
        layer.lora = ExpertLoRA(layer, weights, rank, alpha, dropout, seed, name)
    return [n for n, _ in found] + [f"{n}.{w}" for n, _, ws in experts for w in ws]


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
    for key in [k for k in state_dict if ".lora." in k and k.endswith("_lora_A")]:  # grouped expert weights
        module, weight = key.split(".lora.")[0], key.split(".lora.")[1][: -len("_lora_A")]
        a, b = state_dict[key].double(), state_dict[key[: -len("_lora_A")] + "_lora_B"].double()
        w = state_dict[f"{module}.{weight}"]
        out[f"{module}.{weight}"] = (w.double() + scale * torch.bmm(a, b)).to(w.dtype)
    return out
