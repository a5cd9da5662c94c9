"""Schedule generators: pure functions of ints returning compute actions per rank.

Each generator returns `list[list[Action]]`, one list per pipeline rank, with
compute actions only; `lower` adds the SEND/RECV actions afterwards. GPipe,
1F1B and interleaved 1F1B run full backwards (`B`); ZB-H1, ZBV and DualPipe-V
split some or all of them into an input-grad `I` and a later weight-grad `W`.

Generators live in a registry under their names (`SCHEDULES`, a read-only
view that always lists every registered name); `register_schedule` adds one
of your own, with the placement of virtual stages it is written for.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from .ir import Action, Kind, ScheduleError
from .placement import PLACEMENTS, check_placement, check_positive


def _f(stage: int, mb: int) -> Action:
    return Action(stage, Kind.F, mb)


def _b(stage: int, mb: int) -> Action:
    return Action(stage, Kind.B, mb)


def gpipe(pp: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every rank runs all forwards, then all backwards, in microbatch order.

    Peak live activations per rank equal `microbatches`.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    mbs = range(microbatches)
    return [[_f(r, m) for m in mbs] + [_b(r, m) for m in mbs] for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): warmup forwards, then alternate F and B, then cooldown Bs.

    Rank r runs min(pp-1-r, m) warmup forwards, so it never holds more than
    min(m, pp-r) live activations. Defined for any m >= 1.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    return [_one_f_one_b_rank(r, pp, microbatches) for r in range(pp)]


def _one_f_one_b_rank(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - 1 - rank, m)
    return _warmup_steady_cooldown(
        [_f(rank, k) for k in range(m)], [_b(rank, k) for k in range(m)], warmup
    )


def _warmup_steady_cooldown(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then pairs (next F, next B), then the remaining Bs."""
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


def interleaved_1f1b(pp: int, microbatches: int, chunks_per_rank: int) -> list[list[Action]]:
    """Megatron-style interleaved 1F1B over `chunks_per_rank` (v) chunks per rank.

    Rank r hosts virtual stages c*pp + r for c in 0..v-1. Microbatches go in
    groups of pp: the k-th forward on a rank is chunk (k // pp) % v of
    microbatch (k // (pp*v))*pp + k % pp; the k-th backward is the same with
    the chunk reversed. Warmup is min(2*(pp-r-1) + (v-1)*pp, m*v) forwards for
    v > 1; for v == 1 it is 1F1B's pp-r-1, so the order equals `one_f_one_b`.

    Limits: needs microbatches >= pp and a multiple of pp.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    check_positive("chunks_per_rank", chunks_per_rank)
    _check_interleaved_microbatches(pp, microbatches)
    return [_interleaved_rank(r, pp, microbatches, chunks_per_rank) for r in range(pp)]


def _check_interleaved_microbatches(pp: int, m: int) -> None:
    if m < pp:
        raise ScheduleError(f"interleaved_1f1b needs at least pp={pp} microbatches, got {m}")
    if m % pp:
        lower, upper = (m // pp) * pp, (m // pp + 1) * pp
        raise ScheduleError(
            f"interleaved_1f1b needs the microbatch count to be a multiple of pp={pp}, "
            f"got {m}; try {lower} or {upper}"
        )


def _interleaved_rank(rank: int, pp: int, m: int, v: int) -> list[Action]:
    total = m * v
    forwards, backwards = [], []
    for k in range(total):
        chunk, mb = (k // pp) % v, (k // (pp * v)) * pp + k % pp
        forwards.append(_f(chunk * pp + rank, mb))
        backwards.append(_b((v - 1 - chunk) * pp + rank, mb))
    if v == 1:
        warmup = min(pp - 1 - rank, total)
    else:
        warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    return _warmup_steady_cooldown(forwards, backwards, warmup)


# ---------------------------------------------------------------- split backward


def _with_weight_grads(actions: list[Action], lag: int) -> list[Action]:
    """`actions` with W(s, m) inserted `lag` input-grad actions after each I(s, m), and
    the Ws still pending after the last I appended in order."""
    out: list[Action] = []
    pending: deque[Action] = deque()
    seen = 0
    for a in actions:
        out.append(a)
        if a.kind is Kind.I:
            pending.append(Action(a.stage, Kind.W, a.microbatch))
            seen += 1
            if seen > lag:
                out.append(pending.popleft())
    return out + list(pending)


def zb_h1(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", the H1 schedule).

    1F1B with the backward split: rank r runs 1F1B's order with I for B, and
    each W(m) r input-grads after its I(m), the rest after the last I. Rank
    r holds at most pp microbatches (1F1B: pp - r), the same peak as 1F1B's
    rank 0. Under F = I = W = 1 the step takes 3m + pp - 1 for m >= pp
    (1F1B: 3m + 3(pp - 1)): the bubble is a third of 1F1B's.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    return [_zb_h1_rank(r, pp, microbatches) for r in range(pp)]


def _zb_h1_rank(rank: int, pp: int, m: int) -> list[Action]:
    order = _warmup_steady_cooldown(
        [_f(rank, k) for k in range(m)], [Action(rank, Kind.I, k) for k in range(m)], min(pp - 1 - rank, m)
    )
    return _with_weight_grads(order, lag=rank)


class _Emitter:
    """One rank's action list, numbering each stage's forwards and backwards in order;
    a split backward (`i`) leaves its W pending until `w` takes it."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        # (stage, "F" or "backward") -> next microbatch
        self.count: defaultdict[tuple[int, str], int] = defaultdict(int)
        self.pending: deque[Action] = deque()

    def f(self, stage: int) -> _Emitter:
        return self._emit(Kind.F, stage, "F")

    def b(self, stage: int) -> _Emitter:
        return self._emit(Kind.B, stage, "backward")

    def i(self, stage: int) -> _Emitter:
        self._emit(Kind.I, stage, "backward")
        self.pending.append(Action(stage, Kind.W, self.actions[-1].microbatch))
        return self

    def w(self, stage: int | None = None) -> _Emitter:
        """The oldest pending W (of `stage`, when given); nothing when none is pending."""
        for k, a in enumerate(self.pending):
            if stage is None or a.stage == stage:
                del self.pending[k]
                self.actions.append(a)
                break
        return self

    def forwards(self, stage: int) -> int:
        return self.count[(stage, "F")]

    def _emit(self, kind: Kind, stage: int, counter: str) -> _Emitter:
        self.actions.append(Action(stage, kind, self.count[(stage, counter)]))
        self.count[(stage, counter)] += 1
        return self


def zbv(pp: int, microbatches: int) -> list[list[Action]]:
    """ZBV (Qi et al., the zero-bubble V schedule): two chunks per rank on the V
    placement, rank r holding stages r and 2pp-1-r, every backward split.

    Rank r: 2(pp-r)-1 forwards of its first chunk; r pairs (F up, F down); pp-r
    triples (F, I, W) of its second chunk; then (F, I, W) of each chunk in
    turn until all forwards are done; r pairs (I down, I up); pp-r pairs
    (I, W) of the first chunk; the remaining Ws. Written for at least 2pp-1
    microbatches; fewer are that order with the extra microbatches left out.
    Under F = I = W = 1 per chunk, a rank's work is 6m and the step takes
    6m + pp - 1 for m >= 2pp - 1: only the unavoidable wait for the first
    activation to reach the last rank (1F1B on the same model, a stage
    being two chunks: 6m + 6(pp - 1)). Each rank holds at most 2pp chunk
    activations, as much as 1F1B's rank 0 holds.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    return [_zbv_rank(r, pp, microbatches) for r in range(pp)]


def _zbv_rank(rank: int, pp: int, m: int) -> list[Action]:
    n = max(m, 2 * pp - 1)
    down, up = rank, 2 * pp - 1 - rank
    e = _Emitter()
    for _ in range(2 * (pp - rank) - 1):
        e.f(down)
    for _ in range(rank):
        e.f(up).f(down)
    for _ in range(pp - rank):
        e.f(up).i(up).w(up)
    while e.forwards(up) < e.forwards(down) or e.forwards(down) < n:
        if e.forwards(down) < n:
            e.f(down)
        e.i(down).w(down).f(up).i(up).w(up)
    for _ in range(rank):
        e.i(down).i(up)
    for _ in range(pp - rank):
        e.i(down).w(down)
    for stage in (up, down):
        while any(a.stage == stage for a in e.pending):
            e.w(stage)
    return [a for a in e.actions if a.microbatch < m]


def dualpipe_v(pp: int, microbatches: int) -> list[list[Action]]:
    """DualPipe-V (DeepSeek-V3's DualPipe folded onto the V placement, as in
    deepseek-ai/DualPipe and torch's ScheduleDualPipeV). Its steady state puts a forward
    of one chunk next to a backward of the other; `build_schedule(..., overlap=True)`
    makes each such neighbour pair one OVERLAP action, run at once.

    Rank r holds stages r and 2pp-1-r. Full backwards in the steady state; the
    cooldown splits backwards so that their Ws fill its gaps. Needs
    microbatches >= 2pp.
    """
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    if microbatches < 2 * pp:
        raise ScheduleError(f"dualpipe_v needs at least 2*pp={2 * pp} microbatches, got {microbatches}")
    return [_dualpipe_v_rank(r, pp, microbatches) for r in range(pp)]


def _dualpipe_v_rank(rank: int, pp: int, m: int) -> list[Action]:
    down, up = rank, 2 * pp - 1 - rank
    e = _Emitter()
    for _ in range(2 * (pp - rank - 1)):
        e.f(down)
    for _ in range(rank + 1):
        e.f(down).f(up)
    for _ in range(pp - rank - 1):
        e.i(up).w().f(up)
    for _ in range(m - 2 * pp + rank + 1):
        e.f(down).b(up).f(up).b(down)
    for _ in range(pp - rank - 1):
        e.b(up).f(up).b(down)
    split = False
    for k in range(rank + 1):  # from the middle on, backwards split so that their Ws fill the gaps
        split |= k == (rank + 1) // 2 and rank % 2 == 1
        (e.i if split else e.b)(up)
        split |= k == (rank + 1) // 2 and rank % 2 == 0
        (e.i if split else e.b)(down)
    for _ in range(pp - rank - 1):
        e.w()
        (e.i if split else e.b)(down)
    while e.pending:
        e.w()
    return e.actions


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Generator:
    """A registered schedule: `fn(pp, microbatches)` (or, when `chunks_per_rank` is
    None, `fn(pp, microbatches, chunks_per_rank)`) returns each rank's compute actions,
    or a full program with its SEND/RECV actions; `placement` is a name in PLACEMENTS
    or `fn(pp, chunks_per_rank) -> tuple of ranks`."""

    name: str
    fn: Callable
    placement: str | Callable = "looping"
    chunks_per_rank: int | None = 1  # None: any number, passed to fn
    min_chunks: int = 1  # with chunks_per_rank None: the fewest it takes, and the default

    def chunks(self, chunks_per_rank: int | None) -> int:
        """The chunk count to build with, after checking the one asked for."""
        if chunks_per_rank is None:
            return self.chunks_per_rank or self.min_chunks
        check_positive("chunks_per_rank", chunks_per_rank)
        if chunks_per_rank < self.min_chunks:
            raise ScheduleError(
                f"{self.name} needs at least {self.min_chunks} virtual stages per rank, got chunks_per_rank="
                f"{chunks_per_rank} (with one it is plain 1F1B: name '1f1b' for that); build the module with "
                f"PipelineModule(..., schedule={self.name!r}, chunks_per_rank={self.min_chunks})"
            )
        if self.chunks_per_rank is not None and chunks_per_rank != self.chunks_per_rank:
            k = self.chunks_per_rank
            fits = [g.name for g in _REGISTRY.values() if g.chunks_per_rank in (None, chunks_per_rank)]
            takes = f"only {', '.join(fits)} take{'s' if len(fits) == 1 else ''}" if fits else "no schedule takes"
            raise ScheduleError(
                f"{self.name} runs {k} chunk{'s' if k > 1 else ''} per rank, got chunks_per_rank={chunks_per_rank}; "
                f"{takes} chunks_per_rank={chunks_per_rank}"
            )
        return chunks_per_rank

    def place(self, pp: int, chunks_per_rank: int) -> tuple[int, ...]:
        make = PLACEMENTS[self.placement] if isinstance(self.placement, str) else self.placement
        return check_placement(make(pp, chunks_per_rank), pp, chunks_per_rank)

    def generate(self, pp: int, microbatches: int, chunks_per_rank: int) -> list[list[Action]]:
        if self.chunks_per_rank is None:
            return self.fn(pp, microbatches, chunks_per_rank)
        return self.fn(pp, microbatches)


_REGISTRY: dict[str, Generator] = {}
SCHEDULES = MappingProxyType(_REGISTRY)  # name -> Generator; `in`, iteration and list() give the names


def register_schedule(name: str, fn: Callable, *, placement: str | Callable = "looping",
                      chunks_per_rank: int | None = 1, min_chunks: int = 1, replace: bool = False) -> Generator:
    """Register generator `fn` under `name`, so `build_schedule(name, ...)`, the engine
    (`schedule=name`), `pipekit plan --schedule name` and configs find it.

    `fn(pp, microbatches)` returns one list of actions per rank: compute actions
    (`lower` adds the messages) or a whole program. With `chunks_per_rank=None` the
    schedule takes any chunk count and is called as `fn(pp, microbatches, chunks)`.
    `placement`: "looping", "v", or `fn(pp, chunks_per_rank)` giving the rank of each
    virtual stage. `min_chunks` (with `chunks_per_rank=None`): the fewest chunks the
    schedule takes, and what it builds with when none is asked for. Every schedule
    built from it is validated."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ScheduleError(f"a schedule name must be a non-empty string without spaces, got {name!r}")
    if not callable(fn):
        raise ScheduleError(f"schedule {name!r}: the generator must be callable, got {fn!r}")
    if isinstance(placement, str) and placement not in PLACEMENTS:
        raise ScheduleError(f"schedule {name!r}: unknown placement {placement!r}; choose one of: "
                            f"{', '.join(PLACEMENTS)}, or pass a function (pp, chunks_per_rank) -> ranks")
    if chunks_per_rank is not None:
        check_positive("chunks_per_rank", chunks_per_rank)
    check_positive("min_chunks", min_chunks)
    if name in _REGISTRY and not replace:
        raise ScheduleError(f"a schedule named {name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[name] = Generator(name, fn, placement, chunks_per_rank, min_chunks)
    return _REGISTRY[name]


def get_generator(name: str) -> Generator:
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def generate(name: str, pp: int, microbatches: int, chunks_per_rank: int | None = None) -> list[list[Action]]:
    """Actions per rank for schedule `name` (one of SCHEDULES); chunks_per_rank None: its own."""
    generator = get_generator(name)
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    return generator.generate(pp, microbatches, generator.chunks(chunks_per_rank))


register_schedule("gpipe", gpipe)
register_schedule("1f1b", one_f_one_b)
register_schedule("interleaved_1f1b", interleaved_1f1b, chunks_per_rank=None, min_chunks=2)  # 1 chunk: 1f1b
register_schedule("zb_h1", zb_h1)
register_schedule("zbv", zbv, placement="v", chunks_per_rank=2)
register_schedule("dualpipe_v", dualpipe_v, placement="v", chunks_per_rank=2)
