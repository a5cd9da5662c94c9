"""Triton kernels, each in one file beside its autograd Function and its PyTorch
reference; `dispatch.py` holds the one rule that picks a side (Triton on CUDA in
fp32/fp16/bf16, the reference otherwise; float64 always the reference). `FusedAdamW` is the
one optimizer among them: ZeroOptimizer steps its master shards with it (`fused=`)."""

from .adamw import FusedAdamW, adamw_step_, adamw_step_reference, unscale_and_check_, unscale_and_check_reference
from .dispatch import MODES, kernels, kernels_mode, set_kernels, use_triton
from .glu import geglu, geglu_reference, swiglu, swiglu_reference
from .grouped_gemm import grouped_gemm, grouped_gemm_reference
from .linear_cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_eager,
    linear_cross_entropy_reference,
)
from .moe_permute import moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference
from .norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .rotary import apply_rotary, apply_rotary_reference

__all__ = [
    "MODES",
    "kernels",
    "kernels_mode",
    "set_kernels",
    "use_triton",
    "apply_rotary",
    "apply_rotary_reference",
    "geglu",
    "geglu_reference",
    "swiglu",
    "swiglu_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_eager",
    "linear_cross_entropy_reference",
    "grouped_gemm",
    "grouped_gemm_reference",
    "moe_permute",
    "moe_permute_reference",
    "moe_unpermute",
    "moe_unpermute_reference",
    "FusedAdamW",
    "adamw_step_",
    "adamw_step_reference",
    "unscale_and_check_",
    "unscale_and_check_reference",
]
