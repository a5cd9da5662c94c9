"""PipelineEngine: walk this rank's action list, then step one optimizer.

One optimizer step (`train_batch`) is:

1. read this rank's batch, split it into M microbatches (only the rank of the
   first stage needs the inputs and only the rank of the last the labels; see
   "Data" below);
2. run this rank's lowered action list from the schedule, one handler per
   action kind, looked up in `engine.handlers` (a copy of the registry that
   `register_action` fills): F, B (full backward), I (input grads only) and W
   (weight grads only; see `pipekit.split_backward`), SEND_F/RECV_F,
   SEND_B/RECV_B. What a step holds between its actions is one `Step`; a
   failing action raises a PipelineError showing the rank's action grid;
3. wait for the posted sends and step the optimizer, always a
   `pipekit.optim.ZeroOptimizer` (a plain torch optimizer is wrapped at
   stage 0): it reduces the gradients over dp (during backward) and over the
   pipeline ranks sharing a tied layer, unscales, checks that the losses,
   inputs (marked by the engine) and gradients are finite on every rank,
   skipping the step everywhere when not (one line says which, first),
   clips and updates; the engine has no gradient path of its own;
4. return the loss (see "The loss" below).

The schedule is declared once, on the module (`PipelineModule(...,
schedule=..., microbatches=...)`); the engine runs `module.schedule` and its
forwards alone (itself a validated Schedule) for eval.

Data: `train_batch(data)` / `eval_batch(data)` take the batch `(inputs,
labels)` itself (a tuple or a list, as a DataLoader gives it) or an iterator
of batches. A rank that holds no stage reading the inputs (stage 0) may pass
None for them, a rank without the last stage None for the labels, a middle
rank None for the whole batch (`train_batch()`). Receive buffers are sized
from the shapes of a microbatch's inputs, agreed once, at the first step
(train or eval; see `pipekit.handshake.InputShapes`): the rank of stage 0 posts its shapes to
the other pipeline ranks and each tells it whether it was given inputs, so
all ranks always agree on what is exchanged and later steps exchange nothing.
If every rank was given its inputs then, shapes may change from step to step,
and from microbatch to microbatch in a batch given as `pipekit.Microbatches`
(each rank sizes from its own; the stage shapes of a length seen before are
reused, not traced again), and a rank that later passes None fails with
an error saying why; if some rank was given none, the first step's shapes are
fixed (as torch.distributed.pipelining fixes them at its first step) and the
rank of stage 0 refuses inputs of other shapes, naming both, before sending
anything. A rank that lacks data one of its stages reads gets an error naming
the rank, its stages and what is missing.

The loss of each microbatch is weighted before its backward so that the
gradients are those of the loss of the whole batch, as in one process: by
1/M, or, for a token-level loss (one with an `ignore_index`), by its share
of the valid tokens of the global batch (see `StepLoss.weigh`).

The loss returned costs no communication and no host sync by default: on the
ranks holding the last stage, a detached 0-dim float64 tensor, the loss of this
data-parallel replica's batch as one process would compute it on that batch
(for a token-level loss, the mean over its valid tokens); None on the other ranks (as
torch.distributed.pipelining gives losses on the last stage only). With
`reduce_loss=True` (every rank passes the same) it is the loss of the whole
global batch as a Python float on every rank (DeepSpeed's `train_batch`): in
training its shares travel in the optimizer's all-reduce of the non-finite marks
and come back in that read (no collective or host sync of its own; a rank that did
not ask is named by the others); `eval_batch` all-reduces it over pp and dp.

Host syncs: one inside a step on a GPU beyond what the caller asks for: the
optimizer's read of the world's non-finite marks, which decides whether it
steps at all. Loss weights and token counts stay on the device, so do the
optimizer's norm and clipping; reading `last_grad_norm` (and `reduce_loss=True` in
`eval_batch`) are reads the caller asks for. What is left is counted in tests/test_host_sync.py.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import auxloss, comm, split_backward
from .comm import Lanes
from .handshake import InputShapes
from .layers.context import shard_sequence
from .microbatch import Microbatches, all_tensors, cast_floats, leaf, next_batch, rebuild, split_microbatches, to_device
from .optim import Marks, Skip, ZeroOptimizer
from .pipeline import PipelineModule
from .rules import check_clip, check_overlap
from .schedules import Action, Kind, Schedule, TimelineEvent
from .schedules.ir import WEIGHT_GRAD_KINDS
from .spec import TiedLayerSpec
from .topology import Topology, default_timeout

_IO_SHAPES_KEPT = 32  # microbatch input shapes whose stage (input, output) metas an engine keeps


class PipelineError(RuntimeError):
    """An action failed; the message names the rank, the action and shows the rank's action list."""


@dataclass(eq=False)
class Step:
    """What one step (`train_batch` or `eval_batch`) holds between its actions.

    `_run` makes a fresh one per step and keeps it as `engine.step_state` until the
    next; every handler gets it. Dicts are keyed by (virtual stage, microbatch), the
    outbox by (stage, SEND kind, microbatch). A training step ends with the stash,
    inbox, grads and weight work empty (`leftover`)."""

    actions: list[Action]
    training: bool
    micro_in: list | None  # this rank's microbatch inputs (None: not given)
    micro_labels: list | None  # its microbatch labels (None: not given)
    io: list = field(default_factory=list)  # per microbatch, per virtual stage: (input, output) as meta tensors
    loss: StepLoss = field(init=False)  # the microbatches' loss weights and losses
    posted: list = field(default_factory=list)  # sends in flight: (work, tensor)
    stash: dict = field(default_factory=dict)  # -> (stage input, stage output or weighted loss)
    inbox: dict = field(default_factory=dict)  # -> stage input (received, or from a local stage)
    grads: dict = field(default_factory=dict)  # -> grads of the stage's float outputs
    weight_work: dict = field(default_factory=dict)  # -> what W still has to do after I
    outbox: dict = field(default_factory=dict)  # (stage, kind, mb) -> tensors waiting for their SEND
    outputs: list = field(default_factory=list)  # the last stage's outputs (eval)
    recv_due: collections.deque = field(default_factory=collections.deque)  # RECV actions not yet posted
    recv_posted: collections.deque = field(default_factory=collections.deque)  # (action, comm.PostedRecv)

    def leftover(self) -> list:
        """Activations or gradients a training step made and no action consumed."""
        return [*self.stash, *self.inbox, *self.grads, *self.weight_work]


Handler = Callable[["PipelineEngine", Step, Action], None]
_HANDLERS: dict[Kind, Handler] = {}


def register_action(kind: Kind | str, fn: Handler, *, replace: bool = False) -> Handler:
    """Run `fn(engine, step, action)` for every action of `kind` (a `Kind` or its text, "F")
    in the engines built from now on (an engine's own table is `engine.handlers`). The
    built-in kinds are registered by this module; replacing one takes `replace=True`."""
    try:
        kind = Kind(kind)
    except ValueError:
        raise ValueError(f"unknown action kind {kind!r}; the kinds are {', '.join(k.value for k in Kind)}") from None
    if not callable(fn):
        raise TypeError(f"the handler of {kind.value} must be callable (engine, step, action), got {fn!r}")
    if kind in _HANDLERS and not replace:
        raise ValueError(f"action kind {kind.value} already has a handler; pass replace=True to replace it")
    _HANDLERS[kind] = fn
    return fn


class PipelineEngine:
    """Trains a PipelineModule with the schedule the module declares.

    Args:
        module: this rank's PipelineModule; its `schedule` (a built
            `pipekit.schedules.Schedule`: placement, chunks, microbatches) is what runs.
        optimizer: a `pipekit.optim.ZeroOptimizer`; a torch optimizer over
            `module.parameters()`, wrapped at ZeRO stage 0 (same hyperparameters and
            param groups, shared, so an LR scheduler made for it still applies; the
            torch optimizer itself is not stepped: checkpoint `engine.optimizer`); or
            a torch optimizer class or factory (`functools.partial(torch.optim.AdamW,
            lr=...)`), built over whatever this rank holds, nothing included.
            None: eval only.
        record_timeline: keep every action's measured start/end (seconds since
            `self.step_start`, a `time.perf_counter()` reading) in `self.timeline`,
            in the simulator's format.
        timeout: how long a receive waits before failing with the rank,
            action and microbatch named (None: PIPEKIT_TIMEOUT's seconds, else 300).
        clip_grad_norm: clip the gradients to this global L2 norm (over every
            parameter of the model, each counted once) before the step.
        lr_scheduler: stepped after every optimizer step that was not skipped.
        say: where the one line about a skipped step goes, from global rank 0 (default:
            printed; None: nowhere, the caller reports `last_skip` itself, as `pipekit
            train` does with its own step numbers). A step is skipped on every rank when
            any rank's loss, inputs or gradients are not finite (`pipekit.optim.finite`).
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
        optimizer=None,
        record_timeline: bool = False,
        timeout: datetime.timedelta | None = None,
        clip_grad_norm: float | None = None,
        lr_scheduler=None,
        recv_ahead: int = 4,
        say: Callable[[str], None] | None = print,
        **removed,
    ):
        _refuse_removed(removed)
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine takes a pipekit.PipelineModule (its first argument), got "
                            f"{type(module).__name__}; build one with PipelineModule(specs, topology, loss_fn=...)")
        if isinstance(recv_ahead, bool) or not isinstance(recv_ahead, int) or recv_ahead < 0:
            raise ValueError(f"recv_ahead must be an int >= 0 (receives posted before they are needed; 0: each "
                             f"when its RECV action runs), got {recv_ahead!r}")
        self.recv_ahead = recv_ahead
        self.module = module
        self.topo = module.topology
        self.optimizer = as_zero_optimizer(optimizer, module)
        check_clip(clip_grad_norm)
        if self.optimizer is not None and clip_grad_norm is not None:
            self.optimizer.clip_grad_norm = clip_grad_norm
        self.clip_grad_norm = clip_grad_norm
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must be a torch LR scheduler over the engine's optimizer (something with "
                            f".step(), e.g. torch.optim.lr_scheduler.LambdaLR(engine_optimizer, ...)) or None, got "
                            f"{type(lr_scheduler).__name__} {lr_scheduler!r}")
        self.lr_scheduler = lr_scheduler
        self.say = say
        self.steps_run = 0  # train_batch calls so far: the step a skip's line names
        self.timeout = timeout if timeout is not None else default_timeout()  # PIPEKIT_TIMEOUT, else 300 s
        self.schedule: Schedule = module.schedule
        self.num_microbatches = self.schedule.microbatches
        self.actions = list(self.schedule.ranks[self.topo.pp_rank])
        self.eval_actions = list(self.schedule.forward_only().ranks[self.topo.pp_rank])
        self.last_stage = module.num_stages - 1
        self.record_timeline = record_timeline
        self.timeline: list[TimelineEvent] = []
        self.step_start: float | None = None  # the last step's start, `time.perf_counter()`
        self.handlers: dict[Kind, Handler] = dict(_HANDLERS)
        self.step_state: Step | None = None
        self.tie_groups = module.tie_groups
        self.backward_passes = Backward(module, self.actions)  # B, I, W: their parameters and passes
        self._io: dict[tuple, list] = {}  # (module.training, input shapes) -> `stage_io_meta`, least recent first
        self._shapes = InputShapes(self.topo, self.timeout, module.local_stages, module.stage_rank(0),
                                  self.num_microbatches)
        self._step_layers = auxloss.step_layers(module)  # layers with work around a step (auxloss.StepStatistic)
        self._peers = [self.topo.global_rank(module.stage_rank(s)) for s in range(module.num_stages)]  # global ranks
        self.lanes: Lanes | None = None  # an OVERLAP's forward streams, made with the twin groups
        if self.schedule.overlaps:
            self._open_lanes()

    def _open_lanes(self) -> None:
        """Before the first OVERLAP: backward collectives get their own groups (`pipekit.comm.lane`),
        forwards their side streams (`pipekit.comm.Lanes`)."""
        sharded = self.optimizer is not None and self.optimizer.sharded_layers
        try:
            check_overlap(True, 3 if sharded else 0)
        except ValueError as e:
            raise ValueError(f"schedule {self.schedule.name!r} (OVERLAP actions): {e}") from None
        if dist.is_initialized():
            comm.use_backward_twins(self.topo.backward_twins())
        self.lanes = Lanes(self.topo.device)

    # ---- what the optimizer reports ---------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None without clipping or
        after a skipped step). Read from the device on access: the one host sync it costs."""
        return None if self.optimizer is None else self.optimizer.last_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped on every rank (`last_skip` says why)."""
        return self.last_skip is not None

    @property
    def last_skip(self) -> Skip | None:
        """Why the last step was skipped (a non-finite loss, input or gradient anywhere, or an
        fp16 overflow), or None."""
        return None if self.optimizer is None else self.optimizer.last_skip

    def grad_norm(self) -> float | None:
        """`last_grad_norm`: the global L2 norm of the last step's reduced, unscaled
        gradients, each parameter counted once over dp, pp and tp (computed by the
        optimizer when clipping)."""
        return self.last_grad_norm

    @property
    def _trainer(self) -> ZeroOptimizer:
        """The optimizer, inside a training step (`train_batch` refuses to start without one)."""
        assert self.optimizer is not None, "a training action ran without an optimizer"
        return self.optimizer

    # ---- set-up -------------------------------------------------------
    def _stage_io(self, example_input) -> list:
        """Every stage's (input, output) meta tensors for microbatch inputs shaped as
        `example_input`, kept per mode (training, eval) and shapes: a layer may give other
        shapes in eval (a fused loss's head), and a length seen before (length-bucketed
        microbatches, a sequence-length warm-up) is not traced again. The last
        `_IO_SHAPES_KEPT` shapes are kept."""
        key = (self.module.training, tuple((t.shape, t.dtype) for t in all_tensors(example_input)))
        io = self._io.pop(key, None)
        if io is None:
            io = self.module.stage_io_meta(example_input)
            if len(self._io) >= _IO_SHAPES_KEPT:
                self._io.pop(next(iter(self._io)))  # the least recently used
        self._io[key] = io
        return io

    def _ios(self, examples: list) -> list:
        """`_stage_io` of each microbatch's example, looked up once per distinct example
        (an evenly split batch, or a rank given no inputs, repeats one for all)."""
        ios: dict[int, list] = {}  # id(example) -> its stage metas
        for x in examples:
            if id(x) not in ios:
                ios[id(x)] = self._stage_io(x)
        return [ios[id(x)] for x in examples]

    # ---- the public steps ---------------------------------------------
    def train_batch(self, data=None, *, reduce_loss: bool = False):
        """One optimizer step over `num_microbatches` microbatches of one batch.

        `data` is the batch `(inputs, labels)` itself (a tuple or a list), or an
        iterator whose `next()` gives it (`iter(loader)`, a generator): this
        data-parallel rank's share. Only the rank holding stage 0 needs the
        inputs and only the rank holding the last stage the labels; the others
        may pass None in their place, or None for the whole batch (shapes: see
        the module docstring).

        Returns, by default without any communication or host sync, this dp
        replica's loss over its batch as a detached 0-dim float64 tensor on the
        ranks holding the last stage, and None on the others. `reduce_loss=True`
        returns the loss of the global batch (as in one process) as a float on every
        rank, summed with the step's non-finite marks (the optimizer's one all-reduce and
        one host read), so every rank must pass it. The gradients and the step are the
        same either way.

        Layers that need a statistic of the whole step (`pipekit.auxloss.StepStatistic`, e.g.
        MoE global-batch balancing) get a pre-pass first: the step's forward actions, without
        autograd (an extra forward of every microbatch; not in the timeline)."""
        if self.optimizer is None:
            raise RuntimeError("train_batch needs an optimizer; pass optimizer=... to PipelineEngine")
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        batch = next_batch(data)
        if any(layer.needs_prepass for layer in self._step_layers):
            with torch.no_grad(), auxloss.prepass(self._step_layers, self.topo.dp_group):
                self._run(self.eval_actions, batch, training=False)
        step = self._run(self.actions, batch, training=True)
        marks = self._marks(step, reduce_loss)
        self.optimizer.step(marks=marks)  # reduction, unscaling, finite check, clipping, update (the loss too)
        self.steps_run += 1
        auxloss.end_step(self._step_layers, self.topo.dp_group)
        skip = self.optimizer.last_skip
        if skip is not None and self.say is not None and self.topo.rank == 0:
            self.say(skip.line(self.steps_run))
        if self.lr_scheduler is not None and skip is None:
            self.lr_scheduler.step()
        if reduce_loss:
            return step.loss.from_marks(marks, self.topo)
        return step.loss.value(False, self.topo, self.timeout)

    def _marks(self, st: Step, reduce_loss: bool = False) -> Marks:
        """What this rank knows of the step that is not finite, for the optimizer's world-wide
        check (`pipekit.optim.finite`): each microbatch's loss (last stage; one weighing
        nothing is not marked) and floating-point inputs (stage 0); with `reduce_loss`, this
        rank's share of the global batch's loss, reduced with them. On the device: no sync."""
        marks = Marks(self.topo.device, dp=self.topo.dp, microbatches=self.num_microbatches,
                      dp_rank=self.topo.dp_rank, loss=True, world=self.topo.world_size)
        if reduce_loss:
            marks.carry_loss(st.loss.share(self.topo))
        if st.loss.raw:
            marks.mark_losses(st.loss.raw, st.loss.weights)
        if st.micro_in is not None and 0 in self.module.local_stages:
            marks.mark_inputs(st.micro_in)
        return marks

    @torch.no_grad()
    def eval_batch(self, data=None, return_outputs: bool = False, *, reduce_loss: bool = False):
        """Forward only, on the same data as `train_batch` (None where a rank needs none).
        Returns the loss as `train_batch` does (None without a loss_fn), or `(loss, outputs)`
        with the last stage's outputs concatenated over microbatches (None off the last stage;
        a list, one per microbatch, when their shapes differ past the first dimension)."""
        self.module.eval()
        step = self._run(self.eval_actions, next_batch(data), training=False)
        loss = step.loss.value(reduce_loss, self.topo, self.timeout) if self.module.has_loss else None
        if not return_outputs:
            return loss
        outs: torch.Tensor | tuple[torch.Tensor, ...] | None = None
        if self.last_stage in self.module.local_stages:
            parts = step.outputs
            if len({tuple(t.shape[1:]) for p in parts for t in all_tensors(p)[:1]}) > 1:
                return loss, parts  # microbatches of different lengths: one output each
            outs = torch.cat(parts) if isinstance(parts[0], torch.Tensor) else tuple(map(torch.cat, zip(*parts)))
        return loss, outs

    # ---- this rank's data -----------------------------------------------
    def _prepare(self, batch) -> tuple[list | None, list | None]:
        """Check, move and split this rank's batch: (microbatch inputs, microbatch labels),
        each None where not given. A `Microbatches` batch comes cut already: each
        microbatch keeps its own shape."""
        if isinstance(batch, Microbatches):
            if len(batch) != self.num_microbatches:
                raise ValueError(f"Microbatches holds {len(batch)} microbatches, but the schedule runs "
                                 f"{self.num_microbatches}; give one (inputs, labels) pair per microbatch")
            given_in, given_labels = batch.inputs(), batch.labels()
            self._check_needs(given_in, given_labels)
            return (None if given_in is None else [self._moved_inputs(x, "inputs") for x in given_in],
                    None if given_labels is None else [self._context_chunks(to_device(y, self.topo.device), "labels")
                                                       for y in given_labels])
        if batch is None:
            inputs = labels = None
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, labels = (tuple(x) if isinstance(x, list) else x for x in batch)  # a DataLoader's lists
        else:
            size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
            raise TypeError(f"a batch must be a pair (inputs, labels), pipekit.Microbatches, or None on a rank that "
                            f"needs no data; got {type(batch).__name__}{size}")
        self._check_needs(inputs, labels)
        micro_in = micro_labels = None
        if inputs is not None:
            micro_in = split_microbatches(self._moved_inputs(inputs, "inputs"), self.num_microbatches, "inputs")
        if labels is not None:
            labels = to_device(labels, self.topo.device)
            micro_labels = split_microbatches(self._context_chunks(labels, "labels"), self.num_microbatches, "labels")
        return micro_in, micro_labels

    def _moved_inputs(self, inputs, what: str):
        """Inputs on the device, floats in the module's dtype, this cp rank's chunks."""
        return self._context_chunks(cast_floats(to_device(inputs, self.topo.device), self.module.param_dtype), what)

    def _context_chunks(self, x, what: str):
        """Context parallelism (cp > 1): this rank's two chunks of every sequence in `x` (a tensor
        or tuple; dim 1 is the sequence of each tensor with one), `pipekit.layers.context`."""
        t = self.topo
        if t.cp == 1:
            return x
        if isinstance(x, tuple):
            return tuple(self._context_chunks(item, what) for item in x)
        if x.dim() < 2:
            return x
        try:
            return shard_sequence(x, t.cp, t.cp_rank, dim=1)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None

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
    def _run(self, actions: list[Action], batch, *, training: bool) -> Step:
        """Run one action list over `batch`; the Step it leaves (also `self.step_state`)."""
        self._refuse_autocast(training)
        micro_in, micro_labels = self._prepare(batch)
        step = self.step_state = Step(actions, training, micro_in, micro_labels)
        if self.lanes is not None:
            self.lanes.new_step()
        uniform = not isinstance(batch, Microbatches)  # an even split: every microbatch shaped as the first
        step.io = self._ios(self._shapes.examples(micro_in, step.posted, uniform=uniform))
        step.loss = StepLoss.weigh(self.module, micro_labels, self.topo)
        step.recv_due.extend(a for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B))
        self.timeline = []
        self.step_start = t0 = time.perf_counter()  # timeline times are relative to this (a machine-wide clock)
        self._post_receives(step)
        record = self.record_timeline
        for i, action in enumerate(actions):
            start = time.perf_counter() if record else 0.0  # no clock read per action without a timeline
            try:
                self._handler(action)(self, step, action)
            except Exception as e:
                raise PipelineError(self._failure_report(actions, i, e)) from e
            if record:
                end = time.perf_counter()
                self.timeline.append(TimelineEvent(self.topo.pp_rank, str(action), start - t0, end - t0))
        comm.wait_all(step.posted, self.timeout)
        self._shapes.finish_first_step()
        leftover = step.leftover() if training else []
        assert not leftover, f"rank {self.topo.rank}: unconsumed activations/grads after the step: {leftover}"
        return step

    def _refuse_autocast(self, training: bool) -> None:
        """torch.autocast around a step: refused in one line. The stages' output dtypes are
        predicted on the meta device, which autocast does not cover, and they size every
        message between stages; pipekit's own precision policy does what autocast would."""
        kind = self.topo.device.type
        if torch.is_autocast_enabled(kind):
            raise ValueError(f"{'train_batch' if training else 'eval_batch'} ran under torch.autocast({kind!r}, "
                             f"dtype={torch.get_autocast_dtype(kind)}), which pipekit does not take: its stages' "
                             "dtypes size the messages between them; set the precision on the module instead, "
                             "PipelineModule(..., precision=\"bf16\") (config: train.precision=bf16; float32 "
                             "master weights in the optimizer), and step outside the autocast")

    def _handler(self, action: Action) -> Handler:
        handler = self.handlers.get(action.kind)
        if handler is None:
            raise KeyError(f"no handler for action kind {action.kind.value}; register one with "
                           "pipekit.engine.register_action(kind, fn)")
        return handler

    def _failure_report(self, actions: list[Action], step: int, error: Exception) -> str:
        a = actions[step]
        lines = [
            f"rank {self.topo.rank} (pp_rank {self.topo.pp_rank}, dp_rank {self.topo.dp_rank}) failed at action "
            f"#{step} {a} (stage {a.stage}, {a.kind.value}, microbatch {a.microbatch}): "
            f"{type(error).__name__}: {error}",
            "this rank's actions:",
        ]
        for i, b in enumerate(actions):
            lines.append(f"  {'>>' if i == step else '  '} {i:4d} {b}")
        return "\n".join(lines)

    # ---- handlers: (engine, step, action), registered below ---------------
    def _forward(self, st: Step, a: Action) -> None:
        s, m = a.stage, a.microbatch
        if s == 0:
            assert st.micro_in is not None  # the rank of stage 0 is always given inputs (`_check_needs`)
            x = st.micro_in[m]
        else:
            x = st.inbox.pop((s, m))
        out = self.module.forward_stage(s, x)
        self._check_shapes(out, st.io[m][s][1], f"stage {s} output")
        if s == self.last_stage:
            self._finish_forward(st, x, out, m)
            return
        if st.training:
            st.stash[(s, m)] = (x, out)
        if s + 1 in self.module.local_stages:
            st.inbox[(s + 1, m)] = leaf(out) if st.training else out
        else:
            st.outbox[(s, Kind.SEND_F, m)] = all_tensors(out)

    def _finish_forward(self, st: Step, x, out, m: int) -> None:
        """The loss of the last stage's output (half-precision layers: taken to float32 first,
        unless the loss says `keeps_output_dtype` and does its own precision, as the fused
        linear cross-entropy does: its matmul runs in the head weight's dtype)."""
        if not self.module.has_loss:
            if st.training:
                raise RuntimeError("training needs a loss; pass loss_fn=... to PipelineModule")
            st.outputs.append(out)
            return
        loss_fn, labels = self.module.loss_fn, st.micro_labels
        assert loss_fn is not None and labels is not None  # built on the last stage's rank; labels checked
        upcast = self.module.param_dtype and not getattr(loss_fn, "keeps_output_dtype", False)
        loss = checked_loss(loss_fn, loss_fn(cast_floats(out, torch.float32 if upcast else None), labels[m]),
                            st.training)
        st.loss.add(loss, m)
        if st.training:
            weight = st.loss.weight(m, loss.dtype, self._trainer.loss_scale)  # on the device: no sync
            st.stash[(self.last_stage, m)] = (x, loss * weight)
        else:
            st.outputs.append(out)

    def _overlap(self, st: Step, a: Action) -> None:
        """OVERLAP: the forward on a second thread while this one runs the backward, so the
        collectives inside either wait while the other computes (torch and gloo let go of the
        GIL in both). Each lane keeps its collectives in program order on its own groups
        (`pipekit.comm.lane`) and its kernels on its own stream (`pipekit.comm.Lanes`: the forward on
        a side stream, joined after); the two touch different (stage, microbatch) entries of the step."""
        assert a.pair is not None and self.lanes is not None  # an OVERLAP is made with its pair (Action.overlap)
        forward, backward = a.pair
        failed: list[BaseException] = []
        run, join = self.lanes.forward_lane((forward.stage, forward.microbatch),
                                            (backward.stage, backward.microbatch))

        def run_forward():
            try:
                run(lambda: self._forward(st, forward))
            except BaseException as e:  # re-raised on this thread below
                failed.append(e)

        thread = threading.Thread(target=run_forward, name=f"pipekit {forward}", daemon=True)
        thread.start()
        try:
            self._handler(backward)(self, st, backward)
        finally:
            thread.join()
            join()
        if failed:
            raise failed[0]

    def _backward(self, st: Step, a: Action) -> None:
        """B: the full backward of (stage, microbatch): input grad and weight grads."""
        self.backward_passes.full(st, a, self._trainer)

    def _backward_input(self, st: Step, a: Action) -> None:
        """I: only the input grad; what the weight grads need is kept for W."""
        self.backward_passes.input_only(st, a, self._trainer)

    def _backward_weight(self, st: Step, a: Action) -> None:
        """W: the weight grads of (stage, microbatch), from where its I stopped."""
        self.backward_passes.weight(st, a, self._trainer)

    def _peer(self, stage: int) -> int:
        """The global rank of the rank holding `stage` (in this rank's dp replica and tp rank)."""
        return self._peers[stage]

    def _send_forward(self, st: Step, a: Action) -> None:
        st.posted += comm.send(st.outbox.pop((a.stage, Kind.SEND_F, a.microbatch)), self._peer(a.stage + 1))

    def _send_backward(self, st: Step, a: Action) -> None:
        st.posted += comm.send(st.outbox.pop((a.stage, Kind.SEND_B, a.microbatch)), self._peer(a.stage - 1))

    def _recv_forward(self, st: Step, a: Action) -> None:
        x = rebuild(st.io[a.microbatch][a.stage][0], self._received(st, a))
        st.inbox[(a.stage, a.microbatch)] = leaf(x) if st.training else x

    def _recv_backward(self, st: Step, a: Action) -> None:
        st.grads[(a.stage, a.microbatch)] = self._received(st, a)

    def _post_receives(self, st: Step, at_least: int = 0) -> None:
        """Keep the next `recv_ahead` (or `at_least`) receives of this rank's program posted, in
        program order: the order the peers send in."""
        while st.recv_due and len(st.recv_posted) < max(self.recv_ahead, at_least):
            a = st.recv_due.popleft()
            if a.kind is Kind.RECV_F:
                like, src = all_tensors(st.io[a.microbatch][a.stage][0]), self._peer(a.stage - 1)
            else:
                like, src = comm.float_entries(st.io[a.microbatch][a.stage][1]), self._peer(a.stage + 1)
            st.recv_posted.append((a, comm.post_recv(like, src, self.topo.device)))

    def _received(self, st: Step, a: Action) -> list[torch.Tensor]:
        """The tensors of RECV action `a`, the next posted receive (posted now if none is)."""
        self._post_receives(st, at_least=1)
        head, posted = st.recv_posted.popleft()
        assert head == a, f"rank {self.topo.rank}: receive for {head} posted, but the program runs {a}"
        self._post_receives(st)
        return comm.wait_recv(posted, self.timeout)

    @staticmethod
    def _check_shapes(value, meta, where: str) -> None:
        if (isinstance(value, torch.Tensor) and isinstance(meta, torch.Tensor)
                and value.shape == meta.shape and value.dtype == meta.dtype):
            return  # the common case, one tensor as predicted, without lists
        got = [(tuple(t.shape), t.dtype) for t in all_tensors(value)]
        want = [(tuple(t.shape), t.dtype) for t in all_tensors(meta)]
        if got != want:
            raise RuntimeError(f"{where} is {got} but the meta-device run predicted {want}; layers must be "
                               "shape-deterministic")


for _kind, _fn in {
    Kind.F: PipelineEngine._forward,
    Kind.B: PipelineEngine._backward,
    Kind.I: PipelineEngine._backward_input,
    Kind.W: PipelineEngine._backward_weight,
    Kind.SEND_F: PipelineEngine._send_forward,
    Kind.RECV_F: PipelineEngine._recv_forward,
    Kind.SEND_B: PipelineEngine._send_backward,
    Kind.RECV_B: PipelineEngine._recv_backward,
    Kind.OVERLAP: PipelineEngine._overlap,
}.items():
    register_action(_kind, _fn)


class Backward:
    """The backward passes of this rank's stages, for the engine's B, I and W handlers.

    It knows which parameters a pass over a stage gives gradients to (tied layers included:
    `stage_params`) and which of them are complete for the step once a (stage, microbatch)
    has run (`final_params`), which it tells the optimizer's bucketing (`backward_pass`), so
    their reduction can start; it takes a pass's operands from the step's stash and hands
    the input grads to the previous stage (local, or to the outbox for SEND_B). A layer's
    auxiliary loss (`pipekit.auxloss.attach`) counts as the mean over microbatches, scaled
    like the main loss for fp16. The optimizer is the engine's, given with each pass."""

    def __init__(self, module: PipelineModule, actions: list[Action]):
        self.module = module
        self.last_stage = module.num_stages - 1
        self.microbatches = module.schedule.microbatches
        self.stage_params = {s: self._params_of_stage(s) for s in module.local_stages}
        self.final_params = self._params_final_after(actions)

    def full(self, st: Step, a: Action, trainer: ZeroOptimizer) -> None:
        """B: input grad and weight grads of (stage, microbatch) in one pass."""
        s, m = a.stage, a.microbatch
        x, outs, grads = self._operands(st, s, m)
        with self._weight_pass(trainer, s, m), self._aux_scale(trainer):
            if outs:
                torch.autograd.backward(outs, grads)
        if s > 0:  # stage 0's inputs are the data: no grad is handed back
            self._hand_back(st, s, m, [t.grad if t.grad is not None else torch.zeros_like(t)
                                       for t in comm.float_entries(x)])

    def input_only(self, st: Step, a: Action, trainer: ZeroOptimizer) -> None:
        """I: only the input grad; what the weight grads need is kept for W (`st.weight_work`)."""
        s, m = a.stage, a.microbatch
        x, outs, grads = self._operands(st, s, m)
        inputs = comm.float_entries(x) if s > 0 else []
        with self._aux_scale(trainer):
            params = trainer.autograd_params(self.stage_params[s])
            input_grads, work = split_backward.backward_input(outs, grads, inputs, params)
        st.weight_work[(s, m)] = work
        self._hand_back(st, s, m, input_grads)

    def weight(self, st: Step, a: Action, trainer: ZeroOptimizer) -> None:
        """W: the weight grads of (stage, microbatch), from where its I stopped."""
        s, m = a.stage, a.microbatch
        if (s, m) not in st.weight_work:
            raise RuntimeError(f"weight grads of microbatch {m} on stage {s} before its input grads (I)")
        with self._weight_pass(trainer, s, m), self._aux_scale(trainer), trainer.gathered(self.stage_params[s]):
            split_backward.backward_weight(st.weight_work.pop((s, m)))

    def _operands(self, st: Step, s: int, m: int):
        """(stage input, outputs to differentiate, their grads) of (stage, microbatch)."""
        if (s, m) not in st.stash:
            raise RuntimeError(f"backward of microbatch {m} on stage {s} before its forward")
        x, out = st.stash.pop((s, m))
        if s == self.last_stage:
            return x, [out], [None]  # the weighted (and fp16-scaled) loss
        pairs = [(o, g) for o, g in zip(comm.float_entries(out), st.grads.pop((s, m))) if o.requires_grad]
        return x, [o for o, _ in pairs], [g for _, g in pairs]

    def _weight_pass(self, trainer: ZeroOptimizer, s: int, m: int):
        """A pass that accumulates stage s's parameter grads (inside ZeRO's bucketing)."""
        return trainer.backward_pass(self.stage_params[s], self.final_params.get((s, m), ()))

    def _aux_scale(self, trainer: ZeroOptimizer):
        """Auxiliary losses as the mean over microbatches, scaled like the main loss for fp16."""
        return auxloss.scaled_backward(trainer.loss_scale / self.microbatches)

    def _hand_back(self, st: Step, s: int, m: int, grads: list) -> None:
        """Give the input grad of (stage, microbatch) to the previous stage: local, or sent."""
        if s == 0:
            return
        if s - 1 in self.module.local_stages:
            st.grads[(s - 1, m)] = grads
        else:
            st.outbox[(s, Kind.SEND_B, m)] = grads

    def _params_of_stage(self, stage: int) -> list:
        """The parameters a backward pass over `stage` gives gradients to (tied layers included)."""
        params = []
        for i in self.module.stage_layers(stage):
            spec = self.module.specs[i]
            if isinstance(spec, TiedLayerSpec):
                params += list(self.module.tied[spec.key].parameters())
            elif str(i) in self.module.layers:
                params += list(self.module.layers[str(i)].parameters())
        return params

    def _params_final_after(self, actions: list[Action]) -> dict[tuple[int, int], list]:
        """(stage, microbatch) of a backward action -> the parameters whose gradients are
        complete for the step once it has run (its stage's last backward, or for a layer
        used by two local stages, the later of theirs)."""
        last = {a.stage: (i, a.microbatch) for i, whole in enumerate(actions) for a in whole.parts
                if a.kind in WEIGHT_GRAD_KINDS}
        final: dict[int, tuple] = {}  # id(p) -> (action index, stage, microbatch, p)
        for s, params in self.stage_params.items():
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


# ---- the loss -------------------------------------------------------------
@dataclass(eq=False)
class StepLoss:
    """One step's loss, microbatch by microbatch (see "The loss" in the module docstring).

    `weights`: (M,) float64 on the device, what each microbatch's loss is multiplied by so
    that the step's loss and gradients are those of the whole global batch, as in one
    process (the dp reduction then averages); `local_weights` the same for this dp
    replica's own loss, the one `value` returns by default (`weigh` makes both). `weighted`
    and `raw` collect the last stage's microbatch losses (detached) as they are computed."""

    weights: torch.Tensor
    local_weights: torch.Tensor
    here: bool  # this rank holds the last stage: the one that computes the loss
    weighted: list = field(default_factory=list)  # each microbatch's loss, weighted for the global batch
    raw: list = field(default_factory=list)  # each microbatch's loss as computed
    _cast: dict = field(default_factory=dict)  # (dtype, scale) -> `weight`'s tensors, one per microbatch

    @classmethod
    def weigh(cls, module: PipelineModule, labels: list | None, topo: Topology) -> StepLoss:
        """The weights of a step over `labels` (this rank's microbatch labels, or None), as
        (M,) float64 tensors on the device (no host sync).

        A token-level loss (a `loss_fn` with an `ignore_index`, like cross-entropy) is a mean
        over its microbatch's valid tokens: microbatch m weighs dp * valid_m / valid, valid
        counted over every microbatch and dp replica (one all-reduce over dp on the last
        stage), so masked labels give the one-process loss at any m and dp; for the replica's
        own loss it weighs valid_m / (its replica's valid). No valid token: weight 0. Any
        other loss weighs 1/M, the mean over microbatches, or, where microbatches hold
        different numbers of rows (`pipekit.Microbatches`), rows_m / rows: the mean over
        the replica's rows."""
        m, device = module.schedule.microbatches, topo.device
        here = (module.num_stages - 1) in module.local_stages
        ignore = getattr(module.loss_fn, "ignore_index", None)
        if (ignore is None or not here or labels is None
                or not torch.is_tensor(labels[0])):  # given on the last stage's rank (`PipelineEngine._check_needs`)
            rows = [y.shape[0] if torch.is_tensor(y) and y.dim() else 1 for y in labels or ()]
            if here and len(set(rows)) > 1:
                by_rows = torch.tensor(rows, dtype=torch.float64, device=device) / sum(rows)
                return cls(by_rows, by_rows, here)
            even = torch.full((m,), 1.0 / m, dtype=torch.float64, device=device)
            return cls(even, even, here)
        counts = torch.stack([(y != ignore).sum() for y in labels]).double()
        mine = counts.sum()
        local = torch.where(mine > 0, counts / mine, 0.0)
        total = mine.clone()
        if topo.dp_group is not None:
            dist.all_reduce(total, group=topo.dp_group)
        return cls(torch.where(total > 0, counts * (topo.dp / total), 0.0), local, here)

    def add(self, loss: torch.Tensor, m: int) -> None:
        """Record microbatch m's loss (a 0-dim tensor, as `loss_fn` computed it)."""
        loss = loss.detach()
        self.weighted.append(loss * self.weight(m, loss.dtype))
        self.raw.append(loss)

    def weight(self, m: int, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
        """Microbatch m's weight, times `scale` when given (the fp16 loss scale), as a 0-dim
        tensor of `dtype`: the (M,) weights are scaled and cast once per step (elementwise,
        so to the same values), not once per microbatch."""
        key = (dtype, scale)
        if key not in self._cast:
            scaled = self.weights if scale is None else self.weights * scale
            self._cast[key] = scaled.to(dtype).unbind()
        return self._cast[key][m]

    def value(self, reduce_loss: bool, topo: Topology, timeout: datetime.timedelta):
        """The loss `train_batch` / `eval_batch` return: with `reduce_loss`, the global
        batch's, as a float on every rank (collective); else this replica's as a 0-dim
        float64 tensor where the last stage is, None elsewhere (no communication, no sync;
        a microbatch without valid tokens counts 0, not its NaN)."""
        if reduce_loss:
            return self._mean_loss(topo, timeout)
        if not self.here:
            return None
        raw = torch.stack([loss.double() for loss in self.raw])
        return torch.where(self.local_weights != 0, raw * self.local_weights, 0.0).sum()

    def share(self, topo: Topology) -> torch.Tensor:
        """This rank's part of dp times the global batch's loss, in a sum over the whole world: its
        weighted microbatch losses on the last stage's rank of tp rank 0 (every tp rank holds the same
        ones; cp ranks hold parts); zero elsewhere. 0-dim float64, on the device."""
        total = torch.zeros((), dtype=torch.float64, device=topo.device)
        if self.weighted and topo.tp_rank == 0:
            total += torch.stack(self.weighted).double().sum()
        return total

    def from_marks(self, marks: Marks, topo: Topology) -> float:
        """The step's loss, from the marks' reduction (`share` summed over the world): every rank
        asked for it, or it is a one-line PipelineError on those that did."""
        assert marks.loss_read is not None, "the optimizer reads the marks (verdict) in every step"
        total, asked = marks.loss_read
        world = topo.world_size  # the ranks the marks were summed over (1: a rank alone)
        if asked != world:
            raise PipelineError(f"rank {topo.rank}: {int(asked)} of the {world} ranks passed reduce_loss=True to "
                                f"train_batch: every rank must pass the same reduce_loss (the loss is summed over "
                                f"the whole world)")
        return total / topo.dp if topo.dp > 1 else total  # the mean over dp replicas, as `_mean_loss`

    def _mean_loss(self, topo: Topology, timeout: datetime.timedelta) -> float:
        """The step's loss (the last stage's weighted microbatch losses, averaged over dp),
        given to every rank: the one host read, which the caller asked for."""
        total = torch.zeros((), dtype=torch.float64, device=topo.device)
        if self.weighted:
            total += torch.stack(self.weighted).double().sum()
        for axis, group in (("pp", topo.pp_group), ("dp", topo.dp_group)):
            if group is None:
                continue
            work = dist.all_reduce(total, group=group, async_op=True)
            try:
                work.wait(timeout=timeout)
            except RuntimeError as e:
                raise PipelineError(
                    f"rank {topo.rank}: the step's loss all-reduce over {axis} (reduce_loss=True) was not joined "
                    f"within {timeout.total_seconds():g} s: every rank must pass the same reduce_loss to "
                    f"train_batch / eval_batch, and run the same steps ({str(e).strip().splitlines()[0]})") from e
        if topo.dp_group is not None:
            total /= topo.dp
        return total.item()


def checked_loss(loss_fn, loss, training: bool) -> torch.Tensor:
    """`loss_fn`'s value if it is one number as a tensor (that has a grad, in training); else a
    TypeError/RuntimeError naming `loss_fn` and what it returned, not autograd's words later."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn {_loss_name(loss_fn)} returned {type(loss).__name__} ({loss!r:.40}); it must "
                        f"return the loss as a one-element torch.Tensor (keep it a tensor: no .item() or float())")
    if loss.numel() != 1:
        raise TypeError(f"loss_fn {_loss_name(loss_fn)} returned a tensor of shape {tuple(loss.shape)}; it must "
                        f"return one number (reduce it, e.g. with .mean() or reduction='mean')")
    if training and not loss.requires_grad:
        raise RuntimeError(f"loss_fn {_loss_name(loss_fn)} returned a loss that does not require grad: it does not "
                           f"depend on any trainable weight (a .detach(), .item() or torch.no_grad() in the loss, or "
                           f"every weight frozen)")
    return loss.reshape(())


def _loss_name(loss_fn) -> str:
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def as_zero_optimizer(optimizer, module: PipelineModule) -> ZeroOptimizer | None:
    """The one optimizer the engine drives: a ZeroOptimizer as given; a torch optimizer
    wrapped at stage 0 (`ZeroOptimizer.wrap`); a torch optimizer class or factory built
    by ZeroOptimizer over this rank's parameters (none at all on an empty stage)."""
    if optimizer is None:
        return optimizer
    if isinstance(optimizer, (ZeroOptimizer, torch.optim.Optimizer)):
        _check_own_parameters(optimizer, module)
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return ZeroOptimizer.wrap(optimizer, module)
    if callable(optimizer):
        return ZeroOptimizer(module, optimizer)
    raise TypeError(f"optimizer must be a pipekit.optim.ZeroOptimizer, a torch optimizer, or a torch optimizer "
                    f"class or factory, got {type(optimizer).__name__}")


def _check_own_parameters(optimizer, module: PipelineModule) -> None:
    """ValueError when a built optimizer holds tensors that are not `module`'s parameters (it was
    made over another model, or an earlier build of this one): they would step, this module not."""
    mine = {id(p) for p in module.parameters()}
    given = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in given if id(p) not in mine]
    if foreign:
        raise ValueError(f"the optimizer ({type(optimizer).__name__}) holds {len(foreign)} of {len(given)} tensors "
                         f"that are not this PipelineModule's parameters (the first of shape "
                         f"{tuple(foreign[0].shape)}): build it over this module's parameters(), or pass the "
                         f"optimizer class (optimizer=torch.optim.AdamW) and let the engine build it")


def _refuse_removed(removed: dict) -> None:
    """PipelineEngine's keywords that moved to the module, or never existed: a TypeError."""
    moved = [k for k in ("schedule", "num_microbatches") if k in removed]
    if moved:
        raise TypeError(f"PipelineEngine takes no {' or '.join(k + '=' for k in moved)}: the schedule is declared "
                        "once, on the module; declare it there: PipelineModule(..., schedule=..., "
                        "microbatches=...), and PipelineEngine(module) runs module.schedule")
    if removed:
        raise TypeError(f"PipelineEngine got unexpected keyword argument(s) {', '.join(sorted(removed))}")
