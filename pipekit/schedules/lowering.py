"""Lowering: insert the SEND/RECV actions into per-rank compute lists.

Plan, for a message between stages on different ranks:

1. Each RECV goes immediately before the compute action that consumes it:
   RECV_F(s, m) before F(s, m); RECV_B(s, m) before B(s, m) or I(s, m).
2. For each directed rank pair (a -> b), the message order is b's RECV order.
3. On rank a, each SEND goes right after the compute action producing it
   (F(s, m) -> SEND_F(s, m); B or I(s, m) -> SEND_B(s, m)), except that it
   is held while an earlier message of the same pair is still unproduced; a
   held message is flushed right after the compute that unblocks it.

An OVERLAP stands for its two parts: the RECVs of both go before it, the
SENDs of both after it (both run at once, so both inputs must be there).

So per pair, a's SEND sequence equals b's RECV sequence by construction.
Lowering does not check dependencies; `validate` does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from .ir import INPUT_GRAD_KINDS, Action, Kind, ScheduleError, format_actions, matching_recv, matching_send


def _recv_for(action: Action, placement) -> Action | None:
    """The RECV that `action` consumes, when its producer lives on another rank."""
    s, n = action.stage, len(placement)
    if action.kind is Kind.F and s > 0 and placement[s - 1] != placement[s]:
        return Action(s, Kind.RECV_F, action.microbatch)
    if action.kind in INPUT_GRAD_KINDS and s < n - 1 and placement[s + 1] != placement[s]:
        return Action(s, Kind.RECV_B, action.microbatch)
    return None


def _send_for(action: Action, placement) -> Action | None:
    """The SEND that `action` produces, when its consumer lives on another rank."""
    s, n = action.stage, len(placement)
    if action.kind is Kind.F and s < n - 1 and placement[s + 1] != placement[s]:
        return Action(s, Kind.SEND_F, action.microbatch)
    if action.kind in INPUT_GRAD_KINDS and s > 0 and placement[s - 1] != placement[s]:
        return Action(s, Kind.SEND_B, action.microbatch)
    return None


def _check_compute_only(compute, placement) -> None:
    for r, actions in enumerate(compute):
        for i, whole in enumerate(actions):
            if not whole.is_compute:
                raise ScheduleError(f"lower() takes compute actions only; rank {r} step {i} is {whole}")
            for a in whole.parts:
                _check_placed(r, i, a, placement)


def _check_placed(r: int, i: int, a: Action, placement) -> None:
    if not 0 <= a.stage < len(placement):
        raise ScheduleError(f"rank {r} step {i}: {a} names stage {a.stage}, valid 0..{len(placement) - 1}")
    if placement[a.stage] != r:
        raise ScheduleError(f"rank {r} step {i}: {a} runs on rank {r} but stage {a.stage} is placed on "
                            f"rank {placement[a.stage]}")


def _pair_orders(compute, placement) -> dict[tuple[int, int], list[Action]]:
    """(src rank, dst rank) -> the SENDs src must emit, in dst's RECV order."""
    orders = defaultdict(list)
    for dst, actions in enumerate(compute):
        for a in (part for whole in actions for part in whole.parts):
            recv = _recv_for(a, placement)
            if recv is not None:
                send = matching_send(recv)
                orders[(placement[send.stage], dst)].append(send)
    return orders


def lower(compute: Sequence[Sequence[Action]], placement) -> list[list[Action]]:
    """Return the per-rank lists with RECVs and SENDs inserted (see module doc).

    Raises ScheduleError when a message is never produced by its sender or
    produced but never received.
    """
    _check_compute_only(compute, placement)
    orders = _pair_orders(compute, placement)
    return [_lower_rank(r, actions, placement, orders) for r, actions in enumerate(compute)]


def _lower_rank(rank: int, actions, placement, orders) -> list[Action]:
    out, produced = [], []
    next_index: defaultdict[int, int] = defaultdict(int)  # dst rank -> position in orders[(rank, dst)]
    for whole in actions:
        out += [recv for a in whole.parts if (recv := _recv_for(a, placement)) is not None]
        out.append(whole)
        sends = [send for a in whole.parts if (send := _send_for(a, placement)) is not None]
        if sends:
            produced += sends
            out += _flush(rank, produced, next_index, orders, placement)
    _check_all_sent(rank, produced, next_index, orders, placement)
    return out


def _flush(rank, produced, next_index, orders, placement) -> list[Action]:
    """Emit (and remove from `produced`) every send that is next in its pair's order."""
    emitted, progress = [], True
    while progress:
        progress = False
        for send in list(produced):
            dst = placement[matching_recv(send).stage]
            order = orders.get((rank, dst), [])
            if next_index[dst] < len(order) and order[next_index[dst]] == send:
                produced.remove(send)
                emitted.append(send)
                next_index[dst] += 1
                progress = True
    return emitted


def _check_all_sent(rank, produced, next_index, orders, placement) -> None:
    for send in produced:
        dst = placement[matching_recv(send).stage]
        order = orders.get((rank, dst), [])
        if send not in order:
            raise ScheduleError(f"rank {rank} produces {send} but rank {dst} never receives it ({matching_recv(send)})")
    for (src, dst), order in orders.items():
        if src == rank and next_index[dst] < len(order):
            missing = order[next_index[dst]]
            producer = "F" if missing.kind is Kind.F or missing.kind is Kind.SEND_F else "B or I"
            raise ScheduleError(
                f"rank {rank} never sends {missing}, which rank {dst} receives as {matching_recv(missing)}: "
                f"rank {rank} runs no {producer} of stage {missing.stage} microbatch {missing.microbatch}"
                + (f"; held behind it: {format_actions(produced)}" if produced else "")
            )
