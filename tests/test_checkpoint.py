"""Resumable, layout-free checkpoints: exact resume, reshard on load, atomic saves.

One spawned group of 4 gloo ranks runs every multi-rank check: a run saved
every 2 steps at pp=2 x dp=2 (ZeRO-1), resumed at the same layout (bitwise the
same losses) and at pp=1 x tp=2 x dp=2 (ZeRO-2, GPipe) and pp=2 x tp=2 (interleaved, 2 chunks per rank);
the parent resumes the same checkpoint in one process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from pipekit.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_full_weights, read_meta
from pipekit.config import load_run
from pipekit.testing import run_distributed
from pipekit.train import train

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# A GPT-2 with tied embeddings, tp-divisible heads and a padded vocabulary; the global batch
# (8 sequences) is the same at every layout below.
MODEL = ["model.family=gpt2", "model.n_layers=2", "model.dim=32", "model.n_heads=4", "model.vocab_size=96",
         "train.seq_len=16", "data.source=synthetic", "data.val_every=0", "logging.progress=false",
         "logging.tensorboard=false", "logging.log_every=1", "logging.peak_tflops=1", f"train.steps={STEPS}",
         "optimizer.warmup_steps=2", "optimizer.lr=3e-3", "checkpoint.every=2", "checkpoint.keep=3"]
LAYOUTS = {
    "pp2_dp2_zero1": ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=1", "train.micro_batch=2",
                      "schedule.microbatches=2"],
    "tp2_dp2_zero2_gpipe": ["parallel.pp=1", "parallel.tp=2", "parallel.dp=2", "optimizer.zero_stage=2",
                            "schedule.name=gpipe", "train.micro_batch=1", "schedule.microbatches=4"],
    "pp2_tp2_interleaved": ["parallel.pp=2", "parallel.tp=2", "schedule.name=interleaved_1f1b",
                            "schedule.chunks_per_rank=2", "train.micro_batch=2", "schedule.microbatches=4"],
    "one_process": ["parallel.pp=1", "train.micro_batch=4", "schedule.microbatches=2"],
}


def losses(out: str) -> dict[int, float]:
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "step" in r}


def _run(layout: str, out: str, *extra: str) -> dict[int, float]:
    run = load_run(None, [*MODEL, *LAYOUTS[layout], f"logging.out_dir={out}", *extra])
    train(run)
    return losses(out)


def _group_checks(tmp: str) -> dict:
    """On 4 ranks: the uninterrupted run, then resumes from its step-2 and step-4 checkpoints."""
    results = {}
    full = os.path.join(tmp, "full")
    results["full"] = _run("pp2_dp2_zero1", full)
    ckpts = os.path.join(full, "checkpoints")
    results["kept"] = sorted(os.listdir(ckpts)) if torch.distributed.get_rank() == 0 else None
    results["same"] = _run("pp2_dp2_zero1", os.path.join(tmp, "same"), f"train.resume={ckpts}/step_00000004",
                           f"checkpoint.dir={tmp}/same_ckpt")
    results["tp"] = _run("tp2_dp2_zero2_gpipe", os.path.join(tmp, "tp"), f"train.resume={ckpts}/step_00000002",
                         f"checkpoint.dir={tmp}/tp_ckpt")
    results["interleaved"] = _run("pp2_tp2_interleaved", os.path.join(tmp, "il"),
                                  f"train.resume={tmp}/tp_ckpt/step_00000004", f"checkpoint.dir={tmp}/il_ckpt")
    return results


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    return tmp, run_distributed(_group_checks, 4, tmp, timeout=400)[0]


def test_saves_every_n_steps_and_keeps_the_newest(group):
    tmp, r = group
    assert r["kept"] == ["step_00000002", "step_00000004", "step_00000006"]
    assert [s for s, _ in list_checkpoints(os.path.join(tmp, "full", "checkpoints"))] == [2, 4, 6]
    meta = read_meta(os.path.join(tmp, "full", "checkpoints", "step_00000004"))
    assert meta["step"] == 4 and meta["layout"]["pp"] == 2 and meta["family"] == "gpt2"


def test_resume_at_the_same_layout_is_bitwise(group):
    _, r = group
    assert list(r["same"]) == [5, 6]
    assert all(r["same"][s] == r["full"][s] for s in (5, 6)), (r["same"], r["full"])


def test_resume_at_other_layouts_follows_the_same_curve(group):
    _, r = group
    assert list(r["tp"]) == [3, 4, 5, 6] and list(r["interleaved"]) == [5, 6]
    for name in ("tp", "interleaved"):
        for step, loss in r[name].items():
            assert loss == pytest.approx(r["full"][step], abs=1e-6), (name, step)


def test_resume_in_one_process(group, tmp_path):
    tmp, r = group
    got = _run("one_process", str(tmp_path / "one"), f"train.resume={tmp}/full/checkpoints/step_00000002")
    assert list(got) == [3, 4, 5, 6]
    for step, loss in got.items():
        assert loss == pytest.approx(r["full"][step], abs=1e-6)


def test_weights_read_back_in_one_process_equal_the_saved_model(group):
    tmp, _ = group
    meta, weights = load_full_weights(os.path.join(tmp, "full", "checkpoints", "step_00000006"))
    final = torch.load(os.path.join(tmp, "full", "model.pt"), weights_only=True)["state_dict"]
    assert set(weights) == set(final)
    for name, t in final.items():
        assert torch.equal(weights[name], t), name


# ---- one process -------------------------------------------------------------
ONE = [*MODEL, *LAYOUTS["one_process"]]


def _signal_after(monkeypatch, step: int, sig=signal.SIGTERM) -> None:
    """Send this process `sig` (a real signal) right after training step `step`."""
    from pipekit.metrics import Logger

    real = Logger.step

    def step_then_signal(self, n, *args):
        real(self, n, *args)
        if n == step:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(Logger, "step", step_then_signal)


def test_sigterm_saves_and_resume_auto_continues_bitwise(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    full = _run("one_process", str(tmp_path / "ref"))
    _signal_after(monkeypatch, 3)
    summary = train(load_run(None, [*ONE, f"logging.out_dir={out}", "checkpoint.every=0"]))
    monkeypatch.undo()
    assert summary["stopped_by"] == "SIGTERM"
    said = capsys.readouterr().out
    assert "pipekit: stopped after step 3 on SIGTERM: checkpoint saved to " in said and "train.resume=auto" in said
    assert [s for s, _ in list_checkpoints(os.path.join(out, "checkpoints"))] == [3]
    assert not os.path.exists(os.path.join(out, "model.pt"))  # the run did not finish
    got = _run("one_process", out, "train.resume=auto")
    assert got == full  # metrics.jsonl holds steps 1-3 of the first run and 4-6 of this one: bitwise


def test_an_in_process_run_leaves_the_callers_default_dtype_alone(tmp_path):
    import torch

    assert torch.get_default_dtype() == torch.float32
    train(load_run(None, [*ONE, "train.dtype=float64", "train.steps=1", f"logging.out_dir={tmp_path}"]))
    assert torch.get_default_dtype() == torch.float32  # a later HF model in this process is built in float32


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    out = str(tmp_path / "run")
    train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=2"]))
    root = os.path.join(out, "checkpoints")
    before = {p: open(os.path.join(root, "step_00000002", p), "rb").read()
              for p in os.listdir(os.path.join(root, "step_00000002"))}
    real = dcp.FileSystemWriter.write_data

    def crash_midway(self, plan, planner):  # write part of the shard files, then die
        real(self, plan, planner).wait()
        for name in os.listdir(self.path):
            if name.endswith(".distcp"):
                with open(os.path.join(self.path, name), "r+b") as f:
                    f.truncate(max(1, os.path.getsize(f.name) // 2))
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", crash_midway)
    with pytest.raises(CheckpointError, match=r"could not save checkpoint .*step_00000004: OSError: No space left on "
                                              r"device \(simulated\) \(the previous checkpoints are intact\)"):
        train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=4", "train.resume=auto"]))
    monkeypatch.undo()
    assert latest_checkpoint(root) == os.path.join(root, "step_00000002")
    assert {p: open(os.path.join(root, "step_00000002", p), "rb").read() for p in before} == before
    got = _run("one_process", out, "train.resume=auto", "train.steps=4")  # the half-written one is ignored
    assert list(got) == [1, 2, 3, 4]


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    out = str(tmp_path / "run")
    train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=2"]))
    ckpt = os.path.join(out, "checkpoints", "step_00000002")
    with pytest.raises(CheckpointError, match=r"another model \(gpt2: dim=32 \(this config: 64\)"):
        train(load_run(None, [*ONE, "model.dim=64", f"logging.out_dir={tmp_path / 'b'}", f"train.resume={ckpt}"]))


def test_a_damaged_checkpoint_is_named(tmp_path):
    out = str(tmp_path / "run")
    train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=2"]))
    ckpt = os.path.join(out, "checkpoints", "step_00000002")
    shard = next(p for p in os.listdir(ckpt) if p.endswith(".distcp"))
    with open(os.path.join(ckpt, shard), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="could not read checkpoint"):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'b'}", f"train.resume={ckpt}"]))
    os.remove(os.path.join(ckpt, "pipekit.json"))
    with pytest.raises(CheckpointError, match="not a complete pipekit checkpoint"):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'c'}", f"train.resume={ckpt}"]))
    shutil.rmtree(ckpt)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'd'}", f"train.resume={ckpt}"]))
