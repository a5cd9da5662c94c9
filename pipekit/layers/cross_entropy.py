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

`FusedLinearCrossEntropy` is the head and this loss in one, for training without
the logits at all (`pipekit.kernels.linear_cross_entropy`, the same two
all-reduces per chunk of tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..kernels import linear_cross_entropy
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


class FusedLinearCrossEntropy(nn.Module):
    """The head and the loss as one: `pipekit.kernels.linear_cross_entropy` of the hidden states
    and the head's weight, so training never holds the (N, Vp/tp) logits (Liger-Kernel's
    `fused_linear_cross_entropy`). What a zoo model with `fused_loss=True` is trained with.

    Bound to the model's head by PipelineModule (`bind_head`, on the last stage's rank): the
    last layer's module, or what `head_of` picks out of it (GPT-2's tied table, `wte`), a
    module with `weight` (Vp/tp, D), `vocab_start` and `group`, like `VocabParallelHead` and
    `VocabParallelEmbedding`; it stays the head's parameter (not this module's: same names,
    same tie groups and optimizer), its gradient coming through the kernel. The head's mode
    says what it gave: in training (a fused head passes the hidden states (..., D) through)
    this is the kernel, vocab-parallel over the head's group (which all-reduces dh itself:
    the head skips `copy_to_tp`), the ids >= `vocab_size` masked; in eval (the head gives its
    logits, for eval_batch's outputs and generate) it is `vocab_parallel_cross_entropy`.

    Precision (`keeps_output_dtype`: the engine does not cast the last stage's output to
    float32 for it): h comes in the layers' dtype, as the head's weight; each chunk's logits
    are made by a matmul in that dtype and taken to float32 for the softmax, exactly as the
    unfused head makes its logits and the engine takes them to float32. The loss is float32.

    Memory: the kernel makes the gradients in forward and keeps them until backward, dh (N, D)
    and dw (Vp/tp, D) in float32, per microbatch whose backward has not run yet on the last
    stage: one under 1F1B, a few where a zero-bubble schedule defers the weight pass (dw waits
    for W), M under GPipe (as the unfused loss keeps M softmaxes of (N, Vp/tp)).
    """

    keeps_output_dtype = True

    def __init__(self, vocab_size: int, ignore_index: int = -100, head_of: Callable | None = None):
        super().__init__()
        self.vocab_size, self.ignore_index, self.head_of = vocab_size, ignore_index, head_of
        self._head: Any = None  # a module with weight, vocab_start and group (`bind_head`)

    def bind_head(self, layer: nn.Module) -> None:
        """Read the head's weight from `layer` (this rank's last layer) from now on."""
        object.__setattr__(self, "_head", self.head_of(layer) if self.head_of else layer)  # not a submodule

    def forward(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self._head
        if head is None:
            raise RuntimeError("FusedLinearCrossEntropy has no head: PipelineModule(specs, loss_fn=...) binds it to "
                               "the last layer (bind_head); call bind_head(head) when using it on its own")
        if not head.training:  # the head gave its logits
            return vocab_parallel_cross_entropy(out.to(torch.promote_types(out.dtype, torch.float32)), targets,
                                                head.group, self.ignore_index)
        return linear_cross_entropy(out.to(head.weight.dtype), head.weight, targets, ignore_index=self.ignore_index,
                                    vocab_size=self.vocab_size, vocab_start=head.vocab_start, tp_group=head.group)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, ignore_index={self.ignore_index}"
