"""The process grid: pipeline x data x tensor parallel, on torch's DeviceMesh, with
expert parallelism and ZeRO-3's hybrid sharding carved out of the data-parallel axis.

Ranks are laid out row-major over (pp, dp, tp): the tensor-parallel ranks of
one stage replica are neighbours, then its data-parallel replicas
(rank = (pp_rank * dp + dp_rank) * tp + tp_rank), the order Megatron uses to
keep the chattiest collectives (tp) within a node. Expert parallelism is no
axis of its own: runs of `ep` consecutive dp ranks share out the experts, on a
second (pp, edp, ep, tp) mesh; hybrid sharding likewise splits dp into
(dp_replicate, dp_shard). Expert tensor parallelism and sequence parallelism
reuse the tp group. There is no context-parallel axis.

Devices: one GPU per worker or none. `resolve_device` decides from the
number of visible GPUs and of workers on this node, before any group exists;
`init_distributed` and `Topology` follow its answer.

Launchers: the same script runs as one plain process (`python script.py`: no
group, `Topology()` is the 1x1x1 grid), under torchrun / `pipekit train`, and
under `torch.multiprocessing` (the script's own `init_process_group`, or
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set and `init_distributed()`).
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .rules import check_dp_shard, check_ep

TIMEOUT_ENV = "PIPEKIT_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def default_timeout() -> datetime.timedelta:
    """How long a receive or a collective waits for its peer: PIPEKIT_TIMEOUT's seconds (300 when
    unset), read when a group or an engine is made, never at import (a bad value must not break
    every subcommand); ValueError in one line naming it when it is not a finite number > 0."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a finite number of seconds > 0 (how long a receive waits "
                         f"for its peer; default {DEFAULT_TIMEOUT_S:g}); unset it or give e.g. {TIMEOUT_ENV}=600")
    return datetime.timedelta(seconds=seconds)


def _check_sizes(**sizes) -> None:
    """Topology's sizes are ints >= 1 (dp and dp_shard may be None), before anything else: a
    string or a float would otherwise surface as a distributed error far from its cause."""
    for name, value in sizes.items():
        if value is None and name in ("dp", "dp_shard"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Topology({name}={value!r}): {name} must be an int >= 1"
                             + (" (or None: what the world size leaves)" if name == "dp" else
                                " (or None: all of dp)" if name == "dp_shard" else ""))


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


DEVICES = ("auto", "cpu", "cuda")


def count_visible_gpus() -> int:
    """CUDA devices this process can see (after CUDA_VISIBLE_DEVICES); 0 when CUDA is not available."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_workers(default: int = 1) -> int:
    """Workers on this node: torchrun's LOCAL_WORLD_SIZE when set, else `default`
    (1 for a plain process; the whole world for a single-node launch not yet started)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def local_rank_and_workers(rank: int, world_size: int) -> tuple[int, int]:
    """(this worker's index on its node, workers on the node): torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE when set; without them (torch.multiprocessing, or a script that sets
    RANK and WORLD_SIZE itself) every worker is taken to be on this node, as
    `torch.multiprocessing.spawn` starts them: (rank, world_size). A multi-node launch
    of your own sets both."""
    workers = local_workers(world_size)
    return int(os.environ.get("LOCAL_RANK", rank % workers)), workers


def _launched_world() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) from the environment, None when neither is set; ValueError for one
    without the other."""
    have = [k for k in ("RANK", "WORLD_SIZE") if k in os.environ]
    if not have:
        return None
    if len(have) == 1:
        other = "WORLD_SIZE" if have == ["RANK"] else "RANK"
        raise ValueError(f"{have[0]}={os.environ[have[0]]} is set but {other} is not; a launcher sets both "
                         "(torchrun does), or neither for one plain process")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def resolve_device(requested: str, local_workers: int, visible_gpus: int | None = None) -> tuple[str, str]:
    """("cuda" or "cpu", a one-line reason) for `local_workers` workers on a node with
    `visible_gpus` GPUs (None: count them; 0 without CUDA). Pure given the counts.

    The plan is one GPU per worker or none at all: "auto" takes CUDA only when every
    local worker gets its own GPU, else the CPU with gloo; "cuda" with too few GPUs
    raises ValueError naming both counts and the ways out; "cpu" always gives the CPU.
    Limit: only counts are compared (not memory, not whether the GPUs are busy).
    """
    if requested not in DEVICES:
        raise ValueError(f"device {requested!r} is not one of {list(DEVICES)}")
    if local_workers < 1:
        raise ValueError(f"local_workers must be >= 1, got {local_workers}")
    gpus = count_visible_gpus() if visible_gpus is None else visible_gpus
    counts = f"{_plural(gpus, 'GPU')} visible for {_plural(local_workers, 'local worker')}"
    if requested == "cpu":
        return "cpu", f"train.device=cpu: using the CPU with gloo ({counts})"
    if gpus >= local_workers:
        return "cuda", f"{requested}: {counts}; one GPU per worker with NCCL"
    if requested == "cuda":
        way_out = (f"run at most {_plural(gpus, 'worker')} per node (smaller pp*dp*tp, or spread them over more "
                   "nodes), or set train.device=cpu") if gpus else "set train.device=cpu, or run on nodes with GPUs"
        raise ValueError(f"train.device=cuda needs a GPU per local worker, but {counts}; {way_out}")
    if gpus == 0:
        return "cpu", "auto: no CUDA device visible; using the CPU with gloo"
    return "cpu", (f"auto: {counts}; using the CPU with gloo (set parallel sizes so each node has a GPU per "
                   "worker, or train.device=cpu to silence this)")


def fell_back(requested: str, device: str) -> bool:
    """Whether "auto" chose the CPU although some GPU is visible: the case worth a notice."""
    return requested == "auto" and device == "cpu" and count_visible_gpus() > 0


def init_distributed(
    backend: str | None = None, timeout: datetime.timedelta | None = None, device: str = "auto"
) -> None:
    """Initialise the default process group from the environment if it is not up yet.

    One call for every way a script is started:

    - a group already up (the script called `init_process_group` itself, as under
      `torch.multiprocessing`): nothing;
    - one plain process (neither RANK nor WORLD_SIZE set): nothing; `Topology()`
      works without a group;
    - under torchrun / `pipekit train`: its RANK, WORLD_SIZE, MASTER_ADDR and
      MASTER_PORT, over its store with a prefix per restart attempt;
    - RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by the script itself (e.g. in
      `torch.multiprocessing.spawn` workers): the env:// rendezvous, as torchrun's;
    - RANK=0 and WORLD_SIZE=1 without MASTER_ADDR: a group of one rank over an
      in-process store (no port). WORLD_SIZE > 1 without MASTER_ADDR or MASTER_PORT
      raises ValueError naming what is missing.

    The device comes from `resolve_device(device, workers on this node)` (see
    `local_rank_and_workers`): NCCL and `torch.cuda.set_device(local rank)` for CUDA,
    gloo for the CPU (`backend` overrides the backend; an explicit "nccl" still sets
    the CUDA device). `timeout` None: PIPEKIT_TIMEOUT's seconds, else 300.
    """
    if dist.is_initialized():
        return
    launched = _launched_world()
    if launched is None:
        return
    rank, world = launched
    timeout = timeout if timeout is not None else default_timeout()  # PIPEKIT_TIMEOUT, else 300 s
    local_rank, workers = local_rank_and_workers(rank, world)
    kind, _ = resolve_device(device, workers)
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    if kind == "cuda" or backend == "nccl":
        torch.cuda.set_device(local_rank)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and world == 1:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=rank, world_size=1, timeout=timeout)
        return
    if missing:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are set but {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not: set MASTER_ADDR and MASTER_PORT to the "
                         "address and a free port of rank 0 (torchrun sets all four), or call "
                         "torch.distributed.init_process_group(...) yourself before pipekit")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # Under torchrun: its store, with a prefix per restart attempt. torch 2.13 reuses the
    # agent's store across `--max-restarts` restarts (same port, same keys), so the ranks of
    # a restart would read the dead attempt's addresses and gloo would wait on dead peers.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store: dist.Store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store)
    store = dist.PrefixStore(f"pipekit/attempt_{restart}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def init_alone(device: str = "cpu", timeout: datetime.timedelta | None = None) -> None:
    """A process group of this process alone, over an in-process store (no port), where none is
    up: what FSDP (parameter offload) needs in a run of one process. gloo, or NCCL on a GPU."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, timeout=timeout if timeout is not None else default_timeout())


CP_MODES = ("ring", "ulysses")  # how attention crosses the cp ranks (pipekit.layers.context)


class Topology:
    """This rank's place in the (pp, dp, tp) grid and the process groups along each axis.

    With `ep` > 1 (dividing dp) the dp axis is also split into (edp, ep): experts are
    sharded over `ep_group` and their gradients reduced over `edp_group`.

    With `cp` > 1 (context parallelism) the world is pp x dp x tp x cp: each of the `dp`
    data replicas is `cp` ranks that read the same rows and hold two chunks each of every
    sequence (`pipekit.layers.context`), passing keys and values over `cp_group`. The dp
    axis (`dp`, `dp_rank`, `dp_group`) is then the data replicas x cp: every rank holding
    the same parameters, over which gradients are reduced and ZeRO shards; `data_dp` and
    `data_rank` say which rows a rank reads (`data_dp` = the `dp` given), `cp_rank` its
    place in its cp group. At cp=1 data_dp = dp and data_rank = dp_rank. `cp_mode`: "ring"
    (keys and values passed around the cp ranks) or "ulysses" (all-to-all to head shards).

    With `expert_tp` (Megatron's expert tensor parallelism), MoE layers split each
    expert's hidden dimension over the tp group (`etp_group`, the tp group itself; None
    without it, or at tp=1): `etp` is then tp, else 1.

    With `sequence_parallel` (Megatron's sequence parallelism; a no-op at tp=1) the layers
    built on this topology split the activations outside their tp regions along the
    sequence over the tp group (`pipekit.layers.parallel.sequence_parallel`): the attribute
    `sequence_parallel` is then True.

    `Topology(pp=2, tp=2)` on 8 ranks gives dp=2. Uses the default process group;
    when none is up but a launcher's RANK and WORLD_SIZE > 1 are in the
    environment (torchrun, or torch.multiprocessing workers that set them), it
    first calls `init_distributed(device=...)`. One plain process (pp=dp=tp=1)
    needs no group; `alone=True` makes that one-process grid even inside a job (the
    planner profiles layers so, beside the job's other ranks). Every rank must construct
    it (group creation is collective). Groups of size 1 are None. Every attribute exists
    on every Topology (a one-process grid too): callers never need a default.

    `device` is "auto", "cpu" or "cuda" (`device_type` is an older alias). With a
    process group, "auto" (or None) follows the backend: CUDA for NCCL, else the
    CPU. A plain process resolves "auto" with `resolve_device` (its GPU when it
    has one); None keeps it on the CPU, the library default (`pipekit train`
    always passes `train.device`).
    """

    mesh: DeviceMesh | None  # the (pp, dp, tp) mesh; None in one plain process
    moe_mesh: DeviceMesh | None  # the (pp, edp, ep, tp) mesh when ep > 1, else None
    hsdp_mesh: DeviceMesh | None  # the (pp, dp_replicate, dp_shard, tp) mesh with hybrid sharding, else None

    def __init__(self, pp: int = 1, dp: int | None = None, tp: int = 1, device_type: str | None = None,
                 device: str | None = None, ep: int = 1, expert_tp: bool = False,
                 sequence_parallel: bool = False, dp_shard: int | None = None, alone: bool = False, cp: int = 1,
                 cp_mode: str = "ring"):
        _check_sizes(pp=pp, dp=dp, tp=tp, ep=ep, dp_shard=dp_shard, cp=cp)
        for name, flag in (("expert_tp", expert_tp), ("alone", alone)):
            if not isinstance(flag, bool):
                raise TypeError(f"Topology({name}=...) must be True or False, got {flag!r}")
        device = _one_device_arg(device, device_type)
        if cp_mode not in CP_MODES:
            raise ValueError(f"Topology(cp_mode={cp_mode!r}) is not one of {list(CP_MODES)}")
        self.cp_mode = cp_mode
        self.dp_shard = dp_shard
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
        if not alone and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:  # a launcher's
            init_distributed(device=device or "auto")
        if alone or not dist.is_initialized():
            self._init_single(pp, dp, tp, device, cp)
            check_ep(ep, 1)
            check_dp_shard(dp_shard, 1)
            return
        self.world_size = dist.get_world_size()
        if self.world_size % cp:
            raise ValueError(f"Topology(cp={cp}) on {self.world_size} ranks: cp must divide the world size "
                             f"(world = pp * dp * tp * cp)")
        self.pp, data_dp, self.tp = grid_sizes(self.world_size // cp, pp, dp, tp)
        self.cp, self.data_dp = cp, data_dp
        self.dp = data_dp * cp  # the ranks holding the same parameters: data replicas x cp
        device_type = _group_device(device)
        self.device = (torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        self.mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.rank = dist.get_rank()
        self.pp_rank, rest = divmod(self.rank, self.dp * self.tp)
        self.dp_rank, self.tp_rank = divmod(rest, self.tp)
        self.pp_group, self.dp_group, self.tp_group = (
            self.mesh.get_group(name) if size > 1 else None
            for name, size in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
        )
        self._init_context_groups(device_type)
        self._init_expert_groups(ep, device_type)
        self.etp, self.etp_group = (self.tp, self.tp_group) if expert_tp else (1, None)
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self._init_hybrid(dp_shard, device_type)

    def _init_hybrid(self, dp_shard: int | None, device_type: str) -> None:
        """ZeRO-3's hybrid sharding: `dp_shard` consecutive dp ranks shard the parameters, and the
        dp // dp_shard such groups replicate each other (`hsdp_mesh`, the (pp, dp_replicate,
        dp_shard, tp) mesh; None when every dp rank shards)."""
        self.hsdp_mesh = None
        if dp_shard is None:
            self.dp_shard = self.dp
            return
        check_dp_shard(dp_shard, self.dp)
        if dp_shard < self.dp:
            self.hsdp_mesh = init_device_mesh(device_type, (self.pp, self.dp // dp_shard, dp_shard, self.tp),
                                              mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))

    def fsdp_mesh(self, alone: bool = False) -> DeviceMesh | None:
        """The mesh ZeRO-3 shards a stage's parameters over: this rank's dp ranks (1-D), or with
        hybrid sharding its (dp_replicate, dp_shard) part (2-D); None at dp=1, or with `alone`
        (parameter offload) this rank by itself."""
        if self.dp_group is None:
            return self.mesh["dp"] if alone and self.mesh is not None else None
        if self.hsdp_mesh is not None:
            return self.hsdp_mesh["dp_replicate", "dp_shard"]
        assert self.mesh is not None  # a dp group lies on the mesh
        return self.mesh["dp"]

    def backward_twins(self) -> dict:
        """{group: a second group of the same ranks} for the groups the model's layers talk
        over (tp, the tp of the experts, ep), made once (every rank of the world must call
        this at the same point, as it must any `new_group`): the lanes of `pipekit.comm.lane`."""
        if getattr(self, "_twins", None) is None:
            self._twins = {}
            meshes = [(self.mesh, "tp", self.tp_group), (self.moe_mesh, "ep", self.ep_group)]
            for mesh, dim, group in meshes:
                if mesh is None or group is None:
                    continue
                assert mesh.mesh_dim_names is not None  # both meshes are made with their dims' names
                d = mesh.mesh_dim_names.index(dim)
                members = mesh.mesh.movedim(d, -1).reshape(-1, mesh.mesh.shape[d]).tolist()
                for ranks in members:  # every rank makes every group, in one order
                    twin = dist.new_group(ranks)
                    if self.rank in ranks:
                        self._twins[group] = twin
        return self._twins

    def _init_context_groups(self, device_type: str) -> None:
        """Context parallelism: each run of `cp` consecutive ranks of the dp axis holds the same
        rows, each rank its two chunks of every sequence (`pipekit.layers.context`), and
        attention passes keys and values over `cp_group` (the (pp, data_dp, cp, tp) mesh's cp
        dimension). `data_rank` / `data_dp`: which rows this rank's replica reads, of how many."""
        self.data_rank, self.cp_rank = divmod(self.dp_rank, self.cp)
        self.cp_mesh = self.cp_group = None
        if self.cp > 1:
            self.cp_mesh = init_device_mesh(device_type, (self.pp, self.data_dp, self.cp, self.tp),
                                            mesh_dim_names=("pp", "data", "cp", "tp"))
            self.cp_group = self.cp_mesh.get_group("cp")

    def _init_expert_groups(self, ep: int, device_type: str) -> None:
        """Expert parallelism: each run of `ep` consecutive dp ranks shares out the experts
        (`ep_group`); the dp ranks holding the same experts form `edp_group` (dp // ep ranks),
        over which expert gradients are reduced."""
        check_ep(ep, self.dp)
        self.ep, self.edp = ep, self.dp // ep
        self.edp_rank, self.ep_rank = divmod(self.dp_rank, ep)
        self.moe_mesh = self.ep_group = None
        self.edp_group = self.dp_group
        if ep > 1:
            self.moe_mesh = init_device_mesh(device_type, (self.pp, self.edp, ep, self.tp),
                                             mesh_dim_names=("pp", "edp", "ep", "tp"))
            self.ep_group = self.moe_mesh.get_group("ep")
            self.edp_group = self.moe_mesh.get_group("edp") if self.edp > 1 else None

    def _init_single(self, pp: int, dp: int | None, tp: int, device: str | None, cp: int = 1) -> None:
        """One plain process, no process groups: what `PipelineModule(topology=None)` uses."""
        if (pp, dp or 1, tp, cp) != (1, 1, 1, 1):
            raise RuntimeError(
                f"Topology(pp={pp}, dp={dp}, tp={tp}{f', cp={cp}' if cp > 1 else ''}) needs torch.distributed to be "
                "initialised, but no group "
                "is up and no launcher started more workers (RANK, WORLD_SIZE); launch with `pipekit "
                "train` / torchrun, or in torch.multiprocessing workers call torch.distributed."
                "init_process_group(...) (or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE and call "
                "pipekit.init_distributed())"
            )
        self.world_size = self.pp = self.dp = self.tp = self.cp = self.data_dp = 1
        self.rank = self.pp_rank = self.dp_rank = self.tp_rank = self.cp_rank = self.data_rank = 0
        self.cp_mesh = self.cp_group = None
        self.mesh = self.pp_group = self.dp_group = self.tp_group = None
        self.ep = self.edp = 1
        self.ep_rank = self.edp_rank = 0
        self.moe_mesh = self.ep_group = self.edp_group = None
        self.etp, self.etp_group = 1, None
        self.sequence_parallel = False  # one process: tp=1
        self.hsdp_mesh, self.dp_shard = None, 1
        kind = "cpu" if device is None else resolve_device(device, local_workers())[0]
        self.device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """Global rank at a grid coordinate; dp_rank and tp_rank default to this rank's."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def __repr__(self) -> str:
        return (
            f"Topology(pp={self.pp}, dp={self.data_dp}, tp={self.tp}" + (f", cp={self.cp}" if self.cp > 1 else "")
            + (f", ep={self.ep}" if self.ep > 1 else "")
            + f", rank={self.rank} -> pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, tp_rank={self.tp_rank}"
            + (f", ep_rank={self.ep_rank}" if self.ep > 1 else "")
            + (f", expert_tp={self.etp}" if self.etp > 1 else "")
            + (", sequence_parallel=True)" if self.sequence_parallel else ")")
        )


def _one_device_arg(device: str | None, device_type: str | None) -> str | None:
    """`device`, or its alias `device_type`; both given must agree."""
    if device is not None and device_type is not None and device != device_type:
        raise ValueError(f"Topology got device={device!r} and device_type={device_type!r}; "
                         "pass one of them (device_type is an alias of device)")
    device = device if device is not None else device_type
    if device is not None and device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {list(DEVICES)}")
    return device


def _group_device(device: str | None) -> str:
    """The device type of a rank in a process group: the backend's for None or "auto"
    (CUDA for NCCL, else the CPU); "cuda" is checked against this node's GPUs."""
    if device in (None, "auto"):
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return resolve_device(device, local_workers())[0]
