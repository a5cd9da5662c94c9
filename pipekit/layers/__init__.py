"""Tensor-parallel primitives and transformer layers.

Every layer takes `group=None`, meaning the tp group current at construction
(`with tensor_parallel(group): ...`); with no group it is a plain one-process
layer; built inside `with sequence_parallel(True): ...` as well (and at tp > 1), the
activations between their tp regions are split along the sequence. A tp shard is a
slice of the full tensor initialised the same way at every tp size, and parameter
names do not depend on the tp size.
"""

from .attention import CausalSelfAttention
from .block import TransformerBlock
from .cross_entropy import FusedLinearCrossEntropy, VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import GeluMLP, SwiGLUMLP
from .norm import LayerNorm, RMSNorm
from .parallel import (
    TensorParallelModule,
    copy_to_tp,
    current_tp_group,
    gather_from_tp,
    gather_sequence,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_sequence,
    scatter_to_tp,
    sequence_parallel,
    shard_dim,
    sharded_parameter,
    tensor_parallel,
    tp_slice,
)
from .rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "CausalSelfAttention",
    "ColumnParallelLinear",
    "FusedLinearCrossEntropy",
    "GeluMLP",
    "LayerNorm",
    "RMSNorm",
    "RowParallelLinear",
    "SwiGLUMLP",
    "TensorParallelModule",
    "TransformerBlock",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "apply_rotary",
    "copy_to_tp",
    "current_tp_group",
    "gather_from_tp",
    "gather_sequence",
    "group_rank",
    "group_size",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "rotary_cos_sin",
    "scatter_to_tp",
    "sequence_parallel",
    "shard_dim",
    "sharded_parameter",
    "tensor_parallel",
    "tp_slice",
    "vocab_parallel_cross_entropy",
]
