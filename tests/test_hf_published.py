"""The config.json of published Hugging Face models (their values as the Hub serves them, weights
not needed): each maps to a pipekit config whose model is transformers' model, counted on the
meta device — the same parameter count, and `to_hf` of pipekit's tensors gives every one of
transformers' tensor names with its shape (nothing missing, nothing extra), at the real sizes:
Llama 3.2's scaled rope and tied head, Qwen2.5's q/k/v biases and 14 heads over 2 kv heads,
Qwen3's head_dim 128 at hidden 1024, Qwen3-MoE's 128 experts of width 768, Phi-3's fused
tensors and window, Mistral 7B's window."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipekit.models import count_params, hf  # noqa: E402
from pipekit.models.hf import expected_shapes, hf_adapter  # noqa: E402

COMMON = {"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "bfloat16",
          "use_cache": True}
PUBLISHED = {  # name: (config.json, what pipekit must make of it)
    "Llama-3.2-1B": ({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256},
        {"tie_embeddings": True, "head_dim": None, "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}),
    "Qwen2.5-0.5B": ({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643, "eos_token_id": 151643,
        "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
        "vocab_size": 151936},
        {"qkv_bias": True, "tie_embeddings": True, "sliding_window": None}),
    "Qwen3-0.6B": ({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_size": 1024,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936},
        {"qk_norm": True, "head_dim": 128}),
    "Qwen3-30B-A3B": ({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936},
        {"n_experts": 128, "top_k": 8, "hidden": 768, "qk_norm": True, "renormalize": None}),
    "Phi-3-mini-4k": ({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "bos_token_id": 1, "embd_pdrop": 0.0,
        "eos_token_id": 32000, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
        "vocab_size": 32064},
        {"hf_model_type": "phi3", "sliding_window": 2047}),
    "Mistral-7B-v0.1": ({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000},
        {"sliding_window": 4096, "hf_model_type": None}),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_config_is_transformers_model(name):
    d, want = PUBLISHED[name]
    d = {**COMMON, **d}
    cfg = hf.config_from_hf(d)
    assert {k: getattr(cfg, k) for k in want} == want
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    assert count_params(cfg, padded=False) == sum(p.numel() for p in model.parameters())  # a tied table once
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = hf_adapter(cfg).to_hf({k: torch.empty(s, device="meta") for k, s in expected_shapes(cfg).items()})
    assert {k: tuple(v.shape) for k, v in ours.items()} == theirs
    assert hf.config_from_hf(hf.hf_config_from(cfg)) == cfg  # and back
