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
for the optimizer and checkpoints; none carries `tp_shard_dim`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.glu import swiglu
from ..layers.parallel import normal_full
from ..spec import layer_seed
from .grouped import GEMMS

ACTIVATIONS = ("swiglu", "gelu")


Shapes = dict[str, tuple[tuple[int, ...], float]]  # {name: (shape of one expert's tensor, init std)}


def mark_expert(p: nn.Parameter) -> nn.Parameter:
    """Mark `p` as an expert tensor, sharded over ep along dim 0 (what the optimizer and checkpoints read)."""
    p.expert_parallel, p.ep_shard_dim = True, 0  # type: ignore[attr-defined]  # pipekit's marks on a Parameter
    return p


def _expert_parameters(shapes: Shapes, first: int, n_local: int,
                       seed: int) -> dict[str, nn.Parameter]:
    """{name: (n_local, *shape) parameter}; expert first+i draws its tensors, in `shapes`
    order, from a generator seeded with layer_seed(seed, first+i). std 0 means zeros."""
    out = {name: torch.zeros((n_local, *shape)) for name, (shape, _) in shapes.items()}
    device = next(iter(out.values())).device
    if device.type != "meta":
        for i in range(n_local):
            gen = torch.Generator(device=device).manual_seed(layer_seed(seed, first + i))
            for name, (_, std) in shapes.items():
                if std > 0:
                    out[name][i].normal_(0.0, std, generator=gen)
    return {name: mark_expert(nn.Parameter(t)) for name, t in out.items()}


class Experts(nn.Module):
    """Experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of `n_experts`, as grouped weights.

    forward(x_ND, sizes): rows of `x_ND` sorted by local expert, `sizes[e]` of
    them for local expert e (Python ints), -> (N, dim), each row through its
    expert. `gemm` names the grouped-matmul function (see grouped.py). No communication.
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
                 seed: int | None = None, gemm: str = "auto"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        if bias and activation != "gelu":
            raise ValueError(f"bias=True is supported with activation='gelu' only, got activation={activation!r}")
        if n_experts % ep_size:
            raise ValueError(f"n_experts={n_experts} is not divisible by the expert-parallel size ep={ep_size}; "
                             f"choose n_experts a multiple of {ep_size} or an ep that divides {n_experts}")
        self.dim, self.hidden, self.n_experts, self.activation = dim, hidden, n_experts, activation
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
        for name, p in _expert_parameters(shapes, self.first, self.n_local, seed).items():
            self.register_parameter(name, p)
        self.bias = bias

    def __deepcopy__(self, memo):
        """A deep copy keeps the expert marks, which torch's `Parameter.__deepcopy__` drops."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        for p in new._parameters.values():
            if p is not None:
                mark_expert(p)
        return new

    def forward(self, x_ND: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        mm = GEMMS[self.gemm]
        if self.activation == "swiglu":
            h_NH = swiglu(mm(x_ND, self.w_gate, sizes), mm(x_ND, self.w_up, sizes))
            return mm(h_NH, self.w_down, sizes)
        rows_N = torch.repeat_interleave(torch.arange(self.n_local, device=x_ND.device),
                                         torch.tensor(sizes, device=x_ND.device), output_size=x_ND.shape[0])
        h_NH = mm(x_ND, self.w_fc, sizes)
        h_NH = F.gelu(h_NH + self.b_fc[rows_N] if self.bias else h_NH, approximate="tanh")
        y_ND = mm(h_NH, self.w_proj, sizes)
        return y_ND + self.b_proj[rows_N] if self.bias else y_ND

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, experts {self.first}..{self.first + self.n_local - 1} "
                f"of {self.n_experts}, activation={self.activation!r}, bias={self.bias}, gemm={self.gemm!r}")


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
