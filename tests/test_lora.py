"""`pipekit.layers.lora` in one process, against PEFT: an adapted Llama gives PEFT's logits (LoRA
and DoRA), a new adapter changes nothing, merging folds it into the weights exactly; and the
mistakes a user makes with `model.init` / `model.lora` / `model.freeze` are refused in one line
before any worker starts."""

from __future__ import annotations

import re

import pytest
import torch

from pipekit.config import ConfigError, load_run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = r"attn\.(q|v|o)$|mlp\.down$"
HF_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
HF_NAME = {"attn.q": "self_attn.q_proj", "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
           "mlp.down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _pipekit(path: str, dora: bool):
    from pipekit.run.loop import build
    from pipekit.topology import Topology

    run = load_run(None, [f"model.init={path}", "train.dtype=float64", "train.seq_len=8", "model.lora.rank=2",
                          "model.lora.alpha=6", f"model.lora.targets={TARGETS}", f"model.lora.dora={str(dora).lower()}",
                          "train.device=cpu"])
    return build(run, Topology(alone=True)).module


def _perturb(module) -> None:
    """Give every adapter factor values of its own (B starts at zero, m at ||W||)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_adapters_give_pefts_logits(float64, llama_dir, dora):
    module = _pipekit(llama_dir, dora)
    x = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    module.eval()
    with torch.no_grad():
        plain = module(x)[..., :200]  # the padded vocabulary's logits are -inf
    _perturb(module)
    with torch.no_grad():
        ours = module(x)[..., :200]
    assert (ours - plain).abs().max() > 1e-3  # the adapters act
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float64).eval()
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=6, target_modules=HF_TARGETS, use_dora=dora))
    state = theirs.state_dict()
    mine = dict(module.named_parameters())
    copied = 0
    for name, p in mine.items():
        m = re.fullmatch(r"layers\.(\d+)\.(attn\.\w|mlp\.down)\.lora\.(lora_A\.weight|lora_B\.weight|"
                         r"lora_magnitude_vector)", name)
        if m is None:
            continue
        layer, part, what = int(m[1]) - 1, HF_NAME[m[2]], m[3]
        key = (f"base_model.model.model.layers.{layer}.{part}." +
               (f"{what.split('.')[0]}.default.weight" if what != "lora_magnitude_vector"
                else "lora_magnitude_vector.default.weight"))
        state[key].copy_(p.detach())
        copied += 1
    assert copied == 2 * 4 * (3 if dora else 2)
    with torch.no_grad():
        want = theirs(x).logits
        with theirs.disable_adapter():
            base = theirs(x).logits
    # transformers' RMSNorm computes in float32 whatever the model's dtype: the two models agree
    # to ~1e-8 without adapters, and so do the adapters' effects (each of order 0.1)
    assert (plain - base).abs().max().item() < 1e-6
    assert ((ours - plain) - (want - base)).abs().max().item() < 1e-6
    assert (ours - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_new_adapter_changes_nothing_and_merging_is_exact(float64, llama_dir, dora):
    from pipekit.checkpoint import full_state_dict, load_full_state_dict
    from pipekit.layers.lora import merge_adapters

    module = _pipekit(llama_dir, dora)
    x = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(2))
    module.eval()
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    assert frozen and all(".lora." not in n for n in frozen)
    assert all(".lora." in n for n, p in module.named_parameters() if p.requires_grad)
    with torch.no_grad():
        before = module(x)
    plain = _pipekit(llama_dir, dora)  # the same weights; its adapters are removed by loading the merge
    for _, layer in plain.named_modules():
        if getattr(layer, "lora", None) is not None:
            layer.lora = None
    plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), before)
    _perturb(module)
    with torch.no_grad():
        adapted = module(x)[..., :200]  # the padded vocabulary's logits are -inf
    load_full_state_dict(plain, merge_adapters(full_state_dict(module), scale=6 / 2))
    with torch.no_grad():
        assert (plain(x)[..., :200] - adapted).abs().max().item() < 1e-12


MISTAKES = [  # (overrides, the one line's pattern); {dir} is the Llama's model dir
    (["model.init={dir}/nowhere"], r"^model.init=[^:]*/nowhere does not exist; give a Hugging"),
    (["model.init={dir}", "model.dim=64"], r"model.dim=64 contradicts model.init=.*, whose dim is 32; leave model.dim "
                                          r"out"),
    (["model.init={dir}", "model.family=gpt2"], r"model.family=gpt2 contradicts model.init=.*, which holds a llama"),
    (["model.init={dir}", "model.flavour=tiny"], r"model.flavour=tiny does not apply with model.init"),
    (["model.init={dir}", "model.lora.rank=4", "model.lora.targets=experts"],
     r"model.lora.targets='experts' matches no linear layer of the llama model; its linears are "
     r"layers.N.\{attn.k, attn.o, attn.q, attn.v, mlp.down, mlp.gate, mlp.up\}"),
    (["model.lora.rank=4", "model.lora.dora=true", "model.lora.dropout=0.1"],
     r"model.lora.dora=true with model.lora.dropout=0.1 is not supported"),
    (["model.lora.dora=true"], r"model.lora.dora=true decomposes the adapters, but model.lora.rank=0"),
    (["model.lora.rank=4", "model.lora.targets=(("], r"model.lora.targets='\(\(' is not a valid regex"),
    (["model.freeze=nothing_here"], r"model.freeze='nothing_here' matches no parameter; the names look like"),
    (["model.lora.rank=4", "model.lora.alpha=0"], r"model.lora.alpha=0.0 must be a finite number > 0"),
]


@pytest.mark.parametrize("overrides, said", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_fine_tuning_mistakes_are_refused_in_one_line(llama_dir, overrides, said):
    with pytest.raises(ConfigError) as e:
        load_run(None, ["train.seq_len=8", *(o.format(dir=llama_dir) for o in overrides)])
    assert re.search(said, str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_convert_to_hf_merges_the_adapters(float64, llama_dir, dora, tmp_path):
    from dataclasses import asdict

    from pipekit.checkpoint import full_state_dict
    from pipekit.config import LoraConfig
    from pipekit.interchange import convert, pretrained_config

    module = _pipekit(llama_dir, dora)
    _perturb(module)
    module.eval()
    x = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = module(x)[..., :200]
    family, cfg = pretrained_config(llama_dir)
    lora = asdict(LoraConfig(rank=2, alpha=6.0, targets=TARGETS, dora=dora))
    saved = {"family": family, "config": asdict(cfg), "state_dict": full_state_dict(module), "lora": lora}
    torch.save(saved, tmp_path / "model.pt")  # as `pipekit train` writes it (run/loop.py: save_weights)
    convert(str(tmp_path / "model.pt"), str(tmp_path / "hf"), "to_hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64).eval()
    with torch.no_grad():
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-6  # transformers' float32 RMSNorm: ~1e-8
    del saved["lora"]
    torch.save(saved, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match=r"holds LoRA adapters but not their settings"):
        convert(str(tmp_path / "bare.pt"), str(tmp_path / "hf2"), "to_hf")
