"""Mixture-of-Experts (Megatron-Core / MegaBlocks style): router -> dispatcher -> experts -> combine.

    router.py    Router: linear gate, softmax/sigmoid scores, top-k (optionally
                 group-limited: device-limited routing), load-balancing and z
                 losses, DeepSeek-V3 aux-loss-free bias
    dispatch.py  the Dispatcher seam: the dispatch plan (sort by expert, capacity
                 drops by position or probs, padding to capacity), then
                 dispatch / combine, locally or by all_to_all over ep
    experts.py   Experts (grouped SwiGLU/GELU weights, seeded per global expert),
                 SharedExpert (the always-on dense MLP)
    grouped.py   the experts' grouped matmul (GEMMS): loop, torch._grouped_mm, megablocks,
                 triton (pipekit/kernels/grouped_gemm.py)
    layer.py     MoEMLP, the drop-in for a dense MLP

Only the dispatcher's dispatch and combine communicate in a forward (and the
layer's aux-free bias update, when it sums loads over its balance group). The
aux losses reach the router through `pipekit.auxloss.attach` on the block's
output; values go to `pipekit.auxloss.metrics`. Around a training step the
engine calls the layer as a `pipekit.auxloss.StepStatistic`: a pre-pass that
counts the step's loads for global-batch balancing, and the once-per-step
aux-free bias update, each summing loads over the data-parallel group.
"""

from .dispatch import (
    DISPATCHERS,
    DROP_POLICIES,
    AllToAllDispatcher,
    Dispatcher,
    DispatchPlan,
    DispatchState,
    ExchangeState,
    LocalDispatcher,
    all_to_all,
    capacity,
    combine,
    make_dispatcher,
    permute,
    plan_dispatch,
    register_dispatcher,
)
from .experts import ACTIVATIONS, Experts, SharedExpert
from .grouped import GEMMS, register_gemm
from .layer import BIAS_UPDATES, MoEMLP, apply_bias_updates
from .router import SCORES, Router, Routing

__all__ = [
    "ACTIVATIONS",
    "BIAS_UPDATES",
    "DISPATCHERS",
    "DROP_POLICIES",
    "GEMMS",
    "SCORES",
    "AllToAllDispatcher",
    "DispatchPlan",
    "DispatchState",
    "Dispatcher",
    "ExchangeState",
    "Experts",
    "LocalDispatcher",
    "MoEMLP",
    "Router",
    "Routing",
    "SharedExpert",
    "all_to_all",
    "apply_bias_updates",
    "capacity",
    "combine",
    "make_dispatcher",
    "permute",
    "plan_dispatch",
    "register_dispatcher",
    "register_gemm",
]
