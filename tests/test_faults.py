"""Faults under `pipekit train`'s own launcher (torch.distributed.run), with real processes:
a worker killed by SIGKILL and restarted (`--max-restarts`), a worker that raises, a run
that diverges, and a SIGTERM to the launcher (a scheduler's preemption)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipekit.config import load_config
from pipekit.train import train

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
    assert "exitcode: -9" in done.stderr  # torchrun saw the kill ...
    assert f"resuming from {out}/checkpoints/step_00000002 (step 2)" in done.stdout  # ... and the restart resumed
    twice = [line for line in done.stdout.splitlines() if line.startswith("step     3")]
    assert len(twice) == 2 and twice[0].split()[3] == twice[1].split()[3]  # step 3 again, the same loss
    got = steps(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl: each step once
    for step, loss in got.items():
        assert loss == pytest.approx(undisturbed[step], abs=1e-5), step
    assert (out / "model.pt").exists()


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
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
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
