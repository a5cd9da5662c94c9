"""Context parallelism's attention core (`pipekit.layers.context`) equals one process.

One spawn of 4 gloo ranks serves every multi-rank check: cp=4 on the world, cp=2 on
the two pairs [0, 1] and [2, 3] (both pairs run every cp=2 case). Float64, B=2, T not
a power of two (12 at cp=2, 24 at cp=4): ring and Ulysses, Hq=4 with Hkv in {4, 2, 1},
with and without packed documents (boundaries off the chunk edges); every rank checks
its output and dq, dk, dv within 1e-12 of explicit softmax attention over the whole
sequence. In bf16 at cp=4 the error against float64 is at most 1.5x that of cp=1 SDPA
in bf16 on the same inputs; the bytes sent follow the formulas of the module docstring.
In this process: the layout round trip, "sdpa" bitwise equal to `CausalSelfAttention`,
the ring's own block math at cp=1, meta shapes and the one-line errors.
"""

from __future__ import annotations

import math

import einops
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipekit.layers import CausalSelfAttention
from pipekit.layers.attention import document_mask
from pipekit.layers.context import (
    attention_core,
    attention_mask,
    chunk_index,
    reset_sent_bytes,
    sent_bytes,
    shard_sequence,
    unshard_sequence,
)
from pipekit.layers.linear import column_parallel_linears
from pipekit.testing import FakeGroup, run_distributed

TOL = 1e-12
B, D = 2, 8
SEQ = {2: 12, 4: 24}  # T per cp: C = 3 tokens a chunk
DOC_LENGTHS = {12: ([5, 4, 3], [2, 7, 3]), 24: ([7, 6, 11], [3, 10, 5, 6]), 64: ([13, 30, 21], [40, 24])}
HEADS = [(4, 4), (4, 2), (4, 1)]
CASES = [(cp, mode, hq, hkv, docs) for cp in (2, 4) for mode in ("ring", "ulysses") for hq, hkv in HEADS
         for docs in (False, True)]


def case_id(case) -> str:
    cp, mode, hq, hkv, docs = case
    return f"{mode}-cp{cp}-hq{hq}-hkv{hkv}" + ("-docs" if docs else "")


def doc_ids(T: int) -> torch.Tensor:
    """(B, T) document ids of packed rows: a few documents each, boundaries off the chunk edges."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in DOC_LENGTHS[T]])


def inputs(T: int, hq: int, hkv: int, seed: int = 0, d: int = D) -> tuple[torch.Tensor, ...]:
    """q, k, v and an output gradient over the whole sequence, float64, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, hq, T, d), (B, hkv, T, d), (B, hkv, T, d), (B, hq, T, d)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)


def reference(q, k, v, doc=None) -> torch.Tensor:
    """Explicit softmax attention over the whole sequence, query t seeing key s <= t of its document."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if doc is not None:
        mask = mask & (doc.unsqueeze(2) == doc.unsqueeze(1)).unsqueeze(1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    return scores.softmax(-1) @ v


def with_grads(fn, tensors, dy) -> list[torch.Tensor]:
    """fn(*tensors) and the gradients of <fn(...), dy> with respect to each of `tensors`."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


def as_in_a_model(x: torch.Tensor) -> torch.Tensor:
    """`x` (B, H, T, d) as the attention layer makes it: a view of (B, T, H*d), not contiguous."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [(x.double() - y.double()).abs().max().item() for x, y in zip(a, b)]


# ---- the spawned checks ----------------------------------------------------------------
def run_case(group, cp: int, mode: str, hq: int, hkv: int, docs: bool, dtype=torch.float64,
             T: int | None = None, d: int = D) -> list[float]:
    """This rank's worst errors (output, dq, dk, dv) of `mode` against the whole-sequence
    reference in float64 (on the inputs rounded to `dtype`)."""
    T = SEQ[cp] if T is None else T
    rank = group.rank()
    q, k, v, dy = (t.to(dtype) for t in inputs(T, hq, hkv, d=d))
    doc = doc_ids(T) if docs else None
    want = with_grads(lambda *t: reference(*t, doc), [x.double() for x in (q, k, v)], dy.double())
    doc_local = None if doc is None else shard_sequence(doc, cp, rank)
    local = [as_in_a_model(shard_sequence(t, cp, rank, dim=2)) for t in (q, k, v)]
    got = with_grads(lambda *t: attention_core(*t, mode=mode, group=group, index=chunk_index(T // cp, cp, rank),
                                               doc=doc_local), local, shard_sequence(dy, cp, rank, dim=2))
    assert all(t.dtype == dtype for t in got), [t.dtype for t in got]
    return worst(got, [shard_sequence(t, cp, rank, dim=2) for t in want])


def bf16_errors(group, mode: str) -> dict[str, list[float]]:
    """bf16 at cp=4 and bf16 SDPA at cp=1 (whole sequence), each against float64, T=64 with documents."""
    T, hq, hkv, d = 64, 4, 2, 16
    q, k, v, dy = (t.to(torch.bfloat16) for t in inputs(T, hq, hkv, seed=1, d=d))
    doc = doc_ids(T)
    want = with_grads(lambda *t: reference(*t, doc), [x.double() for x in (q, k, v)], dy.double())
    one = with_grads(lambda *t: attention_core(*t, doc=doc), [q, k, v], dy)
    return {"cp1": worst(one, want), "cp4": run_case(group, 4, mode, hq, hkv, True, torch.bfloat16, T, d)}


def bytes_sent(group, mode: str) -> tuple[int, int]:
    """Bytes this rank sent in one forward, then in its backward, at cp=4, Hq=4, Hkv=2, no documents."""
    reset_sent_bytes()
    q, k, v, dy = (shard_sequence(t, 4, group.rank(), dim=2).requires_grad_() for t in inputs(SEQ[4], 4, 2))
    y = attention_core(q, k, v, mode=mode, group=group)
    forward = sent_bytes()
    y.backward(dy)
    return forward, sent_bytes() - forward


def _all_checks() -> dict:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    out: dict = {case: run_case(groups[case[0]], *case) for case in CASES}
    for mode in ("ring", "ulysses"):
        out[("bf16", mode)] = bf16_errors(groups[4], mode)
        out[("bytes", mode)] = bytes_sent(groups[4], mode)
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_all_checks, 4, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_context_parallel_attention_equals_one_process_in_float64(per_rank, case):
    for rank, results in enumerate(per_rank):
        errors = dict(zip(("out", "dq", "dk", "dv"), results[case]))
        assert max(errors.values()) < TOL, f"rank {rank}: {errors}"


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_bf16_at_cp4_is_no_worse_than_one_rank(per_rank, mode):
    for rank, results in enumerate(per_rank):
        errors = results[("bf16", mode)]
        for what, one, many in zip(("out", "dq", "dk", "dv"), errors["cp1"], errors["cp4"]):
            assert many <= 1.5 * one, f"rank {rank} {what}: cp=4 error {many:.3g}, cp=1 error {one:.3g}"


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_sent_bytes_follow_the_formulas(per_rank, mode):
    cp, T_local, f64 = 4, SEQ[4] // 4, 8
    kv_block = 2 * B * 2 * T_local * D * f64  # this rank's K and V, Hkv=2
    if mode == "ring":  # forward: cp-1 K/V blocks; backward: cp-1 K/V blocks and cp dK/dV blocks
        want = ((cp - 1) * kv_block, (cp - 1) * kv_block + cp * kv_block)
    else:  # q, k and v (kv heads repeated to 4, which cp divides) and the output: (cp-1)/cp of each
        per_pass = (cp - 1) * 4 * B * 4 * T_local * D * f64 // cp
        want = (per_pass, per_pass)
    assert [tuple(r[("bytes", mode)]) for r in per_rank] == [want] * 4


# ---- in this process ----------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunks_shard_and_unshard_round_trip(cp):
    T = 2 * cp * 5
    x = torch.arange(3 * T).view(3, T)
    parts = [shard_sequence(x, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x[:, chunk_index(T // cp, cp, r)])
    assert torch.equal(unshard_sequence(parts), x)
    assert sorted(torch.cat([chunk_index(T // cp, cp, r) for r in range(cp)]).tolist()) == list(range(T))
    assert chunk_index(4, 2, 1).tolist() == [2, 3, 4, 5] and chunk_index(4, 2, 0).tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_sdpa_without_index_is_causal_self_attention_bitwise(heads):
    torch.manual_seed(0)
    hq, hkv = heads
    attn = CausalSelfAttention(32, hq, hkv)
    x = torch.randn(2, 10, 32)
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=8) for t in column_parallel_linears(x, attn.q, attn.k,
                                                                                                  attn.v))
    y = attention_core(q, k, v)
    assert torch.equal(attn.o(einops.rearrange(y, "b h t d -> b t (h d)")), attn(x))
    r = hq // hkv
    inline = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
    assert torch.equal(y, inline)


def test_the_mask_rule_is_the_document_mask(float64):
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5, 0, 1, 2]])
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    doc, index = starts.cumsum(1), torch.arange(10)
    assert torch.equal(attention_mask(index, index, doc, doc), document_mask(positions))
    q, k, v, _ = inputs(10, 4, 2)
    assert worst([attention_core(q, k, v, doc=doc)], [reference(q, k, v, doc)])[0] < TOL


@pytest.mark.parametrize("docs", [False, True])
def test_the_ring_block_math_at_cp1_equals_one_process(docs):
    T = 14
    q, k, v, dy = inputs(T, 4, 2)
    doc = doc_ids(24)[:, 5:5 + T] if docs else None
    want = with_grads(lambda *t: reference(*t, doc), [q, k, v], dy)
    got = with_grads(lambda *t: attention_core(*t, mode="ring", group=FakeGroup(1), doc=doc), [q, k, v], dy)
    assert max(worst(got, want)) < TOL


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_meta_tensors_get_their_shape_without_communicating(mode):
    q, k = torch.empty(2, 4, 6, 8, device="meta"), torch.empty(2, 1, 6, 8, device="meta")
    y = attention_core(q, k, k, mode=mode, group=FakeGroup(4, 1))
    assert y.shape == q.shape and y.is_meta


ERRORS = [
    (dict(mode="flash3"), "mode='flash3' is not an attention backend"),
    (dict(mode="ring"), "mode='ring' needs the context-parallel process group; got group=None"),
    (dict(mode="ulysses"), "mode='ulysses' needs the context-parallel process group"),
    (dict(group=FakeGroup(2)), "mode='sdpa' attends locally and takes no group of 2 ranks"),
    (dict(mode="ring", group=FakeGroup(2), T=5), "T_local=5 is odd"),
    (dict(mode="ulysses", group=FakeGroup(4), hq=6, hkv=2), "Hq=6 query heads are not divisible by the Ulysses "
                                                             "degree cp=4"),
    (dict(hq=4, hkv=3), "Hq=4 query heads are not divisible by Hkv=3 kv heads"),
]


@pytest.mark.parametrize(("kwargs", "message"), ERRORS, ids=[m.split(" ")[0] for _, m in ERRORS])
def test_bad_input_fails_in_one_line_naming_the_values(kwargs, message):
    hq, hkv, T = kwargs.pop("hq", 4), kwargs.pop("hkv", 2), kwargs.pop("T", 6)
    q, k = torch.zeros(1, hq, T, 4, device="meta"), torch.zeros(1, hkv, T, 4, device="meta")
    with pytest.raises(ValueError) as err:
        attention_core(q, k, k, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_length_that_2cp_does_not_divide_fails_naming_t_and_cp():
    with pytest.raises(ValueError, match=r"^T=12 is not divisible by 2\*cp=8 \(cp=4\)") as err:
        shard_sequence(torch.zeros(2, 12), 4, 0)
    assert "\n" not in str(err.value)


def test_a_kv_cache_under_context_parallelism_is_refused_in_one_line():
    """Incremental decoding holds the whole sequence's keys on one rank: a layer built under cp
    refuses it before any communication (the cp group is never touched)."""
    from pipekit.layers.kv_cache import kv_cache

    attn = CausalSelfAttention(32, 4, 2, rope_theta=10000.0)
    attn.context = (object(), "ring")  # as built under context parallelism (a group it must not reach)
    x, positions = torch.randn(1, 4, 32), torch.arange(4)[None]
    with kv_cache(8), pytest.raises(ValueError, match=r"^a KV cache \(incremental decoding\) runs in one process, "
                                                      "not under context parallelism$"):
        attn(x, positions)
