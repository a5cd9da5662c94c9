"""Layout-free weights: gather a full state dict from any layout, load one into any layout.

A parameter's name is the same in every layout (`layers.7.attn.q.weight`,
`tied.embed.wte.weight`), and a tensor-parallel shard is a slice of the full
tensor along the dim recorded in its `tp_shard_dim` attribute. So a *full*
state dict — every name once, every tensor whole — describes the model
independently of pp/dp/tp, and is what `pipekit train` saves at the end,
what `pipekit generate` loads, and what HuggingFace conversion reads and
writes. (Sharded, resumable checkpoints come with their own issue.)

Files are written to a temporary name and renamed when complete, so a
reader never sees a half-written file.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .pipeline import PipelineModule


def _shard_dim(t: torch.Tensor) -> int | None:
    return getattr(t, "tp_shard_dim", None)


def _local_tensors(module: PipelineModule) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by their stable names."""
    return dict(module.state_dict(keep_vars=True))


def full_state_dict(module: PipelineModule) -> dict[str, torch.Tensor]:
    """The whole model's weights as full CPU tensors, returned on every rank.

    Communication: one all-gather over tp per sharded tensor, then one
    all_gather_object over pp of this stage's (gathered) tensors. Meant for
    export and end-of-run saves of models that fit in host memory."""
    topo = module.topology
    local = {}
    for name, t in _local_tensors(module).items():
        dim = _shard_dim(t)  # read before detach(), which drops the attribute
        t = t.detach()
        if dim is not None and topo.tp_group is not None:
            parts = [torch.empty_like(t) for _ in range(topo.tp)]
            dist.all_gather(parts, t.contiguous(), group=topo.tp_group)
            t = torch.cat(parts, dim=dim)
        local[name] = t.to("cpu", copy=True)  # a copy: later training must not change what was returned
    if topo.pp_group is None:
        return local
    pieces: list = [None] * topo.pp
    dist.all_gather_object(pieces, local, group=topo.pp_group)
    full: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for name, t in piece.items():
            full.setdefault(name, t)
    return full


def load_full_state_dict(module: PipelineModule, full: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy this rank's share of a full state dict into `module` (no communication)."""
    topo = module.topology
    local = _local_tensors(module)
    missing = sorted(set(local) - set(full))
    if missing and strict:
        raise KeyError(f"the state dict lacks {len(missing)} tensors this rank needs, e.g. {missing[:5]}")
    with torch.no_grad():
        for name, t in local.items():
            if name not in full:
                continue
            src = full[name]
            dim = _shard_dim(t)
            if dim is not None and topo.tp > 1:
                src = src.chunk(topo.tp, dim=dim)[topo.tp_rank]
            if src.shape != t.shape:
                raise ValueError(f"{name}: this rank holds shape {tuple(t.shape)}, the state dict gives {tuple(src.shape)}")
            t.copy_(src)


def atomic_save(obj, path: str) -> None:
    """torch.save to `path` via a temporary file in the same directory and a rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
