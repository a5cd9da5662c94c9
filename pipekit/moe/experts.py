"""Routed experts as grouped weights, and the always-on shared expert.

`Experts` holds this ep rank's `n_experts / ep` experts as stacked tensors
(expert dim first) and runs them over token rows already sorted by expert.

  swiglu: w_down[e]^T (silu(x w_gate[e]) * (x w_up[e]))
          w_gate, w_up: (E_local, dim, hidden); w_down: (E_local, hidden, dim)
  gelu:   gelu_tanh(x w_fc[e] + b_fc[e]) w_proj[e] + b_proj[e]
          w_fc: (E_local, dim, hidden); w_proj: (E_local, hidden, dim);
          biases b_fc (E_local, hidden), b_proj (E_local, dim) with `bias=True`

Initialisation: every expert draws its own weights, in the order above, from
a generator seeded by (the layer's seed, the expert's GLOBAL index): normal
with std `init_std`, `out_init_std` for the output projection (w_down,
w_proj), zero biases. The layer's seed defaults to `torch.initial_seed()`,
which inside `LayerSpec.build` is the layer's own seed (derived from its
global layer index), so the experts a rank holds at any ep size are bitwise
the tensors those experts have at ep=1, and building them leaves the default
generator untouched. Weights are drawn on the current default device with
that device's generator (on meta: nothing is drawn).

Every expert parameter carries `expert_parallel = True` and `ep_shard_dim = 0`
for the optimizer and checkpoints.

Expert tensor parallelism (`tp_group` of size > 1, Megatron's expert-TP):
each local expert's hidden dimension is split over the group's ranks, so no
expert work is repeated across them. The input projections (w_gate, w_up,
w_fc, b_fc) are column-parallel (a hidden slice each), the output projection
(w_down, w_proj) row-parallel, and the partial outputs are summed by one
all-reduce over the group (`reduce_from_tp`) before b_proj is added; in
backward the input rows' gradient is all-reduced (`copy_to_tp`). Every rank
of the group must hold the same rows (the tp ranks of one stage replica
route the same tokens the same way). A shard is a slice of the full tensor
drawn as above (each expert is drawn whole, then sliced), so the weights are
those of one process; the split tensors carry `tp_shard_dim` (the hidden
dim), b_proj none (replicated over the group). Without a group no parameter
carries `tp_shard_dim` and every tp rank runs its experts whole.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.glu import swiglu
from ..layers.parallel import (
    _mark_tp_shard,
    _SharedRef,
    copy_to_tp,
    divide,
    group_rank,
    group_size,
    normal_full,
    reduce_from_tp,
    shard_dim,
    skipping_init,
)
from ..rules import check_experts
from ..spec import layer_seed
from .grouped import GEMMS, Sizes, group_of_rows

ACTIVATIONS = ("swiglu", "gelu")


Shapes = dict[str, tuple[tuple[int, ...], float]]  # {name: (shape of one expert's tensor, init std)}
HIDDEN_DIM = {"w_gate": 2, "w_up": 2, "w_down": 1, "w_fc": 2, "w_proj": 1, "b_fc": 1}  # of the (E_local, ...) tensor


def mark_expert(p: nn.Parameter) -> nn.Parameter:
    """Mark `p` as an expert tensor, sharded over ep along dim 0 (what the optimizer and checkpoints read)."""
    p.expert_parallel, p.ep_shard_dim = True, 0  # type: ignore[attr-defined]  # pipekit's marks on a Parameter
    return p


def _expert_parameters(shapes: Shapes, first: int, n_local: int, seed: int,
                       tp_group=None) -> dict[str, nn.Parameter]:
    """{name: (n_local, *shape) parameter}; expert first+i draws its tensors, in `shapes`
    order, from a generator seeded with layer_seed(seed, first+i). std 0 means zeros.
    With `tp_group`, the tensors in HIDDEN_DIM keep this rank's slice of the hidden dim
    (each expert drawn whole first) and are marked `tp_shard_dim`."""
    split = {name: HIDDEN_DIM[name] if tp_group is not None and name in HIDDEN_DIM else None for name in shapes}
    out = {name: torch.zeros((n_local, *_sliced(shape, split[name], tp_group))) for name, (shape, _) in shapes.items()}
    device = next(iter(out.values())).device
    if device.type != "meta" and not skipping_init():
        for i in range(n_local):
            gen = torch.Generator(device=device).manual_seed(layer_seed(seed, first + i))
            for name, (shape, std) in shapes.items():
                dim = split[name]
                if std == 0:
                    continue
                if dim is None:
                    out[name][i].normal_(0.0, std, generator=gen)
                else:  # the whole expert's tensor, then this rank's slice of its hidden dim
                    full = torch.empty(shape).normal_(0.0, std, generator=gen)
                    out[name][i] = full.chunk(group_size(tp_group), dim - 1)[group_rank(tp_group)]
    params = {name: mark_expert(nn.Parameter(t)) for name, t in out.items()}
    for name, dim in split.items():
        if dim is not None:
            _mark_tp_shard(params[name], dim)
    return params


def _sliced(shape: tuple[int, ...], dim: int | None, tp_group) -> tuple[int, ...]:
    """One expert's `shape` with its dim `dim - 1` (a dim of the stacked tensor) split over `tp_group`."""
    if dim is None:
        return shape
    return tuple(n // group_size(tp_group) if d == dim - 1 else n for d, n in enumerate(shape))


class Experts(nn.Module):
    """Experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of `n_experts`, as grouped weights.

    forward(x_ND, sizes): rows of `x_ND` sorted by local expert, `sizes[e]` of
    them for local expert e (an int tensor on x's device, or Python ints; grouped.py),
    -> (N, dim), each row through its expert. `gemm` names the grouped-matmul function (see
    grouped.py). No communication, except with expert tensor parallelism (`tp_group` of size >
    1, see the module docstring): one all-reduce of the (N, dim) output over `tp_group`
    forward, one of the input gradient backward.
    """

    # (E_local, ...) parameters, registered in __init__ by activation (see the module docstring)
    w_gate: nn.Parameter
    w_up: nn.Parameter
    w_down: nn.Parameter
    w_fc: nn.Parameter
    w_proj: nn.Parameter
    b_fc: nn.Parameter
    b_proj: nn.Parameter

    def __init__(self, dim: int, hidden: int, n_experts: int, activation: str = "swiglu", bias: bool = False,
                 ep_size: int = 1, ep_rank: int = 0, init_std: float = 0.02, out_init_std: float | None = None,
                 seed: int | None = None, gemm: str = "auto", tp_group=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        if bias and activation != "gelu":
            raise ValueError(f"bias=True is supported with activation='gelu' only, got activation={activation!r}")
        check_experts(n_experts, ep_size)
        if tp_group is not None:
            divide(hidden, group_size(tp_group), "the experts' hidden")
        self.dim, self.hidden, self.n_experts, self.activation = dim, hidden, n_experts, activation
        self._tp_group = _SharedRef(tp_group)
        self.n_local = n_experts // ep_size
        self.first = ep_rank * self.n_local
        self.gemm = gemm
        out_std = init_std if out_init_std is None else out_init_std
        shapes: Shapes
        if activation == "swiglu":
            shapes = {"w_gate": ((dim, hidden), init_std), "w_up": ((dim, hidden), init_std),
                      "w_down": ((hidden, dim), out_std)}
        else:
            shapes = {"w_fc": ((dim, hidden), init_std), "w_proj": ((hidden, dim), out_std)}
            if bias:
                shapes.update(b_fc=((hidden,), 0.0), b_proj=((dim,), 0.0))
        seed = torch.initial_seed() if seed is None else seed
        for name, p in _expert_parameters(shapes, self.first, self.n_local, seed, tp_group).items():
            self.register_parameter(name, p)
        self.bias = bias
        self.adaptable_weights = tuple(w for w in shapes if w.startswith("w_"))  # what LoRA may adapt
        self.lora: Any = None  # a `pipekit.layers.lora.ExpertLoRA` once `add_adapters` gives it one

    @property
    def tp_group(self):
        """The group each expert's hidden dim is split over (None: not split)."""
        return self._tp_group.value

    def __deepcopy__(self, memo):
        """A deep copy shares the tp group and keeps the expert and tp marks, which torch's
        `Parameter.__deepcopy__` drops."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        for name, p in new._parameters.items():
            if p is not None:
                mark_expert(p)
                dim = shard_dim(self._parameters[name])
                if dim is not None:
                    _mark_tp_shard(p, dim)
        return new

    def forward(self, x_ND: torch.Tensor, sizes: Sizes) -> torch.Tensor:
        group = self.tp_group
        x_ND = copy_to_tp(x_ND, group)  # expert-TP: each rank's hidden slice adds to the input's gradient
        if self.activation == "swiglu":
            h_NH = swiglu(self._mm(x_ND, "w_gate", sizes), self._mm(x_ND, "w_up", sizes))  # (N, hidden/tp)
            return reduce_from_tp(self._mm(h_NH, "w_down", sizes), group)
        rows_N = group_of_rows(sizes, x_ND.shape[0], x_ND.device)
        h_NH = self._mm(x_ND, "w_fc", sizes)  # (N, hidden/tp)
        h_NH = F.gelu(h_NH + self.b_fc[rows_N] if self.bias else h_NH, approximate="tanh")
        y_ND = reduce_from_tp(self._mm(h_NH, "w_proj", sizes), group)  # partial sums over the hidden slices
        return y_ND + self.b_proj[rows_N] if self.bias else y_ND

    def _mm(self, x: torch.Tensor, weight: str, sizes: Sizes) -> torch.Tensor:
        """Each row of `x` times its expert's `weight`, plus the adapter's update when it has one
        (added to the partial product, before expert-TP's sum, as the weight's own)."""
        mm = GEMMS[self.gemm]
        y = mm(x, getattr(self, weight), sizes)
        lora = self.lora
        if lora is not None and weight in lora.weights:
            y = y + lora.delta(weight, x, sizes, mm)
        return y

    def extra_repr(self) -> str:
        split = f", hidden split over tp={group_size(self.tp_group)}" if self.tp_group is not None else ""
        return (f"dim={self.dim}, hidden={self.hidden}, experts {self.first}..{self.first + self.n_local - 1} "
                f"of {self.n_experts}, activation={self.activation!r}, bias={self.bias}, gemm={self.gemm!r}{split}")


class SharedExpert(nn.Module):
    """A dense MLP every token goes through, beside the routed experts: (T, dim) -> (T, dim).

    Same activations as `Experts`, weights stored as in nn.Linear (out, in):
    swiglu `gate`, `up` (hidden, dim), `down` (dim, hidden); gelu `fc`,
    `proj` (+ `fc_bias`, `proj_bias`). Drawn from the default generator
    (after the router), identical on every rank; replicated, not tp-sharded.
    """

    gate: nn.Parameter
    up: nn.Parameter
    down: nn.Parameter
    fc: nn.Parameter
    proj: nn.Parameter
    fc_bias: nn.Parameter
    proj_bias: nn.Parameter

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", bias: bool = False,
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        out_std = init_std if out_init_std is None else out_init_std
        self.activation, self.bias = activation, bias and activation == "gelu"
        names = ("gate", "up", "down") if activation == "swiglu" else ("fc", "proj")
        for name in names:
            out_proj = name in ("down", "proj")
            shape = (dim, hidden) if out_proj else (hidden, dim)
            self.register_parameter(name, nn.Parameter(normal_full(shape, out_std if out_proj else init_std)))
        if self.bias:
            self.fc_bias, self.proj_bias = nn.Parameter(torch.zeros(hidden)), nn.Parameter(torch.zeros(dim))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return F.linear(F.silu(F.linear(x_TD, self.gate)) * F.linear(x_TD, self.up), self.down)
        h = F.gelu(F.linear(x_TD, self.fc, self.fc_bias if self.bias else None), approximate="tanh")
        return F.linear(h, self.proj, self.proj_bias if self.bias else None)
