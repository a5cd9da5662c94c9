"""Test helpers: N spawned gloo processes inside pytest, and the one-process oracle.

`run_distributed(fn, world_size, *args)` (from `pipekit.spawn`, where the
planner finds it too) runs `fn` on `world_size` gloo ranks and returns each
rank's result; see that module for its `init` modes and timeouts.

`reference_model(specs, seed)` builds a whole spec list as one plain
`nn.Sequential` without tensor parallelism — what every layout is compared
against — and `reference_name` maps PipelineModule names onto it.

`HostReads` counts the host's reads of tensor values (`.item()`, `.tolist()`,
`bool(t)`, ...: on a GPU each waits for the device), by pipekit call site:
tests/test_host_sync.py and benchmarks/moe_dispatch.py use it.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch import nn

from .layers.parallel import FakeGroup  # tests have always found it here
from .spawn import INITS, run_distributed
from .spec import LayerSpec, TiedLayerSpec, tied_first_index

__all__ = ["INITS", "FakeGroup", "HostReads", "reference_model", "reference_name", "reference_slice", "run_distributed"]


class _Tied(nn.Module):
    def __init__(self, module: nn.Module, forward_fn):
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, x):
        return self.forward_fn(self.module, x) if self.forward_fn else self.module(x)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def reference_model(specs: list, seed: int) -> nn.Sequential:
    """The whole spec list as one nn.Sequential (no tensor parallelism), tied layers sharing one module."""
    tied: dict[str, nn.Module] = {}
    mods: list[nn.Module] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build(seed=seed, index=i)
            mods.append(_Tied(tied[spec.key], spec.forward_fn))
        elif isinstance(spec, LayerSpec):
            mods.append(spec.build(seed=seed, index=i))
        else:
            mods.append(_Fn(spec))
    return nn.Sequential(*mods)


def reference_name(name: str, specs: list) -> str:
    """Map a PipelineModule parameter name to the nn.Sequential one."""
    head, key, rest = name.split(".", 2)
    if head == "layers":
        return f"{key}.{rest}"
    return f"{tied_first_index(specs)[key]}.module.{rest}"


def reference_slice(full: torch.Tensor, p: torch.Tensor, topo) -> torch.Tensor:
    """The part of a single-process tensor that local parameter `p` holds: an expert tensor's
    ep shard (along `p.ep_shard_dim`), then its tp shard (along `p.tp_shard_dim`), or the
    whole tensor for a replicated parameter."""
    ep_dim = getattr(p, "ep_shard_dim", None) if getattr(p, "expert_parallel", False) else None
    if ep_dim is not None:
        full = full.chunk(getattr(topo, "ep", 1), dim=ep_dim)[getattr(topo, "ep_rank", 0)]
    dim = getattr(p, "tp_shard_dim", None)
    return full if dim is None else full.chunk(topo.tp, dim=dim)[topo.tp_rank]


class HostReads:
    """Wraps the Tensor methods that read a value on the host (`READS`) in this process and
    counts their calls while `on`, keyed "method at file:function" by the innermost pipekit
    frame. `restore()` puts the real methods back. What it cannot see: reads inside torch's
    own C++ (a boolean-mask index, `nonzero`, CUDA's `bincount`), so code that means to be
    sync-free avoids those by construction."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")

    def __init__(self):
        self.on, self.sites = False, collections.Counter()
        self._real = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def read(t, *args, **kwargs):
            if self.on:
                self.on = False  # a read inside a read (tolist -> item) counts once
                try:
                    self.sites[f"{name} at {_pipekit_site()}"] += 1
                finally:
                    self.on = True
            return real(t, *args, **kwargs)
        return read

    def total(self) -> int:
        return sum(self.sites.values())

    def restore(self) -> None:
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)


def _pipekit_site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/pipekit/" in f.filename.replace("\\", "/")]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].name}" if frames else "?"
