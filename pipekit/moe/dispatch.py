"""Token dispatch and combine: the `Dispatcher` seam between the router and the experts.

A `Dispatcher` is built once per MoE layer (`make_dispatcher`, registry
`DISPATCHERS`) and called twice per forward, the only two calls of a forward
that communicate (besides the aux-free bias update's all-reduce, layer.py):

  dispatch(x_TD, routing) -> (x_MD, sizes, state)
      the M rows this rank's experts compute, grouped by local expert,
      `sizes[e]` of them for local expert e: an int64 tensor on x's device
      (dropless: the counts never leave the device) or Python ints known
      from the shapes (capacity mode); `state` is what combine needs (a
      `DispatchState`).
  combine(y_MD, state) -> out_TD
      the experts' rows back at their tokens: out[t] = sum over t's kept
      slots of weight * y, accumulated in the routing dtype (float32, float64
      for float64 input), returned in y's dtype.

Both are differentiable: backward runs their exchanges in reverse.

  local     (ep = 1) every expert is here: no communication.
  alltoall  (ep > 1, Megatron's "alltoall" dispatcher) experts sharded over
            the ep group; dispatch makes 2 collectives (1 with a capacity),
            combine 1 (and backward the mirror image: combine's exchange in
            dispatch's backward and vice versa), see `AllToAllDispatcher`.
  auto      local at ep = 1, alltoall otherwise (MoEMLP's default).

The dispatch plan (the same for every dispatcher, no communication). A
token-slot is one (token t, choice k) of the router's (T, K) decision,
numbered s = t*K + k. The plan sorts the slots by expert, stably (so slots of
one expert stay in token order), then:

  permute   x_ND = x_TD[token of each sorted slot]                    (gather)
  compute   y_ND = experts(x_ND), rows grouped by expert              (grouped.py)
  combine   out_TD[t] = sum over t's kept slots of weight * y         (index_add)

permute and combine are pipekit/kernels/moe_permute.py's `moe_permute` /
`moe_unpermute`: Triton by `use_triton` (CUDA), else the reference, which is the
gather and index_add above (bitwise the same on CPU in "auto", and in float64).

Capacity (`capacity_factor` set): capacity C = ceil(capacity_factor * T * K / E)
slots per expert, T this rank's tokens. An expert's slots beyond it are
dropped before any computation, by the drop policy (Megatron's
`moe_token_drop_policy`): "position" keeps an expert's earliest token-slots
(the last tokens are dropped), "probs" its largest combine weights (the
lowest-scoring tokens are dropped; ties by position). A dropped slot
contributes 0, so a token whose every slot is dropped leaves the layer as 0
(the residual around the block carries it). `pad_to_capacity` (Megatron's
`moe_pad_expert_input_to_capacity`) then pads every expert's rows to exactly
C: N = E * C rows whatever the routing, the padding rows copies of tokens
(slot p pads with token p mod T) with combine weight 0, so they add exact
zeros to outputs and gradients, and the shapes, the split sizes of the
exchange and the rows per expert are known from T alone. Without a capacity
nothing is dropped (dropless, MegaBlocks' sense) and N = T * K.

Host syncs (a read of a device value by the host, which on a GPU waits for
the device's queue to drain). The plan, permute and combine make none: sorts,
counts by scatter-add, an index never a boolean mask, shapes from T, K, E and
C only. What remains, per layer call (forward; backward and a recomputed
forward under activation checkpointing reuse or redo the same), is counted
by tests/test_host_sync.py:

  local, dropless       0 with a gemm that takes device offsets (grouped_mm,
                        triton; grouped.py), 1 with one that slices on the
                        host (loop, megablocks: `host_sizes`, grouped_gemm.py)
  local, capacity       padded: 0 with any gemm; unpadded: 1 (the kept rows: a
                        boolean mask), plus the loop's 1
  alltoall, dropless    1: the exchange sizes (`all_to_all_single` takes its
                        split sizes as Python ints), read in one `.tolist()`
                        right after the counts' exchange; plus the loop's 1
  alltoall, capacity    unpadded: as dropless. Padded: 0 with any gemm: every rank sends E/ep * C rows to
                        each peer, so the split sizes are static. Every rank
                        of the ep group must call with the same T (pipekit's
                        microbatches have one shape), as their C must agree
                        (else the exchange's sizes mismatch: gloo aborts).

(Counts are `router.count_per_expert`'s scatter-add: CUDA's `torch.bincount`
would read its maximum on the host.)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import einops
import torch
import torch.distributed as dist

from ..comm import lane
from ..kernels.grouped_gemm import Sizes
from ..kernels.moe_permute import moe_permute, moe_unpermute
from ..layers.parallel import _SharedRef, group_size
from .router import Routing, count_per_expert, route_dtype

DROP_POLICIES = ("position", "probs")  # Megatron's moe_token_drop_policy values


@dataclass
class DispatchPlan:
    """Where each kept token-slot goes, sorted by expert: N rows (T*K dropless, E*C with a capacity)."""

    token_N: torch.Tensor  # (N,) int64 token index of each sorted slot (a padding row's: any token)
    weight_N: torch.Tensor  # (N,) combine weight of each sorted slot (a padding row's: 0)
    counts_E: torch.Tensor  # (E,) int64 kept slots per expert (dropless, unpadded: sums to N; padded: each <= C)
    dropped: torch.Tensor  # scalar int64, token-slots dropped for capacity
    capacity: int | None = None  # C: rows per expert, padding included; None: dropless

    def sizes(self) -> Sizes:
        """Rows per expert: the device counts (dropless), or C for each expert (capacity: static)."""
        return self.counts_E if self.capacity is None else [self.capacity] * self.counts_E.numel()


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """ceil(capacity_factor * tokens * top_k / n_experts): slots each expert keeps."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def plan_dispatch(experts_TK: torch.Tensor, weights_TK: torch.Tensor, n_experts: int,
                  capacity_factor: float | None = None, drop_policy: str = "position",
                  pad_to_capacity: bool = False) -> DispatchPlan:
    """Sort the (T, K) slots by expert, dropping those beyond capacity when one is set (and
    with `pad_to_capacity`, padding every expert to exactly capacity rows)."""
    T, K = experts_TK.shape
    expert_S, weight_S = einops.rearrange(experts_TK, "t k -> (t k)"), einops.rearrange(weights_TK, "t k -> (t k)")
    counts_E = count_per_expert(expert_S, n_experts)
    if capacity_factor is None:
        order_N = torch.argsort(expert_S, stable=True)
        return DispatchPlan(order_N // K, weight_S[order_N], counts_E, counts_E.new_zeros(()))
    if drop_policy == "probs":  # by descending weight (stable: ties by position), then by expert
        by_score = torch.argsort(weight_S.detach(), descending=True, stable=True)
        order_S = by_score[torch.argsort(expert_S[by_score], stable=True)]
    else:
        order_S = torch.argsort(expert_S, stable=True)
    cap = capacity(capacity_factor, T, K, n_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    P, slot_S = n_experts * cap, torch.arange(expert_S.numel(), device=expert_S.device)
    expert_sorted_S = expert_S[order_S]
    rank_S = slot_S - starts_E[expert_sorted_S]
    keep_S = rank_S < cap
    if not pad_to_capacity:  # the kept rows only: their number is read on the host (a boolean mask)
        order_N = order_S[keep_S]
        return DispatchPlan(order_N // K, weight_S[order_N], count_per_expert(expert_S[order_N], n_experts),
                            (~keep_S).sum())
    # row of each sorted slot in the padded (E, C) layout; dropped slot s goes to row P + s, cut off below
    row_S = torch.where(keep_S, expert_sorted_S * cap + rank_S, P + slot_S)
    pad_P = torch.arange(P + slot_S.numel(), device=expert_S.device) % max(T, 1)  # padding: some token
    token_P = pad_P.scatter(0, row_S, order_S // K)[:P]
    weight_P = weight_S.new_zeros(P + slot_S.numel()).scatter(0, row_S, weight_S[order_S])[:P]
    return DispatchPlan(token_P, weight_P, torch.clamp(counts_E, max=cap), (~keep_S).sum(), cap)


def permute(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """The rows the experts see, sorted by expert: (N, D) (pipekit/kernels/moe_permute.py)."""
    return moe_permute(x_TD, plan.token_N)


def combine(y_ND: torch.Tensor, plan: DispatchPlan, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum of weight * y over t's kept slots, accumulated in `dtype`: (T, D) in y's dtype."""
    return moe_unpermute(y_ND, plan.token_N, plan.weight_N, tokens, dtype)


# ---- the dispatcher seam --------------------------------------------------------------
@dataclass
class DispatchState:
    """What `Dispatcher.combine` needs to undo one `dispatch` (the local dispatcher's whole state)."""

    plan: DispatchPlan
    tokens: int  # T, rows of x_TD
    dtype: torch.dtype  # combine accumulates in it (the routing dtype)


@dataclass
class ExchangeState(DispatchState):
    """The all-to-all dispatcher's state: the plan plus the exchange's layout."""

    send_R: list[int]  # rows sent to each ep rank
    recv_R: list[int]  # rows received from each ep rank
    order_M: torch.Tensor | None  # (M,) the received row behind each expert-grouped row; None: padded


S = TypeVar("S", bound=DispatchState)


class Dispatcher(ABC, Generic[S]):
    """Moves token rows to the experts that hold them and back (the module docstring has the contract).

    Holds the plan's options (`capacity_factor`, `drop_policy`, `pad_to_capacity`),
    identical for every dispatcher, and the expert-parallel `group` (None: no ep).
    """

    def __init__(self, n_experts: int, group=None, capacity_factor: float | None = None,
                 drop_policy: str = "position", pad_to_capacity: bool = False):
        self.n_experts, self.capacity_factor, self.drop_policy = n_experts, capacity_factor, drop_policy
        self.pad_to_capacity = pad_to_capacity
        self._group = _SharedRef(group)

    @property
    def group(self):
        return self._group.value

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Sizes, S]:
        """(rows for this rank's experts grouped by local expert, rows per local expert, state)."""

    @abstractmethod
    def combine(self, y_MD: torch.Tensor, state: S) -> torch.Tensor:
        """The experts' rows `y_MD` (as dispatched) back at their tokens, weighted and summed: (T, D)."""

    def _plan(self, routing: Routing) -> DispatchPlan:
        return plan_dispatch(routing.experts_TK, routing.weights_TK, self.n_experts, self.capacity_factor,
                             self.drop_policy, self.pad_to_capacity)

    def __repr__(self) -> str:
        cap = ("dropless" if self.capacity_factor is None
               else f"capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}"
               + (", pad_to_capacity=True" if self.pad_to_capacity else ""))
        return f"{type(self).__name__}(ep={group_size(self.group)}, {cap})"


class LocalDispatcher(Dispatcher[DispatchState]):
    """ep = 1: every expert is on this rank. No communication and no host sync: the sizes are
    the plan's (device counts dropless, C per expert with a capacity)."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Sizes, DispatchState]:
        plan = self._plan(routing)
        state = DispatchState(plan, x_TD.shape[0], route_dtype(x_TD.dtype))
        return permute(x_TD, plan), plan.sizes(), state

    def combine(self, y_MD: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return combine(y_MD, state.plan, state.tokens, state.dtype)


class AllToAllDispatcher(Dispatcher[ExchangeState]):
    """Experts sharded over the ep ranks of `group`, rank r holding experts [r*E/ep, (r+1)*E/ep).

    The sorted slots for rank r's experts are contiguous, so one exchange sends them.
    Dropless dispatch:
              1. all_to_all of the per-expert counts (E ints, viewed (ep, E/ep)), on the device;
              2. the rows sent to and received from each rank, read on the host in one
                 `.tolist()` (the one host sync: `all_to_all_single` takes Python split
                 sizes), then all_to_all_single of the rows with those split sizes;
              3. the received rows, grouped by (source rank, local expert), are
                 sorted stably by local expert for the experts (on the device).
    Capacity dispatch: each expert's rows are padded to C (`plan_dispatch`), so rank r
              is sent E/ep * C rows by every peer: one all_to_all_single of static
              splits, no counts exchanged, and the received (source rank, local
              expert, C) blocks are regrouped by local expert by a reshape. Every
              rank of the group must call with the same token count.
    combine:  un-sort, all_to_all_single back with the splits swapped, then the local
              weighted sum. Backward of each row exchange is the exchange of the
              gradient with the splits swapped (dispatch's in combine's backward and
              vice versa); the counts exchange carries no gradient.
    Every rank makes the same collective calls in the same order, also when it
    sends or receives nothing, and the empty tensors stay in the autograd graph,
    so backward never leaves a peer waiting.
    """

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Sizes, ExchangeState]:
        plan, ep = self._plan(routing), group_size(self.group)
        if plan.capacity is not None:
            return self._dispatch_padded(x_TD, plan, ep)
        recv_RL = exchange_counts(plan.counts_E, self.group)  # (ep, E_local), queued before the gather
        x_ND = permute(x_TD, plan)  # sorted by global expert: rank r's rows are contiguous
        send_R = einops.reduce(plan.counts_E, "(r l) -> r", "sum", r=ep)
        splits = torch.cat([send_R, recv_RL.sum(1)]).tolist()  # the host sync: exchange sizes
        send, recv = splits[:ep], splits[ep:]
        x_MD = all_to_all(x_ND, recv, send, self.group)  # grouped by (source rank, local expert)
        local_L = torch.arange(recv_RL.shape[1], device=x_TD.device)
        local_M = torch.repeat_interleave(einops.repeat(local_L, "l -> (r l)", r=ep),
                                          einops.rearrange(recv_RL, "r l -> (r l)"), output_size=x_MD.shape[0])
        order_M = torch.argsort(local_M, stable=True)  # grouped by (local expert, source rank)
        state = ExchangeState(plan, x_TD.shape[0], route_dtype(x_TD.dtype), send, recv, order_M)
        return x_MD[order_M], recv_RL.sum(0), state

    def _dispatch_padded(self, x_TD: torch.Tensor, plan: DispatchPlan,
                         ep: int) -> tuple[torch.Tensor, Sizes, ExchangeState]:
        assert plan.capacity is not None
        n_local = self.n_experts // ep
        splits = [n_local * plan.capacity] * ep  # the same to and from every rank: static
        x_MD = all_to_all(permute(x_TD, plan), splits, splits, self.group)  # (source rank, local expert, C)
        x_MD = einops.rearrange(x_MD, "(r l c) d -> (l r c) d", r=ep, l=n_local)
        state = ExchangeState(plan, x_TD.shape[0], route_dtype(x_TD.dtype), splits, splits, None)
        return x_MD, [ep * plan.capacity] * n_local, state

    def combine(self, y_MD: torch.Tensor, state: ExchangeState) -> torch.Tensor:
        if state.order_M is None:  # padded: back to (source rank, local expert, C) by a reshape
            ep = len(state.send_R)
            y_recv = einops.rearrange(y_MD, "(l r c) d -> (r l c) d", r=ep, l=self.n_experts // ep)
        else:
            y_recv = y_MD[torch.argsort(state.order_M)]  # back to (source rank, local expert)
        y_ND = all_to_all(y_recv, state.send_R, state.recv_R, self.group)
        return combine(y_ND, state.plan, state.tokens, state.dtype)


DISPATCHERS: dict[str, type[Dispatcher[Any]]] = {"local": LocalDispatcher, "alltoall": AllToAllDispatcher}


def register_dispatcher(name: str, cls: type[Dispatcher[Any]]) -> None:
    """Add (or replace) a dispatcher selectable as `MoEMLP(..., dispatcher=name)`; `cls` is
    called as `cls(n_experts, group, capacity_factor, drop_policy, pad_to_capacity)`."""
    DISPATCHERS[name] = cls


def check_dispatcher(name: str, group) -> None:
    """ValueError for an unknown name, or one that cannot serve this ep group."""
    if name != "auto" and name not in DISPATCHERS:
        raise ValueError(f"dispatcher={name!r} is not one of {['auto', *sorted(DISPATCHERS)]}")
    if name == "local" and group_size(group) > 1:
        raise ValueError(f"dispatcher='local' keeps every token on its rank, but the experts are sharded over "
                         f"ep={group_size(group)} ranks; use dispatcher='alltoall' or 'auto'")
    if name == "alltoall" and group is None:
        raise ValueError("dispatcher='alltoall' needs an expert-parallel group (ep_group=, or an "
                         "expert_parallel(...) block); dispatcher='auto' picks 'local' without one")


def make_dispatcher(name: str, n_experts: int, group=None, capacity_factor: float | None = None,
                    drop_policy: str = "position", pad_to_capacity: bool = False) -> Dispatcher[Any]:
    """The dispatcher `name` for `n_experts` sharded over `group`; "auto": local at ep = 1, else alltoall."""
    check_dispatcher(name, group)
    if name == "auto":
        name = "local" if group_size(group) == 1 else "alltoall"
    return DISPATCHERS[name](n_experts, group, capacity_factor, drop_policy, pad_to_capacity)


# ---- expert-parallel collectives ------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=lane(group))
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
    dist.all_to_all_single(recv, counts_E.contiguous(), group=lane(group))
    return einops.rearrange(recv, "(r l) -> r l", r=ep)


def all_reduce_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """Sum of `counts_E` over `group` (a copy; itself when the group has one rank). The layer's
    aux-free bias update uses it, outside dispatch and combine."""
    if group_size(group) == 1:
        return counts_E
    out = counts_E.clone()
    dist.all_reduce(out, group=lane(group))
    return out
