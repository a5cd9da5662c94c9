"""The test oracle: a spec list as one plain nn.Sequential in one process."""

from __future__ import annotations

from torch import nn

from pipekit.spec import LayerSpec, TiedLayerSpec, tied_first_index


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
    mods = []
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
