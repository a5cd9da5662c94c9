"""Validation of a lowered schedule: every check the engine relies on.

Checks, in order, raising ScheduleError at the first failure:

1. shape: `placement` names ranks 0..len(ranks)-1; every action's stage and
   microbatch are in range and the action runs on the rank hosting its stage;
   no action appears twice; SEND/RECV only across ranks and never past the
   first or last stage; the two parts of an OVERLAP run on one rank;
2. completeness: every (stage, mb) has one F and either one B (full backward)
   or one I (input grad) and one W (weight grads); a forward-only program
   (`backward=False`, for eval) has one F each and no backward at all;
3. dependencies on each rank: F(s, m) after its input (s == 0, F(s-1, m)
   earlier when local, else RECV_F(s, m) earlier); B/I(s, m) after F(s, m)
   and after its output grad (last stage, B/I(s+1, m) earlier when local,
   else RECV_B(s, m) earlier); W(s, m) after I(s, m); a SEND after the
   compute producing it;
4. per directed rank pair, the sender's SEND sequence equals the receiver's
   RECV sequence element by element;
   (checks 1-3 see an OVERLAP as its two parts at one step: neither may need the other)
5. running it with buffered sends and blocking receives finishes (no deadlock).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from .execute import execute
from .ir import INPUT_GRAD_KINDS, Action, Kind, ScheduleError, matching_recv, matching_send, message_stages


def validate(ranks: Sequence[Sequence[Action]], placement, microbatches: int, *, backward: bool = True) -> None:
    """Raise ScheduleError naming the offending rank/action if `ranks` is not a valid program
    (a training program; with `backward=False`, a forward-only one)."""
    _check_shape(ranks, placement, microbatches)
    _check_complete(ranks, placement, microbatches, backward)
    for r, actions in enumerate(ranks):
        _check_dependencies(r, actions, placement)
    _check_pairs(ranks, placement)
    execute(ranks, placement, duration=lambda a: 0)


def _flat(actions) -> list[tuple[int, Action]]:
    """(step, action) of a rank's list, an OVERLAP standing as its parts at its one step."""
    flat = []
    for i, a in enumerate(actions):
        if not isinstance(a, Action):
            raise ScheduleError(f"step {i}: {a!r} is not an Action")
        flat += [(i, part) for part in a.parts]
    return flat


def _check_shape(ranks, placement, microbatches) -> None:
    bad = [p for p in placement if not 0 <= p < len(ranks)]
    if bad or not placement:
        raise ScheduleError(f"placement {tuple(placement)} must map stages to ranks 0..{len(ranks) - 1}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    seen = Counter(a for actions in ranks for _, a in _flat(actions))
    for r, actions in enumerate(ranks):
        for i, a in _flat(actions):
            _check_action(r, i, a, placement, microbatches)
            if seen[a] > 1:
                raise ScheduleError(f"{a} appears {seen[a]} times (rank {r} step {i}); each action runs once")


def _check_action(r, i, a, placement, microbatches) -> None:
    where = f"rank {r} step {i}: {a}"
    if not isinstance(a, Action):
        raise ScheduleError(f"rank {r} step {i}: {a!r} is not an Action")
    if not 0 <= a.stage < len(placement):
        raise ScheduleError(f"{where} names stage {a.stage}; valid stages are 0..{len(placement) - 1}")
    if not 0 <= a.microbatch < microbatches:
        raise ScheduleError(f"{where} names microbatch {a.microbatch}; valid are 0..{microbatches - 1}")
    if placement[a.stage] != r:
        raise ScheduleError(f"{where} runs on rank {r} but stage {a.stage} is placed on rank {placement[a.stage]}")
    if a.is_comm:
        src, dst = message_stages(a)
        peer = dst if a.kind in (Kind.SEND_F, Kind.SEND_B) else src
        if not 0 <= peer < len(placement):
            raise ScheduleError(f"{where} talks to stage {peer}, which does not exist")
        if placement[peer] == r:
            raise ScheduleError(f"{where} talks to stage {peer} on the same rank; local hand-offs need no message")


def _check_complete(ranks, placement, microbatches, backward: bool) -> None:
    kinds = defaultdict(set)
    for actions in ranks:
        for _, a in _flat(actions):
            kinds[(a.stage, a.microbatch)].add(a.kind)
    for s in range(len(placement)):
        for m in range(microbatches):
            have = kinds[(s, m)] - {Kind.F}
            where = f"stage {s} microbatch {m} (rank {placement[s]})"
            if Kind.F not in kinds[(s, m)]:
                raise ScheduleError(f"{where} has no forward {Action(s, Kind.F, m)}")
            computed = sorted(k.value for k in have if k in (Kind.B, Kind.I, Kind.W))
            if not backward:
                if computed:
                    raise ScheduleError(f"{where}: a forward-only program has no backward, found {computed}")
            elif have & {Kind.B, Kind.I, Kind.W} not in ({Kind.B}, {Kind.I, Kind.W}):
                raise ScheduleError(
                    f"{where} needs either B (full backward) or I and W (split backward), found {computed or 'none'}"
                )


def _check_dependencies(rank, actions, placement) -> None:
    flat = _flat(actions)
    position = {a: i for i, a in flat}
    for i, a in flat:
        for options, why in _needs(a, placement):
            steps = [position[o] for o in options if o in position]
            if not steps or min(steps) > i:
                need = " or ".join(str(o) for o in options)
                state = f"at step {min(steps)}" if steps else "missing"
                raise ScheduleError(f"rank {rank} step {i}: {a} needs {need} earlier ({why}); it is {state}")


def _needs(a: Action, placement) -> list[tuple[tuple[Action, ...], str]]:
    """What must precede `a` on its own rank: (acceptable actions, reason) pairs."""
    s, m, last = a.stage, a.microbatch, len(placement) - 1
    if a.kind is Kind.F and s > 0:
        local = placement[s - 1] == placement[s]
        return [((Action(s - 1, Kind.F, m),) if local else (Action(s, Kind.RECV_F, m),), "its input")]
    if a.kind in INPUT_GRAD_KINDS:
        needs: list[tuple[tuple[Action, ...], str]] = [((Action(s, Kind.F, m),), "backward needs its forward")]
        if s < last:
            local = placement[s + 1] == placement[s]
            grad = _backwards(s + 1, m) if local else (Action(s, Kind.RECV_B, m),)
            needs.append((grad, "its output grad"))
        return needs
    if a.kind is Kind.W:
        return [((Action(s, Kind.I, m),), "weight grad after input grad")]
    if a.kind is Kind.SEND_F:
        return [((Action(s, Kind.F, m),), "the output it sends")]
    if a.kind is Kind.SEND_B:
        return [(_backwards(s, m), "the grad it sends")]
    return []


def _backwards(stage: int, m: int) -> tuple[Action, ...]:
    """Either backward form of (stage, m) produces its input grad."""
    return Action(stage, Kind.B, m), Action(stage, Kind.I, m)


def _check_pairs(ranks, placement) -> None:
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, actions in enumerate(ranks):
        for a in actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sends[(r, placement[matching_recv(a).stage])].append(a)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                recvs[(placement[matching_send(a).stage], r)].append(a)
    for pair in sorted(set(sends) | set(recvs)):
        _check_pair(pair, sends[pair], recvs[pair])


def _check_pair(pair, sends, recvs) -> None:
    src, dst = pair
    for k in range(max(len(sends), len(recvs))):
        send = sends[k] if k < len(sends) else None
        recv = recvs[k] if k < len(recvs) else None
        if send is None or recv is None or matching_recv(send) != recv:
            raise ScheduleError(
                f"rank {src} -> rank {dst}, message {k}: rank {src} sends {send or 'nothing'} "
                f"but rank {dst} receives {recv or 'nothing'}"
            )
