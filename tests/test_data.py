"""Data: byte tokenizer, prepare_data's files and split, the cached default corpus, and the sampler's invariants."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from pipekit import data
from pipekit.data import (
    BatchSampler,
    ByteTokenizer,
    TokenDataset,
    default_corpus_dir,
    load_tokenizer,
    prepare_data,
    token_dtype,
)

DOCS = {f"doc{i:02d}.txt": f"document {i}: " + "héllo wörld ✓ " * (i + 3) + "\n" for i in range(20)}


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name, text in DOCS.items():
        (src / ("sub" if name < "doc10" else "") / name).write_text(text, encoding="utf-8")
    (src / "ignored.bin").write_bytes(b"\x00\x01 not a text suffix")
    (src / "bad.md").write_bytes(b"\xff\xfe invalid utf-8")
    return src


@pytest.fixture
def dataset(corpus, tmp_path):
    out = tmp_path / "data"
    prepare_data([str(corpus)], str(out), val_fraction=0.2, seed=0)
    return TokenDataset(str(out), "train")


def _split_docs(out, split):
    return bytes(np.fromfile(out / f"{split}.bin", dtype=np.uint8)).decode("utf-8").split("\x00")[:-1]


def test_byte_tokenizer_round_trips_non_ascii():
    tok = load_tokenizer(None)
    text = "naïve café — 日本語 🚀\n\ttabs"
    ids = tok.encode(text)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eot == 0
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"


@pytest.mark.parametrize(
    "vocab, dtype", [(256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32), (200_000, np.uint32)]
)
def test_token_dtype(vocab, dtype):
    assert token_dtype(vocab) == dtype


def test_prepare_data_meta_counts_and_held_out_split(corpus, tmp_path):
    out = tmp_path / "data"
    meta = prepare_data([str(corpus)], str(out), val_fraction=0.2, seed=0)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint8" and meta["vocab_size"] == 256 and meta["tokenizer"] == "byte"
    assert meta["n_files"] == 20 and meta["n_skipped"] == 1 and meta["n_docs"] == {"train": 16, "val": 4}
    total = sum(len(t.encode()) + 1 for t in DOCS.values())  # + one separator byte each
    assert meta["n_tokens"]["train"] + meta["n_tokens"]["val"] == total
    for split in ("train", "val"):
        assert os.path.getsize(out / f"{split}.bin") == meta["n_tokens"][split]
    train, val = _split_docs(out, "train"), _split_docs(out, "val")
    assert len(val) == 4 and sorted(train + val) == sorted(DOCS.values())
    assert not set(train) & set(val)


def test_split_depends_on_seed_only(corpus, tmp_path):
    val = {seed: _split_docs(_prep(corpus, tmp_path / f"s{seed}", seed), "val") for seed in (0, 1)}
    assert _split_docs(_prep(corpus, tmp_path / "again", 0), "val") == val[0]
    assert val[0] != val[1]


def _prep(corpus, out, seed):
    prepare_data([str(corpus)], str(out), val_fraction=0.2, seed=seed)
    return out


def test_single_file_holds_out_its_tail(tmp_path):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "input.txt").write_text(text)
    meta = prepare_data([str(tmp_path / "input.txt")], str(tmp_path / "d"), val_fraction=0.1)
    train, val = _split_docs(tmp_path / "d", "train"), _split_docs(tmp_path / "d", "val")
    assert train[0] + val[0] == text and train[0].endswith("\n") and val[0].startswith("line 9")
    assert 0.08 * len(text) < len(val[0]) <= 0.1 * len(text)
    assert meta["n_files"] == 1


def test_rerun_overwrites_atomically_and_leaves_no_temp_files(corpus, tmp_path):
    out = tmp_path / "data"
    prepare_data([str(corpus)], str(out), val_fraction=0.2)
    (corpus / "extra.txt").write_text("one more document\n")
    with pytest.raises(FileExistsError, match="already holds a prepared dataset"):
        prepare_data([str(corpus)], str(out), val_fraction=0.0)
    meta = prepare_data([str(corpus)], str(out), val_fraction=0.0, overwrite=True)
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    assert meta["n_files"] == 21 and meta["n_tokens"]["val"] == 0
    assert TokenDataset(str(out), "train").n_tokens == meta["n_tokens"]["train"]
    assert TokenDataset(str(out), "val").n_tokens == 0


def test_interrupted_dataset_is_not_readable(dataset):
    os.remove(os.path.join(dataset.data_dir, "meta.json"))  # what a killed run leaves
    with pytest.raises(FileNotFoundError, match="no complete prepared dataset"):
        TokenDataset(dataset.data_dir)


def test_prepare_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        prepare_data([str(tmp_path / "nope")], str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"no input files .* \*\.py, \*\.txt, \*\.md"):
        prepare_data([str(tmp_path)], str(tmp_path / "d"))
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"no UTF-8 text among 1 files \(1 undecodable\)"):
        prepare_data([str(tmp_path)], str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()  # temp files removed, nothing published, the new out_dir removed again
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"no UTF-8 text"):
        prepare_data([str(tmp_path)], str(tmp_path / "d"))
    assert os.listdir(tmp_path / "d") == []  # an out_dir that was there stays
    with pytest.raises(ValueError, match="val_fraction must be in"):
        prepare_data([str(tmp_path)], str(tmp_path / "d"), val_fraction=1.0)
    with pytest.raises((ImportError, FileNotFoundError), match="tokenizers|tok.json"):
        load_tokenizer(str(tmp_path / "tok.json"))


def test_default_corpus_prepared_once_and_reused(tmp_path):
    lib = tmp_path / "lib"
    for rel in ["os.py", "json/__init__.py", "test/test_os.py", "site-packages/x.py", "README.txt"]:
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(f"# {rel}\n" * 50)
    cache = str(tmp_path / "cache")
    assert default_corpus_dir(cache, source_dir=str(lib)) == cache
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["n_files"] == 2  # os.py, json/__init__.py: no tests, no site-packages, only *.py
    mtime = os.path.getmtime(tmp_path / "cache" / "train.bin")
    assert default_corpus_dir(cache, source_dir=str(lib)) == cache
    assert os.path.getmtime(tmp_path / "cache" / "train.bin") == mtime


def test_default_corpus_is_prepared_once_by_concurrent_callers(tmp_path, monkeypatch):
    """Threads stand in for ranks: flock locks separate open()s against each other even in one process."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(30):
        (lib / f"m{i}.py").write_text(f"x = {i}\n" * 2000)
    calls, real = [], data._prepare_stdlib
    monkeypatch.setattr(data, "_prepare_stdlib", lambda *a: (calls.append(a), time.sleep(0.2), real(*a)))
    cache, barrier, results = str(tmp_path / "cache"), threading.Barrier(4), []

    def rank():
        barrier.wait()
        results.append(default_corpus_dir(cache, source_dir=str(lib)))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [cache] * 4 and len(calls) == 1
    assert sorted(os.listdir(cache)) == [".lock", "meta.json", "train.bin", "val.bin"]
    total = sum(len(f"x = {i}\n") * 2000 + 1 for i in range(30))
    assert TokenDataset(cache).n_tokens + TokenDataset(cache, "val").n_tokens == total


def test_sampler_labels_are_shifted_inputs(dataset):
    inputs, labels = next(BatchSampler(dataset, global_batch=4, seq_len=16, dp_rank=0, dp_size=1))
    assert inputs.shape == labels.shape == (4, 16) and inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    starts = BatchSampler(dataset, 4, 16, 0, 1).starts(0)
    assert torch.equal(labels[0], torch.from_numpy(dataset.tokens[starts[0] + 1 : starts[0] + 17].astype(np.int64)))


def test_sampler_is_deterministic_and_dp_invariant(dataset):
    steps = 5
    one_rank = BatchSampler(dataset, 8, 12, 0, 1, seed=3)
    whole = [next(one_rank) for _ in range(steps)]
    again = BatchSampler(dataset, 8, 12, 0, 1, seed=3)
    for dp in (2, 4):
        ranks = [BatchSampler(dataset, 8, 12, r, dp, seed=3) for r in range(dp)]
        for step in range(steps):
            rows = [next(r) for r in ranks]
            assert all(x.shape == (8 // dp, 12) for x, _ in rows)
            assert torch.equal(torch.cat([x for x, _ in rows]), whole[step][0])
            assert torch.equal(torch.cat([y for _, y in rows]), whole[step][1])
    assert all(torch.equal(next(again)[0], whole[k][0]) for k in range(steps))
    assert not torch.equal(BatchSampler(dataset, 8, 12, 0, 1, seed=4).batch(0)[0], whole[0][0])


def test_sampler_resumes_exactly(dataset):
    run = BatchSampler(dataset, 4, 8, 1, 2, seed=7)
    for _ in range(3):
        next(run)
    state = run.state_dict()
    expected = [next(run) for _ in range(3)]
    for resumed in (BatchSampler(dataset, 4, 8, 1, 2, seed=7, start_step=3), BatchSampler(dataset, 4, 8, 1, 2, seed=7)):
        if resumed.step == 0:
            resumed.load_state_dict(state)
        for x, y in expected:
            got = next(resumed)
            assert torch.equal(got[0], x) and torch.equal(got[1], y)
    assert state == {"step": 3, "seed": 7, "global_batch": 4, "seq_len": 8}
    with pytest.raises(ValueError, match="seed=7 but this sampler has seed=8"):
        BatchSampler(dataset, 4, 8, 0, 1, seed=8).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(global_batch=6, dp_size=4), "global_batch=6 is not divisible by dp_size=4"),
        (dict(dp_rank=2, dp_size=2), "dp_rank=2 is out of range for dp_size=2"),
        (dict(seq_len=10**6), r"seq_len=1000000 needs windows of 1000001 tokens .* has only"),
        (dict(seq_len=0), "seq_len >= 1"),
    ],
)
def test_sampler_errors(dataset, kwargs, message):
    args = dict(global_batch=4, seq_len=8, dp_rank=0, dp_size=1) | kwargs
    with pytest.raises(ValueError, match=message):
        BatchSampler(dataset, **args)


def test_hf_tokenizer_file(corpus, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    specials = ["[UNK]", "<|endoftext|>"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(DOCS.values(), trainer)
    path = str(tmp_path / "tok.json")
    tok.save(path)
    loaded = load_tokenizer(path)
    assert loaded.eot == 1 and loaded.vocab_size == tok.get_vocab_size()
    assert loaded.decode(loaded.encode("héllo wörld ✓")) == "héllo wörld ✓"
    meta = prepare_data([str(corpus)], str(tmp_path / "d"), tokenizer=path, val_fraction=0.2)
    assert meta["dtype"] == "uint16" and meta["eot"] == 1 and meta["tokenizer"] == os.path.abspath(path)
    assert sum(meta["n_tokens"].values()) == sum(len(loaded.encode(t)) + 1 for t in DOCS.values())
    train = TokenDataset(str(tmp_path / "d"))
    assert int(train.tokens.max()) < loaded.vocab_size and train.vocab_size == loaded.vocab_size
