"""Tokenised memmap datasets, the byte tokenizer and the built-in default corpus.

The plan, nanoGPT-style:

1. `prepare_data` reads text files, tokenises each file as one *document*,
   appends the tokenizer's end-of-document separator to each, and writes the
   documents one after another into `train.bin` and `val.bin` (raw native-endian
   arrays that `np.memmap` opens directly) plus `meta.json`. The split is by
   document, so validation text is held out, never a window of training text.
2. `TokenDataset` memmaps one split; nothing is read until it is sampled.
3. `BatchSampler` draws `global_batch` random windows of `seq_len + 1` tokens
   for each step from a generator seeded by `(seed, step)` only, and dp rank
   `r` keeps rows `[r*b, (r+1)*b)`. So every layout (any dp) sees the same
   global batches, and resuming at step k needs nothing but k.

With no data configured, `default_corpus_dir()` gives the Python standard
library's own source (about 730 files, 12 MB of bytes on CPython 3.11), prepared
with the byte tokenizer on first use and cached.

Limits: each input file is one document, read into memory whole; there
is no epoch notion (windows are drawn with replacement, may cross document
boundaries, and the separator token marks those); files are read as UTF-8 and
skipped (and counted) when they are not.
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

import numpy as np
import torch

from .atomic import publish, remove, write_atomic

FORMAT = 1  # bump when the on-disk layout changes; older caches are rebuilt
TEXT_SUFFIXES = (".py", ".txt", ".md")  # what a directory input contributes
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
    """A HuggingFace `tokenizers` JSON file behind the ByteTokenizer interface.

    No special tokens are added when encoding. `eot` is the id of the first of
    `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`, `<|eos|>`, `[SEP]` that
    the vocabulary has; when it has none, `eot` is None and documents are
    joined by the encoding of "\\n\\n" instead."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"tokenizer {path!r} needs the HuggingFace `tokenizers` package: pip install tokenizers",
                              name="tokenizers") from e
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise FileNotFoundError(f"tokenizer file {path!r} {what} (want a HuggingFace tokenizer.json, or None)")
        self.name = os.path.abspath(path)
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises a bare Exception
            raise ValueError(f"tokenizer file {path!r} is not a HuggingFace tokenizer.json "
                             f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from e
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = (self.tok.token_to_id(t) for t in _EOT_NAMES)
        self.eot = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(path: str | None):
    """None (or "byte") -> ByteTokenizer; a path -> HFTokenizer of that JSON file."""
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
    raise ValueError(f"vocab_size={vocab_size} does not fit in uint32")


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


def _documents(files: list[str], val_fraction: float, seed: int, stats: dict):
    """Yield (text, held_out) per document, one file at a time; count files used and skipped in `stats`.

    The split is drawn over `files` before reading, so an undecodable file
    leaves its slot (train or val) empty. A single file is split at its tail."""
    is_val = split_documents(len(files), val_fraction, seed) if len(files) > 1 or val_fraction == 0 else None
    for i, path in enumerate(files):
        text = _read_text(path)
        stats["n_files" if text is not None else "n_skipped"] += 1
        if text is None:
            continue
        if is_val is None:
            yield from zip(*_split_single(text, val_fraction))
        else:
            yield text, bool(is_val[i])
    if not stats["n_files"]:
        raise ValueError(f"no UTF-8 text among {len(files)} files ({stats['n_skipped']} undecodable)")


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


def _encode(tok, text: str, dtype: np.dtype) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype, copy=False)
    return np.asarray(tok.encode(text), dtype=dtype)


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

    Each file is one document: its tokens, then `separator(tok)`. Documents keep
    their file order and go to `train.bin` or `val.bin` by `split_documents`
    (a single file is split at its last val_fraction instead). Files are read
    and written one at a time, so memory holds one file. Writes go to
    temporary names in `out_dir` and are renamed at the end, `meta.json` last
    (after removing any old one), so a dataset is complete exactly when its
    meta.json exists; a killed run leaves no meta.json (and maybe a stray
    `.*.tmp` file). Bad arguments (inputs, tokenizer, out_dir, fraction, seed)
    are refused before `out_dir` is made, and a run that fails later (no
    readable text) removes the directories it made. `source` is the description
    kept in meta (default: the inputs). A dataset already in `out_dir` (its
    meta.json) is replaced only with `overwrite`."""
    _check_fraction(val_fraction)
    _check_seed(seed)
    _check_out_dir(out_dir)
    if not overwrite and os.path.exists(os.path.join(out_dir, "meta.json")):
        raise FileExistsError(f"{out_dir!r} already holds a prepared dataset (meta.json); choose another --out, or "
                              "pass --overwrite to replace it")
    files = list_files(inputs)
    if not files:
        rule = ", ".join("*" + s for s in TEXT_SUFFIXES)
        raise ValueError(f"no input files in {inputs} (a directory contributes {rule} below it)")
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    sep = np.asarray(separator(tok), dtype=dtype)
    stats = {"n_files": 0, "n_skipped": 0}
    docs = _documents(files, val_fraction, seed, stats)
    with _made_dir(out_dir):
        n_tokens, n_docs = _write_splits(out_dir, docs, lambda text: np.concatenate([_encode(tok, text, dtype), sep]))
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "eot": tok.eot,
        "separator": sep.tolist(),
        "n_tokens": n_tokens,
        "n_docs": n_docs,
        **stats,
        "source": source if source is not None else ", ".join(map(str, inputs)),
        "val_fraction": val_fraction,
        "seed": seed,
    }
    write_atomic(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=2))
    return meta


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


def _write_splits(out_dir: str, docs, encode) -> tuple[dict, dict]:
    """Stream the encoded (text, held_out) documents into temp files, then rename them to train.bin / val.bin.

    Returns tokens and documents per split. Nothing is renamed if `docs` raises."""
    tmps, n_tokens, n_docs = {}, {"train": 0, "val": 0}, {"train": 0, "val": 0}
    try:
        for split in ("train", "val"):
            fd, tmps[split] = tempfile.mkstemp(dir=out_dir, prefix=f".{split}.bin.", suffix=".tmp")
            os.close(fd)
        with open(tmps["train"], "wb") as train, open(tmps["val"], "wb") as val:
            for text, held_out in docs:
                ids = encode(text)
                (val if held_out else train).write(ids.tobytes())
                n_tokens["val" if held_out else "train"] += len(ids)
                n_docs["val" if held_out else "train"] += 1
            for fh in (train, val):
                fh.flush()
                os.fsync(fh.fileno())
        remove(os.path.join(out_dir, "meta.json"))  # the dataset is incomplete from here on
        for split, tmp in tmps.items():
            publish(tmp, os.path.join(out_dir, f"{split}.bin"))
    finally:
        for tmp in tmps.values():
            remove(tmp)
    return n_tokens, n_docs


def read_meta(data_dir: str) -> dict | None:
    """meta.json of a complete dataset whose bin files have the sizes it records; else None."""
    try:
        with open(os.path.join(data_dir, "meta.json")) as fh:
            meta = json.load(fh)
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split, n in meta["n_tokens"].items():
            if os.path.getsize(os.path.join(data_dir, f"{split}.bin")) != n * itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if meta.get("format") == FORMAT else None


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


def _has_corpus(cache_dir: str, source: str) -> bool:
    meta = read_meta(cache_dir)
    return meta is not None and meta.get("source") == source


def _prepare_stdlib(source_dir: str, cache_dir: str, source: str) -> None:
    print(f"pipekit: preparing the default corpus ({source}) in {cache_dir} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    meta = prepare_data(stdlib_files(source_dir), cache_dir, source=source)
    n = sum(meta["n_tokens"].values())
    print(f"pipekit: {meta['n_files']} files, {n:,} tokens in {time.perf_counter() - start:.1f}s",
          file=sys.stderr, flush=True)


# ---- reading and sampling -----------------------------------------------------------


class TokenDataset:
    """One split of a prepared dataset, memory-mapped read-only (nothing is loaded up front)."""

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
        dtype = np.dtype(meta["dtype"])
        path = os.path.join(data_dir, f"{split}.bin")
        # np.memmap refuses empty files; an empty split is a legal (if unusable) array
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if self.n_tokens else np.empty(0, dtype)

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (f"TokenDataset({self.data_dir!r}, split={self.split!r}, n_tokens={self.n_tokens}, "
                f"vocab_size={self.vocab_size})")


class BatchSampler:
    """Endless `(inputs, labels)` int64 batches of shape (global_batch // dp_size, seq_len) for one dp rank.

    Step k's global batch is `global_batch` windows of seq_len+1 tokens whose
    starts come from `np.random.default_rng([seed, k])` (uniform, with
    replacement); inputs are a window's first seq_len tokens and labels its
    last seq_len. Rank r keeps rows [r*b, (r+1)*b), b = global_batch // dp_size,
    so the concatenation over ranks is the same for every dp_size. The sampler
    is its own iterator; `step` is the step of the next batch, `start_step=k`
    (or `load_state_dict`) resumes exactly there. For a periodic validation
    loss, build a fresh sampler on the val split each time: the same seed
    gives the same validation batches, so the losses are comparable."""

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        start_step: int = 0,
    ):
        _check_batch(dataset, global_batch, seq_len, dp_rank, dp_size, start_step)
        self.dataset, self.global_batch, self.seq_len = dataset, global_batch, seq_len
        self.dp_rank, self.dp_size, self.seed, self.step = dp_rank, dp_size, seed, start_step
        self.local_batch = global_batch // dp_size

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of `step` (every rank computes all of them)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.dataset.n_tokens - self.seq_len, size=self.global_batch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels) of `step`, without moving the sampler."""
        mine = self.starts(step)[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        offsets = np.arange(self.seq_len + 1)
        windows = torch.from_numpy(self.dataset.tokens[mine[:, None] + offsets].astype(np.int64))  # (b, seq_len + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        """Layout-free state: resumes the same data at any dp_size."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "seq_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={getattr(self, key)}; "
                    "resuming would not continue the same data"
                )
        self.step = int(state["step"])


def _check_batch(dataset, global_batch: int, seq_len: int, dp_rank: int, dp_size: int, start_step: int) -> None:
    if global_batch < 1 or seq_len < 1 or dp_size < 1 or start_step < 0:
        raise ValueError(
            "need global_batch >= 1, seq_len >= 1, dp_size >= 1, start_step >= 0; "
            f"got global_batch={global_batch}, seq_len={seq_len}, dp_size={dp_size}, start_step={start_step}"
        )
    if global_batch % dp_size:
        raise ValueError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}")
    if seq_len + 1 > dataset.n_tokens:
        raise ValueError(
            f"seq_len={seq_len} needs windows of {seq_len + 1} tokens but the {dataset.split!r} split of "
            f"{dataset.data_dir!r} has only {dataset.n_tokens}; use a shorter seq_len or more data"
        )
