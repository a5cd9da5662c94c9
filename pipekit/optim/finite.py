"""Whether a step may be applied: the one check for non-finite values, agreed by the whole world.

Before the update every rank marks what it holds that is not finite in one small float
vector (`Marks`):

    slot 0                     its reduced gradients (ZeroOptimizer: each bucket's owned part)
    1 + r * M + m              the loss of microbatch m of dp replica r (the last stage's ranks)
    1 + (dp + r) * M + m       the inputs of microbatch m of dp replica r (stage 0's ranks)

(the engine marks the losses and inputs; a plain `ZeroOptimizer.step()` only the gradients).
One all-reduce over the world and one host read later every rank holds the same verdict, so
no rank steps while another skips. The engine's marks also carry the step's loss
(`carry_loss`: this rank's share of the global batch's loss, and whether it asked for it), so
`train_batch(reduce_loss=True)` costs no collective and no host read of its own: the marks
are summed (a mark set anywhere stays nonzero; a count, not a 0/1, after the reduction), the
loss shares with them. A plain `ZeroOptimizer.step()` reduces its marks by MAX, as before.
A step with any mark set is skipped: no update, the weights, optimizer state and step counts
untouched (with an fp16 loss scaler it counts as an overflow), and `Skip` says why, in one
line naming the step and whether the loss (which comes first, in forward) or only the
gradients went non-finite, and which microbatches' losses or inputs did. A microbatch whose
loss weighs nothing (no valid token) is not marked: its NaN loss is expected and counts 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..microbatch import all_tensors


class Marks:
    """One step's non-finite marks (module docstring), on the device until `verdict` reads them."""

    def __init__(self, device: torch.device | str | None = None, *, dp: int = 1, microbatches: int = 0,
                 dp_rank: int = 0, loss: bool = False, world: int | None = None):
        self.dp, self.microbatches, self.dp_rank = dp, microbatches, dp_rank
        # the ranks the step spans (a Topology's world_size): 1 is a rank alone (Topology(alone=True), in a
        # world of others, or one plain process), whose marks are reduced with no one; None: the whole world
        self.world = world
        self.values = torch.zeros(1 + 2 * dp * microbatches, dtype=torch.float32, device=device)
        # `loss`: two float64 slots after the marks, [this rank's loss share, 1 if it asked for the loss]
        self.loss = torch.zeros(2, dtype=torch.float64, device=device) if loss else None
        self._reduced: torch.Tensor | None = None  # the marks and the loss slots after `reduce`, summed
        self.loss_read: tuple[float, float] | None = None  # the loss slots as `verdict` read them

    def carry_loss(self, share: torch.Tensor) -> None:
        """Carry `share` (0-dim, this rank's part of the global batch's loss: zero where it holds
        no loss, or is not the one rank of its tp group that counts it) in the reduction, and
        say that this rank asked for the loss."""
        assert self.loss is not None, "Marks(loss=True) carries the loss"
        self.loss[0] = share.to(self.loss.dtype)
        self.loss[1] = 1.0

    @property
    def grads(self) -> torch.Tensor:
        """The gradients' mark: a 0-dim view, which fused AdamW's first pass writes into."""
        return self.values[0]

    def _row(self, kind: int) -> torch.Tensor:
        start = 1 + (kind * self.dp + self.dp_rank) * self.microbatches
        return self.values[start:start + self.microbatches]

    def mark_grads(self, grads: list[torch.Tensor]) -> None:
        for g in grads:  # a host gradient (ZeRO-2 offload): its flag onto the marks' device
            self.grads.copy_(torch.maximum(self.grads, (~torch.isfinite(g)).any().float().to(self.values.device)))

    def mark_losses(self, losses: list[torch.Tensor], weights: torch.Tensor) -> None:
        """Each microbatch's loss (`weights`: what it counts for; 0: not at all, not marked).
        Scalar losses (the usual) are checked in one op over their stack."""
        if all(loss.dim() == 0 for loss in losses):
            bad = ~torch.isfinite(torch.stack([loss.detach() for loss in losses]))
        else:
            bad = torch.stack([~torch.isfinite(loss.detach()).all() for loss in losses])
        self._row(0).copy_((bad & (weights.to(bad.device) != 0)).float())

    def mark_inputs(self, micro_in: list) -> None:
        """Each microbatch's floating-point inputs (token ids are never marked): one flag per
        microbatch, written into the row at once."""
        flags = [[(~torch.isfinite(t)).any() for t in all_tensors(x) if t.is_floating_point()] for x in micro_in]
        held = [m for m, f in enumerate(flags) if f]
        if not held:
            return
        bad = torch.stack([f[0] if len(f) == 1 else torch.stack(f).any() for f in flags if f]).float()
        row = self._row(1)
        if len(held) == len(flags):
            row.copy_(bad)
        else:
            row[torch.tensor(held, device=row.device)] = bad

    def reduce(self) -> None:
        """Every rank's marks on every rank (one all-reduce over the world): with the loss slots
        the marks and the loss shares summed in one float64 message, else the marks by MAX."""
        shared = dist.is_initialized() and self.world != 1
        if self.loss is None:
            if shared:
                dist.all_reduce(self.values, op=dist.ReduceOp.MAX)
            return
        assert self._reduced is None, "the marks are reduced once a step (a sum is not idempotent)"
        packed = torch.cat([self.values.double(), self.loss])
        if shared:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        self.values.copy_(packed[:-2])  # counts of the ranks that marked: nonzero where any did
        self._reduced = packed

    def any(self) -> torch.Tensor:
        """Whether any mark is set: a 0-dim float32 on the device (fused AdamW's `found_inf`)."""
        return self.values.amax()

    def verdict(self, loss_scale: float | None = None) -> Skip | None:
        """The reduced marks read on the host (the one read; the loss slots with them, into
        `loss_read`): None, or why the step is skipped."""
        if self._reduced is not None:
            values = self._reduced.tolist()
            self.loss_read = (values[-2], values[-1])
            values = values[:-2]
        else:
            values = self.values.tolist()
        if not any(values):
            return None
        m = self.microbatches

        def where(kind: int) -> tuple[tuple[int, int], ...]:
            start = 1 + kind * self.dp * m
            return tuple(divmod(i, m) for i, v in enumerate(values[start:start + self.dp * m]) if v)

        return Skip(grads=bool(values[0]), losses=where(0), inputs=where(1), loss_scale=loss_scale)


@dataclass(frozen=True)
class Skip:
    """Why a step was skipped on every rank. `losses`, `inputs`: (dp rank, microbatch) of the
    microbatches whose loss or inputs were not finite; `loss_scale`: the fp16 loss scale after
    the skip (None without a scaler). `overflow`: only gradients went non-finite with a dynamic
    loss scaler that can still lower its scale (fp16's ordinary skip, not a divergence)."""

    grads: bool
    losses: tuple[tuple[int, int], ...] = ()
    inputs: tuple[tuple[int, int], ...] = ()
    loss_scale: float | None = None
    overflow: bool = False

    def line(self, step: int) -> str:
        """The one line that says so."""
        if self.overflow:
            return (f"step {step}: fp16 gradient overflow on some rank; the step was skipped on every rank, "
                    f"loss scale now {self.loss_scale:g}")
        if self.losses or self.inputs:
            what = "the loss went non-finite first" if self.losses else "the inputs are not finite"
            detail = [f"loss of {_microbatches(self.losses)}" if self.losses else "",
                      f"inputs of {_microbatches(self.inputs)} hold a NaN or inf" if self.inputs else ""]
            what += f" ({'; '.join(d for d in detail if d)})"
        else:
            what = "the gradients went non-finite (the loss was finite)"
        scale = f", loss scale now {self.loss_scale:g}" if self.loss_scale is not None else ""
        return (f"step {step}: skipped on every rank, {what}; the weights and optimizer state are unchanged"
                f"{scale}")


def _microbatches(where: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"microbatch {m} of dp rank {r}" for r, m in where)
