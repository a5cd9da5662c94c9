"""Token dispatch and combine: the `Dispatcher` seam between the router and the experts.

A `Dispatcher` is built once per MoE layer (`make_dispatcher`, registry
`DISPATCHERS`) and called twice per forward, the only two calls of a forward
that communicate (besides the aux-free bias update's all-reduce, layer.py):

  dispatch(x_TD, routing) -> (x_MD, sizes, state)
      the M rows this rank's experts compute, grouped by local expert,
      `sizes[e]` of them for local expert e (Python ints, read on the host);
      `state` is what combine needs (a `DispatchState`).
  combine(y_MD, state) -> out_TD
      the experts' rows back at their tokens: out[t] = sum over t's kept
      slots of weight * y, accumulated in the routing dtype (float32, float64
      for float64 input), returned in y's dtype.

Both are differentiable: backward runs their exchanges in reverse.

  local     (ep = 1) every expert is here: no communication.
  alltoall  (ep > 1, Megatron's "alltoall" dispatcher) experts sharded over
            the ep group; dispatch makes 2 collectives, combine 1 (and
            backward the mirror image: combine's exchange in dispatch's
            backward and vice versa), see `AllToAllDispatcher`.
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

Capacity (`capacity_factor` set): capacity = ceil(capacity_factor * T * K / E)
slots per expert, T this rank's tokens. An expert's slots beyond it are
dropped before any computation: by position (earlier tokens win) or by score
(larger combine weight wins; ties by position). A dropped slot contributes 0,
so a token whose every slot is dropped leaves the layer as 0 (the residual
around the block carries it). Without a capacity nothing is dropped
(dropless, MegaBlocks' sense).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import einops
import torch
import torch.distributed as dist

from ..kernels.moe_permute import moe_permute, moe_unpermute
from ..layers.parallel import _SharedRef, group_size
from .router import Routing, route_dtype

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
    expert_S, weight_S = einops.rearrange(experts_TK, "t k -> (t k)"), einops.rearrange(weights_TK, "t k -> (t k)")
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
    order_M: torch.Tensor  # (M,) the received row behind each expert-grouped row


S = TypeVar("S", bound=DispatchState)


class Dispatcher(ABC, Generic[S]):
    """Moves token rows to the experts that hold them and back (the module docstring has the contract).

    Holds the plan's options (`capacity_factor`, `drop_policy`), identical for
    every dispatcher, and the expert-parallel `group` (None: no ep).
    """

    def __init__(self, n_experts: int, group=None, capacity_factor: float | None = None,
                 drop_policy: str = "position"):
        self.n_experts, self.capacity_factor, self.drop_policy = n_experts, capacity_factor, drop_policy
        self._group = _SharedRef(group)

    @property
    def group(self):
        return self._group.value

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], S]:
        """(rows for this rank's experts grouped by local expert, rows per local expert, state)."""

    @abstractmethod
    def combine(self, y_MD: torch.Tensor, state: S) -> torch.Tensor:
        """The experts' rows `y_MD` (as dispatched) back at their tokens, weighted and summed: (T, D)."""

    def _plan(self, routing: Routing) -> DispatchPlan:
        return plan_dispatch(routing.experts_TK, routing.weights_TK, self.n_experts, self.capacity_factor,
                             self.drop_policy)

    def __repr__(self) -> str:
        cap = ("dropless" if self.capacity_factor is None
               else f"capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}")
        return f"{type(self).__name__}(ep={group_size(self.group)}, {cap})"


class LocalDispatcher(Dispatcher[DispatchState]):
    """ep = 1: every expert is on this rank. No communication; the sizes are the plan's
    counts (one host read)."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], DispatchState]:
        plan = self._plan(routing)
        state = DispatchState(plan, x_TD.shape[0], route_dtype(x_TD.dtype))
        return permute(x_TD, plan), plan.counts_E.tolist(), state

    def combine(self, y_MD: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return combine(y_MD, state.plan, state.tokens, state.dtype)


class AllToAllDispatcher(Dispatcher[ExchangeState]):
    """Experts sharded over the ep ranks of `group`, rank r holding experts [r*E/ep, (r+1)*E/ep).

    The sorted slots for rank r's experts are contiguous, so one exchange sends them.
    dispatch: 1. all_to_all of the per-expert counts (E ints, viewed (ep, E/ep));
              2. all_to_all_single of the rows with those split sizes;
              3. the received rows, grouped by (source rank, local expert), are
                 sorted stably by local expert for the experts.
    combine:  un-sort, all_to_all_single back with the splits swapped, then the local
              weighted sum. Backward of each row exchange is the exchange of the
              gradient with the splits swapped (dispatch's in combine's backward and
              vice versa); the counts exchange carries no gradient.
    Every rank makes the same collective calls in the same order, also when it
    sends or receives nothing, and the empty tensors stay in the autograd graph,
    so backward never leaves a peer waiting. Split sizes are read on the host.
    """

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], ExchangeState]:
        plan, ep = self._plan(routing), group_size(self.group)
        x_ND = permute(x_TD, plan)  # sorted by global expert: rank r's rows are contiguous
        recv_RL = exchange_counts(plan.counts_E, self.group)  # (ep, E_local)
        send_R = einops.reduce(plan.counts_E, "(r l) -> r", "sum", r=ep).tolist()
        recv_R = recv_RL.sum(1).tolist()
        x_MD = all_to_all(x_ND, recv_R, send_R, self.group)  # grouped by (source rank, local expert)
        local_L = torch.arange(recv_RL.shape[1], device=x_TD.device)
        local_M = torch.repeat_interleave(einops.repeat(local_L, "l -> (r l)", r=ep),
                                          einops.rearrange(recv_RL, "r l -> (r l)"), output_size=x_MD.shape[0])
        order_M = torch.argsort(local_M, stable=True)  # grouped by (local expert, source rank)
        state = ExchangeState(plan, x_TD.shape[0], route_dtype(x_TD.dtype), send_R, recv_R, order_M)
        return x_MD[order_M], recv_RL.sum(0).tolist(), state

    def combine(self, y_MD: torch.Tensor, state: ExchangeState) -> torch.Tensor:
        y_recv = y_MD[torch.argsort(state.order_M)]  # back to (source rank, local expert)
        y_ND = all_to_all(y_recv, state.send_R, state.recv_R, self.group)
        return combine(y_ND, state.plan, state.tokens, state.dtype)


DISPATCHERS: dict[str, type[Dispatcher[Any]]] = {"local": LocalDispatcher, "alltoall": AllToAllDispatcher}


def register_dispatcher(name: str, cls: type[Dispatcher[Any]]) -> None:
    """Add (or replace) a dispatcher selectable as `MoEMLP(..., dispatcher=name)`; `cls` is
    called as `cls(n_experts, group, capacity_factor, drop_policy)`."""
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
                    drop_policy: str = "position") -> Dispatcher[Any]:
    """The dispatcher `name` for `n_experts` sharded over `group`; "auto": local at ep = 1, else alltoall."""
    check_dispatcher(name, group)
    if name == "auto":
        name = "local" if group_size(group) == 1 else "alltoall"
    return DISPATCHERS[name](n_experts, group, capacity_factor, drop_policy)


# ---- expert-parallel collectives ------------------------------------------------------
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
    return einops.rearrange(recv, "(r l) -> r l", r=ep)


def all_reduce_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """Sum of `counts_E` over `group` (a copy; itself when the group has one rank). The layer's
    aux-free bias update uses it, outside dispatch and combine."""
    if group_size(group) == 1:
        return counts_E
    out = counts_E.clone()
    dist.all_reduce(out, group=group)
    return out
