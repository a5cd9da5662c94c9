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

Trimmed padding (`data.trim_padding`, packed rows): each microbatch of a step is cut
after its rows' last labelled place, rounded up to `train.seq_len_multiple` (at most
the batch's length), and the step is handed to the engine as `pipekit.Microbatches`,
microbatches of different lengths. Under causal attention nothing before the cut reads
what is cut, and the labels cut are all ignored, so the loss and gradients are those of
the untrimmed batch; only the work on padding goes.
"""

from __future__ import annotations

import math

import torch

from ..data import IGNORE_INDEX
from ..microbatch import Microbatches, split_microbatches


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


def trimmed(batch, microbatches: int, multiple: int, ignore_index: int = IGNORE_INDEX) -> Microbatches:
    """`batch` (inputs, labels) split into `microbatches`, each cut after the last place any of
    its rows has a label other than `ignore_index`, rounded up to `multiple` (see the module
    docstring)."""
    inputs, labels = batch
    inputs = tuple(inputs) if isinstance(inputs, list) else inputs
    out = []
    for x, y in zip(split_microbatches(inputs, microbatches, "inputs"),
                    split_microbatches(labels, microbatches, "labels")):
        full = y.shape[1]
        places = (y != ignore_index).any(dim=0).nonzero()
        used = int(places[-1]) + 1 if places.numel() else 1
        out.append(truncated((x, y), min(-(-used // multiple) * multiple, full)))
    return Microbatches(out)


def trimmed_batches(data, microbatches: int, multiple: int):
    """The batches of `data`, each as its trimmed `Microbatches`."""
    for batch in data:
        yield trimmed(batch, microbatches, multiple)
