"""ZeRO stage 3 through FSDP2 (`torch.distributed.fsdp.fully_shard`), inside pipeline stages.

`shard_layers(module)` wraps each layer a rank holds (a transformer block, the
embedding, the head; a tied layer once) with `fully_shard` over the stage's
data-parallel group, so each dp rank keeps 1/N of every parameter between steps:
its gradients, fp32 weights and optimizer state are that rank's shard too. With
hybrid sharding (`Topology(dp_shard=S)`, config `parallel.dp_shard`) each run of S
dp ranks shards and the dp / S runs replicate one another (FSDP's HSDP: a
reduce-scatter within the run, an all-reduce across them), so the all-gathers
stay inside a node. Layer
by layer, the parameters are all-gathered before their forward (and, when
resharded after it, before their backward).

Expert-parallel parameters (ep > 1) are sharded by their own `fully_shard`, over
the expert-data-parallel group (the dp ranks holding the same experts), inside
their layer's; at dp = ep they have no replicas and stay as they are.

Within a step FSDP's gradient reduction is off: a layer's gradients accumulate
over the step's microbatches, whichever schedule runs them (split backwards
included: `I` and `W` both add into the gathered parameters' gradients), and
`reduce_gradients` reduce-scatters each layer's once, at the end of the step, as
torch.distributed.pipelining does for FSDP stages. `reshard_after_forward`
trades memory for traffic: False keeps a layer's parameters gathered from its
first use to the end of the step (one all-gather per layer and step), True frees
them after each forward and each backward and gathers them again for the next
(2 per microbatch, 3 with a split backward, whose weight pass gathers them too:
`ZeroOptimizer.gathered`). Either way the step's gradients accumulate whole (in
the reduce dtype) until the one reduce-scatter at its end.

What FSDP does not manage stays as ZeRO stage 0 beside it (`ZeroOptimizer`):
experts without replicas (dp = ep). Frozen parameters (a LoRA base) are sharded, and
offloaded, as the trained ones are (DeepSpeed's ZeRO-3 partitions them too): FSDP gathers
them for their layer's use and gives them no gradient.

FSDP's parameters are DTensors: the attributes pipekit keeps on a parameter
(`tp_shard_dim`, `expert_parallel`, ...) are copied onto them.

Parameter offload (`offload_params=True`, config `optimizer.offload_params=cpu`): FSDP2's
`CPUOffloadPolicy` keeps each sharded parameter (and the gradient shard its reduce-scatter
gives) in host memory between uses, pinned on CUDA: copied to the device for each all-gather,
the reduced gradient copied back. Such a parameter is marked (`host_shard`), and whatever
pipekit communicates of it runs on its mesh's device (`comm_device`), never on the host
tensor itself: `gather_rows` (checkpoints, optimizer state) copies the shard there for the
all-gather and gives the whole tensor back on the shard's device; the optimizer takes its
gradient into a buffer on the device for the step (`ZeroOptimizer`), where the norm, the
non-finite marks, the tied sums and the tp sums are made. On a CPU-only run the host is the
device, but the copies are the GPU run's.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["assign", "autograd_params", "comm_device", "gather_rows", "gathered_for", "gathered_params",
           "host_shard", "own_rows", "reduce_gradients", "replica_group", "shard_group", "shard_groups",
           "shard_layers", "sharded", "whole"]

HOST_SHARD = "pipekit_host_shard"  # the attribute `shard_layers` sets on a parameter FSDP keeps on the host


def sharded(p: torch.Tensor) -> bool:
    """Whether `p` is a parameter FSDP shards (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def host_shard(p: torch.Tensor) -> bool:
    """Whether FSDP keeps `p`'s shard in host memory between uses (parameter offload)."""
    return bool(getattr(p, HOST_SHARD, False))


def comm_device(p: torch.Tensor) -> torch.device:
    """The device the collectives over FSDP parameter `p`'s mesh run on (the topology's: a
    GPU, or the CPU under gloo), wherever its shard lives."""
    mesh = p.device_mesh  # type: ignore[attr-defined]  # a DTensor
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def shard_layers(module, *, reshard_after_forward: bool = False, reduce_dtype: torch.dtype | None = None,
                 offload_params: bool = False, pin_memory: bool = True) -> list[Any]:
    """`fully_shard` every layer of `module` (a PipelineModule) over its topology's dp group;
    the wrapped layers, in module order (none at dp=1: nothing to shard, but with `offload_params`,
    which shards over this rank alone so that FSDP moves them). The parameters keep
    their dtype (a bf16 model gathers bf16); gradients are accumulated over the step and
    reduced in `reduce_dtype` (None: the parameters'). `offload_params`: the shards and their
    gradients in host memory between uses (FSDP2's CPUOffloadPolicy; `pin_memory`: page-locked,
    where the device is a GPU), each such parameter marked `host_shard`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    topo = module.topology
    if topo.dp_group is None and not offload_params:
        return []  # dp=1: nothing to shard (with parameter offload, FSDP over this rank alone moves them)
    if topo.mesh is None:
        raise ValueError("offload_params='cpu' moves the parameters through FSDP, which needs torch.distributed: "
                         "this is one plain process; run it under `pipekit train` or torchrun, or call "
                         "torch.distributed.init_process_group first (a group of one process will do)")
    offload = (CPUOffloadPolicy(pin_memory=pin_memory and topo.device.type == "cuda") if offload_params else
               OffloadPolicy())
    mesh = topo.fsdp_mesh(alone=offload_params)
    split_experts = topo.ep > 1  # experts split over ep: their replicas are the edp group's
    edp = topo.edp_group if split_experts else None
    expert_mesh = DeviceMesh.from_group(edp, topo.device.type) if edp is not None else None
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}
    wrapped: list[Any] = []  # FSDPModule: fully_shard makes each layer's class a subclass of it
    for layer in [*module.layers.values(), *module.tied.values()]:
        # split experts, trained or frozen: each ep rank holds other experts, so only their edp replicas shard them
        experts = {p for p in layer.parameters() if split_experts and getattr(p, "expert_parallel", False)}
        if experts and expert_mesh is not None:  # the experts' own shards over their edp replicas, first
            for part in _holders(layer, experts):
                fully_shard(part, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                            offload_policy=offload)
                wrapped.append(part)
                experts -= set(part.parameters())
            # what no holder took (an expert weight beside others in one module) stays whole: never the dense mesh
        kept = experts  # frozen parameters are sharded (and offloaded) too: FSDP gathers them, gives them no gradient
        if not [p for p in layer.parameters() if p not in kept]:
            continue
        tied = any(layer is t for t in module.tied.values())
        if tied:  # a later use calls forward_fn(layer, x), not the layer: FSDP must see that call too
            layer.call_tied = types.MethodType(_call_tied, layer)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept or None,
                    mp_policy=policy, offload_policy=offload)
        if tied:
            register_fsdp_forward_method(layer, "call_tied")
        wrapped.append(layer)
    for name, p in module.named_parameters():
        for key, value in attrs.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)
        if offload_params and sharded(p):
            setattr(p, HOST_SHARD, True)
    for layer in wrapped:
        layer.set_requires_gradient_sync(False)
        layer.set_reshard_after_backward(reshard_after_forward)
        layer.pipekit_reshard = reshard_after_forward
    return wrapped


def gathered_params(layers: list[Any]) -> dict[int, torch.Tensor]:
    """{id(sharded parameter): the gathered parameter autograd sees in the layers' graphs} (a
    split backward's weight pass must be pointed at those: `ZeroOptimizer.autograd_params`)."""
    out: dict[int, torch.Tensor] = {}
    for layer in layers:
        group = _param_group(layer)
        for fsdp_param in group.fsdp_params if group is not None else ():
            if hasattr(fsdp_param, "_unsharded_param"):
                out[id(fsdp_param.sharded_param)] = fsdp_param._unsharded_param
    return out


# ---- the optimizer's side: ZeroOptimizer at stage 3 --------------------------------
def shard_groups(module, groups: list[dict], *, reshard_after_forward: bool, reduce_dtype: torch.dtype,
                 offload_params: bool = False, pin_memory: bool = True) -> tuple[list[Any], list[dict]]:
    """Shard the layers of `module` (`shard_layers`); (the wrapped layers, `groups` with the
    module's parameters replaced by FSDP's, found by name)."""
    if module is None or not hasattr(module, "topology"):
        raise ValueError("ZeRO stage 3 shards the layers of a PipelineModule: pass the module (as params, "
                         "or module=)")
    names = {id(p): n for n, p in module.named_parameters()}
    layers = shard_layers(module, reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype,
                          offload_params=offload_params, pin_memory=pin_memory)
    now = dict(module.named_parameters())
    return layers, [{**g, "params": [now[names[id(p)]] if id(p) in names else p for p in g["params"]]}
                    for g in groups]


@contextlib.contextmanager
def gathered_for(layers: list[Any], params: list):
    """The layers resharded after forward (`reshard_after_forward`) that hold `params`,
    gathered for the block inside (a split backward's weight pass, after its input pass
    resharded them), resharded after."""
    resharding: list[Any] = [layer for layer in layers if getattr(layer, "pipekit_reshard", False)]
    ids = {id(p) for p in params}
    mine = [layer for layer in resharding if any(id(p) in ids for p in layer.parameters())]
    for layer in mine:
        layer.unshard()
    try:
        yield
    finally:
        for layer in mine:
            layer.reshard()


def autograd_params(layers: list[Any], params: list) -> list:
    """The tensors autograd differentiates for `params` in a forward run now: the parameters
    themselves, but FSDP's gathered copies of those `layers` shard."""
    if not layers:
        return params
    gathered = gathered_params(layers)
    return [gathered.get(id(p), p) for p in params]


def _holders(layer: nn.Module, params: set) -> list[nn.Module]:
    """The submodules of `layer` whose own parameters are all in `params` (the experts' grouped
    weights), outermost first."""
    out: list[nn.Module] = []
    for sub in layer.modules():
        own = list(sub.parameters(recurse=False))
        if own and all(p in params for p in own) and not any(o in out for o in _ancestors(layer, sub)):
            out.append(sub)
    return out


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    for name, sub in root.named_modules():
        if sub is target:
            parts = name.split(".") if name else []
            return [root.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
    return []


def _call_tied(layer: nn.Module, forward_fn, x):
    """A tied layer's later use (`TiedLayerSpec.forward_fn`, the head of tied embeddings), as
    a method of the layer, so that FSDP gathers its parameters for it (and for its backward)."""
    return forward_fn(layer, x)


def reduce_gradients(layers: list[Any]) -> set[int]:
    """Reduce-scatter the step's accumulated gradients of `layers` (every dp rank calls this
    with the same layers), leaving each parameter's `.grad` its rank's shard, and reshard the
    parameters. Returns the ids of the sharded parameters that got a gradient on this rank.

    Every rank must reduce the same parameters, so one that got no gradient here (an unused
    layer on this rank) is reduced as zeros; the ids say which ones really got one."""
    touched: set[int] = set()
    for layer in layers:
        group = _param_group(layer)
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            full, accumulated = fsdp_param._unsharded_param, fsdp_param.unsharded_accumulated_grad
            if full.grad is None and accumulated is None:
                full.grad = torch.zeros_like(full)
            else:
                touched.add(id(fsdp_param.sharded_param))
            if accumulated is not None and full.grad is not None:  # the last pass's, into the earlier ones'
                accumulated += full.grad
                full.grad = None
            fsdp_param.to_accumulated_grad_if_needed()  # every gradient in the reduce dtype: one reduce-scatter
        layer.set_requires_gradient_sync(True)
        layer.set_reshard_after_backward(True)
        layer.set_is_last_backward(True)
        group.post_backward()  # as torch.distributed.pipelining's stages do after their last backward
        group.finalize_backward()  # on a GPU: the current stream waits for the reduce-scatter
        layer.set_requires_gradient_sync(False)
        layer.set_reshard_after_backward(layer.pipekit_reshard)
    return touched


def _param_group(layer: nn.Module) -> Any:
    """FSDP's parameter group of a wrapped layer (private to torch; torch's pipelining reaches
    it the same way to run a stage's post-backward after its last microbatch)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(layer)  # type: ignore[attr-defined]
    return state._fsdp_param_group


# ---- whole tensors from shards, and back (checkpoints) ------------------------------
def _rows(total: int, n: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s dim-0 rows of `total` split over `n` as torch.chunk (and
    FSDP, and DTensor's Shard(0)) splits them: ceil(total / n) each, the last ones short or empty."""
    size = -(-total // n) if total else 0
    return min(rank * size, total), min((rank + 1) * size, total)


def gather_rows(local: torch.Tensor, shape: torch.Size | tuple, group,
                device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor of `shape` from every rank's dim-0 shard (`local`, any shape holding its
    elements) over `group`: one all-gather of equal, padded pieces, on `device` (the group's:
    `comm_device`; None: `local`'s), where `local` is copied; the whole tensor is given back on
    `local`'s device (a host shard's stays in host memory)."""
    n, rows = dist.get_world_size(group), shape[0] if len(shape) else 1
    per_row = max(1, int(torch.Size(shape).numel()) // max(rows, 1))
    piece = -(-rows // n) * per_row if rows else 0
    flat = torch.zeros(piece, dtype=local.dtype, device=device or local.device)
    flat[:local.numel()] = local.reshape(-1)
    parts = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(parts, flat, group=group)
    whole = torch.cat([part[:(_rows(rows, n, r)[1] - _rows(rows, n, r)[0]) * per_row] for r, part in enumerate(parts)])
    return whole.view(shape).to(local.device)


def own_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's dim-0 rows of `full` over `group` (no communication)."""
    start, end = _rows(full.shape[0], dist.get_world_size(group), dist.get_rank(group))
    return full[start:end]


def shard_group(p: torch.Tensor):
    """The group FSDP splits `p` over: its mesh's last dim (the shard dim of a hybrid mesh)."""
    return p.device_mesh.get_group(p.device_mesh.ndim - 1)  # type: ignore[attr-defined]  # a DTensor


def replica_group(p: torch.Tensor):
    """The group of `p`'s replicas under hybrid sharding (a 2-D mesh's first dim), else None."""
    mesh = p.device_mesh  # type: ignore[attr-defined]  # a DTensor
    return mesh.get_group(0) if mesh.ndim > 1 else None


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor (FSDP's shard) gathered over its shard group (collective, on its
    mesh's device: `gather_rows`; the replicas of hybrid sharding hold the same rows), on the
    shard's device; else itself."""
    if not sharded(t):
        return t
    return gather_rows(t.to_local(), t.shape, shard_group(t), device=comm_device(t))  # type: ignore[attr-defined]


def assign(t: torch.Tensor, value: torch.Tensor) -> None:
    """Copy whole tensor `value` into `t`: into its local rows when `t` is FSDP's shard."""
    if sharded(t):
        group = shard_group(t)
        t.to_local().copy_(own_rows(value, group).reshape(t.to_local().shape))  # type: ignore[attr-defined]
    else:
        t.copy_(value)
