"""The training loop behind `pipekit train`: one worker's view.

Every worker builds the topology, its own stage(s) of the model, AdamW with
warmup + cosine decay, and the engine; then runs `train.steps` optimizer
steps on its data-parallel share of each global batch (the same global
batches whatever the layout). Rank 0 shows a progress bar (loss, tokens/s,
MFU, ETA), writes `metrics.jsonl` and TensorBoard events to
`logging.out_dir`, prints a summary table, and saves the trained weights as
a layout-free `model.pt` that `pipekit generate` and `pipekit convert` read.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from . import auxloss
from .atomic import torch_save_atomic, write_atomic
from .checkpoint import (CheckpointError, full_state_dict, latest_checkpoint, load_checkpoint,
                         save_checkpoint, step_dir)
from .config import Config, model_config, model_loss, model_specs, model_vocab
from .engine import PipelineEngine
from .optim import LossScaler, ZeroOptimizer
from .pipeline import PipelineModule
from .topology import Topology, fell_back, init_distributed, local_workers, resolve_device


# ---- building --------------------------------------------------------------
def lr_lambda(cfg: Config):
    """Multiplier of the peak lr at each step: linear warmup, then cosine to min_lr (or constant)."""
    o, steps = cfg.optimizer, cfg.train.steps
    floor = o.min_lr / o.lr if o.lr else 0.0

    def at(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.decay == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, steps - o.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return at


def make_optimizer(module: PipelineModule, cfg: Config) -> ZeroOptimizer:
    """AdamW (or SGD) under ZeRO stage `optimizer.zero_stage`, with fp32 master weights and,
    for fp16, a loss scaler; matrices decay, vectors (biases, norms) do not, as in nanoGPT
    and Megatron."""
    o = cfg.optimizer
    params = [p for p in module.parameters() if p.requires_grad]
    topo = module.topology
    groups = []
    for experts in (False, True):  # experts: reduced over their own dp group, summed over ep in the norm
        mine = [p for p in params if bool(getattr(p, "expert_parallel", False)) == experts]
        extra = {"dp_group": topo.edp_group, "ep_group": topo.ep_group} if experts else {}
        groups += [{"params": [p for p in mine if p.dim() >= 2], "weight_decay": o.weight_decay, **extra},
                   {"params": [p for p in mine if p.dim() < 2], "weight_decay": 0.0, **extra}]
    hyper = {"betas": (o.beta1, o.beta2), "eps": o.eps} if o.name == "adamw" else {"momentum": o.momentum}
    scaler = LossScaler.from_config(cfg.fp16) if cfg.train.precision == "fp16" else None
    return ZeroOptimizer(groups, o.name, module=module, stage=o.zero_stage, bucket_mb=o.bucket_mb,
                         loss_scaler=scaler, lr=o.lr, **hyper)


def build(cfg: Config, topo: Topology) -> PipelineEngine:
    from .config import schedule_chunks
    from .schedules import build_schedule

    mcfg = model_config(cfg.model)
    s = cfg.schedule
    schedule = build_schedule(s.name, topo.pp, s.microbatches, schedule_chunks(s))  # what module and engine read
    module = PipelineModule(
        model_specs(mcfg),
        loss_fn=model_loss(mcfg),
        topology=topo,
        partition=partition_of(cfg, schedule, topo.device),
        seed=cfg.train.seed,
        schedule=schedule,
        activation_checkpoint_interval=s.activation_checkpoint_interval,
        checkpoint_layers=s.checkpoint_layers,
        precision=cfg.train.precision,
        compile=cfg.train.compile,
    )
    opt = make_optimizer(module, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return PipelineEngine(
        module, optimizer=opt,
        clip_grad_norm=cfg.optimizer.clip_grad_norm, lr_scheduler=sched,
    )


def partition_of(cfg: Config, schedule, device="cpu") -> str | list[int]:
    """schedule.partition as PipelineModule takes it: a method name, or boundaries. "profile"
    times the layers once, on global rank 0 (every rank must cut the model alike, and
    timings differ between processes), and gives its boundaries to every rank."""
    from .config import partition_boundaries

    s = cfg.schedule
    bounds = partition_boundaries(s.partition)
    if bounds is not None or s.partition != "profile":
        return bounds if bounds is not None else s.partition
    found = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        from . import planner

        budget = s.memory_budget_gb * 2**30 if s.memory_budget_gb else None
        prof = planner.profile_layers(cfg, threads=1 if cfg.world_size > 1 else None, device=str(device))
        found = [planner.profile_boundaries(prof.at(cfg.train.micro_batch), schedule.num_stages, budget=budget,
                                            schedule=schedule, cfg=cfg,
                                            optimizer_seconds_per_param=prof.optimizer_seconds_per_param)]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    return found[0]


# ---- data ------------------------------------------------------------------
def data_dir(cfg: Config) -> str | None:
    """The prepared dataset directory for `data.source` (None for synthetic data)."""
    from .data import default_corpus_dir

    if cfg.data.source == "synthetic":
        return None
    if cfg.data.source == "stdlib":
        return default_corpus_dir()
    return cfg.data.source


def batches(cfg: Config, topo: Topology, split: str = "train", path: str | None = None, start_step: int = 0):
    """This dp rank's (inputs, labels) batches from step `start_step` on: the same global
    batches in every layout, and after a resume."""
    t = cfg.train
    seed = t.seed if split == "train" else t.seed + 1
    if path is None:
        from .models.toy import synthetic_batches

        vocab = model_vocab(model_config(cfg.model))
        shard = t.global_batch // topo.dp
        rows = slice(topo.dp_rank * shard, (topo.dp_rank + 1) * shard)
        stream = synthetic_batches(vocab, t.global_batch, t.seq_len, seed=seed)
        return ((x[rows], y[rows]) for x, y in itertools.islice(stream, start_step, None))
    from .data import BatchSampler, TokenDataset

    ds = TokenDataset(path, split)
    return BatchSampler(ds, t.global_batch, t.seq_len, dp_rank=topo.dp_rank, dp_size=topo.dp, seed=seed,
                        start_step=start_step)


def check_vocab(cfg: Config, path: str | None) -> None:
    if path is None:
        return
    from .data import read_meta

    meta = read_meta(path)
    vocab = model_vocab(model_config(cfg.model))
    if meta and meta["vocab_size"] > vocab:
        raise ValueError(
            f"the dataset in {path} has vocab_size {meta['vocab_size']} but model vocab_size={vocab}; "
            f"set model.vocab_size>={meta['vocab_size']}"
        )


# ---- throughput figures ----------------------------------------------------
# Dense (not 2:4-sparse) tensor-core peaks of one GPU in TFLOP/s, from NVIDIA's data sheets:
# (bf16/fp16, tf32). Matched in order as whole words of torch.cuda.get_device_name, so
# "H100 PCIe" comes before "H100" (SXM), and "A10" does not match "A100". V100 has no bf16
# or tf32 tensor cores: its figures are fp16 and plain fp32.
_GPU_PEAK_TFLOPS = (
    ("B200", 2250.0, 1100.0),
    ("GH200", 989.0, 494.0),
    ("H200", 989.0, 494.0),
    ("H100 PCIe", 756.0, 378.0),
    ("H100", 989.0, 494.0),
    ("H800", 989.0, 494.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("L4", 121.0, 60.0),
    ("A10", 125.0, 62.5),
    ("V100", 125.0, 15.7),
)


def peak_flops_per_device(cfg: Config, topo: Topology) -> tuple[float | None, str]:
    """(Dense peak FLOP/s of one device, how it was found), for MFU.

    In order: `logging.peak_tflops`; on CUDA, the card's figure for `train.precision`
    (bf16/fp16: tensor-core dense peak; fp32: the TF32 dense peak, which matmuls reach
    only with TF32 enabled, torch.set_float32_matmul_precision("high"); float64 is not
    modelled), or None for a card not in the table (MFU is then reported as n/a); on the
    CPU, measured once per run by `_measured_cpu_peak` (collective: every rank calls it).
    """
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops * 1e12, "logging.peak_tflops"
    if topo.device.type == "cuda":
        return _gpu_peak(torch.cuda.get_device_name(topo.device), cfg.train.precision)
    return _measured_cpu_peak(topo), "measured on rank 0: the fastest of ~1 s of single-thread fp32 512x512 matmuls"


def _gpu_peak(name: str, precision: str) -> tuple[float | None, str]:
    """The table's peak of the GPU called `name` at `precision`, or None naming the card."""
    import re

    for key, half, tf32 in _GPU_PEAK_TFLOPS:
        if re.search(rf"\b{key}\b", name):
            kind = "tf32" if precision == "fp32" else precision
            return (tf32 if precision == "fp32" else half) * 1e12, f"{name}, {kind} dense (data sheet)"
    return None, f"unknown GPU {name!r}: set logging.peak_tflops for MFU"


_PEAK_PROBE = ("import sys, torch; torch.set_num_threads(1); from pipekit.train import _fastest_matmul; "
               "print(_fastest_matmul(float(sys.argv[2]), int(sys.argv[1])))")


def _single_thread_matmul_flops(seconds: float, n: int) -> float:
    """The fastest single-thread n x n fp32 matmul. Measured here when this process runs one
    intra-op thread (every worker under torchrun); otherwise in a child process (bounded by a
    timeout), since switching this process's thread count to 1 and back was measured to slow
    the training after it by ~10% (the intra-op pool is rebuilt)."""
    import subprocess
    import sys

    if torch.get_num_threads() == 1:
        return _fastest_matmul(seconds, n)
    try:
        out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(n), str(seconds)], capture_output=True,
                             text=True, check=True, timeout=60 + seconds, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return float(out.stdout.split()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return _fastest_matmul(seconds, n) / torch.get_num_threads()  # rough: this process's threads share it


def _fastest_matmul(seconds: float, n: int) -> float:
    a, b = torch.randn(n, n, dtype=torch.float32), torch.randn(n, n, dtype=torch.float32)
    a @ b  # warm-up: first-call set-up is not compute
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _measured_cpu_peak(topo: Topology, seconds: float = 1.0, n: int = 512) -> float:
    """Single-thread fp32 FLOP/s of one core, measured by rank 0 while the other ranks wait
    at a barrier and then receive it (collective on the default group when there is one).

    Each n x n matmul is timed alone for `seconds`, and the fastest counts: other processes
    and a busy SMT sibling only ever slow a matmul down, so the fastest of ~100 is steady
    from run to run where a median follows the machine's load (on the 2-core development VM
    under load 4: best 61-74 GFLOP/s over six rounds, median 18-28). Limit: a core that is
    never free during the whole second is measured low.
    """
    grouped = topo.world_size > 1 and dist.is_initialized()
    if grouped:
        dist.barrier()
    peak = [0.0]
    if topo.rank == 0:
        peak[0] = _single_thread_matmul_flops(seconds, n)
    if grouped:
        dist.broadcast_object_list(peak, src=0)
    return peak[0]


def flops_per_token(model_cfg, seq_len: int, n_params: int) -> float:
    try:
        from .models import flops_per_token as zoo_flops

        return zoo_flops(model_cfg, seq_len)
    except (ImportError, TypeError, ValueError, AttributeError):
        return 6.0 * n_params


# ---- the loop ----------------------------------------------------------------
def train(cfg: Config) -> dict:
    """Run the whole job on this worker; returns a summary (the same on every rank)."""
    device, reason = resolve_device(cfg.train.device, local_workers(cfg.world_size))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.world_size > 1:
        init_distributed(device=device)
    torch.set_default_dtype(getattr(torch, cfg.train.dtype))
    topo = Topology(pp=cfg.parallel.pp, dp=cfg.parallel.dp, tp=cfg.parallel.tp, ep=cfg.parallel.ep, device=device)
    path = data_dir(cfg)
    check_vocab(cfg, path)
    engine = build(cfg, topo)
    start = resume(cfg, topo, engine)
    if start == 0:
        clear_old_checkpoints(cfg, topo)
    if start == cfg.train.steps:
        if topo.rank == 0:
            print(f"the checkpoint is at train.steps={start}: nothing left to train (raise train.steps to go on)",
                  flush=True)
        save_weights(cfg, topo, engine, path)
        return {"steps": 0, "resumed_from": start}
    log = Logger(cfg, topo, engine, notice=reason if fell_back(cfg.train.device, device) else None,
                 start_step=start)
    train_data = batches(cfg, topo, "train", path, start_step=start)
    root, saved_at = checkpoint_root(cfg), None
    has_moe = getattr(model_config(cfg.model), "n_experts", None) is not None
    auxloss.metrics.pop()
    with StopRequests() as stop:
        for step in range(start + 1, cfg.train.steps + 1):
            lr = engine.optimizer.param_groups[0]["lr"]
            engine.record_timeline = step == cfg.logging.trace_step
            loss = engine.train_batch(train_data, reduce_loss=True)
            routed = auxloss.metrics.pop()  # MoE layers' counts of this step's forward passes
            check_finite(loss, step, engine, root)
            if engine.record_timeline:
                write_trace(cfg, topo, engine, step)
            val = None
            if _due(step, cfg.data.val_every, cfg.train.steps):
                with log.paused():
                    val = validate(cfg, topo, engine, path)
                auxloss.metrics.pop()  # validation's forward passes are not the step's
            moe = moe_summary(topo, routed) if has_moe and log.logged(step, val) else None
            log.step(step, loss, lr, val, moe)
            _injected_fault(step, topo)
            stopping = stop.requested(topo)
            if root and (_due(step, cfg.checkpoint.every, -1) or stopping
                         or (step == cfg.train.steps and cfg.checkpoint.at_end)):
                with log.paused():
                    saved_at = save(cfg, topo, engine, root, step)
            if stopping:
                log.stopped(step, stop.signal_name, saved_at if saved_at and saved_at.endswith(f"{step:08d}") else None)
                return {**log.finish(), "stopped_by": stop.signal_name}
    summary = log.finish()
    save_weights(cfg, topo, engine, path)
    return summary


def moe_summary(topo: Topology, local: dict) -> dict | None:
    """Per MoE layer, over every rank's tokens of the step: tokens per expert, the max and
    mean load (token-slots per expert) and their ratio, dropped token-slots, and the mean
    aux and z losses; on rank 0 (None elsewhere). Collective (one all_gather_object)."""
    mine = {k: (v.tolist(), n) for k, (v, n) in local.items()} if topo.tp_rank == 0 else {}  # tp: replicas
    everyone = [mine]
    if topo.world_size > 1 and dist.is_initialized():
        everyone = [None] * topo.world_size
        dist.all_gather_object(everyone, mine)
    if topo.rank != 0:
        return None
    layers: dict[str, dict] = {}
    for part in everyone:
        for name, (value, n) in part.items():
            layer, key = name.rsplit("/", 1)
            d = layers.setdefault(layer, {"tokens": None, "dropped": 0.0, "aux": [0.0, 0], "z": [0.0, 0]})
            if key == "tokens_per_expert":
                d["tokens"] = value if d["tokens"] is None else [a + b for a, b in zip(d["tokens"], value)]
            elif key == "dropped":
                d["dropped"] += value
            elif key in ("aux_loss", "z_loss"):
                d[key[0] if key == "z_loss" else "aux"][0] += value
                d[key[0] if key == "z_loss" else "aux"][1] += n
    out = {}
    for layer, d in sorted(layers.items(), key=lambda kv: int(kv[0].rsplit("/", 1)[-1]) if kv[0][-1].isdigit() else 0):
        tokens = d["tokens"] or [0.0]
        mean = sum(tokens) / len(tokens)
        out[layer] = {"tokens_per_expert": [int(t) for t in tokens], "max_load": max(tokens), "mean_load": mean,
                      "imbalance": max(tokens) / mean if mean else None, "dropped": int(d["dropped"]),
                      "aux_loss": d["aux"][0] / d["aux"][1] if d["aux"][1] else None,
                      "z_loss": d["z"][0] / d["z"][1] if d["z"][1] else None}
    return out


def _injected_fault(step: int, topo: Topology) -> None:
    """For the fault tests: PIPEKIT_TEST_FAULT="kill|raise:RANK:STEP" makes global rank RANK,
    after step STEP of the first attempt (not after a torchrun restart), die by SIGKILL (no
    handler, no cleanup: as when a machine is lost) or raise an error."""
    spec = os.environ.get("PIPEKIT_TEST_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    what, rank, at = spec.split(":")
    if topo.rank == int(rank) and step == int(at):
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault on rank {rank} after step {at}")


# ---- checkpoints -------------------------------------------------------------------
def checkpoint_root(cfg: Config) -> str | None:
    """Where this run's checkpoints go: checkpoint.dir, else {logging.out_dir}/checkpoints, else nowhere."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    return os.path.join(cfg.logging.out_dir, "checkpoints") if cfg.logging.out_dir else None


def clear_old_checkpoints(cfg: Config, topo: Topology) -> None:
    """A fresh run must not leave another run's checkpoints where `train.resume=auto` would
    find them: with logging.overwrite they are deleted, otherwise the run refuses to start."""
    from .checkpoint import list_checkpoints

    root = checkpoint_root(cfg)
    old = list_checkpoints(root) if root else []
    if not old:
        return
    if not cfg.logging.overwrite:
        raise CheckpointError(f"{root} holds checkpoints of another run (up to step {old[-1][0]}); continue it with "
                              f"train.resume=auto, or pass logging.overwrite=true to start afresh and delete them")
    if dist.is_initialized():
        dist.barrier()  # every rank has looked before rank 0 deletes
    if topo.rank == 0:
        import shutil

        for _, path in old:
            shutil.rmtree(path, ignore_errors=True)


def resume_path(cfg: Config) -> str | None:
    """The checkpoint this run continues from: `train.resume` (a path, or "auto": the newest
    complete one under checkpoint_root, or none), also "auto" after a torchrun restart."""
    wanted = cfg.train.resume
    if wanted is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        wanted = "auto"  # a restarted worker continues from where the group got to
    if wanted is None:
        return None
    if wanted == "auto":
        root = checkpoint_root(cfg)
        return latest_checkpoint(root) if root else None
    return wanted


def resume(cfg: Config, topo: Topology, engine: PipelineEngine) -> int:
    """Load the checkpoint to resume from, if any, into `engine` (weights, optimizer state,
    LR schedule, loss scale, RNG); returns the number of steps already done."""
    path = resume_path(cfg)
    if path is None:
        return 0
    from .checkpoint import read_meta

    check_same_model(read_meta(path), cfg, path)
    meta = load_checkpoint(path, engine.module, engine.optimizer)
    if engine.lr_scheduler is not None and meta.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    step = int(meta["step"])
    if step > cfg.train.steps:  # (== is a finished run: train() only rewrites model.pt)
        raise CheckpointError(f"checkpoint {path} is at step {step}, past train.steps={cfg.train.steps}; "
                              f"raise train.steps to train on")
    if topo.rank == 0:
        print(f"resuming from {path} (step {step})", flush=True)
    return step


def check_same_model(meta: dict, cfg: Config, path: str) -> None:
    """A checkpoint continues only the model (and data) it was saved from."""
    mine = {"family": cfg.model.family, "config": _model_record(cfg)}
    theirs = {"family": meta.get("family"), "config": meta.get("model_config")}
    if theirs != mine:
        diff = sorted(k for k in set(mine["config"]) | set(theirs["config"] or {})
                      if (theirs["config"] or {}).get(k) != mine["config"].get(k))
        shown = ", ".join(f"{k}={(theirs['config'] or {}).get(k)} (this config: {mine['config'].get(k)})" for k in diff[:3])
        raise CheckpointError(f"checkpoint {path} was saved from another model ({theirs['family']}: {shown or 'family'}); "
                              f"resume it with the config it was saved with")


def _model_record(cfg: Config) -> dict:
    return json.loads(json.dumps(asdict(model_config(cfg.model))))


def save(cfg: Config, topo: Topology, engine: PipelineEngine, root: str, step: int) -> str:
    """Save a resumable, layout-free checkpoint of step `step` under `root` (collective)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    meta = {"step": step, "family": cfg.model.family, "model_config": _model_record(cfg),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "data": {"source": cfg.data.source, "seed": cfg.train.seed, "global_batch": cfg.train.global_batch,
                     "seq_len": cfg.train.seq_len, "next_step": step},
            "config": json.loads(json.dumps(asdict(cfg)))}
    return save_checkpoint(step_dir(root, step), engine.module, engine.optimizer, meta=meta, keep=cfg.checkpoint.keep)


class NonFiniteLoss(ValueError):
    """The training loss became inf or NaN (the same on every rank: the loss is all-reduced)."""


def check_finite(loss: float, step: int, engine: PipelineEngine, root: str | None) -> None:
    if math.isfinite(loss) or engine.last_step_skipped:  # fp16: the loss scaler skipped the step
        return
    last = latest_checkpoint(root) if root else None
    raise NonFiniteLoss(f"step {step}: the loss is {loss} (training diverged); lower optimizer.lr or raise "
                        f"optimizer.warmup_steps" + (f", and resume from {last}" if last else ""))


class StopRequests:
    """SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) asks the run to stop at the next
    step boundary, after saving a checkpoint; a second signal stops it at once. Every rank
    agrees on the step: `requested` is collective (one 1-element all-reduce per step)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._old: dict = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    def _handle(self, signum, frame):
        if self.signal_name is not None:  # the second one: stop now
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def requested(self, topo: Topology) -> bool:
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=topo.device)
        if topo.world_size > 1 and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal_name is None:
            self.signal_name = "a signal to another rank"
        return bool(flag.item())


def _due(step: int, every: int, last: int) -> bool:
    return every > 0 and (step % every == 0 or step == last)


def validate(cfg: Config, topo: Topology, engine: PipelineEngine, path: str | None) -> float:
    """Mean loss over `data.val_batches` held-out batches (the same ones every time)."""
    data = batches(cfg, topo, "val", path)
    return sum(engine.eval_batch(data, reduce_loss=True) for _ in range(cfg.data.val_batches)) / cfg.data.val_batches


def write_trace(cfg: Config, topo: Topology, engine: PipelineEngine, step: int) -> None:
    """Write this step's measured timeline beside the simulator's prediction for the same
    schedule with the measured mean F and B times: Chrome-trace JSON, and PNGs when
    matplotlib is installed. Gathers the timelines over the pipeline group (collective).
    Limit: ranks' clocks are compared directly, which holds on one machine only."""
    from .schedules import TimelineEvent, mean_costs, render_png, simulate, to_chrome_trace

    mine = [TimelineEvent(e.rank, e.action, e.start + engine.step_start, e.end + engine.step_start)
            for e in engine.timeline]
    everyone = [mine]
    if topo.pp_group is not None:
        everyone = [None] * topo.pp
        dist.all_gather_object(everyone, mine, group=topo.pp_group)
    if topo.rank != 0 or not cfg.logging.out_dir:
        return
    events = [e for part in everyone for e in part]
    t0 = min(e.start for e in events)
    measured = [TimelineEvent(e.rank, e.action, e.start - t0, e.end - t0) for e in events]
    costs = mean_costs(measured)
    predicted = simulate(engine.schedule, costs=costs).timeline
    for name, timeline in (("measured", measured), ("simulated", predicted)):
        base = os.path.join(cfg.logging.out_dir, f"timeline_step{step}_{name}")
        write_atomic(base + ".json", json.dumps(to_chrome_trace(timeline)))
        try:
            render_png(timeline, base + ".png", f"step {step}, {name} ({cfg.schedule.name}, pp={topo.pp})")
        except ImportError:
            pass
    print(f"wrote the measured and simulated timelines of step {step} to {cfg.logging.out_dir}", flush=True)


def save_weights(cfg: Config, topo: Topology, engine: PipelineEngine, data_path: str | None) -> None:
    """Write the full, layout-free weights with the model config and tokenizer name to out_dir/model.pt."""
    if not cfg.logging.out_dir:
        return
    state = full_state_dict(engine.module)  # collective: every rank takes part
    if topo.rank == 0:
        from .data import read_meta

        meta = read_meta(data_path) if data_path else None
        ckpt = {"family": cfg.model.family, "config": asdict(model_config(cfg.model)), "state_dict": state,
                "tokenizer": meta.get("tokenizer") if meta else None}
        path = os.path.join(cfg.logging.out_dir, "model.pt")
        torch_save_atomic(ckpt, path)
        print(f"saved the trained weights to {path}", flush=True)


class Logger:
    """Rank 0's progress bar, metrics.jsonl, TensorBoard events and summary table."""

    def __init__(self, cfg: Config, topo: Topology, engine: PipelineEngine, notice: str | None = None,
                 start_step: int = 0):
        self.cfg, self.engine, self.active = cfg, engine, topo.rank == 0
        self.start_step = start_step  # steps done before this process started (a resumed run)
        self.device, self.notice = topo.device.type, notice
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        n_params = _count_params(engine)
        self.flops_per_token = flops_per_token(model_config(cfg.model), cfg.train.seq_len, n_params)
        self.device_peak, self.peak_source = peak_flops_per_device(cfg, topo)
        self.devices = _devices(topo)
        self.peak = self.device_peak * self.devices if self.device_peak else None
        self.n_params = n_params
        self.history: list[dict] = []
        self.start = time.perf_counter()
        self.bar = self.file = self.tb = None
        if self.active:
            self._open()

    def _open(self) -> None:
        out = self.cfg.logging.out_dir
        if out:
            os.makedirs(out, exist_ok=True)
            self.file = _metrics_file(os.path.join(out, "metrics.jsonl"), self.start_step)
            if self.cfg.logging.tensorboard:
                self.tb = _tensorboard(out)
        if self.cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.cfg.train.steps, desc="train", unit="step", dynamic_ncols=True)
        p = self.cfg.parallel
        self._print(f"{self.cfg.model.family}/{self.cfg.model.flavour}: {self.n_params / 1e6:.2f} M parameters, "
                    f"pp={p.pp} dp={p.dp} tp={p.tp}, schedule {self.cfg.schedule.name}, "
                    f"{self.tokens_per_step:,} tokens per step, on {self.device}")
        for line in (self.notice, None if self.peak else f"MFU: {self.peak_source}"):
            if line:
                self._print(line)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside (validation) out of the training throughput."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - start

    def logged(self, step: int, val: float | None) -> bool:
        """Whether step `step` is written out (the same answer on every rank)."""
        return step % self.cfg.logging.log_every == 0 or val is not None or step in (1, self.cfg.train.steps)

    def step(self, step: int, loss: float, lr: float, val: float | None, moe: dict | None = None) -> None:
        elapsed = time.perf_counter() - self.start  # training time only
        tps = self.tokens_per_step * (step - self.start_step) / elapsed
        rec = {"step": step, "loss": loss, "lr": lr,
               "grad_norm": self.engine.last_grad_norm, "tokens_per_s": tps,
               "skipped": self.engine.last_step_skipped, "loss_scale": self.engine.optimizer.loss_scale,
               "mfu": tps * self.flops_per_token / self.peak if self.peak else None, "elapsed_s": elapsed}
        if val is not None:
            rec["val_loss"] = val
        if moe:
            rec["moe"] = moe
        self.history.append(rec)
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mfu=_percent(rec["mfu"]))
        if rec["skipped"]:
            self._print(f"step {step}: fp16 gradient overflow on some rank; the step was skipped on every rank, "
                        f"loss scale now {rec['loss_scale']:g}")
        if self.logged(step, val) or rec["skipped"]:
            self._record(rec)

    def _record(self, rec: dict) -> None:
        val = f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        if self.bar is None or not self.bar.disable:
            self._print(f"step {rec['step']:5d}  loss {rec['loss']:.4f}{val}  lr {rec['lr']:.2e}  "
                        f"{rec['tokens_per_s']:,.0f} tok/s  mfu {_percent(rec['mfu'])}{_moe_text(rec.get('moe'))}")
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if self.tb:
            for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                if rec.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", rec[key], rec["step"])
            for layer, m in (rec.get("moe") or {}).items():
                for key in ("imbalance", "dropped", "aux_loss", "z_loss"):
                    if m.get(key) is not None:
                        self.tb.add_scalar(f"{layer}/{key}", m[key], rec["step"])

    def stopped(self, step: int, why: str, path: str | None) -> None:
        """Say, in one line, where an interrupted run stopped and how to continue it."""
        if self.active:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            where = (f"checkpoint saved to {path}; continue with train.resume=auto" if path
                     else "no checkpoint saved (no logging.out_dir or checkpoint.dir)")
            print(f"pipekit: stopped after step {step} on {why}: {where}", flush=True)

    def finish(self) -> dict:
        h = self.history
        vals = [r["val_loss"] for r in h if "val_loss" in r]
        summary = {
            "steps": len(h), "seconds": h[-1]["elapsed_s"], "tokens": self.tokens_per_step * len(h),
            "first_loss": h[0]["loss"], "final_loss": h[-1]["loss"], "final_val_loss": vals[-1] if vals else None,
            "tokens_per_s": h[-1]["tokens_per_s"], "mfu": h[-1]["mfu"], "params": self.n_params,
            "peak_flops_per_device": self.device_peak, "peak_source": self.peak_source, "devices": self.devices,
            "pp": self.cfg.parallel.pp, "dp": self.cfg.parallel.dp, "tp": self.cfg.parallel.tp,
            "schedule": self.cfg.schedule.name, "skipped_steps": sum(bool(r["skipped"]) for r in h),
            "precision": self.cfg.train.precision, "zero_stage": self.cfg.optimizer.zero_stage,
        }
        if self.active:
            if self.bar is not None:
                self.bar.close()
            print(summary_table(summary), flush=True)
            if self.file:
                self.file.write(json.dumps({"summary": summary}) + "\n")
                self.file.close()
            if self.tb:
                self.tb.close()
        return summary


def _moe_text(moe: dict | None) -> str:
    """"  moe load max/mean 1.42 (moe/3), dropped 0" for the log line ("" without MoE layers)."""
    if not moe:
        return ""
    worst = max(moe, key=lambda k: moe[k]["imbalance"] or 0.0)
    dropped = sum(m["dropped"] for m in moe.values())
    return f"  moe load max/mean {moe[worst]['imbalance'] or 0:.2f} ({worst}), dropped {dropped}"


def _metrics_file(path: str, start_step: int):
    """metrics.jsonl opened for this run: a fresh run starts it empty; a resumed run keeps the
    records of the steps before `start_step` (dropping later ones and any summary, which the
    interrupted run may have written) and appends."""
    if start_step == 0 or not os.path.exists(path):
        return open(path, "w")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if "step" in rec and rec["step"] <= start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    write_atomic(path, "".join(kept))
    return open(path, "a")


def summary_table(s: dict) -> str:
    rows = [
        ("layout", f"pp={s['pp']} dp={s['dp']} tp={s['tp']} ({s['schedule']})"),
        ("precision", f"{s['precision']}, ZeRO stage {s['zero_stage']}"
                      + (f", {s['skipped_steps']} steps skipped (fp16 overflow)" if s["skipped_steps"] else "")),
        ("parameters", f"{s['params'] / 1e6:.2f} M"),
        ("steps", f"{s['steps']} ({s['tokens']:,} tokens)"),
        ("time", f"{s['seconds']:.1f} s training (validation not counted)"),
        ("train loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"),
        ("val loss", "-" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"),
        ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
        ("peak", _peak_text(s)),
        ("MFU", _percent(s["mfu"])),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def _count_params(engine: PipelineEngine) -> int:
    """Parameters of the whole model (tied ones once), from the layout-free spec list."""
    from .spec import count_parameters, TiedLayerSpec

    seen, total = set(), 0
    for spec in engine.module.specs:
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue
            seen.add(spec.key)
        total += count_parameters(spec)
    return total


def _devices(topo: Topology) -> int:
    """Devices the job computes on: one GPU per rank; on the CPU, the cores its ranks' threads
    can occupy (min(ranks x torch threads, cores)), since the CPU peak is one core's."""
    if topo.device.type == "cuda":
        return topo.world_size
    return min(topo.world_size * torch.get_num_threads(), os.cpu_count() or 1)


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _peak_text(s: dict) -> str:
    """The summary's peak row: the per-device figure, the device count, and where it came from."""
    peak = s.get("peak_flops_per_device")
    if not peak:
        return f"n/a ({s.get('peak_source')})"
    figure = f"{peak / 1e12:,.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:,.1f} GFLOP/s"
    return f"{figure} per device x {s['devices']} ({s['peak_source']})"


def _tensorboard(out_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(out_dir, "tb"))
