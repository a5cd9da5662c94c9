"""Sequence-length warm-up (`train.seq_len_start`, pipekit/run/curriculum.py): DeepSpeed's
seqlen curriculum, the same curve at every layout and after a resume.

The length of every step equals DeepSpeed's `CurriculumScheduler` (fixed_linear and
fixed_root) asked for the step DeepSpeed's engine asks for (its global step + 1). On 4
gloo ranks, float64, GPT-2, 6 steps warming up from 4 to 16 tokens: pp=2 x dp=2 (1F1B,
ZeRO-1) and cp=2 x dp=2 (ring) give the one-process losses within 1e-10 (every step's
shapes new), and a resume from the step-2 checkpoint, in the middle of the warm-up,
gives the uninterrupted run's losses bitwise.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipekit.config import ConfigError, load_config, load_run
from pipekit.run.curriculum import seq_len_at, truncated
from pipekit.run.loop import train
from pipekit.testing import run_distributed

STEPS = 6
MODEL = ["model.family=gpt2", "model.n_layers=2", "model.dim=16", "model.n_heads=4", "model.vocab_size=40",
         "train.seq_len=16", "train.seq_len_start=4", "train.seq_len_warmup_steps=5", "train.seq_len_multiple=4",
         "train.dtype=float64", "data.source=synthetic", "data.val_every=0", "logging.progress=false",
         "logging.tensorboard=false", "logging.log_every=1", f"train.steps={STEPS}", "optimizer.warmup_steps=0",
         "optimizer.lr=1e-2", "checkpoint.every=2", "checkpoint.keep=3", "train.micro_batch=2",
         "schedule.microbatches=2"]
LAYOUTS = {"pp2_dp2": ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=1"],
           "cp2_dp2": ["parallel.pp=1", "parallel.dp=2", "parallel.cp=2"],
           "one": ["parallel.pp=1", "parallel.dp=1", "train.micro_batch=4"]}


def losses(out: str) -> dict[int, float]:
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "step" in r and "loss" in r}


def _run(layout: str, out: str, *extra: str) -> dict[int, float]:
    train(load_run(None, [*MODEL, *LAYOUTS[layout], f"logging.out_dir={out}", *extra]))
    return losses(out)


def _group(tmp: str) -> dict:
    full = os.path.join(tmp, "pp")
    out = {"pp": _run("pp2_dp2", full), "cp": _run("cp2_dp2", os.path.join(tmp, "cp"))}
    out["resumed"] = _run("pp2_dp2", os.path.join(tmp, "again"), f"train.resume={full}/checkpoints/step_00000002",
                          f"checkpoint.dir={tmp}/again_ckpt")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("warmup"))
    group = run_distributed(_group, 4, tmp, timeout=400)[0]
    return group, _run("one", os.path.join(tmp, "one"))


def test_the_lengths_grow_as_configured():
    t = load_config(None, [*MODEL, "checkpoint.every=0"]).train
    assert [seq_len_at(t, s) for s in range(1, 8)] == [4, 8, 8, 12, 16, 16, 16]


def test_every_layout_warms_up_on_the_one_process_curve(results):
    group, one = results
    assert sorted(one) == list(range(1, STEPS + 1))
    for name in ("pp", "cp"):
        assert sorted(group[name]) == sorted(one)
        for step, loss in one.items():
            assert abs(group[name][step] - loss) <= 1e-10, (name, step, group[name][step], loss)


def test_a_resume_in_the_middle_of_the_warm_up_continues_the_curve_bitwise(results):
    group, _ = results
    assert sorted(group["resumed"]) == [3, 4, 5, 6]
    assert all(group["resumed"][s] == group["pp"][s] for s in (3, 4, 5, 6)), (group["resumed"], group["pp"])


def test_truncation_cuts_every_sequence_tensor():
    ids, pos, labels = torch.zeros(2, 9), torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9)
    (a, b), c = truncated(((ids, pos), labels), 4)
    assert a.shape == b.shape == c.shape == (2, 4)


@pytest.mark.parametrize("over, said", [
    (["train.seq_len_start=20"], "train.seq_len_start=20 must be in [1, train.seq_len=16]"),
    (["train.seq_len_warmup_steps=0"], "train.seq_len_warmup_steps=0 must be >= 1"),
    (["parallel.cp=4", "parallel.pp=1"], "train.seq_len_multiple=4 must be a multiple of 8"),
])
def test_bad_warm_up_settings_are_named(over, said):
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
        load_run(None, [*MODEL, "checkpoint.every=0", *over])


@pytest.mark.parametrize("schedule, more", [("fixed_linear", {}), ("fixed_root", {"root_degree": 2}),
                                            ("fixed_root", {"root_degree": 3})])
@pytest.mark.parametrize("low, high, total, step", [(8, 128, 50, 8), (10, 64, 17, 16), (64, 1024, 300, 64)])
def test_each_steps_length_is_deepspeeds(schedule, more, low, high, total, step):
    """DeepSpeed's engine asks its curriculum scheduler for global_steps + 1 before each forward:
    pipekit's step s (1-based) is that number."""
    ds = pytest.importorskip("deepspeed.runtime.data_pipeline.curriculum_scheduler")
    scheduler = ds.CurriculumScheduler({
        "curriculum_type": "seqlen", "min_difficulty": low, "max_difficulty": high, "schedule_type": schedule,
        "schedule_config": {"total_curriculum_step": total, "difficulty_step": step, **more}})
    t = load_config(None, [f"train.seq_len={high}", f"model.max_seq_len={high}", "checkpoint.every=0",
                           f"train.seq_len_start={low}",
                           f"train.seq_len_warmup_steps={total}", f"train.seq_len_multiple={step}",
                           f"train.seq_len_root={more.get('root_degree', 1)}"]).train
    for s in range(1, total + 20):
        assert seq_len_at(t, s) == scheduler.update_difficulty(s), s
