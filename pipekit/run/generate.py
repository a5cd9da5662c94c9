"""Sample text from a model saved by `pipekit train`: `out_dir/model.pt`, or a resumable
checkpoint (`checkpoints/step_N`, or the checkpoints root for its newest).

One process, the whole model (pp=tp=1), no KV cache: each new token reruns
the model on the last `max_seq_len` tokens, which is fine for the small
models a CPU trains and keeps the code obvious.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from ..checkpoint import load_full_state_dict
from ..data import default_cache_dir, load_tokenizer, read_meta, separator
from ..interchange import read_saved_model
from ..models import config_from_dict, model_specs, model_vocab
from ..pipeline import PipelineModule
from ..precision import default_dtype


def load_model(path: str) -> tuple[PipelineModule, object, dict]:
    """(module, model config, the saved dict: `pipekit.interchange.read_saved_model`) of a
    model.pt or checkpoint, on the CPU."""
    ckpt = read_saved_model(path)
    mcfg = config_from_dict(ckpt["family"], ckpt["config"])  # every family, the toy's too, through the registry
    dtype = next(iter(ckpt["state_dict"].values())).dtype
    with default_dtype(dtype):
        module = PipelineModule(model_specs(mcfg))
    load_full_state_dict(module, ckpt["state_dict"])
    return module.eval(), mcfg, ckpt


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse sampling settings that have no meaning, before any work."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0: greedy)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 1, or 0 for no top-k cut")


@torch.no_grad()
def sample(module: PipelineModule, ids: list[int], max_new_tokens: int, *, max_len: int,
           temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> list[int]:
    """Extend `ids` (at least one) by `max_new_tokens` sampled tokens (greedy when temperature
    is 0; top_k 0 or None: no top-k cut)."""
    check_sampling(max_new_tokens, temperature, top_k)
    if not ids:
        raise ValueError("sampling needs at least one token to start from")
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-max_len:]])
        logits = module(context)[0, -1].double()  # (vocab,)
        if temperature == 0:
            out.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return out


def generate_text(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0) -> str:
    """The prompt and its continuation. An empty prompt starts a new document: the model is
    given the tokenizer's end-of-document separator, which the returned text leaves out."""
    check_sampling(max_new_tokens, temperature, top_k)
    module, mcfg, ckpt = load_model(path)
    name = tokenizer_name(ckpt)
    tok = load_tokenizer(name)
    start = tok.encode(prompt) if prompt else separator(tok)
    _check_start(start, model_vocab(mcfg), prompt, name)
    max_len = getattr(mcfg, "max_seq_len", None) or 256
    ids = sample(module, start, max_new_tokens, max_len=max_len,
                 temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(ids if prompt else ids[len(start):])


def tokenizer_name(saved: dict) -> str | None:
    """The tokenizer a saved model was trained with (None: bytes). A model.pt names it; for a
    checkpoint it is found as `train.save_weights` finds it for model.pt: the tokenizer in the
    meta.json of the dataset its config's data.source names ("stdlib": the default corpus's
    cache; "synthetic": none). A dataset no longer there gives None, with a note on stderr."""
    if "checkpoint" not in saved:
        return saved.get("tokenizer")
    config = saved["checkpoint"].get("config") or {}
    source = (config.get("data") or {}).get("source")
    if source is None or source == "synthetic":
        return None
    meta = read_meta(default_cache_dir() if source == "stdlib" else source)
    if meta is None and source != "stdlib":  # the stdlib corpus is byte tokens, cached or not
        print(f"pipekit generate: the dataset {os.path.abspath(source)} that checkpoint {saved.get('path')} was "
              f"trained on is gone or incomplete; using the byte tokenizer", file=sys.stderr)
    return meta.get("tokenizer") if meta else None


def _check_start(ids: list[int], vocab: int, prompt: str, tokenizer: str | None) -> None:
    """The tokens the model starts from: at least one, each below its vocab_size (else the embedding fails)."""
    what = f"the prompt {prompt!r}" if prompt else "the end-of-document separator that starts an empty prompt"
    how = f"tokenizer {tokenizer}" if tokenizer else "byte tokenizer (the model was saved without a tokenizer)"
    if not ids:
        raise ValueError(f"{what} is no tokens under the {how}; give a longer prompt")
    if max(ids) >= vocab:
        raise ValueError(f"{what} has token ids up to {max(ids)} under the {how}, but the model's vocab_size is "
                         f"{vocab}; give a prompt whose tokens are all below {vocab}")
