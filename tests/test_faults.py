"""Faults under `pipekit train`'s own launcher (torch.distributed.run), with real processes:
a worker killed by SIGKILL and restarted (`--max-restarts`), a worker that raises, a run
that diverges, a SIGTERM to the launcher (a scheduler's preemption), a launcher killed by
SIGKILL (its workers must not train on, owned by no one), and a rollback to an older
checkpoint with a changed learning rate, then a restart."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipekit.cli import main
from pipekit.config import load_config
from pipekit.run.launch import PEER_STOPPED, PREEMPTED
from pipekit.run.loop import train

ROOT = Path(__file__).resolve().parents[1]
# Warmup longer than any run here: the LR at a step does not depend on train.steps, so runs of
# different lengths (an interrupted one, its resumption) follow one loss curve.
RUN = [str(ROOT / "configs/toy.yaml"), "train.steps=6", "checkpoint.every=2", "logging.progress=false",
       "logging.log_every=1", "data.val_every=0", "logging.peak_tflops=1", "logging.tensorboard=false",
       "optimizer.warmup_steps=1000"]
UNDISTURBED_STEPS = 40


def launch(out: Path, *extra: str, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PIPEKIT_TEST_FAULT", None)
    if fault:
        env["PIPEKIT_TEST_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "pipekit.cli", "train", *RUN, f"logging.out_dir={out}", *extra],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def steps(out: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "step" in r}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict[int, float]:
    """The same run in one process (pp=1: the same model and batches; layouts agree to ~1e-7)."""
    out = tmp_path_factory.mktemp("undisturbed")
    train(load_config(RUN[0], [*RUN[1:], "parallel.pp=1", f"train.steps={UNDISTURBED_STEPS}",
                               f"logging.out_dir={out}"]))
    return steps(out)


def test_a_killed_worker_is_restarted_and_the_run_finishes_as_if_undisturbed(tmp_path, undisturbed):
    out = tmp_path / "run"
    done = launch(out, "--max-restarts", "1", fault="kill:1:3")  # rank 1 dies by SIGKILL after step 3
    assert done.returncode == 0, done.stderr[-3000:]
    # torchrun saw a worker fail: the killed one (-9), or first its peer, which stops with PEER_STOPPED (3)
    # as soon as it notices (a race between the two exits) ...
    assert "exitcode: -9" in done.stderr or f"exitcode: {PEER_STOPPED}" in done.stderr, done.stderr[-3000:]
    assert f"resuming from {out}/checkpoints/step_00000002 (step 2)" in done.stdout  # ... and the restart resumed
    twice = [line for line in done.stdout.splitlines() if line.startswith("step     3")]
    assert len(twice) == 2 and twice[0].split()[3] == twice[1].split()[3]  # step 3 again, the same loss
    got = steps(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl: each step once
    for step, loss in got.items():
        assert loss == pytest.approx(undisturbed[step], abs=1e-5), step
    assert (out / "model.pt").exists()
    # The summary is the run's, across the restart: 6 steps from step 1's loss, 4 of them in this attempt.
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert (summary["steps"], summary["steps_this_attempt"], summary["attempts"]) == (6, 4, 2)
    assert summary["first_loss"] == got[1]
    assert "6 (" in done.stdout and ", in 2 attempts (4 in this one)" in done.stdout


def test_an_error_in_one_worker_is_reported_once_from_its_rank(tmp_path):
    done = launch(tmp_path / "run", fault="raise:1:2")
    assert done.returncode == 1
    assert done.stderr.count("injected fault on rank 1 after step 2") == 1, done.stderr[-3000:]
    assert "pipekit train: rank 1 failed:\nTraceback" in done.stderr
    assert "pipekit train: rank 0 stopped because another rank did" in done.stderr
    assert "Connection closed" not in done.stderr and "Connection reset" not in done.stderr


def test_a_diverged_run_says_so_once_and_names_the_last_checkpoint(tmp_path):
    done = launch(tmp_path / "run", "optimizer.lr=1e6", "optimizer.warmup_steps=1", "optimizer.clip_grad_norm=null")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "the loss is" in line]
    assert len(lines) == 1 and lines[0].startswith("pipekit train: ranks 0, 1: step ")
    assert "Traceback" not in done.stderr
    assert "lower optimizer.lr" in lines[0]


def test_sigterm_to_the_launcher_saves_a_checkpoint_that_resumes_anywhere(tmp_path, undisturbed):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PIPEKIT_TEST_FAULT", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipekit.cli", "train", *RUN, "train.steps=400",
                             "checkpoint.every=0", f"logging.out_dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(steps(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == PREEMPTED, stderr[-3000:]  # stopped early, resumable
    said = [line for line in stdout.splitlines() if line.startswith("pipekit: stopped after step")]
    assert len(said) == 1 and "on SIGTERM: checkpoint saved to" in said[0] and "train.resume=auto" in said[0], stdout
    stopped_at = int(said[0].split()[4])
    assert (out / "checkpoints" / f"step_{stopped_at:08d}").is_dir()
    assert not (out / "model.pt").exists()
    for step, loss in steps(out).items():
        assert loss == pytest.approx(undisturbed[step], abs=1e-5), step
    # Layout-free: the two-stage checkpoint resumes in one process, on the same curve.
    assert stopped_at < UNDISTURBED_STEPS - 2, "the run was not stopped soon enough to compare"
    resumed = tmp_path / "resumed"
    train(load_config(RUN[0], [*RUN[1:], "parallel.pp=1", f"logging.out_dir={resumed}", "checkpoint.every=0",
                               f"train.steps={stopped_at + 2}",
                               f"train.resume={out}/checkpoints/step_{stopped_at:08d}"]))
    got = steps(resumed)
    assert sorted(got) == [stopped_at + 1, stopped_at + 2]
    for step, loss in got.items():
        assert loss == pytest.approx(undisturbed[step], abs=1e-5), step


def test_a_users_own_torchrun_refuses_an_out_dir_holding_a_run_once(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = (out / "metrics.jsonl").read_bytes()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "pipekit.cli", "train", *RUN, f"logging.out_dir={out}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert done.stderr.count(f"logging.out_dir={out} holds another run (metrics.jsonl)") == 1, done.stderr[-3000:]
    assert (out / "metrics.jsonl").read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _lock_is_free(path: Path) -> bool:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc: Linux")
def test_a_killed_launcher_takes_its_workers_with_it_and_no_run_writes_into_a_live_one(tmp_path, undisturbed, capsys):
    out, ckpts = tmp_path / "run", tmp_path / "ckpts"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PIPEKIT_TEST_FAULT", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipekit.cli", "train", *RUN, "train.steps=400",
                             f"logging.out_dir={out}", f"checkpoint.dir={ckpts}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(steps(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        # While it trains, neither its out_dir nor (from another out_dir) its checkpoint.dir takes another run.
        for extra, taken in (([f"logging.out_dir={out}", "train.resume=auto"], f"logging.out_dir={out}"),
                             ([f"logging.out_dir={tmp_path / 'other'}"], f"checkpoint.dir={ckpts}")):
            assert main(["train", *RUN, f"checkpoint.dir={ckpts}", *extra]) == 2
            assert f"another pipekit run is writing to {taken}" in capsys.readouterr().err
        assert not (tmp_path / "other").exists()  # a refused run writes nothing
        workers = _children(proc.pid)
        assert len(workers) == 2 and all(_alive(w) for w in workers)
        proc.kill()  # the launcher only: SIGKILL, no handler runs
        held_after_kill = not _lock_is_free(out / ".pipekit.lock")
        while any(_alive(w) for w in workers):  # they stop (saving first), holding the run's locks until they exit
            assert time.monotonic() < deadline, "the workers outlived their launcher"
            time.sleep(0.1)
        assert held_after_kill and _lock_is_free(out / ".pipekit.lock") and _lock_is_free(ckpts / ".pipekit.lock")
        stdout, stderr = proc.communicate(timeout=30)  # the workers' output, to the pipes they shared with it
    finally:
        proc.kill()
    said = [line for line in stdout.splitlines() if line.startswith("pipekit: stopped after step")]
    assert len(said) == 1 and "on SIGTERM: checkpoint saved to" in said[0], stdout[-3000:] + stderr[-3000:]
    stopped_at = int(said[0].split()[4])
    assert stopped_at < UNDISTURBED_STEPS - 2, "the run was not stopped soon enough to compare"
    # The advice it printed (here in one process: checkpoints are layout-free) continues the run on the
    # uninterrupted curve, each step once in metrics.jsonl.
    assert main(["train", *RUN, "parallel.pp=1", f"logging.out_dir={out}", f"checkpoint.dir={ckpts}",
                 "train.resume=auto", f"train.steps={stopped_at + 2}"]) == 0
    assert f"resuming from {ckpts}/step_{stopped_at:08d} (step {stopped_at})" in capsys.readouterr().out
    got = steps(out)
    assert sorted(got) == list(range(1, stopped_at + 3))
    for step, loss in got.items():
        assert loss == pytest.approx(undisturbed[step], abs=1e-5), step


def test_a_rollback_starts_a_branch_with_the_new_lr_and_a_restart_continues_that_branch(tmp_path, undisturbed):
    out = tmp_path / "run"
    train(load_config(RUN[0], [*RUN[1:], "parallel.pp=1", "train.steps=8", "checkpoint.keep=3",
                               f"logging.out_dir={out}"]))  # in one process: checkpoints are layout-free
    root = out / "checkpoints"
    old = {name: (root / "step_00000008" / name).read_bytes() for name in ("pipekit.json", ".metadata")}
    shutil.copytree(root / "step_00000004", tmp_path / "step4")
    # Back to step 4 at half the peak lr, keeping one checkpoint (so step 4 is pruned at step 6); rank 1
    # is killed after step 7 and the restart must take this branch's step 6, not step 4 nor the old 6 or 8.
    done = launch(out, f"train.resume={root}/step_00000004", "train.steps=8", "optimizer.lr=1.5e-3",
                  "checkpoint.keep=1", "--max-restarts", "1", fault="kill:1:7")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("pipekit: changed since the checkpoint: checkpoint.keep 3 -> 1, optimizer.lr 0.003 -> 0.0015, "
            "parallel.pp 1 -> 2\n") in done.stdout
    assert "starts a new branch; the later checkpoints (step 6, 8) were moved to" in done.stdout
    assert f"resuming from {root}/step_00000006 (step 6)" in done.stdout
    aside = list((root / "abandoned").glob("*/step_00000008"))
    assert len(aside) == 1 and {n: (aside[0] / n).read_bytes() for n in old} == old
    assert sorted(p.name for p in root.iterdir()) == ["abandoned", "step_00000008"]
    # The reference: the same rollback in one process (layout-free), uninterrupted.
    ref = tmp_path / "ref"
    train(load_config(RUN[0], [*RUN[1:], "parallel.pp=1", "train.steps=8", "optimizer.lr=1.5e-3",
                               f"logging.out_dir={ref}", f"train.resume={tmp_path / 'step4'}"]))
    recs = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r}
    assert sorted(recs) == list(range(1, 9))  # each step once
    expected = {**{s: undisturbed[s] for s in range(1, 5)}, **steps(ref)}
    for step, rec in recs.items():
        assert rec["loss"] == pytest.approx(expected[step], abs=1e-5), step
    # The new peak took effect: in the warmup (1000 steps) step s runs at lr * s / 1000.
    assert recs[4]["lr"] == pytest.approx(3e-3 * 4 / 1000) and recs[5]["lr"] == pytest.approx(1.5e-3 * 5 / 1000)


def signal_when(out: Path, ready, sig: signal.Signals, *extra: str) -> tuple[int, str, str]:
    """Launch the run, send the launcher `sig` once `ready(its stdout so far)` holds, and
    return (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PIPEKIT_TEST_FAULT", None)
    said, errors = out.parent / f"{out.name}.{sig.name}.out", out.parent / f"{out.name}.{sig.name}.err"
    with open(said, "w") as stdout, open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pipekit.cli", "train", *RUN, f"logging.out_dir={out}", *extra],
                                stdout=stdout, stderr=stderr, text=True, env=env, cwd=ROOT)
        try:
            deadline = time.monotonic() + 120
            while not ready(said.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, errors.read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(sig)
            proc.wait(timeout=90)
        finally:
            proc.kill()
    return proc.returncode, said.read_text(), errors.read_text()


def test_sighup_in_a_long_validation_then_sigusr1_each_save_and_the_run_stays_on_its_curve(tmp_path, undisturbed):
    out = tmp_path / "run"
    run = ["train.steps=400", "checkpoint.every=0", "data.val_every=3", "data.val_batches=100000"]
    # The terminal closes (SIGHUP) while step 3's validation runs (hours of it, reported as it goes).
    status, said, _ = signal_when(out, lambda text: "validating: " in text, signal.SIGHUP, *run)
    assert status == PREEMPTED, said[-3000:]
    assert "validating: 1/100000 batches, about" in said and "pipekit: SIGHUP received: stopping" in said
    assert f"pipekit: saved the checkpoint of step 3 to {out}/checkpoints/step_00000003 in " in said
    stops = [line for line in said.splitlines() if line.startswith("pipekit: stopped after step")]
    assert stops == [f"pipekit: stopped after step 3 on SIGHUP: checkpoint saved to {out}/checkpoints/step_00000003; "
                     f"continue with train.resume=auto"]
    # Continued as advised; Slurm's warning before the end of the job's time (SIGUSR1) stops it again.
    status, said, _ = signal_when(out, lambda text: "step     5" in text, signal.SIGUSR1, *run, "train.resume=auto")
    assert status == PREEMPTED, said[-3000:]
    stops = [line for line in said.splitlines() if line.startswith("pipekit: stopped after step")]
    assert len(stops) == 1 and " on SIGUSR1: checkpoint saved to " in stops[0], said[-3000:]
    stopped_at = int(stops[0].split()[4])
    assert stopped_at in (5, 6) and (out / "checkpoints" / f"step_{stopped_at:08d}").is_dir()
    got = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
           if "step" in json.loads(line)]
    assert got == list(range(1, stopped_at + 1))  # each step once, across the three processes' lifetimes
    for step, loss in steps(out).items():
        assert loss == pytest.approx(undisturbed[step], abs=1e-5), step


def test_the_launcher_passes_every_stop_signal_on_and_waits_the_configured_grace(tmp_path, monkeypatch):
    import pipekit.cli
    import pipekit.run.launch

    seen = []
    monkeypatch.setattr(pipekit.run.launch, "torchrun", seen.append)  # no workers: what torchrun would be told
    assert pipekit.cli.main(["train", *RUN, f"logging.out_dir={tmp_path}", "checkpoint.stop_grace_s=45"]) == 0
    assert seen[0].signals_to_handle.split(",") == ["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGQUIT"]
    assert seen[0].shutdown_timeout == 45  # torchrun's own 30 s would kill a step and a save that take longer
