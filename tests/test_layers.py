"""Tensor-parallel layers: tp=N against one process, meta runs, references, errors.

The multi-process tests spawn one gloo group of 2 and one of 4; every rank
builds each layer at tp=1 and at tp=N under the same seed, checks that its
shards are slices of the full tensors, runs forward and backward on the same
input and compares outputs, input gradients and (gathered) parameter
gradients in float64 to 1e-10.

In-process tests use `FakeGroup`, a stand-in tp group that only knows its size
and rank: layers can be built against it (construction never communicates)
and run on meta tensors, and any collective handed it would raise, which is
how "meta runs do not communicate" is checked without processes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipekit.layers import (
    CausalSelfAttention,
    ColumnParallelLinear,
    GeluMLP,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    SwiGLUMLP,
    TransformerBlock,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    apply_rotary,
    current_tp_group,
    gather_from_tp,
    group_rank,
    group_size,
    rotary_cos_sin,
    scatter_to_tp,
    shard_dim,
    tensor_parallel,
    tp_slice,
    vocab_parallel_cross_entropy,
)
from pipekit.models.gpt2 import gpt2_block_parts
from pipekit.models.llama import llama_block_parts
from pipekit.testing import FakeGroup, in_float64, run_distributed

SEED = 1234
TOL = dict(atol=1e-10, rtol=1e-10)


pytestmark = pytest.mark.usefixtures("float64")  # conftest.py


# ---- the cases: one per layer configuration ------------------------------------
@dataclass
class Case:
    """A layer to compare: `build()` constructs it (its group from the context),
    `inputs()` draws full inputs; at tp>1 input i arrives split along
    `in_dims[i]` (None: full) and the output is split along `out_dim`."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], list]
    in_dims: tuple = (None,)
    out_dim: int | None = None


def _x(*shape):
    return lambda: [torch.randn(*shape)]


def _xent_inputs():
    logits = torch.randn(3, 7, 32) * 3
    targets = torch.randint(0, 32, (3, 7))
    targets[0, :3] = -100
    targets[2, 6] = -100
    return [logits, targets]


CASES = [
    Case("column", lambda: ColumnParallelLinear(12, 16), _x(3, 5, 12), out_dim=-1),
    Case("column_gather", lambda: ColumnParallelLinear(12, 16, gather_output=True), _x(3, 5, 12)),
    Case("column_nobias", lambda: ColumnParallelLinear(12, 16, bias=False, init_std=0.5), _x(2, 12), out_dim=-1),
    Case("row_parallel_input", lambda: RowParallelLinear(16, 12), _x(3, 5, 16), in_dims=(-1,)),
    Case("row_full_input", lambda: RowParallelLinear(16, 12, input_is_parallel=False), _x(3, 5, 16)),
    Case("embedding", lambda: VocabParallelEmbedding(32, 12, init_std=1.0),
         lambda: [torch.randint(0, 32, (3, 9))]),
    Case("cross_entropy", lambda: VocabParallelCrossEntropy(), _xent_inputs, in_dims=(-1, None)),
    Case("attn_gqa_rope", lambda: CausalSelfAttention(32, 8, 4, bias=False, rope_theta=10000.0, init_std=0.2),
         _x(2, 6, 32)),
    Case("attn_mha", lambda: CausalSelfAttention(32, 4, init_std=0.2, out_init_std=0.1), _x(2, 6, 32)),
    Case("gelu_mlp", lambda: GeluMLP(16, 64), _x(2, 5, 16)),
    Case("swiglu_mlp", lambda: SwiGLUMLP(16, 48, init_std=0.3), _x(2, 5, 16)),
    Case("block_gpt2", lambda: TransformerBlock(32, **gpt2_block_parts(4, 128, 1e-5), n_layers_for_init=6),
         _x(2, 6, 32)),
    Case("block_llama", lambda: TransformerBlock(32, **llama_block_parts(8, 4, 64, 1e-6, 500000.0)), _x(2, 6, 32)),
]


def assert_close(actual, expected, msg: str) -> None:
    """Same shape and within TOL (torch.testing.assert_close would import torch._dynamo,
    seconds per spawned worker)."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.allclose(actual, expected, **TOL):
        raise AssertionError(f"{msg}: max abs difference {(actual - expected).abs().max().item():.3e}")


def _split(x, dim, group):
    return x if dim is None else tp_slice(x, dim, group)


def _gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _build_pair(case: Case, group):
    """The tp=1 module and this rank's tp module, built from the same seed; also
    checks that both consumed the random stream identically."""
    torch.manual_seed(SEED)
    ref = case.build()
    after_ref = torch.rand(1)
    torch.manual_seed(SEED)
    with tensor_parallel(group):
        mod = case.build()
    assert torch.equal(torch.rand(1), after_ref), f"{case.name}: random stream consumed differently"
    return ref, mod


def check_shards(ref: nn.Module, mod: nn.Module, group, name: str) -> None:
    """Same parameter names; each shard is exactly the slice of the full tensor."""
    full = dict(ref.named_parameters())
    assert list(full) == [n for n, _ in mod.named_parameters()], name
    for pname, p in mod.named_parameters():
        d = shard_dim(p)
        assert shard_dim(full[pname]) == d, f"{name}.{pname}: mark differs between tp sizes"
        expect = full[pname] if d is None or group_size(group) == 1 else tp_slice(full[pname].detach(), d, group)
        assert torch.equal(p.detach(), expect), f"{name}.{pname}: shard is not the slice of the full tensor"


def compare_case(case: Case, group) -> tuple:
    """Run `case` at tp=1 and on `group`; assert outputs and gradients agree. Returns the tp output shape."""
    ref, mod = _build_pair(case, group)
    check_shards(ref, mod, group, case.name)
    torch.manual_seed(SEED + 1)
    inputs = case.inputs()
    ref_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    tp_in = [_split(x, d, group).clone().requires_grad_(x.is_floating_point()) for x, d in zip(inputs, case.in_dims)]
    ref_out, out = ref(*ref_in), mod(*tp_in)
    grad_out = torch.randn_like(ref_out)
    (ref_out * grad_out).sum().backward()
    (out * _split(grad_out, case.out_dim, group)).sum().backward()
    where = f"{case.name} at tp={group_size(group)} rank {group_rank(group)}"
    assert_close(out, _split(ref_out.detach(), case.out_dim, group), f"{where}: output")
    for x, r, d in zip(tp_in, ref_in, case.in_dims):
        if x.requires_grad:
            assert_close(x.grad, _split(r.grad, d, group), f"{where}: input grad")
    ref_params = dict(ref.named_parameters())
    for pname, p in mod.named_parameters():
        d = shard_dim(p)
        grad = p.grad if d is None else _gather(p.grad, d, group)
        assert_close(grad, ref_params[pname].grad, f"{where}: grad of {pname}")
    return tuple(out.shape)


class _NoCollectives:
    """Within the block every collective raises (to prove meta runs do not communicate)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast")

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(dist, n, self._fail(n))

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)

    @staticmethod
    def _fail(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"{name} called during a meta run")
        return fail


def meta_case(case: Case, group, expected_shape) -> None:
    """Build `case` on meta inside tensor_parallel(group) and run forward on meta inputs."""
    with tensor_parallel(group), torch.device("meta"):
        mod = case.build()
    assert all(p.is_meta for p in mod.parameters()), case.name
    torch.manual_seed(SEED + 1)
    inputs = [_split(x, d, group).to("meta") for x, d in zip(case.inputs(), case.in_dims)]
    with torch.no_grad(), _NoCollectives():
        out = mod(*inputs)
    assert out.is_meta and tuple(out.shape) == tuple(expected_shape), (case.name, out.shape, expected_shape)


@in_float64
def _tp_worker(with_meta: bool) -> list[str]:
    """Every case on the world group; with `with_meta`, each also built and run on
    meta inside the real group (the first meta op costs seconds of imports per
    worker, so only the tp=2 group does it; test_fake_group_shards_and_meta
    covers meta at every case in-process)."""
    group = dist.group.WORLD
    done = []
    for case in CASES:
        shape = compare_case(case, group)
        if with_meta:
            meta_case(case, group, shape)
        done.append(case.name)
    done += _primitive_checks(group)
    return done


def _primitive_checks(group) -> list[str]:
    """The bare collectives: values and gradients on a (4, 8) tensor split along dim 0."""
    torch.manual_seed(SEED)
    full = torch.randn(8, 4)
    x = full.clone().requires_grad_()
    part = scatter_to_tp(x, group, dim=0)
    assert_close(part, tp_slice(full, 0, group), "scatter_to_tp")
    y = gather_from_tp(part * 2, group, dim=0)
    assert_close(y, full * 2, "gather_from_tp")
    (y * torch.arange(8.0).unsqueeze(-1)).sum().backward()
    assert_close(x.grad, 2 * torch.arange(8.0).unsqueeze(-1).expand(8, 4), "gather/scatter backward")
    return ["primitives"]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(tp):
    done = run_distributed(_tp_worker, tp, tp == 2)
    expected = [c.name for c in CASES] + ["primitives"]
    assert all(d == expected for d in done)


# ---- in-process: construction, shards, meta with a fake group ------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fake_group_shards_and_meta(case):
    """Every rank of a tp=4 group gets its slice and the same random stream; on meta
    every layer runs inside a size-2 group without communicating."""
    for rank in range(4):
        ref, mod = _build_pair(case, FakeGroup(4, rank))
        check_shards(ref, mod, FakeGroup(4, rank), case.name)
    ref = case.build()
    torch.manual_seed(SEED + 1)
    ref_out = ref(*case.inputs())
    expected = list(ref_out.shape)
    if case.out_dim is not None:
        expected[case.out_dim] //= 2
    meta_case(case, FakeGroup(2, 1), expected)


def test_group_capture_and_names():
    g = FakeGroup(2, 1)
    assert current_tp_group() is None
    with tensor_parallel(g):
        assert current_tp_group() is g
        block = TransformerBlock(32, **llama_block_parts(4, 2, 64, 1e-6, 10000.0))
    assert current_tp_group() is None
    assert block.attn.q.group is g and block.mlp.down.group is g
    assert (group_size(None), group_rank(None), group_size(g), group_rank(g)) == (1, 0, 2, 1)
    names = [n for n, _ in block.named_parameters()]
    plain = TransformerBlock(32, **llama_block_parts(4, 2, 64, 1e-6, 10000.0))
    assert names == [n for n, _ in plain.named_parameters()]
    assert names == ["norm1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
                     "norm2.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"]
    marks = {n: shard_dim(p) for n, p in block.named_parameters()}
    assert marks == {"norm1.weight": None, "attn.q.weight": 0, "attn.k.weight": 0, "attn.v.weight": 0,
                     "attn.o.weight": 1, "norm2.weight": None, "mlp.gate.weight": 0, "mlp.up.weight": 0,
                     "mlp.down.weight": 1}
    copied = copy.deepcopy(block)
    assert copied.attn.q.group is g
    assert {n: shard_dim(p) for n, p in copied.named_parameters()} == marks


def test_row_bias_replicated_column_bias_sharded():
    with tensor_parallel(FakeGroup(4, 3)):
        col, row = ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)
    assert (col.weight.shape, col.bias.shape, shard_dim(col.bias)) == ((4, 8), (4,), 0)
    assert (row.weight.shape, row.bias.shape, shard_dim(row.bias)) == ((8, 4), (8,), None)


def test_init_draw_order():
    """Full tensors are drawn in construction order: q, k, v, o, then the MLP;
    biases are zero and the output projections use the GPT-2 scaled std."""
    torch.manual_seed(7)
    with tensor_parallel(FakeGroup(2, 1)):
        block = TransformerBlock(16, **gpt2_block_parts(4, 64, 1e-5), n_layers_for_init=3)
    torch.manual_seed(7)
    out_std = 0.02 / math.sqrt(6)
    shapes = [("attn.q", (16, 16), 0.02), ("attn.k", (16, 16), 0.02), ("attn.v", (16, 16), 0.02),
              ("attn.o", (16, 16), out_std), ("mlp.fc", (64, 16), 0.02), ("mlp.proj", (16, 64), out_std)]
    for name, shape, std in shapes:
        full = torch.empty(shape).normal_(0.0, std)
        layer = block.get_submodule(name)
        assert torch.equal(layer.weight, tp_slice(full, shard_dim(layer.weight), FakeGroup(2, 1))), name
        assert not layer.bias.any(), name


# ---- references ----------------------------------------------------------------
def _rotate_half_reference(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_reference(x, theta):
    """HF Llama rotary applied to x (B, H, T, hd), written out position by position."""
    T, hd = x.shape[-2], x.shape[-1]
    out = torch.empty_like(x)
    for pos in range(T):
        inv_freq = torch.tensor([theta ** (-(2 * i) / hd) for i in range(hd // 2)], dtype=torch.float64)
        angle = torch.cat([pos * inv_freq, pos * inv_freq])
        out[..., pos, :] = x[..., pos, :] * angle.cos() + _rotate_half_reference(x[..., pos, :]) * angle.sin()
    return out


def test_rotary_matches_hf_convention():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = rotary_cos_sin(5, 8, 500000.0, "cpu", torch.float64)
    assert cos.shape == sin.shape == (5, 8)
    rq, rk = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(rq, _rope_reference(q, 500000.0), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(rk, _rope_reference(k, 500000.0), atol=1e-12, rtol=1e-12)
    # pairs (i, i + hd/2) are rotated: norms per pair are kept, position 0 is untouched
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])
    torch.testing.assert_close(rq[..., :4].pow(2) + rq[..., 4:].pow(2), q[..., :4].pow(2) + q[..., 4:].pow(2))
    c32, _ = rotary_cos_sin(5, 8, 10000.0, None, torch.bfloat16)
    assert c32.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="head_dim=7"):
        rotary_cos_sin(4, 7)


def _attention_reference(attn: CausalSelfAttention, x, n_heads, n_kv_heads, theta):
    B, T, D = x.shape
    hd = D // n_heads
    q = attn.q(x).view(B, T, n_heads, hd).transpose(1, 2)
    k = attn.k(x).view(B, T, n_kv_heads, hd).transpose(1, 2)
    v = attn.v(x).view(B, T, n_kv_heads, hd).transpose(1, 2)
    if theta is not None:
        q, k = _rope_reference(q, theta), _rope_reference(k, theta)
    group = n_heads // n_kv_heads
    k = torch.stack([k[:, h // group] for h in range(n_heads)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(n_heads)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.o(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("n_heads,n_kv_heads,theta", [(4, 4, None), (8, 2, 10000.0), (4, 1, 10000.0)])
def test_attention_matches_reference(n_heads, n_kv_heads, theta):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, n_heads, n_kv_heads, rope_theta=theta, init_std=0.3)
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(attn(x), _attention_reference(attn, x, n_heads, n_kv_heads, theta), **TOL)


def test_norms():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    rms = RMSNorm(8, eps=1e-5)
    rms.weight.data.uniform_()
    expect = rms.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms(x), expect, **TOL)
    xb = x.to(torch.bfloat16)
    rms_b = RMSNorm(8).to(torch.bfloat16)
    hf_style = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert rms_b(xb).dtype == torch.bfloat16 and torch.equal(rms_b(xb), rms_b.weight * hf_style)
    ln = LayerNorm(8)
    ref = nn.LayerNorm(8)
    torch.testing.assert_close(ln(x), ref(x), **TOL)
    assert LayerNorm(8, bias=False).bias is None
    assert [n for n, _ in LayerNorm(8).named_parameters()] == ["weight", "bias"]


def test_mlps_match_formulas():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    gelu = GeluMLP(8, 32)
    h = gelu.fc(x)
    gelu_new = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h.pow(3))))
    torch.testing.assert_close(gelu(x), gelu.proj(gelu_new), **TOL)
    swiglu = SwiGLUMLP(8, 24)
    assert swiglu.gate.bias is None
    g = swiglu.gate(x)
    torch.testing.assert_close(swiglu(x), swiglu.down(g * torch.sigmoid(g) * swiglu.up(x)), **TOL)


def test_linear_tp1_is_plain_linear():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    col, row = ColumnParallelLinear(6, 10), RowParallelLinear(6, 10)
    torch.testing.assert_close(col(x), F.linear(x, col.weight, col.bias), **TOL)
    torch.testing.assert_close(row(x), F.linear(x, row.weight, row.bias), **TOL)
    assert shard_dim(col.weight) == 0 and shard_dim(row.weight) == 1 and shard_dim(row.bias) is None


def test_cross_entropy_tp1_matches_torch():
    torch.manual_seed(0)
    logits, targets = _xent_inputs()
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(a, targets, None)
    ref = F.cross_entropy(b.view(-1, 32), targets.view(-1), ignore_index=-100)
    torch.testing.assert_close(loss, ref, **TOL)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, **TOL)
    ignored = torch.full((3, 7), 5)
    loss5 = VocabParallelCrossEntropy(ignore_index=5)(a, ignored)
    assert loss5.item() == 0.0
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(a, targets[:, :3], None)


def test_cross_entropy_half_precision_runs_in_float32():
    torch.manual_seed(0)
    logits = (torch.randn(5, 16) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 16, (5,))
    loss = vocab_parallel_cross_entropy(logits, targets, None)
    assert loss.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.detach().float(), targets)
    torch.testing.assert_close(loss.float(), ref, atol=1e-2, rtol=1e-2)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


# ---- errors --------------------------------------------------------------------
def test_errors_name_the_values():
    with tensor_parallel(FakeGroup(4)):
        with pytest.raises(ValueError, match=r"n_heads=6 .*tensor-parallel size 4"):
            CausalSelfAttention(24, 6)
        with pytest.raises(ValueError, match=r"n_kv_heads=2 .*tensor-parallel size 4"):
            CausalSelfAttention(32, 8, 2)
        with pytest.raises(ValueError, match=r"n_heads=6 .*tensor-parallel size 4"):
            TransformerBlock(24, **llama_block_parts(6, 6, 64, 1e-6, 10000.0))
        with pytest.raises(ValueError, match=r"num_embeddings=50257 .*tensor-parallel size 4"):
            VocabParallelEmbedding(50257, 8)
        with pytest.raises(ValueError, match=r"out_features=10 .*tensor-parallel size 4"):
            ColumnParallelLinear(8, 10)
        with pytest.raises(ValueError, match=r"in_features=10 .*tensor-parallel size 4"):
            RowParallelLinear(10, 8)
    with pytest.raises(ValueError, match=r"n_heads=8 is not divisible by n_kv_heads=3"):
        CausalSelfAttention(32, 8, 3)


# ---- sliding-window attention --------------------------------------------------------
@in_float64
def test_sliding_window_attention_sees_the_last_w_tokens_and_stays_in_its_document():
    """window_mask against a loop over (query, key); a window at least T long is plain causal
    attention, bitwise; packed documents with a window equal each document run alone; a
    shorter window changes the output (it is applied)."""
    from pipekit.layers.attention import window_mask

    for T, W in ((7, 3), (5, 1), (4, 9)):
        want = torch.tensor([[t - W < s <= t for s in range(T)] for t in range(T)])
        assert torch.equal(window_mask(T, W), want)
    torch.manual_seed(0)
    plain = CausalSelfAttention(16, 4, 2, bias=False, rope_theta=10000.0)
    windowed = CausalSelfAttention(16, 4, 2, bias=False, rope_theta=10000.0, sliding_window=3)
    wide = CausalSelfAttention(16, 4, 2, bias=False, rope_theta=10000.0, sliding_window=9)
    windowed.load_state_dict(plain.state_dict())
    wide.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, 16)
    assert torch.equal(wide(x), plain(x))
    assert (windowed(x) - plain(x)).abs().max() > 1e-3
    docs = [x[:, :5], x[:, 5:]]  # two documents of 5 and 4 tokens packed in one row
    positions = torch.cat([torch.arange(5), torch.arange(4)]).expand(2, 9)
    alone = torch.cat([windowed(d) for d in docs], dim=1)
    torch.testing.assert_close(windowed(x, positions), alone, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        CausalSelfAttention(16, 4, 2, sliding_window=0)
