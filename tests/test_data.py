"""Data: byte tokenizer, prepare_data's files and split, the cached default corpus, and the sampler's invariants."""

from __future__ import annotations

import json
import os
import threading
import time
import zlib

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
from pipekit.testing import CHAT_TEMPLATE, chatml_tokenizer

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
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "train.docs.bin", "val.bin", "val.docs.bin"]
    assert meta["n_files"] == 21 and meta["n_tokens"]["val"] == 0
    assert TokenDataset(str(out), "train").n_tokens == meta["n_tokens"]["train"]
    assert TokenDataset(str(out), "val").n_tokens == 0


@pytest.mark.parametrize("name", ["train.bin", "val.docs.bin", "train.mask.bin"])
def test_prepare_data_never_replaces_a_file_it_would_write_without_overwrite(corpus, tmp_path, name):
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_bytes(b"the user's own bytes")
    with pytest.raises(FileExistsError, match=rf"already holds {name}; .* --overwrite"):
        prepare_data([str(corpus)], str(out))
    assert os.listdir(out) == [name] and (out / name).read_bytes() == b"the user's own bytes"


def test_a_file_that_appears_while_preparing_is_kept_and_ours_withdrawn(tmp_path):
    """The guard before reading cannot see a file written during tokenisation; publishing
    without replacing can: nothing of ours stays beside it, and it is untouched."""
    out = tmp_path / "d"
    out.mkdir()

    def docs():
        yield np.frombuffer(b"abc\0", np.uint8), None, False
        (out / "val.bin").write_bytes(b"theirs")
        yield np.frombuffer(b"de\0", np.uint8), None, True

    with pytest.raises(FileExistsError, match="got a val.bin from elsewhere"):
        data._write_splits(str(out), docs())
    assert os.listdir(out) == ["val.bin"] and (out / "val.bin").read_bytes() == b"theirs"


def test_meta_records_each_files_size_and_crc32_and_a_changed_file_is_named(corpus, tmp_path):
    out = tmp_path / "data"
    meta = prepare_data([str(corpus)], str(out), val_fraction=0.2)
    assert sorted(meta["files"]) == ["train.bin", "train.docs.bin", "val.bin", "val.docs.bin"]
    for name, rec in meta["files"].items():
        raw = (out / name).read_bytes()
        assert rec == {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    assert data.check_files(str(out), meta) == meta["files"]
    size = os.path.getsize(out / "train.bin")
    (out / "train.bin").write_bytes(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
    assert data.read_meta(str(out)) is not None  # the sizes still match: only the checksum can tell
    with pytest.raises(data.DataChanged, match=r"train.bin is not the file its meta.json describes \(its CRC-32"):
        data.check_files(str(out), meta)
    assert data.check_files(str(out), {k: v for k, v in meta.items() if k != "files"}) is None  # an older dataset


def test_a_damaged_default_corpus_is_prepared_again(tmp_path, capsys):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "os.py").write_text("import sys\n" * 100)
    cache = str(tmp_path / "cache")
    default_corpus_dir(cache, source_dir=str(lib))
    good = (tmp_path / "cache" / "train.bin").read_bytes()
    (tmp_path / "cache" / "train.bin").write_bytes(b"x" * len(good))
    capsys.readouterr()
    default_corpus_dir(cache, source_dir=str(lib))
    assert "default corpus cache is damaged" in capsys.readouterr().err
    assert (tmp_path / "cache" / "train.bin").read_bytes() == good


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
    with pytest.raises(ValueError, match=r"no UTF-8 text among 1 file \(1 undecodable, 0 empty\)"):
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
    assert sorted(os.listdir(cache)) == [".lock", "meta.json", "train.bin", "train.docs.bin", "val.bin", "val.docs.bin"]
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


# ---- JSONL: text, prompt/response and chat lines, the loss mask, and malformed lines ----------------------------
@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A Hugging Face tokenizer directory built offline: a small byte-level BPE with ChatML specials."""
    pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("tok")
    chatml_tokenizer(d, ["what is two plus two", "it is four", "be brief", "hello there"] * 5, vocab_size=320)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def _jsonl(path, *lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return str(path)


def _docs_of(out, split="train"):
    """[(tokens, mask)] per document of a prepared split."""
    ds = TokenDataset(str(out), split)
    starts = np.concatenate([[0], ds.doc_ends[:-1]])
    mask = ds.mask if ds.mask is not None else np.ones(ds.n_tokens, np.uint8)
    return [(ds.tokens[a:b].astype(int), mask[a:b].astype(int)) for a, b in zip(starts, ds.doc_ends)]


def test_jsonl_text_and_prompt_response_lines_get_their_loss_mask(tmp_path):
    src = _jsonl(tmp_path / "sft.jsonl", {"text": "plain"}, "", {"prompt": "Q: 2+2?", "response": " 4"})
    meta = prepare_data([src], str(tmp_path / "d"), val_fraction=0.0)
    assert meta["mask"] and meta["doc_ends"] and meta["n_docs"] == {"train": 2, "val": 0}  # the blank line is none
    assert meta["jsonl_lines"] == {"text": 1, "prompt_response": 1, "chat": 0}
    (text, text_mask), (qa, qa_mask) = _docs_of(tmp_path / "d")
    assert bytes(text.tolist()) == b"plain\x00" and text_mask.tolist() == [1] * 6  # text: all trained on
    assert bytes(qa.tolist()) == b"Q: 2+2? 4\x00"
    assert qa_mask.tolist() == [0] * 7 + [1] * 3  # the prompt 0; the response and the separator 1
    assert os.path.getsize(tmp_path / "d" / "train.mask.bin") == meta["n_tokens"]["train"]


def test_text_only_data_has_no_mask(corpus, tmp_path):
    src = _jsonl(tmp_path / "t.jsonl", {"text": "a"}, {"text": "b"})
    meta = prepare_data([str(corpus), src], str(tmp_path / "d"), val_fraction=0.2)
    assert not meta["mask"] and not (tmp_path / "d" / "train.mask.bin").exists()
    assert meta["n_docs"]["train"] + meta["n_docs"]["val"] == 22  # 20 text files and 2 lines, split by document
    assert TokenDataset(str(tmp_path / "d")).mask is None


def test_chat_lines_train_only_the_assistant_turns(chat_tokenizer, tmp_path):
    pytest.importorskip("transformers")
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"},
                         {"role": "assistant", "content": "it is four"}, {"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "hello there"}]}
    src = _jsonl(tmp_path / "chat.jsonl", chat)
    meta = prepare_data([src], str(tmp_path / "d"), tokenizer=str(chat_tokenizer), val_fraction=0.0)
    tok = load_tokenizer(str(chat_tokenizer))
    assert meta["mask"] and meta["eot"] == tok.eot == 1 and meta["tokenizer"] == os.path.abspath(chat_tokenizer)
    [(ids, mask)] = _docs_of(tmp_path / "d")
    rendered = tok.render_chat(chat["messages"])
    assert tok.decode(ids) == rendered + "<|endoftext|>"  # the template's rendering, then the separator
    trained = [tok.decode(ids[i:j]) for i, j in _runs(mask)]
    assert trained == ["it is four<|im_end|>\n", "hello there<|im_end|>\n<|endoftext|>"]


def _runs(mask):
    """(start, end) of each run of 1s."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_sampler_labels_are_minus_100_where_the_next_token_is_masked(tmp_path):
    lines = [{"prompt": f"question {i} " * 3, "response": f"answer {i}"} for i in range(30)]
    prepare_data([_jsonl(tmp_path / "qa.jsonl", *lines)], str(tmp_path / "d"), val_fraction=0.0)
    ds = TokenDataset(str(tmp_path / "d"))
    sampler = BatchSampler(ds, global_batch=4, seq_len=16, seed=1)
    inputs, labels = sampler.batch(0)
    starts = sampler.starts(0)
    for row, start in enumerate(starts):
        tokens = ds.tokens[start + 1 : start + 17].astype(np.int64)
        want = np.where(ds.mask[start + 1 : start + 17] == 1, tokens, -100)
        assert labels[row].tolist() == want.tolist()
    assert (labels == -100).any() and (labels != -100).any()


@pytest.mark.parametrize("line, message", [
    ('{"text": "fine"', r"bad\.jsonl:2: not JSON \(Expecting ',' delimiter at column 16\)"),
    ('{"body": "x"}', r"bad\.jsonl:2: no known keys \(got \['body'\]\)"),
    ('["text"]', r"bad\.jsonl:2: a line must be a JSON object .* got a list"),
    ('{"role": "user", "content": "hi"}', r"bad\.jsonl:2: a chat line needs `messages`"),
    ('{"messages": []}', r"bad\.jsonl:2: `messages` must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: message 0 needs a role and a content \(got \['role'\]\)"),
    ('{"messages": [{"role": "robot", "content": "x"}]}',
     r"bad\.jsonl:2: message 0 has role 'robot'; known roles: system, user, assistant, tool"),
    ('{"prompt": "only a prompt"}', r"bad\.jsonl:2: a line with `prompt` needs `response` too"),
    ('{"text": 3}', r"bad\.jsonl:2: `text` must be a string, got int"),
    ('{"messages": [{"role": "user", "content": "hi"}]}',
     r"bad\.jsonl:2: a chat line is rendered by the tokenizer's chat template, but the byte tokenizer has none"),
])
def test_malformed_jsonl_lines_are_named_by_file_and_line(tmp_path, line, message):
    src = _jsonl(tmp_path / "bad.jsonl", {"text": "a good first line"}, line)
    with pytest.raises(ValueError, match=message) as err:
        prepare_data([src], str(tmp_path / "d"))
    assert "\n" not in str(err.value)  # one line
    assert not (tmp_path / "d").exists()  # nothing left behind


def test_chat_with_a_tokenizer_file_or_a_template_that_refuses(chat_tokenizer, tmp_path):
    pytest.importorskip("transformers")
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    src = _jsonl(tmp_path / "c.jsonl", chat)
    with pytest.raises(ValueError, match=r"c\.jsonl:1: tokenizer .*tokenizer\.json is a tokenizer\.json file, "
                                         r"which has no chat template; .* give --tokenizer a HuggingFace tokenizer"):
        prepare_data([src], str(tmp_path / "d"), tokenizer=str(chat_tokenizer / "tokenizer.json"))
    strict = tmp_path / "strict"
    strict.mkdir()
    (strict / "tokenizer.json").write_bytes((chat_tokenizer / "tokenizer.json").read_bytes())
    (strict / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no chats') }}"}))
    with pytest.raises(ValueError, match=r"c\.jsonl:1: the chat template refused this conversation \(no chats\)"):
        prepare_data([src], str(tmp_path / "d"), tokenizer=str(strict))


def test_a_vocabulary_that_does_not_fit_is_one_line(tmp_path, monkeypatch):
    class Huge(ByteTokenizer):
        vocab_size, name = 2**32 + 5, "huge"

    monkeypatch.setattr(data, "load_tokenizer", lambda path: Huge())
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"^tokenizer huge: vocab_size=4294967301 does not fit in uint32 "
                                         r"\(at most 4294967296 ids\)$"):
        prepare_data([str(tmp_path / "a.txt")], str(tmp_path / "d"))


def test_prepare_data_cli_says_a_bad_line_in_one_line(tmp_path, capsys):
    from pipekit.cli import main

    src = _jsonl(tmp_path / "bad.jsonl", {"text": "ok"}, {"text": "ok"}, "{oops")
    assert main(["prepare-data", src, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}:3: not JSON" in err


# ---- packing -----------------------------------------------------------------------------------------------------
@pytest.fixture
def skewed(tmp_path):
    """Many short documents and a few long ones (one longer than the rows), with prompts masked."""
    rng = np.random.default_rng(0)
    lines = [{"prompt": "p" * int(rng.integers(1, 4)), "response": "r" * int(rng.integers(1, 10))} for _ in range(40)]
    lines += [{"text": "L" * 40}, {"prompt": "q", "response": "R" * 20}]
    prepare_data([_jsonl(tmp_path / "mix.jsonl", *lines)], str(tmp_path / "d"), val_fraction=0.0)
    return TokenDataset(str(tmp_path / "d"))


def test_packed_rows_hold_whole_documents_with_their_positions(skewed):
    S = 16
    sampler = BatchSampler(skewed, global_batch=8, seq_len=S, seed=2, pack=True)
    starts = np.concatenate([[0], skewed.doc_ends[:-1]])
    for step in range(4):
        (tokens, positions), labels = sampler.batch(step)
        assert tokens.shape == positions.shape == labels.shape == (8, S)
        assert tokens.dtype == positions.dtype == labels.dtype == torch.int64
        for row, pieces in enumerate(sampler.plan(step)):
            at = 0
            for first, n in pieces:
                d = int(np.searchsorted(skewed.doc_ends, first, side="right"))  # the document it is a piece of
                assert starts[d] <= first and first + n < skewed.doc_ends[d]
                assert (first - starts[d]) % S == 0  # pieces of a long document are cut every S places
                assert positions[row, at:at + n].tolist() == list(range(n))
                seg = skewed.tokens[first:first + n + 1].astype(np.int64)
                assert tokens[row, at:at + n].tolist() == seg[:-1].tolist()
                want = np.where(skewed.mask[first + 1:first + n + 1] == 1, seg[1:], -100)
                assert labels[row, at:at + n].tolist() == want.tolist()
                at += n
            assert at <= S and (labels[row, at:] == -100).all() and positions[row, at:].tolist() == list(range(S - at))
    assert any(n == S for p in sampler.plan(0) + sampler.plan(1) for _, n in p)  # the long ones were cut


def test_packed_sampler_is_deterministic_dp_invariant_and_resumes(skewed):
    whole = BatchSampler(skewed, 8, 12, seed=3, pack=True)
    batches = [next(whole) for _ in range(3)]
    for dp in (2, 4):
        ranks = [BatchSampler(skewed, 8, 12, r, dp, seed=3, pack=True) for r in range(dp)]
        for (x, p), y in batches:
            rows = [next(r) for r in ranks]
            assert torch.equal(torch.cat([got[0][0] for got in rows]), x)
            assert torch.equal(torch.cat([got[0][1] for got in rows]), p)
            assert torch.equal(torch.cat([got[1] for got in rows]), y)
    resumed = BatchSampler(skewed, 8, 12, seed=3, pack=True, start_step=2)
    assert all(torch.equal(a, b) for a, b in zip(next(resumed)[0], batches[2][0]))
    assert whole.state_dict() == {"step": 3, "seed": 3, "global_batch": 8, "seq_len": 12, "pack": True}
    with pytest.raises(ValueError, match="sampler state has pack=True but this sampler has pack=False"):
        BatchSampler(skewed, 8, 12, seed=3).load_state_dict(whole.state_dict())


def test_packing_needs_the_documents_ends(dataset):
    meta_path = os.path.join(dataset.data_dir, "meta.json")
    meta = json.loads(open(meta_path).read())
    del meta["doc_ends"]  # as a dataset prepared before packing existed
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    old = TokenDataset(dataset.data_dir)
    assert old.doc_ends is None
    BatchSampler(old, 4, 8).batch(0)  # unpacked: as always
    with pytest.raises(ValueError, match="data.pack needs the documents' ends, which the 'train' split of .* was "
                                         "prepared without"):
        BatchSampler(old, 4, 8, pack=True)
