"""The `pipekit` command.

    pipekit train [CONFIG.yaml] [key=value ...]   train (launches its own workers when pp*dp > 1)
    pipekit plan --schedule 1f1b --pp 4 --microbatches 8 [--virtual 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
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
    if cfg.world_size > 1 and "RANK" not in os.environ:
        return _launch(cfg.world_size, ["train", *([args.config] if args.config else []), *args.overrides])
    from .train import train

    train(cfg)
    return 0


def _launch(nproc: int, argv: list[str]) -> int:
    """Start `nproc` workers on this machine through torch.distributed.run, each running `pipekit argv`."""
    from torch.distributed.run import parse_args, run

    print(f"pipekit: launching {nproc} workers with torch.distributed.run", flush=True)
    run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "pipekit.cli", *argv]))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .schedules import ScheduleError, plan_report, render_text
    from .schedules import TimelineEvent

    costs = {"F": args.f_cost, "B": args.b_cost}
    try:
        report = plan_report(args.schedule, args.pp, args.microbatches, args.virtual, costs=costs)
    except ScheduleError as e:
        print(f"pipekit plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    events = [TimelineEvent(**e) for e in report["timeline"]]
    print(render_text(events))
    print(f"makespan {report['makespan']:g}  bubble {report['bubble_fraction']:.3f}  "
          f"peak activations per rank {report['peak_activations']}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipekit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a config")
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.pp=2")
    t.set_defaults(fn=_train)
    q = sub.add_parser("plan", help="simulate a schedule and print its timeline and figures")
    q.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved_1f1b")
    q.add_argument("--pp", type=int, required=True)
    q.add_argument("--microbatches", type=int, required=True)
    q.add_argument("--virtual", type=int, default=1, help="virtual stages per rank (interleaved_1f1b)")
    q.add_argument("--f-cost", type=float, default=1.0)
    q.add_argument("--b-cost", type=float, default=2.0)
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(fn=_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
