"""PipelineEngine: walk this rank's action list, then reduce gradients and step.

One optimizer step (`train_batch`) is:

1. read this rank's batch, split it into M microbatches (only the rank of the
   first stage needs the inputs and only the rank of the last the labels; see
   "Data" below);
2. run this rank's lowered action list from the schedule, one handler per
   action kind: F, B (full backward), I (input grads only) and W (weight
   grads only; see `pipekit.split_backward`), SEND_F/RECV_F, SEND_B/RECV_B;
3. wait for the posted sends; sum the gradients of tied layers over the
   pipeline ranks that hold them; average all gradients over the
   data-parallel group (one flat all-reduce per dtype);
4. step the optimizer and return the loss (see "The loss" below).

The schedule is declared once: on the module (`PipelineModule(schedule=...)`,
which the engine then runs), or here as a `pipekit.schedules.Schedule` or a
registered name (built for the module's pp, chunks and microbatches); its
placement of virtual stages must be the module's, and a name given to both must
agree. The eval program is its forwards alone, itself a validated Schedule.

Data: `train_batch(data)` / `eval_batch(data)` take the batch `(inputs,
labels)` itself (a tuple or a list, as a DataLoader gives it) or an iterator
of batches. A rank that holds no stage reading the inputs (stage 0) may pass
None for them, a rank without the last stage None for the labels, a middle
rank None for the whole batch (`train_batch()`). Receive buffers are sized
from the shapes of a microbatch's inputs, agreed once, at the first step
(train or eval; see `_InputShapes`): the rank of stage 0 posts its shapes to
the other pipeline ranks and each tells it whether it was given inputs, so
all ranks always agree on what is exchanged and later steps exchange nothing.
If every rank was given its inputs then, shapes may change from step to step
(each rank sizes from its own) and a rank that later passes None fails with
an error saying why; if some rank was given none, the first step's shapes are
fixed (as torch.distributed.pipelining fixes them at its first step) and the
rank of stage 0 refuses inputs of other shapes, naming both, before sending
anything. A rank that lacks data one of its stages reads gets an error naming
the rank, its stages and what is missing.

The loss of each microbatch is weighted before its backward so that the
gradients are those of the loss of the whole batch, as in one process: by
1/M, or, for a token-level loss (one with an `ignore_index`), by its share
of the valid tokens of the global batch (see `_loss_weights`).

The loss returned costs no communication by default: on the ranks holding the
last stage, a detached 0-dim float64 tensor, the loss of this data-parallel
replica's batch as one process would compute it on that batch (for a token-level
loss, the mean over its valid tokens); None on the other ranks (as
torch.distributed.pipelining gives losses on the last stage only). With
`reduce_loss=True` (a collective: every rank passes the same) it is the loss of
the whole global batch as a Python float on every rank (DeepSpeed's
`train_batch`): one all-reduce over pp, one over dp and a host sync.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from . import auxloss, comm, split_backward
from .optim import ZeroOptimizer
from .pipeline import PipelineModule, check_interleaving
from .schedules import SCHEDULES, Action, Kind, Schedule, TimelineEvent, build_schedule
from .schedules.ir import WEIGHT_GRAD_KINDS
from .topology import DEFAULT_TIMEOUT


class PipelineError(RuntimeError):
    """An action failed; the message names the rank, the action and shows the rank's action list."""


def split_microbatches(batch, num_microbatches: int, what: str) -> list:
    """Split a tensor or tuple of tensors along dim 0 into equal microbatches."""
    items = batch if isinstance(batch, tuple) else (batch,)
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] % num_microbatches:
            size = t.shape[0] if t.dim() else "a scalar"
            raise ValueError(
                f"{what} batch size {size} does not split into {num_microbatches} microbatches; "
                f"use a batch size that is a multiple of {num_microbatches}"
            )
    parts = [t.chunk(num_microbatches) for t in items]
    return [tuple(p[m] for p in parts) if isinstance(batch, tuple) else parts[0][m] for m in range(num_microbatches)]


def _leaf(x):
    """Detach an activation handed to the next stage; float tensors get their own grad."""
    if isinstance(x, tuple):
        return tuple(_leaf(t) for t in x)
    return x.detach().requires_grad_(x.is_floating_point())


def _rebuild(template, tensors: list[torch.Tensor]):
    """Give received tensors the structure (tensor or tuple) of `template`."""
    return tuple(tensors) if isinstance(template, tuple) else tensors[0]


def _to_device(x, device: torch.device):
    """Move a tensor or tuple of tensors (as a data loader gives them, on the CPU) to `device`."""
    if isinstance(x, tuple):
        return tuple(_to_device(t, device) for t in x)
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


def _next_batch(data):
    """The batch itself (a pair or list of two, or None), or the next item of an iterator."""
    if data is None or isinstance(data, (tuple, list)):
        return data
    if not hasattr(data, "__next__"):
        raise TypeError(f"expected a batch (inputs, labels) or an iterator of batches, got {type(data).__name__}; "
                        "pass iter(loader) for a DataLoader")
    return next(data)


def _shapes(x) -> tuple:
    """(is a tuple, ((shape, dtype), ...)) of a microbatch's inputs: what sizes every buffer."""
    return isinstance(x, tuple), tuple((tuple(t.shape), t.dtype) for t in _all_tensors(x))


def _shapes_to_json(shapes: tuple) -> list:
    return [shapes[0], [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in shapes[1]]]


def _shapes_from_json(obj: list) -> tuple:
    return bool(obj[0]), tuple((tuple(shape), getattr(torch, dtype)) for shape, dtype in obj[1])


def _meta_of(shapes: tuple):
    """Meta tensors of the shapes recorded by `_shapes`."""
    is_tuple, items = shapes
    metas = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in items)
    return metas if is_tuple else metas[0]


def _shape_text(shapes: tuple) -> str:
    items = ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in shapes[1])
    return f"({items})" if shapes[0] else items


def _cast_floats(x, dtype: torch.dtype | None):
    """Cast the floating-point tensors of a tensor or tuple to `dtype` (None: unchanged)."""
    if dtype is None:
        return x
    if isinstance(x, tuple):
        return tuple(_cast_floats(t, dtype) for t in x)
    return x.to(dtype) if x.is_floating_point() else x


def _name(schedule) -> str:
    """A schedule's name, given the name or the Schedule."""
    return schedule if isinstance(schedule, str) else schedule.name


def _all_tensors(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, tuple) else [x]


class _InputShapes:
    """The microbatch input shapes that size every receive buffer, agreed at the first step.

    At its first step the rank holding stage 0 (the owner) posts its shapes to every
    other pipeline rank (a length and a JSON text, before any action), and each of
    them posts the owner one flag: whether it was given inputs. The others wait for
    the shapes before their first action; the owner reads the flags after its last
    (so a silent peer still fails at a named action). No later step communicates: a
    rank given inputs sizes from them (so shapes may change between steps while every
    rank passes inputs); a rank given none at the first step takes that step's shapes
    for good, so the owner then refuses inputs of other shapes, and a rank that was
    given inputs then cannot do without them later (it could not know the shapes).
    """

    def __init__(self, engine: PipelineEngine):
        self.topo, self.timeout = engine.topo, engine.timeout
        self.stages = engine.module.local_stages
        self.owner = engine.module.stage_rank(0)
        self.first: tuple | None = None  # the owner's shapes at the first step
        self.had_inputs: bool | None = None  # this rank's inputs at the first step (None: no step yet)
        self.without: list[int] = []  # known on the owner after the first step: pp ranks given no inputs
        self._flags: dict = {}  # on the owner during the first step: pp rank -> (posted receive, flag)

    def _where(self) -> str:
        t = self.topo
        return f"rank {t.rank} (pp_rank {t.pp_rank}, dp_rank {t.dp_rank}, stages {self.stages})"

    def example(self, example, posted: list):
        """The microbatch inputs `example` (None: none given), or meta tensors shaped as the
        first step's, to size this step's buffers; the first step's sends go to `posted`."""
        mine = None if example is None else _shapes(example)
        if self.had_inputs is None:
            self._first_step(mine, posted)
        if mine is None:
            if self.had_inputs:
                raise ValueError(
                    f"{self._where()} got no inputs, but it was given them at the first step, so the rank of "
                    f"stage 0 does not hold the shapes fixed and this rank cannot know them; pass None for the "
                    "inputs from the first step on (the shapes then stay the first step's), or pass them every step"
                )
            return _meta_of(self.first)
        if self.topo.pp_rank == self.owner:
            fixed = self.without
        else:
            fixed = [] if self.had_inputs else [self.topo.pp_rank]
        if fixed and mine != self.first:
            raise ValueError(
                f"{self._where()}: the inputs' microbatch shapes changed from {_shape_text(self.first)} at the "
                f"first step to {_shape_text(mine)}, but pipeline rank(s) {fixed} passed no inputs then and size "
                "their buffers from the first step's shapes; keep the shapes fixed, or pass the inputs on every "
                "pipeline rank from the first step on"
            )
        return example

    def _first_step(self, mine: tuple | None, posted: list) -> None:
        t, device = self.topo, self.topo.device
        self.had_inputs = mine is not None
        if t.pp == 1:
            self.first = mine
            return
        if t.pp_rank == self.owner:
            self.first = mine
            text = torch.tensor(list(json.dumps(_shapes_to_json(mine)).encode()), dtype=torch.uint8, device=device)
            length = torch.tensor([text.numel()], dtype=torch.int64, device=device)
            for r in range(t.pp):
                if r != self.owner:
                    posted += comm.send([length, text], t.global_rank(r))
                    flag = torch.zeros(1, dtype=torch.int64, device=device)
                    self._flags[r] = (dist.irecv(flag, src=t.global_rank(r)), flag)
            return
        owner = t.global_rank(self.owner)
        posted += comm.send([torch.tensor([int(self.had_inputs)], dtype=torch.int64, device=device)], owner)
        try:
            (length,) = comm.recv([torch.empty(1, dtype=torch.int64, device="meta")], owner, device, self.timeout)
            (text,) = comm.recv([torch.empty(int(length), dtype=torch.uint8, device="meta")], owner, device,
                                self.timeout)
        except (comm.PeerTimeout, comm.PeerClosed) as e:
            raise type(e)(f"{self._where()} waiting for the inputs' shapes from rank {owner} (stage 0) at the "
                          f"first step: {e}") from e
        self.first = _shapes_from_json(json.loads(bytes(text.cpu().tolist()).decode()))
        if mine is not None and mine != self.first:
            raise ValueError(f"{self._where()}: its inputs' microbatch shapes {_shape_text(mine)} differ from those "
                             f"of rank {owner} (stage 0), {_shape_text(self.first)}; pass the same batch on every "
                             "pipeline rank of a data-parallel replica, or None where it is not needed")

    def finish_first_step(self) -> None:
        """On the owner after its first step: read which ranks were given no inputs."""
        flags, self._flags = self._flags, {}
        for r, (work, flag) in flags.items():
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as e:
                raise comm.PeerTimeout(f"{self._where()}: no word from pp_rank {r} on its inputs at the first "
                                       f"step ({e})") from e
            if not flag.item():
                self.without.append(r)


class PipelineEngine:
    """Trains a PipelineModule with a pipeline schedule.

    Args:
        module: this rank's PipelineModule.
        optimizer: a torch optimizer over `module.parameters()` (None: eval only).
        schedule: None (default): the module's (`PipelineModule(schedule=...)`),
            or "1f1b" when the module declares none. Else a
            `pipekit.schedules.Schedule`, or the name of a registered one
            ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", ...; see
            `pipekit.schedules.SCHEDULES`), built for the module's pp and
            chunks_per_rank. Its placement must be the module's, and its name the
            module's schedule's when the module declares one.
            "interleaved_1f1b" with one chunk per rank is refused (it would be
            plain 1F1B).
        num_microbatches: M, microbatches per optimizer step (default: the
            Schedule's, or 1 with a name).
        record_timeline: keep every action's measured start/end (seconds since
            `self.step_start`, a `time.perf_counter()` reading) in `self.timeline`,
            in the simulator's format.
        timeout: how long a receive waits before failing with the rank,
            action and microbatch named.
        clip_grad_norm: clip the gradients to this global L2 norm (over every
            parameter of the model, each counted once) before the step.
        lr_scheduler: stepped after every optimizer step.
        recv_ahead: how many of this rank's next receives are kept posted
            ahead of their RECV actions (default 4; 0: each is posted when its
            action runs). A message whose receive is already posted is
            delivered without the receiver's round trip (see `pipekit.comm`);
            each costs one stage-boundary buffer of memory until it is used.
    """

    def __init__(
        self,
        module: PipelineModule,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        schedule: str | Schedule | None = None,
        num_microbatches: int | None = None,
        record_timeline: bool = False,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        clip_grad_norm: float | None = None,
        lr_scheduler=None,
        recv_ahead: int = 4,
    ):
        if isinstance(recv_ahead, bool) or not isinstance(recv_ahead, int) or recv_ahead < 0:
            raise ValueError(f"recv_ahead must be an int >= 0 (receives posted before they are needed; 0: each "
                             f"when its RECV action runs), got {recv_ahead!r}")
        self.recv_ahead = recv_ahead
        self.module = module
        self.optimizer = optimizer
        if (optimizer is not None and not isinstance(optimizer, ZeroOptimizer) and getattr(module.topology, "ep", 1) > 1
                and any(getattr(p, "expert_parallel", False) for p in module.parameters())):
            raise ValueError("expert parallelism (ep > 1) needs pipekit.optim.ZeroOptimizer (any stage): a plain "
                             "torch optimizer's gradients would be averaged over the whole dp group, but each "
                             "expert lives on one rank of its ep group")
        self.clip_grad_norm = clip_grad_norm
        self.lr_scheduler = lr_scheduler
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.topo = module.topology
        self.timeout = timeout
        self.schedule: Schedule = self._resolve_schedule(schedule, num_microbatches)
        self.num_microbatches = self.schedule.microbatches
        self.actions = list(self.schedule.ranks[self.topo.pp_rank])
        self.eval_actions = list(self.schedule.forward_only().ranks[self.topo.pp_rank])
        self.last_stage = module.num_stages - 1
        self.record_timeline = record_timeline
        self.timeline: list[TimelineEvent] = []
        self.handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._backward_input,
            Kind.W: self._backward_weight,
            Kind.SEND_F: self._send_forward,
            Kind.RECV_F: self._recv_forward,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_B: self._recv_backward,
        }
        self.tie_groups = module.tie_groups
        self.zero = isinstance(optimizer, ZeroOptimizer)
        if optimizer is not None and module.precision != "fp32" and not self.zero:
            raise ValueError(f"precision={module.precision!r} needs fp32 master weights: pass "
                             f"optimizer=pipekit.optim.ZeroOptimizer(module, ...) (any stage) instead of "
                             f"{type(optimizer).__name__}")
        if self.zero and clip_grad_norm is not None:
            optimizer.clip_grad_norm = clip_grad_norm
        self._stage_params = {s: self._params_of_stage(s) for s in module.local_stages}
        self._final_params = self._params_final_after()
        self._io_meta: list | None = None
        self._io_key = None
        self._shapes = _InputShapes(self)

    # ---- set-up -------------------------------------------------------
    def _resolve_schedule(self, schedule, num_microbatches) -> Schedule:
        """The Schedule to run: the given one or the module's, checked against the module
        (same pp, same placement, the same name as the module's declared schedule)."""
        module, pp = self.module, self.topo.pp
        declared = getattr(module, "schedule", None)
        if schedule is not None and not isinstance(schedule, (str, Schedule)):
            raise TypeError(f"schedule must be a registered name ({', '.join(SCHEDULES)}) or a "
                            f"pipekit.schedules.Schedule, got {type(schedule).__name__}")
        if schedule is None and declared is None and module.chunks_per_rank > 1:
            raise ValueError(
                f"the module holds {module.chunks_per_rank} virtual stages per rank (placement "
                f"{module.placement}) but declares no schedule to run them; declare it once: "
                "PipelineModule(..., schedule='interleaved_1f1b' (or 'zbv', 'dualpipe_v', a Schedule)), "
                "or pass schedule= to PipelineEngine"
            )
        if schedule is None:
            schedule = declared if declared is not None else "1f1b"
        elif declared is not None and _name(schedule) != _name(declared):
            raise ValueError(
                f"the module was built for schedule {_name(declared)!r} but the engine was given "
                f"{_name(schedule)!r}; declare the schedule once: PipelineModule(..., schedule=...) and "
                "leave PipelineEngine's schedule out"
            )
        if isinstance(schedule, str) and isinstance(declared, Schedule):
            if num_microbatches in (None, declared.microbatches):
                schedule = declared  # the module's own Schedule, by its name
        if isinstance(schedule, str):
            check_interleaving(schedule, module.chunks_per_rank)
            schedule = build_schedule(schedule, pp, 1 if num_microbatches is None else num_microbatches,
                                      module.chunks_per_rank)
        elif num_microbatches is not None and num_microbatches != schedule.microbatches:
            raise ValueError(f"num_microbatches={num_microbatches}, but schedule {schedule.name!r} runs "
                             f"{schedule.microbatches}; leave num_microbatches out to take the schedule's")
        if schedule.pp != pp:
            raise ValueError(f"schedule {schedule.name!r} is for pp={schedule.pp}, but the topology has pp={pp}")
        check_interleaving(schedule.name, schedule.chunks_per_rank)
        if schedule.placement != module.placement:
            generator = SCHEDULES.get(schedule.name)
            named = getattr(generator, "placement", None)
            hint = f" or placement={named!r}" if isinstance(named, str) else ""
            chunks = f", chunks_per_rank={schedule.chunks_per_rank}"
            declare = (f"schedule={schedule.name!r}" + (chunks if generator.chunks_per_rank is None else "")
                       if generator is not None else "schedule=<the Schedule>")
            raise ValueError(
                f"schedule {schedule.name!r} places virtual stages on ranks {schedule.placement}, but the module "
                f"was built with placement {module.placement}; declare the schedule on the module: "
                f"PipelineModule(..., {declare}) (or placement=<the Schedule>{hint}{chunks})"
            )
        return schedule

    def _params_of_stage(self, stage: int) -> list:
        """The parameters a backward pass over `stage` gives gradients to (tied layers included)."""
        from .spec import TiedLayerSpec

        params = []
        for i in self.module.stage_layers(stage):
            spec = self.module.specs[i]
            if isinstance(spec, TiedLayerSpec):
                params += list(self.module.tied[spec.key].parameters())
            elif str(i) in self.module.layers:
                params += list(self.module.layers[str(i)].parameters())
        return params

    def _params_final_after(self) -> dict[tuple[int, int], list]:
        """(stage, microbatch) of a backward action -> the parameters whose gradients are
        complete for the step once it has run (its stage's last backward, or for a layer
        used by two local stages, the later of theirs)."""
        last = {a.stage: (i, a.microbatch) for i, a in enumerate(self.actions) if a.kind in WEIGHT_GRAD_KINDS}
        final: dict[int, tuple] = {}  # id(p) -> (action index, stage, microbatch, p)
        for s, params in self._stage_params.items():
            if s not in last:
                continue
            i, mb = last[s]
            for p in params:
                if id(p) not in final or i > final[id(p)][0]:
                    final[id(p)] = (i, s, mb, p)
        out: dict[tuple[int, int], list] = {}
        for _, s, mb, p in final.values():
            out.setdefault((s, mb), []).append(p)
        return out

    def _stage_io(self, example_input) -> list:
        key = tuple((t.shape, t.dtype) for t in _all_tensors(example_input))
        if key != self._io_key:
            self._io_meta = self.module.stage_io_meta(example_input)
            self._io_key = key
        return self._io_meta

    # ---- the public steps ---------------------------------------------
    def train_batch(self, data=None, *, reduce_loss: bool = False):
        """One optimizer step over `num_microbatches` microbatches of one batch.

        `data` is the batch `(inputs, labels)` itself (a tuple or a list), or an
        iterator whose `next()` gives it (`iter(loader)`, a generator): this
        data-parallel rank's share. Only the rank holding stage 0 needs the
        inputs and only the rank holding the last stage the labels; the others
        may pass None in their place, or None for the whole batch (shapes: see
        the module docstring).

        Returns, by default without any communication, this dp replica's loss
        over its batch as a detached 0-dim float64 tensor on the ranks holding
        the last stage, and None on the others. `reduce_loss=True` returns the
        loss of the global batch (as in one process) as a float on every rank: a
        collective (an all-reduce over pp and over dp), so every rank must pass it.
        The gradients and the step are the same either way."""
        if self.optimizer is None:
            raise RuntimeError("train_batch needs an optimizer; pass optimizer=... to PipelineEngine")
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._run(self.actions, _next_batch(data), training=True)
        if self.zero:  # reduction, unscaling, overflow check and clipping happen inside
            self.optimizer.step()
            self.last_grad_norm = self.optimizer.last_grad_norm
            self.last_step_skipped = self.optimizer.last_step_skipped
        else:
            self._reduce_gradients()
            self._clip_gradients()
            self.optimizer.step()
            self.last_step_skipped = False
        if self.lr_scheduler is not None and not self.last_step_skipped:
            self.lr_scheduler.step()
        return self._step_loss(reduce_loss)

    @torch.no_grad()
    def eval_batch(self, data=None, return_outputs: bool = False, *, reduce_loss: bool = False):
        """Forward only, on the same data as `train_batch` (None where a rank needs none).
        Returns the loss as `train_batch` does (None without a loss_fn), or `(loss, outputs)`
        with the last stage's outputs concatenated over microbatches (None off the last stage)."""
        self.module.eval()
        self._run(self.eval_actions, _next_batch(data), training=False)
        loss = self._step_loss(reduce_loss) if self.module.has_loss else None
        if not return_outputs:
            return loss
        outs = self._outputs if self.last_stage in self.module.local_stages else None
        if outs is not None:
            outs = torch.cat(outs) if isinstance(outs[0], torch.Tensor) else tuple(map(torch.cat, zip(*outs)))
        return loss, outs

    # ---- this rank's data -----------------------------------------------
    def _prepare(self, batch):
        """Check, move and split this rank's batch into `_micro_in` / `_micro_labels` (None
        where not given); returns the first microbatch's inputs (None: no inputs given)."""
        if batch is None:
            inputs = labels = None
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, labels = (tuple(x) if isinstance(x, list) else x for x in batch)  # a DataLoader's lists
        else:
            size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
            raise TypeError(f"a batch must be a pair (inputs, labels), or None on a rank that needs no data; "
                            f"got {type(batch).__name__}{size}")
        self._check_needs(inputs, labels)
        self._micro_in = self._micro_labels = None
        if inputs is not None:
            inputs = _cast_floats(_to_device(inputs, self.topo.device), self.module.param_dtype)
            self._micro_in = split_microbatches(inputs, self.num_microbatches, "inputs")
        if labels is not None:
            labels = _to_device(labels, self.topo.device)
            self._micro_labels = split_microbatches(labels, self.num_microbatches, "labels")
        return None if self._micro_in is None else self._micro_in[0]

    def _check_needs(self, inputs, labels) -> None:
        """Raise, naming this rank and its stages, when it lacks data one of its stages reads."""
        local, need = self.module.local_stages, []
        if inputs is None and 0 in local:
            need.append("the inputs (stage 0 reads them)")
        if labels is None and self.last_stage in local and self.module.has_loss:
            need.append(f"the labels (the last stage, {self.last_stage}, computes the loss)")
        if need:
            t = self.topo
            raise ValueError(f"rank {t.rank} (pp_rank {t.pp_rank}, dp_rank {t.dp_rank}) holds stages {local} and "
                             f"needs {' and '.join(need)}, but got None; pass them on this rank")

    # ---- the action loop ----------------------------------------------
    def _run(self, actions: list[Action], batch, *, training: bool) -> None:
        example = self._prepare(batch)
        self._posted: list = []
        self._io = self._stage_io(self._shapes.example(example, self._posted))
        self._weights, self._local_weights = self._loss_weights()
        self._training = training
        self._stash: dict = {}  # (stage, mb) -> (stage input, stage output or scaled loss)
        self._inbox: dict = {}  # (stage, mb) -> stage input (received, or from a local stage)
        self._grads: dict = {}  # (stage, mb) -> grads of the stage's float outputs
        self._weight_work: dict = {}  # (stage, mb) -> what W still has to do after I
        self._outbox: dict = {}  # (stage, kind, mb) -> tensors waiting for their SEND
        self._losses: list[torch.Tensor] = []  # each microbatch's loss, weighted for the global batch
        self._raw_losses: list[torch.Tensor] = []  # each microbatch's loss as computed
        self._outputs: list = []
        self.timeline = []
        self._recv_due = collections.deque(a for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B))
        self._recv_posted: collections.deque = collections.deque()  # (action, comm.PostedRecv), program order
        self.step_start = t0 = time.perf_counter()  # timeline times are relative to this (a machine-wide clock)
        self._post_receives()
        for step, action in enumerate(actions):
            start = time.perf_counter()
            try:
                self.handlers[action.kind](action)
            except Exception as e:
                raise PipelineError(self._failure_report(actions, step, e)) from e
            if self.record_timeline:
                self.timeline.append(TimelineEvent(self.topo.pp_rank, str(action), start - t0, time.perf_counter() - t0))
        comm.wait_all(self._posted, self.timeout)
        self._shapes.finish_first_step()
        leftover = [*self._stash, *self._inbox, *self._grads, *self._weight_work] if training else []
        assert not leftover, f"rank {self.topo.rank}: unconsumed activations/grads after the step: {leftover}"

    def _failure_report(self, actions: list[Action], step: int, error: Exception) -> str:
        a = actions[step]
        lines = [
            f"rank {self.topo.rank} (pp_rank {self.topo.pp_rank}, dp_rank {self.topo.dp_rank}) failed at action "
            f"#{step} {a} (stage {a.stage}, {a.kind.value}, microbatch {a.microbatch}): {type(error).__name__}: {error}",
            "this rank's actions:",
        ]
        for i, b in enumerate(actions):
            lines.append(f"  {'>>' if i == step else '  '} {i:4d} {b}")
        return "\n".join(lines)

    # ---- handlers -----------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        x = self._micro_in[m] if s == 0 else self._inbox.pop((s, m))
        out = self.module.forward_stage(s, x)
        self._check_shapes(out, self._io[s][1], f"stage {s} output")
        if s == self.last_stage:
            self._finish_forward(x, out, m)
            return
        if self._training:
            self._stash[(s, m)] = (x, out)
        if self.module.stage_rank(s + 1) == self.topo.pp_rank:
            self._inbox[(s + 1, m)] = _leaf(out) if self._training else out
        else:
            self._outbox[(s, Kind.SEND_F, m)] = _all_tensors(out)

    def _finish_forward(self, x, out, m: int) -> None:
        if not self.module.has_loss:
            if self._training:
                raise RuntimeError("training needs a loss; pass loss_fn=... to PipelineModule")
            self._outputs.append(out)
            return
        loss = self.module.loss_fn(_cast_floats(out, torch.float32 if self.module.param_dtype else None),
                                   self._micro_labels[m])
        self._losses.append(loss.detach() * self._weights[m])
        self._raw_losses.append(loss.detach())
        if self._training:
            scale = self.optimizer.loss_scale if self.zero else 1.0
            self._stash[(self.last_stage, m)] = (x, loss * (scale * self._weights[m]))
        else:
            self._outputs.append(out)

    def _backward(self, a: Action) -> None:
        """B: the full backward of (stage, microbatch): input grad and weight grads."""
        s, m = a.stage, a.microbatch
        x, outs, grads = self._backward_operands(s, m)
        with self._weight_pass(s, m), self._aux_scale():
            if outs:
                torch.autograd.backward(outs, grads)
        self._hand_back(s, m, [t.grad if t.grad is not None else torch.zeros_like(t) for t in comm.float_entries(x)])

    def _backward_input(self, a: Action) -> None:
        """I: only the input grad; what the weight grads need is kept for W."""
        s, m = a.stage, a.microbatch
        x, outs, grads = self._backward_operands(s, m)
        inputs = comm.float_entries(x) if s > 0 else []
        with self._aux_scale():
            input_grads, work = split_backward.backward_input(outs, grads, inputs, self._stage_params[s])
        self._weight_work[(s, m)] = work
        self._hand_back(s, m, input_grads)

    def _backward_weight(self, a: Action) -> None:
        """W: the weight grads of (stage, microbatch), from where its I stopped."""
        s, m = a.stage, a.microbatch
        if (s, m) not in self._weight_work:
            raise RuntimeError(f"weight grads of microbatch {m} on stage {s} before its input grads (I)")
        with self._weight_pass(s, m), self._aux_scale():
            split_backward.backward_weight(self._weight_work.pop((s, m)))

    def _backward_operands(self, s: int, m: int):
        """(stage input, outputs to differentiate, their grads) of (stage, microbatch)."""
        if (s, m) not in self._stash:
            raise RuntimeError(f"backward of microbatch {m} on stage {s} before its forward")
        x, out = self._stash.pop((s, m))
        if s == self.last_stage:
            return x, [out], [None]  # the weighted (and fp16-scaled) loss
        pairs = [(o, g) for o, g in zip(comm.float_entries(out), self._grads.pop((s, m))) if o.requires_grad]
        return x, [o for o, _ in pairs], [g for _, g in pairs]

    def _weight_pass(self, s: int, m: int):
        """A pass that accumulates stage s's parameter grads (inside ZeRO's bucketing)."""
        if not self.zero:
            return contextlib.nullcontext()
        return self.optimizer.backward_pass(self._stage_params[s], self._final_params.get((s, m), ()))

    def _aux_scale(self):
        """A layer's auxiliary loss (pipekit.auxloss.attach) counts as the mean over microbatches,
        scaled like the main loss for fp16."""
        return auxloss.scaled_backward((self.optimizer.loss_scale if self.zero else 1.0) / self.num_microbatches)

    def _hand_back(self, s: int, m: int, grads: list) -> None:
        """Give the input grad of (stage, microbatch) to the previous stage: local, or sent."""
        if s == 0:
            return
        if self.module.stage_rank(s - 1) == self.topo.pp_rank:
            self._grads[(s - 1, m)] = grads
        else:
            self._outbox[(s, Kind.SEND_B, m)] = grads

    def _peer(self, stage: int) -> int:
        return self.topo.global_rank(self.module.stage_rank(stage))

    def _send_forward(self, a: Action) -> None:
        self._posted += comm.send(self._outbox.pop((a.stage, Kind.SEND_F, a.microbatch)), self._peer(a.stage + 1))

    def _send_backward(self, a: Action) -> None:
        self._posted += comm.send(self._outbox.pop((a.stage, Kind.SEND_B, a.microbatch)), self._peer(a.stage - 1))

    def _recv_forward(self, a: Action) -> None:
        x = _rebuild(self._io[a.stage][0], self._received(a))
        self._inbox[(a.stage, a.microbatch)] = _leaf(x) if self._training else x

    def _recv_backward(self, a: Action) -> None:
        self._grads[(a.stage, a.microbatch)] = self._received(a)

    def _post_receives(self, at_least: int = 0) -> None:
        """Keep the next `recv_ahead` (or `at_least`) receives of this rank's program posted, in
        program order: the order the peers send in."""
        while self._recv_due and len(self._recv_posted) < max(self.recv_ahead, at_least):
            a = self._recv_due.popleft()
            if a.kind is Kind.RECV_F:
                like, src = _all_tensors(self._io[a.stage][0]), self._peer(a.stage - 1)
            else:
                like, src = comm.float_entries(self._io[a.stage][1]), self._peer(a.stage + 1)
            self._recv_posted.append((a, comm.post_recv(like, src, self.topo.device)))

    def _received(self, a: Action) -> list[torch.Tensor]:
        """The tensors of RECV action `a`, the next posted receive (posted now if none is)."""
        self._post_receives(at_least=1)
        head, posted = self._recv_posted.popleft()
        assert head == a, f"rank {self.topo.rank}: receive for {head} posted, but the program runs {a}"
        self._post_receives()
        return comm.wait_recv(posted, self.timeout)

    @staticmethod
    def _check_shapes(value, meta, where: str) -> None:
        got = [(tuple(t.shape), t.dtype) for t in _all_tensors(value)]
        want = [(tuple(t.shape), t.dtype) for t in _all_tensors(meta)]
        if got != want:
            raise RuntimeError(f"{where} is {got} but the meta-device run predicted {want}; layers must be shape-deterministic")

    # ---- after the actions --------------------------------------------
    def _reduce_gradients(self) -> None:
        for key, group in self.tie_groups.items():
            grads = [p.grad for p in self._filled_grads(self.module.tied[key].parameters())]
            _all_reduce_flat(grads, group, average=False)
        if self.topo.dp_group is not None:
            _all_reduce_flat([p.grad for p in self._filled_grads(self.module.parameters())], self.topo.dp_group, average=True)

    def _clip_gradients(self) -> None:
        """Scale all gradients so their global norm is at most `clip_grad_norm` (no-op when None)."""
        if self.clip_grad_norm is None:
            self.last_grad_norm = None
            return
        self.last_grad_norm = self.grad_norm()
        if self.last_grad_norm > self.clip_grad_norm:
            scale = self.clip_grad_norm / (self.last_grad_norm + 1e-6)
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    def grad_norm(self) -> float:
        """Global L2 norm of the (reduced) gradients of the whole model.

        Each parameter counts once: a tp-replicated one only on tp rank 0, a
        tied one only on the first pipeline rank that holds it; dp replicas
        hold equal gradients after the reduction and are not summed. One
        all-reduce over pp and one over tp."""
        counted = self.module.counted_in_norm()
        total = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        for name, p in self.module.named_parameters():
            if p.grad is not None and counted[name]:
                total += p.grad.double().pow(2).sum()
        for group in (self.topo.pp_group, self.topo.tp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt().item()

    @staticmethod
    def _filled_grads(params) -> list:
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return params

    def _loss_weights(self) -> tuple[list[float], list[float]]:
        """What each microbatch's loss is multiplied by, so that the step's loss and gradients
        are those of the whole global batch, as in one process (the dp reduction then averages);
        and, for the loss `train_batch` returns by default, so that it is this dp replica's.

        A token-level loss (a `loss_fn` with an `ignore_index`, like cross-entropy) is a mean
        over its microbatch's valid tokens: microbatch m weighs dp * valid_m / valid, valid
        counted over every microbatch and dp replica (one all-reduce over dp on the last
        stage), so masked labels give the one-process loss at any m and dp; for the replica's
        own loss it weighs valid_m / (its replica's valid). Any other loss weighs 1/M: the
        mean over microbatches."""
        m = self.num_microbatches
        ignore = getattr(self.module.loss_fn, "ignore_index", None)
        labels = self._micro_labels
        if ignore is None or self.last_stage not in self.module.local_stages or not torch.is_tensor(labels[0]):
            return [1.0 / m] * m, [1.0 / m] * m
        counts = torch.stack([(y != ignore).sum() for y in labels]).double()
        mine = counts.tolist()
        local = [c / sum(mine) for c in mine] if sum(mine) else [0.0] * m
        total = counts.sum()
        if self.topo.dp_group is not None:
            dist.all_reduce(total, group=self.topo.dp_group)
        if total.item() == 0:
            return [0.0] * m, local
        return (counts * (self.topo.dp / total)).tolist(), local

    def _step_loss(self, reduce_loss: bool):
        """The loss `train_batch` / `eval_batch` return: with `reduce_loss`, the global
        batch's, as a float on every rank (collective); else this replica's as a 0-dim
        float64 tensor where the last stage is, None elsewhere (no communication)."""
        if reduce_loss:
            return self._mean_loss()
        if self.last_stage not in self.module.local_stages:
            return None
        terms = [loss.double() * w for loss, w in zip(self._raw_losses, self._local_weights) if w]
        return torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64, device=self.topo.device)

    def _mean_loss(self) -> float:
        """The step's loss (the last stage's weighted microbatch losses, averaged over dp),
        given to every rank."""
        total = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        if self._losses:
            total += torch.stack(self._losses).double().sum()
        if self.topo.pp_group is not None:
            dist.all_reduce(total, group=self.topo.pp_group)
        if self.topo.dp_group is not None:
            dist.all_reduce(total, group=self.topo.dp_group)
            total /= self.topo.dp
        return total.item()


def _all_reduce_flat(tensors: list[torch.Tensor], group, *, average: bool) -> None:
    """All-reduce a list of tensors in place through one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    size = dist.get_world_size(group)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
