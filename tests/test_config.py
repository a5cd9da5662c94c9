"""A run is resolved once (`pipekit.config.resolve` -> a frozen `Run`), with its precision
policy; a schedule registered by the user's module, or an action-table file, is named
from the config and the command line, in the launcher and in every worker."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from pipekit.config import ConfigError, Run, load_config, load_run, resolve
from pipekit.models import get_model
from pipekit.precision import LossScaling, precision_policy
from pipekit.schedules import SCHEDULES, build_schedule

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "configs" / "toy.yaml")
GPIPE_PP2_M4 = """# GPipe on 2 ranks, 4 microbatches: all forwards, then all backwards
0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
"""


def _module_source(name: str) -> str:
    return ("from pipekit.schedules import one_f_one_b, register_schedule\n"
            f"register_schedule({name!r}, one_f_one_b)\n")


# ---- the Run ---------------------------------------------------------------------------
def test_resolve_makes_one_frozen_run_of_model_schedule_sizes_and_precision():
    run = load_run(TOY, ["parallel.dp=2", "train.micro_batch=4"])
    assert isinstance(run, Run) and resolve(run) is run  # a Run is resolved already
    assert run.model == get_model("toy", "tiny", vocab_size=64, dim=64, n_layers=3)
    assert run.schedule == build_schedule("1f1b", 2, 4)
    assert (run.pp, run.dp, run.tp, run.ep, run.world_size) == (2, 2, 1, 1, 4)
    assert run.partition == "parameters" and run.family == "toy"
    assert run.precision == precision_policy("fp32", "float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.pp = 4
    assert load_run(TOY, ["schedule.partition=0,3,13"]).partition == (0, 3, 13)


def test_a_run_keeps_its_own_keys():
    cfg = load_config(TOY)
    run = resolve(cfg)
    cfg.train.steps = 1
    assert run.config.train.steps == 300


def test_precision_policy_says_which_dtype_holds_what():
    assert precision_policy("fp32", "float64") == precision_policy("fp32", "float64")
    p64 = precision_policy("fp32", "float64")
    assert (p64.param_dtype, p64.reduce_dtype, p64.master_dtype, p64.loss_scaling) == (torch.float64,) * 3 + (None,)
    bf16 = precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.master_dtype, bf16.mixed) == (
        torch.bfloat16, torch.float32, torch.float32, True)
    fp16 = load_run(TOY, ["train.precision=fp16", "fp16.loss_scale=0", "fp16.initial_scale_power=8"]).precision
    assert fp16.param_dtype == torch.float16
    assert fp16.loss_scaling == LossScaling(static_scale=None, initial_scale_power=8)
    static = load_run(TOY, ["train.precision=fp16", "fp16.loss_scale=128"]).precision.loss_scaling
    assert static.static_scale == 128.0
    with pytest.raises(ValueError, match="needs dtype float32"):
        precision_policy("bf16", "float64")


# ---- schedules named from the config ---------------------------------------------------
def test_schedule_module_registers_a_schedule_the_config_names(tmp_path, monkeypatch):
    module, name = f"user_sched_{uuid.uuid4().hex[:8]}", f"mine_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(_module_source(name))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ConfigError, match=f"schedule.name='{name}' is not one of .*needs schedule.module"):
        load_run(TOY, [f"schedule.name={name}"])
    run = load_run(TOY, [f"schedule.module={module}", f"schedule.name={name}"])
    assert name in SCHEDULES
    assert run.schedule.name == name and run.schedule.ranks == build_schedule("1f1b", 2, 4).ranks
    assert load_run(TOY, [f"schedule.module={module}", f"schedule.name={name}"]).schedule == run.schedule  # once


def test_schedule_module_as_a_file_and_its_errors(tmp_path):
    name = f"mine_{uuid.uuid4().hex[:8]}"
    path = tmp_path / "sched.py"
    path.write_text(_module_source(name))
    assert load_run(TOY, [f"schedule.module={path}", f"schedule.name={name}"]).schedule.name == name
    with pytest.raises(ConfigError, match=r"schedule.module=no_such_module_here could not be imported"):
        load_run(TOY, ["schedule.module=no_such_module_here"])
    with pytest.raises(ConfigError, match=r"schedule.module=.*missing.py is not a file"):
        load_run(TOY, [f"schedule.module={tmp_path / 'missing.py'}"])
    (tmp_path / "broken.py").write_text("raise RuntimeError('half written')\n")
    with pytest.raises(ConfigError, match=r"could not be imported: RuntimeError: half written"):
        load_run(TOY, [f"schedule.module={tmp_path / 'broken.py'}"])


def test_an_action_table_file_is_a_schedule_name(tmp_path):
    table = tmp_path / "gpipe2.txt"
    table.write_text(GPIPE_PP2_M4)
    run = load_run(TOY, [f"schedule.name={table}"])
    assert run.schedule.name == "gpipe2"
    assert [list(map(str, run.schedule.compute_actions(r))) for r in range(2)] == [
        line.split() for line in GPIPE_PP2_M4.splitlines()[1:]]
    with pytest.raises(ConfigError, match=r"a table of 2 ranks \(lines\), but parallel.pp=1"):
        load_run(TOY, [f"schedule.name={table}", "parallel.pp=1"])
    with pytest.raises(ConfigError, match=r"schedule: .*microbatch"):
        load_run(TOY, [f"schedule.name={table}", "schedule.microbatches=2"])


def _train_cli(tmp_path: Path, tag: str, *overrides: str) -> list[float]:
    out = tmp_path / tag
    cmd = [sys.executable, "-m", "pipekit.cli", "train", TOY, "train.steps=3", "model.dim=16", "data.val_every=0",
           "logging.progress=false", "logging.log_every=1", f"logging.out_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["summary"]["pp"] == 2
    return [r["loss"] for r in recs if "step" in r]


def test_cli_trains_with_a_registered_and_a_table_schedule(tmp_path):
    """`pipekit train ... schedule.module=M schedule.name=N` on two workers: the launcher and
    each worker import M before resolving; the losses are 1F1B's (and GPipe's table's)."""
    (tmp_path / "cli_sched.py").write_text(_module_source("my_1f1b"))
    (tmp_path / "gpipe2.txt").write_text(GPIPE_PP2_M4)
    builtin = _train_cli(tmp_path, "builtin")
    mine = _train_cli(tmp_path, "mine", "schedule.module=cli_sched", "schedule.name=my_1f1b")
    table = _train_cli(tmp_path, "table", f"schedule.name={tmp_path / 'gpipe2.txt'}")
    assert mine == builtin
    assert table == pytest.approx(builtin, rel=1e-5)
