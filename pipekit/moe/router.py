"""The MoE router: a linear gate, top-k selection, and the router's own losses.

Scores are softmax or sigmoid of `x W^T` (W: n_experts x dim, no bias),
computed in float32, or float64 for a float64 input (in the float promotion
of the input dtype and float32), whatever the model's precision. Each token
takes the top_k experts by score, plus the aux-free balancing bias when there
is one; its combine weights are the chosen scores WITHOUT that bias,
optionally renormalised to sum to one.

Losses (unscaled values; the layer multiplies each by its coefficient):

  aux = E * sum_i f_i * P_i      (Switch / GShard load balancing)
      f_i = fraction of the T*top_k token-slots routed to expert i (sum_i f_i = 1)
      P_i = mean over tokens of the router probability of expert i: the
            softmax, or for sigmoid scores each token's scores divided by
            their sum (DeepSeek-V3's normalisation)
      Balanced routing gives aux = 1 at any E and top_k. HF Mixtral's
      `load_balancing_loss_func` counts f_i per token, not per token-slot
      (tokens_per_expert = top-k assignments / tokens, summing to top_k), so
      its value is top_k times this one for the same routing; multiply our
      `aux_loss_coef` by top_k to reproduce a Mixtral `router_aux_loss_coef`.
      f_i carries no gradient (it is a count); P_i does.
  z   = mean over tokens of logsumexp(logits)^2   (ST-MoE router z-loss)

Global-batch balancing ("Demons in the Detail", Qiu et al. 2025): called with
`balance_counts_E`, the loads of a larger batch the call's tokens belong to
(the layer passes the whole step's, summed over microbatches and dp ranks),
f_i is taken from those counts while P_i stays this call's mean. The loss is
linear in P, so the mean of these per-call losses over the step's equal-sized
microbatches is E * sum_i f_i * P_i of the whole batch, value and gradient.

Device-limited routing (DeepSeek-V2/V3's group-limited top-k), `n_groups` /
`topk_groups` (DeepSeek-V3's n_group / topk_group): the experts are split into
`n_groups` groups of consecutive global ids; each token scores a group by the
sum of its top-2 selection scores in it (the top-1 for groups of one expert),
keeps its `topk_groups` best groups, and takes its top_k among their experts.
The groups are a model setting, so the routing is the same at every ep; with
n_groups = ep a group is the experts one ep rank holds (rank r holds ids
[r*E/ep, (r+1)*E/ep)) and no token reaches more than `topk_groups` ep ranks,
which caps the all-to-all traffic. Combine weights and the aux loss's P_i are
unaffected (from the unmasked scores, as DeepSeek-V3).

Auxiliary-loss-free balancing (DeepSeek-V3), `bias_update_rate > 0`: a
per-expert buffer `expert_bias` (kept in float32 whatever the module's dtype)
is added to the scores for top-k selection only; `update_bias(load)` moves it
by `rate * sign(mean load - load_i)`: up for underloaded experts. When that
happens (after each training forward, or once per step) is the layer's choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import torch
import torch.nn.functional as F
from torch import nn

from ..layers.parallel import normal_full

SCORES = ("softmax", "sigmoid")


def count_per_expert(expert_S: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64 slots per expert, by a scatter-add: no host sync (CUDA's `bincount` reads its max)."""
    counts_E = torch.zeros(n_experts, dtype=torch.long, device=expert_S.device)
    return counts_E.scatter_add_(0, expert_S, torch.ones_like(expert_S))


@dataclass
class Routing:
    """One router call over T tokens, E experts, top_k = K."""

    experts_TK: torch.Tensor  # (T, K) int64, the chosen experts of each token
    weights_TK: torch.Tensor  # (T, K) combine weights (route dtype), bias-free
    counts_E: torch.Tensor  # (E,) int64, token-slots routed to each expert (before any capacity drop)
    aux_loss: torch.Tensor  # scalar, E * sum_i f_i P_i
    z_loss: torch.Tensor  # scalar, mean logsumexp(logits)^2


def route_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing runs in: float32, or wider when the input is (float64)."""
    return torch.promote_types(dtype, torch.float32)


class Router(nn.Module):
    """Linear gate + top-k over `n_experts`: (T, dim) -> `Routing`.

    `renormalize=None` means True when top_k > 1 (Mixtral, DeepSeek-V3) and
    False when top_k == 1 (Switch: a renormalised single weight would be 1.0
    and the gate would learn from the aux loss alone). `jitter` multiplies the
    input by uniform noise in [1 - jitter, 1 + jitter] in training (Switch).
    """

    expert_bias: torch.Tensor | None  # (E,) float32 buffer, with the aux-free bias only

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str = "softmax",
                 renormalize: bool | None = None, jitter: float = 0.0, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, bias_update_rate: float = 0.0, init_std: float = 0.02,
                 n_groups: int | None = None, topk_groups: int | None = None):
        super().__init__()
        check_routing(n_experts, top_k, score, jitter, aux_loss_coef, z_loss_coef, bias_update_rate)
        check_groups(n_experts, top_k, n_groups, topk_groups)
        self.dim, self.n_experts, self.top_k, self.score = dim, n_experts, top_k, score
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.renormalize = top_k > 1 if renormalize is None else bool(renormalize)
        self.jitter, self.aux_loss_coef, self.z_loss_coef = jitter, aux_loss_coef, z_loss_coef
        self.bias_update_rate = bias_update_rate
        self.weight = nn.Parameter(normal_full((n_experts, dim), init_std))
        bias = torch.zeros(n_experts, dtype=torch.float32) if bias_update_rate > 0 else None
        self.register_buffer("expert_bias", bias)

    def forward(self, x_TD: torch.Tensor, balance_counts_E: torch.Tensor | None = None) -> Routing:
        """Route the T tokens of `x_TD`; `balance_counts_E` (E,) are the loads the aux loss's f_i
        come from (None: this call's own)."""
        dtype = route_dtype(x_TD.dtype)
        x_TD = x_TD.to(dtype)
        if self.training and self.jitter > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits_TE = F.linear(x_TD, self.weight.to(dtype))
        scores_TE = logits_TE.softmax(-1) if self.score == "softmax" else logits_TE.sigmoid()
        select_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias.to(dtype)
        if self.n_groups is not None:
            select_TE = self._limit_groups(select_TE)
        experts_TK = select_TE.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, experts_TK)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        counts_E = count_per_expert(experts_TK.flatten(), self.n_experts)
        aux = self._aux(scores_TE, counts_E if balance_counts_E is None else balance_counts_E)
        return Routing(experts_TK, weights_TK, counts_E, aux, self._z(logits_TE))

    def _limit_groups(self, select_TE: torch.Tensor) -> torch.Tensor:
        """`select_TE` with the experts outside each token's `topk_groups` best groups at -inf."""
        assert self.n_groups is not None and self.topk_groups is not None  # set together (check_groups)
        grouped_TGe = einops.rearrange(select_TE, "t (g e) -> t g e", g=self.n_groups)
        best = min(2, grouped_TGe.shape[-1])
        group_TG = grouped_TGe.topk(best, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_TG.topk(self.topk_groups, dim=-1).indices, True)
        keep_TE = einops.repeat(keep_TG, "t g -> t (g e)", e=grouped_TGe.shape[-1])
        return select_TE.masked_fill(~keep_TE, float("-inf"))

    def _aux(self, scores_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """E * sum_i f_i P_i, f from `counts_E` (token-slots per expert, over whichever batch
        they count), P the mean router probability over these T tokens."""
        probs_TE = scores_TE if self.score == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        f_E = counts_E.to(scores_TE.dtype) / counts_E.sum().clamp(min=1)
        return self.n_experts * (f_E * probs_TE.mean(0)).sum()

    @staticmethod
    def _z(logits_TE: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(logits_TE, -1).square().mean()

    def loss(self, routing: Routing) -> torch.Tensor:
        """aux_loss_coef * aux + z_loss_coef * z: what the layer attaches to its output."""
        return self.aux_loss_coef * routing.aux_loss + self.z_loss_coef * routing.z_loss

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """DeepSeek-V3's step: bias_i += rate * sign(mean(load) - load_i)."""
        if self.expert_bias is None:
            return
        load_E = load_E.to(torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E)

    def _apply(self, fn, recurse=True):
        """Keep `expert_bias` in float32 through `.to(bfloat16)` and the like: updates of
        ~1e-3 would vanish in bf16's 8-bit mantissa."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_experts={self.n_experts}, top_k={self.top_k}, score={self.score!r}, "
                f"renormalize={self.renormalize}, jitter={self.jitter}, aux_loss_coef={self.aux_loss_coef}, "
                f"z_loss_coef={self.z_loss_coef}, bias_update_rate={self.bias_update_rate}"
                + ("" if self.n_groups is None else f", n_groups={self.n_groups}, topk_groups={self.topk_groups}"))


def check_routing(n_experts: int, top_k: int, score: str, jitter: float, aux_loss_coef: float,
                  z_loss_coef: float, bias_update_rate: float) -> None:
    """ValueError naming the first bad routing argument and what would be valid."""
    if not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts={n_experts!r} must be an int >= 1")
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, n_experts={n_experts}]")
    if score not in SCORES:
        raise ValueError(f"score={score!r} is not one of {SCORES}")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter={jitter!r} must be in [0, 1) (0 turns it off)")
    for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                        ("bias_update_rate", bias_update_rate)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 (0 turns it off)")


def check_groups(n_experts: int, top_k: int, n_groups: int | None, topk_groups: int | None) -> None:
    """ValueError unless device-limited routing is off (both None) or well formed: `n_groups`
    divides n_experts, `topk_groups` is in [1, n_groups], and those groups hold top_k experts."""
    if n_groups is None and topk_groups is None:
        return
    if n_groups is None or topk_groups is None:
        raise ValueError(f"n_groups={n_groups!r} and topk_groups={topk_groups!r} go together: set both "
                         "(device-limited routing) or neither")
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1 or n_experts % n_groups:
        raise ValueError(f"n_groups={n_groups!r} must be a positive int dividing n_experts={n_experts}")
    if isinstance(topk_groups, bool) or not isinstance(topk_groups, int) or not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups={topk_groups!r} must be an int in [1, n_groups={n_groups}]")
    if top_k > topk_groups * (n_experts // n_groups):
        raise ValueError(f"top_k={top_k} exceeds the {topk_groups * (n_experts // n_groups)} experts of "
                         f"topk_groups={topk_groups} groups of {n_experts // n_groups}; raise topk_groups")
