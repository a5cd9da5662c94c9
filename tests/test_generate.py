"""`pipekit generate` after fine-tuning: decoding with a KV cache, and models from Hugging Face.

- the KV cache (`pipekit.layers.kv_cache`) changes nothing but the cost: greedy tokens with it
  are those of rerunning the whole model, and the logits of every step equal the full
  forward's within 1e-10 (float64), for the tiny GPT-2 (learned positions), Llama (rotary,
  grouped-query) and Mixtral (MoE blocks);
- a Llama that transformers built and saved (random weights, offline) decodes to the tokens of
  transformers' own `generate(do_sample=False)`, stopping at the same eos;
- the command line takes a HF dir (its tokenizer.json), `--chat` (its chat template) and a run
  dir; a request past max_seq_len, `--chat` without a template and a path that is no model
  are one line each.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipekit.cli import main
from pipekit.layers.kv_cache import kv_cache
from pipekit.models import get_model, model_specs
from pipekit.precision import default_dtype
from pipekit.run.generate import has_attention, load_model, sample
from pipekit.testing import CHAT_TEMPLATE, chatml_tokenizer, reference_model

FAMILIES = ("gpt2", "llama", "mixtral")
PROMPT = [3, 7, 1, 9, 40]


def _zoo_model(family: str):
    """The tiny flavour in float64, its matrices redrawn wider than init (std 0.2; norms as they
    are) so that greedy decoding wanders over the vocabulary instead of repeating one token."""
    cfg = get_model(family, "tiny")
    with default_dtype(torch.float64):
        module = reference_model(model_specs(cfg), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (p for p in module.parameters() if p.dim() >= 2):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return module, cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_with_the_kv_cache_are_those_of_rerunning_the_model(family):
    module, cfg = _zoo_model(family)
    assert has_attention(module)
    cached = sample(module, PROMPT, 24, max_len=cfg.max_seq_len, temperature=0, cache=True)
    again = sample(module, PROMPT, 24, max_len=cfg.max_seq_len, temperature=0, cache=False)
    assert cached == again and len(cached) == len(PROMPT) + 24
    assert len(set(cached[len(PROMPT):])) > 10, cached  # a walk over the vocabulary, not one token repeated


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_logits_equal_the_full_forward_at_every_step(family):
    module, cfg = _zoo_model(family)
    ids = torch.tensor([PROMPT + [11, 250, 6, 77, 2, 190, 31, 8]])  # (1, 13)
    with torch.no_grad():
        full = module(ids)[0]  # (13, vocab)
        with kv_cache(cfg.max_seq_len):
            first = module((ids[:, :5], torch.arange(5).unsqueeze(0)))[0]  # the prompt at once
            steps = [module((ids[:, t:t + 1], torch.tensor([[t]])))[0, -1] for t in range(5, ids.shape[1])]
    torch.testing.assert_close(first, full[:5], rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.stack(steps), full[5:], rtol=0, atol=1e-10)


def test_the_cache_takes_tokens_in_order_and_no_more_than_its_length():
    module, _ = _zoo_model("llama")
    with torch.no_grad(), kv_cache(6):
        module((torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])))
        with pytest.raises(ValueError, match="must continue at 3, got positions \\[5\\]"):
            module((torch.tensor([[4]]), torch.tensor([[5]])))
    with torch.no_grad(), kv_cache(4), pytest.raises(ValueError, match="at most 4 positions"):
        module((torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5).unsqueeze(0)))
    with pytest.raises(ValueError, match="max_new_tokens=200 after the prompt's 5 tokens makes 205, more than the "
                                         "model's max_seq_len=128; give max_new_tokens <= 123"):
        sample(module, PROMPT, 200, max_len=128, temperature=0)


def test_the_toy_model_has_no_attention_and_reruns_itself():
    cfg = get_model("toy", "tiny")
    module = reference_model(model_specs(cfg), seed=0).eval()
    assert not has_attention(module)
    assert len(sample(module, [1, 2], 300, max_len=256, temperature=0)) == 302  # no max_seq_len to outgrow


# ---- Hugging Face model dirs ----------------------------------------------------------------------
def _tokenizer(path) -> int:
    """A small byte-level BPE with ChatML specials saved as `path`/tokenizer.json; its vocab size."""
    pytest.importorskip("tokenizers")
    return chatml_tokenizer(path, ["what is two plus two", "it is four", "hello there"] * 5, vocab_size=300)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A HF Llama (random weights, float64) with a tokenizer dir beside its weights: ChatML template, eos <|im_end|>."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf")
    vocab = _tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, initializer_range=0.2, eos_token_id=None,
                                   bos_token_id=None)
    transformers.LlamaForCausalLM(cfg).to(torch.float64).save_pretrained(str(d))
    return d


def _hf_greedy(path, ids: list[int], n: int, eos=None) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=eos, pad_token_id=0)
    return out[0].tolist()


def test_a_hf_llama_decodes_to_transformers_greedy_tokens_and_stops_at_the_same_eos(hf_dir, tmp_path):
    module, cfg, saved = load_model(str(hf_dir))
    assert next(module.parameters()).dtype == torch.float64 and saved["stop"] == []
    ours = sample(module, PROMPT, 30, max_len=cfg.max_seq_len, temperature=0)
    theirs = _hf_greedy(hf_dir, PROMPT, 30)
    assert ours == theirs and len(set(ours[len(PROMPT):])) > 5
    eos = ours[len(PROMPT) + 6]  # an eos the model reaches: both stop at its first appearance
    first = ours.index(eos, len(PROMPT)) + 1
    config = json.loads((hf_dir / "config.json").read_text())
    stopping = tmp_path / "eos"
    shutil.copytree(hf_dir, stopping)
    (stopping / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    module, cfg, saved = load_model(str(stopping))
    assert saved["stop"] == [eos]
    stopped = sample(module, PROMPT, 30, max_len=cfg.max_seq_len, temperature=0, stop=saved["stop"])
    assert stopped == ours[:first] == _hf_greedy(hf_dir, PROMPT, 30, eos=eos)


def test_the_command_line_generates_from_a_hf_dir_with_its_tokenizer(hf_dir, capsys):
    from pipekit.data import load_tokenizer

    tok = load_tokenizer(str(hf_dir))
    prompt = "what is two"
    assert main(["generate", str(hf_dir), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"]) == 0
    start = tok.encode(prompt)
    new = _hf_greedy(hf_dir, start, 12, eos=tok.eot)[len(start):]
    new = new[:-1] if new[-1] == tok.eot else new
    assert capsys.readouterr().out == tok.decode(start + new) + "\n"


def test_chat_renders_the_models_template_and_prints_the_reply_alone(hf_dir, capsys):
    from pipekit.data import load_tokenizer

    tok = load_tokenizer(str(hf_dir))
    assert main(["generate", str(hf_dir), "--chat", "--prompt", "hello there", "--max-new-tokens", "10",
                 "--temperature", "0"]) == 0
    start = tok.encode("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n")
    assert start[:1] == [tok.encode("<|im_start|>")[0]] and tok.eot == tok.encode("<|im_end|>")[0]
    new = _hf_greedy(hf_dir, start, 10, eos=tok.eot)[len(start):]
    new = new[:-1] if new[-1] == tok.eot else new
    assert capsys.readouterr().out == tok.decode(new) + "\n"


def test_a_run_dir_is_read_as_its_model_pt(hf_dir, tmp_path, capsys):
    from pipekit.interchange import convert

    (tmp_path / "run").mkdir()
    convert(str(hf_dir), str(tmp_path / "run" / "model.pt"), "from_hf")
    argv = ["--prompt", "it is", "--max-new-tokens", "5", "--temperature", "0", "--tokenizer", str(hf_dir)]
    assert main(["generate", str(tmp_path / "run"), *argv]) == 0
    from_run = capsys.readouterr().out
    assert main(["generate", str(hf_dir), *argv]) == 0
    assert from_run == capsys.readouterr().out and from_run.startswith("it is")


def _one_line(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_requests_are_one_line(hf_dir, tmp_path, capsys):
    said = _one_line(["generate", str(hf_dir), "--prompt", "it is", "--max-new-tokens", "100"], capsys)
    assert "prompt's 2 tokens makes 102, more than the model's max_seq_len=64; give max_new_tokens <= 62" in said, said
    plain = tmp_path / "plain"
    shutil.copytree(hf_dir, plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    said = _one_line(["generate", str(plain), "--chat", "--prompt", "hi"], capsys)
    assert said.startswith("pipekit generate: --chat: ") and "has no chat_template" in said, said
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a model")
    said = _one_line(["generate", str(tmp_path / "notes"), "--prompt", "hi"], capsys)
    assert "is a directory, but neither a pipekit checkpoint" in said, said
    said = _one_line(["generate", str(tmp_path / "notes" / "a.txt"), "--prompt", "hi"], capsys)
    assert "is not a readable pipekit model file" in said, said
    from pipekit.interchange import convert

    convert(str(hf_dir), str(tmp_path / "model.pt"), "from_hf")  # a model.pt that names no tokenizer: bytes
    said = _one_line(["generate", str(tmp_path / "model.pt"), "--chat", "--prompt", "hi"], capsys)
    assert "its tokenizer is the byte tokenizer, which has none; give --tokenizer" in said, said


@pytest.mark.parametrize("kind", ["llama3rope", "qwen2", "qwen3", "mistral"])
def test_hf_llama_variants_decode_to_transformers_greedy_tokens(kind, tmp_path):
    """The KV cache with Llama 3.1's scaled rope (positions past its original context, where the
    scaling acts), Qwen2's q/k/v biases, Qwen3's head norms and wide heads, and Mistral's sliding
    window (6 tokens, 35 generated): the greedy tokens of transformers' own generate."""
    transformers = pytest.importorskip("transformers")
    keys = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=kind == "qwen2",
                initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    config_cls, model_cls, extra = {
        "llama3rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       {"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 2.0, "original_max_position_embeddings": 16}}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**keys, **extra)).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():  # biases and norm weights away from their 0 and 1
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    module, cfg, _ = load_model(str(tmp_path))
    ours = sample(module, PROMPT, 30, max_len=cfg.max_seq_len, temperature=0)
    assert ours == _hf_greedy(tmp_path, PROMPT, 30) and len(set(ours[len(PROMPT):])) > 5
