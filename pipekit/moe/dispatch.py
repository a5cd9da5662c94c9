"""Token dispatch and combine: sort token-slots by expert, (drop,) exchange, compute, un-sort.

A token-slot is one (token t, choice k) of the router's (T, K) decision,
numbered s = t*K + k. The plan sorts the slots by expert, stably (so slots of
one expert stay in token order), and the layer then:

  permute   x_ND = x_TD[token of each sorted slot]                    (gather)
  compute   y_ND = experts(x_ND), rows grouped by expert              (grouped.py)
  combine   out_TD[t] = sum over t's kept slots of weight * y         (index_add)

The combine accumulates in the routing dtype (float32, float64 for float64
input) and casts back to the input's dtype.

Capacity (`capacity_factor` set): capacity = ceil(capacity_factor * T * K / E)
slots per expert, T this rank's tokens. An expert's slots beyond it are
dropped before any computation: by position (earlier tokens win) or by score
(larger combine weight wins; ties by position). A dropped slot contributes 0,
so a token whose every slot is dropped leaves the layer as 0 (the residual
around the block carries it). Without a capacity nothing is dropped
(dropless, MegaBlocks' sense).

Expert parallelism (`expert_parallel_apply`, group of ep ranks, rank r holding
experts [r*E/ep, (r+1)*E/ep)): the sorted slots for rank r's experts are
contiguous, so one exchange sends them:
  1. all_to_all of the per-expert counts (E ints, viewed (ep, E/ep));
  2. all_to_all_single of the rows with those split sizes (autograd: the
     backward is the all_to_all of the gradient with the splits swapped);
  3. the received rows, grouped by source rank then local expert, are sorted
     stably by local expert, run through the local experts, un-sorted;
  4. all_to_all_single back with the splits swapped.
Every rank makes the same collective calls in the same order, also when it
sends or receives nothing, and the empty tensors stay in the autograd graph,
so backward never leaves a peer waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..layers.parallel import group_size

DROP_POLICIES = ("position", "score")


@dataclass
class DispatchPlan:
    """Where each kept token-slot goes, sorted by expert (N kept slots)."""

    token_N: torch.Tensor  # (N,) int64 token index of each sorted slot
    weight_N: torch.Tensor  # (N,) combine weight of each sorted slot
    counts_E: torch.Tensor  # (E,) int64 kept slots per expert (sums to N)
    dropped: torch.Tensor  # scalar int64, token-slots dropped for capacity


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """ceil(capacity_factor * tokens * top_k / n_experts): slots each expert keeps."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def plan_dispatch(experts_TK: torch.Tensor, weights_TK: torch.Tensor, n_experts: int,
                  capacity_factor: float | None = None, drop_policy: str = "position") -> DispatchPlan:
    """Sort the (T, K) slots by expert, dropping those beyond capacity when one is set."""
    T, K = experts_TK.shape
    expert_S, weight_S = experts_TK.reshape(-1), weights_TK.reshape(-1)
    counts_E = torch.bincount(expert_S, minlength=n_experts)
    if capacity_factor is None:
        order_N = torch.argsort(expert_S, stable=True)
        return DispatchPlan(order_N // K, weight_S[order_N], counts_E, torch.zeros((), dtype=torch.long))
    if drop_policy == "score":  # by descending weight (stable: ties by position), then by expert
        by_score = torch.argsort(weight_S.detach(), descending=True, stable=True)
        order_S = by_score[torch.argsort(expert_S[by_score], stable=True)]
    else:
        order_S = torch.argsort(expert_S, stable=True)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_S = torch.arange(expert_S.numel(), device=expert_S.device) - starts_E[expert_S[order_S]]
    keep = rank_S < capacity(capacity_factor, T, K, n_experts)
    order_N = order_S[keep]
    kept_E = torch.bincount(expert_S[order_N], minlength=n_experts)
    return DispatchPlan(order_N // K, weight_S[order_N], kept_E, (~keep).sum())


def permute(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """The rows the experts see, sorted by expert: (N, D)."""
    return x_TD[plan.token_N]


def combine(y_ND: torch.Tensor, plan: DispatchPlan, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum of weight * y over t's kept slots, accumulated in `dtype`: (T, D) in y's dtype."""
    weighted_ND = y_ND.to(dtype) * plan.weight_N.to(dtype).unsqueeze(-1)
    out_TD = torch.zeros(tokens, y_ND.shape[-1], dtype=dtype, device=y_ND.device)
    return out_TD.index_add(0, plan.token_N, weighted_ND).to(y_ND.dtype)


# ---- expert parallelism -------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send rows `x[in_splits[r] block]` to rank r, receive `out_splits[r]` rows from it;
    backward sends the gradient back the same way (splits swapped)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """(ep, E/ep): row r = how many rows rank r sends for each of this rank's experts."""
    ep = group_size(group)
    recv = torch.empty_like(counts_E)
    dist.all_to_all_single(recv, counts_E.contiguous(), group=group)
    return recv.view(ep, -1)


def expert_parallel_apply(x_ND: torch.Tensor, counts_E: torch.Tensor,
                          experts: Callable[[torch.Tensor, list[int]], torch.Tensor], group) -> torch.Tensor:
    """experts(rows, sizes) over rows sorted by global expert, each row computed on the ep
    rank holding its expert and returned: (N, D) -> (N, D), same order. ep=1: a local call."""
    ep = group_size(group)
    if ep == 1:
        return experts(x_ND, counts_E.tolist())
    recv_RL = exchange_counts(counts_E, group)  # (ep, E_local)
    in_splits = counts_E.view(ep, -1).sum(1).tolist()
    out_splits = recv_RL.sum(1).tolist()
    x_recv = all_to_all(x_ND, out_splits, in_splits, group)  # grouped by (source rank, local expert)
    n_local = recv_RL.shape[1]
    local_of_row = torch.repeat_interleave(torch.arange(n_local, device=x_ND.device).repeat(ep),
                                           recv_RL.reshape(-1), output_size=x_recv.shape[0])
    by_expert = torch.argsort(local_of_row, stable=True)  # grouped by (local expert, source rank)
    y_sorted = experts(x_recv[by_expert], recv_RL.sum(0).tolist())
    y_recv = y_sorted[torch.argsort(by_expert)]  # back to (source rank, local expert)
    return all_to_all(y_recv, in_splits, out_splits, group)


def all_reduce_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """Sum of `counts_E` over `group` (a copy; itself when the group has one rank)."""
    if group_size(group) == 1:
        return counts_E
    out = counts_E.clone()
    dist.all_reduce(out, group=group)
    return out
