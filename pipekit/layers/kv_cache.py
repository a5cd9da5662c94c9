"""The key/value cache of incremental decoding, held apart from the layers.

    with kv_cache(max_len) as cache:
        logits = model((ids, positions))            # the prompt, positions 0..L-1
        logits = model((next_ids, next_positions))  # then the new tokens at L, L+1, ...

While a cache is active (a context variable, so only code inside the `with` sees it),
every `CausalSelfAttention` the forward passes through appends the keys and values of
its new tokens (after the rotary embedding, before grouped-query heads are repeated)
to its own slot and attends over all of them: the query at absolute position p sees
the keys at positions 0..p. No cache active (training, eval, everything else): the
layers compute what they always did; nothing here is consulted.

Plan and limits: one sequence per row, all rows at the same positions, fed in order
(the new tokens' positions must continue at the cached length, else a ValueError);
at most `max_len` positions (the slots are allocated at that length on first use;
more is a ValueError, never a sliding window). For inference: nothing is freed or
rolled back, and no gradient is meant to flow through it. One process's own heads
(a tp rank caches its own kv heads); no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Slot:
    k: torch.Tensor  # (B, KV, max_len, hd)
    v: torch.Tensor
    length: int = 0


class KVCache:
    """Keys and values per attention module, up to `max_len` positions each."""

    def __init__(self, max_len: int):
        if max_len < 1:
            raise ValueError(f"a KV cache needs max_len >= 1, got {max_len}")
        self.max_len = max_len
        self._slots: dict[nn.Module, _Slot] = {}

    def length(self, module: nn.Module) -> int:
        """Positions cached for `module` (0 before its first call)."""
        slot = self._slots.get(module)
        return 0 if slot is None else slot.length

    def append(self, module: nn.Module, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add the keys and values (B, KV, n, hd) of tokens at `positions` (B, n) to `module`'s
        slot; return all its keys and values (B, KV, S, hd) and the mask (B, 1, n, S) of which
        of them each new query sees (key position <= query position)."""
        start, n = self.length(module), k.shape[2]
        if start + n > self.max_len:
            raise ValueError(f"the KV cache holds at most {self.max_len} positions (max_seq_len); "
                             f"{start} cached plus {n} new is {start + n}")
        expected = torch.arange(start, start + n, device=positions.device)
        if not torch.equal(positions, expected.expand_as(positions)):
            raise ValueError(f"the KV cache holds positions 0..{start - 1}; new tokens must continue at "
                             f"{start}, got positions {positions[0].tolist()}")
        slot = self._slots.get(module)
        if slot is None:
            shape = (*k.shape[:2], self.max_len, k.shape[3])
            slot = self._slots[module] = _Slot(k.new_empty(shape), v.new_empty(shape))
        end = start + n
        slot.k[:, :, start:end] = k
        slot.v[:, :, start:end] = v
        slot.length = end
        keys = torch.arange(end, device=positions.device)
        mask = keys <= positions.unsqueeze(-1)  # (B, n, S): query at p sees keys 0..p
        return slot.k[:, :, :end], slot.v[:, :, :end], mask.unsqueeze(1)


_ACTIVE: ContextVar[KVCache | None] = ContextVar("pipekit_kv_cache", default=None)
_open = 0  # `kv_cache` blocks open in this process, in any context: at 0 no ContextVar is read


@contextmanager
def kv_cache(max_len: int) -> Iterator[KVCache]:
    """A fresh `KVCache` of `max_len` positions, active for the attention layers inside the `with`."""
    global _open
    cache = KVCache(max_len)
    token = _ACTIVE.set(cache)
    _open += 1
    try:
        yield cache
    finally:
        _open -= 1
        _ACTIVE.reset(token)


def active_kv_cache() -> KVCache | None:
    """The cache of the innermost `kv_cache` block, or None outside one. With no block open
    anywhere (training) the ContextVar is not read: torch.compile cannot trace its `get`
    (a graph break in every attention layer) but guards on the count."""
    return _ACTIVE.get() if _open else None
