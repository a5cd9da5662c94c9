"""`pipekit train`: resolve the run, check what it names, launch the workers or train.

Every refusal happens here, before a worker starts: the config (`pipekit.config`), the
paths it names (`preflight`), the directories another live run holds (`rundirs`), the
device. Then either this process launches `world_size` workers through
`torch.distributed.run` (`launch`), or, as one of them, trains (`loop.train`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import asdict

from omegaconf import OmegaConf

from .. import topology
from ..config import ConfigError, Run, config_and_overrides, load_run
from ..topology import local_workers, resolve_device
from . import launch, rundirs
from .loop import partition_of
from .preflight import check_before_launch
from .resume import checkpoint_root
from .terminal import surviving_hangup


def train_command(args: argparse.Namespace) -> int:
    """Resolve the run (its errors before any worker starts), check the paths it names,
    then launch the workers (each resolves the same run again from the same argv) or,
    as one of them, train. Its output outlives a closed terminal (`surviving_hangup`)."""
    launch.die_with_launcher()
    with surviving_hangup():
        return _train_command(args)


def _train_command(args: argparse.Namespace) -> int:
    try:
        args.config, args.overrides = config_and_overrides(args.config, args.overrides)
        if getattr(args, "deepspeed", None):  # the file's keys as overrides, once: the workers get those
            args.overrides = _deepspeed_overrides(args)  # the file's, then the command line's
            args.deepspeed = None
        run = load_run(args.config, args.overrides)
    except ConfigError as e:
        print(f"pipekit train: {e}", file=sys.stderr)
        return 2
    cfg = run.config
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if "PIPEKIT_ERROR_DIR" not in os.environ and os.environ.get("RANK", "0") == "0" and not restarted:
        for notice in run.notices:  # once, from the launcher (or rank 0 of a user's torchrun)
            print(f"pipekit: notice: {notice}", file=sys.stderr, flush=True)
    run = dataclasses.replace(run, notices=())  # said here (or not again: workers, restarts), not by train()
    if args.show:
        print(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))), end="")
        return 0
    try:
        check_before_launch(run)  # the data, out_dir, checkpoint dir and the checkpoint to resume from
    except ConfigError as e:
        return _refuse(str(e))
    gpus = topology.count_visible_gpus()
    device = _device(cfg, gpus)
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
            if on_cpu := cpu_notice(cfg, device, gpus):  # once, before any worker starts
                print(f"pipekit: notice: {on_cpu}", file=sys.stderr, flush=True)
            # The workers take this process's answer: after auto -> cpu with a GPU visible they must
            # not resolve again (each would call set_device on an ordinal that is not there).
            argv = ["train", *([args.config] if args.config else []), *args.overrides, f"train.device={device}"]
            if run.partition == "profile":  # once, here, before the workers share the cores
                argv += _profiled_partition(run, device)
            return launch.launch(cfg.world_size, argv, max_restarts=args.max_restarts,
                                 grace=cfg.checkpoint.stop_grace_s, checkpoints=checkpoint_root(cfg))
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            print(f"pipekit train: torchrun started {os.environ['WORLD_SIZE']} workers but the config asks for "
                  f"pp*dp*tp*cp = {cfg.world_size}", file=sys.stderr)
            return 2
        return launch.run_worker(run)
    finally:
        rundirs.leave_no_trace(made)


# Under a user's torchrun every rank refuses, rank 0 says why: the others wait this long before
# exiting, so that torchrun, which stops the group when the first worker fails, does not stop
# rank 0 before it has printed its line.
REFUSAL_GRACE_S = 5.0


def _deepspeed_overrides(args: argparse.Namespace) -> list[str]:
    """--deepspeed's file as overrides (`run.deepspeed.with_deepspeed`: the file's, then the command
    line's); its notes once, on stderr, from the launcher or the only process."""
    from .deepspeed import with_deepspeed

    overrides, notes = with_deepspeed(args.config, args.deepspeed, args.overrides)
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"pipekit: notice: {note}", file=sys.stderr, flush=True)
    return overrides


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


def _device(cfg, gpus: int) -> str | None:
    """"cuda" or "cpu" for this node's workers on a node with `gpus` visible GPUs, or None after
    printing why the requested device cannot be had (train.device=cuda without a GPU per worker,
    which the config's own check has normally refused already)."""
    try:
        device, _ = resolve_device(cfg.train.device, local_workers(cfg.world_size), gpus)
    except ValueError as e:
        print(f"pipekit train: {e}", file=sys.stderr)
        return None
    return device


def cpu_notice(cfg, device: str, gpus: int) -> str | None:
    """The one line for a run that train.device=auto puts on the CPU (`device`), on a node
    with `gpus` visible GPUs: none, or fewer than its workers; what the CPU is then given
    (workers and steps) and how to say it is meant. None when the device was asked for, or
    is a GPU. Said by the launcher before its workers start (`train()` says its own)."""
    if cfg.train.device != "auto" or device != "cpu":
        return None
    workers = local_workers(cfg.world_size)
    why = ("no GPU is visible (CUDA is not available)" if gpus == 0 else
           f"{gpus} GPU{'s are' if gpus > 1 else ' is'} visible for {workers} local workers (one each is needed)")
    return (f"train.device=auto: {why}, so this run trains on the CPU with gloo: {cfg.world_size} workers for "
            f"{cfg.train.steps:,} steps; set train.device=cpu to run on the CPU without this notice")
