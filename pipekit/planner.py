"""The planner behind `pipekit plan CONFIG`: predict a training step of a config for
every schedule, partition and microbatch count, and recommend one.

How a prediction is made
------------------------
1. **Layer costs.** `profile_layers` builds the config's model in this process and
   times every layer on one microbatch: forward (`F`), full backward (`B`), and the
   split backward's halves (`I`, `W`, with `pipekit.split_backward`), median of a
   few repetitions on one thread (a worker's share of a CPU; torchrun gives each
   worker one thread). It also measures the activations each layer saves for
   backward (saved-tensor hooks), its output (the message when a stage ends there)
   and the loss. A layer timed alone finds its weights and activations warm in the
   caches, so the whole model is also run layer after layer, as a stage runs it,
   and the layers' forward costs are scaled by chained / summed forward time (the
   backward's, and the split backward's halves, likewise). Profiled at two microbatch sizes, a cost is fitted as
   `fixed + per_row * rows` to predict other sizes. `flop_layers` (`--no-profile`)
   gives the same table from FLOP counts on the meta device (nothing is
   allocated, so it works for models this machine cannot hold), at a nominal
   throughput.
2. **Stages.** A partition sums layer costs into virtual-stage costs.
3. **Timeline.** `pipekit.schedules.simulate` walks the schedule's program (its
   SEND/RECV actions too) with those stage costs, a fixed engine overhead per
   action, and a message latency `latency + bytes / bandwidth`
   (`measure_comm`: a gloo ping-pong between two processes on this machine).
4. **The step.** After its last action each rank waits at the step's collectives
   (gradient norm, loss), so the step ends at the slowest rank's last action plus
   those collectives plus the slowest rank's optimizer step (timed on the real
   optimizer, shared out by parameters).
5. **Memory per rank**: weights, gradients and optimizer state (ZeRO sharding and
   mixed precision counted), plus the activations in flight, walking the rank's
   actions: a stage's microbatch holds its saved activations from its `F` until
   its `B` or `W`.

Not modelled: tensor parallelism's collectives (a tp>1 config is profiled at
tp=1 and its compute divided by tp), data-parallel gradient reductions beyond
one latency per collective, contention between ranks sharing cores or a link,
GPU kernel overlap, and the allocator's fragmentation.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from .config import Run, partition_boundaries
from .models import model_loss, model_specs, model_vocab, synthetic_batches
from .optim.factory import make_optimizer
from .partition import check_boundaries, partition, partition_weights
from .pipeline import PipelineModule
from .schedules import SCHEDULES, Action, Kind, Schedule, ScheduleError, build_schedule, simulate
from .schedules.generators import get_generator
from .schedules.ir import WEIGHT_GRAD_KINDS
from .spawn import run_distributed
from .spec import TiedLayerSpec, spec_name, tied_first_index
from .split_backward import backward_input, backward_weight
from .topology import Topology

KINDS = ("F", "B", "I", "W")
# Engine time per action beyond the layers' own work (dispatch, stashing, autograd set-up;
# the timelines of benchmarks/plan_accuracy.py put it at 10-30 us on this CPU); overridable.
DEFAULT_ACTION_OVERHEAD = 20e-6
DEFAULT_SEND_OVERHEAD = 50e-6  # posting a gloo isend (measured by measure_comm when it runs)
DEFAULT_LATENCY = 80e-6  # one gloo message between two processes on one host
DEFAULT_BANDWIDTH = 2e9  # bytes/s
NOMINAL_FLOPS = 1e12  # --no-profile: seconds are FLOPs at this rate unless the config gives peak_tflops


@dataclass
class LayerCost:
    """One layer on one microbatch: seconds per action kind, and bytes."""

    name: str
    params: int
    F: float
    B: float
    I: float  # noqa: E741
    W: float
    saved_bytes: int  # activations kept for backward
    out_bytes: int  # the output: the message when a stage ends after this layer

    def scaled(self, fixed: LayerCost | None, rows: float, rows0: float) -> LayerCost:
        """This cost (measured at `rows0` rows) at `rows` rows: `fixed` holds the part that
        does not grow with rows (None: proportional)."""
        def at(key):
            v = getattr(self, key)
            base = min(getattr(fixed, key), v) if fixed is not None else 0.0
            return base + (v - base) * rows / rows0
        return LayerCost(self.name, self.params, *(max(0.0, at(k)) for k in KINDS),
                         round(self.saved_bytes * rows / rows0), round(self.out_bytes * rows / rows0))


@dataclass
class Profile:
    """Per-layer costs at `rows` rows per microbatch, and how they grow with rows."""

    layers: list[LayerCost]
    loss: LayerCost  # the loss on the last output (F and B)
    rows: int
    fixed: list[LayerCost] | None  # the row-independent part (None: costs proportional to rows)
    optimizer_seconds_per_param: float
    source: str

    def at(self, rows: int) -> list[LayerCost]:
        """The layers' costs at `rows` rows per microbatch, the loss folded into the last."""
        fixed = self.fixed or [None] * (len(self.layers) + 1)
        layers = [c.scaled(f, rows, self.rows) for c, f in zip(self.layers, fixed)]
        loss = self.loss.scaled(fixed[-1], rows, self.rows)
        last = layers[-1]
        layers[-1] = replace(last, F=last.F + loss.F, B=last.B + loss.B, I=last.I + loss.B,
                             saved_bytes=last.saved_bytes + loss.saved_bytes)
        return layers


@dataclass
class CommModel:
    latency: float = DEFAULT_LATENCY  # seconds from a send being posted to its arrival, for an empty message
    bandwidth: float = DEFAULT_BANDWIDTH  # bytes per second on top
    collective: float = 2 * DEFAULT_LATENCY  # one small all-reduce over the pipeline ranks
    action_overhead: float = DEFAULT_ACTION_OVERHEAD  # engine time per action, compute or message
    send_overhead: float = DEFAULT_SEND_OVERHEAD  # what posting a send keeps its rank busy
    send_per_byte: float = 0.0  # and per byte of the message
    source: str = "defaults"

    def message(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


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
    memory_bytes: list[int]
    fits: bool = True
    timeline: list = field(default_factory=list, repr=False)
    same_as: list[str] = field(default_factory=list)  # other partition methods that cut the same way

    def overrides(self) -> list[str]:
        """`pipekit train` overrides that run this candidate (a profiled partition as its
        boundaries, so the run cuts where the plan did)."""
        cut = ",".join(map(str, self.boundaries)) if self.partition == "profile" else self.partition
        return [f"schedule.name={self.schedule}", f"schedule.chunks_per_rank={self.chunks_per_rank}",
                f"schedule.microbatches={self.microbatches}", f"train.micro_batch={self.micro_batch}",
                f"schedule.partition={cut}"]


# ---- profiling ---------------------------------------------------------------
def _model(run: Run, device: str = "cpu"):
    """The run's whole model as one pp=1 PipelineModule on `device`, and an example batch maker."""
    cfg, mcfg = run.config, run.model
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    alone = Topology.__new__(Topology)  # one process, no groups, also inside a job (Topology() would span it)
    alone._init_single(1, 1, 1, None)
    with _default_dtype(dtype):
        module = PipelineModule(model_specs(mcfg), loss_fn=model_loss(mcfg), topology=alone,
                                partition="uniform", seed=cfg.train.seed, device=device,
                                precision=run.precision.name)
    vocab = model_vocab(mcfg)

    def batch(rows: int):
        return next(synthetic_batches(vocab, rows, cfg.train.seq_len, seed=cfg.train.seed))

    return module, batch


class _default_dtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)


def _floats(x) -> list[torch.Tensor]:
    xs = list(x) if isinstance(x, (tuple, list)) else [x]
    return [t for t in xs if torch.is_tensor(t) and t.is_floating_point()]


def _leaf(x):
    """A detached copy of a layer's input that collects its grad (float tensors only)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_leaf(t) for t in x)
    if torch.is_tensor(x) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


def _nbytes(x) -> int:
    xs = list(x) if isinstance(x, (tuple, list)) else [x]
    return sum(t.numel() * t.element_size() for t in xs if torch.is_tensor(t))


class _SavedBytes:
    """Bytes autograd saves for backward inside the block, parameters not counted."""

    def __init__(self, params):
        self.params = list(params)
        self.skip = {p.data_ptr() for p in self.params if p.device.type != "meta"}
        self.seen, self.total = set(), 0

    def __enter__(self):
        def pack(t):
            if t.device.type == "meta":  # no storage to tell apart: count each tensor that is not a parameter
                if not any(t is p or (t._base is not None and t._base is p) for p in self.params) \
                        and id(t) not in self.seen:
                    self.seen.add(id(t))
                    self.total += t.numel() * t.element_size()
                return t
            key = t.untyped_storage().data_ptr()
            if key not in self.skip and key not in self.seen:
                self.seen.add(key)
                self.total += t.untyped_storage().nbytes()
            return t
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _time(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def _layer_params(module, i: int) -> list[torch.Tensor]:
    spec = module.specs[i]
    if isinstance(spec, TiedLayerSpec):
        return list(module.tied[spec.key].parameters())
    return list(module.layers[str(i)].parameters()) if str(i) in module.layers else []


def _label(specs: list, i: int) -> str:
    """Layer i's class name; a tied layer's later use says so (a GPT's head is its embedding's module)."""
    spec = specs[i]
    if isinstance(spec, TiedLayerSpec) and (first := tied_first_index(specs)[spec.key]) < i:
        return f"{spec_name(spec)} (tied to layer {first})"
    return spec_name(spec)


def _profile_one(module, i: int, x, reps: int, sync):
    """(LayerCost, output) of layer i on input x: medians over `reps` after one warm-up."""
    params = [p for p in _layer_params(module, i) if p.requires_grad]
    times = {k: [] for k in KINDS}
    out = None
    with _SavedBytes(params) as counter:  # counted apart: the hooks would slow the timed passes
        out = module.run_layer(i, _leaf(x))
    saved, out_bytes = counter.total, _nbytes(out)
    for rep in range(reps + 1):
        for split in (False, True):
            xin = _leaf(x)
            t_f, out = _time(lambda: module.run_layer(i, xin), sync)
            outs = [o for o in _floats(out) if o.requires_grad]
            grads = [torch.randn_like(o) for o in outs]
            if not split:
                t_b, _ = _time(lambda: torch.autograd.backward(outs, grads) if outs else None, sync)
                if rep:
                    times["F"].append(t_f)
                    times["B"].append(t_b)
                continue
            t_i, (_, work) = _time(lambda: backward_input(outs, grads, _floats(xin), params), sync)
            t_w, _ = _time(lambda: backward_weight(work), sync)
            if rep:
                times["I"].append(t_i)
                times["W"].append(t_w)
        for p in params:
            p.grad = None
    med = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
    n = sum(p.numel() for p in params)
    return LayerCost(_label(module.specs, i), n, med["F"], med["B"], med["I"], med["W"], saved, out_bytes), out


def _profile_loss(module, out, labels, reps: int, sync) -> LayerCost:
    fwd, bwd = [], []
    with _SavedBytes([]) as counter:
        module.loss_fn(_leaf(out), labels)
    saved = counter.total
    for rep in range(reps + 1):
        x = _leaf(out)
        t_f, loss = _time(lambda: module.loss_fn(x, labels), sync)
        t_b, _ = _time(lambda: loss.backward(), sync)
        if rep:
            fwd.append(t_f)
            bwd.append(t_b)
    f, b = (statistics.median(v) if v else 0.0 for v in (fwd, bwd))
    return LayerCost("loss", 0, f, b, b, 0.0, saved, 0)


def profile_layers(run: Run, *, rows: int | None = None, reps: int = 5, threads: int | None = 1,
                   device: str = "cpu") -> Profile:
    """Time the config's layers in this process (see the module docstring).

    `rows`: sequences per microbatch (default `train.micro_batch`); a second profile at
    half as many rows gives the row-independent part of each cost. `threads`: the
    intra-op threads to time with (None: leave torch's setting)."""
    rows = rows or run.config.train.micro_batch
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        module, batch = _model(run, device)
        _ = make_optimizer(module, run.config.optimizer, run.precision)  # its gradient hooks run in every backward timed below, as in a run
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        _profile_rows(module, batch, rows, 0, sync)  # a whole untimed pass: the allocator's first big blocks
        layers, loss = _profile_rows(module, batch, rows, reps, sync)
        fixed = None
        if rows >= 2:
            small, small_loss = _profile_rows(module, batch, rows // 2, reps, sync)
            fixed = [_intercept(big, lit, rows, rows // 2) for big, lit in zip(layers + [loss], small + [small_loss])]
        per_param = _optimizer_seconds_per_param(run, module, sync)
    finally:
        torch.set_num_threads(old_threads)
    where = f"{device}, {threads or old_threads} thread{'s' if (threads or old_threads) > 1 else ''}"
    return Profile(layers, loss, rows, fixed, per_param, f"measured on {where}")


def _profile_and_ping(run: Run, rows, reps) -> tuple:
    """On each of two gloo ranks sharing this host: the ping-pong, then the same profile at
    the same time (so each layer is timed while the other rank computes, as in a run)."""
    comm = _ping([4, 1 << 22], 30)
    return comm, profile_layers(run, rows=rows, reps=reps, threads=1)


def profile_on_two_ranks(run: Run, *, rows: int | None = None, reps: int = 5,
                         timeout: float = 600.0) -> tuple[Profile, CommModel]:
    """The CPU profile and message costs as two pipeline ranks on this host see them.

    Two gloo processes (one thread each) measure the messages between them, then
    profile the layers side by side: each layer's time includes what a worker loses
    to the other one sharing the caches and memory bandwidth. The profile is the mean
    of the two ranks'."""
    (ping, one), (_, two) = run_distributed(_profile_and_ping, 2, run, rows, reps, timeout=timeout)
    mean = replace(one, layers=[_mean_cost(a, b) for a, b in zip(one.layers, two.layers)],
                   loss=_mean_cost(one.loss, two.loss),
                   optimizer_seconds_per_param=(one.optimizer_seconds_per_param + two.optimizer_seconds_per_param) / 2,
                   source="measured on cpu by two ranks side by side, 1 thread each")
    return mean, _comm_model(ping)


def _mean_cost(a: LayerCost, b: LayerCost) -> LayerCost:
    return replace(a, **{k: (getattr(a, k) + getattr(b, k)) / 2 for k in KINDS})


def _profile_rows(module, batch, rows, reps, sync):
    x, labels = batch(rows)
    x = x.to(module.device)
    out, layers = x, []
    with torch.enable_grad():
        for i in range(len(module.specs)):
            cost, out = _profile_one(module, i, out, reps, sync)
            layers.append(cost)
            out = out.detach() if torch.is_tensor(out) else out
        loss = _profile_loss(module, out, labels.to(module.device), reps, sync)
        if reps:
            layers, loss = _calibrated(layers, loss, _chained(module, x, labels.to(module.device), reps, sync))
    return layers, loss


def _chained(module, x, labels, reps: int, sync) -> dict[str, float]:
    """Median seconds of the whole model run layer after layer on one microbatch, as a
    stage runs its layers: forward (with the loss) and full backward ("F", "B"); and,
    from the first layer's output on (a stage whose input takes a gradient), the split
    backward's halves ("I", "W")."""
    n = len(module.specs)
    params = [p for p in module.parameters() if p.requires_grad]
    times: dict[str, list[float]] = {k: [] for k in KINDS}

    def forward(start, inp):
        out = inp
        for i in range(start, n):
            out = module.run_layer(i, out)
        return module.loss_fn(out, labels)

    for rep in range(reps + 1):
        t_f, loss = _time(lambda: forward(0, x), sync)
        t_b, _ = _time(loss.backward, sync)
        got = {"F": t_f, "B": t_b}
        if n > 1:
            with torch.no_grad():
                first = module.run_layer(0, x)
            inp = _leaf(first)
            loss = forward(1, inp)
            t_i, (_, work) = _time(lambda: backward_input([loss], [None], _floats(inp), params), sync)
            t_w, _ = _time(lambda: backward_weight(work), sync)
            got.update(I=t_i, W=t_w)
        for p in module.parameters():
            p.grad = None
        if rep:
            for k, v in got.items():
                times[k].append(v)
    return {k: statistics.median(v) for k, v in times.items() if v}


def _calibrated(layers: list[LayerCost], loss: LayerCost, chained: dict[str, float]):
    """Each layer timed alone runs with its weights and activations warm in the caches; run one
    after another, as in a stage, they are not (on a 2-core CPU host, a GPT's forward took
    1.11x and its backward 1.05x the sum of its layers'). Scale each kind's cost by the
    chained time over the summed one: F and B over every layer and the loss, I and W over
    those after the first layer (what the chained split pass covers)."""
    rest = [*layers[1:], loss]
    summed = {"F": sum(c.F for c in layers) + loss.F, "B": sum(c.B for c in layers) + loss.B,
              "I": sum(c.I for c in rest), "W": sum(c.W for c in rest)}
    factor = {k: chained[k] / summed[k] if summed[k] > 0 and k in chained else 1.0 for k in KINDS}
    if "I" not in chained:  # one layer: no split pass; the backward's factor stands in
        factor["I"] = factor["W"] = factor["B"]

    def scale(c: LayerCost) -> LayerCost:
        return replace(c, **{k: getattr(c, k) * factor[k] for k in KINDS})

    return [scale(c) for c in layers], scale(loss)


def _intercept(big: LayerCost, small: LayerCost, rows: int, rows_small: int) -> LayerCost:
    """The row-independent part of a cost measured at two sizes (>= 0, <= the cost)."""
    def cut(key):
        b, s = getattr(big, key), getattr(small, key)
        slope = (b - s) / (rows - rows_small)
        return min(max(0.0, b - slope * rows), b)
    return LayerCost(big.name, big.params, *(cut(k) for k in KINDS), 0, 0)


def _optimizer_seconds_per_param(run: Run, module, sync) -> float:
    """One step of the run's torch optimizer (AdamW or SGD) over fp32 copies of the whole
    model's weights, per parameter: what ZeroOptimizer runs on its master weights (no
    collectives here, so rank 0 of a job can time it alone)."""
    params = [p.detach().float().clone().requires_grad_(True) for p in module.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    o = run.config.optimizer
    opt = (torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
           if o.name == "adamw" else torch.optim.SGD(params, lr=o.lr, momentum=o.momentum))
    opt.step()  # the first step allocates the state
    runs = []
    for _ in range(3):
        t, _ = _time(opt.step, sync)
        runs.append(t)
    return statistics.median(runs) / sum(p.numel() for p in params)


def flop_layers(run: Run, *, rows: int | None = None, flops_per_second: float | None = None) -> Profile:
    """The layer table from FLOP counts (torch's FlopCounterMode) on the meta device:
    seconds = FLOPs / `flops_per_second` (default: logging.peak_tflops, or 1 TFLOP/s).
    A backward's halves are taken as equal (I = W = B / 2)."""
    rows = rows or run.config.train.micro_batch
    rate = flops_per_second or ((run.config.logging.peak_tflops or 0) * 1e12) or NOMINAL_FLOPS
    module, batch = _model(run, "meta")
    x, labels = (t.to("meta") for t in batch(rows))
    layers = []
    out = x
    for i in range(len(module.specs)):
        params = [p for p in _layer_params(module, i) if p.requires_grad]
        xin = _leaf(out)
        with FlopCounterMode(display=False) as fwd, _SavedBytes(params) as counter:
            out = module.run_layer(i, xin)
        outs = [o for o in _floats(out) if o.requires_grad]
        with FlopCounterMode(display=False) as bwd:
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        f, b = fwd.get_total_flops() / rate, bwd.get_total_flops() / rate
        layers.append(LayerCost(_label(module.specs, i), sum(p.numel() for p in params), f, b, b / 2, b / 2,
                                counter.total, _nbytes(out)))
        out = out.detach() if torch.is_tensor(out) else out
    xin = _leaf(out)
    with FlopCounterMode(display=False) as fwd:
        loss = module.loss_fn(xin, labels)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    loss_cost = LayerCost("loss", 0, fwd.get_total_flops() / rate, bwd.get_total_flops() / rate,
                          bwd.get_total_flops() / rate, 0.0, 0, 0)
    # AdamW: about 12 FLOPs and 16 bytes moved per parameter; count it as memory-bound at 1/50 of the rate.
    return Profile(layers, loss_cost, rows, None, 50 * 12 / rate,
                   f"FLOP counts at {rate / 1e12:g} TFLOP/s (no profile)")


# ---- communication -------------------------------------------------------------
def _ping(sizes: list[int], reps: int) -> dict:
    """On each of two gloo ranks: half the median round trip of a message of each size,
    and of a one-element all-reduce."""
    rank, out = dist.get_rank(), {}

    def lap(fn) -> float:
        laps = []
        for _ in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            laps.append(time.perf_counter() - t0)
        return statistics.median(laps[2:])

    for n in sizes:
        buf = torch.zeros(max(1, n // 4))
        if rank == 0:
            out[n] = lap(lambda: (dist.send(buf, 1), dist.recv(buf, 1))) / 2
        else:
            out[n] = lap(lambda: (dist.recv(buf, 0), dist.send(buf, 0))) / 2
    for n in sizes:  # what posting an isend costs the sender (the engine's SEND), its receive posted ahead
        buf, posts = torch.zeros(max(1, n // 4)), []
        for _ in range(reps + 2):
            work = dist.irecv(buf, 0) if rank == 1 else None
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                work = dist.isend(buf, 1)
                posts.append(time.perf_counter() - t0)
            work.wait()
        out[f"post {n}"] = statistics.median(posts[2:]) if posts else 0.0
    flag = torch.zeros(1)
    out["collective"] = lap(lambda: dist.all_reduce(flag))
    return out


def measure_comm(reps: int = 30, timeout: float = 60.0) -> CommModel:
    """Message latency and bandwidth between two gloo processes on this host (ping-pong),
    and a one-element all-reduce."""
    return _comm_model(run_distributed(_ping, 2, [4, 1 << 22], reps, timeout=timeout)[0])


def _comm_model(out: dict) -> CommModel:
    """A CommModel from `_ping`'s round trips."""
    sizes = sorted(k for k in out if isinstance(k, int))
    small, big = out[sizes[0]], out[sizes[1]]
    bandwidth = (sizes[1] - sizes[0]) / (big - small) if big > 2 * small else sizes[1] / big
    post_small, post_big = out[f"post {sizes[0]}"], out[f"post {sizes[1]}"]
    return CommModel(latency=small, bandwidth=bandwidth, collective=out["collective"], send_overhead=post_small,
                     send_per_byte=max(0.0, (post_big - post_small) / (sizes[1] - sizes[0])),
                     source="measured: gloo ping-pong between two processes on this host")


# ---- prediction ----------------------------------------------------------------
def stage_costs(layers: list[LayerCost], boundaries: list[int]) -> list[LayerCost]:
    """Each virtual stage's summed cost; its output is its last layer's. The first stage's
    input (token ids) takes no gradient, so its split backward leaves everything to W:
    I = 0, W = B."""
    out = []
    for s, (lo, hi) in enumerate(zip(boundaries, boundaries[1:])):
        part = layers[lo:hi]
        cost = LayerCost(f"stage {s}", sum(c.params for c in part), *(sum(getattr(c, k) for c in part) for k in KINDS),
                         sum(c.saved_bytes for c in part), part[-1].out_bytes)
        out.append(replace(cost, I=0.0, W=cost.B) if s == 0 else cost)
    return out


def activation_peaks(schedule: Schedule, saved: list[int]) -> list[int]:
    """Per rank, the most activation bytes held at once walking its actions: a (stage,
    microbatch) holds `saved[stage]` from its F to its B or W."""
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for a in actions:
            if a.kind is Kind.F:
                held += saved[a.stage]
                peak = max(peak, held)
            elif a.kind in WEIGHT_GRAD_KINDS:
                held -= saved[a.stage]
        peaks.append(peak)
    return peaks


def state_bytes(params: int, run: Run) -> int:
    """Weights, gradients, master weights and optimizer moments of `params` parameters on
    one rank, in the run's precision policy's dtypes, with ZeRO's sharding over dp."""
    o, dp, policy = run.config.optimizer, run.dp, run.precision
    width = policy.param_dtype.itemsize
    state = policy.master_dtype.itemsize
    moments = (2 if o.name == "adamw" else (1 if o.momentum else 0)) * state
    master = state if policy.mixed else 0  # fp32: the parameters are their own master copy
    grads = width
    sharded = (master + moments) + (grads if o.zero_stage >= 2 else 0)
    kept = width + (0 if o.zero_stage >= 2 else grads)
    return round(params * (kept + sharded / (dp if o.zero_stage >= 1 else 1)))


def predict(schedule: Schedule, layers: list[LayerCost], boundaries: list[int], comm: CommModel,
            optimizer_seconds_per_param: float, run: Run | None = None) -> dict:
    """The predicted step of `schedule` with these layer costs cut at `boundaries`."""
    stages = stage_costs(layers, boundaries)
    over = comm.action_overhead

    def duration(a: Action) -> float:
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
    saved = [s.saved_bytes for s in stages]
    acts = activation_peaks(schedule, saved)
    memory = [acts[r] + (state_bytes(params[r], run) if run is not None else 0) for r in range(schedule.pp)]
    return {"step": max(ends) + tail, "makespan": sim.makespan, "bubble": sim.bubble_fraction, "tail": tail,
            "memory": memory, "timeline": sim.timeline}


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
    prefix_p, prefix_a = [0], [0]
    for c, t in zip(layers, times):
        prefix_t.append(prefix_t[-1] + t)
        prefix_p.append(prefix_p[-1] + c.params)
        prefix_a.append(prefix_a[-1] + c.saved_bytes)

    def fits(s, lo, hi):
        return state_bytes(prefix_p[hi] - prefix_p[lo], run) + inflight[s] * (prefix_a[hi] - prefix_a[lo]) <= share

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
        for a in actions:
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


def plan(run: Run, profile: Profile, comm: CommModel, *, schedules=None, partitions=None, microbatches=None,
         budget: float | None = None) -> list[Candidate]:
    """Every candidate the config allows, fastest predicted step first (those over the
    memory `budget`, bytes per rank, last)."""
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
                    bounds = boundaries_for(method, run, layers, schedule, budget if method == "profile" else None,
                                            profile.optimizer_seconds_per_param)
                except ValueError:
                    continue
                if tuple(bounds) in seen:
                    seen[tuple(bounds)].same_as.append(method)
                    continue
                p = predict(schedule, layers, bounds, comm, profile.optimizer_seconds_per_param, run)
                out.append(Candidate(name, schedule.chunks_per_rank, m, rows, method, bounds, p["step"],
                                     p["makespan"], p["bubble"], p["tail"], p["memory"],
                                     budget is None or max(p["memory"]) <= budget, p["timeline"]))
                seen[tuple(bounds)] = out[-1]
    out.sort(key=lambda c: (not c.fits, c.step_seconds))
    return out


def _schedule_options(names, run: Run) -> list[tuple[str, int | None]]:
    """(schedule, chunks per rank) pairs: a schedule's own chunk count, or for one that
    takes any (interleaved_1f1b), 2 and the run's."""
    out = []
    for name in names:
        if get_generator(name).chunks_per_rank is not None:
            out.append((name, None))
            continue
        mine = run.schedule.chunks_per_rank if name == run.schedule.name else None
        out += [(name, k) for k in sorted({2, *([mine] if mine and mine > 1 else [])})]
    return out


def candidate_record(c: Candidate, tokens_per_row: int) -> dict:
    """A JSON-able summary of a candidate."""
    rec = {k: v for k, v in asdict(c).items() if k != "timeline"}
    rec["tokens_per_second"] = c.micro_batch * c.microbatches * tokens_per_row / c.step_seconds
    return rec


# ---- the report ------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def layer_table(profile: Profile) -> str:
    """The profiled layers (the loss folded into the last), at the profiled rows."""
    rows = [["layer", "name", "params", "F ms", "B ms", "I ms", "W ms", "saved MiB"]]
    for i, c in enumerate(profile.at(profile.rows)):
        rows.append([str(i), c.name, f"{c.params:,}", *(_ms(getattr(c, k)) for k in KINDS), _mib(c.saved_bytes)])
    return _table(rows)


def candidate_table(candidates: list[Candidate], tokens_per_row: int, top: int) -> str:
    rows = [["schedule", "chunks", "microbatches", "x rows", "partition", "boundaries", "step ms", "tokens/s",
             "bubble", "peak MiB/rank", ""]]
    for c in candidates[:top]:
        tps = c.micro_batch * c.microbatches * tokens_per_row / c.step_seconds
        rows.append([c.schedule, str(c.chunks_per_rank), str(c.microbatches), str(c.micro_batch),
                     "=".join([c.partition, *c.same_as]),
                     ",".join(map(str, c.boundaries)), _ms(c.step_seconds), f"{tps:,.0f}",
                     f"{c.bubble_fraction:.3f}", _mib(max(c.memory_bytes)), "" if c.fits else "over budget"])
    return _table(rows)
