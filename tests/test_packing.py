"""Packed documents (`data.pack`) are the documents fed one by one; and any layout equals one process.

A packed row holds whole documents; the inputs are `(tokens, positions)`, the
positions restarting at 0 at each document, so rotary (Llama) and learned (GPT-2)
positions are per document and attention stays inside it. In float64:

- the packed batch gives the same summed loss and the same gradients as its documents
  fed one at a time, each its own unpadded sequence (GPT-2 and Llama tiny, tied and
  untied), and the padding is inert;
- a prompt's masked labels carry no gradient: the loss is the mean over the response
  tokens alone, and the logits of masked positions get exactly zero gradient;
- pp=2 x dp=2, tp=2 x dp=2 (with and without sequence parallelism) and pp=2 x tp=2
  with sequence parallelism (4 spawned gloo workers, one group for every check) train
  packed batches of a prepared prompt/response dataset exactly as one process does
  (loss, every gradient, every weight within 1e-10, 2 SGD steps);
- a plain ids tensor still goes through the same model as before (nothing changes
  without packing: tests/test_models.py and the parity suites hold that).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import pipekit
from pipekit.config import ConfigError, load_config
from pipekit.data import BatchSampler, TokenDataset, prepare_data
from pipekit.layers.attention import document_mask
from pipekit.models import get_model, model_loss, model_specs
from pipekit.testing import Reference, in_float64, reference_model, run_distributed

TOL = 1e-10
SEED, SEQ, BATCH = 5, 24, 8
MODELS = {
    "gpt2": dict(vocab_size=256, max_seq_len=32, n_layers=2, dim=16, n_heads=4),
    "gpt2-untied": dict(vocab_size=256, max_seq_len=32, n_layers=2, dim=16, n_heads=4, tie_embeddings=False),
    "llama": dict(vocab_size=256, max_seq_len=32, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=24),
}


def model(name: str):
    cfg = get_model(name.split("-")[0], "tiny", **MODELS[name])
    return cfg, model_specs(cfg), model_loss(cfg).build()


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    """A prepared prompt/response dataset with a skewed length mix (some longer than a row)."""
    d = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(1)
    lines = [{"prompt": "q" * int(rng.integers(1, 6)) + "?", "response": "abcdefgh"[: int(rng.integers(1, 9))]}
             for _ in range(60)]
    lines += [{"prompt": "long?", "response": "x" * 40}, {"text": "a plain text document " * 2}]
    (d / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    prepare_data([str(d / "sft.jsonl")], str(d / "data"), val_fraction=0.0)
    return str(d / "data")


def packed_batch(path: str, step: int = 0):
    return BatchSampler(TokenDataset(path), BATCH, SEQ, seed=SEED, pack=True).batch(step)


def one_by_one(tokens, positions, labels):
    """The packed rows' documents as (inputs (1, n), labels (1, n)), each its own sequence."""
    docs = []
    for x, p, y in zip(tokens, positions, labels):
        starts = [t for t in range(len(p)) if t == 0 or p[t] != p[t - 1] + 1] + [len(p)]
        docs += [(x[a:b][None], y[a:b][None]) for a, b in zip(starts, starts[1:])]
    return docs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_packed_batch_is_its_documents_fed_one_by_one(name, sft_data, float64):
    cfg, specs, loss_fn = model(name)
    net = reference_model(specs, SEED)
    (tokens, positions), labels = packed_batch(sft_data)
    assert (positions == 0).sum() > 2 * BATCH  # several documents a row
    valid = (labels != -100).sum()
    packed = loss_fn(net((tokens, positions)), labels) * valid  # the summed loss
    packed.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for x, y in one_by_one(tokens, positions, labels):
        if (y != -100).any():  # (the padding "document" and prompt-only pieces have nothing to learn)
            total = total + loss_fn(net(x), y) * (y != -100).sum()
    total.backward()
    assert abs(packed.item() - total.item()) <= TOL * max(1.0, abs(total.item()))
    for n, p in net.named_parameters():
        assert (grads[n] - p.grad).abs().max().item() <= TOL, f"{name}: {n}'s gradient differs"


def test_attention_stays_inside_each_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    mask = document_mask(positions)[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    want = (doc[:, None] == doc[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(mask, want)


def test_masked_prompt_tokens_carry_no_gradient(sft_data, float64):
    cfg, specs, loss_fn = model("llama")
    net = reference_model(specs, SEED)
    (tokens, positions), labels = packed_batch(sft_data, step=1)
    ds = TokenDataset(sft_data)
    assert ds.mask is not None and (ds.mask == 0).any()
    logits = net((tokens, positions))
    logits.retain_grad()
    loss = loss_fn(logits, labels)
    loss.backward()
    masked, kept = labels == -100, labels != -100
    assert masked.sum() > 0 and kept.sum() > 0
    assert logits.grad[masked].abs().max().item() == 0.0  # prompt (and padding) positions: no gradient at all
    assert logits.grad[kept].abs().amax(-1).min().item() > 0
    lp = torch.log_softmax(logits.detach()[..., : cfg.vocab_size], -1)
    by_hand = -lp[kept].gather(-1, labels[kept][:, None]).mean()  # the mean over the response tokens alone
    assert abs(loss.item() - by_hand.item()) <= TOL


def rows(batch, topo):
    """This dp rank's rows of a (possibly nested) (inputs, labels) batch."""
    def cut(t):
        if isinstance(t, tuple):
            return tuple(cut(x) for x in t)
        n = len(t) // topo.dp
        return t[topo.dp_rank * n:(topo.dp_rank + 1) * n]
    return cut(batch)


def sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


@in_float64
def run_layout(name: str, path: str, pp: int, dp: int, tp: int, sp: bool, microbatches: int) -> dict:
    cfg, specs, loss_fn = model(name)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, sequence_parallel=sp)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED, schedule="1f1b",
                                    microbatches=microbatches)
    engine = pipekit.PipelineEngine(module, optimizer=sgd(module.parameters()))
    ref = Reference(specs, loss_fn, sgd, seed=SEED)
    sampler = BatchSampler(TokenDataset(path), BATCH, SEQ, seed=SEED, pack=True)
    mine = BatchSampler(TokenDataset(path), BATCH, SEQ, dp_rank=topo.dp_rank, dp_size=dp, seed=SEED, pack=True)
    for step in range(2):
        batch, local = sampler.batch(step), mine.batch(step)
        assert all(torch.equal(a, b) for a, b in zip(rows(batch, topo)[0], local[0]))  # the sampler's own dp rows
        loss = engine.train_batch(iter([local]), reduce_loss=True)
        ref.record("loss", abs(loss - ref.step(batch)))
        ref.compare(module, topo)
    return ref.worst


# (model, pp, dp, tp, sequence parallel, microbatches)
LAYOUTS = [("gpt2", 2, 2, 1, False, 2), ("llama", 2, 2, 1, False, 4), ("gpt2-untied", 1, 2, 2, False, 2),
           ("llama", 1, 2, 2, True, 2), ("gpt2", 2, 1, 2, True, 4)]


def check_layouts(path: str) -> list:
    return [run_layout(name, path, *layout) for name, *layout in LAYOUTS]


def test_packed_training_at_pp_dp_tp_and_sequence_parallel_equals_one_process(sft_data):
    for rank, results in enumerate(run_distributed(check_layouts, 4, sft_data, timeout=300)):
        for layout, worst in zip(LAYOUTS, results):
            assert set(worst) >= {"loss", "weight", "grad"}
            for what, diff in worst.items():
                assert diff <= TOL, f"rank {rank}, (model, pp, dp, tp, sp, m)={layout}: {what} differs by {diff:.3g}"


@pytest.mark.parametrize("overrides, message", [
    (["data.source=synthetic"], "data.pack=true packs documents, but data.source=synthetic has none"),
    (["model.family=toy"], "data.pack=true needs a model that takes packed positions .* model.family=toy does not"),
])
def test_what_packing_does_not_support_is_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.pack=true", *overrides])
    assert not load_config(None, overrides).data.pack  # off by default
    assert load_config(None, ["data.pack=true", "model.family=llama", "parallel.tp=2",
                              "parallel.sequence_parallel=true"]).data.pack
