"""The one model of execution: each rank walks its action list; a RECV waits for its SEND.

`execute` is shared by `validate` (durations of zero: does every program finish,
or where does it deadlock) and `simulate` (real durations: when does each
action start and end). Pure Python: no torch.
"""

from __future__ import annotations

from .ir import Action, Kind, ScheduleError, matching_send


def execute(ranks, placement, duration, comm_latency=0.0) -> list[list[tuple[float, float]]]:
    """(start, end) of every action of every rank; raises ScheduleError on a deadlock.

    `duration(action)` is what the action keeps its rank busy (communication
    actions included); `comm_latency` a number or a function of the RECV action.

    Sweeps the ranks, advancing each as far as its next RECV allows, until all
    are done or no rank can move. Shared by `simulate` and `validate`.
    """
    times: list[list[tuple[float, float]]] = [[] for _ in ranks]
    clocks = [0.0] * len(ranks)
    sent: dict[Action, float] = {}
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(ranks):
            progress |= _advance(r, actions, times[r], clocks, sent, duration, comm_latency)
    _check_finished(ranks, times, placement)
    return times


def _advance(r, actions, times, clocks, sent, duration, comm_latency) -> bool:
    """Run rank r's actions until a RECV whose SEND has not happened; True if any ran."""
    start_len = len(times)
    while len(times) < len(actions):
        a = actions[len(times)]
        start = clocks[r]
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            send = matching_send(a)
            if send not in sent:
                break
            start = max(start, sent[send] + (comm_latency(a) if callable(comm_latency) else comm_latency))
        end = start + duration(a)
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            sent[a] = end  # the message leaves once it is posted
        times.append((start, end))
        clocks[r] = end
    return len(times) > start_len


def _check_finished(ranks, times, placement) -> None:
    stuck = []
    for r, actions in enumerate(ranks):
        if len(times[r]) < len(actions):
            a = actions[len(times[r])]
            peer = _peer_rank(a, placement)
            stuck.append(f"rank {r} waits on {a} (step {len(times[r])}) from rank {peer}")
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))


def _peer_rank(recv: Action, placement):
    stage = matching_send(recv).stage
    return placement[stage] if 0 <= stage < len(placement) else "<none>"
