"""`pipekit.rules`: each rule about which settings combine is written once, and the config
(`pipekit train`, before any worker starts) and the Python API (`Topology`, `PipelineEngine`,
the MoE layers) refuse the same values with the same words, each naming its values the way
its caller writes them."""

from __future__ import annotations

import re

import pytest

import pipekit
from pipekit import rules
from pipekit.config import ConfigError, load_config
from pipekit.models.toy import ToyConfig, lm_loss, toy_lm
from pipekit.moe import MoEMLP

# (a rule, its arguments, the config's overrides that break it the same way)
CASES = [
    ("ep-divides-dp", rules.check_ep, (3, 4), ["parallel.dp=4", "parallel.ep=3"]),
    ("dp-shard-divides-dp", rules.check_dp_shard, (3, 4, 3),
     ["parallel.dp=4", "parallel.dp_shard=3", "optimizer.zero_stage=3"]),
    ("dp-shard-is-stage-3", rules.check_dp_shard, (2, 4, 1),
     ["parallel.dp=4", "parallel.dp_shard=2", "optimizer.zero_stage=1"]),
    ("zero3-overlap", rules.check_overlap, (True, 3),
     ["parallel.dp=2", "optimizer.zero_stage=3", "schedule.overlap=true"]),
    ("clip-negative", rules.check_clip, (-1.0,), ["optimizer.clip_grad_norm=-1.0"]),
]


def _said(check, args, names) -> str:
    with pytest.raises(ValueError) as e:
        check(*args, names=names)
    return str(e.value)


def _as_api(text: str) -> str:
    """A config message in the API's words: the keys' prefixes off, YAML's words as Python's."""
    for key, config_key in rules.CONFIG.items():
        text = text.replace(config_key, key)
    return text.replace("=true", "=True").replace("=false", "=False").replace("null", "None")


@pytest.mark.parametrize("name, check, args, overrides", CASES, ids=[c[0] for c in CASES])
def test_the_config_and_the_api_refuse_with_one_rule(name, check, args, overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == _said(check, args, rules.CONFIG)
    api = _said(check, args, rules.API)
    assert re.sub(r"'(\w+)'", r"\1", api) == _as_api(str(e.value)), (api, str(e.value))


def test_n_experts_must_divide_by_ep_in_the_config_and_the_layer():
    with pytest.raises(ConfigError, match=r"model.n_experts=6 is not divisible by the expert-parallel size "
                                          r"parallel.ep=4; use an ep among \[1, 2\]"):
        load_config(None, ["model.family=mixtral", "model.n_experts=6", "parallel.dp=4", "parallel.ep=4",
                           "train.micro_batch=1"])
    from pipekit.layers.parallel import FakeGroup

    with pytest.raises(ValueError, match=r"^n_experts=6 is not divisible by the expert-parallel size ep=4"):
        MoEMLP(dim=8, hidden=16, n_experts=6, top_k=2, ep_group=FakeGroup(4))


def test_the_topology_and_the_engine_apply_the_rules():
    with pytest.raises(ValueError, match=r"^ep=2 must divide dp=1"):
        pipekit.Topology(ep=2)
    with pytest.raises(ValueError, match=r"^dp_shard=2 must divide dp=1"):
        pipekit.Topology(dp_shard=2)
    module = pipekit.PipelineModule(toy_lm(ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)),
                                    loss_fn=lm_loss)
    for clip in (-1.0, 0, float("nan"), "1.0"):
        with pytest.raises(ValueError, match=r"^clip_grad_norm=.* must be a finite number > 0, or None"):
            pipekit.PipelineEngine(module, clip_grad_norm=clip)


def test_a_topology_alone_is_whole_inside_a_job(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as in a launcher's worker: alone=True must not join the job
    t = pipekit.Topology(alone=True)
    assert (t.world_size, t.pp, t.dp, t.tp, t.ep, t.etp, t.dp_shard) == (1, 1, 1, 1, 1, 1, 1)
    assert t.ep_group is None and t.etp_group is None and t.hsdp_mesh is None and t.sequence_parallel is False
