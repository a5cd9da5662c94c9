"""The process grid: pipeline x data x tensor parallel, on torch's DeviceMesh.

Ranks are laid out row-major over (pp, dp, tp): the tensor-parallel ranks of
one stage replica are neighbours, then its data-parallel replicas
(rank = (pp_rank * dp + dp_rank) * tp + tp_rank), the order Megatron uses to
keep the chattiest collectives (tp) within a node. Expert parallelism joins
as a further dimension later.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("PIPEKIT_TIMEOUT", 300)))


def grid_sizes(world_size: int, pp: int, dp: int | None = None, tp: int = 1) -> tuple[int, int, int]:
    """Check and complete (pp, dp, tp) for `world_size` ranks; raise naming the bad value."""
    for name, value in (("pp", pp), ("tp", tp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={value}")
    if dp is None:
        if world_size % (pp * tp):
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"world size {world_size} is not divisible by pp*tp = {pp}*{tp} = {pp * tp}; "
                f"pp*tp must divide the world size (one of {divisors})"
            )
        dp = world_size // (pp * tp)
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got dp={dp}")
    if pp * dp * tp != world_size:
        raise ValueError(
            f"world size {world_size} does not match pp*dp*tp = {pp}*{dp}*{tp} = {pp * dp * tp}; "
            f"launch {pp * dp * tp} processes or choose pp, dp, tp with product {world_size}"
        )
    return pp, dp, tp


def init_distributed(backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialise the default process group from torchrun's environment if it is not up yet.

    gloo on CPU, NCCL when CUDA is available (override with `backend`).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=timeout)


class Topology:
    """This rank's place in the (pp, dp, tp) grid and the process groups along each axis.

    `Topology(pp=2, tp=2)` on 8 ranks gives dp=2. Requires an initialised
    default process group, except for one plain process (pp=dp=tp=1), which
    needs none; every rank must construct it (group creation is collective).
    Groups of size 1 are None.
    """

    def __init__(self, pp: int = 1, dp: int | None = None, tp: int = 1, device_type: str | None = None):
        if not dist.is_initialized():
            self._init_single(pp, dp, tp, device_type)
            return
        self.world_size = dist.get_world_size()
        self.pp, self.dp, self.tp = grid_sizes(self.world_size, pp, dp, tp)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        self.mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.rank = dist.get_rank()
        self.pp_rank, rest = divmod(self.rank, self.dp * self.tp)
        self.dp_rank, self.tp_rank = divmod(rest, self.tp)
        self.pp_group, self.dp_group, self.tp_group = (
            self.mesh.get_group(name) if size > 1 else None
            for name, size in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
        )

    def _init_single(self, pp: int, dp: int | None, tp: int, device_type: str | None) -> None:
        """One plain process, no process groups: what `PipelineModule(topology=None)` uses."""
        if (pp, dp or 1, tp) != (1, 1, 1):
            raise RuntimeError(
                f"Topology(pp={pp}, dp={dp}, tp={tp}) needs torch.distributed to be initialised; "
                "call pipekit.init_distributed() first, or launch with `pipekit train` / torchrun"
            )
        self.world_size = self.pp = self.dp = self.tp = 1
        self.rank = self.pp_rank = self.dp_rank = self.tp_rank = 0
        self.mesh = self.pp_group = self.dp_group = self.tp_group = None
        self.device = torch.device(device_type or "cpu")

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """Global rank at a grid coordinate; dp_rank and tp_rank default to this rank's."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def __repr__(self) -> str:
        return (
            f"Topology(pp={self.pp}, dp={self.dp}, tp={self.tp}, rank={self.rank} -> "
            f"pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, tp_rank={self.tp_rank})"
        )
