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
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args
from torch.distributed.run import run as torchrun

from . import __version__, planner, profiler
from .atomic import write_atomic
from .comm import PeerClosed
from .config import ConfigError, Run, load_run
from .data import prepare_data
from .env import format_report, report
from .generate import generate_text
from .preflight import check_before_launch
from .schedules import ScheduleError, TimelineEvent, plan_report, render_png, render_text, to_chrome_trace
from .topology import fell_back, local_workers, resolve_device
from .train import partition_of, train


def _train(args: argparse.Namespace) -> int:
    """Resolve the run (its errors before any worker starts), check the paths it names,
    then launch the workers (each resolves the same run again from the same argv) or,
    as one of them, train."""
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
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
        if os.environ.get("RANK", "0") == "0":  # under a user's torchrun, said once
            print(f"pipekit train: {e}", file=sys.stderr)
        return 2
    device = _device(cfg)
    if device is None:
        return 2
    # Checked here, or by every worker a user's own torchrun started (before the first collective,
    # so before any rank writes), but not in workers of this command's launcher or a restart.
    checked = "PIPEKIT_ERROR_DIR" in os.environ or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not checked and (taken := _out_dir_taken(cfg)):
        if os.environ.get("RANK", "0") == "0":
            print(f"pipekit train: {taken}", file=sys.stderr)
        return 2
    lock = _lock_out_dir(cfg) if "RANK" not in os.environ else None  # held until this command returns
    if isinstance(lock, str):
        print(f"pipekit train: {lock}", file=sys.stderr)
        return 2
    if cfg.world_size > 1 and "RANK" not in os.environ:
        # The workers take this process's answer: after auto -> cpu with a GPU visible they must
        # not resolve again (each would call set_device on an ordinal that is not there).
        argv = ["train", *([args.config] if args.config else []), *args.overrides, f"train.device={device}"]
        if run.partition == "profile":  # once, here, before the workers share the cores
            argv += _profiled_partition(run, device)
        return _launch(cfg.world_size, argv, max_restarts=args.max_restarts)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != cfg.world_size:
        print(f"pipekit train: torchrun started {os.environ['WORLD_SIZE']} workers but the config asks for "
              f"pp*dp*tp = {cfg.world_size}", file=sys.stderr)
        return 2
    return _run_worker(run)


def _profiled_partition(run: Run, device: str) -> list[str]:
    """schedule.partition=profile resolved to boundaries in the launcher, as overrides for the workers."""
    bounds = partition_of(run, "cuda" if device == "cuda" else "cpu")
    print(f"pipekit: schedule.partition=profile -> boundaries {bounds} (layer times measured on this machine)",
          flush=True)
    return [f"schedule.partition={','.join(map(str, bounds))}", "schedule.memory_budget_gb=null"]


def _run_worker(run: Run) -> int:
    """Train on this process (one of the workers, or the only one). An error is reported once,
    from the rank where it started: a rank that failed only because a peer stopped stays
    quiet (exit status PEER_STOPPED); the launcher collects the rest (see `_report_failures`)."""
    try:
        summary = train(run)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported once, below
        return _worker_failed(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    stopped = summary.get("stopped_by") if isinstance(summary, dict) else None
    if stopped in ("SIGINT", "SIGTERM") and "RANK" not in os.environ:
        return 128 + getattr(signal, stopped)  # the shell's convention for a run ended by a signal
    return 0


PEER_STOPPED = 3  # a worker's exit status when it failed only because another rank stopped first
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "closed its connection")


def _caused_by_peer(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, PeerClosed) or any(mark in str(e) for mark in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def _worker_failed(e: BaseException) -> int:
    """Report a worker's error once and return its exit status: 2 for a user's mistake (one
    line), 1 for anything else (the traceback), PEER_STOPPED (nothing printed) when the rank
    only lost a peer. Under `pipekit train`'s launcher the report goes to a file the launcher
    prints from; under a user's own torchrun it is printed here."""
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(e, KeyboardInterrupt):
        return 130
    peer = _caused_by_peer(e)
    user = isinstance(e, USER_ERRORS) and not peer
    if os.environ.get("PIPEKIT_DEBUG") == "1":
        user = False
    text = _first_line(e) if user else "".join(traceback.format_exception(e)).rstrip()
    status = PEER_STOPPED if peer else (2 if user else 1)
    report_dir = os.environ.get("PIPEKIT_ERROR_DIR")
    if report_dir:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        write_atomic(os.path.join(report_dir, f"attempt{attempt}-rank{rank}.json"),
                     json.dumps({"rank": rank, "peer": peer, "user": user, "text": text, "time": time.time()}))
    elif not peer:
        who = f"rank {rank}: " if "RANK" in os.environ else ""
        print(f"pipekit train: {who}{text}" if user else text, file=sys.stderr, flush=True)
    return status


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


RUN_FILES = ("metrics.jsonl", "model.pt", "checkpoints")


def _out_dir_taken(cfg) -> str | None:
    """Why this run must not write into `logging.out_dir` (another run's files are there,
    and neither `train.resume` nor `logging.overwrite` is set), or None."""
    out = cfg.logging.out_dir
    if not out or cfg.logging.overwrite or cfg.train.resume or not os.path.isdir(out):
        return None
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if not found:
        return None
    return (f"logging.out_dir={out} holds another run ({', '.join(found)}); continue it with train.resume=auto, "
            f"choose another logging.out_dir, or pass logging.overwrite=true to replace it")


def _lock_out_dir(cfg):
    """An open, exclusively locked `out_dir/.pipekit.lock` (the lock lasts as long as this
    process), None without an out_dir or where file locks are unavailable, or the reason
    another live run holds it. Taken after every other pre-launch check has passed."""
    out = cfg.logging.out_dir
    try:
        import fcntl
    except ImportError:  # not on this platform: no lock
        return None
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    handle = open(os.path.join(out, ".pipekit.lock"), "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return f"another pipekit run is writing to logging.out_dir={out}; wait for it or choose another out_dir"
    return handle


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


def _launch(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Start `nproc` workers on this machine through torch.distributed.run, each running
    `pipekit argv`; with `max_restarts`, a failed group is restarted (and resumes from its
    newest checkpoint) up to that many times. Errors are reported once (`_report_failures`)."""
    print(f"pipekit: launching {nproc} workers with torch.distributed.run"
          + (f" (up to {max_restarts} restarts)" if max_restarts else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="pipekit-errors-") as reports:
        os.environ["PIPEKIT_ERROR_DIR"] = reports
        try:
            torchrun(parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                            "-m", "pipekit.cli", *argv]))
        except ChildFailedError as e:
            return _report_failures(e, reports)
        except SignalException as e:  # Ctrl-C or SIGTERM: the workers save, say where, and stop
            return 128 + int(e.sigval)
        finally:
            os.environ.pop("PIPEKIT_ERROR_DIR", None)
    return 0


def _report_failures(e, reports: str) -> int:
    """Print each distinct error of the last attempt once (the earliest first), naming the
    ranks it came from, then one line on the ranks that stopped only because a peer did."""
    found = []
    for name in os.listdir(reports):
        try:
            with open(os.path.join(reports, name)) as f:
                found.append((name.split("-")[0], json.load(f)))
        except (OSError, ValueError):
            continue
    last = max((a for a, _ in found), key=lambda a: int(a.removeprefix("attempt")), default=None)
    reports_now = sorted((r for a, r in found if a == last), key=lambda r: r["time"])
    origins: dict[str, list[int]] = {}
    for r in reports_now:
        if not r["peer"]:
            origins.setdefault(r["text"], []).append(r["rank"])
    for text, ranks in origins.items():
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
        print(f"pipekit train: {who}: {text}" if "\n" not in text else f"pipekit train: {who} failed:\n{text}",
              file=sys.stderr)
    failed = sorted(e.failures)
    silent = [r for r in failed if not any(r in ranks for ranks in origins.values())]
    if not origins:
        print(f"pipekit train: worker rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed "
              f"(the first failure is rank {e.get_first_failure()[0]}; see its output above)", file=sys.stderr)
    elif silent:
        print(f"pipekit train: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped because "
              f"another rank did", file=sys.stderr)
    users = all(r["user"] for r in reports_now if not r["peer"]) and origins
    return 2 if users else 1


def _plan(args: argparse.Namespace) -> int:
    """Every input, including where --trace and --png go (and matplotlib for --png), is
    checked before either file is written: a mistake writes nothing."""
    if args.config is not None:
        return _plan_config(args)
    if args.pp is None or args.microbatches is None:
        raise ValueError("give a training config (pipekit plan CONFIG [key=value ...]), or --pp and "
                         "--microbatches to simulate one schedule under unit costs")
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
    overrides = list(args.overrides)
    if "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        overrides, args.config = [args.config, *overrides], None
    try:
        run = load_run(args.config, overrides)
    except ConfigError as e:
        print(f"pipekit plan: {e}", file=sys.stderr)
        return 2
    if not _plan_flags_ok(args):
        return 2
    profile, comm = _plan_costs(run, args)
    budget = args.memory_gb * 2**30 if args.memory_gb else None
    candidates = planner.plan(run, profile, comm, budget=budget)
    if not candidates:
        raise ValueError(f"no schedule runs pp={run.pp} with this model's {len(profile.layers)} layers")
    best, tokens = candidates[0], run.config.train.seq_len * run.dp
    command = _recommended_command(args.config, overrides, best)
    if args.json:
        print(json.dumps({"profile": profile.source, "comm": {k: getattr(comm, k) for k in
                                                               ("latency", "bandwidth", "collective",
                                                                "action_overhead", "send_overhead", "source")},
                          "layers": [vars(c) for c in profile.at(profile.rows)],
                          "candidates": [planner.candidate_record(c, tokens) for c in candidates],
                          "recommended": planner.candidate_record(best, tokens), "command": command}))
    else:
        _print_plan(run, profile, comm, candidates, args, command)
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
    for flag, value in (("--memory-gb", args.memory_gb), ("--latency", args.latency)):
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
    if args.no_profile:
        profile, comm = profiler.flop_layers(run), profiler.CommModel()
    elif run.pp > 1 and device == "cpu" and args.latency is None:
        profile, comm = profiler.profile_on_two_ranks(run)
    else:
        profile = profiler.profile_layers(run, device=device, threads=1 if device == "cpu" else None)
        comm = profiler.CommModel()
    if args.latency is not None:
        comm = profiler.CommModel(latency=args.latency, collective=2 * args.latency, source="--latency")
    return profile, comm


def _print_plan(run: Run, profile, comm, candidates, args: argparse.Namespace, command: str) -> None:
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
    if not best.fits:
        print(f"\nnothing fits {args.memory_gb} GiB per rank; the fastest is shown")
    print(f"\nrecommended: {best.schedule}, {best.microbatches} microbatches of {best.micro_batch}, partition "
          f"{best.partition} {best.boundaries}: {best.step_seconds * 1e3:.1f} ms per step")
    print(f"  {command}\n")
    print(render_text(best.timeline))


def _recommended_command(config, overrides, best) -> str:
    keep = [o for o in overrides if o.split("=", 1)[0] not in
            {"schedule.name", "schedule.chunks_per_rank", "schedule.microbatches", "train.micro_batch",
             "schedule.partition", "train.global_batch"}]
    return " ".join(["pipekit train", *([config] if config else []), *keep, *best.overrides()])


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
                            seed=args.seed)
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


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipekit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pipekit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a config")
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.pp=2")
    t.add_argument("--show", action="store_true", help="print the merged, checked config (every key) and exit")
    t.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart failed workers up to N times (torchrun's --max-restarts); each restart resumes "
                        "from the newest checkpoint")
    t.set_defaults(fn=_train)

    q = sub.add_parser("plan", help="predict a config's step for every schedule and recommend one; or simulate "
                                    "one schedule under unit costs (--pp, --microbatches)")
    q.add_argument("config", nargs="?", help="YAML training config: profile its layers and plan it")
    q.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    q.add_argument("--no-profile", action="store_true",
                   help="with CONFIG: FLOP counts on the meta device instead of timing the layers")
    q.add_argument("--memory-gb", type=float, default=None, help="with CONFIG: memory per rank to fit in (GiB)")
    q.add_argument("--latency", type=float, default=None, metavar="SECONDS",
                   help="with CONFIG: message latency instead of measuring it")
    q.add_argument("--top", type=int, default=12, help="with CONFIG: candidates to list")
    q.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv | dualpipe_v")
    q.add_argument("--pp", type=int, default=None)
    q.add_argument("--microbatches", type=int, default=None)
    q.add_argument("--virtual", type=int, default=None,
                   help="virtual stages per rank (interleaved_1f1b; default: the schedule's own)")
    q.add_argument("--f-cost", type=float, default=1.0)
    q.add_argument("--b-cost", type=float, default=2.0)
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


# What a user's mistake raises (a missing or unreadable file, a bad value): one line and exit
# status 2 instead of a traceback. PIPEKIT_DEBUG=1 shows the traceback.
USER_ERRORS = (OSError, ValueError, EOFError, pickle.UnpicklingError)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        if os.environ.get("PIPEKIT_DEBUG") == "1":
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pipekit {args.command}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
