"""The schedule IR: actions, their kinds and text form, and which send pairs with which receive.

An `Action` is (virtual stage, kind, microbatch). Each compute kind means
one thing wherever it stands (torch.distributed.pipelining's names):

- `F`: forward;
- `B`: the full backward: input grad and weight grads in one pass;
- `I`: backward for the input grad only (the first half of a split backward);
- `W`: the weight grads of a stage whose `I` already ran (the second half).
- `OVERLAP`: a forward and a backward (`B` or `I`) of two different (stage,
  microbatch) pairs on one rank that run at the same time, so that the
  communication inside one layer of either (an expert-parallel all-to-all, a
  tensor-parallel all-reduce) is hidden behind the other's compute, as
  DeepSeek-V3's DualPipe pairs them. Written `0F5+3B2`; `Action.pair` holds the
  two, `Action.parts` the actions a program checks and simulates it as (the
  forward first). Its stage and microbatch are the forward's.

A (stage, microbatch) has one `F` and either one `B`, or one `I` and one `W`,
standing alone or as a part of an `OVERLAP`.
Communication kinds are named after the LOCAL stage of the rank that runs them:

- `SEND_F(s, m)`: send F(s, m)'s output to the rank of stage s+1;
- `RECV_F(s, m)`: receive F(s, m)'s input from the rank of stage s-1;
- `SEND_B(s, m)`: send the input grad of B or I(s, m) to the rank of stage s-1;
- `RECV_B(s, m)`: receive the grad of F(s, m)'s output from stage s+1.

A `Schedule` (`pipekit.schedules.program`) is a whole program of these
actions, validated when it is made.

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ScheduleError(ValueError):
    """Every bad-input error raised by `pipekit.schedules`."""


class Kind(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - torch's letter for the input-grad backward
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OVERLAP = "OVERLAP"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
INPUT_GRAD_KINDS = frozenset({Kind.B, Kind.I})  # produce the grad sent to the previous stage
WEIGHT_GRAD_KINDS = frozenset({Kind.B, Kind.W})  # accumulate parameter grads and free the activation

# Longest kinds first so "SEND_F" is not read as a shorter kind followed by garbage.
_KIND_ALTERNATION = "|".join(sorted((k.value for k in Kind if k is not Kind.OVERLAP), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KIND_ALTERNATION})(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one rank: `stage` is the global virtual stage index. An `OVERLAP`
    (made by `Action.overlap`) also holds its forward and backward in `pair`."""

    stage: int
    kind: Kind
    microbatch: int
    pair: tuple[Action, Action] | None = None

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                valid = ", ".join(k.value for k in Kind)
                raise ScheduleError(f"unknown action kind {self.kind!r}; valid kinds: {valid}") from None
        if (self.kind is Kind.OVERLAP) != (self.pair is not None):
            raise ScheduleError("an OVERLAP action is made by Action.overlap(forward, backward), and only it "
                                f"holds a pair; got kind {self.kind.value} with pair={self.pair!r}")

    @classmethod
    def overlap(cls, forward: Action, backward: Action) -> Action:
        """`forward` (an F) and `backward` (a B or I of another stage or microbatch) run at once."""
        if forward.kind is not Kind.F or backward.kind not in INPUT_GRAD_KINDS:
            raise ScheduleError(f"an overlap pairs a forward (F) with a backward (B or I), got {forward} and "
                                f"{backward}")
        if (forward.stage, forward.microbatch) == (backward.stage, backward.microbatch):
            raise ScheduleError(f"{forward} and {backward} cannot overlap: a backward needs its own forward done")
        return cls(forward.stage, Kind.OVERLAP, forward.microbatch, (forward, backward))

    @property
    def parts(self) -> tuple[Action, ...]:
        """The plain actions this one stands for: its pair, or itself."""
        return self.pair if self.pair is not None else (self,)

    def __str__(self) -> str:
        if self.pair is not None:
            return f"{self.pair[0]}+{self.pair[1]}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str`: "0F1" -> Action(0, Kind.F, 1); "2RECV_B5" likewise; "0F5+3B2" (or
        "3B2+0F5") -> Action.overlap of the two."""
        if isinstance(text, str) and "+" in text:
            first, _, second = text.strip().partition("+")
            a, b = cls.parse(first), cls.parse(second)
            return cls.overlap(*((b, a) if b.kind is Kind.F else (a, b)))
        match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None and isinstance(text, str) and re.match(r"^\d+BW\d+$", text.strip()):
            full = text.strip().replace("BW", "B")
            raise ScheduleError(f"cannot parse action {text!r}: the full backward is 'B' ('{full}'); "
                                "a split backward is 'I' (input grad) then 'W' (weight grads)")
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> such as "
                f"'0F1' or '2RECV_B5', kind one of {', '.join(k.value for k in Kind)}"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


def message_stages(action: Action) -> tuple[int, int]:
    """(source stage, destination stage) of a SEND/RECV action's message."""
    s = action.stage
    return {
        Kind.SEND_F: (s, s + 1),
        Kind.RECV_F: (s - 1, s),
        Kind.SEND_B: (s, s - 1),
        Kind.RECV_B: (s + 1, s),
    }[action.kind]


def matching_send(recv: Action) -> Action:
    """The SEND on the peer rank that delivers what `recv` receives."""
    if recv.kind is Kind.RECV_F:
        return Action(recv.stage - 1, Kind.SEND_F, recv.microbatch)
    if recv.kind is Kind.RECV_B:
        return Action(recv.stage + 1, Kind.SEND_B, recv.microbatch)
    raise ScheduleError(f"{recv} is not a receive")


def matching_recv(send: Action) -> Action:
    """The RECV on the peer rank that consumes what `send` sends."""
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    if send.kind is Kind.SEND_B:
        return Action(send.stage - 1, Kind.RECV_B, send.microbatch)
    raise ScheduleError(f"{send} is not a send")


def format_actions(actions) -> str:
    """Space-separated text form of an action list, as used in tests and errors."""
    return " ".join(str(a) for a in actions)
