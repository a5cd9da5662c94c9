"""Token embedding with the vocabulary (rows) split over the tp group."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .parallel import TensorParallelModule, divide, group_rank, leave_tp, normal_full, sharded_parameter


def check_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """Token ids are integers in [0, vocab), the same answer in every layout: a float tensor is a
    TypeError here; an id outside the table fails the step with one line, by a device-side
    assertion that reads nothing back to the host (at tp > 1 such an id would otherwise
    embed as zeros on every rank, silently; at tp = 1 an IndexError without the vocab)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"token ids must be integers (torch.long), got a {ids.dtype} tensor of shape "
                        f"{tuple(ids.shape)}; pass the tokenizer's ids as they are (no .float())")
    torch._assert_async(((ids >= 0) & (ids < vocab)).all(),
                        f"a token id lies outside [0, {vocab}), the embedding's rows (model.vocab_size, padded); "
                        f"the inputs hold ids of another tokenizer or vocabulary")


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding whose table rows are split over the tp group.

    weight: (num_embeddings/tp, embedding_dim), sharded along dim 0; rank r
    holds ids [r*V/tp, (r+1)*V/tp). Input: integer ids (...), the same on every
    rank. Output: (..., embedding_dim), full on every rank.

    Each rank looks up the ids it holds and writes zeros for the others; the
    forward all-reduce (`reduce_from_tp`) sums the parts. Backward: no
    communication (each rank's table gets the gradient of its own ids only).
    Sequence-parallel (`sequence_parallel`): ids (B, T), the parts are reduce-scattered
    along T instead, and the output is this rank's slice (B, T/tp, embedding_dim).
    Packed documents: the input `(ids, positions)` gives `(embedding, positions)`, the
    positions (B, T) passed on whole for the blocks' attention.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = 0.02, group=None):
        super().__init__(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = divide(num_embeddings, self.tp_size, "num_embeddings")
        self.vocab_start = group_rank(self.group) * self.rows_per_rank
        self.weight = sharded_parameter(normal_full((num_embeddings, embedding_dim), init_std), 0, self.group)

    def forward(self, ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Any:
        if isinstance(ids, tuple):  # packed documents: (ids, positions)
            return self._embed(ids[0]), ids[1]
        return self._embed(ids)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(ids, self.num_embeddings)
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (..., D)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(out, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"
