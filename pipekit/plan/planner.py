"""The planner behind `pipekit plan CONFIG`: predict a training step of a config for
every schedule, partition and microbatch count, and recommend one.

How a prediction is made
------------------------
1. **Layer costs** come from `pipekit.plan.profiler`: each layer timed in this
   process (or on two CPU ranks side by side), or counted in FLOPs, with the
   bytes it saves for backward and sends on.
2. **Stages.** A partition sums layer costs into virtual-stage costs.
3. **Timeline.** `pipekit.schedules.simulate` walks the schedule's program (its
   SEND/RECV actions too) with those stage costs, a fixed engine overhead per
   action, and a message latency `latency + bytes / bandwidth`
   (`pipekit.plan.profiler.measure_comm`: a gloo ping-pong between two processes).
4. **The step.** After its last action each rank waits at the step's collectives
   (gradient norm, loss), so the step ends at the slowest rank's last action plus
   those collectives plus the slowest rank's optimizer step (timed on the real
   optimizer, shared out by parameters).
5. **Memory per rank** is not predicted here: `pipekit.plan.memory` counts it, for the
   candidate table (`run_memory`, at the run's own settings) and the memory plan alike.
   `profile_boundaries` with a budget keeps its own estimate from the layer costs it is
   given: weights and optimizer state, plus the activations in flight, walking the
   rank's actions: a stage's microbatch holds its saved activations from its `F` until
   its `B` or `W`.

Not modelled: tensor parallelism's collectives (a tp>1 config is profiled at
tp=1 and its compute divided by tp), data-parallel gradient reductions beyond
one latency per collective, contention between ranks sharing cores or a link,
GPU kernel overlap, and the allocator's fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ..config import Run, partition_boundaries
from ..models import model_specs
from ..partition import check_boundaries, partition, partition_weights
from ..schedules import SCHEDULES, Action, Kind, Schedule, ScheduleError, build_schedule, simulate
from ..schedules.generators import get_generator
from ..schedules.ir import WEIGHT_GRAD_KINDS
from ..schedules.simulate import overlap_duration
from .profiler import KINDS, CommModel, LayerCost, Profile


@dataclass
class Candidate:
    """One (schedule, microbatches, partition) and what the model predicts for it."""

    schedule: str
    chunks_per_rank: int
    microbatches: int
    micro_batch: int
    partition: str
    boundaries: list[int]
    step_seconds: float
    makespan: float
    bubble_fraction: float
    tail_seconds: float
    timeline: list = field(default_factory=list, repr=False)
    same_as: list[str] = field(default_factory=list)  # other partition methods that cut the same way

    def overrides(self) -> list[str]:
        """`pipekit train` overrides that run this candidate (a profiled partition as its
        boundaries, so the run cuts where the plan did)."""
        cut = ",".join(map(str, self.boundaries)) if self.partition == "profile" else self.partition
        return [f"schedule.name={self.schedule}", f"schedule.chunks_per_rank={self.chunks_per_rank}",
                f"schedule.microbatches={self.microbatches}", f"train.micro_batch={self.micro_batch}",
                f"schedule.partition={cut}"]


# ---- prediction ----------------------------------------------------------------
def stage_costs(layers: list[LayerCost], boundaries: list[int]) -> list[LayerCost]:
    """Each virtual stage's summed cost; its output is its last layer's. The first stage's
    input (token ids) takes no gradient, so its split backward leaves everything to W:
    I = 0, W = B."""
    out = []
    for s, (lo, hi) in enumerate(zip(boundaries, boundaries[1:])):
        part = layers[lo:hi]
        seconds = {k: sum(getattr(c, k) for c in part) for k in KINDS}
        cost = LayerCost(f"stage {s}", sum(c.params for c in part), **seconds,
                         saved_bytes=sum(c.saved_bytes for c in part), out_bytes=part[-1].out_bytes,
                         frozen=sum(c.frozen for c in part))
        out.append(replace(cost, I=0.0, W=cost.B) if s == 0 else cost)
    return out


def activation_peaks(schedule: Schedule, saved: list[int]) -> list[int]:
    """Per rank, the most activation bytes held at once walking its actions: a (stage,
    microbatch) holds `saved[stage]` from its F to its B or W."""
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for a in (part for whole in actions for part in whole.parts):
            if a.kind is Kind.F:
                held += saved[a.stage]
                peak = max(peak, held)
            elif a.kind in WEIGHT_GRAD_KINDS:
                held -= saved[a.stage]
        peaks.append(peak)
    return peaks


def state_bytes(params: int, run: Run, frozen: int = 0) -> int:
    """Weights, gradients, master weights and optimizer moments of `params` trained parameters
    on one rank, in the run's precision policy's dtypes, with ZeRO's sharding over dp, and the
    weights alone of `frozen` ones (the optimizer never sees them). Weights count whole, at
    ZeRO-3 too: a balance between stages, not the memory plan (`pipekit.plan.memory`).
    ZeRO shards over dp x cp (`Run.zero_shards`)."""
    o, dp, policy = run.config.optimizer, run.zero_shards, run.precision
    width = policy.param_dtype.itemsize
    state = policy.master_dtype.itemsize
    moments = (2 if o.name == "adamw" else (1 if o.momentum else 0)) * state
    master = state if policy.mixed else 0  # fp32: the parameters are their own master copy
    grads = width
    sharded = (master + moments) + (grads if o.zero_stage >= 2 else 0)
    kept = width + (0 if o.zero_stage >= 2 else grads)
    return round(params * (kept + sharded / (dp if o.zero_stage >= 1 else 1)) + frozen * width)


def predict(schedule: Schedule, layers: list[LayerCost], boundaries: list[int], comm: CommModel,
            optimizer_seconds_per_param: float) -> dict:
    """The predicted step of `schedule` with these layer costs cut at `boundaries` (its time;
    its memory is `pipekit.plan.memory`'s)."""
    stages = stage_costs(layers, boundaries)
    over = comm.action_overhead

    def duration(a: Action) -> float:
        if a.pair is not None:  # the layers' communication is not measured: nothing is hidden
            f, b = a.pair
            return overlap_duration(stages[f.stage].F, getattr(stages[b.stage], b.kind.value)) + over
        if a.is_compute:
            return getattr(stages[a.stage], a.kind.value) + over
        if a.kind is Kind.SEND_F:
            return over + comm.send_overhead + comm.send_per_byte * stages[a.stage].out_bytes
        if a.kind is Kind.SEND_B:
            return over + comm.send_overhead + comm.send_per_byte * stages[a.stage - 1].out_bytes
        return over

    def latency(recv: Action) -> float:
        sender = recv.stage - 1 if recv.kind is Kind.RECV_F else recv.stage + 1
        return comm.message(stages[min(recv.stage, sender)].out_bytes)

    sim = simulate(schedule, duration=duration, comm_latency=latency)
    ends = [max((e.end for e in sim.timeline if e.rank == r), default=0.0) for r in range(schedule.pp)]
    params = [sum(stages[s].params for s in schedule.local_stages(r)) for r in range(schedule.pp)]
    optimizer = max(params) * optimizer_seconds_per_param
    # pipekit train's per step, over the pipeline ranks: the gradient norm, the loss, the stop-request check
    collectives = 3 if schedule.pp > 1 else 0
    tail = collectives * comm.collective + optimizer
    return {"step": max(ends) + tail, "makespan": sim.makespan, "bubble": sim.bubble_fraction, "tail": tail,
            "timeline": sim.timeline}


# ---- partitions ----------------------------------------------------------------
def profile_boundaries(layers: list[LayerCost], num_stages: int, *, budget: float | None = None,
                       schedule: Schedule | None = None, run: Run | None = None,
                       optimizer_seconds_per_param: float = 0.0) -> list[int]:
    """Contiguous stages balancing the measured time of `layers`: F + B per microbatch, plus
    (given the rate) each layer's share of the optimizer step spread over the schedule's
    microbatches.

    Without a `budget` the heaviest stage is minimised exactly (`partition_weights`).
    With one (bytes per rank), the heaviest stage is minimised among partitions whose
    every stage fits: weights and optimizer state plus its activations in flight
    (the most microbatches `schedule` keeps between a stage's F and its B or W); a
    rank's budget is shared evenly by its virtual stages. ValueError when none fits.
    """
    per_step = optimizer_seconds_per_param / (schedule.microbatches if schedule is not None else 1)
    times = [c.F + c.B + c.params * per_step for c in layers]
    if budget is None:
        return partition_weights(times, num_stages)
    if schedule is None or run is None:
        raise ValueError("a memory budget needs the schedule and the run (activations in flight, optimizer state)")
    inflight = _inflight_per_stage(schedule)
    share = budget / schedule.chunks_per_rank
    n = len(layers)
    prefix_t = [0.0]
    prefix_p, prefix_f, prefix_a = [0], [0], [0]
    for c, t in zip(layers, times):
        prefix_t.append(prefix_t[-1] + t)
        prefix_p.append(prefix_p[-1] + c.params)
        prefix_f.append(prefix_f[-1] + c.frozen)
        prefix_a.append(prefix_a[-1] + c.saved_bytes)

    def fits(s, lo, hi):
        state = state_bytes(prefix_p[hi] - prefix_p[lo], run, prefix_f[hi] - prefix_f[lo])
        return state + inflight[s] * (prefix_a[hi] - prefix_a[lo]) <= share

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for hi in range(s, n - (num_stages - s) + 1):
            for lo in range(s - 1, hi):
                if best[s - 1][lo] == inf or not fits(s - 1, lo, hi):
                    continue
                value = max(best[s - 1][lo], prefix_t[hi] - prefix_t[lo])
                if value < best[s][hi]:
                    best[s][hi], cut[s][hi] = value, lo
    if best[num_stages][n] == inf:
        raise ValueError(f"no partition of the {n} layers into {num_stages} stages fits a memory budget of "
                         f"{budget / 2**30:.3g} GiB per rank; raise the budget, use more pipeline ranks, "
                         "or checkpoint activations")
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def _inflight_per_stage(schedule: Schedule) -> list[int]:
    """The most microbatches of each stage held between F and B/W at once."""
    peak = [0] * schedule.num_stages
    for actions in schedule.ranks:
        live = [0] * schedule.num_stages
        for a in (part for whole in actions for part in whole.parts):
            if a.kind is Kind.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind in WEIGHT_GRAD_KINDS:
                live[a.stage] -= 1
    return peak


def boundaries_for(method: str, run: Run, layers: list[LayerCost], schedule: Schedule,
                   budget: float | None = None, optimizer_seconds_per_param: float = 0.0) -> list[int]:
    """Boundaries of `method` ("profile" or any `pipekit.partition` method) over the schedule's stages."""
    if method == "profile":
        return profile_boundaries(layers, schedule.num_stages, budget=budget, schedule=schedule, run=run,
                                  optimizer_seconds_per_param=optimizer_seconds_per_param)
    explicit = partition_boundaries(method)
    if explicit is not None:
        return check_boundaries(explicit, len(layers), schedule.num_stages)
    return partition(model_specs(run.model), schedule.num_stages, method)


# ---- the plan ------------------------------------------------------------------
def microbatch_options(run: Run) -> list[tuple[int, int]]:
    """(microbatches, micro_batch) pairs with the run's batch per dp replica."""
    rows = run.config.train.micro_batch * run.schedule.microbatches
    return [(m, rows // m) for m in range(1, rows + 1) if rows % m == 0]


def plan(run: Run, profile: Profile, comm: CommModel, *, schedules=None, partitions=None,
         microbatches=None) -> list[Candidate]:
    """Every candidate the config allows, fastest predicted step first. What each holds per
    rank is `pipekit.plan.memory`'s to count (`run_memory`, `memory_plan`)."""
    pp = run.pp
    names = list(schedules or SCHEDULES)
    parts = list(partitions or dict.fromkeys(["profile", "parameters", "uniform", run.config.schedule.partition]))
    options = microbatch_options(run)
    if microbatches:
        options = [(m, r) for m, r in options if m in set(microbatches)]
    out = []
    tp = run.tp
    for m, rows in options:
        layers = [replace(c, **{k: getattr(c, k) / tp for k in KINDS}) for c in profile.at(rows)]
        for name, chunks in _schedule_options(names, run):
            try:
                schedule = build_schedule(name, pp, m, chunks)
            except ScheduleError:
                continue  # this schedule does not run this (pp, microbatches)
            if schedule.num_stages > len(layers):
                continue
            seen: dict[tuple, Candidate] = {}
            for method in parts:
                try:
                    bounds = boundaries_for(method, run, layers, schedule, None, profile.optimizer_seconds_per_param)
                except ValueError:
                    continue
                if tuple(bounds) in seen:
                    seen[tuple(bounds)].same_as.append(method)
                    continue
                p = predict(schedule, layers, bounds, comm, profile.optimizer_seconds_per_param)
                out.append(Candidate(name, schedule.chunks_per_rank, m, rows, method, bounds, p["step"],
                                     p["makespan"], p["bubble"], p["tail"], p["timeline"]))
                seen[tuple(bounds)] = out[-1]
    out.sort(key=lambda c: c.step_seconds)
    return out


def _schedule_options(names, run: Run) -> list[tuple[str, int | None]]:
    """(schedule, chunks per rank) pairs: a schedule's own chunk count, or for one that
    takes any (interleaved_1f1b), 2 and the run's."""
    out: list[tuple[str, int | None]] = []
    for name in names:
        if get_generator(name).chunks_per_rank is not None:
            out.append((name, None))
            continue
        mine = run.schedule.chunks_per_rank if name == run.schedule.name else None
        out += [(name, k) for k in sorted({2, *([mine] if mine and mine > 1 else [])})]
    return out


def candidate_record(c: Candidate, tokens_per_row: int, memory_bytes: list[float] | None = None) -> dict:
    """A JSON-able summary of a candidate; `memory_bytes`: its bytes per pipeline rank
    (`pipekit.plan.memory.run_memory`)."""
    rec = {k: v for k, v in asdict(c).items() if k != "timeline"}
    rec["tokens_per_second"] = c.micro_batch * c.microbatches * tokens_per_row / c.step_seconds
    if memory_bytes is not None:
        rec["memory_bytes"] = memory_bytes
    return rec


# ---- the report ------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def layer_table(profile: Profile) -> str:
    """The profiled layers (the loss folded into the last), at the profiled rows."""
    layers = profile.at(profile.rows)
    frozen = any(c.frozen for c in layers)  # fine-tuning: trained and frozen parameters apart
    rows = [["layer", "name", "params", *(["frozen"] if frozen else []), "F ms", "B ms", "I ms", "W ms",
             "saved MiB"]]
    for i, c in enumerate(layers):
        rows.append([str(i), c.name, f"{c.params:,}", *([f"{c.frozen:,}"] if frozen else []),
                     *(_ms(getattr(c, k)) for k in KINDS), _mib(c.saved_bytes)])
    return _table(rows)


def candidate_table(candidates: list[Candidate], tokens_per_row: int, top: int,
                    memory: list[list[float]] | None = None) -> str:
    """The candidates, and with `memory` (each one's bytes per pipeline rank,
    `pipekit.plan.memory.run_memory`) the worst rank's total, in GiB as the memory plan prints it."""
    rows = [["schedule", "chunks", "microbatches", "x rows", "partition", "boundaries", "step ms", "tokens/s",
             "bubble", *(["peak GiB/rank"] if memory is not None else [])]]
    for i, c in enumerate(candidates[:top]):
        tps = c.micro_batch * c.microbatches * tokens_per_row / c.step_seconds
        rows.append([c.schedule, str(c.chunks_per_rank), str(c.microbatches), str(c.micro_batch),
                     "=".join([c.partition, *c.same_as]),
                     ",".join(map(str, c.boundaries)), _ms(c.step_seconds), f"{tps:,.0f}",
                     f"{c.bubble_fraction:.3f}", *([_gib(max(memory[i]))] if memory is not None else [])])
    return _table(rows)
