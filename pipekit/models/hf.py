"""Hugging Face interchange: GPT2LMHeadModel, LlamaForCausalLM and MixtralForCausalLM weights and configs.

A pipekit *full* state dict (`pipekit.checkpoint.full_state_dict`: every
tensor whole, named as in one process) maps one-to-one onto a transformers
state dict, up to these changes:

GPT-2   HF's Conv1D stores weights as (in, out): every linear weight is
        transposed; the fused `c_attn` (D, 3D) splits into q, k, v.
        Hub checkpoints saved from `GPT2Model` lack the `transformer.` prefix
        and may hold the causal-mask buffers `attn.bias` / `attn.masked_bias`:
        both are handled on reading.
Llama   names only. HF's Llama checkpoints already use the `rotate_half`
        rotary convention (its conversion script permuted Meta's interleaved
        q/k rows once), and so does `pipekit.layers.apply_rotary`, so q_proj
        and k_proj are copied as they are (the logits tests prove it).
Mixtral attention and norms as Llama; the router `mlp.router` is HF's `mlp.gate`. The
        experts, pipekit's (E, D, H) `w_gate`, `w_up` and (E, H, D) `w_down`, are
        HF's fused `mlp.experts.gate_up_proj` (E, 2H, D: the H gate rows, then the
        H up rows, each (out, in) as F.linear takes it) and `down_proj` (E, D, H),
        transposed. Import also reads the per-expert form files hold (transformers
        < 5, and what 5.x's save_pretrained still writes): `block_sparse_moe.gate`,
        `block_sparse_moe.experts.{e}.w1` (gate, (H, D)), `.w3` (up), `.w2` (down,
        (D, H)). Export writes the fused in-memory form, which from_pretrained loads
        as it is. HF's Mixtral routes by softmax and has no shared experts: configs
        with `score="sigmoid"` or `n_shared_experts > 0` are refused both ways.

With tied embeddings `lm_head.weight` is the token table: written into the
HF state dict (as the same tensor, like `model.state_dict()`), left out of
files, and not required on reading.

Vocabulary padding: pipekit's token table and untied head have
`padded_vocab(cfg)` rows (see gpt2.py). Import appends zero rows to HF's
vocab_size rows; export drops the padded rows (whatever training left in
them: they never affect the logits), so HF -> pipekit -> HF is exact.

Files: `load_hf_checkpoint(dir)` reads config.json with model.safetensors,
pytorch_model.bin or their sharded `*.index.json` forms; `save_hf_checkpoint`
writes config.json + model.safetensors, loadable offline by
`transformers.AutoModelForCausalLM.from_pretrained` (a new dir is built under a
temporary name and renamed into place; over an existing one, only those files are
replaced, each atomically). A model pipekit saved is read by `read_saved_model`
from either of its forms: a *pipekit file* `torch.save({"family", "config":
asdict(cfg), "state_dict"})` (train's model.pt, convert's output), its state dict
padded, or a resumable checkpoint directory (`checkpoints/step_N`, or the
checkpoints root for its newest), whose full weights `pipekit.checkpoint` reads.
A file whose config predates `vocab_pad_multiple` (unpadded tables) is read with
the default multiple and padded with zero rows.
transformers is imported only by the functions that build HF config objects.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import asdict
from typing import Callable

import torch

from ..atomic import publish, publish_dir, remove, torch_save_atomic, write_atomic
from .gpt2 import GPT2Config
from .llama import LlamaConfig
from .mixtral import MixtralConfig
from .registry import FAMILIES, config_from_dict, family_of, model_specs

HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mixtral": "mixtral"}  # HF model_type -> pipekit family
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # buffers, not weights


def _check_hf_form(family: str, what: str = "this is a") -> None:
    """Refuse, in one line, a family that has no Hugging Face form (`what` names the model)."""
    if family in FAMILIES and FAMILIES[family].hf:
        return
    *others, last = [name for name, fam in FAMILIES.items() if fam.hf]
    raise ValueError(f"{what} {family!r} model, which has no Hugging Face form; "
                     f"only {', '.join(others)} and {last} models convert")


def _check_family(family: str, cfg) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid families: {sorted(FAMILIES)}")
    _check_hf_form(family)
    if family_of(cfg) != family:
        raise ValueError(f"family {family!r} was given with a {type(cfg).__name__}; they must agree")
    if family == "mixtral":
        _check_mixtral(cfg)
    if family == "gpt2" and cfg.n_experts is not None:
        raise ValueError(f"this GPT-2 has MoE blocks (n_experts={cfg.n_experts}), which Hugging Face's GPT-2 "
                         f"lacks; only dense GPT-2 models convert")


def _embed_prefix(cfg) -> str:
    return "tied.embed" if cfg.tie_embeddings else "layers.0"


# ---- GPT-2 ---------------------------------------------------------------------
def _gpt2_pairs(cfg: GPT2Config) -> list[tuple[str, str, bool]]:
    """(pipekit name, HF name, transposed) for every tensor but q/k/v, which are fused in HF."""
    L, e = cfg.n_layers, _embed_prefix(cfg)
    pairs = [(f"{e}.wte.weight", "transformer.wte.weight", False), (f"{e}.wpe.weight", "transformer.wpe.weight", False)]
    modules = (("norm1", "ln_1", False), ("norm2", "ln_2", False), ("attn.o", "attn.c_proj", True),
               ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))  # (ours, theirs, Conv1D)
    for i in range(L):
        p, h = f"layers.{i + 1}.", f"transformer.h.{i}."
        for ours, theirs, conv in modules:
            pairs.append((f"{p}{ours}.weight", f"{h}{theirs}.weight", conv))
            pairs.append((f"{p}{ours}.bias", f"{h}{theirs}.bias", False))
    pairs += [(f"layers.{L + 1}.{n}", f"transformer.ln_f.{n}", False) for n in ("weight", "bias")]
    if not cfg.tie_embeddings:
        pairs.append((f"layers.{L + 2}.weight", "lm_head.weight", False))
    return pairs


def _gpt2_from_hf(hf: dict, cfg: GPT2Config) -> dict:
    if "transformer.wte.weight" not in hf and "wte.weight" in hf:  # saved from GPT2Model
        hf = {k if k.startswith("lm_head.") else f"transformer.{k}": v for k, v in hf.items()}
    used = {"lm_head.weight"} if cfg.tie_embeddings else set()
    out = {}
    for ours, theirs, transposed in _gpt2_pairs(cfg):
        t = _take(hf, theirs, used)
        out[ours] = t.t().contiguous() if transposed else t
    for i in range(cfg.n_layers):
        h = f"transformer.h.{i}.attn.c_attn."
        w = _take(hf, h + "weight", used).t()  # Conv1D (D, 3D) -> (3D, D): rows q, k, v
        b = _take(hf, h + "bias", used)
        for name, wi, bi in zip("qkv", w.chunk(3, dim=0), b.chunk(3, dim=0)):
            out[f"layers.{i + 1}.attn.{name}.weight"] = wi.contiguous()
            out[f"layers.{i + 1}.attn.{name}.bias"] = bi.clone()
    _check_all_used(hf, used)
    return out


def _gpt2_to_hf(sd: dict, cfg: GPT2Config) -> dict:
    out = {}
    for ours, theirs, transposed in _gpt2_pairs(cfg):
        t = _get(sd, ours)
        out[theirs] = t.t().contiguous() if transposed else t
    for i in range(cfg.n_layers):
        p = f"layers.{i + 1}.attn."
        qkv = torch.cat([_get(sd, p + n + ".weight") for n in "qkv"])  # (3D, D)
        out[f"transformer.h.{i}.attn.c_attn.weight"] = qkv.t().contiguous()  # Conv1D: (D, 3D)
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([_get(sd, p + n + ".bias") for n in "qkv"])
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# ---- Llama ---------------------------------------------------------------------
_LLAMA_MLP = (("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))


def _llama_pairs(cfg: LlamaConfig | MixtralConfig, mlp: tuple = _LLAMA_MLP) -> list[tuple[str, str]]:
    """(pipekit name, HF name) of every tensor; `mlp`: the (ours, theirs) pairs of the feed-forward
    part (Mixtral's experts are mapped apart: their layouts differ)."""
    L = cfg.n_layers
    e = "tied.embed.weight" if cfg.tie_embeddings else "layers.0.weight"
    pairs = [(e, "model.embed_tokens.weight")]
    names = (("norm1", "input_layernorm"), ("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"),
             ("attn.v", "self_attn.v_proj"), ("attn.o", "self_attn.o_proj"), ("norm2", "post_attention_layernorm"),
             *mlp)
    for i in range(L):
        pairs += [(f"layers.{i + 1}.{ours}.weight", f"model.layers.{i}.{theirs}.weight") for ours, theirs in names]
    pairs.append((f"layers.{L + 1}.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append((f"layers.{L + 2}.weight", "lm_head.weight"))
    return pairs


def _llama_from_hf(hf: dict, cfg: LlamaConfig) -> dict:
    used = {"lm_head.weight"} if cfg.tie_embeddings else set()
    out = {ours: _take(hf, theirs, used) for ours, theirs in _llama_pairs(cfg)}
    _check_all_used(hf, used)
    return out


def _llama_to_hf(sd: dict, cfg: LlamaConfig) -> dict:
    out = {theirs: _get(sd, ours) for ours, theirs in _llama_pairs(cfg)}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---- Mixtral -------------------------------------------------------------------
def _check_mixtral(cfg: MixtralConfig) -> None:
    """Refuse what HF's Mixtral lacks (its routing is softmax, it has no shared experts)."""
    extras = ([f"n_shared_experts={cfg.n_shared_experts}"] if cfg.n_shared_experts else []) + \
             ([f"score={cfg.score!r}"] if cfg.score != "softmax" else [])
    if extras:
        raise ValueError(f"this Mixtral config has {' and '.join(extras)}, which Hugging Face's Mixtral lacks "
                         f"(softmax routing, no shared experts); only configs with score='softmax' and "
                         f"n_shared_experts=0 convert")


def _mixtral_experts_from_hf(hf: dict, cfg: MixtralConfig, i: int, used: set) -> dict:
    """Block i's router and experts in pipekit's names and layouts, from the fused form or
    (when the block has it) the per-expert one."""
    p, ours, H = f"model.layers.{i}.", f"layers.{i + 1}.mlp.", cfg.hidden
    old = p + "block_sparse_moe."
    if p + "mlp.experts.gate_up_proj" not in hf and old + "gate.weight" in hf:
        per = {n: torch.stack([_take(hf, f"{old}experts.{e}.{n}.weight", used).t() for e in range(cfg.n_experts)])
               for n in ("w1", "w3", "w2")}  # w1, w3: (H, D) -> (E, D, H); w2: (D, H) -> (E, H, D)
        router, gate, up, down = _take(hf, old + "gate.weight", used), per["w1"], per["w3"], per["w2"]
    else:
        router = _take(hf, p + "mlp.gate.weight", used)
        gate_up = _take(hf, p + "mlp.experts.gate_up_proj", used)  # (E, 2H, D)
        if gate_up.dim() != 3 or gate_up.shape[1] != 2 * H:
            raise ValueError(f"{p}mlp.experts.gate_up_proj has shape {tuple(gate_up.shape)}; the config needs "
                             f"(n_experts, 2 * hidden = {2 * H}, dim)")
        gate, up = gate_up.transpose(1, 2).split(H, dim=2)  # (E, D, H) each
        down = _take(hf, p + "mlp.experts.down_proj", used).transpose(1, 2)  # (E, D, H) -> (E, H, D)
    return {ours + "router.weight": router, ours + "experts.w_gate": gate.contiguous(),
            ours + "experts.w_up": up.contiguous(), ours + "experts.w_down": down.contiguous()}


def _mixtral_from_hf(hf: dict, cfg: MixtralConfig) -> dict:
    used = {"lm_head.weight"} if cfg.tie_embeddings else set()
    out = {ours: _take(hf, theirs, used) for ours, theirs in _llama_pairs(cfg, mlp=())}
    for i in range(cfg.n_layers):
        out.update(_mixtral_experts_from_hf(hf, cfg, i, used))
    _check_all_used(hf, used)
    return out


def _mixtral_to_hf(sd: dict, cfg: MixtralConfig) -> dict:
    """The fused form of transformers >= 5 (what MixtralForCausalLM holds in memory)."""
    out = {theirs: _get(sd, ours) for ours, theirs in _llama_pairs(cfg, mlp=(("mlp.router", "mlp.gate"),))}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i + 1}.mlp.experts.", f"model.layers.{i}.mlp.experts."
        gate_up = torch.cat([_get(sd, ours + "w_gate"), _get(sd, ours + "w_up")], dim=2)  # (E, D, 2H)
        out[theirs + "gate_up_proj"] = gate_up.transpose(1, 2).contiguous()  # (E, 2H, D)
        out[theirs + "down_proj"] = _get(sd, ours + "w_down").transpose(1, 2).contiguous()  # (E, D, H)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---- vocabulary padding --------------------------------------------------------
def vocab_tensor_names(cfg) -> list[str]:
    """The pipekit tensors with one row per token id: the token table, and the untied head."""
    table = f"{_embed_prefix(cfg)}.wte.weight" if family_of(cfg) == "gpt2" else f"{_embed_prefix(cfg)}.weight"
    return [table] if cfg.tie_embeddings else [table, f"layers.{cfg.n_layers + 2}.weight"]


def _pad_vocab(sd: dict, cfg) -> dict:
    """`sd` with its vocab tensors of exactly `vocab_size` rows grown to `padded_vocab(cfg)` by zero rows."""
    out = dict(sd)
    for name in vocab_tensor_names(cfg):
        t = out.get(name)
        if t is not None and t.shape[0] == cfg.vocab_size < cfg.padded_vocab:
            out[name] = torch.cat([t, t.new_zeros(cfg.padded_vocab - cfg.vocab_size, *t.shape[1:])])
    return out


def _strip_vocab(sd: dict, cfg) -> dict:
    """`sd` (padded, shapes checked) with its vocab tensors cut to `vocab_size` rows (copies)."""
    if cfg.padded_vocab == cfg.vocab_size:
        return sd
    return {**sd, **{name: sd[name][: cfg.vocab_size].clone() for name in vocab_tensor_names(cfg)}}


# ---- helpers -------------------------------------------------------------------
def _take(hf: dict, name: str, used: set) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"the Hugging Face state dict lacks {name!r} (it has {len(hf)} tensors, e.g. {sorted(hf)[:3]})")
    used.add(name)
    return hf[name]


def _get(sd: dict, name: str) -> torch.Tensor:
    if name not in sd:
        raise KeyError(f"the pipekit state dict lacks {name!r} (it has {len(sd)} tensors, e.g. {sorted(sd)[:3]}); "
                       "is the config the one the weights were trained with?")
    return sd[name]


def _check_all_used(hf: dict, used: set) -> None:
    extra = sorted(k for k in hf if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"the Hugging Face state dict has {len(extra)} tensors this config does not use, "
                         f"e.g. {extra[:5]}; does the config match the checkpoint?")


def _check_shapes(sd: dict, cfg, family: str) -> None:
    """Compare every tensor with the shape the spec list builds (on meta, tp=1)."""
    expected = {}
    specs = model_specs(cfg)
    tied: set[str] = set()
    for i, spec in enumerate(specs):
        key = getattr(spec, "key", None)
        if key is not None:
            if key in tied:
                continue
            tied.add(key)
            prefix = f"tied.{key}."
        else:
            prefix = f"layers.{i}."
        for name, t in spec.build(device="meta").state_dict().items():
            expected[prefix + name] = tuple(t.shape)
    if set(expected) != set(sd):
        missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
        raise ValueError(f"{family} state dict does not match the config: "
                         f"missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{name}: the config gives shape {shape}, the weights have {tuple(sd[name].shape)}")


_FROM_HF: dict[str, Callable] = {"gpt2": _gpt2_from_hf, "llama": _llama_from_hf, "mixtral": _mixtral_from_hf}
_TO_HF: dict[str, Callable] = {"gpt2": _gpt2_to_hf, "llama": _llama_to_hf, "mixtral": _mixtral_to_hf}


def from_hf_state_dict(family: str, hf_sd: dict, cfg) -> dict[str, torch.Tensor]:
    """A transformers state dict -> a pipekit full state dict for `cfg` (vocab padded, shapes checked)."""
    _check_family(family, cfg)
    out = _pad_vocab(_FROM_HF[family](hf_sd, cfg), cfg)
    _check_shapes(out, cfg, family)
    return out


def to_hf_state_dict(family: str, full_sd: dict, cfg) -> dict[str, torch.Tensor]:
    """A pipekit full state dict (padded) -> the state dict of GPT2LMHeadModel / LlamaForCausalLM /
    MixtralForCausalLM (vocab_size rows: the padded ones dropped)."""
    _check_family(family, cfg)
    _check_shapes(full_sd, cfg, family)
    return _TO_HF[family](_strip_vocab(full_sd, cfg), cfg)


# ---- configs -------------------------------------------------------------------
def config_from_hf(hf_config) -> GPT2Config | LlamaConfig | MixtralConfig:
    """A transformers config (object, or config.json as a dict) -> GPT2Config / LlamaConfig / MixtralConfig.

    Raises a ValueError for architecture options pipekit does not implement."""
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    model_type = d.get("model_type")
    build = {"gpt2": _gpt2_config_from_hf, "llama": _llama_config_from_hf,
             "mixtral": _mixtral_config_from_hf}.get(model_type)
    if build is None:
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: {sorted(HF_MODEL_TYPES)}")
    try:
        return build(d)
    except KeyError as e:
        raise ValueError(f"the Hugging Face {model_type} config lacks {e.args[0]!r}") from e


def _require(d: dict, checks: dict[str, tuple]) -> None:
    for key, (default, allowed) in checks.items():
        value = d.get(key, default)
        if value not in allowed:
            raise ValueError(f"Hugging Face config has {key}={value!r}; pipekit supports only {list(allowed)}")


def _gpt2_config_from_hf(d: dict) -> GPT2Config:
    _require(d, {
        "activation_function": ("gelu_new", ("gelu_new", "gelu_pytorch_tanh")),
        "scale_attn_weights": (True, (True,)),
        "scale_attn_by_inverse_layer_idx": (False, (False,)),
    })
    if d.get("n_inner") not in (None, 4 * d["n_embd"]):
        raise ValueError(f"Hugging Face config has n_inner={d['n_inner']}; "
                         f"pipekit's GPT-2 MLP is 4*n_embd={4 * d['n_embd']}")
    return GPT2Config(vocab_size=d["vocab_size"], max_seq_len=d["n_positions"], n_layers=d["n_layer"],
                      dim=d["n_embd"], n_heads=d["n_head"], norm_eps=d.get("layer_norm_epsilon", 1e-5),
                      tie_embeddings=d.get("tie_word_embeddings", True), init_std=d.get("initializer_range", 0.02))


def _llama_config_from_hf(d: dict) -> LlamaConfig:
    return LlamaConfig(**_llama_fields(d, theta=10000.0, eps=1e-6))


def _llama_fields(d: dict, theta: float, eps: float) -> dict:
    """The config fields Llama and Mixtral share; `theta`, `eps`: transformers' defaults for the family."""
    _require(d, {"hidden_act": ("silu", ("silu",)), "attention_bias": (False, (False,)), "mlp_bias": (False, (False,))})
    rope = d.get("rope_parameters") or {}  # transformers >= 5
    scaling = d.get("rope_scaling") or {}  # older config.json files
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"Hugging Face config has rope type {rope_type!r}; "
                         "pipekit supports only unscaled rope ('default')")
    dim, heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"Hugging Face config has head_dim={d['head_dim']}; "
                         f"pipekit needs hidden_size/num_attention_heads = {dim // heads}")
    theta = rope.get("rope_theta", d.get("rope_theta", theta))
    return dict(vocab_size=d["vocab_size"], max_seq_len=d["max_position_embeddings"], n_layers=d["num_hidden_layers"],
                dim=dim, n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads, hidden=d["intermediate_size"],
                norm_eps=d.get("rms_norm_eps", eps), rope_theta=float(theta),
                tie_embeddings=d.get("tie_word_embeddings", False), init_std=d.get("initializer_range", 0.02))


def _mixtral_config_from_hf(d: dict) -> MixtralConfig:
    if d.get("sliding_window") is not None:
        raise ValueError(f"Hugging Face config has sliding_window={d['sliding_window']!r}; pipekit has no "
                         "sliding-window attention (only null converts)")
    if d.get("router_jitter_noise"):
        raise ValueError(f"Hugging Face config has router_jitter_noise={d['router_jitter_noise']!r}; pipekit's "
                         "Mixtral routes without input jitter (only 0 converts)")
    fields = _llama_fields(d, theta=1000000.0, eps=1e-5)
    top_k = d["num_experts_per_tok"]
    coef = _scaled(d.get("router_aux_loss_coef", 0.001), top_k / fields["n_layers"])
    return MixtralConfig(**fields, n_experts=d["num_local_experts"], top_k=top_k, aux_loss_coef=coef)


def _scaled(coef: float, factor: float) -> float:
    """`coef * factor` to 12 significant digits, so that a round trip gives the number back."""
    return float(f"{coef * factor:.12g}")


def _token_id(default: int, vocab_size: int) -> int | None:
    return default if default < vocab_size else None


def hf_config_from(cfg):
    """GPT2Config / LlamaConfig / MixtralConfig -> the matching transformers config object.

    Router loss: pipekit attaches `aux_loss_coef * aux_l` in every block l, aux_l = E * sum_i
    f_li P_li with f counted per token-slot (pipekit.moe.router); HF adds one
    `router_aux_loss_coef * aux_HF`, aux_HF = E * sum_i F_i P_i over the layer means F_i (top-k
    assignments per token, summing to top_k) and P_i, so aux_HF = top_k * aux_l for one layer.
    The two give the router of every block the same gradient when the layers' loads agree,
    and the same loss value with one layer, at
        aux_loss_coef = router_aux_loss_coef * top_k / n_layers,
    the conversion both ways (to 12 significant digits). `output_router_logits` is written
    False (HF's default: it then trains without the term unless asked) and not read;
    `z_loss_coef` and `capacity_factor` have no HF form: export is dropless, without z-loss."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("writing a Hugging Face model needs transformers: pip install transformers",
                          name="transformers") from e

    family = family_of(cfg)
    _check_hf_form(family)
    if family == "gpt2":
        eos = _token_id(50256, cfg.vocab_size)
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.dim, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
            bos_token_id=eos, eos_token_id=eos, architectures=["GPT2LMHeadModel"],
        )
    common = dict(
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len, hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.dim // cfg.n_heads, intermediate_size=cfg.hidden, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        bos_token_id=_token_id(1, cfg.vocab_size), eos_token_id=_token_id(2, cfg.vocab_size),
    )
    if family == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False,
                                        architectures=["LlamaForCausalLM"])
    _check_mixtral(cfg)
    return transformers.MixtralConfig(
        **common, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=_scaled(cfg.aux_loss_coef, cfg.n_layers / cfg.top_k), router_jitter_noise=0.0,
        output_router_logits=False, sliding_window=None, architectures=["MixtralForCausalLM"],
    )


# ---- files ---------------------------------------------------------------------
def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model dir: (sharded) safetensors preferred, else (sharded) pytorch_model.bin."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        files = [single] if os.path.exists(os.path.join(path, single)) else []
        if not files and os.path.exists(os.path.join(path, index)):
            files = sorted(set(_read_json(os.path.join(path, index), "weight_map")["weight_map"].values()))
        if files:
            out: dict[str, torch.Tensor] = {}
            for name in files:
                out.update(_read_file(os.path.join(path, name)))
            return out
    raise FileNotFoundError(f"{path} holds no model.safetensors, pytorch_model.bin or their .index.json")


def _read_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one weights file; a missing, truncated or foreign file is a one-line error."""
    import pickle

    from safetensors import SafetensorError

    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path} is missing (named by the model dir's .index.json)")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"weights file {path} is not readable: truncated, corrupt or not a weights file "
                         f"({type(e).__name__} while reading it)") from e


def _read_json(path: str, *keys: str) -> dict:
    """A JSON object file that has `keys`; anything else is a one-line error naming the file."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    return obj


def load_hf_checkpoint(path: str):
    """Read a HF model dir -> (family, config, pipekit full state dict)."""
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"{path} {what}; give a Hugging Face model dir (config.json and weights)")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face model dir: it has no config.json")
    cfg = config_from_hf(_read_json(config_path))
    family = family_of(cfg)
    return family, cfg, from_hf_state_dict(family, _read_weights(path), cfg)


def _unshared(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no storage (what safetensors requires)."""
    seen: set[int] = set()
    out = {}
    for name, t in sd.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")  # transformers' names for a sharded export
_INDEX = "model.safetensors.index.json"


def save_hf_checkpoint(family: str, full_sd: dict, cfg, out_dir: str, *, overwrite: bool = False,
                       dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors for `full_sd` into `out_dir`.

    A new `out_dir` is built under a temporary name and renamed into place whole. An
    existing non-empty one is refused unless `overwrite`; then only the files written
    here are replaced, each atomically (model.safetensors, then config.json), and the
    index and shards of an earlier sharded export are removed, so the dir holds one
    set of weights; every other file (a README, tokenizer files) is left as it is. A
    crash between two files can leave new weights beside the old config.json: a rerun
    completes it. `dtype` casts floating tensors (None: keep)."""
    hf_sd = to_hf_state_dict(family, full_sd, cfg)
    if cfg.tie_embeddings:
        hf_sd.pop("lm_head.weight")  # tied to the token table; transformers re-ties it on loading
    if dtype is not None:
        hf_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_sd.items()}
    out_dir = os.path.abspath(out_dir)
    check_hf_out_dir(out_dir, overwrite)
    hf_config = hf_config_from(cfg)
    floats = [v.dtype for v in hf_sd.values() if v.is_floating_point()]
    if floats:
        hf_config.dtype = str(floats[0]).removeprefix("torch.")
    if os.path.isdir(out_dir):
        _write_hf_files(out_dir, hf_config, hf_sd)
        return
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed process of the same id
    os.mkdir(tmp)
    try:
        _write_hf_files(tmp, hf_config, hf_sd)
        publish_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_hf_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse an `out_dir` that is a file, or a non-empty dir without `overwrite`."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} is a file; give a directory for the Hugging Face model")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace "
                              f"the model files in it (config.json, model.safetensors; other files are kept)")


def _write_hf_files(out_dir: str, hf_config, hf_sd: dict) -> None:
    _save_safetensors(_unshared(hf_sd), os.path.join(out_dir, "model.safetensors"))
    _remove_sharded_weights(out_dir)
    write_atomic(os.path.join(out_dir, "config.json"), hf_config.to_json_string())


def _save_safetensors(sd: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, atomically. It writes only to a file name (its in-memory `save`
    would hold a second copy of the weights), so it writes a temporary name beside `path`,
    which `pipekit.atomic.publish` renames into place."""
    from safetensors.torch import save_file

    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        save_file(sd, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        publish(tmp, path)
    finally:
        remove(tmp)


def _remove_sharded_weights(out_dir: str) -> None:
    """Remove an earlier sharded export from `out_dir`: model.safetensors.index.json (first, so
    no reader follows it to a missing shard), then the shards it names and any
    model-NNNNN-of-NNNNN.safetensors. Only safetensors files directly in `out_dir` go."""
    index = os.path.join(out_dir, _INDEX)
    shards = {n for n in os.listdir(out_dir) if _SHARD.match(n)}
    if os.path.isfile(index):
        try:
            named = _read_json(index, "weight_map")["weight_map"].values()
        except (OSError, ValueError):
            named = []
        shards |= {n for n in named if isinstance(n, str) and n == os.path.basename(n) and n.endswith(".safetensors")}
        remove(index)
    for n in sorted(shards - {"model.safetensors"}):
        remove(os.path.join(out_dir, n))


def save_pipekit_file(family: str, cfg, full_sd: dict, path: str) -> None:
    """torch.save({"family", "config", "state_dict"}) to `path`, atomically."""
    torch_save_atomic({"family": family, "config": asdict(cfg), "state_dict": full_sd}, path)


# ---- a model pipekit saved: model.pt, or a resumable checkpoint --------------------------
def read_saved_model(path: str) -> dict:
    """A model pipekit saved, as the dict of a model.pt ("family", "config", "state_dict",
    "tokenizer" where train wrote it), read from any of its forms:

    a file           a pipekit file (train's model.pt, `convert --from-hf`'s output);
    a checkpoint     a resumable checkpoint dir (`checkpoints/step_N`): its full weights,
                     its pipekit.json under "checkpoint" and its path under "path";
    a root           a dir of checkpoints: its newest complete one, as above.

    Anything else is a one-line error (ValueError or OSError). Checkpoints are read by
    `pipekit.checkpoint` (imported here only: the model zoo stays below the runtime)."""
    if not os.path.isdir(path):
        return read_model_file(path)
    from ..checkpoint import CheckpointError, load_full_weights

    ckpt = checkpoint_dir(path)
    meta, sd = load_full_weights(ckpt)
    if not isinstance(meta.get("family"), str) or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{ckpt}/pipekit.json lacks the model's family and model_config (it was not "
                              f"written by pipekit train)")
    return {"family": meta["family"], "config": meta["model_config"], "state_dict": sd, "checkpoint": meta,
            "path": ckpt}


def checkpoint_dir(path: str) -> str:
    """The checkpoint the directory `path` names: itself, when it is one (an incomplete one
    is a CheckpointError saying what it lacks), or the newest complete checkpoint in it,
    when it is a checkpoints root. Any other directory is an IsADirectoryError."""
    from ..checkpoint import META, CheckpointError, latest_checkpoint, read_meta

    names = os.listdir(path)
    if META in names or ".metadata" in names or re.match(r"step_\d+", os.path.basename(os.path.normpath(path))):
        read_meta(path)  # raises for an incomplete or unreadable one
        return path
    steps = [n for n in names if n.startswith("step_")]
    if steps:
        newest = latest_checkpoint(path)
        if newest is None:
            raise CheckpointError(f"{path} holds no complete checkpoint ({len(steps)} incomplete: "
                                  f"{', '.join(sorted(steps)[:3])}); an interrupted save leaves such a directory")
        return newest
    run = [os.path.join(path, n) for n in ("model.pt", "checkpoints") if n in names]
    if run:
        raise IsADirectoryError(f"{path} is a directory, but not a checkpoint: it holds a run; give {' or '.join(run)}")
    raise IsADirectoryError(f"{path} is a directory, but neither a pipekit checkpoint (a directory holding {META}, "
                            f"such as checkpoints/step_00000100) nor a checkpoints root; give one, or a model.pt")


def read_model_file(path: str) -> dict:
    """The dict of a pipekit model file (`model.pt`: family, config, state_dict, ...), read
    safely (weights only); a missing, truncated or foreign file is a one-line error."""
    import pickle

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such pipekit file or checkpoint: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give a model.pt written by pipekit train or convert")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"{path} is not a readable pipekit model file: truncated, corrupt or not written by "
                         f"pipekit ({type(e).__name__} while reading it)") from e
    if not isinstance(obj, dict) or not {"family", "config", "state_dict"} <= set(obj):
        raise ValueError(f"{path} is not a pipekit model file (a dict with 'family', 'config', 'state_dict')")
    return obj


def load_pipekit_file(path: str):
    """Read a model pipekit saved (`read_saved_model`: a model.pt or a checkpoint) ->
    (family, config, full state dict)."""
    obj = read_saved_model(path)
    _check_hf_form(obj["family"], f"{obj.get('path', path)} holds a")
    cfg = config_from_dict(obj["family"], obj["config"])
    sd = obj["state_dict"]
    if "vocab_pad_multiple" not in obj["config"]:  # written before vocab padding: tables of vocab_size rows
        sd = _pad_vocab(sd, cfg)
    return obj["family"], cfg, sd


def convert(src: str, dst: str, direction: str, *, overwrite: bool = False, dtype: torch.dtype | None = None) -> None:
    """`direction="from_hf"`: HF model dir `src` -> pipekit file `dst`;
    `"to_hf"`: a model pipekit saved (`read_saved_model`: a model.pt, a checkpoint dir or a
    checkpoints root) `src` -> HF model dir `dst` (`save_hf_checkpoint`)."""
    if direction == "from_hf":
        if os.path.isdir(dst):
            raise IsADirectoryError(f"{dst} is a directory; give the pipekit file to write, e.g. {dst}/model.pt")
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
        family, cfg, sd = load_hf_checkpoint(src)
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        save_pipekit_file(family, cfg, sd, dst)
    elif direction == "to_hf":
        check_hf_out_dir(dst, overwrite)  # before reading what may be a large checkpoint
        family, cfg, sd = load_pipekit_file(src)
        save_hf_checkpoint(family, sd, cfg, dst, overwrite=overwrite, dtype=dtype)
    else:
        raise ValueError(f"unknown conversion direction {direction!r}; valid: 'from_hf', 'to_hf'")


# ---- command line --------------------------------------------------------------
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_convert_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `pipekit convert`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="a Hugging Face model dir (config.json + weights)")
    src.add_argument("--to-hf", metavar="MODEL", help="a model pipekit saved: a model.pt, a checkpoint dir "
                     "(checkpoints/step_N) or a checkpoints root (its newest complete checkpoint)")
    parser.add_argument("--out", required=True, help="the pipekit file (--from-hf) or HF model dir (--to-hf) to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast floating weights (default: keep)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file, or the model files in an existing --out dir "
                             "(other files in it are kept)")


def run_convert(args: argparse.Namespace) -> int:
    """Run `pipekit convert`; 0 on success, 2 with a message on stderr for bad input."""
    direction, src = ("from_hf", args.from_hf) if args.from_hf else ("to_hf", args.to_hf)
    try:
        convert(src, args.out, direction, overwrite=args.overwrite, dtype=_DTYPES.get(args.dtype))
    except ImportError as e:
        if e.name != "transformers":
            raise
        print(f"pipekit convert: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as e:
        said = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) quotes its message
        print(f"pipekit convert: {said}", file=sys.stderr)
        return 2
    print(f"pipekit convert: wrote {args.out}")
    return 0
