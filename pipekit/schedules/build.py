"""Build a validated `Schedule` (from a registered generator or an action table) and
summarise its simulation for `pipekit plan`."""

from __future__ import annotations

import os
import re
from dataclasses import asdict

from .generators import get_generator
from .ir import INPUT_GRAD_KINDS, Action, Kind, ScheduleError
from .lowering import lower
from .placement import check_placement, check_positive, resolve_placement
from .program import Schedule
from .simulate import resolve_costs, simulate
from .validate import validate


def build_schedule(name: str, pp: int, microbatches: int, chunks_per_rank: int | None = None, *,
                   overlap: bool = False) -> Schedule:
    """generate -> (pair for overlap) -> lower -> validate; ScheduleError on bad input.

    `chunks_per_rank` None takes the schedule's own (2 for zbv and dualpipe_v, else
    1); stages are placed as the schedule's registration says (looping or v).
    `overlap`: pair forwards with neighbouring backwards (`pair_for_overlap`).
    """
    generator = get_generator(name)
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    chunks = generator.chunks(chunks_per_rank)
    placement = generator.place(pp, chunks)
    actions = generator.generate(pp, microbatches, chunks)
    if overlap:
        if any(a.is_comm for row in actions for a in row):
            raise ScheduleError(f"schedule {name!r} gives a whole program with its messages; overlap pairs "
                                "compute actions before lowering, so it needs a schedule that gives compute only")
        actions = pair_for_overlap(actions, placement, microbatches)
    return _program(name, pp, chunks, microbatches, placement, actions)


def pair_for_overlap(compute, placement, microbatches: int) -> list[list[Action]]:
    """Each rank's compute list with neighbouring forward and backward (B or I) actions of
    different (stage, microbatch) merged into one OVERLAP, first to last, greedily: the
    order of the rest is kept. A pair whose hoisted receive would make the program wait
    forever (the lowered program does not validate) is left unpaired."""
    rows = [_pair_neighbours(row) for row in compute]
    try:
        lower_and_validate(rows, placement, microbatches)
        return rows
    except ScheduleError:
        pass
    rows = [list(row) for row in compute]  # slow path: keep each pair only if the program still runs
    for r in range(len(rows)):
        i = 0
        while i < len(rows[r]) - 1:
            pair = _as_pair(rows[r][i], rows[r][i + 1])
            if pair is not None:
                trial = [*rows[r][:i], pair, *rows[r][i + 2:]]
                try:
                    lower_and_validate([*rows[:r], trial, *rows[r + 1:]], placement, microbatches)
                    rows[r] = trial
                except ScheduleError:
                    pass
            i += 1
    return rows


def lower_and_validate(compute, placement, microbatches: int) -> None:
    """ScheduleError unless `compute` lowers to a valid program."""
    validate(lower(compute, placement), placement, microbatches)


def _pair_neighbours(row) -> list[Action]:
    out, i = [], 0
    while i < len(row):
        pair = _as_pair(row[i], row[i + 1]) if i + 1 < len(row) else None
        out.append(pair or row[i])
        i += 2 if pair is not None else 1
    return out


def _as_pair(a: Action, b: Action) -> Action | None:
    """The OVERLAP of `a` and `b` when one is a forward and the other a backward (B or I) of
    another (stage, microbatch); else None."""
    for f, back in ((a, b), (b, a)):
        if f.kind is Kind.F and back.kind in INPUT_GRAD_KINDS and (f.stage, f.microbatch) != (back.stage,
                                                                                                 back.microbatch):
            return Action.overlap(f, back)
    return None


def _program(name, pp, chunks, microbatches, placement, actions) -> Schedule:
    """A Schedule of `actions`, lowered first unless they already hold the messages."""
    if not isinstance(actions, (list, tuple)) or len(actions) != pp:
        got = f"{len(actions)} lists" if isinstance(actions, (list, tuple)) else repr(actions)
        raise ScheduleError(f"schedule {name!r} must give one action list per rank ({pp}), got {got}")
    if not any(a.is_comm for row in actions for a in row if isinstance(a, Action)):
        actions = lower(actions, placement)
    return Schedule(name, pp, chunks, microbatches, placement, actions)


def parse_table(text: str) -> list[list[Action]]:
    """One rank per line, actions separated by spaces and/or commas ("0F0, 0F1 0I0 0W0").
    Blank lines and `#` comments are skipped."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0]
        tokens = [t for t in re.split(r"[,\s]+", line) if t]
        if not tokens:
            continue
        try:
            rows.append([Action.parse(t) for t in tokens])
        except ScheduleError as e:
            raise ScheduleError(f"line {number}: {e}") from None
    if not rows:
        raise ScheduleError("the action table is empty: give one line of actions per rank")
    return rows


def schedule_from_table(text: str, *, name: str = "table", placement=None, microbatches: int | None = None) -> Schedule:
    """A validated Schedule from an action table (see `parse_table`): rank r's list is line r.

    The table holds compute actions (lowered here) or a whole program with its
    SEND/RECV actions. `placement` ("looping", "v" or a tuple of ranks) defaults
    to where the table runs each stage;
    `microbatches` to one more than the largest microbatch named."""
    rows = parse_table(text)
    pp = len(rows)
    stages = _stages_run_where(rows)
    if placement is None:
        missing = [s for s in range(max(stages) + 1) if s not in stages]
        if missing:
            raise ScheduleError(f"the table runs no action of stage {missing[0]}; stages are numbered from 0 "
                                f"up (or pass placement=)")
        placement = check_placement(tuple(stages[s] for s in range(len(stages))), pp)
    else:
        placement = resolve_placement(placement, pp)
    if microbatches is None:
        microbatches = 1 + max(part.microbatch for row in rows for a in row for part in a.parts)
    return _program(name, pp, len(placement) // pp, microbatches, placement, rows)


def _stages_run_where(rows) -> dict[int, int]:
    """stage -> the rank whose line runs it; ScheduleError if two lines do."""
    where: dict[int, int] = {}
    for r, row in enumerate(rows):
        for a in (part for whole in row for part in whole.parts):
            if where.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} runs on two ranks, {where[a.stage]} and {r} ({a}); "
                                    "each stage lives on one rank")
    return where


def load_schedule(path: str | os.PathLike, *, name: str | None = None, placement=None,
                  microbatches: int | None = None) -> Schedule:
    """`schedule_from_table` on a text or CSV file; the name defaults to the file's stem."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    return schedule_from_table(text, name=name or stem, placement=placement, microbatches=microbatches)


def plan_report(name: str, pp: int, microbatches: int, chunks_per_rank: int | None = None, costs=None) -> dict:
    """A JSON-able summary: the compute actions per rank and their simulated timeline.

    Costs default to F=1, B=2, I=1, W=1; communication is free.
    """
    schedule = build_schedule(name, pp, microbatches, chunks_per_rank)
    unit = resolve_costs(costs)
    result = simulate(schedule, unit)
    return {
        "schedule": name,
        "pp": pp,
        "microbatches": microbatches,
        "chunks_per_rank": schedule.chunks_per_rank,
        "placement": list(schedule.placement),
        "costs": unit,
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "bubble_per_rank": result.bubble_per_rank,
        "peak_activations": result.peak_activations,
        "actions": [[str(a) for a in schedule.compute_actions(r)] for r in range(pp)],
        "timeline": [asdict(e) for e in result.timeline],
    }
