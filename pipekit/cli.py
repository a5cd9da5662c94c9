"""The `pipekit` command.

    pipekit train [CONFIG.yaml] [key=value ...] [--show]   train (--show: print the merged config and exit)
    pipekit plan --schedule 1f1b --pp 4 --microbatches 8 [--virtual 2] [--json] [--trace F.json] [--png F.png]
    pipekit prepare-data FILES_OR_DIRS --out DIR [--tokenizer tokenizer.json]
    pipekit convert --from-hf HF_DIR --out model.pt | --to-hf model.pt --out HF_DIR
    pipekit generate runs/x/model.pt --prompt "def "
    pipekit env
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys


def _train(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"pipekit train: {e}", file=sys.stderr)
        return 2
    if args.show:
        from dataclasses import asdict

        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))), end="")
        return 0
    device = _device(cfg)
    if device is None:
        return 2
    if "RANK" not in os.environ and (taken := _out_dir_taken(cfg)):
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
        return _launch(cfg.world_size, argv)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != cfg.world_size:
        print(f"pipekit train: torchrun started {os.environ['WORLD_SIZE']} workers but the config asks for "
              f"pp*dp*tp = {cfg.world_size}", file=sys.stderr)
        return 2
    from .train import train

    try:
        train(cfg)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


RUN_FILES = ("metrics.jsonl", "model.pt")


def _out_dir_taken(cfg) -> str | None:
    """Why this run must not write into `logging.out_dir` (another run's files are there and
    `logging.overwrite` is off), or None. Checked by the launcher before any worker starts;
    workers started by a user's own torchrun are not checked."""
    out = cfg.logging.out_dir
    if not out or cfg.logging.overwrite or not os.path.isdir(out):
        return None
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if not found:
        return None
    return (f"logging.out_dir={out} holds another run ({', '.join(found)}); choose another "
            f"logging.out_dir, or pass logging.overwrite=true to replace it")


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
    from .topology import fell_back, local_workers, resolve_device

    try:
        device, reason = resolve_device(cfg.train.device, local_workers(cfg.world_size))
    except ValueError as e:
        print(f"pipekit train: {e}", file=sys.stderr)
        return None
    if fell_back(cfg.train.device, device) and cfg.world_size > 1 and "RANK" not in os.environ:
        print(f"pipekit: {reason}", flush=True)
    return device


def _launch(nproc: int, argv: list[str]) -> int:
    """Start `nproc` workers on this machine through torch.distributed.run, each running `pipekit argv`."""
    from torch.distributed.run import parse_args, run

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    print(f"pipekit: launching {nproc} workers with torch.distributed.run", flush=True)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "pipekit.cli", *argv]))
    except ChildFailedError as e:
        ranks = sorted(e.failures)
        print(f"pipekit train: worker rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed "
              f"(the first failure is rank {e.get_first_failure()[0]}; its error is printed above)", file=sys.stderr)
        return 1
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .schedules import ScheduleError, TimelineEvent, plan_report, render_png, render_text, to_chrome_trace

    costs = {"F": args.f_cost, "B": args.b_cost}
    try:
        report = plan_report(args.schedule, args.pp, args.microbatches, args.virtual, costs=costs)
    except ScheduleError as e:
        print(f"pipekit plan: {e}", file=sys.stderr)
        return 2
    events = [TimelineEvent(**e) for e in report["timeline"]]
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(to_chrome_trace(events), f)
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


def _prepare_data(args: argparse.Namespace) -> int:
    from .data import prepare_data

    meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction, seed=args.seed)
    print(json.dumps(meta, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .generate import generate_text

    print(generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0


def _env(args: argparse.Namespace) -> int:
    from .env import format_report, report

    print(format_report(report()))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .models.hf import run_convert

    return run_convert(args) or 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipekit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    p.add_argument("--version", action="version", version=f"pipekit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a config")
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.pp=2")
    t.add_argument("--show", action="store_true", help="print the merged, checked config (every key) and exit")
    t.set_defaults(fn=_train)

    q = sub.add_parser("plan", help="simulate a schedule and print its timeline and figures")
    q.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved_1f1b")
    q.add_argument("--pp", type=int, required=True)
    q.add_argument("--microbatches", type=int, required=True)
    q.add_argument("--virtual", type=int, default=1, help="virtual stages per rank (interleaved_1f1b)")
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
    from .models.hf import add_convert_args

    add_convert_args(c)
    c.set_defaults(fn=_convert)

    g = sub.add_parser("generate", help="sample text from a trained model.pt")
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
