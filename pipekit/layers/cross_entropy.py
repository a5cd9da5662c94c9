"""Cross-entropy over logits whose vocabulary is split over the tp group.

The full (tokens, vocab) logits never exist on any rank. Forward, per token:

    m     = max over the whole vocabulary        all-reduce (max)  of (N,)
    s     = sum of exp(logit - m)                all-reduce (sum)  \\ one all-reduce
    z_t   = logit of the target - m              all-reduce (sum)  / of (2, N)
    loss  = log(s) - z_t

(only the rank holding the target contributes a non-zero z_t). Backward needs
no communication: the gradient on each shard is (softmax - onehot) * g / count,
with the softmax kept from forward.

Precision: half-precision logits are computed in float32; float32 and float64
stay as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import TensorParallelModule, _all_reduce, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local).to(torch.promote_types(logits.dtype, torch.float32))  # (N, V/tp)
        t = targets.reshape(-1)  # (N,)
        valid = t != ignore_index
        local_t = t - group_rank(group) * v_local
        here = valid & (local_t >= 0) & (local_t < v_local)  # target id lives on this shard
        local_t = local_t.masked_fill(~here, 0)

        m = _all_reduce(x.max(dim=-1).values, group, op=dist.ReduceOp.MAX)  # (N,)
        x = x - m.unsqueeze(-1)
        exp = x.exp()
        z_t = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), z_t]), group)  # (2, N): sum-exp, target logit
        per_token = (sums[0].log() - sums[1]).masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1)
        softmax = exp.div_(sums[0].unsqueeze(-1))  # (N, V/tp), in place of exp
        ctx.save_for_backward(softmax, local_t, here, valid, count)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return (per_token.sum() / count).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, here, valid, count = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= here.to(g.dtype)  # minus onehot, only where the target is on this shard
        g = g * (valid.to(g.dtype) * (grad / count)).unsqueeze(-1)
        return g.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not `ignore_index`.

    logits_shard: (..., V/tp), this rank's slice of the vocabulary (rank r holds
    ids [r*V/tp, (r+1)*V/tp)); targets: (...) global ids. Communication: two
    forward all-reduces (see the module docstring), none in backward. When
    every target is ignored the loss is 0 (not NaN) and so is the gradient.
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and targets {tuple(targets.shape)} "
                         "disagree: expected logits (..., V/tp) and targets (...)")
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, group, ignore_index)


class VocabParallelCrossEntropy(TensorParallelModule):
    """`vocab_parallel_cross_entropy` as a module holding its group (None: the
    current tp group at construction), usable as a PipelineModule loss."""

    def __init__(self, ignore_index: int = -100, group=None):
        super().__init__(group)
        self.ignore_index = ignore_index

    def forward(self, logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, targets, self.group, self.ignore_index)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, tp={group_size(self.group)}"
