"""Resumable, layout-free checkpoints: exact resume, reshard on load, atomic saves.

One spawned group of 4 gloo ranks runs every multi-rank check: a run saved
every 2 steps at pp=2 x dp=2 (ZeRO-1), resumed at the same layout (bitwise the
same losses) and at pp=1 x tp=2 x dp=2 (ZeRO-2, GPipe) and pp=2 x tp=2 (interleaved, 2 chunks per rank);
the parent resumes the same checkpoint in one process. A LoRA run (adapters on every linear of
the blocks) saved at pp=2 x dp=2 resumes at tp=2 x dp=2 and in one process on the same curve.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from pipekit.checkpoint import CheckpointError, list_checkpoints, load_full_weights, read_meta
from pipekit.config import load_run
from pipekit.run.loop import train
from pipekit.testing import run_distributed

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


LORA = ["model.lora.rank=4", "model.lora.alpha=8", r"model.lora.targets=attn\.(q|k|v|o)$|mlp\.", "optimizer.lr=3e-2"]


def losses(out: str) -> dict[int, float]:
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "step" in r}


def _run(layout: str, out: str, *extra: str) -> dict[int, float]:
    run = load_run(None, [*MODEL, *LAYOUTS[layout], f"logging.out_dir={out}", *extra])
    threads = torch.get_num_threads()
    if layout == "one_process":  # in this process: one thread, as each spawned rank has, so the same kernels
        torch.set_num_threads(1)
    try:
        train(run)
    finally:
        torch.set_num_threads(threads)
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
    # LoRA: adapters and their optimizer state saved at pp=2 x dp=2, resumed at tp=2 x dp=2
    lora = os.path.join(tmp, "lora")
    results["lora"] = _run("pp2_dp2_zero1", lora, *LORA)
    results["lora_tp"] = _run("tp2_dp2_zero2_gpipe", os.path.join(tmp, "lora_tp"), *LORA,
                              f"train.resume={lora}/checkpoints/step_00000002", f"checkpoint.dir={tmp}/lora_tp_ckpt")
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


def test_lora_resumes_at_another_layout_and_in_one_process_on_the_same_curve(group, tmp_path):
    """The adapters and their AdamW moments are in the checkpoint, layout-free: resumed at
    tp=2 x dp=2 (ZeRO-2) and in one process, the losses are the uninterrupted run's; the
    frozen weights are bitwise those the run started from."""
    tmp, r = group
    assert list(r["lora_tp"]) == [3, 4, 5, 6]
    one = _run("one_process", str(tmp_path / "one"), *LORA, f"train.resume={tmp}/lora/checkpoints/step_00000004")
    assert list(one) == [5, 6]
    for name, got in (("tp", r["lora_tp"]), ("one process", one)):
        for step, loss in got.items():
            assert loss == pytest.approx(r["lora"][step], abs=1e-6), (name, step)
    assert abs(r["lora"][6] - r["lora"][1]) > 1e-3  # the adapters trained
    _, start = load_full_weights(os.path.join(tmp, "lora", "checkpoints", "step_00000002"))
    _, end = load_full_weights(os.path.join(tmp, "lora_tp_ckpt", "step_00000006"))
    adapters = [k for k in end if ".lora." in k]
    assert len(adapters) == 2 * 6 * 2  # 2 blocks x (q, k, v, o, fc, proj) x (A, B)
    assert all(torch.equal(end[k], start[k]) for k in end if ".lora." not in k)  # frozen: bitwise
    assert max((end[k] - start[k]).abs().max().item() for k in adapters) > 1e-3


# ---- one process -------------------------------------------------------------
ONE = [*MODEL, *LAYOUTS["one_process"]]


def _signal_after(monkeypatch, step: int, sig=signal.SIGTERM) -> None:
    """Send this process `sig` (a real signal) right after training step `step`."""
    from pipekit.run.metrics import Logger

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


def test_a_full_disk_is_said_and_the_partial_save_removed(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    out = str(tmp_path / "run")
    train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=2"]))
    root = os.path.join(out, "checkpoints")
    before = {p: open(os.path.join(root, "step_00000002", p), "rb").read()
              for p in os.listdir(os.path.join(root, "step_00000002"))}
    real = dcp.FileSystemWriter.write_data

    def fill_the_disk(self, plan, planner):  # write part of the shard files, then run out of space
        real(self, plan, planner).wait()
        for name in os.listdir(self.path):
            if name.endswith(".distcp"):
                with open(os.path.join(self.path, name), "r+b") as f:
                    f.truncate(max(1, os.path.getsize(f.name) // 2))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fill_the_disk)
    with pytest.raises(CheckpointError, match=r"could not save checkpoint .*step_00000004: no space left on device "
                                              r"\(.* free there\); removed the partial step_00000004.tmp, and the "
                                              r"previous checkpoint .*step_00000002 is intact$"):
        train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=4", "train.resume=auto"]))
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["step_00000002"]  # no step_00000004.tmp left to fill the disk
    assert {p: open(os.path.join(root, "step_00000002", p), "rb").read() for p in before} == before
    got = _run("one_process", out, "train.resume=auto", "train.steps=4")
    assert list(got) == [1, 2, 3, 4]


class _FillingDisk(io.RawIOBase):
    """A file on a disk with `room` bytes left: the write past them fails with ENOSPC."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)


def _disk_full_after(room: int) -> None:
    """From now on in this process, DCP's files fit only `room` bytes (torch.save then reports
    `RuntimeError: ... unexpected pos`, the ENOSPC only as its context), and the file system
    says 0 bytes are free, as a full one does."""
    import contextlib
    from collections import namedtuple

    from torch.distributed.checkpoint.filesystem import FileSystem

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with open(path, mode) as f:
            yield io.BufferedWriter(_FillingDisk(f, room), 64) if "w" in mode else f

    FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    shutil.disk_usage = lambda path: namedtuple("usage", "total used free")(1 << 30, 1 << 30, 0)


def _full_disk_on_rank_1(tmp: str) -> dict:
    """pp=2: a run to step 2; its continuation to step 4 with rank 1's disk full at the save;
    then, with room again, the continuation from step 2 (and an undisturbed run to compare)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    rank = torch.distributed.get_rank()
    layout = ["parallel.pp=2", "train.micro_batch=2", "schedule.microbatches=2", "train.dtype=float64"]
    ref = _run_layout(layout, os.path.join(tmp, "ref"), "train.steps=4")
    out = os.path.join(tmp, "run")
    _run_layout(layout, out, "train.steps=2")
    disk, stream = shutil.disk_usage, FileSystem.create_stream
    if rank == 1:
        _disk_full_after(200)
    try:
        _run_layout(layout, out, "train.steps=4", "train.resume=auto")
        error = None
    except CheckpointError as e:
        error = str(e)
    shutil.disk_usage, FileSystem.create_stream = disk, stream  # type: ignore[method-assign]
    left = sorted(os.listdir(os.path.join(out, "checkpoints")))
    torch.distributed.barrier()
    got = _run_layout(layout, out, "train.steps=4", "train.resume=auto")
    return {"error": error, "left": left, "got": got, "ref": ref}


def _run_layout(layout: list[str], out: str, *extra: str) -> dict[int, float]:
    train(load_run(None, [*MODEL, *layout, f"logging.out_dir={out}", *extra]))
    return losses(out)


def test_a_full_disk_on_one_rank_is_said_by_every_rank_and_the_previous_checkpoint_resumes(tmp_path):
    results = run_distributed(_full_disk_on_rank_1, 2, str(tmp_path), timeout=300)
    assert results[0]["error"] == results[1]["error"]  # one line, however many ranks report it
    assert re.fullmatch(r"could not save checkpoint .*step_00000004: no space left on device \(0 bytes free there\); "
                        r"removed the partial step_00000004.tmp, and the previous checkpoint .*step_00000002 is intact",
                        results[0]["error"]), results[0]["error"]
    assert results[0]["left"] == ["step_00000002"]
    got, ref = results[0]["got"], results[0]["ref"]
    assert sorted(got) == [1, 2, 3, 4]  # metrics.jsonl: each step once
    for step in got:
        assert got[step] == pytest.approx(ref[step], abs=1e-12), step


def test_a_model_file_that_does_not_fit_is_said_in_one_line(tmp_path, monkeypatch):
    import pipekit.atomic
    from pipekit.atomic import torch_save_atomic

    path = tmp_path / "model.pt"
    path.write_bytes(b"the previous model")
    real = os.fdopen
    monkeypatch.setattr(pipekit.atomic.os, "fdopen", lambda fd, mode: io.BufferedWriter(
        _FillingDisk(real(fd, mode), 600), 64))
    with pytest.raises(OSError, match=rf"^\[Errno {errno.ENOSPC}\] no space left on device to write {path} "
                                      rf"\(.* free there\)$") as caught:
        torch_save_atomic({"w": torch.zeros(1000)}, str(path))
    assert caught.value.errno == errno.ENOSPC  # an OSError: pipekit's commands say it in one line
    assert os.listdir(tmp_path) == ["model.pt"] and path.read_bytes() == b"the previous model"


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    out = str(tmp_path / "run")
    train(load_run(None, [*ONE, f"logging.out_dir={out}", "train.steps=2"]))
    ckpt = os.path.join(out, "checkpoints", "step_00000002")
    with pytest.raises(CheckpointError, match=r"another model \(gpt2: dim=32 \(this config: 64\)"):
        train(load_run(None, [*ONE, "model.dim=64", f"logging.out_dir={tmp_path / 'b'}", f"train.resume={ckpt}"]))


def test_a_damaged_checkpoint_is_refused_naming_the_previous_complete_one(tmp_path):
    out = str(tmp_path / "run")
    full = _run("one_process", out, "train.steps=4")
    root = os.path.join(out, "checkpoints")
    ckpt, previous = os.path.join(root, "step_00000004"), os.path.join(root, "step_00000002")
    shard = os.path.join(ckpt, next(p for p in os.listdir(ckpt) if p.endswith(".distcp")))
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:  # zeroed bytes inside the shard: same size, other numbers
        f.seek(size // 2)
        f.write(bytes(64))
    said = (rf"checkpoint {ckpt} is damaged: {os.path.basename(shard)} differs from what was written \(its sha256 "
            rf"does not match\); the previous complete checkpoint is {previous}: continue from it with "
            rf"train.resume={previous}$")
    with pytest.raises(CheckpointError, match=said):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'b'}", f"train.resume={ckpt}"]))
    with pytest.raises(CheckpointError, match=said):  # generate and convert read it the same way
        load_full_weights(ckpt)
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=rf"damaged: {os.path.basename(shard)} holds 100 bytes but {size} were "
                                              rf"written \(truncated or overwritten\); the previous complete"):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'c'}", "train.steps=4", f"train.resume={ckpt}"]))
    got = _run("one_process", str(tmp_path / "d"), "train.steps=4", f"train.resume={previous}")
    assert got == {3: full[3], 4: full[4]}  # the named checkpoint continues the run bitwise
    os.remove(os.path.join(ckpt, "pipekit.json"))
    with pytest.raises(CheckpointError, match="not a complete pipekit checkpoint"):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'e'}", f"train.resume={ckpt}"]))
    shutil.rmtree(ckpt)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        train(load_run(None, [*ONE, f"logging.out_dir={tmp_path / 'f'}", f"train.resume={ckpt}"]))
