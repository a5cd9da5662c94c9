"""`Schedule`: a complete, validated pipeline program, one lowered action list per rank.

The one description of a pipeline program that the module (which stages live
here), the engine (what runs in what order), the simulator and the pictures
read. It stands above the IR's pieces: making one runs `validate`, and its
eval program is `lower`ed from its forwards. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Action, Kind, ScheduleError
from .lowering import lower
from .validate import validate


@dataclass(frozen=True)
class Schedule:
    """A complete, validated pipeline program: one action list per rank.

    `placement[s]` is the rank hosting virtual stage s; `ranks[r]` is rank r's
    lowered list (compute plus SEND/RECV) in execution order. Making one runs
    `validate`, so a `Schedule` that exists is runnable: the module reads which
    stages live where from it, the engine runs it, the simulator and the
    pictures draw it. Build one with `build_schedule` (a registered generator)
    or `schedule_from_table` (a hand-written action table).
    """

    name: str
    pp: int
    chunks_per_rank: int
    microbatches: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    backward: bool = True  # False: an eval program of forwards only (see `forward_only`)

    def __post_init__(self):
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        if len(self.ranks) != self.pp or len(self.placement) != self.pp * self.chunks_per_rank:
            raise ScheduleError(
                f"schedule {self.name!r}: pp={self.pp} and chunks_per_rank={self.chunks_per_rank} need "
                f"{self.pp} action lists and {self.pp * self.chunks_per_rank} placed stages, got "
                f"{len(self.ranks)} and {len(self.placement)}"
            )
        validate(self.ranks, self.placement, self.microbatches, backward=self.backward)

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    def stage_rank(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} out of range: this schedule has stages 0..{self.num_stages - 1}")
        return self.placement[stage]

    def local_stages(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return [s for s, r in enumerate(self.placement) if r == rank]

    def compute_actions(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        return [a for a in self.ranks[rank] if a.is_compute]

    def forward_only(self) -> Schedule:
        """The same forwards in the same order per rank, without backward: the eval program."""
        compute = [[part for a in self.compute_actions(r) for part in a.parts if part.kind is Kind.F]
                   for r in range(self.pp)]
        ranks = tuple(tuple(actions) for actions in lower(compute, self.placement))
        return Schedule(self.name, self.pp, self.chunks_per_rank, self.microbatches, self.placement,
                        ranks, backward=False)

    @property
    def overlaps(self) -> bool:
        """Whether any rank runs a forward and a backward at once (an OVERLAP action)."""
        return any(a.kind is Kind.OVERLAP for actions in self.ranks for a in actions)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.pp:
            raise ScheduleError(f"rank {rank} out of range: this schedule has ranks 0..{self.pp - 1}")
