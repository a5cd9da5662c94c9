"""Placements: which pipeline rank hosts each virtual stage.

A placement is a tuple `p` with `p[s]` the rank of virtual stage `s`; every
rank hosts the same number of stages (`chunks_per_rank`). Two are built in:

- looping (Megatron's interleaving): stage s on rank s % pp, so rank r holds
  r, r + pp, r + 2pp, ... (the identity for one chunk);
- v (zig-zag, ZB-V / DualPipe-V): chunk c of rank r is stage c*pp + r for
  even c and c*pp + pp-1-r for odd c, so with two chunks rank r holds stages
  r and 2pp-1-r, and the first and the last stage share rank 0.
"""

from __future__ import annotations

from .ir import ScheduleError


def check_positive(name: str, value) -> None:
    """Raise ScheduleError unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ScheduleError(f"{name} must be >= 1, got {value}")


def looping_placement(pp: int, chunks_per_rank: int = 1) -> tuple[int, ...]:
    """Virtual stage s on rank s % pp (Megatron's interleaving; identity for one chunk)."""
    check_positive("pp", pp)
    check_positive("chunks_per_rank", chunks_per_rank)
    return tuple(s % pp for s in range(pp * chunks_per_rank))


def v_placement(pp: int, chunks_per_rank: int = 2) -> tuple[int, ...]:
    """Zig-zag: down the ranks for even chunks, back up for odd ones ((0, 1, 1, 0) for pp=2)."""
    check_positive("pp", pp)
    check_positive("chunks_per_rank", chunks_per_rank)
    return tuple(s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(pp * chunks_per_rank))


PLACEMENTS = {"looping": looping_placement, "v": v_placement}


def resolve_placement(placement, pp: int, chunks_per_rank: int | None = None) -> tuple[int, ...]:
    """A placement tuple from a name in PLACEMENTS, an explicit sequence of ranks, or a
    `Schedule` (its own placement). `chunks_per_rank` None takes the named placement's
    default (looping 1, v 2) or the length of the given one; else it must agree."""
    check_positive("pp", pp)
    if chunks_per_rank is not None:
        check_positive("chunks_per_rank", chunks_per_rank)
    if isinstance(placement, str):
        if placement not in PLACEMENTS:
            raise ScheduleError(f"unknown placement {placement!r}; choose one of: {', '.join(PLACEMENTS)}, "
                                "or give a tuple of ranks, one per virtual stage")
        make = PLACEMENTS[placement]
        return make(pp) if chunks_per_rank is None else make(pp, chunks_per_rank)
    if hasattr(placement, "placement") and hasattr(placement, "ranks"):  # a Schedule
        if placement.pp != pp:
            raise ScheduleError(f"schedule {placement.name!r} is for pp={placement.pp}, but pp={pp} here")
        placement = placement.placement
    return check_placement(placement, pp, chunks_per_rank)


def check_placement(placement, pp: int, chunks_per_rank: int | None = None) -> tuple[int, ...]:
    """`placement` as a tuple, after checking that it puts the same number of stages on
    each of ranks 0..pp-1 (`chunks_per_rank` of them when given)."""
    try:
        ranks = tuple(placement)
    except TypeError:
        raise ScheduleError(f"placement must be a name ({', '.join(PLACEMENTS)}) or a sequence of ranks, "
                            f"got {placement!r}") from None
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < pp for r in ranks):
        raise ScheduleError(f"placement {ranks} must map every virtual stage to a rank 0..{pp - 1}")
    counts = [ranks.count(r) for r in range(pp)]
    if len(set(counts)) != 1:
        raise ScheduleError(f"placement {ranks} puts {counts} stages on ranks 0..{pp - 1}; "
                            "every rank must hold the same number")
    if chunks_per_rank is not None and counts[0] != chunks_per_rank:
        raise ScheduleError(f"placement {ranks} puts {counts[0]} stages on each rank, "
                            f"but chunks_per_rank={chunks_per_rank}")
    return ranks
