"""Mixture-of-Experts (Megatron-Core / MegaBlocks style): router -> dispatch -> experts -> combine.

    router.py    Router: linear gate, softmax/sigmoid scores, top-k, load-balancing
                 and z losses, DeepSeek-V3 aux-loss-free bias
    experts.py   Experts (grouped SwiGLU/GELU weights, seeded per global expert),
                 SharedExpert (the always-on dense MLP)
    grouped.py   grouped matmul backends: loop, torch._grouped_mm, megablocks
    dispatch.py  sort by expert, capacity drops, all_to_all expert parallelism, combine
    layer.py     MoEMLP, the drop-in for a dense MLP

Only dispatch.py communicates. The aux losses reach the router through
`pipekit.auxloss.attach` on the block's output; values go to `pipekit.auxloss.metrics`.
"""

from .dispatch import DROP_POLICIES, DispatchPlan, all_to_all, capacity, combine, permute, plan_dispatch
from .experts import ACTIVATIONS, Experts, SharedExpert
from .grouped import BACKENDS, register_backend
from .layer import BIAS_UPDATES, MoEMLP, apply_bias_updates
from .router import SCORES, Router, Routing

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BIAS_UPDATES",
    "DROP_POLICIES",
    "DispatchPlan",
    "Experts",
    "MoEMLP",
    "Router",
    "Routing",
    "SCORES",
    "SharedExpert",
    "all_to_all",
    "apply_bias_updates",
    "capacity",
    "combine",
    "permute",
    "plan_dispatch",
    "register_backend",
]
