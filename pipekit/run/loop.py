"""The training loop behind `pipekit train`: one worker's view.

`train(run)` takes a resolved `Run` (`pipekit.config.resolve`): every worker
builds the topology, its own stage(s) of the model for the run's schedule, the
optimizer (`pipekit.optim.factory`) and the engine; then runs `train.steps`
optimizer steps on its data-parallel share of each global batch (the same
global batches whatever the layout). Rank 0 reports through
`pipekit.run.metrics.Logger` (progress bar, metrics.jsonl, TensorBoard, summary
table), checkpoints are saved and resumed through `pipekit.run.resume`, and the
trained weights are written as a layout-free `model.pt` that `pipekit generate` and
`pipekit convert` read.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from .. import auxloss
from ..atomic import torch_save_atomic, write_atomic
from ..checkpoint import full_state_dict
from ..config import Config, Run, resolve
from ..data import BatchSampler, TokenDataset, default_corpus_dir
from ..data import read_meta as read_data_meta
from ..engine import PipelineEngine
from ..interchange import load_pretrained
from ..kernels import kernels
from ..layers.parallel import skip_init
from ..models import model_loss, model_specs, model_vocab, synthetic_batches
from ..optim import Skip
from ..optim.factory import lr_schedule, make_optimizer
from ..pipeline import PipelineModule
from ..plan.planner import profile_boundaries
from ..plan.profiler import finetune, profile_layers
from ..precision import default_dtype
from ..schedules import Schedule, TimelineEvent, mean_costs, render_png, simulate, to_chrome_trace
from ..topology import Topology, fell_back, init_alone, init_distributed, local_workers, resolve_device
from . import reports
from .curriculum import trimmed_batches, warmed_up
from .metrics import Logger, moe_summary
from .resume import checkpoint_root, clear_old_checkpoints, is_own, resume, save
from .terminal import detach_from_closed_terminal


# ---- building --------------------------------------------------------------
def build(run: Run, topo: Topology) -> PipelineEngine:
    """This rank's module (its stages of the run's schedule), optimizer, LR schedule and engine."""
    module = build_module(run, topo)
    prepare_weights(run, module)
    o = run.config.optimizer
    opt = make_optimizer(module, o, run.precision)
    sched = lr_schedule(opt, o, run.config.train.steps)
    # say=None: the Logger says a skipped step's line, with the run's step numbers
    return PipelineEngine(module, optimizer=opt, clip_grad_norm=o.clip_grad_norm, lr_scheduler=sched, say=None)


def build_module(run: Run, topo: Topology) -> PipelineModule:
    """This rank's module: its stages of the run's schedule. With model.init its weights are
    allocated, not drawn (`skip_init`): `prepare_weights` reads them all, and the draws'
    whole-tensor temporaries would outgrow this rank's shard."""
    s = run.config.schedule
    with skip_init() if run.config.model.init is not None else contextlib.nullcontext():
        return PipelineModule(
            model_specs(run.model),
            loss_fn=model_loss(run.model),
            topology=topo,
            partition=partition_of(run, topo.device),
            seed=run.config.train.seed,
            schedule=run.schedule,
            activation_checkpoint_interval=s.activation_checkpoint_interval,
            checkpoint_layers=s.checkpoint_layers,
            precision=run.precision,
            compile=run.config.train.compile,
        )


def prepare_weights(run: Run, module: PipelineModule) -> None:
    """The weights the run starts from, before the optimizer takes its master copies:
    model.init's (each rank reading its own), then the adapters (model.lora: every other
    weight frozen) and model.freeze (`finetune`: what the plan's model applies too)."""
    if run.config.model.init is not None:
        load_pretrained(module, run.config.model.init)
    finetune(run, module)


def partition_of(run: Run, device="cpu") -> str | list[int]:
    """The run's partition as PipelineModule takes it: a method name, or boundaries. "profile"
    times the layers once, on global rank 0 (every rank must cut the model alike, and
    timings differ between processes), and gives its boundaries to every rank."""
    if run.partition != "profile":
        return list(run.partition) if isinstance(run.partition, tuple) else run.partition
    found: list[list[int] | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        found = [profiled_boundaries(run, run.schedule, device)]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    boundaries = found[0]
    assert boundaries is not None  # rank 0 profiled; the broadcast gave every other rank its list
    return boundaries


def profiled_boundaries(run: Run, schedule: Schedule, device="cpu") -> list[int]:
    """Boundaries balancing the layers' measured times in this process (within
    schedule.memory_budget_gb when set): what partition=profile cuts at."""
    s, budget = run.config.schedule, None
    if s.memory_budget_gb:
        budget = s.memory_budget_gb * 2**30
    prof = profile_layers(run, threads=1 if run.world_size > 1 else None, device=str(device))
    return profile_boundaries(prof.at(run.config.train.micro_batch), schedule.num_stages, budget=budget,
                              schedule=schedule, run=run, optimizer_seconds_per_param=prof.optimizer_seconds_per_param)


# ---- data ------------------------------------------------------------------
def data_dir(cfg: Config) -> str | None:
    """The prepared dataset directory for `data.source` (None for synthetic data)."""
    if cfg.data.source == "synthetic":
        return None
    if cfg.data.source == "stdlib":
        return default_corpus_dir()
    return cfg.data.source


def batches(run: Run, topo: Topology, split: str = "train", path: str | None = None, start_step: int = 0):
    """This dp rank's (inputs, labels) batches from step `start_step` on: the same global
    batches in every layout, and after a resume. Without a dataset `path`: the toy task's
    synthetic batches over the model's vocabulary. With data.pack, rows of whole documents
    whose inputs are (tokens, positions) (`pipekit.data.BatchSampler`)."""
    t = run.config.train
    seed = t.seed if split == "train" else t.seed + 1
    if path is None:
        vocab = model_vocab(run.model)
        shard = run.global_batch // topo.data_dp  # a replica's rows (its cp ranks read the same rows)
        rows = slice(topo.data_rank * shard, (topo.data_rank + 1) * shard)
        stream = synthetic_batches(vocab, run.global_batch, t.seq_len, seed=seed)
        return ((x[rows], y[rows]) for x, y in itertools.islice(stream, start_step, None))
    ds = TokenDataset(path, split)
    return BatchSampler(ds, run.global_batch, t.seq_len, dp_rank=topo.data_rank, dp_size=topo.data_dp, seed=seed,
                        start_step=start_step, pack=run.config.data.pack)


def check_vocab(run: Run, path: str | None) -> None:
    """The dataset at `path` has no token id beyond the model's vocabulary."""
    if path is None:
        return
    meta = read_data_meta(path)
    vocab = model_vocab(run.model)
    if meta and meta["vocab_size"] > vocab:
        raise ValueError(
            f"the dataset in {path} has vocab_size {meta['vocab_size']} but model vocab_size={vocab}; "
            f"set model.vocab_size>={meta['vocab_size']}"
        )


# ---- the loop ----------------------------------------------------------------
def train(run: Run) -> dict:
    """Run the whole job on this worker; returns a summary (the same on every rank).
    `run` is resolved (a Config is resolved here first, for callers holding one)."""
    run = resolve(run)
    # both restored for an in-process caller:
    with default_dtype(getattr(torch, run.config.train.dtype)), kernels(run.config.model.kernels):
        return _train(run)


def _train(run: Run) -> dict:
    cfg = run.config
    topo, notice = _join(run)
    if topo.rank == 0:
        for line in run.notices:  # a Python caller's (the command says them before it launches)
            print(f"pipekit: notice: {line}", file=sys.stderr, flush=True)
    path = data_dir(cfg)
    check_vocab(run, path)
    engine = build(run, topo)
    start, resumed_from = resume(run, topo, engine)
    own = resumed_from is None or is_own(cfg, resumed_from)  # else: another run's checkpoint, a new run here
    if start == 0 or not own:
        clear_old_checkpoints(cfg, topo)
    if start == cfg.train.steps:
        if topo.rank == 0:
            print(f"the checkpoint is at train.steps={start}: nothing left to train (raise train.steps to go on)",
                  flush=True)
        save_weights(run, topo, engine, path)
        return {"steps": 0, "resumed_from": start}
    log = Logger(run, topo, engine, notice=notice, start_step=start, continues=own)
    summary = _steps(run, topo, engine, log, path, start, resumed_from)
    if "stopped_by" not in summary:
        save_weights(run, topo, engine, path)
    return summary


def _join(run: Run) -> tuple[Topology, str | None]:
    """This worker's place: its device, the process group (when there is more than one
    worker), the topology; and the notice to print when train.device=auto
    fell back to the CPU."""
    device, reason = resolve_device(run.config.train.device, local_workers(run.world_size))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or run.world_size > 1:
        init_distributed(device=device)
    elif run.config.optimizer.offload_params != "none" and not dist.is_initialized():
        init_alone(device)  # FSDP moves offloaded parameters, and needs a process group: one of this process
    topo = Topology(pp=run.pp, dp=run.dp, tp=run.tp, ep=run.ep, device=device,
                    expert_tp=run.config.parallel.expert_tp,
                    sequence_parallel=run.config.parallel.sequence_parallel,
                    dp_shard=run.config.parallel.dp_shard, cp=run.config.parallel.cp,
                    cp_mode=run.config.parallel.cp_mode)
    return topo, reason if fell_back(run.config.train.device, device) else None


def _steps(run: Run, topo: Topology, engine: PipelineEngine, log: Logger, path: str | None, start: int,
           resumed_from: str | None = None) -> dict:
    """Steps start+1 .. train.steps: train, validate, log, checkpoint, and stop early (after
    a checkpoint) when any rank got SIGTERM/SIGINT, or (`Divergence`) after
    train.max_skipped_steps steps in a row skipped for non-finite values. Returns the
    logger's summary."""
    cfg = run.config
    train_data = batches(run, topo, "train", path, start_step=start)
    if cfg.train.seq_len_start is not None:  # sequence-length warm-up: each batch cut to its step's length
        train_data = warmed_up(train_data, cfg.train, start)
    if cfg.data.trim_padding:  # each microbatch cut to its own used length
        train_data = trimmed_batches(train_data, cfg.schedule.microbatches, cfg.train.seq_len_multiple)
    root, saved_at = checkpoint_root(cfg), None
    divergence = Divergence(cfg.train.max_skipped_steps, start, resumed_from)
    has_moe = getattr(run.model, "n_experts", None) is not None
    auxloss.metrics.pop()
    optimizer = engine.optimizer
    assert optimizer is not None  # build_engine gives the engine its optimizer
    with StopRequests() as stop:
        for step in range(start + 1, cfg.train.steps + 1):
            lr = optimizer.param_groups[0]["lr"]
            engine.record_timeline = step == cfg.logging.trace_step
            loss = engine.train_batch(train_data, reduce_loss=True)
            routed = auxloss.metrics.pop()  # MoE layers' counts of this step's forward passes
            divergence.step(step, engine.last_skip, loss)
            if engine.record_timeline:
                write_trace(run, topo, engine, step)
            val = None
            if _due(step, cfg.data.val_every, cfg.train.steps):
                with log.paused():
                    val = validate(run, topo, engine, path, stop, say=log.say)
                auxloss.metrics.pop()  # validation's forward passes are not the step's
            moe = moe_summary(topo, routed) if has_moe and log.logged(step, val) else None
            log.step(step, loss, lr, val, moe)
            _injected_fault(step, topo)
            stopping = stop.requested(topo)
            due = _due(step, cfg.checkpoint.every, -1) or (step == cfg.train.steps and cfg.checkpoint.at_end)
            if root and (stopping or (due and not divergence.streak)):  # a skipped step's weights: saved already
                with log.paused():
                    began = time.perf_counter()
                    divergence.check_weights(step, engine, topo)
                    saved_at = save(run, topo, engine, root, step)
                    divergence.saved(step, saved_at)
                    log.saved(step, saved_at, time.perf_counter() - began)
            if stopping:
                now = saved_at if saved_at and saved_at.endswith(f"{step:08d}") else None
                log.stopped(step, stop.signal_name, now)
                return {**log.finish(), "stopped_by": stop.signal_name, "checkpoint": now}
    return log.finish()


def _injected_fault(step: int, topo: Topology) -> None:
    """For the fault tests: PIPEKIT_TEST_FAULT="kill|term|slow|raise:RANK:STEP" makes global rank
    RANK, after step STEP of the first attempt (not after a torchrun restart), die by SIGKILL (no
    handler, no cleanup: as when a machine is lost), get a SIGTERM (a scheduler stopping one
    rank), take SLOW_S seconds more over the step, or raise an error."""
    spec = os.environ.get("PIPEKIT_TEST_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    what, rank, at = spec.split(":")
    if topo.rank == int(rank) and step == int(at):
        if what in ("kill", "term"):
            os.kill(os.getpid(), signal.SIGKILL if what == "kill" else signal.SIGTERM)
            return
        if what == "slow":
            time.sleep(SLOW_S)
            return
        raise RuntimeError(f"injected fault on rank {rank} after step {at}")


SLOW_S = 6.0  # PIPEKIT_TEST_FAULT=slow: a step this much longer


class NonFiniteLoss(ValueError):
    """Training diverged: too many steps in a row skipped for a non-finite loss or gradients, or
    weights gone non-finite (the same on every rank: what decides is all-reduced)."""


class Divergence:
    """Steps skipped in a row for non-finite values (`pipekit.optim.finite`), and which
    checkpoints hold weights known to be good, for the advice when the run stops.

    A skipped step leaves the weights as they were, so a checkpoint saved at step s holds the
    weights that step s + 1 (and any skipped after it) ran on: when a streak of skips begins
    at step f, the checkpoints of steps >= f - 1 hold the very weights that keep failing, and
    the good one is the newest from before (a step that then trained cleanly ran on it). A
    checkpoint is saved only with finite weights (`check_weights`), none during a streak (its
    weights are the streak's, and keeping it would push a good one out of checkpoint.keep).
    fp16 overflows while the loss scale can still fall do not count: that is the scaler's work."""

    def __init__(self, limit: int, start: int, resumed_from: str | None):
        self.limit, self.streak, self.first = limit, 0, 0
        self.checkpoints: list[tuple[int, str]] = [(start, resumed_from)] if resumed_from else []
        self.cause = ""

    def step(self, step: int, skip: Skip | None, loss: float) -> None:
        """Count step `step`'s skip (or the end of a streak); raise after `limit` in a row."""
        if skip is None or skip.overflow:
            self.streak = 0
            return
        if not self.streak:  # what went wrong first
            self.first = step
            self.cause = f"the loss is {loss}" if skip.losses or skip.inputs else "the gradients are not finite"
        self.streak += 1
        if self.streak >= self.limit:
            span = f"step {step}" if step == self.first else f"steps {self.first}-{step}"
            raise NonFiniteLoss(
                f"step {self.first}: {self.cause} (training diverged): {span} skipped, {self.streak} in a row "
                f"(train.max_skipped_steps={self.limit}); lower optimizer.lr or raise "
                f"optimizer.warmup_steps{self.advice()}")

    def saved(self, step: int, path: str) -> None:
        self.checkpoints.append((step, path))

    def good(self) -> str | None:
        """The newest checkpoint still on disk whose weights are not the failing ones."""
        before = self.first - 1 if self.streak else None
        ok = [path for step, path in self.checkpoints if (before is None or step < before) and os.path.isdir(path)]
        return ok[-1] if ok else None

    def advice(self) -> str:
        good = self.good()
        if good:
            return f", and resume from {good} (the newest checkpoint whose weights trained a step cleanly)"
        return "; no checkpoint of this run holds weights known to be good"

    def check_weights(self, step: int, engine: PipelineEngine, topo: Topology) -> None:
        """Refuse to save non-finite weights (collective: one all-reduce, one read)."""
        bad = torch.zeros((), dtype=torch.float32, device=topo.device)
        for p in engine.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # ZeRO-3: this rank's shard
            bad = torch.maximum(bad, (~torch.isfinite(local.detach())).any().float())
        if dist.is_initialized() and topo.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise NonFiniteLoss(f"step {step}: the weights are not finite (training diverged), so no checkpoint "
                                f"was saved; lower optimizer.lr or raise optimizer.warmup_steps{self.advice()}")


class StopRequests:
    """SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C), SIGHUP (the terminal or SSH
    session closed) or SIGUSR1 (Slurm's warning before the end of a job's time) asks the run
    to stop at the next step boundary, or between two validation batches, after saving a
    checkpoint; a second signal, 2 s or more after the first, stops it at once, unless it is
    the launcher passing on the stop it was sent in turn (its first, `reports.forwards`) or
    another SIGHUP (a terminal closes once). Every rank agrees on where: `requested` is
    collective (one 1-element all-reduce per step and per validation batch). Rank 0 says at
    once that the signal came, and each rank tells the launcher (`reports`); after SIGHUP, a
    closed terminal's stdout and stderr are replaced by /dev/null, so that the saving run's
    prints do not fail."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
    # A second signal within this many seconds of the first is the same request arriving twice
    # (a launcher's forward beside a scheduler's own, a parent's death relayed), not "stop now".
    ECHO_S = 2.0

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._since = 0.0  # when the first signal came (time.monotonic)
        self._forwards = 0  # the stop signals the launcher had passed on when the last one came
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    def _handle(self, signum, frame):
        forwards, seen = reports.forwards(), self._forwards
        self._forwards = forwards
        if self.signal_name is not None:  # the second one: stop now, unless it is the first one's echo
            launchers_first = forwards == 1 and seen == 0
            if time.monotonic() - self._since < self.ECHO_S or launchers_first or signum == signal.SIGHUP:
                return
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.signal_name, self._since = signal.Signals(signum).name, time.monotonic()
        if signum == signal.SIGHUP:
            detach_from_closed_terminal()
        with contextlib.suppress(OSError):
            reports.write("stopping", {"signal": self.signal_name, "time": time.time()})
        if os.environ.get("RANK", "0") == "0":
            try:  # os.write: a print interrupted by this handler would refuse a reentrant one
                os.write(1, f"pipekit: {self.signal_name} received: stopping after this step (or validation "
                            f"batch) and a checkpoint; a second signal stops at once, unsaved\n".encode())
            except OSError:
                pass

    def requested(self, topo: Topology) -> bool:
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=topo.device)
        if topo.world_size > 1 and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal_name is None:
            self.signal_name = "a signal to another rank"
        return bool(flag.item())


def _due(step: int, every: int, last: int) -> bool:
    return every > 0 and (step % every == 0 or step == last)


# A validation expected to take longer than this is reported as it goes, then every PROGRESS_EVERY_S.
PROGRESS_AFTER_S, PROGRESS_EVERY_S = 10.0, 30.0


def validate(run: Run, topo: Topology, engine: PipelineEngine, path: str | None,
             stop: StopRequests | None = None, say=None) -> float | None:
    """Mean loss over `data.val_batches` held-out batches (the same ones every time), or None
    when `stop` was requested before the last batch (checked between batches: collective).
    A validation expected to last over PROGRESS_AFTER_S seconds is reported through `say`
    (rank 0's printer) after its first batch, then every PROGRESS_EVERY_S, with the time left."""
    data, n = batches(run, topo, "val", path), run.config.data.val_batches
    total, began, said = 0.0, time.perf_counter(), None
    for done in range(1, n + 1):
        total += engine.eval_batch(data, reduce_loss=True)
        if done == n:
            break
        if stop is not None and stop.requested(topo):
            return None
        now = time.perf_counter()
        left = (now - began) / done * (n - done)
        if say is not None and (now - began + left > PROGRESS_AFTER_S if said is None
                                else now - said > PROGRESS_EVERY_S):
            say(f"validating: {done}/{n} batches, about {_duration(left)} left")
            said = now
    return total / n


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def write_trace(run: Run, topo: Topology, engine: PipelineEngine, step: int) -> None:
    """Write this step's measured timeline beside the simulator's prediction for the same
    schedule with the measured mean F and B times: Chrome-trace JSON, and PNGs when
    matplotlib is installed. Gathers the timelines over the pipeline group (collective).
    Limit: ranks' clocks are compared directly, which holds on one machine only."""
    out_dir = run.config.logging.out_dir
    step_start = engine.step_start
    assert step_start is not None  # set by the step whose timeline this is
    mine = [TimelineEvent(e.rank, e.action, e.start + step_start, e.end + step_start) for e in engine.timeline]
    everyone = [mine]
    if topo.pp_group is not None:
        gathered: list[Any] = [None] * topo.pp  # each pp rank's events, unpickled
        dist.all_gather_object(gathered, mine, group=topo.pp_group)
        everyone = gathered
    if topo.rank != 0 or not out_dir:
        return
    events = [e for part in everyone for e in part]
    t0 = min(e.start for e in events)
    measured = [TimelineEvent(e.rank, e.action, e.start - t0, e.end - t0) for e in events]
    costs = mean_costs(measured)
    predicted = simulate(engine.schedule, costs=costs).timeline
    for name, timeline in (("measured", measured), ("simulated", predicted)):
        base = os.path.join(out_dir, f"timeline_step{step}_{name}")
        write_atomic(base + ".json", json.dumps(to_chrome_trace(timeline)))
        try:
            render_png(timeline, base + ".png", f"step {step}, {name} ({run.schedule.name}, pp={topo.pp})")
        except ImportError:
            pass
    print(f"wrote the measured and simulated timelines of step {step} to {out_dir}", flush=True)


def save_weights(run: Run, topo: Topology, engine: PipelineEngine, data_path: str | None) -> None:
    """Write the full, layout-free weights with the model config and tokenizer name to out_dir/model.pt."""
    out_dir = run.config.logging.out_dir
    if not out_dir:
        return
    state = full_state_dict(engine.module)  # collective: every rank takes part
    if topo.rank == 0:
        meta = read_data_meta(data_path) if data_path else None
        ckpt = {"family": run.family, "config": asdict(run.model), "state_dict": state,
                "tokenizer": meta.get("tokenizer") if meta else None}
        if run.config.model.lora.rank:  # what `convert` needs to merge the adapters (their scale)
            ckpt["lora"] = asdict(run.config.model.lora)
        path = os.path.join(out_dir, "model.pt")
        torch_save_atomic(ckpt, path)
        print(f"saved the trained weights to {path}", flush=True)
