"""Layout-free weights: gather a full state dict from any layout, load one into any layout.

A parameter's name is the same in every layout (`layers.7.attn.q.weight`,
`tied.embed.wte.weight`), and a tensor-parallel shard is a slice of the full
tensor along the dim recorded in its `tp_shard_dim` attribute (an expert
tensor: along `ep_shard_dim` over ep, and with expert tensor parallelism also
along its hidden dim over tp). So a *full*
state dict — every name once, every tensor whole — describes the model
independently of pp/dp/tp, and is what `pipekit train` saves at the end,
what `pipekit generate` loads, and what HuggingFace conversion reads and
writes. Resumable checkpoints (below) use the same names, sharded, through
torch.distributed.checkpoint, with the optimizer state by parameter name.

Files are written to a temporary name and renamed when complete, so a
reader never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DCPException  # a BaseException

from .atomic import free_space, fsync_dir, no_space_left, publish_dir, torch_save_atomic, write_atomic
from .optim.fsdp import assign, whole
from .pipeline import PipelineModule

Sharding = tuple[tuple[int, str], ...]  # ((dim, axis), ...): split along each dim over the "ep" or "tp" axis


def _shard_dim(t: torch.Tensor) -> Sharding:
    """How a parameter is split: an expert shard (`expert_parallel`) along its `ep_shard_dim`
    over ep, a tp shard along its `tp_shard_dim` over tp (an expert-TP shard: both); () when
    replicated."""
    out = []
    ep_dim = getattr(t, "ep_shard_dim", None)
    if getattr(t, "expert_parallel", False) and ep_dim is not None:
        out.append((ep_dim, "ep"))
    dim = getattr(t, "tp_shard_dim", None)
    if dim is not None:
        out.append((dim, "tp"))
    return tuple(out)


def _axis(module: PipelineModule, axis: str) -> tuple[int, int, object]:
    """(size, this rank's index, group) of the "tp" or "ep" axis."""
    topo = module.topology
    if axis == "ep":
        return topo.ep, topo.ep_rank, topo.ep_group
    return topo.tp, topo.tp_rank, topo.tp_group


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
        sharding = _shard_dim(t)  # read before detach(), which drops the attribute
        t = whole(t.detach())  # ZeRO-3: gathered over dp
        for dim, axis in sharding:
            size, _, group = _axis(module, axis)
            if size > 1:
                t = t.to(topo.device)  # a host-held ZeRO-3 shard's whole (parameter offload): gathered on the device
                parts = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(parts, t.contiguous(), group=group)
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
    local = _local_tensors(module)
    missing = sorted(set(local) - set(full))
    if missing and strict:
        raise KeyError(f"the state dict lacks {len(missing)} tensors this rank needs, e.g. {missing[:5]}")
    with torch.no_grad():
        for name, t in local.items():
            if name not in full:
                continue
            src = full[name]
            for dim, axis in _shard_dim(t):
                size, index, _ = _axis(module, axis)
                src = src.chunk(size, dim=dim)[index]
            if src.shape != t.shape:
                raise ValueError(
                    f"{name}: this rank holds shape {tuple(t.shape)}, the state dict gives {tuple(src.shape)}")
            assign(t, src)


def atomic_save(obj, path: str) -> None:
    """torch.save to `path` atomically (see pipekit.atomic)."""
    torch_save_atomic(obj, path)


# ---- resumable checkpoints -------------------------------------------------------
# A checkpoint is a directory written by torch.distributed.checkpoint (DCP): every rank
# writes its own tensors, under names that do not depend on the layout:
#
#   model/<name>            a parameter or persistent buffer (`layers.7.attn.q.weight`)
#   optim/<name>/<key>      its optimizer state (exp_avg, exp_avg_sq, master; step is 0-dim)
#   rng/<rank>              each rank's RNG state (restored only at the same layout)
#
# A tensor-parallel shard is a DTensor sharded along its `tp_shard_dim` over the tp mesh,
# so DCP records it as a slice of the full tensor; a tensor held by several ranks (dp
# replicas, tp-replicated, a tied weight on two pipeline ranks) is written once. Loading
# at any other (pp, tp, dp, ZeRO stage, schedule, partition) reads exactly the slices a
# rank needs. Beside the tensors, `pipekit.json` holds what is not a tensor (the step,
# data position, LR schedule, loss scale, the config), written last.
#
# Atomic: written into `<path>.tmp`, then renamed to `<path>` by rank 0 once every rank
# has finished; a directory without `.metadata` and `pipekit.json`, or ending in `.tmp`,
# is not a checkpoint. `pipekit.json` lists every other file's size and sha256, taken as
# it was written and checked on every load: a damaged file is refused, never trained on.

META = "pipekit.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or from another model."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, META))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and is_complete(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def skipped_note(root: str, chosen: str | None) -> str | None:
    """One line when "the newest complete checkpoint" under `root` (`chosen`) passed over newer
    step directories that are damaged (a deleted .metadata or pipekit.json), naming them and
    what each lacks; None when nothing was passed over."""
    m = _STEP_DIR.match(os.path.basename(chosen)) if chosen else None
    skipped = incomplete_after(root, int(m.group(1)) if m else None)
    if not skipped:
        return None
    shown = ", ".join(f"{os.path.basename(p)} (it lacks {_lacks(p)})" for p in skipped[:3])
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    then = f"using {chosen}, the newest complete one" if chosen else "no complete checkpoint is left"
    return f"pipekit: passing over newer checkpoints that are not complete: {shown}{more}; {then}"


def read_meta(path: str) -> dict:
    """The `pipekit.json` of checkpoint `path`; CheckpointError naming what is wrong."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint directory (a checkpoint is a directory such as "
                              f"checkpoints/step_00000100)")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete pipekit checkpoint (it lacks {_lacks(path)}; an "
                              f"interrupted save leaves such a directory); {_previous_hint(path)}")
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/{META} is unreadable ({e}); {_previous_hint(path)}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}/{META} holds a {type(meta).__name__}, not a checkpoint's record; "
                              f"{_previous_hint(path)}")
    return meta


def _lacks(path: str) -> str:
    missing = [n for n in (".metadata", META) if not os.path.isfile(os.path.join(path, n))]
    return " and ".join(missing) or f".metadata or {META}"


def incomplete_after(root: str, step: int | None) -> list[str]:
    """Published step directories under `root` newer than `step` (None: any) that are not
    complete checkpoints (a deleted .metadata or pipekit.json: damage, not an interrupted
    save, which stays `step_N.tmp`), newest first: what "the newest checkpoint" skipped."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        full = os.path.join(root, name)
        if m and os.path.isdir(full) and (step is None or int(m.group(1)) > step) and not is_complete(full):
            found.append((int(m.group(1)), full))
    return [p for _, p in sorted(found, reverse=True)]


def prune_checkpoints(root: str, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted saves."""
    for _, path in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):
        if name.endswith(".tmp") and _STEP_DIR.match(name[:-4]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _global(module: PipelineModule, t: torch.Tensor, sharding: Sharding):
    """`t` as DCP should see it: a DTensor sharded along its dims over the tp and/or ep mesh
    axes of size > 1 (an expert-TP shard: a 2-D (ep, tp) mesh), or itself."""
    split = [(dim, axis) for dim, axis in sharding if _axis(module, axis)[0] > 1]
    if not split:
        return t
    from torch.distributed.tensor import DTensor, Shard

    topo = module.topology
    grid = topo.moe_mesh if any(axis == "ep" for _, axis in split) else topo.mesh
    assert grid is not None, "an ep or tp axis of size > 1 lies on a device mesh"
    axes = tuple(axis for _, axis in split)
    return DTensor.from_local(t, grid[axes if len(axes) > 1 else axes[0]], [Shard(dim) for dim, _ in split],
                              run_check=False)


def _full_shape(module: PipelineModule, t: torch.Tensor, sharding: Sharding) -> tuple[int, ...]:
    shape = list(t.shape)
    for dim, axis in sharding:
        shape[dim] *= _axis(module, axis)[0]
    return tuple(shape)


def _param_state(optimizer) -> dict:
    """{param: {key: tensor}} of a ZeroOptimizer or a plain torch optimizer."""
    if hasattr(optimizer, "param_state"):
        return optimizer.param_state()
    return {p: {k: v.detach().clone() for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
            for group in optimizer.param_groups for p in group["params"]}


def _load_param_state(optimizer, per_param: dict) -> None:
    if hasattr(optimizer, "load_param_state"):
        optimizer.load_param_state(per_param)
        return
    for p, state in per_param.items():
        optimizer.state[p] = {k: v.clone() for k, v in state.items()}


def _entry_dim(p: torch.Tensor, value: torch.Tensor) -> Sharding:
    """The sharding of an optimizer entry of `p`: p's own, except for a 0-dim one (a step count)."""
    return _shard_dim(p) if value.dim() == p.dim() and value.dim() > 0 else ()


def _layout(module: PipelineModule) -> dict:
    topo = module.topology
    return {"pp": topo.pp, "dp": topo.dp, "tp": topo.tp, "ep": topo.ep,
            "chunks_per_rank": module.chunks_per_rank, "boundaries": list(module.boundaries),
            "world_size": topo.world_size}


def save_checkpoint(path: str, module: PipelineModule, optimizer=None, *, meta: dict | None = None,
                    keep: int | None = None) -> str:
    """Save `module`'s weights, `optimizer`'s state and every rank's RNG to the directory
    `path` (collective: every rank calls it), plus `meta` (JSON-able) in `pipekit.json`.
    With `keep`, older checkpoints beside `path` beyond the newest `keep` are deleted.

    Each rank records the size and sha256 of the files it wrote, and `pipekit.json` lists
    them all (`verify_checkpoint` checks them on every load). A save that fails on any rank
    (a full disk, said as such) removes `<path>.tmp` and raises the same CheckpointError on
    every rank; the previous checkpoints are left as they were. Communication beyond DCP's:
    one all_gather_object of each rank's file list, one broadcast of rank 0's verdict."""
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = _checkpoint_state(module, optimizer)
    need = sum(_nbytes(t) for t in state.values())
    files: dict[str, dict] = {}
    failed = None
    try:
        with _quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not _distributed())
        files = _file_digests(tmp, _rank())
    except (Exception, DCPException) as e:  # noqa: BLE001 - DCP wraps each rank's error; said once, below
        failed = _why_not_saved(e, tmp, need)
    reports: list = [(files, failed)]
    if _distributed():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (files, failed))
    verdict: list[str | None] = [None]
    if _rank() == 0:
        verdict = [_publish(tmp, path, reports, {"format": 1, "layout": _layout(module), **(meta or {})}, keep)]
    if _distributed():
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    return path


def _checkpoint_state(module: PipelineModule, optimizer) -> dict:
    """What this rank gives DCP to save: weights, optimizer state (by parameter name) and RNG."""
    state: dict = {}
    names = {}
    for name, t in _local_tensors(module).items():
        dim = _shard_dim(t)
        state[f"model/{name}"] = _global(module, whole(t.detach()), dim)  # ZeRO-3: gathered over dp
        names[id(t)] = name
    if optimizer is not None:
        for p, entries in _param_state(optimizer).items():
            for key, value in entries.items():
                state[f"optim/{names[id(p)]}/{key}"] = _global(module, value, _entry_dim(p, value))
    state[f"rng/{_rank()}"] = torch.get_rng_state()
    if torch.cuda.is_available() and module.topology.device.type == "cuda":
        state[f"rng_cuda/{_rank()}"] = torch.cuda.get_rng_state(module.topology.device).cpu()
    return state


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def _why_not_saved(e: BaseException, tmp: str, need: int) -> str:
    """Why this rank's part of a save failed, in a few words (a full disk said as such)."""
    failures = getattr(e, "failures", None) or {}
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [e]
    if any(isinstance(c, BaseException) and no_space_left(c, os.path.dirname(tmp), need) for c in [e, *causes]):
        return f"no space left on device ({free_space(os.path.dirname(tmp))} free there)"
    return _root_cause(e)


def _publish(tmp: str, path: str, reports: list, record: dict, keep: int | None) -> str | None:
    """Rank 0: write `pipekit.json` with every rank's file digests and rename `tmp` to `path`
    (then prune to `keep`); None when published, else the one-line error every rank raises,
    after removing `tmp`."""
    failed = [why for _, why in reports if why]
    why = next((w for w in failed if w.startswith("no space")), failed[0] if failed else None)
    if why is None:
        record["files"] = {name: digest for files, _ in reports for name, digest in sorted(files.items())}
        try:
            write_atomic(os.path.join(tmp, META), json.dumps(record, indent=1, default=_jsonable))
            fsync_dir(tmp)
            publish_dir(tmp, path)
        except Exception as e:  # noqa: BLE001 - said on every rank, below
            why = _why_not_saved(e, tmp, 0)
    if why is None:
        if keep is not None:
            prune_checkpoints(os.path.dirname(path), keep)
        return None
    shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(os.path.dirname(path))
    kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
    return f"could not save checkpoint {path}: {why}; removed the partial {os.path.basename(tmp)}, and {kept}"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _file_digests(directory: str, rank: int) -> dict[str, dict]:
    """{file name: {"bytes", "sha256"}} of the files DCP wrote for `rank` in `directory`
    (`__<rank>_*.distcp`; rank 0 also its `.metadata`)."""
    mine = [n for n in os.listdir(directory) if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata")]
    return {n: {"bytes": os.path.getsize(os.path.join(directory, n)), "sha256": _sha256(os.path.join(directory, n))}
            for n in sorted(mine)}


def _data_files(path: str) -> list[str]:
    """The files of checkpoint `path` that DCP reads (`.metadata`, `*.distcp`)."""
    return sorted(n for n in os.listdir(path) if n == ".metadata" or n.endswith(".distcp"))


def verify_checkpoint(path: str, meta: dict, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the files of checkpoint `path` against the sizes and sha256 sums its
    `pipekit.json` recorded when they were written ([] when nothing is); `share=(i, n)`
    checks only every n-th file from the i-th (n ranks share the reading). Every file DCP
    would read must have its digest: a manifest that lost its list (or an entry of it) is
    damaged, not a checkpoint without checks."""
    recorded = meta.get("files")
    if not isinstance(recorded, dict) or not recorded:
        return [f"{META} records no file digests (its \"files\" list is missing or empty: the manifest was edited "
                f"or damaged), so its shards cannot be checked"]
    problems = [f"{name} has no recorded digest in {META} (a file added after the save, or an edited manifest)"
                for name in _data_files(path) if name not in recorded]
    for i, (name, want) in enumerate(sorted(recorded.items())):
        if i % share[1] != share[0]:
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{name} is missing")
        elif not isinstance(want, dict) or not {"bytes", "sha256"} <= set(want):
            problems.append(f"{META} records no size and sha256 for {name}")
        elif os.path.getsize(file) != want["bytes"]:
            problems.append(f"{name} holds {os.path.getsize(file)} bytes but {want['bytes']} were written (truncated "
                            f"or overwritten)")
        elif _sha256(file) != want["sha256"]:
            problems.append(f"{name} differs from what was written (its sha256 does not match)")
    return problems


def previous_complete(path: str) -> str | None:
    """The newest complete checkpoint beside checkpoint `path` with an earlier step, or None."""
    path = os.path.abspath(path)
    m = _STEP_DIR.match(os.path.basename(path))
    earlier = [p for step, p in list_checkpoints(os.path.dirname(path)) if m and step < int(m.group(1))]
    return earlier[-1] if earlier else None


def _previous_hint(path: str) -> str:
    earlier = previous_complete(path)
    return (f"the previous complete checkpoint is {earlier}: continue from it with train.resume={earlier}"
            if earlier else "there is no earlier checkpoint beside it")


def _refuse_damaged(path: str, problems: list[str]) -> None:
    """Raise CheckpointError naming the first problem and the previous complete checkpoint."""
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise CheckpointError(f"checkpoint {os.path.abspath(path)} is damaged: {problems[0]}{more}; {_previous_hint(path)}")


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _open(path: str, collective: bool = False):
    """(pipekit.json, a DCP reader, what the checkpoint holds by key) of checkpoint `path`,
    once its files are checked against their recorded digests (`collective`: every rank
    checks a share and all learn the result, by one all_gather_object)."""
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    if collective and _distributed():
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, verify_checkpoint(path, meta, (_rank(), dist.get_world_size())))
        _refuse_damaged(path, sorted(p for part in found for p in part))
    else:
        _refuse_damaged(path, verify_checkpoint(path, meta))
    reader = dcp.FileSystemReader(path)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - DCP raises assorted errors on a damaged .metadata
        raise CheckpointError(f"{path}/.metadata is unreadable ({type(e).__name__}: {e})") from e
    return meta, reader, saved


def load_checkpoint(path: str, module: PipelineModule, optimizer=None) -> dict:
    """Load checkpoint `path` into `module` and `optimizer` at this run's layout (collective);
    returns its `pipekit.json`. Raises CheckpointError, naming the tensor, when the
    checkpoint lacks one this model needs or holds it in another shape."""
    import torch.distributed.checkpoint as dcp

    meta, reader, saved = _open(path, collective=True)
    local = _local_tensors(module)
    state, targets = {}, {}
    for name, t in local.items():
        key, dim = f"model/{name}", _shard_dim(t)
        _expect(saved, key, _full_shape(module, t, dim), path)
        buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # whole over dp, also for ZeRO-3's shards
        state[key], targets[key] = _global(module, buf, dim), buf
    opt_keys: dict[str, list[str]] = {}
    if optimizer is not None:
        for key in saved:
            if key.startswith("optim/"):
                name, entry = key[len("optim/"):].rsplit("/", 1)
                opt_keys.setdefault(name, []).append(entry)
        params = dict(module.named_parameters())
        for name, entries in opt_keys.items():
            p = params.get(name)
            if p is None:
                continue
            for entry in entries:
                key = f"optim/{name}/{entry}"
                shape = () if len(saved[key].size) == 0 else p.shape  # a step count, or shaped like p
                buf = torch.empty(shape, dtype=saved[key].properties.dtype, device=p.device)
                dim = _entry_dim(p, buf)
                _expect(saved, key, _full_shape(module, buf, dim), path)
                state[key], targets[key] = _global(module, buf, dim), buf
    same_layout = meta.get("layout") == _layout(module)
    rng_key = f"rng/{_rank()}"
    if same_layout and rng_key in saved:
        state[rng_key] = targets[rng_key] = torch.empty(saved[rng_key].size, dtype=torch.uint8)
    try:
        with _quiet():
            dcp.load(state, storage_reader=reader, no_dist=not _distributed())
    except (Exception, DCPException) as e:  # noqa: BLE001 - a truncated or corrupt shard file
        raise CheckpointError(f"could not read checkpoint {path}: {_root_cause(e)}") from e
    with torch.no_grad():
        for name, t in local.items():
            assign(t, targets[f"model/{name}"])
    if optimizer is not None:
        params = dict(module.named_parameters())
        per_param = {params[n]: {e: targets[f"optim/{n}/{e}"] for e in entries}
                     for n, entries in opt_keys.items() if n in params}
        _load_param_state(optimizer, per_param)
    if rng_key in targets:
        torch.set_rng_state(targets[rng_key])
    return meta


def _root_cause(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception or traceback}
    if failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback) in some torch versions
            e = e[0]
    if not isinstance(e, BaseException):
        return str(e).strip().splitlines()[-1]
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


@contextlib.contextmanager
def _quiet():
    """Silence DCP's warning that, without a process group, it assumes one process (it is one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _expect(saved: dict, key: str, shape: tuple[int, ...], path: str) -> None:
    if key not in saved:
        raise CheckpointError(f"checkpoint {path} has no {key.split('/', 1)[1]} (saved from another model: "
                              f"compare its {META} with this config)")
    got = tuple(saved[key].size)
    if got != shape:
        raise CheckpointError(f"checkpoint {path} holds {key.split('/', 1)[1]} with shape {got}, this model's is "
                              f"{shape}: it was saved from another model config")


def load_full_weights(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(pipekit.json, the full weights by name) of checkpoint `path`, in this one process
    (no process group): what `convert --to-hf` and `generate` read."""
    import torch.distributed.checkpoint as dcp

    meta, reader, saved = _open(path)
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in saved.items() if k.startswith("model/")}
    with _quiet():
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except (Exception, DCPException) as e:  # noqa: BLE001
            raise CheckpointError(f"could not read checkpoint {path}: {_root_cause(e)}") from e
    return meta, {k[len("model/"):]: v for k, v in state.items()}
