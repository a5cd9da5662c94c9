"""The launcher and its workers: `pipekit train` starts pp*dp*tp workers through
torch.distributed.run (`launch`), each trains (`run_worker`) and reports an error once, from
the rank where it started (`worker_failed`; the launcher prints the reports, `report_failures`);
workers die with their launcher (`die_with_launcher`) and end without tearing down an
interpreter that gloo threads still use (`exit_worker`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import uuid
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing import api as elastic_api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args
from torch.distributed.run import run as torchrun

from ..checkpoint import latest_checkpoint
from ..comm import PeerClosed
from ..config import Run
from . import reports as told
from .loop import StopRequests, train


def run_worker(run: Run) -> int:
    """Train on this process (one of the workers, or the only one). An error is reported once,
    from the rank where it started: a rank that failed only because a peer stopped stays
    quiet (exit status PEER_STOPPED); the launcher collects the rest (see `report_failures`)."""
    global _had_process_group
    try:
        summary = train(run)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported once, below
        return worker_failed(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            _had_process_group = True
    stopped = summary.get("stopped_by") if isinstance(summary, dict) else None
    if stopped is None:
        return 0
    status = PREEMPTED if summary.get("checkpoint") else 128 + getattr(signal, stopped, signal.SIGTERM)
    # Under this command's launcher a stop is no failure (torchrun would restart the group): the
    # launcher exits with the status instead.
    return 0 if told.write("stopped", {"status": status, "checkpoint": summary.get("checkpoint")}) else status


# The exit statuses of `pipekit train` (README, "What pipekit answers"): 0 finished; 1 failed
# (a traceback); 2 a user's mistake (one line); PREEMPTED stopped early by a signal after saving
# a checkpoint (resumable: the line says where); 128 + N stopped at once by signal N, unsaved
# (130: Ctrl-C); PEER_STOPPED is a worker's only.
PREEMPTED = 75  # EX_TEMPFAIL: stopped early, resumable
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C before the run could stop at a step (or a second Ctrl-C)
PEER_STOPPED = 3  # a worker's exit status when it failed only because another rank stopped first


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "closed its connection")


def _caused_by_peer(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, PeerClosed) or any(mark in str(e) for mark in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def worker_failed(e: BaseException) -> int:
    """Report a worker's error once and return its exit status: 2 for a user's mistake (one
    line), 1 for anything else (the traceback), PEER_STOPPED (nothing printed) when the rank
    only lost a peer. Under `pipekit train`'s launcher the report goes to a file the launcher
    prints from; under a user's own torchrun, or when the launcher is gone, it is printed here."""
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED
    peer = _caused_by_peer(e)
    user = isinstance(e, USER_ERRORS) and not peer
    if os.environ.get("PIPEKIT_DEBUG") == "1":
        user = False
    text = _first_line(e) if user else "".join(traceback.format_exception(e)).rstrip()
    status = PEER_STOPPED if peer else (2 if user else 1)
    written = told.write("error", {"rank": rank, "peer": peer, "user": user, "text": text, "time": time.time()})
    if not written and not peer:  # else the launcher prints it
        who = f"rank {rank}: " if "RANK" in os.environ else ""
        print(f"pipekit train: {who}{text}" if user else text, file=sys.stderr, flush=True)
    return status


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def die_with_launcher() -> None:
    """A worker under torchrun (this command's launcher or a user's) asks the kernel for a signal
    when its launcher dies (Linux's PR_SET_PDEATHSIG), and turns it into one SIGTERM: a `kill -9`
    of the launcher then stops the workers as a preemption does (they save a checkpoint, say so
    and exit) instead of leaving them training on, owned by no one. Not SIGTERM itself: the
    kernel repeats the signal as each of the launcher's threads exits, and a second SIGTERM
    means "stop now, unsaved". Elsewhere, or outside torchrun, a no-op."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    def once(signum, frame):
        signal.signal(signum, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGUSR2, once)
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGUSR2), 0, 0, 0)
    launcher = os.environ.get("PIPEKIT_LAUNCHER_PID")
    if launcher and os.getppid() != int(launcher):  # gone before the request was made
        sys.exit(f"pipekit train: rank {os.environ.get('RANK')}: the launcher (pid {launcher}) is gone; stopping")


# The signals that stop a run after a checkpoint. The launcher passes each on to its workers
# (SIGQUIT too, torchrun's default, which stops them at once).
STOP_SIGNALS = tuple(sig.name for sig in StopRequests.SIGNALS)


def launch(nproc: int, argv: list[str], grace: int, max_restarts: int = 0, checkpoints: str | None = None) -> int:
    """Start `nproc` workers on this machine through torch.distributed.run, each running
    `pipekit argv`; with `max_restarts`, a failed group is restarted (and resumes from its
    newest checkpoint) up to that many times. Errors are reported once (`report_failures`).
    A stop signal is passed on to the workers, which are given `grace` seconds to finish
    their step and save before they are killed (torchrun's own default is 30 s). The exit
    status is the workers' (PREEMPTED after a stop that saved), or says why there is none:
    workers killed before they had saved, after a stop signal, are said in one line naming
    the newest checkpoint under `checkpoints`."""
    print(f"pipekit: launching {nproc} workers with torch.distributed.run"
          + (f" (up to {max_restarts} restarts)" if max_restarts else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="pipekit-errors-") as reports:
        os.environ["PIPEKIT_ERROR_DIR"] = reports
        os.environ["PIPEKIT_LAUNCHER_PID"] = str(os.getpid())
        os.environ["PIPEKIT_LAUNCH"] = uuid.uuid4().hex  # one identity for every restart (resume.launch_id)
        try:
            with _noting_forwards(reports):
                torchrun(parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                                     f"--signals-to-handle={','.join(STOP_SIGNALS)},SIGQUIT",
                                     f"--shutdown-timeout={grace}", "-m", "pipekit.cli", *argv]))
        except ChildFailedError as e:
            return report_failures(e, reports)
        except SignalException as e:  # a stop signal: the workers save, say where, and stop
            return _after_signal(signal.Signals(int(e.sigval)), reports, grace, checkpoints)
        finally:
            os.environ.pop("PIPEKIT_ERROR_DIR", None)
            os.environ.pop("PIPEKIT_LAUNCHER_PID", None)
            os.environ.pop("PIPEKIT_LAUNCH", None)
        return _stop_status(reports) or 0


@contextlib.contextmanager
def _noting_forwards(reports: str):
    """Each stop signal torchrun passes on to the workers is counted first (`reports.note_forward`),
    so that a worker told to stop already takes the launcher's first one for the same request
    (a signal to the workers, then to the launcher), not for "stop now"."""
    original = elastic_api._terminate_process_handler

    def noting(signum, frame):
        told.note_forward(reports)
        original(signum, frame)

    elastic_api._terminate_process_handler = noting  # looked up when torchrun installs its handlers
    try:
        yield
    finally:
        elastic_api._terminate_process_handler = original


def _stop_status(reports: str) -> int | None:
    """The exit status the workers' stop earned (PREEMPTED when it saved), or None when none stopped."""
    stopped = told.last(reports, "stopped")
    if not stopped:
        return None
    return PREEMPTED if any(r["status"] == PREEMPTED for r in stopped) else stopped[0]["status"]


def _after_signal(sig: signal.Signals, reports: str, grace: int, checkpoints: str | None) -> int:
    """The launcher's status after a stop signal: the workers' own when they stopped (saving),
    else 128 + the signal, with one line on what was lost and where to continue from."""
    status = _stop_status(reports)
    if status is not None:
        return status
    newest = latest_checkpoint(checkpoints) if checkpoints else None
    since = (f"the newest checkpoint is {newest}; continue from it with train.resume=auto" if newest
             else "no checkpoint of this run was saved")
    if told.last(reports, "stopping"):
        print(f"pipekit train: the workers were still in their step or checkpoint {grace} s after {sig.name} "
              f"(checkpoint.stop_grace_s={grace}) and were killed: {since}; raise checkpoint.stop_grace_s above "
              f"a step and a save", file=sys.stderr, flush=True)
    else:
        print(f"pipekit train: stopped by {sig.name} before training began: {since}", file=sys.stderr, flush=True)
    return 128 + int(sig)


def report_failures(e, reports: str) -> int:
    """Print each distinct error of the last attempt once (the earliest first), naming the
    ranks it came from, then one line on the ranks that stopped only because a peer did."""
    reports_now = sorted(told.last(reports, "error"), key=lambda r: r["time"])
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
        # the rank that died: not one that stopped only because a peer did (it may exit first)
        culprits = {r: f for r, f in e.failures.items() if f.exitcode != PEER_STOPPED} or e.failures
        first = min(culprits, key=lambda r: culprits[r].timestamp)
        failure = culprits[first]
        print(f"pipekit train: worker rank {first} {_how_it_ended(failure.exitcode)} and left no error of its own"
              + (f"; rank{'s' if len(failed) > 2 else ''} {', '.join(str(r) for r in failed if r != first)} stopped "
                 "with it" if len(failed) > 1 else "")
              + "; continue from the newest checkpoint with train.resume=auto (--max-restarts N restarts by itself)",
              file=sys.stderr)
    elif silent:
        print(f"pipekit train: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped because "
              f"another rank did", file=sys.stderr)
    users = all(r["user"] for r in reports_now if not r["peer"]) and origins
    return 2 if users else 1


def _how_it_ended(exitcode: int) -> str:
    """A worker's end in words: killed by which signal (SIGKILL: also what the kernel's
    out-of-memory killer sends), or its exit status."""
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    oom = " (sent from outside, or by the kernel's out-of-memory killer)" if -exitcode == signal.SIGKILL else ""
    return f"was killed by {name}{oom}"


# Set once this process has trained in a process group, whose gloo threads outlive it (see exit_worker).
_had_process_group = False


def trained_in_a_group() -> bool:
    """Whether this process trained in a process group (then it ends by `exit_worker`)."""
    return _had_process_group


def exit_worker(status: int) -> NoReturn:
    """End a worker process that trained in a process group without tearing its interpreter down.

    The gloo process groups, and their threads, outlive `destroy_process_group`: the trained
    model and optimizer still refer to them when the worker exits. A gloo thread that lets go
    of the last reference to a tensor of a finished collective needs the GIL; during
    interpreter finalization, taking it ends the thread through C++ code that cannot unwind,
    so the process aborts with `terminate called without an active exception` after a run
    that finished and saved (mixtral_tiny, ZeRO-1 at dp=2, did once in 13; two gloo ranks that
    leave collectives on views to finish at exit do 12 times in 20, and never with this). The
    exit functions run and the output is flushed as at any exit; then the process ends at once."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed terminal, a closed stream
            pass
    os._exit(status)


# What a user's mistake raises (a missing or unreadable file, a bad value): one line and exit
# status 2 instead of a traceback. PIPEKIT_DEBUG=1 shows the traceback.
USER_ERRORS = (OSError, ValueError, EOFError, pickle.UnpicklingError)
