"""MoEMLP: router -> dispatcher -> experts -> combine (+ shared experts), a drop-in for a dense MLP."""

from __future__ import annotations

import einops
import torch
from torch import nn

from .. import auxloss
from ..layers.parallel import _SharedRef, current_ep_group, group_rank, group_size
from .dispatch import DROP_POLICIES, DispatchState, all_reduce_counts, check_dispatcher, make_dispatcher
from .experts import ACTIVATIONS, Experts, SharedExpert
from .grouped import check_gemm
from .router import Router, Routing

BIAS_UPDATES = ("forward", "step")


class MoEMLP(nn.Module):
    """Mixture-of-Experts feed-forward block: (..., dim) -> (..., dim), e.g. (B, T, dim).

    Each token goes to its `top_k` of `n_experts` routed experts (each an MLP
    of width `hidden`, SwiGLU or GELU) and the outputs are summed with the
    router's weights; `n_shared_experts > 0` adds one always-on dense MLP of
    width `shared_hidden` (default n_shared_experts * hidden). Routing
    options (score, renormalize, jitter, the losses and aux-free balancing)
    are the `Router`'s; `capacity_factor` / `drop_policy` are the dispatch
    plan's (None: dropless); `dispatcher` names how rows reach the experts and
    come back (dispatch.py: "auto", "local", "alltoall" or a registered one),
    chosen once here; `gemm` names the experts' grouped matmul (grouped.py).
    Only the dispatcher's dispatch and combine communicate in a forward.

    Expert parallelism: experts are sharded over `ep_group` (None: the group
    of the innermost `pipekit.layers.parallel.expert_parallel(...)` block at
    construction, which PipelineModule sets from `Topology.ep_group`; outside
    any, no ep) and tokens travel by all_to_all (dispatch.py). The ep ranks
    hold different tokens; the router and shared experts are replicated and
    each rank routes its own tokens. `balance_group` is the group whose summed loads
    drive the aux-free bias update (default `ep_group`; pass the whole
    data-parallel group to keep the bias identical on every replica).

    Aux-free bias (`bias_update_rate > 0`): each training forward adds its
    loads (token-slots per expert) to `pending_load`; `bias_update="forward"`
    applies them at the end of that forward (all-reducing over
    `balance_group`), `bias_update="step"` leaves them for
    `apply_bias_update()` (or `apply_bias_updates(model)`), called once after
    the optimizer step: DeepSeek-V3's per-step update over the whole batch.
    Only "step" goes with activation checkpointing: a recomputed forward must
    route as the original did, and under "forward" the bias has moved by then
    (that combination raises a RuntimeError when the recomputation runs).

    Auxiliary losses: the output is `attach(out, aux_loss_coef * aux +
    z_loss_coef * z)` (pipekit.auxloss): the losses train the router in
    backward with the engine's scale and never travel as values. Metrics,
    recorded per forward under `{name}/` (name "moe", or "moe/{layer_index}"):
    tokens_per_expert (E,), max_load and mean_load (token-slots per expert),
    dropped (token-slots), aux_loss, z_loss: all from this rank's tokens.

    Limits: tensor parallelism is not applied inside the block: under a tp
    group every tp rank holds the same full parameters (none marked
    `tp_shard_dim`) and does the same computation on the same (replicated)
    input, so its input gradient needs no tp all-reduce. On the meta device
    the block returns an empty tensor of the input's shape (routing is data
    dependent). Split sizes are read on the host (a sync per layer call).
    The aux and z losses are computed per call, over the tokens of one
    microbatch on one rank (Megatron's default): unlike the token-level main
    loss, their values and gradients depend on how the global batch is split
    (dp, ep, microbatches), as do capacity drops, whose capacity counts the
    tokens of the call.
    """

    pending_load: torch.Tensor | None  # (E,) int64 buffer, with the aux-free bias only

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2, *, activation: str = "swiglu",
                 bias: bool = False, score: str = "softmax", renormalize: bool | None = None, jitter: float = 0.0,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 bias_update: str = "forward", capacity_factor: float | None = None,
                 drop_policy: str = "position", n_shared_experts: int = 0,
                 shared_hidden: int | None = None, dispatcher: str = "auto", gemm: str = "auto", ep_group=None,
                 balance_group=None, name: str | None = None, layer_index: int | None = None,
                 init_std: float = 0.02, out_init_std: float | None = None, seed: int | None = None):
        super().__init__()
        ep_group = current_ep_group() if ep_group is None else ep_group
        ep = group_size(ep_group)
        _check_layer(n_experts, ep_group, activation, capacity_factor, drop_policy, n_shared_experts, dispatcher,
                     gemm, bias_update)
        self.name = name or ("moe" if layer_index is None else f"moe/{layer_index}")
        self.layer_index = layer_index
        self.bias_update = bias_update
        self.dispatcher = make_dispatcher(dispatcher, n_experts, ep_group, capacity_factor, drop_policy)
        self._balance_group = _SharedRef(ep_group if balance_group is None else balance_group)
        seed = torch.initial_seed() if seed is None else seed  # before any draw below
        self.router = Router(dim, n_experts, top_k, score, renormalize, jitter, aux_loss_coef, z_loss_coef,
                             bias_update_rate, init_std)
        self.experts = Experts(dim, hidden, n_experts, activation, bias, ep, group_rank(ep_group), init_std,
                               out_init_std, seed, gemm)
        self.shared = (SharedExpert(dim, shared_hidden or n_shared_experts * hidden, activation, bias, init_std,
                                    out_init_std) if n_shared_experts else None)
        pending = torch.zeros(n_experts, dtype=torch.long) if bias_update_rate > 0 else None
        self.register_buffer("pending_load", pending, persistent=False)

    @property
    def ep_group(self):
        return self.dispatcher.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            return torch.empty_like(x)
        counting = self.training and self.pending_load is not None
        if counting and auxloss.in_backward() and self.bias_update == "forward":
            raise RuntimeError(
                f"{self.name}: bias_update='forward' moved the aux-free bias after the original forward, so "
                "this recomputation (activation checkpointing) would route differently; use "
                "bias_update='step' and call pipekit.moe.apply_bias_updates(model) after each optimizer step")
        x_TD = einops.rearrange(x, "... d -> (...) d")  # (B*T, dim)
        routing = self.router(x_TD)
        x_MD, sizes, state = self.dispatcher.dispatch(x_TD, routing)  # rows for this rank's experts
        out_TD = self.dispatcher.combine(self.experts(x_MD, sizes), state)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        self._record(routing, state)
        if counting and not auxloss.in_backward():  # a recomputed forward was counted already
            self.pending_load += routing.counts_E
            if self.bias_update == "forward":
                self.apply_bias_update()
        return auxloss.attach(out_TD, self.router.loss(routing)).view_as(x)

    @torch.no_grad()
    def apply_bias_update(self) -> None:
        """Move the aux-free bias by the loads counted since the last update (summed over
        `balance_group`: a collective there) and reset them. A no-op without the bias."""
        if self.pending_load is None:
            return
        self.router.update_bias(all_reduce_counts(self.pending_load, self._balance_group.value))
        self.pending_load.zero_()

    def _record(self, routing: Routing, state: DispatchState) -> None:
        counts = routing.counts_E.float()
        for key, value in (("tokens_per_expert", counts), ("max_load", counts.max()), ("mean_load", counts.mean()),
                           ("dropped", state.plan.dropped), ("aux_loss", routing.aux_loss),
                           ("z_loss", routing.z_loss)):
            auxloss.metrics.record(f"{self.name}/{key}", value)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dispatcher={self.dispatcher!r}"


def apply_bias_updates(model: nn.Module) -> None:
    """`apply_bias_update()` on every MoEMLP in `model`, in module order (each may all-reduce
    over its balance group, so every rank of that group calls this at the same point)."""
    for module in model.modules():
        if isinstance(module, MoEMLP):
            module.apply_bias_update()


def _check_layer(n_experts, ep_group, activation, capacity_factor, drop_policy, n_shared_experts, dispatcher,
                 gemm, bias_update) -> None:
    """ValueError naming the first bad layer argument (routing ones are checked by the Router)."""
    ep = group_size(ep_group)
    if isinstance(n_experts, int) and n_experts >= 1 and n_experts % ep:
        raise ValueError(f"n_experts={n_experts} is not divisible by the expert-parallel size ep={ep}; "
                         f"choose n_experts a multiple of {ep} or an ep that divides {n_experts}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be > 0, or None for dropless routing")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r} is not one of {DROP_POLICIES}")
    if not isinstance(n_shared_experts, int) or n_shared_experts < 0:
        raise ValueError(f"n_shared_experts={n_shared_experts!r} must be an int >= 0")
    if bias_update not in BIAS_UPDATES:
        raise ValueError(f"bias_update={bias_update!r} is not one of {BIAS_UPDATES}")
    check_dispatcher(dispatcher, ep_group)
    check_gemm(gemm)
