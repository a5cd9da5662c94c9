"""The `pipekit` command.

    pipekit train [CONFIG.yaml] [key=value ...] [--show]   train (--show: print the merged config and exit)
    pipekit plan --schedule 1f1b --pp 4 --microbatches 8 [--virtual 2] [--json] [--trace F.json] [--png F.png]
    pipekit prepare-data FILES_OR_DIRS --out DIR [--tokenizer tokenizer.json]
    pipekit convert --from-hf HF_DIR --out model.pt | --to-hf model.pt|CHECKPOINT --out HF_DIR
    pipekit generate runs/x/model.pt|runs/x/checkpoints[/step_N] --prompt "def "
    pipekit env
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict

from omegaconf import OmegaConf

from . import __version__, launch, memplan, planner, profiler, rundirs
from .atomic import write_atomic
from .config import ConfigError, Run, load_run
from .data import prepare_data
from .env import format_report, report
from .generate import generate_text
from .preflight import check_before_launch
from .schedules import ScheduleError, TimelineEvent, plan_report, render_png, render_text, to_chrome_trace
from .topology import fell_back, local_workers, resolve_device
from .train import partition_of


def _config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """The config file and the key=value overrides of a command line, in whatever order the
    user gave them (the file first, last or between overrides). ConfigError, in one line,
    for a word that is neither (`train.steps 3`: said as `train.steps=3`) or two files."""
    words = [w for w in (config, *overrides) if w is not None]
    files = [w for w in words if "=" not in w and (w.endswith((".yaml", ".yml")) or os.path.exists(w))]
    if len(files) > 1:
        raise ConfigError(f"one config file, got {len(files)}: {' and '.join(files)}; a second file's settings "
                          "go in as key=value overrides")
    rest = [w for w in words if w not in files]
    for i, word in enumerate(rest):
        if "=" not in word:
            after = rest[i + 1] if i + 1 < len(rest) and "=" not in rest[i + 1] else None
            hint = f" (did you mean {word}={after}?)" if after is not None else ""
            raise ConfigError(f"{word!r} is neither a config file (not found) nor a key=value override{hint}")
    return (files[0] if files else None), rest


def _train(args: argparse.Namespace) -> int:
    """Resolve the run (its errors before any worker starts), check the paths it names,
    then launch the workers (each resolves the same run again from the same argv) or,
    as one of them, train."""
    launch.die_with_launcher()
    try:
        args.config, args.overrides = _config_and_overrides(args.config, args.overrides)
        run = load_run(args.config, args.overrides)
    except ConfigError as e:
        print(f"pipekit train: {e}", file=sys.stderr)
        return 2
    cfg = run.config
    if args.show:
        print(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))), end="")
        return 0
    try:
        check_before_launch(run)  # the data, out_dir, checkpoint dir and the checkpoint to resume from
    except ConfigError as e:
        return _refuse(str(e))
    device = _device(cfg)
    if device is None:
        return 2
    # Checked here, or by every worker a user's own torchrun started (before the first collective,
    # so before any rank writes), but not in workers of this command's launcher or a restart.
    checked = "PIPEKIT_ERROR_DIR" in os.environ or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not checked and os.environ.get("RANK", "0") == "0" and (busy := rundirs.held_by_a_live_run(cfg)):
        print(f"pipekit train: {busy}", file=sys.stderr)
        return 2
    if not checked and (taken := rundirs.out_dir_taken(cfg)):
        return _refuse(taken)
    made = [] if checked else rundirs.dirs_to_make(cfg)
    locks = rundirs.hold_run_dirs(cfg)  # held until this process exits
    if isinstance(locks, str):
        return _refuse(locks)
    try:
        if cfg.world_size > 1 and "RANK" not in os.environ:
            # The workers take this process's answer: after auto -> cpu with a GPU visible they must
            # not resolve again (each would call set_device on an ordinal that is not there).
            argv = ["train", *([args.config] if args.config else []), *args.overrides, f"train.device={device}"]
            if run.partition == "profile":  # once, here, before the workers share the cores
                argv += _profiled_partition(run, device)
            return launch.launch(cfg.world_size, argv, max_restarts=args.max_restarts,
                           grace=cfg.checkpoint.stop_grace_s)
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            print(f"pipekit train: torchrun started {os.environ['WORLD_SIZE']} workers but the config asks for "
                  f"pp*dp*tp = {cfg.world_size}", file=sys.stderr)
            return 2
        return launch.run_worker(run)
    finally:
        rundirs.leave_no_trace(made)


# Under a user's torchrun every rank refuses, rank 0 says why: the others wait this long before
# exiting, so that torchrun, which stops the group when the first worker fails, does not stop
# rank 0 before it has printed its line.
REFUSAL_GRACE_S = 5.0


def _refuse(why: str) -> int:
    """Refuse a run before it starts: the reason once (rank 0, or the only process), exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"pipekit train: {why}", file=sys.stderr, flush=True)
    else:
        time.sleep(REFUSAL_GRACE_S)
    return 2


def _profiled_partition(run: Run, device: str) -> list[str]:
    """schedule.partition=profile resolved to boundaries in the launcher, as overrides for the workers."""
    bounds = partition_of(run, "cuda" if device == "cuda" else "cpu")
    print(f"pipekit: schedule.partition=profile -> boundaries {bounds} (layer times measured on this machine)",
          flush=True)
    return [f"schedule.partition={','.join(map(str, bounds))}", "schedule.memory_budget_gb=null"]


def _device(cfg) -> str | None:
    """"cuda" or "cpu" for this node's workers, or None after printing why the requested device
    cannot be had. Prints the notice when auto fell back to the CPU although a GPU is visible
    (here, once, for workers this command launches; `train()` prints it otherwise)."""
    try:
        device, reason = resolve_device(cfg.train.device, local_workers(cfg.world_size))
    except ValueError as e:
        print(f"pipekit train: {e}", file=sys.stderr)
        return None
    if fell_back(cfg.train.device, device) and cfg.world_size > 1 and "RANK" not in os.environ:
        print(f"pipekit: {reason}", flush=True)
    return device


def _plan(args: argparse.Namespace) -> int:
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
    for flag, path in (("--trace", args.trace), ("--png", args.png)):
        if path:
            _check_output_file(flag, path)
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("pipekit plan: --png needs matplotlib: pip install matplotlib", file=sys.stderr)
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
        args.config, overrides = _config_and_overrides(args.config, args.overrides)
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
    # with a budget the memory plan decides what fits (the candidates' own column keeps the config's settings)
    candidates = planner.plan(run, profile, comm, schedules=args.schedule and [args.schedule],
                              microbatches=args.microbatches and [args.microbatches])
    if not candidates:
        only = "".join(f", {flag} {v}" for flag, v in (("--schedule", args.schedule),
                                                      ("--microbatches", args.microbatches)) if v is not None)
        raise ValueError(f"no schedule runs pp={run.pp} with this model's {len(profile.layers)} layers{only}")
    best, tokens = candidates[0], run.config.train.seq_len * run.dp
    command = _recommended_command(args.config, overrides, best)
    rows = memplan.memory_plan(run, profile, comm, candidates, budget) if budget is not None else None
    if rows:
        best = rows[0].candidate
        command = _recommended_command(args.config, overrides, best, memplan.row_overrides(rows[0]))
        best.timeline = rows[0].timeline
    if args.json:
        print(json.dumps({"profile": profile.source, "comm": {k: getattr(comm, k) for k in
                                                               ("latency", "bandwidth", "collective",
                                                                "action_overhead", "send_overhead", "source")},
                          "layers": [vars(c) for c in profile.at(profile.rows)],
                          "candidates": [planner.candidate_record(c, tokens) for c in candidates],
                          "recommended": planner.candidate_record(best, tokens), "command": command,
                          **({"memory_plan": _memory_record(rows, args.memory_gb)} if rows else {})}))
    else:
        _print_plan(run, profile, comm, candidates, args, command, rows)
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
    note = "" if best.runnable else " (not yet runnable: this pipekit does not run it)"
    print(f"\nrecommended: {c.schedule}, {c.microbatches} microbatches of {c.micro_batch}, partition {c.partition} "
          f"{c.boundaries}, {best.option.label()}: {best.step_seconds * 1e3:.1f} ms per step, "
          f"{best.memory.total / 2**30:.2f} GiB of {budget_gb:g} per rank{note}")
    print(f"  {command}\n")


def _print_plan(run: Run, profile, comm, candidates, args: argparse.Namespace, command: str,
                rows: list[memplan.MemoryRow] | None = None) -> None:
    """The plan as text: the layer table, the message costs, the candidates, the recommendation."""
    best, cfg = candidates[0], run.config
    print(f"layers ({profile.source}; {profile.rows} rows x {cfg.train.seq_len} tokens per microbatch):")
    print(planner.layer_table(profile))
    print(f"\nmessages: {comm.latency * 1e6:.0f} us + bytes / {comm.bandwidth / 1e9:.2f} GB/s; "
          f"posting a send {comm.send_overhead * 1e6:.0f} us; engine overhead {comm.action_overhead * 1e6:.0f} us "
          f"per action ({comm.source})")
    print(f"\npredicted steps, pp={run.pp} dp={run.dp} tp={run.tp}, "
          f"{cfg.train.micro_batch * cfg.schedule.microbatches} rows per dp replica (fastest first):")
    print(planner.candidate_table(candidates, cfg.train.seq_len * run.dp, args.top))
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


def _prepare_data(args: argparse.Namespace) -> int:
    try:
        meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                            seed=args.seed, overwrite=args.overwrite)
    except ImportError as e:  # --tokenizer needs the optional tokenizers package
        if e.name != "tokenizers":
            raise
        print(f"pipekit prepare-data: {e}", file=sys.stderr)
        return 2
    print(json.dumps(meta, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        text = generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                             args.seed)
    except ImportError as e:  # the model's tokenizer.json needs the optional tokenizers package
        if e.name != "tokenizers":
            raise
        print(f"pipekit generate: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _env(args: argparse.Namespace) -> int:
    print(format_report(report()))
    return 0


_DTYPES = ("bfloat16", "float16", "float32")  # convert --dtype: torch dtypes by name


def _add_convert_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `pipekit convert`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="a Hugging Face model dir (config.json + weights)")
    src.add_argument("--to-hf", metavar="MODEL", help="a model pipekit saved: a model.pt, a checkpoint dir "
                     "(checkpoints/step_N) or a checkpoints root (its newest complete checkpoint)")
    parser.add_argument("--out", required=True, help="the pipekit file (--from-hf) or HF model dir (--to-hf) to write")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="cast floating weights (default: keep)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file, or the model files in an existing --out dir "
                             "(other files in it are kept)")


def _convert(args: argparse.Namespace) -> int:
    """Run `pipekit convert`; 0 on success, 2 with a message on stderr for bad input."""
    import torch

    from .interchange import convert

    direction, src = ("from_hf", args.from_hf) if args.from_hf else ("to_hf", args.to_hf)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        convert(src, args.out, direction, overwrite=args.overwrite, dtype=dtype)
    except ImportError as e:
        if e.name != "transformers":
            raise
        print(f"pipekit convert: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as e:
        said = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) quotes its message
        print(f"pipekit convert: {said}", file=sys.stderr)
        return 2
    print(f"pipekit convert: wrote {args.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (and where to find the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _count(text: str) -> int:
    """An argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipekit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pipekit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a config")
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.pp=2")
    t.add_argument("--show", action="store_true", help="print the merged, checked config (every key) and exit")
    t.add_argument("--max-restarts", type=_count, default=0, metavar="N",
                   help="restart failed workers up to N times (torchrun's --max-restarts); each restart resumes "
                        "from the newest checkpoint")
    t.set_defaults(fn=_train)

    q = sub.add_parser("plan", help="predict a config's step for every schedule and recommend one; or simulate "
                                    "one schedule under unit costs (--pp, --microbatches)")
    q.add_argument("config", nargs="?", help="YAML training config: profile its layers and plan it")
    q.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    q.add_argument("--no-profile", action="store_true",
                   help="with CONFIG: FLOP counts on the meta device instead of timing the layers")
    q.add_argument("--memory-budget-gb", type=float, default=None, metavar="GIB",
                   help="with CONFIG: memory per rank to fit in (GiB); also predicts each rank's parameters, "
                        "gradients, master weights, optimizer state and activations for every schedule x ZeRO "
                        "stage x sequence parallelism x activation checkpointing, and recommends the fastest "
                        "that fits")
    q.add_argument("--memory-gb", type=float, default=None, metavar="GIB", help="the same as --memory-budget-gb")
    q.add_argument("--latency", type=float, default=None, metavar="SECONDS",
                   help="with CONFIG: message latency instead of measuring it")
    q.add_argument("--top", type=int, default=12, help="with CONFIG: candidates to list")
    q.add_argument("--schedule", default=None,
                   help="gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv | dualpipe_v (default 1f1b; with CONFIG: "
                        "plan only this schedule)")
    q.add_argument("--pp", type=int, default=None, help="without CONFIG (with one, parallel.pp=N)")
    q.add_argument("--microbatches", type=int, default=None, help="(with CONFIG: plan only this count)")
    q.add_argument("--virtual", type=int, default=None,
                   help="virtual stages per rank (interleaved_1f1b; default: the schedule's own)")
    q.add_argument("--f-cost", type=float, default=None, help="without CONFIG: a forward's cost (default 1)")
    q.add_argument("--b-cost", type=float, default=None, help="without CONFIG: a backward's cost (default 2)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--trace", metavar="FILE", help="also write the timeline as Chrome-trace JSON (Perfetto)")
    q.add_argument("--png", metavar="FILE", help="also draw the timeline as a PNG (needs matplotlib)")
    q.set_defaults(fn=_plan)

    d = sub.add_parser("prepare-data", help="tokenise text files into a memory-mapped dataset")
    d.add_argument("inputs", nargs="+", help="files or directories (*.py, *.txt, *.md below a directory)")
    d.add_argument("--out", required=True, help="output directory (train.bin, val.bin, meta.json)")
    d.add_argument("--tokenizer", default=None, help="a HuggingFace tokenizer.json (default: bytes)")
    d.add_argument("--val-fraction", type=float, default=0.01)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    d.set_defaults(fn=_prepare_data)

    c = sub.add_parser("convert", help="import weights from / export to HuggingFace transformers")
    _add_convert_args(c)
    c.set_defaults(fn=_convert)

    g = sub.add_parser("generate", help="sample text from a trained model.pt or a checkpoint")
    g.add_argument("checkpoint")
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=_generate)

    e = sub.add_parser("env", help="report versions and usable backends")
    e.set_defaults(fn=_env)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)  # `train CONFIG --max-restarts 1 key=value`: overrides after a flag
    if extra:
        unknown = [w for w in extra if w.startswith("-")] if args.command in ("train", "plan") else extra
        if unknown:
            p.exit(2, f"pipekit {args.command}: unrecognized arguments: {' '.join(unknown)} "
                      f"(see pipekit {args.command} --help)\n")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.fn(args)
    except launch.USER_ERRORS as e:
        if os.environ.get("PIPEKIT_DEBUG") == "1":
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pipekit {args.command}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    status = main()
    if launch.trained_in_a_group():
        launch.exit_worker(status)
    sys.exit(status)
