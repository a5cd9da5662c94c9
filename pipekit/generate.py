"""Sample text from a model saved by `pipekit train` (`out_dir/model.pt`).

One process, the whole model (pp=tp=1), no KV cache: each new token reruns
the model on the last `max_seq_len` tokens, which is fine for the small
models a CPU trains and keeps the code obvious.
"""

from __future__ import annotations

import torch

from .checkpoint import load_full_state_dict
from .config import model_specs
from .pipeline import PipelineModule


def model_config_from(family: str, config: dict):
    """Rebuild the typed model config saved beside the weights."""
    if family == "toy":
        from .models.toy import ToyConfig

        return ToyConfig(**config)
    from .models import config_from_dict

    return config_from_dict(family, config)


def load_model(path: str) -> tuple[PipelineModule, object, dict]:
    """(module, model config, the checkpoint dict) of a saved model.pt, on the CPU."""
    from .models.hf import read_model_file

    ckpt = read_model_file(path)
    mcfg = model_config_from(ckpt["family"], ckpt["config"])
    dtype = next(iter(ckpt["state_dict"].values())).dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        module = PipelineModule(model_specs(mcfg))
    finally:
        torch.set_default_dtype(previous)
    load_full_state_dict(module, ckpt["state_dict"])
    return module.eval(), mcfg, ckpt


@torch.no_grad()
def sample(module: PipelineModule, ids: list[int], max_new_tokens: int, *, max_len: int,
           temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> list[int]:
    """Extend `ids` by `max_new_tokens` sampled tokens (greedy when temperature is 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-max_len:]])
        logits = module(context)[0, -1].double()  # (vocab,)
        if temperature <= 0:
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
    from .data import load_tokenizer

    module, mcfg, ckpt = load_model(path)
    tok = load_tokenizer(ckpt.get("tokenizer"))
    max_len = getattr(mcfg, "max_seq_len", None) or 256
    ids = sample(module, tok.encode(prompt), max_new_tokens, max_len=max_len,
                 temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(ids)
