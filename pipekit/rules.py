"""Which settings combine: each rule written once, for the config and the Python API alike.

A rule is a function of plain values that raises `ValueError` in one line: the offending
value, why, and what would be valid. It names each value by the word the caller gives in
`names` (`API`: the argument names of `Topology`, `PipelineEngine`, `ZeroOptimizer`;
`CONFIG`: the YAML keys), so `pipekit train` says `parallel.ep=3` where Python says `ep=3`.
`pipekit.config` turns the error into a `ConfigError` before any worker starts; the
constructors raise it as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

API: Mapping[str, str] = {}  # the Python argument names as they are
CONFIG: Mapping[str, str] = {
    "pp": "parallel.pp", "dp": "parallel.dp", "tp": "parallel.tp", "ep": "parallel.ep",
    "dp_shard": "parallel.dp_shard", "n_experts": "model.n_experts", "stage": "optimizer.zero_stage",
    "overlap": "schedule.overlap", "device": "train.device", "clip_grad_norm": "optimizer.clip_grad_norm",
}


def _say(names: Mapping[str, str], key: str, value) -> str:
    """`key=value` as the caller writes it: YAML's true/null and bare words in a config, Python's repr else."""
    if names is not CONFIG:
        return f"{key}={value!r}"
    shown = "true" if value is True else "false" if value is False else "null" if value is None else value
    return f"{names.get(key, key)}={shown}"


def divisors(n: int, also: int | None = None) -> list[int]:
    """The divisors of n (that also divide `also`, when given)."""
    return [d for d in range(1, n + 1) if n % d == 0 and (also is None or also % d == 0)]


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ep(ep, dp: int, names: Mapping[str, str] = API) -> None:
    """Experts are sharded over runs of `ep` consecutive data-parallel ranks: ep divides dp."""
    if not _whole(ep) or ep < 1 or dp % ep:
        raise ValueError(f"{_say(names, 'ep', ep)} must divide {_say(names, 'dp', dp)} (experts are sharded over "
                         f"groups of ep data-parallel ranks); use an ep among {divisors(dp)}")


def check_experts(n_experts: int, ep: int, dp: int | None = None, names: Mapping[str, str] = API) -> None:
    """Every expert-parallel rank holds the same number of experts: ep divides n_experts."""
    if n_experts % ep:
        valid = divisors(dp, n_experts) if dp is not None else divisors(n_experts)
        raise ValueError(f"{_say(names, 'n_experts', n_experts)} is not divisible by the expert-parallel size "
                         f"{_say(names, 'ep', ep)}; use an ep among {valid}, or n_experts a multiple of {ep}")


def check_dp_shard(dp_shard, dp: int, stage: int | None = None, names: Mapping[str, str] = API) -> None:
    """ZeRO-3's hybrid sharding: runs of dp_shard dp ranks shard the parameters (None: all of dp),
    so dp_shard divides dp, and only stage 3 shards parameters. `stage` None: not known here."""
    if dp_shard is None:
        return
    if stage is not None and stage != 3:
        raise ValueError(f"{_say(names, 'dp_shard', dp_shard)} is ZeRO-3's hybrid sharding, but "
                         f"{_say(names, 'stage', stage)}; set {_say(names, 'stage', 3)} or leave "
                         f"{names.get('dp_shard', 'dp_shard')} out")
    if not _whole(dp_shard) or dp_shard < 1 or dp % dp_shard:
        raise ValueError(f"{_say(names, 'dp_shard', dp_shard)} must divide {_say(names, 'dp', dp)} (the ranks that "
                         f"shard the parameters; the rest replicate them); use one of {divisors(dp)}")


def check_overlap(overlap: bool, stage: int, names: Mapping[str, str] = API) -> None:
    """Overlapped schedules (a forward beside a backward on two threads, on two streams on a
    GPU: `pipekit.comm.Lanes`) run with ZeRO 0-2, not ZeRO-3 (FSDP's gathers and per-layer state
    are not made for two threads at once)."""
    if not overlap:
        return
    if stage == 3:
        raise ValueError(f"{_say(names, 'stage', 3)} cannot run with {_say(names, 'overlap', True)} yet (FSDP's "
                         "gathers and per-layer state are not made for a forward and a backward on two threads "
                         f"at once); use ZeRO stage 0, 1 or 2 with the overlap, or set {_say(names, 'overlap', False)}")


def check_clip(clip_grad_norm, names: Mapping[str, str] = API) -> None:
    """Gradient clipping: a finite norm > 0, or None for none (a norm <= 0 would flip or zero every step)."""
    if clip_grad_norm is None:
        return
    ok = isinstance(clip_grad_norm, (int, float)) and not isinstance(clip_grad_norm, bool)
    if not ok or not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0:
        raise ValueError(f"{_say(names, 'clip_grad_norm', clip_grad_norm)} must be a finite number > 0, or "
                         f"{'null' if names is CONFIG else 'None'} (no clipping)")
