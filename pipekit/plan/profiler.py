"""The profiler behind `pipekit plan` and `schedule.partition=profile`: what each layer
of a run's model costs, and what a message between two ranks costs.

Layer costs
-----------
`profile_layers` builds the run's model in this process and times every layer
on one microbatch: forward (`F`), full backward (`B`), and the split backward's
halves (`I`, `W`, with `pipekit.split_backward`), median of a few repetitions on
one thread (a worker's share of a CPU; torchrun gives each worker one thread).
It also measures the activations each layer saves for backward (saved-tensor
hooks), its output (the message when a stage ends there) and the loss. A layer
timed alone finds its weights and activations warm in the caches, so the whole
model is also run layer after layer, as a stage runs it, and the layers' costs
are scaled by chained / summed time, per kind (`_calibrated`). Profiled at two
microbatch sizes, a cost is fitted as `fixed + per_row * rows` to predict other
sizes. The run's optimizer is built over the model first: its gradient hooks
are part of every backward timed. `flop_layers` (`--no-profile`) gives the same
table from FLOP counts on the meta device (nothing is allocated, so it works for
models this machine cannot hold), at a nominal throughput.
`profile_on_two_ranks` profiles on two gloo processes side by side, as two
workers sharing a CPU host see their layers.

Message costs
-------------
`measure_comm`: a gloo ping-pong between two processes on this machine gives
the latency and bandwidth of a message, what posting a send costs the sender,
and a one-element all-reduce (`CommModel`).

Fine-tuning: the model is the run's as `pipekit train` trains it (`finetune`: model.lora's
adapters, every other weight frozen, and model.freeze), so a frozen layer's `params` are its
adapters alone (`frozen` the rest), its timed backward computes no frozen weight's gradient,
and its split backward's `W` is the adapters' weight gradients alone (near-empty).

Limits: one process times the whole model at tp=1; contention with other jobs
on the machine is measured, not modelled; the two-rank profile is a CPU
measure (a GPU run is profiled in one process).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..config import Run
from ..kernels import kernels
from ..layers.lora import add_adapters, freeze
from ..models import model_loss, model_specs, model_vocab, synthetic_batches
from ..optim.factory import make_optimizer
from ..pipeline import PipelineModule
from ..precision import default_dtype
from ..spawn import run_distributed
from ..spec import TiedLayerSpec, spec_name, tied_first_index
from ..split_backward import backward_input, backward_weight
from ..topology import Topology

_T = TypeVar("_T")

KINDS = ("F", "B", "I", "W")
# Engine time per action beyond the layers' own work (dispatch, stashing, autograd set-up;
# the timelines of benchmarks/plan_accuracy.py put it at 10-30 us on this CPU); overridable.
DEFAULT_ACTION_OVERHEAD = 20e-6
DEFAULT_SEND_OVERHEAD = 50e-6  # posting a gloo isend (measured by measure_comm when it runs)
DEFAULT_LATENCY = 80e-6  # one gloo message between two processes on one host
DEFAULT_BANDWIDTH = 2e9  # bytes/s
NOMINAL_FLOPS = 1e12  # --no-profile: seconds are FLOPs at this rate unless the config gives peak_tflops
# `pipekit plan` counts FLOPs on the meta device instead of timing on the CPU above this many FLOPs for one
# microbatch's forward and backward through the whole model: a profile runs each layer about 30 times
# (two sizes, 5 repetitions and a warm-up, F, B and the split backward, the chained passes), which at the
# 10-100 GFLOP/s of one CPU thread is already minutes at 1e12.
PROFILE_CPU_FLOP_LIMIT = 1e12


@dataclass
class LayerCost:
    """One layer on one microbatch: seconds per action kind, and bytes."""

    name: str
    params: int  # trained parameters (gradients, optimizer state)
    F: float
    B: float
    I: float  # noqa: E741
    W: float
    saved_bytes: int  # activations kept for backward
    out_bytes: int  # the output: the message when a stage ends after this layer
    frozen: int = 0  # frozen parameters (model.lora, model.freeze): their weights alone, never a gradient

    def scaled(self, fixed: LayerCost | None, rows: float, rows0: float) -> LayerCost:
        """This cost (measured at `rows0` rows) at `rows` rows: `fixed` holds the part that
        does not grow with rows (None: proportional)."""
        def at(key):
            v = getattr(self, key)
            base = min(getattr(fixed, key), v) if fixed is not None else 0.0
            return base + (v - base) * rows / rows0
        return LayerCost(self.name, self.params, **{k: max(0.0, at(k)) for k in KINDS},
                         saved_bytes=round(self.saved_bytes * rows / rows0),
                         out_bytes=round(self.out_bytes * rows / rows0), frozen=self.frozen)


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
        fixed: Sequence[LayerCost | None] = self.fixed or [None] * (len(self.layers) + 1)
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


# ---- profiling ---------------------------------------------------------------
def finetune(run: Run, module) -> None:
    """The run's fine-tuning on `module`'s weights, in place: model.lora's adapters (every other
    weight frozen) and model.freeze. `pipekit train` applies it after model.init's weights and
    before the optimizer (`pipekit.run.loop.prepare_weights`); the plan's model (`whole_model`)
    is built through it too, so the two cannot differ in what is trained."""
    m = run.config.model
    if m.lora.rank:
        add_adapters(module, m.lora.targets, m.lora.rank, m.lora.alpha, m.lora.dropout, m.lora.dora,
                     seed=run.config.train.seed)
    if m.freeze is not None:
        freeze(module, m.freeze)


def whole_model(run: Run, device: str = "cpu", *, tp_group=None, sequence_parallel: bool = False):
    """The run's whole model as one pp=1 PipelineModule on `device`, its fine-tuning applied
    (`finetune`: adapters, frozen weights), and an example batch maker. `tp_group`: the tp group
    its layers are built on (a `pipekit.layers.parallel.FakeGroup` builds one tp rank's shards
    on meta, where collectives only shape); `sequence_parallel` with it."""
    cfg, mcfg = run.config, run.model
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    alone = Topology(alone=True)  # one process, no groups, also inside a job (Topology() would span it)
    if tp_group is not None:  # what PipelineModule._groups hands the layers; the grid itself stays one process
        alone.tp_group, alone.sequence_parallel = tp_group, sequence_parallel
    with default_dtype(dtype):
        module = PipelineModule(model_specs(mcfg), loss_fn=model_loss(mcfg), topology=alone,
                                partition="uniform", seed=cfg.train.seed, device=device,
                                precision=run.precision)
        finetune(run, module)
    vocab = model_vocab(mcfg)

    def batch(rows: int):
        return next(synthetic_batches(vocab, rows, cfg.train.seq_len, seed=cfg.train.seed))

    return module, batch


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


class SavedStorages:
    """While active (`with counter:`), the bytes autograd saves for backward: each storage
    counted once, whole (views of one storage are one tensor's bytes), the storages of
    `params` (so parameters and their views) left out. Works on the meta device, where
    storages have sizes but no addresses: a storage is told apart by its identity, and
    the saved tensors are kept alive until `close()` so that no identity is reused."""

    def __init__(self, params=()):
        self.skip = {self._key(p) for p in params}
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []
        self.total = 0

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        return storage._cdata if t.is_meta else storage.data_ptr()

    def __enter__(self):
        def pack(t: torch.Tensor) -> torch.Tensor:
            key = self._key(t)
            if key not in self.skip and key not in self.seen:
                self.seen.add(key)
                self.kept.append(t)
                self.total += t.untyped_storage().nbytes()
            return t
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def take(self) -> int:
        """Bytes counted since the last take."""
        n, self.total = self.total, 0
        return n

    def close(self) -> None:
        self.kept.clear()


def _time(sync, fn: Callable[..., _T], *args) -> tuple[float, _T]:
    """(seconds, result) of `fn(*args)`, the device synchronised before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return time.perf_counter() - t0, out


def _backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if outs:
        torch.autograd.backward(outs, grads)


def params_of_layer(module, i: int) -> list[torch.Tensor]:
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
    every = params_of_layer(module, i)
    params = [p for p in every if p.requires_grad]
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    out = None
    # counted apart (the hooks would slow the timed passes); a frozen weight autograd keeps is no activation
    with SavedStorages(every) as counter:
        out = module.run_layer(i, _leaf(x))
    saved, out_bytes = counter.total, _nbytes(out)
    counter.close()
    for rep in range(reps + 1):
        for split in (False, True):
            xin = _leaf(x)
            t_f, out = _time(sync, module.run_layer, i, xin)
            outs = [o for o in _floats(out) if o.requires_grad]
            grads = [torch.randn_like(o) for o in outs]
            if not split:
                t_b, _ = _time(sync, _backward, outs, grads)
                if rep:
                    times["F"].append(t_f)
                    times["B"].append(t_b)
                continue
            t_i, (_, work) = _time(sync, backward_input, outs, grads, _floats(xin), params)
            t_w, _ = _time(sync, backward_weight, work)
            if rep:
                times["I"].append(t_i)
                times["W"].append(t_w)
        for p in params:
            p.grad = None
    med = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
    n, frozen = sum(p.numel() for p in params), sum(p.numel() for p in every if not p.requires_grad)
    return LayerCost(_label(module.specs, i), n, med["F"], med["B"], med["I"], med["W"], saved, out_bytes,
                     frozen), out


def _profile_loss(module, out, labels, reps: int, sync) -> LayerCost:
    fwd, bwd = [], []
    with SavedStorages() as counter:
        module.loss_fn(_leaf(out), labels)
    saved = counter.total
    counter.close()
    for rep in range(reps + 1):
        x = _leaf(out)
        t_f, loss = _time(sync, module.loss_fn, x, labels)
        t_b, _ = _time(sync, loss.backward)
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
    intra-op threads to time with (None: leave torch's setting). The layers run on the side
    `model.kernels` picks, as `train` runs them (`pipekit plan`, schedule.partition=profile in
    the launcher and in the workers all come here)."""
    rows = rows or run.config.train.micro_batch
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with kernels(run.config.model.kernels):  # the side the run's layers take: what a run times
            return _profile_layers(run, rows, reps, device, threads or old_threads)
    finally:
        torch.set_num_threads(old_threads)


def _profile_layers(run: Run, rows: int, reps: int, device: str, threads: int) -> Profile:
    module, batch = whole_model(run, device)
    # the run's optimizer: its gradient hooks run in every backward timed below, as in a run
    _ = make_optimizer(module, run.config.optimizer, run.precision)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    _profile_rows(module, batch, rows, 0, sync)  # a whole untimed pass: the allocator's first big blocks
    layers, loss = _profile_rows(module, batch, rows, reps, sync)
    fixed = None
    if rows >= 2:
        small, small_loss = _profile_rows(module, batch, rows // 2, reps, sync)
        fixed = [_intercept(big, lit, rows, rows // 2) for big, lit in zip(layers + [loss], small + [small_loss])]
    per_param = _optimizer_seconds_per_param(run, module, sync)
    where = f"{device}, {threads} thread{'s' if threads > 1 else ''}"
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
        t_f, loss = _time(sync, forward, 0, x)
        t_b, _ = _time(sync, loss.backward)
        got = {"F": t_f, "B": t_b}
        if n > 1:
            with torch.no_grad():
                first = module.run_layer(0, x)
            inp = _leaf(first)
            loss = forward(1, inp)
            t_i, (_, work) = _time(sync, backward_input, [loss], [None], _floats(inp), params)
            t_w, _ = _time(sync, backward_weight, work)
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
    return LayerCost(big.name, big.params, **{k: cut(k) for k in KINDS}, saved_bytes=0, out_bytes=0,
                     frozen=big.frozen)


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
        t, _ = _time(sync, opt.step)
        runs.append(t)
    return statistics.median(runs) / sum(p.numel() for p in params)


def too_large_to_profile(run: Run, device: str) -> str | None:
    """Why timing `run`'s layers in this process is out of reach (None: it is not): the whole
    model's weights, gradients and a timed fp32 optimizer (about 6 copies of the weights)
    over half this machine's memory, or on the CPU, one microbatch's forward and backward
    (6 FLOPs per parameter and token) over `PROFILE_CPU_FLOP_LIMIT`."""
    from ..models import count_params

    params = count_params(run.model)
    width = 8 if run.config.train.dtype == "float64" else 4
    need = 6 * width * params
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        have = None
    if have and need > have / 2:
        return (f"{params:,} parameters need about {need / 2**30:.0f} GiB to profile, over half this machine's "
                f"{have / 2**30:.0f} GiB")
    flops = 6 * params * run.config.train.micro_batch * run.config.train.seq_len
    if not device.startswith("cuda") and flops > PROFILE_CPU_FLOP_LIMIT:
        return (f"one microbatch's forward and backward is {flops:.2g} FLOPs, over the "
                f"{PROFILE_CPU_FLOP_LIMIT:.0e} a CPU profile is allowed")
    return None


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    """`F.scaled_dot_product_attention` on meta tensors as the fused kernel a real run takes
    (on meta torch picks its math path, which saves the (T, T) score matrix; the CPU flash
    kernel, like CUDA's flash and memory-efficient ones, saves q, k, v, the output and a
    per-row log-sum-exp). Other calls (a mask, real tensors) go to torch's own."""
    real = F.scaled_dot_product_attention

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if q.is_meta and attn_mask is None and not kwargs.get("enable_gqa", False):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, scale=scale)[0]
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)

    F.scaled_dot_product_attention = fused  # type: ignore[assignment]  # undone below
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def meta_saved(run: Run, rows: int, *, tp_group=None, sequence_parallel: bool = False) -> list[tuple[int, int]]:
    """Per layer, (bytes autograd saves, output bytes) of one microbatch of `rows` rows, by one
    forward of the run's layers on the meta device (built on `tp_group`, a stand-in group, and
    sequence parallel when asked) under `SavedStorages`, attention as the fused kernel a real
    run takes; the loss's saved bytes folded into the last layer. Nothing is allocated."""
    module, batch = whole_model(run, "meta", tp_group=tp_group, sequence_parallel=sequence_parallel)
    module.train()
    x, labels = (t.to("meta") for t in batch(rows))
    counter = SavedStorages(list(module.parameters()))  # frozen weights too; buffers count (rotary tables)
    out, found = x, []
    try:
        with counter, torch.enable_grad(), _fused_attention_on_meta():
            for i in range(len(module.specs)):
                out = module.run_layer(i, out)
                found.append([counter.take(), _nbytes(out)])
            module.loss_fn(out, labels)
            found[-1][0] += counter.take()
    finally:
        counter.close()
    return [(saved, size) for saved, size in found]


def flop_layers(run: Run, *, rows: int | None = None, flops_per_second: float | None = None) -> Profile:
    """The layer table from FLOP counts (torch's FlopCounterMode) on the meta device:
    seconds = FLOPs / `flops_per_second` (default: logging.peak_tflops, or 1 TFLOP/s).
    A backward's halves are counted apart: I the FLOPs of the gradients of the layer's input
    alone, W = B - I (what the weight gradients add; a frozen layer's, the adapters' alone, so
    near zero; a first layer, whose input takes no gradient, all of B). Saved bytes: `meta_saved` (the
    count the memory plan makes; the FLOP pass keeps torch's unfused meta attention, whose
    FLOPs torch counts)."""
    rows = rows or run.config.train.micro_batch
    rate = flops_per_second or ((run.config.logging.peak_tflops or 0) * 1e12) or NOMINAL_FLOPS
    module, batch = whole_model(run, "meta")
    x, labels = (t.to("meta") for t in batch(rows))
    saved = meta_saved(run, rows)  # what each layer saves, as the memory plan counts it (attention fused)
    layers = []
    out = x
    for i in range(len(module.specs)):
        every = params_of_layer(module, i)
        params = [p for p in every if p.requires_grad]
        xin = _leaf(out)
        with FlopCounterMode(display=False) as fwd:
            out = module.run_layer(i, xin)
        outs = [o for o in _floats(out) if o.requires_grad]
        grads = [torch.ones_like(o) for o in outs]
        inputs = _floats(xin)
        with FlopCounterMode(display=False) as inp:  # the input gradients alone: the split backward's I
            if outs and inputs:
                torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
        with FlopCounterMode(display=False) as bwd:
            if outs:
                torch.autograd.backward(outs, grads)
        f, b, i_part = (c.get_total_flops() / rate for c in (fwd, bwd, inp))
        layers.append(LayerCost(_label(module.specs, i), sum(p.numel() for p in params), f, b, min(i_part, b),
                                max(0.0, b - i_part), saved[i][0], _nbytes(out),
                                sum(p.numel() for p in every if not p.requires_grad)))
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
def _ping(sizes: list[int], reps: int) -> dict[int | str, float]:
    """On each of two gloo ranks: half the median round trip of a message of each size,
    and of a one-element all-reduce."""
    rank = dist.get_rank()
    out: dict[int | str, float] = {}

    def lap(fn, *args) -> float:
        laps = []
        for _ in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            fn(*args)
            laps.append(time.perf_counter() - t0)
        return statistics.median(laps[2:])

    for n in sizes:
        buf = torch.zeros(max(1, n // 4))
        if rank == 0:
            out[n] = lap(_send_then_recv, buf, 1) / 2
        else:
            out[n] = lap(_recv_then_send, buf, 0) / 2
    for n in sizes:  # what posting an isend costs the sender (the engine's SEND), its receive posted ahead
        buf, posts = torch.zeros(max(1, n // 4)), []
        for _ in range(reps + 2):
            work = dist.irecv(buf, 0) if rank == 1 else None
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                work = dist.isend(buf, 1)
                posts.append(time.perf_counter() - t0)
            assert work is not None  # two ranks: 1 posted the receive, 0 the send
            work.wait()
        out[f"post {n}"] = statistics.median(posts[2:]) if posts else 0.0
    flag = torch.zeros(1)
    out["collective"] = lap(dist.all_reduce, flag)
    return out


def _send_then_recv(buf: torch.Tensor, peer: int) -> None:
    dist.send(buf, peer)
    dist.recv(buf, peer)


def _recv_then_send(buf: torch.Tensor, peer: int) -> None:
    dist.recv(buf, peer)
    dist.send(buf, peer)


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
