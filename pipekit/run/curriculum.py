"""Sequence-length warm-up: each step's batch cut to the length a schedule gives it.

`train.seq_len_start` (None: off) to `train.seq_len` over `train.seq_len_warmup_steps`
steps, DeepSpeed's `curriculum_learning` with `curriculum_type: seqlen` and its
`fixed_linear` / `fixed_root` schedules (`train.seq_len_root`: the root degree, 1 for
linear). At step s (1-based, the step being taken; DeepSpeed's engine asks for its
global step + 1), with start a, end b, warm-up W, root r and `train.seq_len_multiple` m:

    L = floor((s / W) ** (1 / r) * (b - a) + a), rounded down to a multiple of m,
        but never below the first multiple of m at or above a, nor above b;
    L = b from step W on.

The data is read at the full `train.seq_len` and every row cut to its first L tokens
(inputs, labels and a packed row's positions alike), as DeepSpeed truncates its batch:
the same rows at any layout, and after a resume, since L depends on the step alone
(the checkpoint's step is the schedule's position). The rows keep their number, so the
tokens per step grow with L (DeepSpeed's behaviour). Shapes change between steps; every
rank is given its batch, so each sizes its buffers from its own inputs
(`pipekit.handshake.InputShapes`). Validation runs at the full length.
"""

from __future__ import annotations

import math

import torch


def seq_len_at(t, step: int) -> int:
    """The sequence length of step `step` (1-based) under `t` (the config's train section)."""
    start, end = t.seq_len_start, t.seq_len
    if start is None or step >= t.seq_len_warmup_steps:
        return end
    m = t.seq_len_multiple
    length = math.floor((step / t.seq_len_warmup_steps) ** (1.0 / t.seq_len_root) * (end - start) + start)
    length -= length % m
    return min(max(length, -(-start // m) * m), end)


def truncated(batch, length: int):
    """`batch` (a tensor, or nested tuples of them) with every tensor of two or more dims cut to
    its first `length` entries along dim 1 (the sequence)."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(truncated(x, length) for x in batch)
    if isinstance(batch, torch.Tensor) and batch.dim() >= 2:
        return batch[:, :length]
    return batch


def warmed_up(data, t, start_step: int):
    """The batches of `data` (from step start_step + 1 on) each cut to its step's length."""
    for step, batch in enumerate(data, start=start_step + 1):
        yield truncated(batch, seq_len_at(t, step))
