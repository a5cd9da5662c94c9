"""Sample text from a model: one pipekit trained or one from Hugging Face, in one process,
the whole model (pp=tp=1), on the CPU.

Inputs (`load_model`): a model pipekit saved (`out_dir/model.pt`; a resumable checkpoint,
`checkpoints/step_N`, or the checkpoints root for its newest; or a run directory holding
them: its model.pt, else its checkpoints), read by `pipekit.interchange.read_saved_model`;
or a Hugging Face model dir (config.json with safetensors or .bin weights), built from
`pretrained_config` and filled by `load_pretrained`, in the dtype its config.json names
(float32 when it names none). The tokenizer: the one a pipekit model was trained with
(`tokenizer_name`), a HF dir's own tokenizer.json (and tokenizer_config.json, for --chat),
or the one `tokenizer=` names.

Decoding (`sample`): a model with attention runs with a KV cache (`pipekit.layers.kv_cache`):
the prompt once at positions 0..L-1, then each new token alone at its position, so the
work per new token is one token's forward (plus attention over the cache), not the
whole sequence's. Prompt and new tokens must fit in the model's max_seq_len together: a
longer request is refused before any work (a ValueError saying how many new tokens
fit), never slid along a window. A model without attention (the toy) reruns the model on
the last max_seq_len tokens for each new token, as it always did (it has no positions to
get wrong). Decoding stops after max_new_tokens, or at a stop token: the tokenizer's
end-of-text token (`eot`), and for a HF dir the eos_token_id of its config.json and
generation_config.json. The stop token ends the ids `sample` returns; the text leaves it out.

Chat (`chat=True`, `--chat`): the prompt is one user message rendered by the tokenizer's own
chat template with the generation prompt (transformers' `apply_chat_template`, through
`HFTokenizer.render_chat`), and the text returned is the reply alone. A tokenizer without
a template is a one-line error.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Collection
from contextlib import nullcontext

import torch

from ..checkpoint import load_full_state_dict
from ..data import default_cache_dir, load_tokenizer, read_meta, separator
from ..interchange import load_pretrained, pretrained_config, read_saved_model
from ..layers import CausalSelfAttention
from ..layers.kv_cache import kv_cache
from ..models import config_from_dict, model_specs, model_vocab
from ..pipeline import PipelineModule
from ..precision import default_dtype

_HF_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}


def load_model(path: str) -> tuple[PipelineModule, object, dict]:
    """(module, model config, a record of what was read) of the model at `path`, on the CPU, in
    eval mode. The record is `pipekit.interchange.read_saved_model`'s dict for a model pipekit
    saved; for a HF dir {"family", "hf_dir", "tokenizer" (the dir, when it holds a
    tokenizer.json, else None), "stop" (its eos ids)}."""
    path = run_model(path)
    if is_hf_dir(path):
        return _load_hf(path)
    ckpt = read_saved_model(path)
    mcfg = config_from_dict(ckpt["family"], ckpt["config"])  # every family, the toy's too, through the registry
    dtype = next(iter(ckpt["state_dict"].values())).dtype
    with default_dtype(dtype):
        module = PipelineModule(model_specs(mcfg))
    load_full_state_dict(module, ckpt["state_dict"])
    return module.eval(), mcfg, ckpt


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def run_model(path: str) -> str:
    """The model a run directory holds (its model.pt, else its checkpoints root); any other path as it is."""
    if os.path.isdir(path) and not is_hf_dir(path):
        for name in ("model.pt", "checkpoints"):
            if os.path.exists(os.path.join(path, name)):
                return os.path.join(path, name)
    return path


def _load_hf(path: str) -> tuple[PipelineModule, object, dict]:
    family, mcfg = pretrained_config(path)
    config = _json(os.path.join(path, "config.json"))
    dtype = _HF_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.float32)
    with default_dtype(dtype):
        module = PipelineModule(model_specs(mcfg))
    try:
        load_pretrained(module, path)
    except KeyError as e:  # a tensor the model needs that the files lack: the user's input, in one line
        raise ValueError(str(e.args[0]) if e.args else f"{path} lacks weights the model needs") from e
    stop = [i for f in ("config.json", "generation_config.json")
            for i in _ids(_json(os.path.join(path, f)).get("eos_token_id"))]
    tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    return module.eval(), mcfg, {"family": family, "hf_dir": path, "tokenizer": tokenizer, "stop": stop}


def _json(path: str) -> dict:
    try:
        with open(path) as fh:
            obj = json.load(fh)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    return obj if isinstance(obj, dict) else {}


def _ids(value) -> list[int]:
    """An eos_token_id entry (an int, a list of them, or None) as a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse sampling settings that have no meaning, before any work."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0: greedy)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 1, or 0 for no top-k cut")


def check_fits(n_start: int, max_new_tokens: int, max_len: int) -> None:
    """Refuse a sequence (start + new tokens) longer than the model's max_seq_len (the KV cache's length)."""
    if n_start > max_len:
        raise ValueError(f"the prompt is {n_start} tokens, more than the model's max_seq_len={max_len}; "
                         f"give a shorter prompt")
    if n_start + max_new_tokens > max_len:
        raise ValueError(f"max_new_tokens={max_new_tokens} after the prompt's {n_start} tokens makes "
                         f"{n_start + max_new_tokens}, more than the model's max_seq_len={max_len}; "
                         f"give max_new_tokens <= {max_len - n_start}")


def has_attention(module: torch.nn.Module) -> bool:
    """Whether the model has attention layers, which decode with a KV cache."""
    return any(isinstance(m, CausalSelfAttention) for m in module.modules())


@torch.no_grad()
def sample(module: PipelineModule, ids: list[int], max_new_tokens: int, *, max_len: int,
           temperature: float = 0.8, top_k: int | None = 50, seed: int = 0, stop: Collection[int] = (),
           cache: bool | None = None) -> list[int]:
    """Extend `ids` (at least one) by up to `max_new_tokens` sampled tokens (greedy when
    temperature is 0; top_k 0 or None: no top-k cut), ending early after a token in `stop`.

    `cache` (default: when the model has attention): decode with a KV cache, the sequence
    at most `max_len` tokens (else a ValueError before any work); False: rerun the model on
    the last `max_len` tokens for each new one (the reference the cache is tested against)."""
    check_sampling(max_new_tokens, temperature, top_k)
    if not ids:
        raise ValueError("sampling needs at least one token to start from")
    cached = has_attention(module) if cache is None else cache
    if cached:
        check_fits(len(ids), max_new_tokens, max_len)
    gen = torch.Generator().manual_seed(seed)
    out, fed = list(ids), 0
    with kv_cache(max_len) if cached else nullcontext():
        for _ in range(max_new_tokens):
            if cached:  # the tokens not yet in the cache, at their positions
                positions = torch.arange(fed, len(out)).unsqueeze(0)  # (1, n)
                logits = module((torch.tensor([out[fed:]]), positions))[0, -1]
                fed = len(out)
            else:
                logits = module(torch.tensor([out[-max_len:]]))[0, -1]
            out.append(_pick(logits.double(), temperature, top_k, gen))  # (vocab,)
            if out[-1] in stop:
                break
    return out


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """The next token from the last position's logits (vocab,)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = -float("inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


DEFAULT_NEW_TOKENS = 200  # max_new_tokens=None: this many, or as many as fit in max_seq_len


def generate_text(path: str, prompt: str, max_new_tokens: int | None = None, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, *, chat: bool = False,
                  tokenizer: str | None = None) -> str:
    """The prompt and its continuation (`chat`: the reply alone). An empty prompt starts a new
    document: the model is given the tokenizer's end-of-document separator, which the returned
    text leaves out. `tokenizer` (a tokenizer.json or a tokenizer dir) replaces the model's own.
    `max_new_tokens` None: `DEFAULT_NEW_TOKENS`, or fewer where the model's max_seq_len ends
    first; a number given is taken as asked, or refused when it does not fit (`check_fits`)."""
    check_sampling(max_new_tokens or 0, temperature, top_k)
    module, mcfg, saved = load_model(path)
    name = tokenizer or tokenizer_name(saved)
    tok = load_tokenizer(name)
    if chat:
        start = tok.encode(_render_chat(tok, prompt))
    else:
        start = tok.encode(prompt) if prompt else separator(tok)
    _check_start(start, model_vocab(mcfg), prompt, name)
    stop = {*saved.get("stop", ()), *([tok.eot] if tok.eot is not None else [])}
    max_len = getattr(mcfg, "max_seq_len", None) or 256
    if max_new_tokens is None:
        room = max_len - len(start) if has_attention(module) else DEFAULT_NEW_TOKENS
        max_new_tokens = max(0, min(DEFAULT_NEW_TOKENS, room))
    ids = sample(module, start, max_new_tokens, max_len=max_len,
                 temperature=temperature, top_k=top_k, seed=seed, stop=stop)
    if len(ids) > len(start) and ids[-1] in stop:
        ids = ids[:-1]
    return tok.decode(ids[len(start):] if chat or not prompt else ids)


def _render_chat(tok, prompt: str) -> str:
    """`prompt` as one user message, rendered by the tokenizer's chat template with the generation prompt."""
    if not hasattr(tok, "render_chat"):
        raise ValueError("--chat renders the prompt with the model's chat template, but its tokenizer is the byte "
                         "tokenizer, which has none; give --tokenizer a tokenizer directory with a chat_template")
    try:
        return tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - a template's own errors (jinja) are the user's input too
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--chat: {said}") from e


def tokenizer_name(saved: dict) -> str | None:
    """The tokenizer a saved model was trained with (None: bytes); a HF dir's own (None, with a note
    on stderr, when it has no tokenizer.json). A model.pt names it; for a
    checkpoint it is found as `train.save_weights` finds it for model.pt: the tokenizer in the
    meta.json of the dataset its config's data.source names ("stdlib": the default corpus's
    cache; "synthetic": none). A dataset no longer there gives None, with a note on stderr."""
    if "hf_dir" in saved and saved["tokenizer"] is None:
        print(f"pipekit generate: the Hugging Face model dir {saved['hf_dir']} has no tokenizer.json; using the "
              f"byte tokenizer (give --tokenizer for another)", file=sys.stderr)
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
