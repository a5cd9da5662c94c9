"""Hugging Face mapping: GPT-2, Llama, Mixtral and their kin: names, layouts and configs.

transformers' model_type -> pipekit family: gpt2 -> gpt2; llama, mistral, qwen2, qwen3 -> llama
(Llama 3.1's scaled rope, Qwen2's q/k/v biases, Qwen3's q/k head norms and head_dim are
LlamaConfig fields); mixtral, qwen3_moe -> mixtral (`HF_MODEL_TYPES`). Export writes
Qwen3 / Qwen2 / Qwen3-MoE where the config has their features, Llama or Mixtral otherwise
(a Mistral comes back as a Llama: the same tensors and math).

One adapter per family, in the manner of torchtitan's state-dict adapters:
`hf_adapter(cfg)` gives the family's `StateDictAdapter` for one config, whose
`to_hf(state_dict)` / `from_hf(hf_state_dict)` translate a pipekit *full* state
dict (every tensor whole, named as in one process; `pipekit.checkpoint.
full_state_dict`) to and from a transformers state dict, and whose `hf_config()`
/ `config_from_hf(d)` translate the configs. Here are tensors and dicts only:
reading and writing model files is `pipekit.interchange`, on the runtime side.

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
        (D, H)). Export gives the fused in-memory form, which from_pretrained loads
        as it is. HF's Mixtral routes by softmax and has no shared experts: configs
        with `score="sigmoid"` or `n_shared_experts > 0` are refused both ways.
        Qwen3-MoE: the same fused names in memory; on disk (save_pretrained) one
        `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj` per expert, read too.

With tied embeddings `lm_head.weight` is the token table: given in the HF state
dict (as the same tensor, like `model.state_dict()`) and not required on reading.

Vocabulary padding: pipekit's token table and untied head have
`padded_vocab(cfg)` rows (see common.py). Import appends zero rows to HF's
vocab_size rows; export drops the padded rows (whatever training left in
them: they never affect the logits), so HF -> pipekit -> HF is exact.
transformers is imported only by `hf_config()`, which builds its config objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..layers.rotary import rope_scaling_of
from .gpt2 import GPT2Config
from .llama import LlamaConfig
from .mixtral import MixtralConfig
from .registry import FAMILIES, family_of, model_specs

_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # buffers, not weights


class StateDictAdapter:
    """A family's translation to and from transformers, for one config `cfg`.

    `from_hf` takes transformers' names and layouts (vocab_size rows) and gives
    pipekit's (padded, shapes checked against the spec list); `to_hf` the reverse.
    A subclass names its token table, refuses in `check` what
    HF's model lacks, and maps the tensors in `_from_hf` (reading each by `hf.take`)
    and `_to_hf`. Constructing an adapter runs `check`."""

    embed: str  # the token table in the HF state dict (what a tied lm_head is)
    table: str  # the token table's tensor inside pipekit's embedding layer

    def __init__(self, cfg):
        self.cfg = cfg
        self.check()
        self._shapes: dict | None = None  # expected_shapes(cfg), made once when first needed

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The pipekit tensors of `cfg` and their shapes (tp=1)."""
        if self._shapes is None:
            self._shapes = expected_shapes(self.cfg)
        return self._shapes

    def check(self) -> None:
        """Raise a one-line ValueError for a config HF's model cannot hold (default: none)."""

    def from_hf(self, hf_state_dict, names=None) -> dict[str, torch.Tensor]:
        """A transformers state dict -> a pipekit full state dict (vocab padded, shapes checked).

        `names`, when given, are the pipekit tensors wanted: only the HF tensors they come from
        are read (`hf_state_dict` may be a mapping that reads each tensor from its file when it
        is asked for), and the result holds those tensors alone."""
        hf = _Taken(hf_state_dict, {"lm_head.weight"} if self.cfg.tie_embeddings else (), names)
        out = self._from_hf(hf)
        if names is None:
            hf.check_all_used()
        out = pad_vocab(out, self.cfg)
        check_shapes(out, self.cfg, partial=names is not None, expected=self.shapes())
        return out

    def to_hf(self, state_dict: dict) -> dict[str, torch.Tensor]:
        """A pipekit full state dict (padded) -> the transformers one (vocab_size rows)."""
        check_shapes(state_dict, self.cfg, expected=self.shapes())
        out = self._to_hf(strip_vocab(state_dict, self.cfg))
        if self.cfg.tie_embeddings:
            out["lm_head.weight"] = out[self.embed]
        return out

    def renamed(self, hf_state_dict) -> dict[str, tuple[str, bool]]:
        """{pipekit name: (HF name, transposed)} of the tensors that are one HF tensor under
        another name, perhaps transposed (what a loader may read straight into place); the
        others (fused, stacked) only `from_hf` makes. Default: none."""
        return {}

    def fused(self) -> dict[str, tuple[str, bool, int, int]]:
        """{pipekit name: (HF name, transposed, j, n)} of the tensors HF fuses with others: the
        pipekit tensor is part j of n along dim 0 of the HF tensor in pipekit's layout
        (transposed back first if `transposed`), the parts as long as their pipekit tensors
        (GPT-2's three equal ones; Phi-3's q, k, v with grouped-query heads are not). Default: none."""
        return {}

    def _from_hf(self, hf: _Taken) -> dict:
        raise NotImplementedError

    def _to_hf(self, sd: dict) -> dict:
        raise NotImplementedError

    @classmethod
    def config_from_hf(cls, d: dict) -> GPT2Config | LlamaConfig | MixtralConfig:
        """A transformers config.json (dict) -> this family's pipekit config."""
        raise NotImplementedError

    def hf_config(self):
        """The transformers config object of `cfg`."""
        raise NotImplementedError

    @classmethod
    def vocab_names(cls, cfg) -> list[str]:
        """The pipekit tensors with one row per token id: the token table, and the untied head."""
        table = f"{embed_prefix(cfg)}.{cls.table}"
        return [table] if cfg.tie_embeddings else [table, f"layers.{cfg.n_layers + 2}.weight"]


# ---- GPT-2 ---------------------------------------------------------------------
class GPT2Adapter(StateDictAdapter):
    """GPT2LMHeadModel: Conv1D weights transposed, q, k, v fused into `c_attn`; dense models only."""

    embed, table = "transformer.wte.weight", "wte.weight"
    modules = (("norm1", "ln_1", False), ("norm2", "ln_2", False), ("attn.o", "attn.c_proj", True),
               ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))  # (ours, theirs, Conv1D)

    def check(self) -> None:
        if self.cfg.n_experts is not None:
            raise ValueError(f"this GPT-2 has MoE blocks (n_experts={self.cfg.n_experts}), which Hugging Face's "
                             f"GPT-2 lacks; only dense GPT-2 models convert")

    def _pairs(self) -> list[tuple[str, str, bool]]:
        """(pipekit name, HF name, transposed) for every tensor but q/k/v, which are fused in HF."""
        L, e = self.cfg.n_layers, embed_prefix(self.cfg)
        pairs = [(f"{e}.wte.weight", self.embed, False), (f"{e}.wpe.weight", "transformer.wpe.weight", False)]
        for i in range(L):
            p, h = f"layers.{i + 1}.", f"transformer.h.{i}."
            for ours, theirs, conv in self.modules:
                pairs.append((f"{p}{ours}.weight", f"{h}{theirs}.weight", conv))
                pairs.append((f"{p}{ours}.bias", f"{h}{theirs}.bias", False))
        pairs += [(f"layers.{L + 1}.{n}", f"transformer.ln_f.{n}", False) for n in ("weight", "bias")]
        if not self.cfg.tie_embeddings:
            pairs.append((f"layers.{L + 2}.weight", "lm_head.weight", False))
        return pairs

    def renamed(self, hf_state_dict) -> dict[str, tuple[str, bool]]:
        bare = self.embed not in hf_state_dict and "wte.weight" in hf_state_dict  # saved from GPT2Model
        return {ours: (theirs.removeprefix("transformer.") if bare else theirs, conv)
                for ours, theirs, conv in self._pairs()}

    def fused(self) -> dict[str, tuple[str, bool, int, int]]:
        """q, k, v: chunks 0, 1, 2 of the rows of `c_attn` (a Conv1D: its weight transposed)."""
        out = {}
        for i in range(self.cfg.n_layers):
            h = f"transformer.h.{i}.attn.c_attn."
            for j, name in enumerate("qkv"):
                out[f"layers.{i + 1}.attn.{name}.weight"] = (h + "weight", True, j, 3)
                out[f"layers.{i + 1}.attn.{name}.bias"] = (h + "bias", False, j, 3)
        return out

    def from_hf(self, hf_state_dict, names=None) -> dict[str, torch.Tensor]:
        """As the base, also reading a state dict saved from `GPT2Model` (no `transformer.` prefix)."""
        if self.embed not in hf_state_dict and "wte.weight" in hf_state_dict:
            hf_state_dict = _Prefixed(hf_state_dict, "transformer.", keep=("lm_head.",))
        return super().from_hf(hf_state_dict, names)

    def _from_hf(self, hf: _Taken) -> dict:
        out = {}
        for ours, theirs, transposed in self._pairs():
            if hf.wants(ours):
                t = hf.take(theirs)
                out[ours] = t.t().contiguous() if transposed else t
        for i in range(self.cfg.n_layers):
            if not any(hf.wants(f"layers.{i + 1}.attn.{n}.{w}") for n in "qkv" for w in ("weight", "bias")):
                continue
            h = f"transformer.h.{i}.attn.c_attn."
            w = hf.take(h + "weight").t()  # Conv1D (D, 3D) -> (3D, D): rows q, k, v
            b = hf.take(h + "bias")
            for name, wi, bi in zip("qkv", w.chunk(3, dim=0), b.chunk(3, dim=0)):
                out[f"layers.{i + 1}.attn.{name}.weight"] = wi.contiguous()
                out[f"layers.{i + 1}.attn.{name}.bias"] = bi.clone()
        return out

    def _to_hf(self, sd: dict) -> dict:
        out = {}
        for ours, theirs, transposed in self._pairs():
            out[theirs] = sd[ours].t().contiguous() if transposed else sd[ours]
        for i in range(self.cfg.n_layers):
            p = f"layers.{i + 1}.attn."
            qkv = torch.cat([sd[p + n + ".weight"] for n in "qkv"])  # (3D, D)
            out[f"transformer.h.{i}.attn.c_attn.weight"] = qkv.t().contiguous()  # Conv1D: (D, 3D)
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([sd[p + n + ".bias"] for n in "qkv"])
        return out

    @classmethod
    def config_from_hf(cls, d: dict) -> GPT2Config:
        """A GPT-2 config.json (dict) -> GPT2Config; options pipekit lacks raise a ValueError."""
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

    def hf_config(self):
        """The transformers.GPT2Config of `cfg`."""
        cfg, eos = self.cfg, _token_id(50256, self.cfg.vocab_size)
        return _transformers().GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.dim, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
            bos_token_id=eos, eos_token_id=eos, architectures=["GPT2LMHeadModel"],
        )


# ---- Llama ---------------------------------------------------------------------
class LlamaAdapter(StateDictAdapter):
    """LlamaForCausalLM: the same tensors under other names."""

    embed, table = "model.embed_tokens.weight", "weight"
    defaults = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}  # transformers' defaults for config.json keys
    mlp = (("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))

    def _pairs(self, mlp: tuple) -> list[tuple[str, str]]:
        """(pipekit name, HF name) of every tensor; `mlp`: the (ours, theirs) pairs of the
        feed-forward part (Mixtral's experts are mapped apart: their layouts differ)."""
        L, cfg = self.cfg.n_layers, self.cfg
        pairs = [(f"{embed_prefix(cfg)}.weight", self.embed)]
        names = (("norm1", "input_layernorm"), ("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"),
                 ("attn.v", "self_attn.v_proj"), ("attn.o", "self_attn.o_proj"),
                 ("norm2", "post_attention_layernorm"), *mlp)
        names += (("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")) if cfg.qk_norm else ()
        biases = (("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"),
                  ("attn.v", "self_attn.v_proj")) if cfg.qkv_bias else ()
        for i in range(L):
            pairs += [(f"layers.{i + 1}.{ours}.weight", f"model.layers.{i}.{theirs}.weight") for ours, theirs in names]
            pairs += [(f"layers.{i + 1}.{ours}.bias", f"model.layers.{i}.{theirs}.bias") for ours, theirs in biases]
        pairs.append((f"layers.{L + 1}.weight", "model.norm.weight"))
        if not cfg.tie_embeddings:
            pairs.append((f"layers.{L + 2}.weight", "lm_head.weight"))
        return pairs

    def renamed(self, hf_state_dict) -> dict[str, tuple[str, bool]]:
        fused = self.fused()
        return {ours: (theirs, False) for ours, theirs in self._pairs(self.mlp) if ours not in fused}

    def fused(self) -> dict[str, tuple[str, bool, int, int]]:
        """Phi-3's: q, k, v the parts 0, 1, 2 of `qkv_proj`'s rows, gate and up 0, 1 of `gate_up_proj`'s."""
        if self.cfg.hf_model_type != "phi3":
            return {}
        llama_names = {theirs: ours for ours, theirs in self._pairs(self.mlp)}
        out = {}
        for i in range(self.cfg.n_layers):
            for fused, parts in self._splits().items():
                for j, (part, _) in enumerate(parts):
                    ours = llama_names[f"model.layers.{i}.{part}.weight"]
                    out[ours] = (f"model.layers.{i}.{fused}.weight", False, j, len(parts))
        return out

    def _from_hf(self, hf: _Taken) -> dict:
        parts = self._unfused(hf)
        return {ours: parts[ours] if ours in parts else hf.take(theirs)
                for ours, theirs in self._pairs(self.mlp) if hf.wants(ours)}

    def _to_hf(self, sd: dict) -> dict:
        out = {theirs: sd[ours] for ours, theirs in self._pairs(self.mlp)}
        return self._fused(out) if self.cfg.hf_model_type == "phi3" else out

    def _splits(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Phi-3's fused tensors: {its name in a block: ((the Llama name, rows), ...)} in row order."""
        cfg = self.cfg
        hd, H = cfg.attn_head_dim, cfg.hidden
        kv = cfg.n_kv_heads * hd
        return {"self_attn.qkv_proj": (("self_attn.q_proj", cfg.n_heads * hd), ("self_attn.k_proj", kv),
                                       ("self_attn.v_proj", kv)),
                "mlp.gate_up_proj": (("mlp.gate_proj", H), ("mlp.up_proj", H))}

    def _unfused(self, hf: _Taken) -> dict:
        """The pipekit tensors cut out of Phi-3's fused q/k/v and gate/up weights, where `hf` has them."""
        llama_names = {theirs: ours for ours, theirs in self._pairs(self.mlp)}
        out: dict[str, torch.Tensor] = {}
        for i in range(self.cfg.n_layers):
            for fused, parts in self._splits().items():
                name = f"model.layers.{i}.{fused}.weight"
                wanted = [llama_names[f"model.layers.{i}.{part}.weight"] for part, _ in parts]
                if name not in hf or not any(hf.wants(w) for w in wanted):
                    continue
                t = hf.take(name)
                rows = [n for _, n in parts]
                if t.dim() != 2 or t.shape[0] != sum(rows):
                    raise ValueError(f"{name} has shape {tuple(t.shape)}; the config needs ({sum(rows)}, dim)")
                out.update(zip(wanted, (c.contiguous() for c in t.split(rows))))
        return out

    def _fused(self, hf_sd: dict) -> dict:
        """A Llama-named HF state dict with Phi-3's fused q/k/v and gate/up weights in its place."""
        out = dict(hf_sd)
        for i in range(self.cfg.n_layers):
            for fused, parts in self._splits().items():
                out[f"model.layers.{i}.{fused}.weight"] = torch.cat(
                    [out.pop(f"model.layers.{i}.{part}.weight") for part, _ in parts])
        return out

    @classmethod
    def _fields_from_hf(cls, d: dict) -> dict:
        """The config fields Llama and Mixtral (and Mistral, Qwen2, Qwen3) share, from a config.json dict."""
        _require(d, {"hidden_act": ("silu", ("silu",)), "mlp_bias": (False, (False,))})
        rope = dict(d.get("rope_parameters") or {})  # transformers >= 5
        scaling = dict(d.get("rope_scaling") or {})  # older config.json files
        partial = (rope or scaling).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1.0):
            raise ValueError(f"Hugging Face config has partial_rotary_factor={partial!r}; pipekit rotates every "
                             f"channel of a head (only 1.0 converts)")
        given = {k: v for k, v in (rope or scaling).items() if k not in ("rope_theta", "partial_rotary_factor")}
        if given.get("rope_type", given.get("type")) == "llama3":  # as transformers: the model's context by default
            given.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
        try:
            rope_scaling = rope_scaling_of(given)
        except ValueError as e:
            raise ValueError(f"Hugging Face config: {e}") from None
        dim, heads = d["hidden_size"], d["num_attention_heads"]
        head_dim = d.get("head_dim")
        theta = rope.get("rope_theta", d.get("rope_theta", cls.defaults["rope_theta"]))
        return dict(vocab_size=d["vocab_size"], max_seq_len=d["max_position_embeddings"],
                    n_layers=d["num_hidden_layers"], dim=dim, n_heads=heads,
                    n_kv_heads=d.get("num_key_value_heads") or heads, hidden=d["intermediate_size"],
                    norm_eps=d.get("rms_norm_eps", cls.defaults["rms_norm_eps"]), rope_theta=float(theta),
                    tie_embeddings=d.get("tie_word_embeddings", False), init_std=d.get("initializer_range", 0.02),
                    rope_scaling=None if rope_scaling is None else rope_scaling.as_dict(),
                    head_dim=None if head_dim in (None, dim // heads) and not dim % heads else head_dim)

    @classmethod
    def config_from_hf(cls, d: dict) -> LlamaConfig:
        """A Llama, Mistral, Phi-3, Qwen2 or Qwen3 config.json (dict) -> LlamaConfig; options pipekit
        lacks raise a ValueError. Mistral: Llama's tensors and its sliding window (none when the
        window covers max_position_embeddings: it masks nothing there). Phi-3: Mistral's with
        q/k/v and gate/up fused in the files (`hf_model_type="phi3"`, written back so). Qwen2:
        biases on q, k and v (`qkv_bias`). Qwen3: q_norm and k_norm (`qk_norm`), its head_dim."""
        kind = d.get("model_type", "llama")
        if kind in ("qwen2", "qwen3"):
            _no_sliding_window(d)
            _require(d, {"attention_bias": (False, (False, None))} if kind == "qwen3" else {})
            fields = cls._fields_from_hf(d)
            return LlamaConfig(**fields, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3")
        _require(d, {"attention_bias": (False, (False,))})
        fields = cls._fields_from_hf(d)
        cfg = LlamaConfig(**fields, sliding_window=_window(d) if kind in ("mistral", "phi3") else None)
        return cfg if hf_form(cfg) == kind else replace(cfg, hf_model_type=kind)  # remembered where not implied

    def check(self) -> None:
        """Refuse a config no Hugging Face form pipekit writes holds (`hf_form`)."""
        hf_form(self.cfg)

    def _hf_fields(self) -> dict:
        """The transformers config keys Llama and Mixtral share."""
        cfg = self.cfg
        return dict(
            vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len, hidden_size=cfg.dim,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.attn_head_dim, intermediate_size=cfg.hidden, hidden_act="silu",
            rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std, bos_token_id=_token_id(1, cfg.vocab_size),
            eos_token_id=_token_id(2, cfg.vocab_size),
            rope_scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling),  # transformers writes into it
        )

    def hf_config(self):
        """The transformers config of `cfg`, in the form `hf_form` names."""
        t, cfg, form = _transformers(), self.cfg, hf_form(self.cfg)
        if form == "qwen3":
            return t.Qwen3Config(**self._hf_fields(), attention_bias=False, use_sliding_window=False,
                                 architectures=["Qwen3ForCausalLM"])
        if form == "qwen2":
            return t.Qwen2Config(**self._hf_fields(), use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
        if form == "mistral":
            return t.MistralConfig(**self._hf_fields(), sliding_window=cfg.sliding_window,
                                   architectures=["MistralForCausalLM"])
        if form == "phi3":
            return t.Phi3Config(**self._hf_fields(), sliding_window=cfg.sliding_window, pad_token_id=None,
                                architectures=["Phi3ForCausalLM"])
        return t.LlamaConfig(**self._hf_fields(), attention_bias=False, mlp_bias=False,
                             architectures=["LlamaForCausalLM"])


_LLAMA_FORMS = {  # form -> (what it needs, what it cannot hold)
    "qwen3": ({"qk_norm"}, {"qkv_bias", "sliding_window"}),
    "qwen2": ({"qkv_bias"}, {"qk_norm", "sliding_window"}),
    "mistral": (set(), {"qkv_bias", "qk_norm"}),
    "phi3": (set(), {"qkv_bias", "qk_norm"}),
    "llama": (set(), {"qkv_bias", "qk_norm", "sliding_window"}),
}


def hf_form(cfg: LlamaConfig) -> str:
    """The Hugging Face model a Llama-family config is written as: its `hf_model_type` where set,
    else by its features (q/k head norms: qwen3; q/k/v biases: qwen2; a sliding window:
    mistral; none: llama). A config no form holds (biases with head norms, either with a
    window), or an hf_model_type its features contradict, is a one-line ValueError."""
    on = {f for f in ("qkv_bias", "qk_norm") if getattr(cfg, f)} | ({"sliding_window"} if cfg.sliding_window else set())
    form = cfg.hf_model_type or ("qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else
                                 "mistral" if cfg.sliding_window is not None else "llama")
    needs, lacks = _LLAMA_FORMS[form]
    if needs - on or on & lacks:
        said = ", ".join(sorted(on)) or "none of qkv_bias, qk_norm, sliding_window"
        fits = [f for f, (n, x) in _LLAMA_FORMS.items() if not (n - on or on & x)]
        raise ValueError(f"a Llama config with {said} has no Hugging Face {form} form"
                         + (f" (it fits {', '.join(fits)}: set hf_model_type to one, or None)" if fits else
                            " nor any other pipekit writes (Qwen2 has the biases, Qwen3 the norms, Mistral the "
                            "window, none two of them)"))
    return form


def _window(d: dict) -> int | None:
    """A Mistral, Phi-3 or Mixtral config's sliding window; None where it covers every position
    (it masks nothing)."""
    window = d.get("sliding_window")
    return None if window is None or window >= d["max_position_embeddings"] else int(window)


def _renormalize(rescaled: bool, top_k: int) -> bool | None:
    """MoEConfig.renormalize for top-k weights that are `rescaled` or not: None where that is the default."""
    return None if rescaled == (top_k > 1) else rescaled


def _no_sliding_window(d: dict) -> None:
    """Refuse a Qwen config whose layers use a sliding window: Qwen's are per layer (its
    layer_types, from max_window_layers), pipekit's `sliding_window` is one for every layer."""
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ()):
        raise ValueError(f"Hugging Face {d.get('model_type')} config has use_sliding_window="
                         f"{d.get('use_sliding_window')!r} (sliding_window={d.get('sliding_window')!r}, per layer "
                         f"from max_window_layers); pipekit's sliding window is one for every layer: only Qwen "
                         f"configs without it convert")


# ---- Mixtral -------------------------------------------------------------------
class MixtralAdapter(LlamaAdapter):
    """MixtralForCausalLM: Llama's attention and norms, the router and the fused experts.

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

    defaults = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-5}

    def check(self) -> None:
        """Refuse what HF's Mixtral and Qwen3-MoE lack (their routing is softmax, plain top-k, without
        an aux-free bias; they have no shared experts, no attention biases; Mixtral always rescales
        the top-k weights to sum to one, Qwen3-MoE as its norm_topk_prob says)."""
        cfg = self.cfg
        extras = ([f"n_shared_experts={cfg.n_shared_experts}"] if cfg.n_shared_experts else []) + \
                 (["qkv_bias=True"] if cfg.qkv_bias else []) + \
                 ([f"score={cfg.score!r}"] if cfg.score != "softmax" else []) + \
                 ([f"n_groups={cfg.n_groups}"] if cfg.n_groups is not None else []) + \
                 ([f"bias_update_rate={cfg.bias_update_rate}"] if cfg.bias_update_rate else [])
        if extras:
            raise ValueError(f"this Mixtral config has {' and '.join(extras)}, which Hugging Face's Mixtral lacks, "
                             f"as does Qwen3-MoE (softmax, plain top-k routing, no shared experts, no attention "
                             f"biases); only configs with score='softmax', n_shared_experts=0, no n_groups, "
                             f"bias_update_rate=0 and qkv_bias false convert")
        form = "qwen3_moe" if cfg.qk_norm else "mixtral"
        if cfg.hf_model_type not in (None, form):
            raise ValueError(f"this Mixtral config has hf_model_type={cfg.hf_model_type!r} but "
                             f"{'' if cfg.qk_norm else 'no '}q/k head norms (qk_norm={cfg.qk_norm}), which makes it "
                             f"{form}; set hf_model_type={form!r} or None")
        if cfg.qk_norm and cfg.sliding_window is not None:
            raise ValueError(f"this Mixtral config has qk_norm and sliding_window={cfg.sliding_window}: pipekit writes "
                             f"Qwen3-MoE without a window (Mixtral has the window without the norms)")
        if not cfg.qk_norm and not self.renormalized():
            raise ValueError(f"this Mixtral config does not rescale its top_k={cfg.top_k} weights to sum to one "
                             f"(renormalize={cfg.renormalize}), which Hugging Face's Mixtral always does; set "
                             f"renormalize=true (Qwen3-MoE, with qk_norm, holds either)")

    def renormalized(self) -> bool:
        """Whether a token's top-k weights sum to one (`renormalize`, by default when top_k > 1)."""
        return self.cfg.top_k > 1 if self.cfg.renormalize is None else self.cfg.renormalize

    def _experts_from_hf(self, hf: _Taken, i: int) -> dict:
        """Block i's router and experts in pipekit's names and layouts, from the fused form or
        (when the block has it) the per-expert one."""
        p, ours, H = f"model.layers.{i}.", f"layers.{i + 1}.mlp.", self.cfg.hidden
        old = p + "block_sparse_moe."
        E = self.cfg.n_experts
        if p + "mlp.experts.gate_up_proj" not in hf and old + "gate.weight" in hf:
            per = {n: torch.stack([hf.take(f"{old}experts.{e}.{n}.weight").t() for e in range(E)])
                   for n in ("w1", "w3", "w2")}  # w1, w3: (H, D) -> (E, D, H); w2: (D, H) -> (E, H, D)
            router, gate, up, down = hf.take(old + "gate.weight"), per["w1"], per["w3"], per["w2"]
        elif p + "mlp.experts.gate_up_proj" not in hf and p + "mlp.experts.0.gate_proj.weight" in hf:
            # Qwen3-MoE on disk: mlp.experts.{e}.gate_proj / up_proj (H, D), down_proj (D, H)
            per = {n: torch.stack([hf.take(f"{p}mlp.experts.{e}.{n}.weight").t() for e in range(E)])
                   for n in ("gate_proj", "up_proj", "down_proj")}
            router, gate, up, down = hf.take(p + "mlp.gate.weight"), per["gate_proj"], per["up_proj"], per["down_proj"]
        else:
            router = hf.take(p + "mlp.gate.weight")
            gate_up = hf.take(p + "mlp.experts.gate_up_proj")  # (E, 2H, D)
            if gate_up.dim() != 3 or gate_up.shape[1] != 2 * H:
                raise ValueError(f"{p}mlp.experts.gate_up_proj has shape {tuple(gate_up.shape)}; the config needs "
                                 f"(n_experts, 2 * hidden = {2 * H}, dim)")
            gate, up = gate_up.transpose(1, 2).split(H, dim=2)  # (E, D, H) each
            down = hf.take(p + "mlp.experts.down_proj").transpose(1, 2)  # (E, D, H) -> (E, H, D)
        return {ours + "router.weight": router, ours + "experts.w_gate": gate.contiguous(),
                ours + "experts.w_up": up.contiguous(), ours + "experts.w_down": down.contiguous()}

    def renamed(self, hf_state_dict) -> dict[str, tuple[str, bool]]:
        return {ours: (theirs, False) for ours, theirs in self._pairs(mlp=())}  # the experts: stacked in HF

    def _from_hf(self, hf: _Taken) -> dict:
        out = {ours: hf.take(theirs) for ours, theirs in self._pairs(mlp=()) if hf.wants(ours)}
        for i in range(self.cfg.n_layers):
            if hf.wants(f"layers.{i + 1}.mlp.router.weight"):
                out.update(self._experts_from_hf(hf, i))
        return out

    def _to_hf(self, sd: dict) -> dict:
        """The fused form of transformers >= 5 (what MixtralForCausalLM holds in memory)."""
        out = {theirs: sd[ours] for ours, theirs in self._pairs(mlp=(("mlp.router", "mlp.gate"),))}
        for i in range(self.cfg.n_layers):
            ours, theirs = f"layers.{i + 1}.mlp.experts.", f"model.layers.{i}.mlp.experts."
            gate_up = torch.cat([sd[ours + "w_gate"], sd[ours + "w_up"]], dim=2)  # (E, D, 2H)
            out[theirs + "gate_up_proj"] = gate_up.transpose(1, 2).contiguous()  # (E, 2H, D)
            out[theirs + "down_proj"] = sd[ours + "w_down"].transpose(1, 2).contiguous()  # (E, D, H)
        return out

    @classmethod
    def config_from_hf(cls, d: dict) -> MixtralConfig:
        """A Mixtral or Qwen3-MoE config.json (dict) -> MixtralConfig; options pipekit lacks raise a
        ValueError. Qwen3-MoE: q/k head norms, its head_dim, experts of moe_intermediate_size, the
        top-k weights rescaled as norm_topk_prob says; every layer sparse."""
        if d.get("model_type") == "qwen3_moe":
            return cls._qwen3_moe_config(d)
        _require(d, {"attention_bias": (False, (False,))})
        if d.get("router_jitter_noise"):
            raise ValueError(f"Hugging Face config has router_jitter_noise={d['router_jitter_noise']!r}; pipekit's "
                             "Mixtral routes without input jitter (only 0 converts)")
        fields = cls._fields_from_hf(d)
        top_k = d["num_experts_per_tok"]
        coef = _scaled(d.get("router_aux_loss_coef", 0.001), top_k / fields["n_layers"])
        return MixtralConfig(**fields, n_experts=d["num_local_experts"], top_k=top_k, aux_loss_coef=coef,
                             renormalize=_renormalize(True, top_k),  # HF's Mixtral always rescales them
                             sliding_window=_window(d))

    @classmethod
    def _qwen3_moe_config(cls, d: dict) -> MixtralConfig:
        _no_sliding_window(d)
        _require(d, {"attention_bias": (False, (False, None)), "decoder_sparse_step": (1, (1,))})
        if d.get("mlp_only_layers"):
            raise ValueError(f"Hugging Face qwen3_moe config has mlp_only_layers={d['mlp_only_layers']!r}; pipekit's "
                             f"MoE model has experts in every block (only [] converts)")
        fields = {**cls._fields_from_hf(d), "hidden": d["moe_intermediate_size"]}
        top_k = d["num_experts_per_tok"]
        coef = _scaled(d.get("router_aux_loss_coef", 0.001), top_k / fields["n_layers"])
        experts = d["num_experts"] if "num_experts" in d else d["num_local_experts"]  # config.json < 5 / 5.x
        return MixtralConfig(**fields, n_experts=experts, top_k=top_k, aux_loss_coef=coef, qk_norm=True,
                             renormalize=_renormalize(bool(d.get("norm_topk_prob", False)), top_k))

    def hf_config(self):
        """The transformers.MixtralConfig of `cfg` (see the class docstring for the router loss);
        Qwen3MoeConfig with q/k head norms."""
        cfg = self.cfg
        if cfg.qk_norm:
            return _transformers().Qwen3MoeConfig(
                **self._hf_fields(), num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                moe_intermediate_size=cfg.hidden, norm_topk_prob=self.renormalized(), decoder_sparse_step=1,
                mlp_only_layers=[], router_aux_loss_coef=_scaled(cfg.aux_loss_coef, cfg.n_layers / cfg.top_k),
                output_router_logits=False, attention_bias=False, use_sliding_window=False,
                architectures=["Qwen3MoeForCausalLM"])
        return _transformers().MixtralConfig(
            **self._hf_fields(), num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
            router_aux_loss_coef=_scaled(cfg.aux_loss_coef, cfg.n_layers / cfg.top_k), router_jitter_noise=0.0,
            output_router_logits=False, sliding_window=cfg.sliding_window, architectures=["MixtralForCausalLM"],
        )


ADAPTERS: dict[str, type[StateDictAdapter]] = {"gpt2": GPT2Adapter, "llama": LlamaAdapter,
                                               "mixtral": MixtralAdapter}  # family -> its HF adapter
# transformers' model_type -> the adapter that reads it (Mistral, Qwen2 and Qwen3 are Llama variants)
HF_MODEL_TYPES: dict[str, type[StateDictAdapter]] = {"gpt2": GPT2Adapter, "llama": LlamaAdapter,
                                                     "mistral": LlamaAdapter, "phi3": LlamaAdapter,
                                                     "qwen2": LlamaAdapter,
                                                     "qwen3": LlamaAdapter, "mixtral": MixtralAdapter,
                                                     "qwen3_moe": MixtralAdapter}


# ---- by family -----------------------------------------------------------------
def check_hf_form(family: str, what: str = "this is a") -> None:
    """Refuse, in one line, a family that has no Hugging Face form (`what` names the model)."""
    if family in ADAPTERS:
        return
    *others, last = ADAPTERS
    raise ValueError(f"{what} {family!r} model, which has no Hugging Face form; "
                     f"only {', '.join(others)} and {last} models convert")


def hf_adapter(cfg, family: str | None = None) -> StateDictAdapter:
    """The adapter of `cfg`'s family; `family`, when given, must be that family. A family or
    config without a Hugging Face form is a one-line ValueError."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid families: {sorted(FAMILIES)}")
    own = family_of(cfg) if family is None else family
    check_hf_form(own)
    if family_of(cfg) != own:
        raise ValueError(f"family {own!r} was given with a {type(cfg).__name__}; they must agree")
    return ADAPTERS[own](cfg)


def from_hf_state_dict(family: str, hf_sd: dict, cfg) -> dict[str, torch.Tensor]:
    """A transformers state dict -> a pipekit full state dict for `cfg` (vocab padded, shapes checked)."""
    return hf_adapter(cfg, family).from_hf(hf_sd)


def to_hf_state_dict(family: str, full_sd: dict, cfg) -> dict[str, torch.Tensor]:
    """A pipekit full state dict (padded) -> the state dict of GPT2LMHeadModel / LlamaForCausalLM /
    MixtralForCausalLM (vocab_size rows: the padded ones dropped)."""
    return hf_adapter(cfg, family).to_hf(full_sd)


def config_from_hf(hf_config) -> GPT2Config | LlamaConfig | MixtralConfig:
    """A transformers config (object, or config.json as a dict) -> GPT2Config / LlamaConfig / MixtralConfig.

    Raises a ValueError for architecture options pipekit does not implement."""
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    model_type = d.get("model_type")
    adapter = HF_MODEL_TYPES.get(str(model_type))
    if adapter is None:
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: {sorted(HF_MODEL_TYPES)}")
    try:
        return adapter.config_from_hf(d)
    except KeyError as e:
        raise ValueError(f"the Hugging Face {model_type} config lacks {e.args[0]!r}") from e


def hf_config_from(cfg):
    """GPT2Config / LlamaConfig / MixtralConfig -> the matching transformers config object."""
    return hf_adapter(cfg).hf_config()


# ---- vocabulary padding --------------------------------------------------------
def embed_prefix(cfg) -> str:
    """Where the token table lives in a pipekit state dict: the tied entry, or layer 0."""
    return "tied.embed" if cfg.tie_embeddings else "layers.0"


def vocab_tensor_names(cfg) -> list[str]:
    """The pipekit tensors with one row per token id: the token table, and the untied head."""
    return ADAPTERS[family_of(cfg)].vocab_names(cfg)


def pad_vocab(sd: dict, cfg) -> dict:
    """`sd` with its vocab tensors of exactly `vocab_size` rows grown to `padded_vocab(cfg)` by zero rows."""
    out = dict(sd)
    for name in vocab_tensor_names(cfg):
        t = out.get(name)
        if t is not None and t.shape[0] == cfg.vocab_size < cfg.padded_vocab:
            out[name] = torch.cat([t, t.new_zeros(cfg.padded_vocab - cfg.vocab_size, *t.shape[1:])])
    return out


def strip_vocab(sd: dict, cfg) -> dict:
    """`sd` (padded, shapes checked) with its vocab tensors cut to `vocab_size` rows (copies)."""
    if cfg.padded_vocab == cfg.vocab_size:
        return sd
    return {**sd, **{name: sd[name][: cfg.vocab_size].clone() for name in vocab_tensor_names(cfg)}}


# ---- helpers -------------------------------------------------------------------
class _Prefixed(Mapping):
    """A state dict seen with `prefix` before each name (but those starting with `keep`),
    without reading its tensors (it may be a mapping that reads each from a file)."""

    def __init__(self, sd, prefix: str, keep: tuple[str, ...] = ()):
        self.sd, self.prefix, self.keep = sd, prefix, keep
        self.names = {k if k.startswith(keep) else prefix + k: k for k in sd}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sd[self.names[name]]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _Taken:
    """A transformers state dict read name by name; what was never taken is reported at the end."""

    def __init__(self, hf, used=(), names=None):
        self.hf, self.used, self.names = hf, set(used), None if names is None else set(names)

    def wants(self, ours: str) -> bool:
        """Whether the pipekit tensor `ours` is asked for (every one, without `names`)."""
        return self.names is None or ours in self.names

    def __contains__(self, name: str) -> bool:
        return name in self.hf

    def take(self, name: str) -> torch.Tensor:
        if name not in self.hf:
            raise KeyError(f"the Hugging Face state dict lacks {name!r} (it has {len(self.hf)} tensors, "
                           f"e.g. {sorted(self.hf)[:3]})")
        self.used.add(name)
        return self.hf[name]

    def check_all_used(self) -> None:
        extra = sorted(k for k in self.hf if k not in self.used and not k.endswith(_IGNORED_SUFFIXES))
        if extra:
            raise ValueError(f"the Hugging Face state dict has {len(extra)} tensors this config does not use, "
                             f"e.g. {extra[:5]}; does the config match the checkpoint?")


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape as the spec list builds it (on meta, tp=1)."""
    expected = {}
    tied: set[str] = set()
    for i, spec in enumerate(model_specs(cfg)):
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
    return expected


def check_shapes(sd: dict, cfg, partial: bool = False, expected: dict | None = None) -> None:
    """Compare every tensor with the shape the spec list builds (`expected_shapes`, given or
    computed); `partial`: `sd` holds some of the model's tensors (none unknown, none required)."""
    expected = expected_shapes(cfg) if expected is None else expected
    if set(expected) != set(sd) and not (partial and set(sd) <= set(expected)):
        missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
        raise ValueError(f"{family_of(cfg)} state dict does not match the config: "
                         f"missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        if name in sd and tuple(sd[name].shape) != shape:
            raise ValueError(f"{name}: the config gives shape {shape}, the weights have {tuple(sd[name].shape)}")


def _require(d: dict, checks: dict[str, tuple]) -> None:
    for key, (default, allowed) in checks.items():
        value = d.get(key, default)
        if value not in allowed:
            raise ValueError(f"Hugging Face config has {key}={value!r}; pipekit supports only {list(allowed)}")


def _scaled(coef: float, factor: float) -> float:
    """`coef * factor` to 12 significant digits, so that a round trip gives the number back."""
    return float(f"{coef * factor:.12g}")


def _token_id(default: int, vocab_size: int) -> int | None:
    return default if default < vocab_size else None


def _transformers():
    """The transformers module, or an ImportError saying how to get it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("writing a Hugging Face model needs transformers: pip install transformers",
                          name="transformers") from e
    return transformers
