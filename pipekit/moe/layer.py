"""MoEMLP: router -> dispatcher -> experts -> combine (+ shared experts), a drop-in for a dense MLP."""

from __future__ import annotations

import einops
import torch
from torch import nn

from .. import auxloss
from ..layers.parallel import (
    _SharedRef,
    current_ep_group,
    current_etp_group,
    current_tp_group,
    group_rank,
    group_size,
    mark_sequence_parallel,
    sequence_parallel_active,
)
from ..rules import check_experts
from .dispatch import DROP_POLICIES, DispatchState, all_reduce_counts, check_dispatcher, make_dispatcher
from .experts import ACTIVATIONS, Experts, SharedExpert
from .grouped import check_gemm
from .router import Router, Routing

BIAS_UPDATES = ("forward", "step")
METRICS = ("tokens_per_expert", "max_load", "mean_load", "dropped", "aux_loss", "z_loss")  # recorded per call


class MoEMLP(nn.Module, auxloss.StepStatistic):
    """Mixture-of-Experts feed-forward block: (..., dim) -> (..., dim), e.g. (B, T, dim).

    Each token goes to its `top_k` of `n_experts` routed experts (each an MLP
    of width `hidden`, SwiGLU or GELU) and the outputs are summed with the
    router's weights; `n_shared_experts > 0` adds one always-on dense MLP of
    width `shared_hidden` (default n_shared_experts * hidden). Routing
    options (score, renormalize, jitter, the losses, aux-free balancing and
    device-limited routing: `n_groups` / `topk_groups`) are the `Router`'s;
    `capacity_factor` / `drop_policy` ("position" or "probs") /
    `pad_to_capacity` are the dispatch plan's (None: dropless); `dispatcher` names how rows reach the experts and
    come back (dispatch.py: "auto", "local", "alltoall" or a registered one),
    chosen once here; `gemm` names the experts' grouped matmul (grouped.py).
    Only the dispatcher's dispatch and combine communicate in a forward.

    Expert parallelism: experts are sharded over `ep_group` (None: the group
    of the innermost `pipekit.layers.parallel.expert_parallel(...)` block at
    construction, which PipelineModule sets from `Topology.ep_group`; outside
    any, no ep) and tokens travel by all_to_all (dispatch.py). The ep ranks
    hold different tokens; the router and shared experts are replicated and
    each rank routes its own tokens. `balance_group` is the group whose summed loads
    drive the aux-free bias update made here (default `ep_group`; pass the whole
    data-parallel group to keep the bias identical on every replica).

    Aux-free bias (`bias_update_rate > 0`): each training forward adds its
    loads (token-slots per expert) to `pending_load`; `bias_update="forward"`
    applies them at the end of that forward (all-reducing over
    `balance_group`), `bias_update="step"` once per optimizer step:
    DeepSeek-V3's update over the whole batch. Under `PipelineEngine` that is
    automatic (`end_step`, after the optimizer step, summing the loads over the
    stage's whole data-parallel group, so every replica keeps the same bias and
    the update does not depend on micro_batch, dp or ep); elsewhere call
    `apply_bias_update()` (or `apply_bias_updates(model)`) after each step.
    Only "step" goes with activation checkpointing: a recomputed forward must
    route as the original did, and under "forward" the bias has moved by then
    (that combination raises a RuntimeError when the recomputation runs).

    Auxiliary losses: the output is `attach(out, aux_loss_coef * aux +
    z_loss_coef * z)` (pipekit.auxloss): the losses train the router in
    backward with the engine's scale and never travel as values. Metrics,
    recorded per forward under `{name}/` (name "moe", or "moe/{layer_index}"):
    tokens_per_expert (E,), max_load and mean_load (token-slots per expert),
    dropped (token-slots), aux_loss, z_loss: all from this rank's tokens.

    Expert tensor parallelism: with `expert_tp_group` (None: the group of the
    innermost `expert_tensor_parallel(...)` block, which PipelineModule sets to
    the tp group under `Topology(expert_tp=True)`), each expert's hidden
    dimension is split over that group (experts.py: column-parallel input
    projections, row-parallel output, one all-reduce of the expert rows).
    Without it, under a tp group every tp rank holds the same full experts
    (none marked `tp_shard_dim`) and repeats the same expert work. Either way
    the router and shared expert are replicated over tp and run whole on the
    (replicated) input.

    Sequence parallelism (built inside `sequence_parallel(True)` at tp > 1; not with
    expert tensor parallelism): the input is this tp rank's sequence slice and each tp
    rank routes its own tokens, as a dp rank does; every parameter is marked
    `sequence_parallel` (its gradient summed over tp), the loads of the global balance
    and of the aux-free bias are summed over tp as well as dp, and the aux and z losses
    are divided by tp (the tp ranks' terms are then averaged, as dp ranks' are). With
    `global_balance` (or the aux loss off) and the z-loss this equals one process; the
    per-call aux loss and capacity drops depend on the split, as they do under dp.

    Limits: On the meta device
    the block returns an empty tensor of the input's shape (routing is data
    dependent). Host syncs are dispatch.py's, named there: none at ep=1 with a
    device-offset gemm or with a capacity, one per call for dropless ep > 1.
    By default the aux and z losses are computed per call, over the tokens of
    one microbatch on one rank (Megatron's default): unlike the token-level
    main loss, their values and gradients depend on how the global batch is
    split (dp, ep, microbatches), as do capacity drops, whose capacity counts
    the tokens of the call.

    Global-batch balancing (`global_balance=True`, "Demons in the Detail",
    Qiu et al. 2025): the aux loss's f_i are the loads of the whole step's
    batch, summed over its microbatches and the data-parallel group, P_i stay
    per call; the engine's 1/M per microbatch and the dp mean of gradients then
    make value and gradient those of E * sum_i f_i P_i over the global batch,
    as one process with the whole batch would compute it, at any micro_batch,
    dp, ep or pp. The f_i must be known before the step's first backward,
    which under 1F1B precedes its last forward, so `PipelineEngine` runs a
    pre-pass (`pipekit.auxloss.prepass`): every microbatch's forward once
    more, without autograd, before the step, counting each layer's loads;
    then one all-reduce of E int64 per layer over dp. Cost: one extra forward
    per step (about a third of the step's compute, no activations kept, the
    pipeline's forward-only bubble, and the ep all-to-alls of that forward).
    It is exact because the pre-pass routes as the step does: refused with
    `jitter` (random) and with `bias_update="forward"` (the bias would move
    between the two); skipped at aux_loss_coef=0. A training call outside an
    engine (no pre-pass) takes its own tokens as the batch. The z-loss stays
    per call (it has no f).
    """

    pending_load: torch.Tensor | None  # (E,) int64 buffer, with the aux-free bias only
    step_load: torch.Tensor | None  # (E,) int64 buffer, with global balancing only: the step's loads

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2, *, activation: str = "swiglu",
                 bias: bool = False, score: str = "softmax", renormalize: bool | None = None, jitter: float = 0.0,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 bias_update: str = "forward", capacity_factor: float | None = None,
                 drop_policy: str = "position", pad_to_capacity: bool = False, global_balance: bool = False,
                 n_groups: int | None = None, topk_groups: int | None = None, n_shared_experts: int = 0,
                 shared_hidden: int | None = None, dispatcher: str = "auto", gemm: str = "auto", ep_group=None,
                 expert_tp_group=None, balance_group=None, name: str | None = None, layer_index: int | None = None,
                 init_std: float = 0.02, out_init_std: float | None = None, seed: int | None = None):
        super().__init__()
        ep_group = current_ep_group() if ep_group is None else ep_group
        expert_tp_group = current_etp_group() if expert_tp_group is None else expert_tp_group
        tp_group = current_tp_group()
        sp = sequence_parallel_active(tp_group)
        if sp and group_size(expert_tp_group) > 1:
            raise ValueError(f"sequence parallelism at tp={group_size(tp_group)} does not support expert tensor "
                             "parallelism yet (each tp rank routes its own sequence slice, so the tp ranks hold "
                             "different tokens); use expert_tp=False with sequence parallelism")
        # sequence-parallel: this rank's tokens only; loads and losses are completed over tp
        self._sp_group = _SharedRef(tp_group if sp else None)
        ep = group_size(ep_group)
        _check_layer(n_experts, ep_group, activation, capacity_factor, drop_policy, n_shared_experts, dispatcher,
                     gemm, bias_update)
        _check_balance(capacity_factor, pad_to_capacity, global_balance, jitter, bias_update_rate, bias_update)
        self.name = name or ("moe" if layer_index is None else f"moe/{layer_index}")
        self.layer_index = layer_index
        self.bias_update = bias_update
        self.dispatcher = make_dispatcher(dispatcher, n_experts, ep_group, capacity_factor, drop_policy,
                                          pad_to_capacity)
        self._balance_group = _SharedRef(ep_group if balance_group is None else balance_group)
        seed = torch.initial_seed() if seed is None else seed  # before any draw below
        self.router = Router(dim, n_experts, top_k, score, renormalize, jitter, aux_loss_coef, z_loss_coef,
                             bias_update_rate, init_std, n_groups, topk_groups)
        self.experts = Experts(dim, hidden, n_experts, activation, bias, ep, group_rank(ep_group), init_std,
                               out_init_std, seed, gemm, expert_tp_group)
        self.shared = (SharedExpert(dim, shared_hidden or n_shared_experts * hidden, activation, bias, init_std,
                                    out_init_std) if n_shared_experts else None)
        pending = torch.zeros(n_experts, dtype=torch.long) if bias_update_rate > 0 else None
        self.register_buffer("pending_load", pending, persistent=False)
        self.needs_prepass = global_balance and aux_loss_coef > 0  # no loss, no loads to count
        self.register_buffer("step_load", torch.zeros(n_experts, dtype=torch.long) if self.needs_prepass else None,
                             persistent=False)
        self._step_load_ready = False  # step_load holds this step's completed loads
        self._metrics_key = auxloss.metric_key([f"{self.name}/{m}" for m in METRICS])
        if sp:  # replicated over tp, each copy fed by its rank's tokens: gradients summed over tp
            mark_sequence_parallel(*self.parameters())

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
        prepassing = auxloss.in_prepass()
        routing = self.router(x_TD, self.step_load if self._step_load_ready and not prepassing else None)
        x_MD, sizes, state = self.dispatcher.dispatch(x_TD, routing)  # rows for this rank's experts
        out_TD = self.dispatcher.combine(self.experts(x_MD, sizes), state)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        if prepassing:  # loads only: no metrics, no bias loads, no aux loss
            if self.step_load is not None:
                self.step_load += routing.counts_E
            return out_TD.view_as(x)
        self._record(routing, state)
        if counting and not auxloss.in_backward():  # a recomputed forward was counted already
            self.pending_load += routing.counts_E
            if self.bias_update == "forward":
                self.apply_bias_update()
        aux = self.router.loss(routing)
        sp_size = group_size(self._sp_group.value)
        if sp_size > 1:  # the tp ranks' aux terms are summed with the router's gradients over tp: their mean
            aux = aux / sp_size
        return auxloss.attach(out_TD, aux).view_as(x)

    def apply_bias_update(self) -> None:
        """Move the aux-free bias by the loads counted since the last update (summed over
        `balance_group`: a collective there) and reset them. A no-op without the bias."""
        self._update_bias(self._balance_group.value)

    @torch.no_grad()
    def _update_bias(self, group) -> None:
        if self.pending_load is None:
            return
        counts = all_reduce_counts(all_reduce_counts(self.pending_load, group), self._sp_group.value)
        self.router.update_bias(counts)
        self.pending_load.zero_()

    # ---- auxloss.StepStatistic: the engine's calls around a step ----------------------
    def begin_prepass(self) -> None:
        if self.step_load is not None:
            self.step_load.zero_()
            self._step_load_ready = False

    @torch.no_grad()
    def end_prepass(self, group) -> None:
        """The step's loads, summed over the data-parallel `group`: the f_i of every call until
        the step ends (one all-reduce of E int64)."""
        if self.step_load is not None:
            self.step_load.copy_(all_reduce_counts(all_reduce_counts(self.step_load, group),
                                                   self._sp_group.value))
            self._step_load_ready = True

    def end_step(self, group) -> None:
        """Forget the step's loads; with bias_update="step", move the bias by the step's loads
        summed over the data-parallel `group`."""
        self._step_load_ready = False
        if self.bias_update == "step":
            self._update_bias(group)

    def _record(self, routing: Routing, state: DispatchState) -> None:
        """This call's metrics to `auxloss.metrics` through the layer's key (under torch.compile: one
        opaque op in the graph, no name in it to guard on, no graph break)."""
        counts = routing.counts_E.float()
        auxloss.record_metrics(self._metrics_key, [counts, counts.max(), counts.mean(), state.plan.dropped,
                                                   routing.aux_loss, routing.z_loss])

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dispatcher={self.dispatcher!r}"


def apply_bias_updates(model: nn.Module) -> None:
    """`apply_bias_update()` on every MoEMLP in `model`, in module order (each may all-reduce
    over its balance group, so every rank of that group calls this at the same point)."""
    for module in model.modules():
        if isinstance(module, MoEMLP):
            module.apply_bias_update()


def _check_balance(capacity_factor, pad_to_capacity, global_balance, jitter, bias_update_rate,
                   bias_update) -> None:
    """ValueError naming a setting that padding or global balancing cannot go with."""
    if pad_to_capacity and capacity_factor is None:
        raise ValueError("pad_to_capacity=True pads each expert to its capacity, but capacity_factor=None "
                         "(dropless) sets none; set a capacity_factor or pad_to_capacity=False")
    if global_balance and jitter:
        raise ValueError(f"global_balance=True counts the step's loads in a pre-pass that must route as the step "
                         f"does, but jitter={jitter} draws new noise each call; use jitter=0")
    if global_balance and bias_update_rate and bias_update == "forward":
        raise ValueError("global_balance=True counts the step's loads in a pre-pass that must route as the step "
                         "does, but bias_update='forward' moves the bias between forwards; use bias_update='step'")


def _check_layer(n_experts, ep_group, activation, capacity_factor, drop_policy, n_shared_experts, dispatcher,
                 gemm, bias_update) -> None:
    """ValueError naming the first bad layer argument (routing ones are checked by the Router)."""
    ep = group_size(ep_group)
    if isinstance(n_experts, int) and n_experts >= 1:
        check_experts(n_experts, ep)
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
