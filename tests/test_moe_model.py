"""Mixtral-style models under `pipekit train` at pp x dp x tp x ep layouts.

Float64, 3 AdamW steps, a model with 16 experts and top-1 routing on 8 tokens
per microbatch, so that in most steps some experts receive no tokens on a
rank and some none at all (`ZeroOptimizer` must then leave them alone, as
one process would). With the router's load-balancing loss on, the loss
depends on which tokens share a rank (it is a per-rank statistic, averaged
over dp as Megatron does), so layouts with the same dp are compared with
each other; with it off, a layout is compared with one process.
"""

from __future__ import annotations

import json
import os

import pytest

from pipekit.config import load_config
from pipekit.run.loop import train
from pipekit.testing import run_distributed

BASE = ["model.family=mixtral", "model.n_layers=2", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
        "model.hidden=16", "model.n_experts=16", "model.top_k=1", "model.vocab_size=64", "train.seq_len=8",
        "train.dtype=float64", "train.steps=3", "data.source=synthetic", "data.val_every=0", "logging.progress=false",
        "logging.tensorboard=false", "logging.log_every=1", "logging.peak_tflops=1", "optimizer.warmup_steps=1",
        "optimizer.lr=1e-2", "checkpoint.at_end=false", "train.micro_batch=1", "schedule.microbatches=2"]
WITH_AUX = {  # dp=2 each: the same tokens on each dp rank
    "pp2_dp2": ["parallel.pp=2", "parallel.dp=2"],
    "pp2_dp2_ep2_zero1": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "optimizer.zero_stage=1"],
    "tp2_dp2_ep2_zero2": ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "optimizer.zero_stage=2"],
}
NO_AUX = ["model.aux_loss_coef=0", "model.z_loss_coef=0"]


def losses(out: str) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl")) if '"step"' in line]


def _layouts(tmp: str) -> dict:
    out = {}
    for name, layout in WITH_AUX.items():
        train(load_config(None, [*BASE, *layout, f"logging.out_dir={tmp}/{name}", "checkpoint.every=2"]))
        out[name] = losses(f"{tmp}/{name}")
    # Layout-free experts: saved sharded over ep=2 at step 2, resumed at ep=1 and at tp=2 x ep=2.
    ckpt = f"{tmp}/pp2_dp2_ep2_zero1/checkpoints/step_00000002"
    for name, layout in (("resumed_ep1", WITH_AUX["pp2_dp2"]), ("resumed_tp2_ep2", WITH_AUX["tp2_dp2_ep2_zero2"])):
        train(load_config(None, [*BASE, *layout, f"logging.out_dir={tmp}/{name}", f"train.resume={ckpt}"]))
        out[name] = losses(f"{tmp}/{name}")
    train(load_config(None, [*BASE, *NO_AUX, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                             "optimizer.zero_stage=2", f"logging.out_dir={tmp}/no_aux"]))
    out["no_aux"] = losses(f"{tmp}/no_aux")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("moe"))
    return run_distributed(_layouts, 4, tmp, timeout=500)[0]


def test_expert_parallel_layouts_train_the_same_model(runs):
    want = runs["pp2_dp2"]
    assert len(want) == 3
    for name in WITH_AUX:
        assert runs[name] == pytest.approx(want, abs=1e-10), name


def test_a_checkpoint_with_sharded_experts_resumes_at_other_ep(runs):
    for name in ("resumed_ep1", "resumed_tp2_ep2"):
        assert runs[name] == pytest.approx(runs["pp2_dp2"][2:], abs=1e-10), name


def test_without_the_aux_loss_any_layout_is_one_process(runs, tmp_path):
    train(load_config(None, [*BASE, *NO_AUX, "parallel.pp=1", "train.micro_batch=2",
                             f"logging.out_dir={tmp_path}"]))
    assert losses(str(tmp_path)) == pytest.approx(runs["no_aux"], abs=1e-10)


def test_ep_that_does_not_divide_the_experts_is_refused_before_launch():
    from pipekit.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.n_experts=6 is not divisible by the "
                                          r"expert-parallel size parallel.ep=4"):
        load_config(None, [*BASE, "model.n_experts=6", "parallel.dp=4", "parallel.ep=4", "train.micro_batch=1"])
    with pytest.raises(ConfigError, match=r"parallel.ep=2 shards experts, but model.family=gpt2 has none"):
        load_config(None, ["parallel.dp=2", "parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"top_k=9 exceeds n_experts=8"):
        load_config(None, ["model.family=mixtral", "model.top_k=9"])


def test_experts_without_tokens_are_said_once_per_layer_and_ep_shows_in_the_layout(tmp_path, capsys):
    """8 tokens a step for 16 top-1 experts: at least 8 of each layer's get none, said at step 1."""
    from pipekit.run.metrics import summary_table

    summary = train(load_config(None, [*BASE, "train.seq_len=4", f"logging.out_dir={tmp_path}"]))
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "got no tokens" in line]
    assert [line.split(":")[1].strip() for line in said] == ["moe/1", "moe/2"], said
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"step": 1,' in line]
    idle = [i for i, t in enumerate(recs[0]["moe"]["moe/1"]["tokens_per_expert"]) if t == 0]
    assert len(idle) >= 8 and f"experts {', '.join(map(str, idle[:8]))}" in said[0] and "at step 1 " in said[0]
    assert " ep=" not in out and "ep=2 (" in summary_table({**summary, "ep": 2})
