"""Build a validated `Schedule` and summarise its simulation for `pipekit plan`."""

from __future__ import annotations

from dataclasses import asdict

from .generators import generate, looping_placement
from .ir import Schedule
from .lowering import lower
from .simulate import resolve_costs, simulate
from .validate import validate


def build_schedule(name: str, pp: int, microbatches: int, chunks_per_rank: int = 1) -> Schedule:
    """generate -> lower -> validate; ScheduleError on bad input.

    All three schedules use the looping placement (stage s on rank s % pp).
    """
    compute = generate(name, pp, microbatches, chunks_per_rank)
    placement = looping_placement(pp, chunks_per_rank)
    lowered = lower(compute, placement)
    validate(lowered, placement, microbatches)
    return Schedule(
        name=name,
        pp=pp,
        chunks_per_rank=chunks_per_rank,
        microbatches=microbatches,
        placement=placement,
        ranks=tuple(tuple(actions) for actions in lowered),
    )


def plan_report(name: str, pp: int, microbatches: int, chunks_per_rank: int = 1, costs=None) -> dict:
    """A JSON-able summary: the compute actions per rank and their simulated timeline.

    Costs default to F=1, B=2 (W=1, BW=3); communication is free.
    """
    schedule = build_schedule(name, pp, microbatches, chunks_per_rank)
    unit = resolve_costs(costs)
    result = simulate(schedule, unit)
    return {
        "schedule": name,
        "pp": pp,
        "microbatches": microbatches,
        "chunks_per_rank": chunks_per_rank,
        "costs": unit,
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "bubble_per_rank": result.bubble_per_rank,
        "peak_activations": result.peak_activations,
        "actions": [[str(a) for a in schedule.compute_actions(r)] for r in range(pp)],
        "timeline": [asdict(e) for e in result.timeline],
    }
