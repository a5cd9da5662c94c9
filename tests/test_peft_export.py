"""`pipekit convert --to-peft`: a model's LoRA/DoRA adapters alone, in PEFT's form, load with
`peft.PeftModel.from_pretrained` onto the transformers model and give pipekit's logits (float32,
within 1e-5): Llama (its untied head adapted too: the padded vocabulary rows dropped), GPT-2
(Conv1D c_proj / c_fc, and q, v fused into one c_attn adapter), from a model.pt as `pipekit
train` writes it and from a checkpoint; what has no PEFT form is refused in one line."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from pipekit.cli import main
from pipekit.config import load_run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ = 200, 8


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    path = str(tmp_path_factory.mktemp("gpt2"))
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """Phi-3 with grouped-query heads (Phi-3-medium's, Phi-4's shape): q, k, v of 32, 16, 16 rows
    fused in qkv_proj, gate and up in gate_up_proj."""
    torch.manual_seed(2)
    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  pad_token_id=None, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("phi3"))
    transformers.Phi3ForCausalLM(cfg).save_pretrained(path)
    return path


def _run(path: str, targets: str, dora: bool):
    return load_run(None, [f"model.init={path}", "train.dtype=float32", f"train.seq_len={SEQ}", "train.device=cpu",
                           "model.lora.rank=2", "model.lora.alpha=6", f"model.lora.targets={targets}",
                           f"model.lora.dora={str(dora).lower()}"])


def _adapted(run):
    """The run's module, its adapters given values of their own (B starts at zero, m at ||W||)."""
    from pipekit.run.loop import build
    from pipekit.topology import Topology

    module = build(run, Topology(alone=True)).module
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora." in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module.eval()


def _save_model_pt(run, module, path: str) -> str:
    """model.pt as `pipekit train` writes it (run/loop.py: save_weights), with its "lora" record."""
    from pipekit.checkpoint import full_state_dict

    torch.save({"family": run.family, "config": asdict(run.model), "state_dict": full_state_dict(module),
                "lora": asdict(run.config.model.lora)}, path)
    return path


def _assert_peft_gives_our_logits(module, base_dir: str, adapter_dir: str, seed: int) -> None:
    """PeftModel.from_pretrained(the HF base model, adapter_dir) gives `module`'s logits within
    1e-5 (float32), and its adapters act (the logits move off the base model's)."""
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(x).logits
        theirs = peft.PeftModel.from_pretrained(base, adapter_dir).eval()(x).logits
        ours = module(x)[..., :VOCAB]  # the padded vocabulary's logits are -inf
    assert (theirs - plain).abs().max() > 1e-2
    assert (ours - theirs).abs().max().item() < 1e-5


LLAMA_CASES = {  # name: (targets, dora, PEFT's target_modules)
    "lora": (r"attn\.(q|v)$|mlp\.down$|^layers\.4$", False, ["down_proj", "lm_head", "q_proj", "v_proj"]),
    "dora": (r"attn\.(q|k|o)$|mlp\.(gate|up)$", True, ["gate_proj", "k_proj", "o_proj", "q_proj", "up_proj"]),
    "one-layer": (r"layers\.2\.attn\.q$|mlp\.down$", False, ["down_proj", "model.layers.1.self_attn.q_proj"]),
}


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_a_llama_adapter_loads_into_peft_and_gives_pipekits_logits(llama_dir, tmp_path, case):
    targets, dora, modules = LLAMA_CASES[case]
    run = _run(llama_dir, targets, dora)
    module = _adapted(run)
    pt = _save_model_pt(run, module, str(tmp_path / "model.pt"))
    assert main(["convert", "--to-peft", pt, "--out", str(tmp_path / "peft")]) == 0
    files = sorted(os.listdir(tmp_path / "peft"))
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_dora"]) == ("LORA", 2, 6.0, dora)
    assert config["target_modules"] == modules and config["fan_in_fan_out"] is False
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert all(re.fullmatch(r"base_model\.model\.\S+\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)", k)
               for k in tensors), sorted(tensors)[:3]  # adapters alone, no base weights
    assert sum(k.endswith("lora_magnitude_vector") for k in tensors) == (len(tensors) // 3 if dora else 0)
    _assert_peft_gives_our_logits(module, llama_dir, str(tmp_path / "peft"), seed=1)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_gpt2s_fused_qkv_take_one_exact_adapter_on_c_attn(gpt2_dir, tmp_path, dora):
    run = _run(gpt2_dir, r"attn\.(q|v|o)$|mlp\.(fc|proj)$", dora)
    module = _adapted(run)
    pt = _save_model_pt(run, module, str(tmp_path / "model.pt"))
    assert main(["convert", "--to-peft", pt, "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["c_attn", "c_fc", "c_proj"] and config["fan_in_fan_out"] is True
    assert config["rank_pattern"] == {f"transformer.h.{i}.attn.c_attn": 4 for i in range(2)}  # q and v: 2 x 2
    assert config["alpha_pattern"] == {f"transformer.h.{i}.attn.c_attn": 12.0 for i in range(2)}  # scale 6 / 2
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert b.shape == (96, 4) and not b[32:64].any()  # k's rows: no adapter
    _assert_peft_gives_our_logits(module, gpt2_dir, str(tmp_path / "peft"), seed=2)


def test_a_checkpoint_exports_with_its_base_model_named(llama_dir, tmp_path):
    from pipekit.checkpoint import save_checkpoint

    run = _run(llama_dir, r"attn\.(q|v)$", True)
    module = _adapted(run)
    ckpt = save_checkpoint(str(tmp_path / "checkpoints" / "step_00000002"), module,
                           meta={"family": run.family, "model_config": asdict(run.model),
                                 "config": json.loads(json.dumps(asdict(run.config)))})
    assert main(["convert", "--to-peft", str(tmp_path / "checkpoints"), "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == llama_dir and config["use_dora"] is True
    assert ckpt.endswith("step_00000002")  # the checkpoints root names its newest
    _assert_peft_gives_our_logits(module, llama_dir, str(tmp_path / "peft"), seed=3)


def test_what_has_no_peft_form_is_refused_in_one_line(llama_dir, tmp_path, capsys):
    from pipekit.checkpoint import full_state_dict
    from pipekit.interchange import convert
    from pipekit.models.peft import to_peft

    run = _run(llama_dir, r"attn\.q$", False)
    module = _adapted(run)
    pt = _save_model_pt(run, module, str(tmp_path / "model.pt"))
    saved = torch.load(pt, weights_only=True)
    plain = {**saved, "state_dict": {k: v for k, v in saved["state_dict"].items() if ".lora." not in k}}
    torch.save(plain, tmp_path / "plain.pt")
    assert main(["convert", "--to-peft", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "a")]) == 2
    said = capsys.readouterr().err
    assert re.fullmatch(r"pipekit convert: .*plain.pt holds no LoRA adapters: --to-peft exports adapters alone .*"
                        r"export the whole model with --to-hf\n", said), said
    del saved["lora"]
    torch.save(saved, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match=r"holds LoRA adapters but not their settings .* cannot be exported"):
        convert(str(tmp_path / "bare.pt"), str(tmp_path / "b"), "to_peft")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "README.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"full exists and is not empty; pass overwrite=True .* PEFT adapter"):
        convert(pt, str(tmp_path / "full"), "to_peft")
    convert(pt, str(tmp_path / "full"), "to_peft", overwrite=True)
    assert sorted(os.listdir(tmp_path / "full")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    sd = full_state_dict(module)
    experts = {**sd, "layers.1.mlp.experts.lora.w_gate_lora_A": torch.zeros(2, 32, 2)}
    with pytest.raises(ValueError, match=r"^layers.1.mlp.experts.lora.w_gate_lora_A is an MoE expert adapter, which "
                                         r"has no PEFT form"):
        to_peft(run.family, run.model, experts, rank=2, alpha=6.0)
    with pytest.raises(ValueError, match=r"adapter has rank 2, but its settings say model.lora.rank=4"):
        to_peft(run.family, run.model, sd, rank=4, alpha=6.0)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_phi3s_fused_weights_take_one_exact_adapter_each(phi3_dir, tmp_path, dora):
    """Adapters on pipekit's separate q, v and gate of a Phi-3: one LoRA on qkv_proj (q and v, rows
    of unequal length) and one on gate_up_proj, PEFT's logits equal to pipekit's."""
    run = _run(phi3_dir, r"attn\.(q|v|o)$|mlp\.gate$", dora)
    module = _adapted(run)
    pt = _save_model_pt(run, module, str(tmp_path / "model.pt"))
    assert main(["convert", "--to-peft", pt, "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["gate_up_proj", "o_proj", "qkv_proj"]
    assert config["rank_pattern"] == {f"model.layers.{i}.self_attn.qkv_proj": 4 for i in range(2)}
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    b = tensors["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    assert b.shape == (64, 4) and not b[32:48].any()  # k's 16 rows: no adapter
    _assert_peft_gives_our_logits(module, phi3_dir, str(tmp_path / "peft"), seed=3)
