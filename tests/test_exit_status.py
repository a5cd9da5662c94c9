"""Exit statuses that tell a finished run from a stopped one, and the faults around a stop:
a SIGTERM to one worker (75, resumable, and where to resume), a signal to the workers and
then to the launcher (the launcher's forward is no "stop now"), a real terminal hang-up
(SIGHUP through a pty), a stop grace shorter than a step, a report file cut short, and
Ctrl-C while the command starts (one line, 130). Runs are the fault tests' tiny toy."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from test_faults import ROOT, RUN, _children, launch, steps

from pipekit.checkpoint import list_checkpoints
from pipekit.cli import main
from pipekit.run import loop, reports
from pipekit.run.launch import INTERRUPTED, PREEMPTED

RESUME_LINE = "continue with train.resume=auto"


def _popen(out: Path, *extra: str, fault: str | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PIPEKIT_TEST_FAULT", None)
    if fault:
        env["PIPEKIT_TEST_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "pipekit.cli", "train", *RUN, f"logging.out_dir={out}", *extra],
                            env=env, cwd=ROOT, **kw)


def _wait_for(check, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or hung before it was ready"
        time.sleep(0.1)


def test_sigterm_to_one_worker_exits_preempted_and_says_where_to_resume(tmp_path):
    out = tmp_path / "run"
    done = launch(out, "train.steps=400", "checkpoint.every=0", fault="term:1:3")  # a scheduler stops rank 1
    assert done.returncode == PREEMPTED, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("pipekit: stopped after step")]
    assert said == [f"pipekit: stopped after step 3 on a signal to another rank: checkpoint saved to "
                    f"{out}/checkpoints/step_00000003; {RESUME_LINE}"], done.stdout[-3000:]
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))] == [3] and not (out / "model.pt").exists()


def test_a_stopped_run_in_one_process_exits_preempted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPEKIT_TEST_FAULT", "term:0:2")
    out = tmp_path / "run"
    assert main(["train", *RUN, "parallel.pp=1", f"logging.out_dir={out}"]) == PREEMPTED
    assert f"checkpoint saved to {out}/checkpoints/step_00000002; {RESUME_LINE}" in capsys.readouterr().out


def test_sigterm_to_the_workers_then_the_launcher_saves_once_and_exits_preempted(tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.out"
    with open(log, "w") as said:
        proc = _popen(out, "train.steps=400", "checkpoint.every=0", fault="slow:0:3", stdout=said,
                      stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for(lambda: "step     3" in log.read_text(), proc)
            for worker in _children(proc.pid):
                os.kill(worker, signal.SIGTERM)
            time.sleep(2.5)  # past the echo window, while rank 0's step 3 still runs
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)
        finally:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == PREEMPTED, text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("pipekit: stopped after step")] == [
        f"pipekit: stopped after step 3 on SIGTERM: checkpoint saved to {out}/checkpoints/step_00000003; "
        f"{RESUME_LINE}"], text[-3000:]


@pytest.mark.parametrize("first, second, forwards, stops_now", [
    (signal.SIGTERM, signal.SIGTERM, (0, 0), True),    # the user repeats the signal: stop now
    (signal.SIGTERM, signal.SIGTERM, (0, 1), False),   # the launcher passing the same stop on
    (signal.SIGTERM, signal.SIGTERM, (1, 2), True),    # the user repeats it to the launcher
    (signal.SIGHUP, signal.SIGHUP, (0, 0), False),     # a terminal closes once
    (signal.SIGTERM, signal.SIGINT, (0, 0), True),     # Ctrl-C after a preemption: stop now
])
def test_a_second_signal_stops_at_once_only_when_a_user_repeats_it(monkeypatch, first, second, forwards, stops_now):
    told = iter(forwards)
    monkeypatch.setattr(reports, "forwards", lambda: next(told))
    monkeypatch.setattr(loop, "detach_from_closed_terminal", lambda: None)
    stop = loop.StopRequests()
    stop._handle(first, None)
    stop._since -= 2.5  # the second one comes 2.5 s later, past the echo window
    if stops_now:
        with pytest.raises(KeyboardInterrupt):
            stop._handle(second, None)
    else:
        stop._handle(second, None)
    assert stop.signal_name == first.name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pty as the controlling terminal: Linux")
def test_a_terminal_hangup_saves_a_checkpoint_and_exits_preempted(tmp_path):
    out = tmp_path / "run"
    master, slave = pty.openpty()

    def own_terminal():  # the run's session has the pty as its controlling terminal, as a shell's job has
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = _popen(out, "train.steps=400", "checkpoint.every=0", stdin=slave, stdout=slave, stderr=slave,
                  preexec_fn=own_terminal)
    os.close(slave)
    try:
        drained = bytearray()

        def two_steps() -> bool:
            try:
                drained.extend(os.read(master, 65536))  # keep the pty's buffer from filling
            except OSError:
                pass
            return (out / "metrics.jsonl").exists() and len(steps(out)) >= 2

        os.set_blocking(master, False)
        _wait_for(two_steps, proc)
        os.close(master)  # the terminal closes: SIGHUP to the session, EIO on every write to it
        proc.wait(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == PREEMPTED, drained.decode(errors="replace")[-3000:]
    saved = list_checkpoints(str(out / "checkpoints"))
    assert len(saved) == 1 and saved[0][0] == max(steps(out)), (saved, steps(out))


def test_a_stop_grace_shorter_than_a_step_says_so_and_the_previous_checkpoint_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    with open(tmp_path / "run.out", "w") as said, open(tmp_path / "run.err", "w") as errors:
        proc = _popen(out, "train.steps=400", "checkpoint.stop_grace_s=1", fault="slow:0:3", stdout=said,
                      stderr=errors, text=True)
        try:
            _wait_for(lambda: "step     3" in (tmp_path / "run.out").read_text(), proc)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)
        finally:
            proc.kill()
    err = (tmp_path / "run.err").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("pipekit train:")]
    assert lines == [f"pipekit train: the workers were still in their step or checkpoint 1 s after SIGTERM "
                     f"(checkpoint.stop_grace_s=1) and were killed: the newest checkpoint is "
                     f"{out}/checkpoints/step_00000002; continue from it with train.resume=auto; raise "
                     f"checkpoint.stop_grace_s above a step and a save"], err[-3000:]
    assert main(["train", *RUN, "parallel.pp=1", f"logging.out_dir={out}", "train.resume=auto"]) == 0
    assert f"resuming from {out}/checkpoints/step_00000002 (step 2)" in capsys.readouterr().out


def test_reports_and_checkpoints_cut_short_by_a_kill_are_not_read(tmp_path):
    (tmp_path / "attempt0-rank0.json").write_text(json.dumps({"rank": 0, "text": "boom"}))
    (tmp_path / ".attempt0-rank1.json.k2j3.tmp").write_text(json.dumps({"rank": 1, "text": "half"}))
    (tmp_path / "stopped-attempt0-rank1.json").write_text(json.dumps({"status": PREEMPTED}))
    assert reports.last(str(tmp_path), "error") == [{"rank": 0, "text": "boom"}]
    assert reports.last(str(tmp_path), "stopped") == [{"status": PREEMPTED}]
    for name in ("step_00000004.tmp", ".step_00000004.x1.tmp", "step_00000004.attempt0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_text("")
        (tmp_path / name / "pipekit.json").write_text("{}")
    assert list_checkpoints(str(tmp_path)) == []


# A Ctrl-C while the command imports torch used to land inside a C extension's start-up: numpy
# then refused to load twice (a traceback), pybind11 aborted the process, or the signal was
# swallowed and the run trained to the end with status 0. It is held until the import is done
# (pipekit.HELD_INTERRUPTS). The delays sample the start-up: importing torch (~0.3-0.8 s here),
# the config, torchrun's start-up and the workers' imports.
@pytest.mark.parametrize("delay", [0.3, 0.5, 0.6, 0.8, 1.2, 2.5])
def test_ctrl_c_while_the_command_starts_is_one_line_and_130(tmp_path, delay):
    proc = subprocess.Popen([sys.executable, "-m", "pipekit.cli", "train", *RUN, f"logging.out_dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == INTERRUPTED, err
    said = [line for line in err.splitlines() if not line.startswith(("W", "pipekit: notice:"))]  # torchrun's banner
    before = "pipekit train: stopped by SIGINT before training began: no checkpoint of this run was saved"
    assert said in (["pipekit: interrupted"], ["pipekit train: interrupted"], [before]), err


def test_ctrl_c_while_a_library_user_imports_pipekit_arrives_after_the_import():
    """`import pipekit` holds a Ctrl-C until its imports are done, then gives Python's own
    handler back and delivers it there: a KeyboardInterrupt at the import statement's end,
    with pipekit whole (not a half-imported torch)."""
    code = ("import os, signal, sys, threading\n"
            "threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "try:\n"
            "    import pipekit\n"
            "    import time; time.sleep(5)\n"
            "    print('never interrupted')\n"
            "except KeyboardInterrupt:\n"
            "    whole = 'pipekit' in sys.modules and hasattr(sys.modules['pipekit'], 'PipelineEngine')\n"
            "    print('interrupted', whole, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout == "interrupted True True\n", out.stdout + out.stderr
