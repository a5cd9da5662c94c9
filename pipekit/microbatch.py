"""Microbatches: a batch split along its first dimension, moved, cast, and handed between stages.

A stage's input or output is a tensor or a tuple of tensors; these helpers keep that
structure while they split, move, cast and detach it. Nothing here communicates.
"""

from __future__ import annotations

import torch


class Microbatches(list):
    """A step's batch already cut into its microbatches: `Microbatches([(inputs, labels), ...])`,
    one pair per microbatch, each of its own shape (length-bucketed or trimmed batches; a
    rank that needs no inputs or labels passes None in their place, as for a whole batch).

    `PipelineEngine.train_batch` / `eval_batch` take it where they take a batch (or an
    iterator may give it). Each microbatch's loss then weighs as in one process looping over
    the same microbatches: for a token-level loss by its valid tokens (as for a whole
    batch), for any other loss by its rows."""

    def inputs(self) -> list | None:
        """Each microbatch's inputs (a list over microbatches), None if none were given."""
        return self._column(0, "inputs")

    def labels(self) -> list | None:
        """Each microbatch's labels (a list over microbatches), None if none were given."""
        return self._column(1, "labels")

    def _column(self, i: int, what: str) -> list | None:
        for m, pair in enumerate(self):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"Microbatches holds one (inputs, labels) pair per microbatch; item {m} is "
                                f"{type(pair).__name__}")
        column = [tuple(pair[i]) if isinstance(pair[i], list) else pair[i] for pair in self]
        given = [x is not None for x in column]
        if not any(given):
            return None
        if not all(given):
            raise ValueError(f"Microbatches: {what} given for microbatches {[m for m, g in enumerate(given) if g]} "
                             f"but None for {[m for m, g in enumerate(given) if not g]}; give them for all or none")
        return column


def split_microbatches(batch, num_microbatches: int, what: str) -> list:
    """Split a tensor or tuple of tensors along dim 0 into equal microbatches."""
    items = batch if isinstance(batch, tuple) else (batch,)
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] % num_microbatches:
            size = t.shape[0] if t.dim() else "a scalar"
            raise ValueError(
                f"{what} batch size {size} does not split into {num_microbatches} microbatches; "
                f"use a batch size that is a multiple of {num_microbatches}"
            )
    parts = [t.chunk(num_microbatches) for t in items]
    return [tuple(p[m] for p in parts) if isinstance(batch, tuple) else parts[0][m] for m in range(num_microbatches)]


def leaf(x):
    """Detach an activation handed to the next stage; float tensors get their own grad."""
    if isinstance(x, tuple):
        return tuple(leaf(t) for t in x)
    return x.detach().requires_grad_(x.is_floating_point())


def rebuild(template, tensors: list[torch.Tensor]):
    """Give received tensors the structure (tensor or tuple) of `template`."""
    return tuple(tensors) if isinstance(template, tuple) else tensors[0]


def to_device(x, device: torch.device):
    """Move a tensor or tuple of tensors (as a data loader gives them, on the CPU) to `device`."""
    if isinstance(x, tuple):
        return tuple(to_device(t, device) for t in x)
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


def next_batch(data):
    """The batch itself (a pair or list of two, or None), or the next item of an iterator."""
    if data is None or isinstance(data, (tuple, list)):
        return data
    if not hasattr(data, "__next__"):
        raise TypeError(f"expected a batch (inputs, labels) or an iterator of batches, got {type(data).__name__}; "
                        "pass iter(loader) for a DataLoader")
    return next(data)


def cast_floats(x, dtype: torch.dtype | None):
    """Cast the floating-point tensors of a tensor or tuple to `dtype` (None: unchanged)."""
    if dtype is None:
        return x
    if isinstance(x, tuple):
        return tuple(cast_floats(t, dtype) for t in x)
    return x.to(dtype) if x.is_floating_point() else x


def all_tensors(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, tuple) else [x]
