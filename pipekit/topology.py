"""The process grid: pipeline x data parallel, on torch's DeviceMesh.

Ranks are laid out row-major over (pp, dp), so the data-parallel replicas of
one pipeline stage are neighbours (rank = pp_rank * dp + dp_rank), the order
Megatron uses to keep the heaviest collectives within a node. Tensor and
expert parallelism join as further mesh dimensions later.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("PIPEKIT_TIMEOUT", 300)))


def grid_sizes(world_size: int, pp: int, dp: int | None = None) -> tuple[int, int]:
    """Check and complete (pp, dp) for `world_size` ranks; raise naming the bad value."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got pp={pp}")
    if dp is None:
        if world_size % pp:
            raise ValueError(
                f"world size {world_size} is not divisible by pp={pp}; "
                f"pp must divide the world size (e.g. one of {[d for d in range(1, world_size + 1) if world_size % d == 0]})"
            )
        dp = world_size // pp
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got dp={dp}")
    if pp * dp != world_size:
        raise ValueError(
            f"world size {world_size} does not match pp*dp = {pp}*{dp} = {pp * dp}; "
            f"launch {pp * dp} processes or choose pp, dp with pp*dp = {world_size}"
        )
    return pp, dp


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
    """This rank's place in the (pp, dp) grid and the process groups along each axis.

    `Topology(pp=2)` on 8 ranks gives dp=4. Requires an initialised default
    process group; every rank must construct it (group creation is collective).
    """

    def __init__(self, pp: int = 1, dp: int | None = None, device_type: str | None = None):
        if not dist.is_initialized():
            self._init_single(pp, dp, device_type)
            return
        self.world_size = dist.get_world_size()
        self.pp, self.dp = grid_sizes(self.world_size, pp, dp)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        self.mesh = init_device_mesh(device_type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank = divmod(self.rank, self.dp)
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")

    def _init_single(self, pp: int, dp: int | None, device_type: str | None) -> None:
        """One plain process, no process groups: what `PipelineModule(topology=None)` uses."""
        if (pp, dp or 1) != (1, 1):
            raise RuntimeError(
                f"Topology(pp={pp}, dp={dp}) needs torch.distributed to be initialised; "
                "call pipekit.init_distributed() first, or launch with `pipekit train` / torchrun"
            )
        self.world_size = self.pp = self.dp = 1
        self.rank = self.pp_rank = self.dp_rank = 0
        self.mesh = self.pp_group = self.dp_group = None
        if device_type is None:
            device_type = "cpu"
        self.device = torch.device(device_type)

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank at grid coordinate (pp_rank, dp_rank); dp_rank defaults to this rank's."""
        return pp_rank * self.dp + (self.dp_rank if dp_rank is None else dp_rank)

    def __repr__(self) -> str:
        return f"Topology(pp={self.pp}, dp={self.dp}, rank={self.rank} -> pp_rank={self.pp_rank}, dp_rank={self.dp_rank})"
