"""Schedule generators: pure functions of ints returning compute actions per rank.

Each generator returns `list[list[Action]]`, one list per pipeline rank, with
compute actions only (`F` and `B`; `B` is the full backward here since none of
these schedules emits `W`). `lower` adds the SEND/RECV actions afterwards.
Stages are placed by `looping_placement`: virtual stage s lives on rank s % pp.
"""

from __future__ import annotations

from .ir import Action, Kind, ScheduleError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def check_positive(name: str, value) -> None:
    """Raise ScheduleError unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ScheduleError(f"{name} must be >= 1, got {value}")


def looping_placement(pp: int, chunks_per_rank: int) -> tuple[int, ...]:
    """Virtual stage s on rank s % pp (Megatron's interleaving; identity for one chunk)."""
    check_positive("pp", pp)
    check_positive("chunks_per_rank", chunks_per_rank)
    return tuple(s % pp for s in range(pp * chunks_per_rank))


def _f(stage: int, mb: int) -> Action:
    return Action(stage, Kind.F, mb)


def _b(stage: int, mb: int) -> Action:
    return Action(stage, Kind.B, mb)


def gpipe(pp: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every rank runs all forwards, then all backwards, in microbatch order.

    Peak live activations per rank equal `microbatches`.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    mbs = range(microbatches)
    return [[_f(r, m) for m in mbs] + [_b(r, m) for m in mbs] for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): warmup forwards, then alternate F and B, then cooldown Bs.

    Rank r runs min(pp-1-r, m) warmup forwards, so it never holds more than
    min(m, pp-r) live activations. Defined for any m >= 1.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    return [_one_f_one_b_rank(r, pp, microbatches) for r in range(pp)]


def _one_f_one_b_rank(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - 1 - rank, m)
    return _warmup_steady_cooldown(
        [_f(rank, k) for k in range(m)], [_b(rank, k) for k in range(m)], warmup
    )


def _warmup_steady_cooldown(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then pairs (next F, next B), then the remaining Bs."""
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


def interleaved_1f1b(pp: int, microbatches: int, chunks_per_rank: int) -> list[list[Action]]:
    """Megatron-style interleaved 1F1B over `chunks_per_rank` (v) chunks per rank.

    Rank r hosts virtual stages c*pp + r for c in 0..v-1. Microbatches go in
    groups of pp: the k-th forward on a rank is chunk (k // pp) % v of
    microbatch (k // (pp*v))*pp + k % pp; the k-th backward is the same with
    the chunk reversed. Warmup is min(2*(pp-r-1) + (v-1)*pp, m*v) forwards for
    v > 1; for v == 1 it is 1F1B's pp-r-1, so the order equals `one_f_one_b`.

    Limits: needs microbatches >= pp and a multiple of pp.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    check_positive("chunks_per_rank", chunks_per_rank)
    _check_interleaved_microbatches(pp, microbatches)
    return [_interleaved_rank(r, pp, microbatches, chunks_per_rank) for r in range(pp)]


def _check_interleaved_microbatches(pp: int, m: int) -> None:
    if m < pp:
        raise ScheduleError(f"interleaved_1f1b needs at least pp={pp} microbatches, got {m}")
    if m % pp:
        lower, upper = (m // pp) * pp, (m // pp + 1) * pp
        raise ScheduleError(
            f"interleaved_1f1b needs the microbatch count to be a multiple of pp={pp}, "
            f"got {m}; try {lower} or {upper}"
        )


def _interleaved_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    total = m * v
    forwards, backwards = [], []
    for k in range(total):
        chunk, mb = (k // pp) % v, (k // (pp * v)) * pp + k % pp
        forwards.append(_f(chunk * pp + rank, mb))
        backwards.append(_b((v - 1 - chunk) * pp + rank, mb))
    if v == 1:
        warmup = min(pp - 1 - rank, total)
    else:
        warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    return _warmup_steady_cooldown(forwards, backwards, warmup)


def generate(name: str, pp: int, microbatches: int, chunks_per_rank: int = 1) -> list[list[Action]]:
    """Compute actions per rank for schedule `name` (one of SCHEDULES)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    check_positive("chunks_per_rank", chunks_per_rank)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, chunks_per_rank)
    if chunks_per_rank != 1:
        raise ScheduleError(
            f"{name} runs one chunk per rank, got chunks_per_rank={chunks_per_rank}; "
            f"only interleaved_1f1b takes chunks_per_rank"
        )
    return gpipe(pp, microbatches) if name == "gpipe" else one_f_one_b(pp, microbatches)
