"""The model zoo: configs and flavours, spec lists, parameter counts, FLOPs, training.

Parallel correctness against Hugging Face (every layout, logits, training)
lives in test_hf.py; here everything runs in this process. Tensor-parallel
construction is checked without processes through a stand-in group (the
layers only ask a group for its size and rank while building, and do not
communicate on the meta device).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pipekit
from pipekit.checkpoint import full_state_dict, load_full_state_dict
from pipekit.layers import VocabParallelCrossEntropy, tensor_parallel, vocab_parallel_cross_entropy
from pipekit.models import (
    FAMILIES,
    GPT2Config,
    LlamaConfig,
    config_from_dict,
    count_params,
    flops_per_token,
    get_model,
    model_keys,
    model_loss,
    model_specs,
    padded_vocab,
    with_overrides,
)
from pipekit.models.common import attention_flops
from pipekit.models.hf import vocab_tensor_names
from pipekit.spec import LayerSpec, TiedLayerSpec, build_layer
from pipekit.testing import FakeGroup

ROOT = Path(__file__).resolve().parents[1]
ALL_FLAVOURS = [(family, flavour) for family, fam in FAMILIES.items() for flavour in fam.flavours]


# ---- configs -------------------------------------------------------------------
def test_get_model_defaults_and_overrides():
    assert get_model("gpt2") == GPT2Config(vocab_size=256, max_seq_len=128, n_layers=4, dim=128, n_heads=4)
    cfg = get_model("llama", "tiny", n_layers=2, rope_theta=1e4)
    assert isinstance(cfg, LlamaConfig) and (cfg.n_layers, cfg.rope_theta, cfg.n_kv_heads) == (2, 1e4, 2)
    assert get_model("llama", "3-8b").hidden == 14336
    assert with_overrides(cfg, dim=64).dim == 64


@pytest.mark.parametrize("call,match", [
    (lambda: get_model("bert"), r"valid families: \['gpt2', 'llama', 'mixtral', 'toy'\]"),
    (lambda: get_model("gpt2", "huge"), r"valid flavours: \['tiny', '124m', '355m', '774m', '1.5b'\]"),
    (lambda: get_model("llama", n_kv_head=2),
     r"unknown llama config key\(s\) \['n_kv_head'\]; valid keys: .*'n_kv_heads'"),
    (lambda: get_model("gpt2", dim=102), "dim=102 is not divisible by n_heads=4"),
    (lambda: get_model("llama", n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
    (lambda: get_model("llama", n_layers=0), "n_layers must be a positive int"),
    (lambda: with_overrides(get_model("gpt2"), hidden=3), r"unknown gpt2 config key\(s\) \['hidden'\]"),
    (lambda: get_model("toy", n_heads=2),
     r"unknown toy config key\(s\) \['n_heads'\]; valid keys: .*'blocks'.* "
     r"\(or vocab_size for vocab, n_layers for blocks\)"),
    (lambda: get_model("toy", vocab_size=8, vocab=8), "'vocab_size' is given twice, also as 'vocab'"),
    (lambda: get_model("toy", "huge"), r"valid flavours: \['tiny'\]"),
    (lambda: get_model("toy", n_layers=0), "ToyConfig: blocks must be a positive int"),
])
def test_bad_configs_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_padded_vocab():
    assert [padded_vocab(get_model("gpt2", vocab_size=v)) for v in (1, 128, 129, 50257)] == [128, 128, 256, 50304]
    assert get_model("llama", vocab_size=61, vocab_pad_multiple=8).padded_vocab == 64
    assert get_model("gpt2", vocab_size=61, vocab_pad_multiple=1).padded_vocab == 61
    assert [get_model("llama", f).padded_vocab for f in ("2-7b", "3-8b")] == [32000, 128256]  # already multiples
    with pytest.raises(ValueError, match="vocab_pad_multiple must be a positive int"):
        get_model("gpt2", vocab_pad_multiple=0)


def test_config_from_dict_without_vocab_pad_multiple():
    """Files written before padding existed lack the field: the default applies."""
    old = asdict(get_model("llama", vocab_size=61))
    del old["vocab_pad_multiple"]
    assert config_from_dict("llama", old) == get_model("llama", vocab_size=61, vocab_pad_multiple=128)


def test_config_check_uses_the_padded_vocab():
    from pipekit.config import ConfigError, load_config, model_config

    cfg = load_config(str(ROOT / "configs/gpt2_124m.yaml"))  # 50,257 ids at tp=2
    assert cfg.parallel.tp == 2 and model_config(cfg.model).vocab_size == 50257
    message = ("model.vocab_size=50257, padded to 50304 (a multiple of its vocab_pad_multiple=128), "
               "is not divisible by parallel.tp=5")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(ROOT / "configs/gpt2_1.5b.yaml"), ["parallel.tp=5"])


# ---- the registry: every family, the toy model too ------------------------------------------
def test_the_toy_model_registers_like_the_other_families():
    """Its flavour, the common keys the registry maps onto its fields, its spec list and
    plain loss, its vocabulary, and its size and FLOPs in closed form (no attention: 6 * N,
    what train.py's fallback gave it before)."""
    from pipekit.models import ToyConfig, family_of, lm_loss, model_vocab, toy_lm

    assert get_model("toy") == ToyConfig()
    cfg = get_model("toy", "tiny", vocab_size=64, dim=64, n_layers=3)  # configs/toy.yaml
    assert cfg == ToyConfig(vocab=64, dim=64, blocks=3) and family_of(cfg) == "toy"
    assert with_overrides(cfg, n_layers=1).blocks == 1 and with_overrides(cfg, blocks=2).blocks == 2
    assert config_from_dict("toy", asdict(cfg)) == cfg  # what model.pt and checkpoints store
    assert model_keys("toy") == ["vocab_size", "dim", "wide_dim", "n_layers", "mlp_ratio"]
    assert repr(model_specs(cfg)) == repr(toy_lm(cfg)) and model_loss(cfg) is lm_loss
    assert model_vocab(cfg) == 64 and model_vocab(get_model("gpt2", vocab_size=61)) == 61
    assert count_params(cfg) == count_params(cfg, embedding_lookups=False) == meta_count(model_specs(cfg)) == 89_024
    assert flops_per_token(cfg, 32) == flops_per_token(cfg, 1) == 6 * 89_024


def test_config_generate_and_train_do_not_branch_on_a_family():
    for name in ("config.py", "run/generate.py", "run/loop.py", "run/start.py"):
        source = (ROOT / "pipekit" / name).read_text()
        assert "ToyConfig" not in source and not re.search(r"""== ["'](toy|gpt2|llama|mixtral)["']""", source), name


def test_the_moe_fields_are_defined_once():
    """Mixtral is Llama's config with the MoE fields; GPT-2 has the same optional ones; every
    one of them is a `model.` key of the training config, so YAML and overrides reach it."""
    from dataclasses import fields

    from pipekit.config import ModelConfig
    from pipekit.models import MixtralConfig, MoEConfig

    moe = [f.name for f in fields(MoEConfig)]
    assert issubclass(MixtralConfig, LlamaConfig) and issubclass(MixtralConfig, MoEConfig)
    assert issubclass(GPT2Config, MoEConfig) and get_model("gpt2").n_experts is None
    assert set(model_keys("mixtral")) == set(model_keys("llama")) | set(moe)
    assert set(moe) <= {f.name for f in fields(ModelConfig)}
    mixtral = get_model("mixtral", n_experts=4, top_k=1, rope_theta=1.0)
    assert (mixtral.n_experts, mixtral.top_k, mixtral.rope_theta, get_model("mixtral", "8x7b").rope_theta) == \
        (4, 1, 1.0, 1e6)
    with pytest.raises(ValueError, match="MixtralConfig: dim=102 is not divisible by n_heads=4"):
        get_model("mixtral", dim=102)


def test_shared_parts_live_in_common():
    """Llama and Mixtral borrow nothing from gpt2.py; the helpers stay importable from it."""
    from pipekit.models import common, gpt2, mixtral

    for name in ("check_positive", "check_moe", "padded_vocab", "vocab_logits", "VocabParallelHead",
                 "mask_padded_vocab", "moe_mlp"):
        assert getattr(gpt2, name) is getattr(common, name), name
    assert mixtral.moe_mlp is common.moe_mlp
    for name in ("llama.py", "mixtral.py"):
        assert not re.search(r"from \.gpt2|import gpt2", (ROOT / "pipekit/models" / name).read_text()), name


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
    ("mixtral", "8x7b"): 46_702_792_704,  # "46.7B total, 12.9B active" (Jiang et al. 2024)
}


@pytest.mark.parametrize("family,flavour", list(KNOWN_PARAMS))
def test_count_params_of_published_sizes(family, flavour):
    """The published sizes are the unpadded models (`padded=False`); the default
    counts the padded rows too, once per vocab table (GPT-2: 50,257 -> 50,304 rows)."""
    cfg = get_model(family, flavour)
    assert count_params(cfg, padded=False) == KNOWN_PARAMS[(family, flavour)]
    tables = 1 if cfg.tie_embeddings else 2
    assert count_params(cfg) - count_params(cfg, padded=False) == tables * (cfg.padded_vocab - cfg.vocab_size) * cfg.dim


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
    tie = {"tie_embeddings": tied} if "tie_embeddings" in model_keys(family) else {}  # the toy's table is its head
    cfg = get_model(family, flavour, n_layers=2, **tie)  # the blocks repeat: two show the formula
    assert count_params(cfg) == meta_count(model_specs(cfg))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("variant", [dict(qkv_bias=True), dict(qk_norm=True, head_dim=64), dict(head_dim=16)])
def test_count_params_of_llama_variants(family, variant):
    """The Hugging Face variants (Qwen2's q/k/v biases, Qwen3's head norms and head_dim) counted in
    closed form as built; the attention FLOPs follow the heads' real width."""
    cfg = get_model(family, "tiny", n_layers=2, **variant)
    assert count_params(cfg) == meta_count(model_specs(cfg))
    base = get_model(family, "tiny", n_layers=2)
    ratio = cfg.attn_head_dim / base.attn_head_dim
    assert attention_flops(cfg, 64) == attention_flops(base, 64) * ratio
    windowed = with_overrides(cfg, sliding_window=16)
    assert attention_flops(windowed, 64) * 4 == attention_flops(cfg, 64) == attention_flops(windowed, 16) * 4


@pytest.mark.parametrize("moe", [dict(n_experts=4), dict(n_experts=4, n_shared_experts=2, top_k=1)])
def test_gpt2_moe_count_params_matches_the_spec_list(moe):
    cfg = get_model("gpt2", "tiny", n_layers=2, **moe)
    assert count_params(cfg) == meta_count(model_specs(cfg))
    dense = get_model("gpt2", "tiny", n_layers=2)
    per_expert = 8 * cfg.dim * cfg.dim + 5 * cfg.dim  # fc, proj and their biases
    routed = (count_params(cfg) - count_params(cfg, active=True)) / cfg.n_layers
    assert routed == (cfg.n_experts - cfg.top_k) * per_expert
    assert count_params(dense, active=True) == count_params(dense)


def test_mixtral_8x7b_active_parameters():
    assert count_params(get_model("mixtral", "8x7b"), padded=False, active=True) == 12_879_925_248


def test_count_params_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from pipekit.models.hf import hf_config_from

    for cfg in (get_model("gpt2"), get_model("gpt2", tie_embeddings=False), get_model("llama"),
                get_model("llama", tie_embeddings=True)):
        model = transformers.AutoModelForCausalLM.from_config(hf_config_from(cfg))
        assert count_params(cfg) == sum(p.numel() for p in model.parameters()), cfg


def test_flops_per_token():
    cfg = get_model("gpt2", "124m")
    # the position table is a lookup; wte is also the head, whose matmul computes the 50,304 - 50,257 padded rows too
    matmul_params = 124_439_808 - 1024 * 768 + (50304 - 50257) * 768
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
@pytest.mark.parametrize("vocab", [{}, {"vocab_size": 61, "vocab_pad_multiple": 8}], ids=["v256", "v61"])
def test_tp_shards_are_slices_of_the_one_process_model(family, tied, vocab):
    """At tp=2 each rank's shard is its slice (along `tp_shard_dim`) of the tp=1
    weights (padded rows included), and the logits come out split over the padded vocabulary."""
    cfg = get_model(family, n_layers=2, tie_embeddings=tied, **vocab)
    specs = model_specs(cfg)
    whole = build_all(specs)
    shards = [build_all(specs, FakeGroup(2, r)) for r in range(2)]
    for i, module in enumerate(whole):
        for name, full in module.state_dict(keep_vars=True).items():
            parts = [dict(s[i].state_dict(keep_vars=True))[name] for s in shards]
            dim = getattr(parts[0], "tp_shard_dim", None)
            joined = parts[0] if dim is None else torch.cat(parts, dim=dim)
            assert torch.equal(joined, full), f"entry {i} {name}"
            if dim is None:
                assert torch.equal(parts[1], full), f"entry {i} {name}: replicated but differs on rank 1"
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    shard = run_all(specs, build_all(specs, FakeGroup(2, 1), device="meta"), ids)
    assert shard.shape == (2, 8, cfg.padded_vocab // 2)
    assert run_all(specs, whole, torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, cfg.padded_vocab)


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
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=0, schedule="1f1b", microbatches=2)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.0)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    losses = [engine.train_batch(iter([batch]), reduce_loss=True) for _ in range(20)]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(cfg.vocab_size)) < 0.5, losses[0]
    assert losses[-1] < losses[0] - 1.0, losses


# ---- vocabulary padding ------------------------------------------------------------
def test_cross_entropy_with_minus_inf_logits():
    """Masked (-inf) logits: the loss is F.cross_entropy's on the other columns, no NaN
    forward or backward, and the masked columns get zero gradient."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    logits[..., 6:] = float("-inf")
    targets = torch.randint(0, 6, (3, 5), generator=gen)
    targets[0, 0] = -100
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, targets, None)
    loss.backward()
    ref_x = logits[..., :6].clone().requires_grad_()
    ref = F.cross_entropy(ref_x.flatten(0, 1), targets.flatten())
    ref.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 1e-12
    assert torch.isfinite(x.grad).all() and not x.grad[..., 6:].any()
    assert (x.grad[..., :6] - ref_x.grad).abs().max() < 1e-12


def _strip(sd: dict, cfg) -> dict:
    return {k: v[:cfg.vocab_size] if k in vocab_tensor_names(cfg) else v for k, v in sd.items()}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_padded_model_is_the_unpadded_model(family, tied, float64):
    """61 ids in 64 rows (float64): the logits of the padded ids are -inf, the loss
    and every gradient equal those of the same weights without padding, the padded
    rows get zero gradient and do not move in an SGD step."""
    cfg = get_model(family, n_layers=1, dim=32, vocab_size=61, vocab_pad_multiple=8, tie_embeddings=tied)
    padded = pipekit.PipelineModule(model_specs(cfg), seed=0)
    plain_cfg = with_overrides(cfg, vocab_pad_multiple=1)
    plain = pipekit.PipelineModule(model_specs(plain_cfg))
    load_full_state_dict(plain, _strip(full_state_dict(padded), cfg))
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for module, c in ((padded, cfg), (plain, plain_cfg)):
        logits = module(ids[:, :-1])
        assert logits.shape[-1] == c.padded_vocab
        losses.append(model_loss(c).build()(logits, ids[:, 1:]))
        losses[-1].backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-12
    assert (padded(ids)[..., 61:] == float("-inf")).all()
    grads = _strip({n: p.grad for n, p in padded.named_parameters()}, cfg)
    for name, p in plain.named_parameters():
        assert (grads[name] - p.grad).abs().max() < 1e-12, name
    before = full_state_dict(padded)
    torch.optim.SGD(padded.parameters(), lr=0.5).step()
    after = full_state_dict(padded)
    for name in vocab_tensor_names(cfg):
        assert not dict(padded.named_parameters())[name].grad[61:].any(), name
        assert torch.equal(after[name][61:], before[name][61:]) and not torch.equal(after[name], before[name])
