"""Tokenised memmap datasets, the byte tokenizer and the built-in default corpus.

The plan, nanoGPT-style:

1. `prepare_data` reads text files and JSONL files. A text file is one *document*;
   a JSONL file holds one document per line: `{"text": ...}`, `{"prompt": ...,
   "response": ...}` or a chat `{"messages": [{"role": ..., "content": ...}, ...]}`
   (rendered by the tokenizer's own chat template). Each document is tokenised, gets
   the tokenizer's end-of-document separator appended, and the documents are written
   one after another into `train.bin` and `val.bin` (raw native-endian arrays that
   `np.memmap` opens directly), their end offsets into `train.docs.bin` /
   `val.docs.bin` (int64), plus `meta.json` (which records each file's size and CRC-32:
   the fingerprint that `pipekit train` checks at start and a checkpoint keeps).
   Instruction data (prompt/response and chat lines) also gets a **loss mask**,
   `train.mask.bin` / `val.mask.bin` (uint8, one per token: 1 where the token is trained
   on, 0 on prompts and on the turns that are not the assistant's); a dataset with no
   such line has no mask. The split is by document, so validation text is held out,
   never a window of training text.
2. `TokenDataset` memmaps one split (tokens, and the mask and document ends when
   there are some); nothing is read until it is sampled.
3. `BatchSampler` makes each step's global batch from a generator seeded by
   `(seed, step)` only, and dp rank `r` keeps rows `[r*b, (r+1)*b)`. So every
   layout (any dp) sees the same global batches, and resuming at step k needs
   nothing but k. Unpacked (the default), a row is a random window of
   `seq_len + 1` tokens of the stream (crossing documents); packed
   (`pack=True`), a row holds whole documents and the inputs carry each token's
   position in its document (see `BatchSampler`). Labels are -100 where the
   mask is 0 (the label of position t is token t+1, so the mask of token t+1).

With no data configured, `default_corpus_dir()` gives the Python standard
library's own source (about 730 files, 12 MB of bytes on CPython 3.11), prepared
with the byte tokenizer on first use and cached.

Limits: each input file is read into memory whole (a JSONL file line by line);
unpacked, windows are drawn with replacement and may cross document boundaries
(the separator token marks those); packed, documents are drawn with replacement
(no epochs); text files are read as UTF-8 and skipped (and counted) when they are
not, while a JSONL line that is not UTF-8 JSON of a known form is an error naming
the file and the line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import sysconfig
import tempfile
import time
import zlib
from typing import Any

import numpy as np
import torch

from .atomic import publish, remove, write_atomic

FORMAT = 1  # bump when the on-disk layout changes; older caches are rebuilt
TEXT_SUFFIXES = (".py", ".txt", ".md", ".jsonl")  # what a directory input contributes
CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles a chat line's messages may have
IGNORE_INDEX = -100  # the label of a token not trained on (masked, padding): what the losses ignore
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".venv", "node_modules"}
_EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


# ---- tokenizers ---------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to train, lossless for any text.

    `eot = 0`: documents are joined by one NUL byte (0x00), a token that text
    files practically never contain, so a model can learn where documents end;
    `decode` renders it as "\\x00"."""

    vocab_size = 256
    eot = 0
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace tokenizer behind the ByteTokenizer interface: a `tokenizers` JSON file,
    or a Hugging Face tokenizer directory (its tokenizer.json, and tokenizer_config.json
    with the `chat_template` that `render_chat` uses, loaded offline by transformers).

    No special tokens are added when encoding. `eot` is the id of a directory's
    `eos_token` (tokenizer_config.json) when the vocabulary has it, else that of the
    first of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`, `<|eos|>`, `[SEP]`
    that the vocabulary has; when it has none, `eot` is None and documents are
    joined by the encoding of "\\n\\n" instead."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"tokenizer {path!r} needs the HuggingFace `tokenizers` package: pip install tokenizers",
                              name="tokenizers") from e
        self.dir = path if os.path.isdir(path) else None
        file = os.path.join(path, "tokenizer.json") if self.dir else path
        if self.dir and not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer directory {path!r} has no tokenizer.json (want a HuggingFace "
                                    "tokenizer.json, or a directory holding one; without one, byte tokens)")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer file {path!r} does not exist (want a HuggingFace tokenizer.json, "
                                    "or a directory holding one; without one, byte tokens)")
        self.name = os.path.abspath(path)
        try:
            self.tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises a bare Exception
            raise ValueError(f"tokenizer file {file!r} is not a HuggingFace tokenizer.json "
                             f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from e
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = (*([_config_eos(self.dir)] if self.dir else []), *_EOT_NAMES)
        ids = (self.tok.token_to_id(t) for t in names if t)
        self.eot = next((i for i in ids if i is not None), None)
        self._chat: Any = None  # the transformers tokenizer, loaded by the first `render_chat`

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each one's (start, end) character span in it."""
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """`messages` rendered as text by the tokenizer's chat template (transformers'
        `apply_chat_template(tokenize=False)`); ValueError when there is no template."""
        if self._chat is None:
            self._chat = _chat_tokenizer(self)
        return self._chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _config_eos(directory: str) -> str | None:
    """The `eos_token` that a tokenizer directory's tokenizer_config.json names, if any."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as fh:
            eos = json.load(fh).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def _chat_tokenizer(tok: HFTokenizer):
    """The transformers tokenizer of `tok`'s directory, loaded offline, that has a chat template."""
    how = ("chat lines are rendered by the tokenizer's chat template: give --tokenizer a HuggingFace "
           "tokenizer directory (tokenizer.json + tokenizer_config.json with chat_template)")
    if tok.dir is None:
        raise ValueError(f"tokenizer {tok.name} is a tokenizer.json file, which has no chat template; {how}")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"chat lines need the `transformers` package to render the chat template of {tok.name}: "
                          "pip install transformers", name="transformers") from e
    try:
        chat = AutoTokenizer.from_pretrained(tok.dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tokenizer directory {tok.dir!r} does not load in transformers ({said})") from e
    if not getattr(chat, "chat_template", None):
        raise ValueError(f"tokenizer directory {tok.dir!r} has no chat_template; {how}")
    return chat


def load_tokenizer(path: str | None):
    """None (or "byte") -> ByteTokenizer; a path -> HFTokenizer of that JSON file or directory."""
    if path is None or path == "byte":
        return ByteTokenizer()
    return HFTokenizer(path)


def separator(tok) -> list[int]:
    """The tokens appended after every document: `[tok.eot]`, or "\\n\\n" encoded when eot is None."""
    return [tok.eot] if tok.eot is not None else tok.encode("\n\n")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint8, uint16 or uint32."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size={vocab_size} does not fit in uint32 (at most {2**32} ids)")


# ---- preparing a dataset -------------------------------------------------------


def list_files(inputs: list[str]) -> list[str]:
    """The files that `inputs` name, in a deterministic order.

    A file is taken whatever its name; a directory contributes every file below
    it (recursively, sorted) whose name ends in .py, .txt or .md, skipping
    hidden directories, __pycache__, .venv and node_modules. Duplicates count once."""
    files: list[str] = []
    for path in inputs:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            files.extend(_walk(path, TEXT_SUFFIXES))
        else:
            raise FileNotFoundError(f"data input {path!r} is neither a file nor a directory")
    unique: dict[str, str] = {}
    for f in files:
        unique.setdefault(os.path.realpath(f), f)
    return list(unique.values())


def _walk(root: str, suffixes: tuple[str, ...], skip: set[str] = _SKIP_DIRS) -> list[str]:
    out: list[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip and not x.startswith("."))
        out.extend(os.path.join(d, n) for n in sorted(names) if n.endswith(suffixes))
    return out


def _read_text(path: str) -> str | None:
    """The file's text, or None when it is not UTF-8."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError:
        return None


def _is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl")


def _documents(files: list[str], val_fraction: float, seed: int, stats: dict, encoder: _Encoder):
    """Yield (ids, mask or None, held_out) per document, one file (or JSONL line) at a time;
    count files used and skipped, and JSONL lines of each form, in `stats`.

    A text file is one document, a JSONL file one per line that is not blank. The split
    is drawn over the documents before reading (the JSONL files' lines counted first),
    so an undecodable text file leaves its slot (train or val) empty. A single text
    file is split at its tail."""
    counts = [_count_lines(f) if _is_jsonl(f) else 1 for f in files]
    single_text = len(files) == 1 and not _is_jsonl(files[0]) and val_fraction > 0
    is_val = None if single_text else split_documents(sum(counts), val_fraction, seed)
    at = empty = undecodable = 0
    for path, count in zip(files, counts):
        if _is_jsonl(path):
            stats["n_files"] += 1
            lines = 0
            for i, (lineno, obj) in enumerate(_jsonl_lines(path)):
                lines += 1
                ids, mask, kind = encoder.line(obj, f"{path}:{lineno}")
                stats.setdefault("jsonl_lines", {"text": 0, "prompt_response": 0, "chat": 0})[kind] += 1
                assert is_val is not None  # only a single text file has no split drawn
                yield ids, mask, bool(is_val[at + i])
            at += count
            empty += lines == 0
            continue
        text = _read_text(path)
        empty += text == ""  # nothing to learn from: skipped as an undecodable file is
        undecodable += text is None
        stats["n_files" if text else "n_skipped"] += 1
        at += 1
        if not text:
            continue
        if is_val is None:
            for part, held_out in zip(*_split_single(text, val_fraction)):
                yield encoder.text(part), None, held_out
        else:
            yield encoder.text(text), None, bool(is_val[at - 1])
    if not stats["n_files"] or empty == len(files):
        raise ValueError(f"no UTF-8 text among {len(files)} file{'s' if len(files) > 1 else ''} "
                         f"({undecodable} undecodable, {empty} empty): nothing to prepare")


def _count_lines(path: str) -> int:
    """The lines of a JSONL file that are not blank: its documents."""
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _jsonl_lines(path: str):
    """Yield (line number, JSON object) for each line of `path` that is not blank; a line
    that is not UTF-8 JSON of an object is a ValueError naming the file and the line."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                raise ValueError(f"{where}: the line is not UTF-8") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: a line must be a JSON object ({_FORMS}), got a {type(obj).__name__}")
            yield lineno, obj


_FORMS = '{"text": ...}, {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}'


class _Encoder:
    """Documents as (token ids with the separator appended, loss mask or None), in the dataset's dtype.

    `text(t)`: a text document, no mask (every token is trained on). `line(obj, where)`
    encodes a JSONL line and says its form (text, prompt_response, chat): a prompt and
    its response are encoded apart and joined, the mask 0 on the prompt and 1 on the
    response and the separator; a chat is rendered by the tokenizer's chat template
    and encoded whole, the mask 1 on the characters of the assistant's messages
    (found by rendering the conversation prefix by prefix: an assistant message's part
    is what it adds after the template's generation prompt for it) and 0 elsewhere;
    the separator is appended unless the rendering already ends with it, and is
    trained on when the last message is the assistant's. Errors name `where`."""

    def __init__(self, tok, dtype: np.dtype):
        self.tok, self.dtype = tok, dtype
        self.sep = np.asarray(separator(tok), dtype=dtype)

    def ids(self, text: str, where: str = "") -> np.ndarray:
        if isinstance(self.tok, ByteTokenizer):
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype, copy=False)
        return self._checked(self.tok.encode(text), where)

    def _checked(self, ids: list[int], where: str) -> np.ndarray:
        top = max(ids, default=-1)
        if top >= self.tok.vocab_size:
            raise ValueError(f"{where + ': ' if where else ''}tokenizer {self.tok.name} gave id {top}, beyond its "
                             f"vocabulary of {self.tok.vocab_size}")
        return np.asarray(ids, dtype=self.dtype)

    def text(self, text: str) -> np.ndarray:
        return np.concatenate([self.ids(text), self.sep])

    def line(self, obj: dict, where: str) -> tuple[np.ndarray, np.ndarray | None, str]:
        if "messages" in obj:
            ids, mask = self.chat(obj["messages"], where)
            return ids, mask, "chat"
        if "prompt" in obj or "response" in obj:
            prompt, response = (_string(obj, key, where) for key in ("prompt", "response"))
            p, r = self.ids(prompt, where), self.ids(response, where)
            mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r) + len(self.sep), np.uint8)])
            return np.concatenate([p, r, self.sep]), mask, "prompt_response"
        if "text" in obj:
            return np.concatenate([self.ids(_string(obj, "text", where), where), self.sep]), None, "text"
        if {"role", "content", "conversations", "conversation", "turns"} & set(obj):
            raise ValueError(f"{where}: a chat line needs `messages`, a list of {{role, content}} objects "
                             f"(got keys {sorted(obj)})")
        raise ValueError(f"{where}: no known keys (got {sorted(obj)}); a line is {_FORMS}")

    def chat(self, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{where}: message {j} needs a role and a content (got "
                                 f"{sorted(m) if isinstance(m, dict) else type(m).__name__})")
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"{where}: message {j} has role {m['role']!r}; known roles: {', '.join(CHAT_ROLES)}")
            if not isinstance(m["content"], str):
                raise ValueError(f"{where}: message {j}'s content must be a string, got {type(m['content']).__name__}")
        spans, prev = [], ""
        for j, m in enumerate(messages):
            cur = self._render(messages[: j + 1], False, where)
            if not cur.startswith(prev):
                raise ValueError(f"{where}: the chat template does not render the conversation prefix by prefix (the "
                                 f"text before message {j} changes when it is added), so its assistant tokens "
                                 "cannot be found")
            if m["role"] == "assistant":
                head = self._render(messages[:j], True, where) if j else prev
                start = len(head) if cur.startswith(head) and len(head) >= len(prev) else len(prev)
                spans.append((start, len(cur)))
            prev = cur
        ids, offsets = self.tok.encode_offsets(prev)
        starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        out = self._checked(ids, where)
        n = len(self.sep)
        if len(out) >= n and np.array_equal(out[len(out) - n:], self.sep):
            return out, mask
        last = 1 if messages[-1]["role"] == "assistant" else 0
        return np.concatenate([out, self.sep]), np.concatenate([mask, np.full(n, last, np.uint8)])

    def _render(self, messages: list, generation_prompt: bool, where: str) -> str:
        if not isinstance(self.tok, HFTokenizer):
            raise ValueError(f"{where}: a chat line is rendered by the tokenizer's chat template, but the byte "
                             "tokenizer has none; give --tokenizer a HuggingFace tokenizer directory "
                             "(tokenizer.json + tokenizer_config.json with chat_template)")
        try:
            return self.tok.render_chat(messages, add_generation_prompt=generation_prompt)
        except (ValueError, ImportError) as e:
            if getattr(e, "name", None) == "transformers" or "chat template" in str(e) or "chat_template" in str(e):
                raise type(e)(f"{where}: {e}") from e
            raise ValueError(f"{where}: the chat template refused this conversation ({_first_line(e)})") from e
        except Exception as e:  # noqa: BLE001 - jinja's errors (raise_exception in a template, ...)
            raise ValueError(f"{where}: the chat template refused this conversation ({_first_line(e)})") from e


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        other = "response" if key == "prompt" else "prompt"
        raise ValueError(f"{where}: a line with `{other}` needs `{key}` too")
    if not isinstance(obj[key], str):
        raise ValueError(f"{where}: `{key}` must be a string, got {type(obj[key]).__name__}")
    return obj[key]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the documents held out for validation.

    round(val_fraction * n_docs) documents, chosen by a generator seeded with
    `seed`; at least one when val_fraction > 0, and never all of them."""
    _check_fraction(val_fraction)
    n_val = round(val_fraction * n_docs)
    if val_fraction > 0:
        n_val = min(max(n_val, 1), n_docs - 1)
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")


def _split_single(text: str, val_fraction: float) -> tuple[list[str], np.ndarray]:
    """One document only: hold out its last val_fraction (from a line start), nanoGPT-shakespeare style."""
    cut = min(int(len(text) * (1 - val_fraction)), max(len(text) - 1, 0))
    nl = text.find("\n", max(cut - 1, 0))
    cut = nl + 1 if 0 <= nl < len(text) - 1 else cut
    return [text[:cut], text[cut:]], np.array([False, True])


def prepare_data(
    inputs: list[str],
    out_dir: str,
    tokenizer: str | None = None,
    val_fraction: float = 0.01,
    seed: int = 0,
    *,
    source: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Tokenise `inputs` (files or directories, see `list_files`) into `out_dir`; return the meta dict.

    Each text file is one document, and each line of a JSONL file (`*.jsonl`:
    `{"text"}`, `{"prompt", "response"}` or `{"messages"}`, see `_Encoder`): its tokens,
    then `separator(tok)`. Documents keep their order and go to `train.bin` or `val.bin`
    by `split_documents` (a single text file is split at its last val_fraction instead);
    their end offsets go to `*.docs.bin` (int64), and when a prompt/response or chat line
    is among them, the loss mask of every token to `*.mask.bin` (uint8; text documents
    all 1), `meta["mask"]` saying so. Files are read and written one at a time (JSONL
    line by line), so memory holds one file. A malformed JSONL line is a ValueError
    naming the file and the line. Writes go to
    temporary names in `out_dir` and are renamed at the end, `meta.json` last
    (after removing any old one), so a dataset is complete exactly when its
    meta.json exists; a killed run leaves no meta.json (and maybe a stray
    `.*.tmp` file). Bad arguments (inputs, tokenizer, out_dir, fraction, seed)
    are refused before `out_dir` is made, and a run that fails later (no
    readable text) removes the directories it made. `source` is the description
    kept in meta (default: the inputs). Without `overwrite`, any file it would
    write or remove (meta.json, each split's .bin, .docs.bin, .mask.bin) already in
    `out_dir` is a FileExistsError naming it, before anything is read or written, and
    none is replaced later either (see `_write_splits`). `meta["files"]` records each
    file's size and CRC-32: the dataset's fingerprint (`check_files`)."""
    _check_fraction(val_fraction)
    _check_seed(seed)
    _check_out_dir(out_dir)
    if not overwrite:
        _refuse_existing(out_dir)
    files = list_files(inputs)
    if not files:
        rule = ", ".join("*" + s for s in TEXT_SUFFIXES)
        raise ValueError(f"no input files in {inputs} (a directory contributes {rule} below it)")
    tok = load_tokenizer(tokenizer)
    try:
        dtype = token_dtype(tok.vocab_size)
    except ValueError as e:
        raise ValueError(f"tokenizer {tok.name}: {e}") from None
    encoder = _Encoder(tok, dtype)
    sep = encoder.sep
    stats: dict = {"n_files": 0, "n_skipped": 0}
    docs = _documents(files, val_fraction, seed, stats, encoder)
    with _made_dir(out_dir):
        n_tokens, n_docs, has_mask, written = _write_splits(out_dir, docs, overwrite)
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "eot": tok.eot,
        "separator": sep.tolist(),
        "n_tokens": n_tokens,
        "n_docs": n_docs,
        "mask": has_mask,  # {split}.mask.bin: uint8 per token, 0 where not trained on
        "doc_ends": True,  # {split}.docs.bin: int64 end offset of each document
        "files": written,  # each file's size and CRC-32: the dataset's fingerprint (`check_files`)
        **stats,
        "source": source if source is not None else ", ".join(map(str, inputs)),
        "val_fraction": val_fraction,
        "seed": seed,
    }
    write_atomic(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=2), replace=overwrite)
    return meta


OUTPUTS = tuple(f"{split}.{name}" for split in ("train", "val") for name in ("bin", "docs.bin", "mask.bin"))


def _refuse_existing(out_dir: str) -> None:
    """FileExistsError naming the first file of `out_dir` that prepare-data would write or remove."""
    for name in ("meta.json", *OUTPUTS):
        path = os.path.join(out_dir, name)
        if os.path.lexists(path):
            held = "a prepared dataset (meta.json)" if name == "meta.json" else name
            raise FileExistsError(f"{out_dir!r} already holds {held}; choose another --out, or pass --overwrite "
                                  f"to replace it")


def _check_seed(seed: int) -> None:
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def _check_out_dir(out_dir: str) -> None:
    """`out_dir` is a directory or can be made one: checked before anything is read or written."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"out_dir {out_dir!r} is a file; give a directory for train.bin, val.bin and meta.json")
    _, existing = _missing_dirs(out_dir)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"out_dir {out_dir!r} cannot be created: {existing!r} is a file")


def _missing_dirs(path: str) -> tuple[list[str], str]:
    """The directories that making `path` would create (deepest first), and its nearest existing part."""
    missing, d = [], os.path.abspath(path)
    while not os.path.exists(d):
        missing.append(d)
        d = os.path.dirname(d)
    return missing, d


@contextlib.contextmanager
def _made_dir(path: str):
    """Make `path` (and missing parents) for the body; if the body fails, remove the directories
    made here again, so a failed run leaves no empty output behind (existing ones stay)."""
    made, _ = _missing_dirs(path)
    os.makedirs(path, exist_ok=True)
    try:
        yield
    except BaseException:
        for d in made:  # deepest first; stops at one that is not empty
            try:
                os.rmdir(d)
            except OSError:
                break
        raise


def _write_splits(out_dir: str, docs, overwrite: bool = False) -> tuple[dict, dict, bool, dict]:
    """Stream the encoded (ids, mask, held_out) documents into temp files, then rename them to
    {split}.bin, {split}.docs.bin and (when some document has a mask) {split}.mask.bin.

    Returns tokens and documents per split, whether there is a mask, and each file's
    `{"size", "crc32"}` (summed as it is written: no second read). Nothing is renamed if
    `docs` raises. With `overwrite`, files here are replaced (meta.json removed first, so
    the mix a crash in between leaves is no dataset) and an older mask file the new dataset
    lacks is removed; without it, a file that appeared meanwhile is not replaced: the
    files published so far are removed again and FileExistsError names it."""
    splits, names = ("train", "val"), ["bin", "docs.bin"]
    tmps: dict = {}
    sums: dict = {}
    n_tokens, n_docs = {"train": 0, "val": 0}, {"train": 0, "val": 0}

    def temp(split: str, name: str):
        fd, tmps[(split, name)] = tempfile.mkstemp(dir=out_dir, prefix=f".{split}.{name}.", suffix=".tmp")
        sums[(split, name)] = [0, 0]  # size, crc32
        return os.fdopen(fd, "wb")

    def put(key: tuple, data: bytes) -> None:
        files[key].write(data)
        sums[key][0] += len(data)
        sums[key][1] = zlib.crc32(data, sums[key][1])

    files: dict = {}
    published: list[str] = []
    try:
        files = {(split, name): temp(split, name) for split in splits for name in names}
        for ids, mask, held_out in docs:
            split = "val" if held_out else "train"
            if mask is not None and (split, "mask.bin") not in files:  # the first mask: the ones before it
                for sp in splits:
                    files[(sp, "mask.bin")] = temp(sp, "mask.bin")
                    put((sp, "mask.bin"), np.ones(n_tokens[sp], np.uint8).tobytes())
                names.append("mask.bin")
            put((split, "bin"), ids.tobytes())
            if "mask.bin" in names:
                put((split, "mask.bin"), (np.ones(len(ids), np.uint8) if mask is None else mask).tobytes())
            n_tokens[split] += len(ids)
            n_docs[split] += 1
            put((split, "docs.bin"), np.asarray([n_tokens[split]], dtype=np.int64).tobytes())
        for fh in files.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        if overwrite:
            remove(os.path.join(out_dir, "meta.json"))  # the dataset is incomplete from here on
        for (split, name), tmp in tmps.items():
            path = os.path.join(out_dir, f"{split}.{name}")
            publish(tmp, path, replace=overwrite)
            published.append(path)
        if overwrite and "mask.bin" not in names:
            for split in splits:
                remove(os.path.join(out_dir, f"{split}.mask.bin"))
    except FileExistsError as e:
        for path in published:  # ours: none of them was there when we began
            remove(path)
        raise FileExistsError(f"{out_dir!r} got a {os.path.basename(e.filename2 or '?')} from elsewhere while "
                              "preparing; choose another --out, or pass --overwrite to replace it") from None
    finally:
        for fh in files.values():
            fh.close()
        for tmp in tmps.values():
            remove(tmp)
    written = {f"{split}.{name}": {"size": size, "crc32": f"{crc:08x}"} for (split, name), (size, crc) in sums.items()}
    return n_tokens, n_docs, "mask.bin" in names, dict(sorted(written.items()))


def read_meta(data_dir: str) -> dict | None:
    """meta.json of a complete dataset whose files have the sizes it records; else None."""
    try:
        with open(os.path.join(data_dir, "meta.json")) as fh:
            meta = json.load(fh)
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split, n in meta["n_tokens"].items():
            sizes = {"bin": n * itemsize}
            if meta.get("mask"):
                sizes["mask.bin"] = n
            if meta.get("doc_ends"):
                sizes["docs.bin"] = meta["n_docs"][split] * 8
            for name, size in sizes.items():
                if os.path.getsize(os.path.join(data_dir, f"{split}.{name}")) != size:
                    return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if meta.get("format") == FORMAT else None


class DataChanged(ValueError):
    """A dataset's files are not the ones its meta.json describes; the message names the file."""


def check_files(data_dir: str, meta: dict) -> dict | None:
    """Read every file of `meta["files"]` whole and check its size and CRC-32; return the
    fingerprint (`meta["files"]`), or None for a dataset prepared without one (an older
    pipekit: nothing to check). DataChanged names the first file that differs.
    Costs one sequential read of the dataset: ~15 ms for the 12 MB stdlib corpus (page-cached)."""
    recorded = meta.get("files")
    if not recorded:
        return None
    for name, want in recorded.items():
        path = os.path.join(data_dir, name)
        try:
            size, crc = _crc32(path)
        except OSError as e:
            raise DataChanged(f"{path} is listed in its meta.json but cannot be read ({e.strerror}); "
                              f"run `pipekit prepare-data ... --out {data_dir} --overwrite` again") from None
        if (size, f"{crc:08x}") != (want["size"], want["crc32"]):
            how = f"{size} bytes, meta.json says {want['size']}" if size != want["size"] else "its CRC-32 differs"
            raise DataChanged(f"{path} is not the file its meta.json describes ({how}): it changed after "
                              f"`pipekit prepare-data`; prepare the dataset again (--overwrite)")
    return recorded


def _crc32(path: str, chunk: int = 8 << 20) -> tuple[int, int]:
    """(size, CRC-32) of the file at `path`, read `chunk` bytes at a time."""
    size = crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            size += len(block)
            crc = zlib.crc32(block, crc)
    return size, crc


def unfingerprinted(data_dir: str) -> str:
    """The notice for a dataset prepared without a fingerprint (an older pipekit)."""
    return (f"pipekit: {data_dir} was prepared without a fingerprint (an older pipekit), so a change to its files "
            "cannot be noticed; `pipekit prepare-data ... --overwrite` adds one")


# ---- the default corpus: the Python standard library's source --------------------


def stdlib_files(root: str) -> list[str]:
    """The *.py files under `root`, without site-packages, dist-packages and test directories."""
    skip = _SKIP_DIRS | {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return _walk(root, (".py",), skip)


def default_cache_dir() -> str:
    """`$PIPEKIT_CACHE/stdlib-X.Y.Z`, or `~/.cache/pipekit/stdlib-X.Y.Z` when PIPEKIT_CACHE is unset."""
    root = os.environ.get("PIPEKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pipekit")
    return os.path.join(root, "stdlib-" + ".".join(map(str, sys.version_info[:3])))


def default_corpus_dir(cache_dir: str | None = None, *, source_dir: str | None = None) -> str:
    """The prepared default corpus (byte tokens of the stdlib's *.py source); prepares it on first use.

    `cache_dir` is the dataset directory itself (default `default_cache_dir()`);
    `source_dir` the library to read (default `sysconfig.get_paths()["stdlib"]`).
    A cached dataset is reused when its meta.json names the same source and its
    files have the recorded sizes. Safe for many processes at once: the first to
    take an flock on `cache_dir/.lock` prepares, the others wait and reuse it.
    CPython 3.11: ~730 files, ~12 M tokens (uint8, ~12 MB), a few seconds."""
    cache_dir = cache_dir or default_cache_dir()
    source_dir = source_dir or sysconfig.get_paths()["stdlib"]
    source = f"python stdlib source *.py (no tests, no site-packages) of {source_dir}"
    if _has_corpus(cache_dir, source):
        return cache_dir
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _has_corpus(cache_dir, source):
            _prepare_stdlib(source_dir, cache_dir, source)
    return cache_dir


def source_dir(source: str) -> str | None:
    """The dataset directory that `data.source` names, without preparing anything: None for
    synthetic data, the default corpus's cache for stdlib, else the path itself."""
    if source == "synthetic":
        return None
    return default_cache_dir() if source == "stdlib" else source


def fingerprint(source: str) -> dict | None:
    """The fingerprint (each file's size and CRC-32) that the meta.json of `data.source`'s
    dataset records, as it stands now; None without a complete fingerprinted dataset there."""
    path = source_dir(source)
    meta = read_meta(path) if path else None
    return meta.get("files") if meta else None


def _has_corpus(cache_dir: str, source: str) -> bool:
    """Whether the cache holds this source's corpus, whole: one prepared before documents' ends
    or fingerprints were kept is prepared again, and so is one whose files changed (said)."""
    meta = read_meta(cache_dir)
    if meta is None or meta.get("source") != source or not (meta.get("doc_ends") and meta.get("files")):
        return False
    try:
        check_files(cache_dir, meta)
    except DataChanged as e:
        print(f"pipekit: the default corpus cache is damaged ({e}); preparing it again", file=sys.stderr, flush=True)
        return False
    return True


def _prepare_stdlib(source_dir: str, cache_dir: str, source: str) -> None:
    print(f"pipekit: preparing the default corpus ({source}) in {cache_dir} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    meta = prepare_data(stdlib_files(source_dir), cache_dir, source=source, overwrite=True)
    n = sum(meta["n_tokens"].values())
    print(f"pipekit: {meta['n_files']} files, {n:,} tokens in {time.perf_counter() - start:.1f}s",
          file=sys.stderr, flush=True)


# ---- reading and sampling -----------------------------------------------------------


class TokenDataset:
    """One split of a prepared dataset, memory-mapped read-only (nothing is loaded up front):
    `tokens`, `mask` (uint8 per token, or None: every token is trained on) and `doc_ends`
    (int64 end offset of each document, or None for a dataset prepared before they were kept)."""

    def __init__(self, data_dir: str, split: str = "train"):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        meta = read_meta(data_dir)
        if meta is None:
            raise FileNotFoundError(
                f"no complete prepared dataset in {data_dir!r} "
                "(meta.json missing, stale or not matching the .bin sizes); run `pipekit prepare-data`"
            )
        self.data_dir, self.split, self.meta = data_dir, split, meta
        self.vocab_size = int(meta["vocab_size"])
        self.n_tokens = int(meta["n_tokens"][split])
        self.tokens = _open(data_dir, f"{split}.bin", np.dtype(meta["dtype"]), self.n_tokens)
        self.mask = self.doc_ends = None
        if meta.get("mask"):
            self.mask = _open(data_dir, f"{split}.mask.bin", np.dtype(np.uint8), self.n_tokens)
        if meta.get("doc_ends"):
            self.doc_ends = _open(data_dir, f"{split}.docs.bin", np.dtype(np.int64), int(meta["n_docs"][split]))

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (f"TokenDataset({self.data_dir!r}, split={self.split!r}, n_tokens={self.n_tokens}, "
                f"vocab_size={self.vocab_size})")


def _open(data_dir: str, name: str, dtype: np.dtype, n: int) -> np.ndarray:
    # np.memmap refuses empty files; an empty split is a legal (if unusable) array
    return np.memmap(os.path.join(data_dir, name), dtype=dtype, mode="r") if n else np.empty(0, dtype)


class BatchSampler:
    """Endless `(inputs, labels)` int64 batches of shape (global_batch // dp_size, seq_len) for one dp rank.

    Unpacked (the default): step k's global batch is `global_batch` windows of
    seq_len+1 tokens whose starts come from `np.random.default_rng([seed, k])`
    (uniform, with replacement); inputs are a window's first seq_len tokens and
    labels its last seq_len, -100 where the dataset's mask is 0.

    Packed (`pack=True`): the inputs are a pair `(tokens, positions)` and each row
    holds whole documents, none crossing rows. Step k draws documents from
    `np.random.default_rng([seed, k])` (uniform over the split's documents of two
    tokens or more, with replacement) and places each, in the order drawn, in the first
    row with room for it (first fit); the first that fits in no row ends the batch. A
    document of n tokens takes n-1 places (inputs its tokens but the last, labels its
    tokens but the first); one longer than seq_len is cut into pieces of seq_len
    places, each a document of its own. `positions` restart at 0 at each document,
    which is how the model finds the boundaries (attention stays inside a document);
    the rest of a row is padding: token 0, labels -100, positions 0, 1, ... (a
    document of its own that no label reads).

    Rank r keeps rows [r*b, (r+1)*b), b = global_batch // dp_size, so the
    concatenation over ranks is the same for every dp_size. The sampler is its own
    iterator; `step` is the step of the next batch, `start_step=k` (or
    `load_state_dict`) resumes exactly there. For a periodic validation loss, build
    a fresh sampler on the val split each time: the same seed gives the same
    validation batches, so the losses are comparable."""

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        start_step: int = 0,
        pack: bool = False,
    ):
        _check_batch(dataset, global_batch, seq_len, dp_rank, dp_size, start_step, pack)
        self.dataset, self.global_batch, self.seq_len = dataset, global_batch, seq_len
        self.dp_rank, self.dp_size, self.seed, self.step = dp_rank, dp_size, seed, start_step
        self.local_batch = global_batch // dp_size
        self.pack = pack
        if pack:
            self._doc_starts, self._doc_places = _packable_documents(dataset)

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of `step` (every rank computes all of them; unpacked)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.dataset.n_tokens - self.seq_len, size=self.global_batch)

    def batch(self, step: int):
        """This rank's (inputs, labels) of `step`, without moving the sampler."""
        if self.pack:
            return self._packed(step)
        mine = self.starts(step)[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        at = mine[:, None] + np.arange(self.seq_len + 1)  # (b, seq_len + 1)
        windows = torch.from_numpy(self.dataset.tokens[at].astype(np.int64))
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.dataset.mask is not None:  # the label of position t is token t+1: its mask
            labels = labels.masked_fill(torch.from_numpy(self.dataset.mask[at[:, 1:]] == 0), IGNORE_INDEX)
        return inputs, labels

    def plan(self, step: int) -> list[list[tuple[int, int]]]:
        """The packed global batch of `step`: per row, its pieces as (first token, places)."""
        rng = np.random.default_rng([self.seed, step])
        free = np.full(self.global_batch, self.seq_len)
        rows: list[list[tuple[int, int]]] = [[] for _ in range(self.global_batch)]
        while True:
            for d in rng.integers(0, len(self._doc_places), size=_DRAWS):
                start, places = int(self._doc_starts[d]), int(self._doc_places[d])
                for off in range(0, places, self.seq_len):
                    n = min(self.seq_len, places - off)
                    r = int(np.argmax(free >= n))
                    if free[r] < n:
                        return rows
                    rows[r].append((start + off, n))
                    free[r] -= n

    def _packed(self, step: int):
        b, S = self.local_batch, self.seq_len
        rows = self.plan(step)[self.dp_rank * b : (self.dp_rank + 1) * b]
        tokens, positions = np.zeros((b, S), np.int64), np.zeros((b, S), np.int64)
        labels = np.full((b, S), IGNORE_INDEX, np.int64)
        ds = self.dataset
        for r, pieces in enumerate(rows):
            at = 0
            for start, n in pieces:
                seg = ds.tokens[start : start + n + 1].astype(np.int64)
                tokens[r, at : at + n], labels[r, at : at + n] = seg[:-1], seg[1:]
                if ds.mask is not None:
                    labels[r, at : at + n][ds.mask[start + 1 : start + n + 1] == 0] = IGNORE_INDEX
                positions[r, at : at + n] = np.arange(n)
                at += n
            positions[r, at:] = np.arange(S - at)  # the padding: a document of its own
        return (torch.from_numpy(tokens), torch.from_numpy(positions)), torch.from_numpy(labels)

    def __iter__(self):
        return self

    def __next__(self):
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        """Layout-free state: resumes the same data at any dp_size."""
        state = {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len}
        return {**state, "pack": True} if self.pack else state

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "seq_len", "pack"):
            theirs, mine = state.get(key, False) if key == "pack" else state.get(key), getattr(self, key)
            if (key == "pack" or key in state) and theirs != mine:
                raise ValueError(
                    f"sampler state has {key}={theirs} but this sampler has {key}={mine}; "
                    "resuming would not continue the same data"
                )
        self.step = int(state["step"])


_DRAWS = 256  # documents drawn at a time while packing a batch (part of what the seed means)


def _packable_documents(dataset: TokenDataset) -> tuple[np.ndarray, np.ndarray]:
    """(first token, places = tokens - 1) of each document of `dataset` with two tokens or more."""
    where = f"the {dataset.split!r} split of {dataset.data_dir!r}"
    if dataset.doc_ends is None:
        raise ValueError(f"data.pack needs the documents' ends, which {where} was prepared without (an older "
                         "pipekit); run `pipekit prepare-data` again")
    ends = np.asarray(dataset.doc_ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    keep = ends - starts >= 2
    if not keep.any():
        raise ValueError(f"data.pack: {where} has no document of two tokens or more to pack")
    return starts[keep], ends[keep] - starts[keep] - 1


def _check_batch(dataset, global_batch: int, seq_len: int, dp_rank: int, dp_size: int, start_step: int,
                 pack: bool = False) -> None:
    if global_batch < 1 or seq_len < 1 or dp_size < 1 or start_step < 0:
        raise ValueError(
            "need global_batch >= 1, seq_len >= 1, dp_size >= 1, start_step >= 0; "
            f"got global_batch={global_batch}, seq_len={seq_len}, dp_size={dp_size}, start_step={start_step}"
        )
    if global_batch % dp_size:
        raise ValueError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}")
    if not pack and seq_len + 1 > dataset.n_tokens:
        raise ValueError(
            f"seq_len={seq_len} needs windows of {seq_len + 1} tokens but the {dataset.split!r} split of "
            f"{dataset.data_dir!r} has only {dataset.n_tokens}; use a shorter seq_len or more data"
        )
