"""Event-driven simulation of a lowered schedule.

Model: each rank walks its action list in order. A compute action costs
`costs[kind]` (the same for every stage, or one dict per virtual stage) and
starts when the rank is free; a RECV blocks the rank until the matching SEND
has happened plus `comm_latency` (a number, or a function of the RECV action);
a SEND is posted at once (buffered, never blocks). Communication actions cost
nothing, unless a `duration` function (of any action) replaces the costs: then
the time a rank spends posting a send or taking a message in can be modelled
(`pipekit.plan.planner` does).

Communication inside a layer (an expert-parallel all-to-all, a tensor-parallel
all-reduce) is part of a compute action's cost; `comm` says how much of each
kind's cost it is. It runs on its own lane: an OVERLAP of a forward and a
backward keeps the rank busy for `overlap_duration` of the two, the longer
of their compute together, their communication together, and either alone.

Not modelled here: contention, overlap of compute with the copy of a message,
what happens after the last action (waiting for posted sends, the loss and
gradient reductions, the optimizer step: `pipekit.plan.planner` adds those), memory
limits, and variation between microbatches.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from .execute import execute
from .ir import WEIGHT_GRAD_KINDS, Action, Kind, ScheduleError
from .program import Schedule

# A full backward costs twice a forward; its halves (input grad I, weight grads W) one each.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class TimelineEvent:
    """One compute action on one rank; also the format of the engine's measured timelines."""

    rank: int
    action: str
    start: float
    end: float


@dataclass
class SimResult:
    timeline: list[TimelineEvent]
    makespan: float
    bubble_fraction: float
    bubble_per_rank: list[float] = field(default_factory=list)
    peak_activations: list[int] = field(default_factory=list)


def resolve_stage_costs(costs, num_stages: int) -> list[dict[str, float]]:
    """One resolved cost dict per virtual stage, from one dict (every stage) or a list of them."""
    if costs is None or isinstance(costs, dict):
        return [resolve_costs(costs)] * num_stages
    costs = list(costs)
    if len(costs) != num_stages:
        raise ScheduleError(f"per-stage costs must give one dict per virtual stage ({num_stages}), got {len(costs)}")
    return [resolve_costs(c) for c in costs]


def resolve_costs(costs: dict[str, float] | None) -> dict[str, float]:
    """DEFAULT_COSTS overridden by `costs`; only compute kinds, non-negative."""
    merged = dict(DEFAULT_COSTS)
    for key, value in (costs or {}).items():
        key = key.value if isinstance(key, Kind) else key
        if key not in DEFAULT_COSTS:
            raise ScheduleError(f"unknown cost key {key!r}; costs are given for {', '.join(DEFAULT_COSTS)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise ScheduleError(f"cost of {key} must be a number >= 0, got {value!r}")
        merged[key] = value
    return merged


def mean_costs(events) -> dict[str, float]:
    """The mean duration of each compute kind in a (measured) timeline: the costs to
    simulate the same schedule with. Kinds that do not occur are left out."""
    spans: dict[str, list[float]] = {}
    for e in events:
        try:
            kind = Action.parse(e.action).kind
        except ScheduleError:
            continue
        if kind.value in DEFAULT_COSTS:
            spans.setdefault(kind.value, []).append(e.end - e.start)
    return {k: sum(v) / len(v) for k, v in spans.items()}


def overlap_duration(forward: float, backward: float, forward_comm: float = 0.0, backward_comm: float = 0.0) -> float:
    """How long a forward and a backward that run at once keep their rank busy: each one's
    communication (`*_comm`, part of its cost) hides behind the other's compute, so the pair
    takes the longer of the compute lane (both computes), the communication lane (both
    communications) and either action alone (its own compute and communication are in series)."""
    for name, total, comm in (("forward", forward, forward_comm), ("backward", backward, backward_comm)):
        if not 0 <= comm <= total:
            raise ScheduleError(f"the {name}'s communication ({comm}) must lie within 0 and its cost ({total})")
    compute = (forward - forward_comm) + (backward - backward_comm)
    return max(compute, forward_comm + backward_comm, forward, backward)


def simulate(schedule: Schedule, costs=None, comm_latency=0.0, *, duration=None, comm=None) -> SimResult:
    """Simulate `schedule` under per-kind `costs` (DEFAULT_COSTS: F=1, B=2, I=1, W=1), one
    dict for every stage or a list with one per virtual stage; or under `duration(action)`,
    which then gives every action's cost (communication included) instead.
    `comm` (like `costs`, default none): the part of each kind's cost that is communication
    inside its layers, which an OVERLAP hides (`overlap_duration`).

    bubble_per_rank[r] = 1 - busy_r / makespan; bubble_fraction = 1 - total
    busy / (pp * makespan); peak_activations[r] = the most (stage, microbatch)
    pairs on rank r whose F is done and whose weight grads (B, or W after an
    I) are not: an I frees part of a stage's activations, but what W needs
    stays, and this count does not model the difference. The timeline holds
    compute events only.
    """
    if duration is None:
        per_stage = resolve_stage_costs(costs, schedule.num_stages)
        per_stage_comm = resolve_stage_costs(comm or dict.fromkeys(DEFAULT_COSTS, 0.0), schedule.num_stages)

        def duration(a):
            if a.pair is not None:
                f, b = a.pair
                return overlap_duration(per_stage[f.stage]["F"], per_stage[b.stage][b.kind.value],
                                        per_stage_comm[f.stage]["F"], per_stage_comm[b.stage][b.kind.value])
            return per_stage[a.stage][a.kind.value] if a.is_compute else 0.0

    times = execute(schedule.ranks, schedule.placement, duration, comm_latency)
    timeline = [
        TimelineEvent(r, str(a), start, end)
        for r, actions in enumerate(schedule.ranks)
        for a, (start, end) in zip(actions, times[r])
        if a.is_compute
    ]
    makespan = max((e.end for e in timeline), default=0.0)
    busy = [sum(e.end - e.start for e in timeline if e.rank == r) for r in range(schedule.pp)]
    return SimResult(
        timeline=timeline,
        makespan=makespan,
        bubble_fraction=1 - sum(busy) / (schedule.pp * makespan) if makespan else 0.0,
        bubble_per_rank=[1 - b / makespan if makespan else 0.0 for b in busy],
        peak_activations=[peak_live_activations(schedule.ranks[r]) for r in range(schedule.pp)],
    )


def peak_live_activations(actions) -> int:
    """Most (stage, mb) pairs held at once (from F to B or W), walking one rank's list in order."""
    live = peak = 0
    for a in (part for whole in actions for part in whole.parts):
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in WEIGHT_GRAD_KINDS:
            live -= 1
    return peak
