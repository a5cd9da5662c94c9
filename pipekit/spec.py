"""Lazy, seeded layer construction.

A model is a plain list whose entries are `LayerSpec`s, `TiedLayerSpec`s or
plain callables (a function reshaping a tensor, say). Nothing is built until a
rank asks for the layers of its own stage, and every layer is built under a
seed derived from (base seed, global layer index), so its initial weights do
not depend on which rank, stage or layout builds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_MASK64 = (1 << 64) - 1


def layer_seed(base_seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for layer `index` of a model seeded with `base_seed`.

    SplitMix64 over the pair, so neighbouring layers and neighbouring base
    seeds get unrelated random streams.
    """
    z = (base_seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    """Seed the CPU generator (and `device`'s, when it is a GPU) and restore them after.

    Only generators that are forked are seeded: `torch.manual_seed` would also
    reseed every other GPU (or queue that reseed until CUDA starts), which the
    fork does not restore.
    """
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if cuda_devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


class LayerSpec:
    """`module_cls(*args, **kwargs)`, built only when `build` is called.

    `build(seed=..., index=...)` seeds the random number generators of the
    target device from `layer_seed(seed, index)` and constructs the module
    there (`device="meta"` allocates nothing, which is how parameters are
    counted and shapes are found). The module's forward takes one argument,
    a tensor or a tuple of tensors, and returns one of the same.

    Limit: weights built on CUDA come from the CUDA generator, so a layer built
    on a GPU differs from the same layer built on the CPU; every rank of one
    job builds on the same device type, so layouts still agree.
    """

    def __init__(self, module_cls: Callable[..., nn.Module], *args: Any, **kwargs: Any):
        if isinstance(module_cls, nn.Module):  # callable too, but its call is its forward
            raise TypeError(f"LayerSpec takes the layer's class and its arguments (e.g. LayerSpec(nn.Linear, 64, "
                            f"64)), got a {type(module_cls).__name__} already built; give the class, so that each "
                            f"rank builds only its own stages' layers")
        if not callable(module_cls):
            raise TypeError(f"LayerSpec needs a module class or factory, got {module_cls!r}")
        self.module_cls = module_cls
        self.args = args
        self.kwargs = kwargs

    @property
    def name(self) -> str:
        return getattr(self.module_cls, "__name__", type(self.module_cls).__name__)

    def build(self, *, seed: int = 0, index: int = 0, device: str | torch.device | None = None) -> nn.Module:
        device = torch.device(device) if device is not None else torch.device("cpu")
        with _seeded(layer_seed(seed, index), device), device:
            module = self.module_cls(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self!r} built {type(module).__name__}, expected an nn.Module")
        return module

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{type(self).__name__}({self.name}, {', '.join(parts)})".replace(", )", ")")


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every spec with the same `key`.

    The classic use is a token embedding tied to the language-model head: the
    first occurrence embeds (`forward_fn=None` calls the module), a later one
    projects with `forward_fn(module, x)`. Every stage that holds the key builds
    the module from the seed of the key's *first* position in the spec list,
    so all copies start identical; the engine sums their gradients before the
    optimizer step. `tied_weight_attr` names the shared parameter(s).
    """

    def __init__(
        self,
        key: str,
        module_cls: Callable[..., nn.Module],
        *args: Any,
        tied_weight_attr: str | list[str] = "weight",
        forward_fn: Callable[[Any, Any], Any] | None = None,  # (the module built here, x)
        **kwargs: Any,
    ):
        super().__init__(module_cls, *args, **kwargs)
        self.key = key
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        self.forward_fn = forward_fn

    def __repr__(self) -> str:
        return f"TiedLayerSpec(key={self.key!r}, {super().__repr__()[len('TiedLayerSpec('):]}"


def tied_first_index(specs: list) -> dict[str, int]:
    """Map each tied key to the global index of its first occurrence."""
    first: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            first.setdefault(spec.key, i)
    return first


def built_module_error(module: nn.Module, index: int) -> TypeError:
    """The error for a built module in a spec list (as DeepSpeed's PipelineModule takes them)."""
    return TypeError(
        f"entry {index} of the spec list is a built nn.Module ({type(module).__name__}); pipekit builds each "
        "layer lazily, only on the rank that holds it, seeded by its index: wrap it as LayerSpec(cls, *args) "
        "(e.g. LayerSpec(nn.Linear, 8, 8) for nn.Linear(8, 8))"
    )


def build_layer(specs: list, index: int, *, seed: int, device=None):
    """Build entry `index` of `specs` the way every rank does: a tied spec is
    seeded by its key's first index, a plain callable is returned as is."""
    spec = specs[index]
    if isinstance(spec, TiedLayerSpec):
        return spec.build(seed=seed, index=tied_first_index(specs)[spec.key], device=device)
    if isinstance(spec, LayerSpec):
        return spec.build(seed=seed, index=index, device=device)
    if isinstance(spec, nn.Module):
        raise built_module_error(spec, index)
    if callable(spec):
        return spec
    raise TypeError(f"entry {index} of the spec list is {spec!r}; expected a LayerSpec, TiedLayerSpec or callable")


def spec_name(spec) -> str:
    """The class name a spec list entry builds (a callable's own name): what
    `type:REGEX` partitions and `checkpoint_layers` match, and errors show."""
    if isinstance(spec, LayerSpec):
        return spec.name
    return getattr(spec, "__name__", type(spec).__name__)


def count_parameters(spec) -> int:
    """Number of parameters of one spec list entry, counted on the meta device."""
    if isinstance(spec, LayerSpec):
        return sum(p.numel() for p in spec.build(device="meta").parameters())
    return 0
