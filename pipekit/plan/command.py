"""`pipekit plan`: what the command prints and writes.

Without a config: one schedule simulated under unit costs (`pipekit.schedules.plan_report`).
With one: the run's layers profiled (`profiler`), every schedule, partition and microbatch
count predicted (`planner`), optionally each candidate's memory per rank (`memory`), and
the fastest that fits recommended as a `pipekit train` command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ..atomic import write_atomic
from ..config import ConfigError, Run, config_and_overrides, load_run
from ..schedules import ScheduleError, TimelineEvent, plan_report, render_png, render_text, to_chrome_trace
from ..topology import local_workers, resolve_device
from . import memory as memplan
from . import planner, profiler


def plan_command(args: argparse.Namespace) -> int:
    """Every input, including where --trace and --png go (and matplotlib for --png), is
    checked before either file is written: a mistake writes nothing."""
    if args.config is not None:
        return _plan_config(args)
    if args.pp is None or args.microbatches is None:
        raise ValueError("give a training config (pipekit plan CONFIG [key=value ...]), or --pp and "
                         "--microbatches to simulate one schedule under unit costs")
    args.schedule = args.schedule or "1f1b"
    args.f_cost = 1.0 if args.f_cost is None else args.f_cost
    args.b_cost = 2.0 if args.b_cost is None else args.b_cost
    for flag, cost in (("--f-cost", args.f_cost), ("--b-cost", args.b_cost)):
        if not math.isfinite(cost):
            raise ValueError(f"{flag} {cost} must be a finite number >= 0")
    costs = {"F": args.f_cost, "B": args.b_cost}
    try:
        report = plan_report(args.schedule, args.pp, args.microbatches, args.virtual, costs=costs)
    except ScheduleError as e:
        print(f"pipekit plan: {e}", file=sys.stderr)
        return 2
    if not _outputs_ok(args):
        return 2
    events = [TimelineEvent(**e) for e in report["timeline"]]
    if args.trace:
        write_atomic(args.trace, json.dumps(to_chrome_trace(events)))
    if args.png:
        render_png(events, args.png, f"{args.schedule}, pp={args.pp}, microbatches={args.microbatches}, "
                   f"virtual={args.virtual}: bubble {report['bubble_fraction']:.3f}")
    if args.json:
        print(json.dumps(report))
        return 0
    print(render_text(events))
    print(f"makespan {report['makespan']:g}  bubble {report['bubble_fraction']:.3f}  "
          f"peak activations per rank {report['peak_activations']}")
    return 0


def _plan_config(args: argparse.Namespace) -> int:
    """`pipekit plan CONFIG`: profile the run's layers, predict every schedule, partition
    and microbatch count, recommend the fastest that fits. Every flag and output path is
    checked (and the run resolved) before anything is measured or written."""
    try:
        args.config, overrides = config_and_overrides(args.config, args.overrides)
        run = load_run(args.config, overrides)
    except ConfigError as e:
        print(f"pipekit plan: {e}", file=sys.stderr)
        return 2
    if not _plan_flags_ok(args):
        return 2
    for flag, value, instead in (("--pp", args.pp, "parallel.pp=N"), ("--virtual", args.virtual,
                                                                     "schedule.chunks_per_rank=N"),
                                 ("--f-cost", args.f_cost, None), ("--b-cost", args.b_cost, None)):
        if value is not None:
            raise ValueError(f"{flag} {value} applies without a CONFIG; with one, "
                             + (f"override {instead}" if instead else "the costs are the profiled layers'"))
    if args.schedule is not None and args.schedule not in planner.SCHEDULES:
        raise ValueError(f"--schedule {args.schedule} is not one of {list(planner.SCHEDULES)}")
    counts = [m for m, _ in planner.microbatch_options(run)]
    if args.microbatches is not None and args.microbatches not in counts:
        raise ValueError(f"--microbatches {args.microbatches} does not divide this run's batch per replica "
                         f"({counts[-1]} rows); valid: {counts}")
    profile, comm = _plan_costs(run, args)
    budget = args.memory_gb * 2**30 if args.memory_gb else None
    # with a budget the memory plan decides what fits (the candidates' own column keeps the config's settings,
    # counted by the same memory model: memplan.run_memory)
    candidates = planner.plan(run, profile, comm, schedules=args.schedule and [args.schedule],
                              microbatches=args.microbatches and [args.microbatches])
    if not candidates:
        only = "".join(f", {flag} {v}" for flag, v in (("--schedule", args.schedule),
                                                      ("--microbatches", args.microbatches)) if v is not None)
        raise ValueError(f"no schedule runs pp={run.pp} with this model's {len(profile.layers)} layers{only}")
    best, tokens = candidates[0], run.config.train.seq_len * run.dp
    memory, sources = memplan.run_memory(run, profile, candidates)
    memory_of = {id(c): m for c, m in zip(candidates, memory)}
    command = _recommended_command(args.config, overrides, best)
    rows = memplan.memory_plan(run, profile, comm, candidates, budget) if budget is not None else None
    context: tuple[list[memplan.ContextRow], list[str]] = ([], [])
    if rows:
        best = rows[0].candidate
        command = _recommended_command(args.config, overrides, best, memplan.row_overrides(rows[0]))
        best.timeline = rows[0].timeline
        if not rows[0].fits or memplan.activations_dominate(rows[0]):  # long sequences: would another cp help?
            assert budget is not None
            context = memplan.context_rows(run, profile, rows[0], budget)
    if args.json:
        print(json.dumps({"profile": profile.source, "comm": {k: getattr(comm, k) for k in
                                                               ("latency", "bandwidth", "collective",
                                                                "action_overhead", "send_overhead", "source")},
                          "layers": [vars(c) for c in profile.at(profile.rows)],
                          "candidates": [planner.candidate_record(c, tokens, m) for c, m in zip(candidates, memory)],
                          "candidates_memory": _settings(run),
                          "recommended": planner.candidate_record(best, tokens, memory_of[id(best)]),
                          "command": command,
                          **({"memory_plan": _memory_record(rows, args.memory_gb)} if rows else {}),
                          **({"context_parallel": _context_record(args.config, overrides, rows, context)}
                             if context[0] or context[1] else {})}))
    else:
        _print_plan(run, profile, comm, candidates, memory, sources, args, command, rows)
        if context[0] or context[1]:
            assert rows is not None
            _print_context(run, args.config, overrides, rows, context, args.memory_gb)
    title = (f"{best.schedule}, pp={run.pp}, {best.microbatches} x {best.micro_batch} rows, "
             f"predicted {best.step_seconds * 1e3:.1f} ms, bubble {best.bubble_fraction:.3f}")
    if args.trace:
        write_atomic(args.trace, json.dumps(to_chrome_trace(best.timeline)))
    if args.png:
        render_png(best.timeline, args.png, title)
    return 0


def _plan_flags_ok(args: argparse.Namespace) -> bool:
    """`pipekit plan CONFIG`'s flags: ValueError for a bad number; False (said on stderr)
    when --png cannot be drawn here; --trace and --png must be writable files."""
    if args.memory_budget_gb is not None and args.memory_gb is not None and args.memory_budget_gb != args.memory_gb:
        raise ValueError(f"--memory-budget-gb {args.memory_budget_gb} and --memory-gb {args.memory_gb} are the same "
                         "flag with two values; give one")
    args.memory_flag = "--memory-gb" if args.memory_gb is not None else "--memory-budget-gb"
    args.memory_gb = args.memory_gb if args.memory_gb is not None else args.memory_budget_gb
    for flag, value in ((args.memory_flag, args.memory_gb), ("--latency", args.latency)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise ValueError(f"{flag} {value} must be a finite number > 0")
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be >= 1")
    return _outputs_ok(args)


def _outputs_ok(args: argparse.Namespace) -> bool:
    """--trace and --png name writable files (ValueError/OSError otherwise), and --png can be
    drawn here: False, said on stderr, when matplotlib is missing."""
    for flag, path in (("--trace", args.trace), ("--png", args.png)):
        if path:
            _check_output_file(flag, path)
    if args.png:
        try:
            import matplotlib  # noqa: F401 - optional: only --png needs it
        except ImportError:
            print("pipekit plan: --png needs matplotlib: pip install matplotlib", file=sys.stderr)
            return False
    return True


def _plan_costs(run: Run, args: argparse.Namespace):
    """(layer profile, message costs) for the plan: FLOP counts (--no-profile), two CPU ranks
    side by side (pp > 1 on the CPU, as two workers sharing this host see it), or this
    process on the run's device; --latency replaces the measured message costs."""
    try:
        device = resolve_device(run.config.train.device, local_workers(run.world_size))[0]
    except ValueError:  # train.device=cuda without enough GPUs here: plan on what there is
        device = "cpu"
    too_large = None if args.no_profile else profiler.too_large_to_profile(run, device)
    if args.no_profile or too_large:
        profile, comm = profiler.flop_layers(run), profiler.CommModel()
        if too_large:
            profile.source += f"; not profiled: {too_large}"
    elif run.pp > 1 and device == "cpu" and args.latency is None:
        profile, comm = profiler.profile_on_two_ranks(run)
    else:
        profile = profiler.profile_layers(run, device=device, threads=1 if device == "cpu" else None)
        comm = profiler.CommModel()
    if args.latency is not None:
        comm = profiler.CommModel(latency=args.latency, collective=2 * args.latency, source="--latency")
    return profile, comm


def _memory_record(rows: list[memplan.MemoryRow], budget_gb: float) -> dict:
    return {"budget_gb": budget_gb, "fits": rows[0].fits, "rows": [r.record() for r in rows],
            "recommended": rows[0].record() if rows[0].fits else None,
            "least_memory": min(rows, key=lambda r: r.memory.total).record()}


def _print_memory(run: Run, rows: list[memplan.MemoryRow], budget_gb: float, command: str, top: int) -> None:
    """The memory plan: the table, then the recommendation (or why nothing fits)."""
    print(f"\npredicted memory per rank (GiB, the worst rank; pp={run.pp} dp={run.dp} tp={run.tp} ep={run.ep}, "
          f"{run.precision.name}, {run.config.optimizer.name}) for a budget of {budget_gb:g} GiB, "
          "fits first, fastest first:")
    print(memplan.memory_table(rows, top))
    for source in sorted({r.activations_source for r in rows}):
        print(f"activations: {source}")
    if len(rows) > top:
        print(f"({len(rows) - top} more: --top {len(rows)} lists them all; --json gives them all)")
    best = rows[0]
    c = best.candidate
    if not best.fits:
        least = rows[0]  # nothing fits: the rows are by memory
        print(f"\nnothing fits {budget_gb:g} GiB per rank: the least memory is {least.memory.total / 2**30:.2f} GiB "
              f"({least.candidate.schedule}, {least.option.label()}); use more ranks (pp, tp, ep) or a larger budget")
        print(f"recommended: none fits; the least memory plan: {command}\n")
        return
    note = "" if best.runnable else " (refused by pipekit train: the command below says why)"
    print(f"\nrecommended: {c.schedule}, {c.microbatches} microbatches of {c.micro_batch}, partition {c.partition} "
          f"{c.boundaries}, {best.option.label()}: {best.step_seconds * 1e3:.1f} ms per step, "
          f"{best.memory.total / 2**30:.2f} GiB of {budget_gb:g} per rank{note}")
    print(f"  {command}\n")


def _context_command(config, overrides, rows: list[memplan.MemoryRow], c: memplan.ContextRow) -> str:
    keys = {o.split("=", 1)[0] for o in c.overrides}
    plan = [o for o in memplan.row_overrides(rows[0]) if o.split("=", 1)[0] not in keys]
    return _recommended_command(config, overrides, rows[0].candidate, [*plan, *c.overrides])


def _context_pick(rows: list[memplan.MemoryRow], context: list[memplan.ContextRow]) -> memplan.ContextRow | None:
    """The cp to recommend: the smallest that fits where the plan's best row does not, or,
    where it fits, the smallest that cuts its worst rank's total by a quarter or more; None
    if neither."""
    best = rows[0]
    for c in context:
        if c.fits and (not best.fits or c.memory.total <= 0.75 * best.memory.total):
            return c
    return None


def _context_record(config, overrides, rows, context) -> dict:
    found, refused = context
    pick = _context_pick(rows, found)
    return {"rows": [c.record() for c in found], "refused": refused,
            "recommended": pick.record() if pick else None,
            "command": _context_command(config, overrides, rows, pick) if pick else None}


def _print_context(run: Run, config, overrides, rows, context, budget_gb: float) -> None:
    """Activations dominate (or nothing fits): the plan's best row at every other cp of the same ranks."""
    found, refused = context
    best = rows[0]
    share = best.memory.activations / best.memory.total if best.memory.total else 0.0
    print(f"\nactivations are {share:.0%} of the best plan's worst rank: context parallelism cuts them (the same "
          f"{best.candidate.microbatches} x {best.candidate.micro_batch} rows and global batch, the ranks of dp x cp "
          "regrouped; memory only: step time at another cp is not predicted, the profile is at the config's length):")
    table = [["cp", "dp", "microbatches", "activ. GiB", "total GiB", ""]]
    table.append([str(run.cp), str(run.dp), str(best.candidate.microbatches),
                  f"{best.memory.activations / 2**30:.3f}", f"{best.memory.total / 2**30:.3f}",
                  ("fits" if best.fits else "over budget") + " (the plan above)"])
    table += [[str(c.cp), str(c.dp), str(c.microbatches), f"{c.memory.activations / 2**30:.3f}",
               f"{c.memory.total / 2**30:.3f}", "fits" if c.fits else "over budget"] for c in found]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    print("\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in table))
    for line in refused:
        print(f"  not possible: {line}")
    pick = _context_pick(rows, found)
    if pick is None:
        print("context parallelism: no cp of these ranks fits the budget and cuts a quarter of the memory\n")
        return
    print(f"recommended for memory: cp={pick.cp}, dp={pick.dp}: {pick.memory.total / 2**30:.2f} GiB of "
          f"{budget_gb:g} per rank")
    print(f"  {_context_command(config, overrides, rows, pick)}\n")


def _settings(run: Run) -> str:
    """What the candidates' memory column counts: the run's own settings (`memplan.run_option`)."""
    note = memplan.unmodelled_checkpointing(run)
    return f"the worst rank at the config's {memplan.run_option(run).label()}" + (f" ({note})" if note else "")


def _print_plan(run: Run, profile, comm, candidates, memory: list[list[float]], sources: set[str],
                args: argparse.Namespace, command: str, rows: list[memplan.MemoryRow] | None = None) -> None:
    """The plan as text: the layer table, the message costs, the candidates, the recommendation."""
    best, cfg = candidates[0], run.config
    print(f"layers ({profile.source}; {profile.rows} rows x {cfg.train.seq_len} tokens per microbatch):")
    print(planner.layer_table(profile))
    print(f"\nmessages: {comm.latency * 1e6:.0f} us + bytes / {comm.bandwidth / 1e9:.2f} GB/s; "
          f"posting a send {comm.send_overhead * 1e6:.0f} us; engine overhead {comm.action_overhead * 1e6:.0f} us "
          f"per action ({comm.source})")
    print(f"\npredicted steps, pp={run.pp} dp={run.dp} tp={run.tp}, "
          f"{cfg.train.micro_batch * cfg.schedule.microbatches} rows per dp replica (fastest first):")
    print(planner.candidate_table(candidates, cfg.train.seq_len * run.dp, args.top, memory))
    print(f"peak GiB/rank: {_settings(run)}; activations {'; '.join(sorted(sources))}"
          + ("" if rows else f" (every setting, component by component: {args.memory_flag} N)"))
    if rows:
        _print_memory(run, rows, args.memory_gb, command, args.top)
        print(render_text(rows[0].timeline))
        return
    print(f"\nrecommended: {best.schedule}, {best.microbatches} microbatches of {best.micro_batch}, partition "
          f"{best.partition} {best.boundaries}: {best.step_seconds * 1e3:.1f} ms per step")
    print(f"  {command}\n")
    print(render_text(best.timeline))


def _recommended_command(config, overrides, best, extra: list[str] | None = None) -> str:
    """`pipekit train` with the config's overrides and the plan's (`extra`: instead of the candidate's own)."""
    mine = extra if extra is not None else best.overrides()
    keys = {o.split("=", 1)[0] for o in mine} | {"train.global_batch"}
    keep = [o for o in overrides if o.split("=", 1)[0] not in keys]
    return " ".join(["pipekit train", *([config] if config else []), *keep, *mine])


def _check_output_file(flag: str, path: str) -> None:
    """`path` can be written as a file: not a directory, in a writable directory that exists."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{flag} {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{flag} {path}: the directory {parent} is not writable by this user")
