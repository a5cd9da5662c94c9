"""The model zoo: configs and flavours, spec lists, parameter counts, FLOPs, training.

Parallel correctness against Hugging Face (every layout, logits, training)
lives in test_hf.py; here everything runs in this process. Tensor-parallel
construction is checked without processes through a stand-in group (the
layers only ask a group for its size and rank while building, and do not
communicate on the meta device).
"""

from __future__ import annotations

import math

import pytest
import torch

import pipekit
from pipekit.layers import VocabParallelCrossEntropy, tensor_parallel
from pipekit.models import (
    FAMILIES,
    GPT2Config,
    LlamaConfig,
    count_params,
    flops_per_token,
    get_model,
    model_loss,
    model_specs,
    with_overrides,
)
from pipekit.spec import LayerSpec, TiedLayerSpec, build_layer

ALL_FLAVOURS = [(family, flavour) for family, fam in FAMILIES.items() for flavour in fam.flavours]


class StandInGroup:
    """A tp "group" of `size` ranks seen from `rank`, for building layers without processes."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


# ---- configs -------------------------------------------------------------------
def test_get_model_defaults_and_overrides():
    assert get_model("gpt2") == GPT2Config(vocab_size=256, max_seq_len=128, n_layers=4, dim=128, n_heads=4)
    cfg = get_model("llama", "tiny", n_layers=2, rope_theta=1e4)
    assert isinstance(cfg, LlamaConfig) and (cfg.n_layers, cfg.rope_theta, cfg.n_kv_heads) == (2, 1e4, 2)
    assert get_model("llama", "3-8b").hidden == 14336
    assert with_overrides(cfg, dim=64).dim == 64


@pytest.mark.parametrize("call,match", [
    (lambda: get_model("bert"), r"valid families: \['gpt2', 'llama'\]"),
    (lambda: get_model("gpt2", "huge"), r"valid flavours: \['tiny', '124m', '355m', '774m', '1.5b'\]"),
    (lambda: get_model("llama", n_kv_head=2),
     r"unknown llama config key\(s\) \['n_kv_head'\]; valid keys: .*'n_kv_heads'"),
    (lambda: get_model("gpt2", dim=102), "dim=102 is not divisible by n_heads=4"),
    (lambda: get_model("llama", n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
    (lambda: get_model("llama", n_layers=0), "n_layers must be a positive int"),
    (lambda: with_overrides(get_model("gpt2"), hidden=3), r"unknown gpt2 config key\(s\) \['hidden'\]"),
])
def test_bad_configs_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- sizes and FLOPs ---------------------------------------------------------------
# Parameter counts of the published models (tied embeddings counted once), as
# Hugging Face's `num_parameters()` reports them for the configs named in the zoo.
KNOWN_PARAMS = {
    ("gpt2", "124m"): 124_439_808,
    ("gpt2", "355m"): 354_823_168,
    ("gpt2", "774m"): 774_030_080,
    ("gpt2", "1.5b"): 1_557_611_200,
    ("llama", "2-7b"): 6_738_415_616,
    ("llama", "3-8b"): 8_030_261_248,
    ("llama", "3-70b"): 70_553_706_496,
}


@pytest.mark.parametrize("family,flavour", list(KNOWN_PARAMS))
def test_count_params_of_published_sizes(family, flavour):
    assert count_params(get_model(family, flavour)) == KNOWN_PARAMS[(family, flavour)]


def meta_count(specs: list) -> int:
    """Parameters of the spec list built on meta, each tied key once."""
    seen, total = set(), 0
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue
            seen.add(spec.key)
        if isinstance(spec, LayerSpec):
            total += sum(p.numel() for p in spec.build(device="meta").parameters())
    return total


@pytest.mark.parametrize("family,flavour", ALL_FLAVOURS)
@pytest.mark.parametrize("tied", [True, False])
def test_count_params_matches_the_spec_list(family, flavour, tied):
    cfg = get_model(family, flavour, n_layers=2, tie_embeddings=tied)  # the blocks repeat: two show the formula
    assert count_params(cfg) == meta_count(model_specs(cfg))


def test_count_params_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from pipekit.models.hf import hf_config_from

    for cfg in (get_model("gpt2"), get_model("gpt2", tie_embeddings=False), get_model("llama"),
                get_model("llama", tie_embeddings=True)):
        model = transformers.AutoModelForCausalLM.from_config(hf_config_from(cfg))
        assert count_params(cfg) == sum(p.numel() for p in model.parameters()), cfg


def test_flops_per_token():
    cfg = get_model("gpt2", "124m")
    matmul_params = 124_439_808 - 1024 * 768  # the position table is a lookup; wte is also the head
    assert count_params(cfg, embedding_lookups=False) == matmul_params
    assert flops_per_token(cfg, 1024) == 6 * matmul_params + 12 * 12 * 768 * 1024
    llama = get_model("llama", "3-8b")  # untied: the input table is a lookup, the head a matmul
    assert count_params(llama, embedding_lookups=False) == 8_030_261_248 - 128256 * 4096
    assert flops_per_token(llama, 8192) - flops_per_token(llama, 4096) == 12 * 32 * 4096 * 4096
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)


# ---- spec lists ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_stable_parameter_names(family, tied):
    cfg = get_model(family, n_layers=2, tie_embeddings=tied)
    names = set(pipekit.PipelineModule(model_specs(cfg), device="meta").state_dict())
    embed = {("gpt2", True): "tied.embed.wte.weight", ("gpt2", False): "layers.0.wte.weight",
             ("llama", True): "tied.embed.weight", ("llama", False): "layers.0.weight"}[family, tied]
    mlp = "layers.2.mlp.fc.weight" if family == "gpt2" else "layers.2.mlp.gate.weight"
    assert {embed, "layers.1.attn.q.weight", "layers.2.attn.o.weight", mlp, "layers.3.weight"} <= names
    assert ("layers.4.weight" in names) == (not tied)  # the untied head
    assert isinstance(model_loss(cfg), LayerSpec) and model_loss(cfg).module_cls is VocabParallelCrossEntropy


def build_all(specs: list, group=None, device=None, seed: int = 3) -> list:
    """Every entry built as PipelineModule would (tied ones shared), under `group`."""
    tied, out = {}, []
    with tensor_parallel(group):
        for i, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                tied.setdefault(spec.key, build_layer(specs, i, seed=seed, device=device))
                out.append(tied[spec.key])
            else:
                out.append(build_layer(specs, i, seed=seed, device=device))
    return out


def run_all(specs: list, modules: list, x):
    for spec, module in zip(specs, modules):
        fn = getattr(spec, "forward_fn", None)
        x = fn(module, x) if fn is not None else module(x)
    return x


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_tp_shards_are_slices_of_the_one_process_model(family, tied):
    """At tp=2 each rank's shard is its slice (along `tp_shard_dim`) of the tp=1
    weights, and the logits come out split over the vocabulary."""
    cfg = get_model(family, n_layers=2, tie_embeddings=tied)
    specs = model_specs(cfg)
    whole = build_all(specs)
    shards = [build_all(specs, StandInGroup(2, r)) for r in range(2)]
    for i, module in enumerate(whole):
        for name, full in module.state_dict(keep_vars=True).items():
            parts = [dict(s[i].state_dict(keep_vars=True))[name] for s in shards]
            dim = getattr(parts[0], "tp_shard_dim", None)
            joined = parts[0] if dim is None else torch.cat(parts, dim=dim)
            assert torch.equal(joined, full), f"entry {i} {name}"
            if dim is None:
                assert torch.equal(parts[1], full), f"entry {i} {name}: replicated but differs on rank 1"
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert run_all(specs, build_all(specs, StandInGroup(2, 1), device="meta"), ids).shape == (2, 8, cfg.vocab_size // 2)
    assert run_all(specs, whole, torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, cfg.vocab_size)


def test_sequence_longer_than_position_table():
    cfg = get_model("gpt2", max_seq_len=8, n_layers=1)
    module = pipekit.PipelineModule(model_specs(cfg))
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        module(torch.zeros(1, 9, dtype=torch.long))


# ---- training -----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tiny_flavour_trains(family):
    """20 AdamW steps on one repeating batch: the loss starts near log(vocab) and falls."""
    cfg = get_model(family, "tiny", n_layers=2)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=0)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.0)
    engine = pipekit.PipelineEngine(module, optimizer=opt, schedule="1f1b", num_microbatches=2)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    losses = [engine.train_batch(iter([batch])) for _ in range(20)]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(cfg.vocab_size)) < 0.5, losses[0]
    assert losses[-1] < losses[0] - 1.0, losses
