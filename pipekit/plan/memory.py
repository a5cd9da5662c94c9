"""The memory model behind `pipekit plan CONFIG --memory-budget-gb N`: for every schedule x
ZeRO stage (0-3) x sequence parallelism (off/on, at tp > 1) x activation checkpointing
(off / every transformer block), the bytes each rank holds, and the fastest plan that fits.

Nothing is allocated: parameter counts come from the model built on the meta device
(`layer_params`, with the run's fine-tuning applied as `pipekit train` applies it: model.lora's
adapters, every other weight frozen, and model.freeze), activation bytes from the run's own
layers run on the meta device (`meta_activations`).

Model state per rank (ZeRO, Rajbhandari et al. 2020), Ψ parameters of the rank's
stages (a tied weight, a GPT's embedding and head, counted once per rank holding it),
N the group the state is sharded over:

    params           Ψ · param bytes            / N at stage 3
    grads            Ψ · gradient bytes         / N at stages 2, 3
    master           Ψ · master bytes           / N at stages 1, 2, 3   (0 when params are fp32: their own master)
    optimizer        Ψ · k · master bytes       / N at stages 1, 2, 3   (k = 2 Adam moments; SGD with momentum 1)
    gathered         stage 3 only: parameters FSDP holds gathered whole, in param bytes. Without
                     `optimizer.reshard_after_forward` every layer stays gathered from its first use
                     to the step's end: the rank's whole Ψ; with it each layer is freed after its
                     forward and after its backward: the rank's largest layer
    unsharded_grads  stage 3 only: Ψ · gradient bytes, the step's gradients FSDP accumulates whole
                     until the one reduce-scatter at the step's end

Frozen parameters (fine-tuning: `profiler.finetune`) hold their weights alone, in param bytes:
the optimizer never sees them, so they have no gradient, master copy or moments. Below ZeRO-3
they are whole on every rank; at ZeRO-3 FSDP shards and gathers them as it does the trained
ones (and parameter offload keeps their shards on the host), with no gradient to reduce.
The adapters are trained parameters like any other: A (r, in) and B (out, r) per target linear,
DoRA's magnitude (out,) beside them, counted from the adapted model itself.

Bytes are the run's precision policy's: param bytes `param_dtype`, gradient bytes
`reduce_dtype` (the dtype `ZeroOptimizer` accumulates and reduces gradients in: fp32
under bf16/fp16, as its own table says), master and moments `master_dtype`.
Ψ on a rank: the dense parameters of its stages / tp (every one counted as split:
norm weights and MoE routers, in fact replicated over tp, are well under 1% of a
block), sharded over N = dp x cp (the ranks holding the same parameters); the routed
experts' parameters / ep (and / tp with `parallel.expert_tp`), sharded over N = edp =
dp x cp / ep (a group over N = 1 is whole: nothing gathered, its gradients in `grads`).

Activations per rank: a stage's microbatch holds its saved bytes from its F to its B/W,
so a rank's peak is `planner.activation_peaks` of the per-stage sums below. Per layer
and microbatch, the bytes one tp rank saves for backward are counted, not modelled
(`meta_activations`): the run's layers are built at its tp on the meta device (a
`FakeGroup(tp, 0)` as their tp group, sequence parallel when the option has it), one
microbatch runs forward in train mode under `torch.autograd.graph.saved_tensors_hooks`,
and the saved storages are summed, each once, parameters' left out (the loss's folded
into the last layer). So whatever the layers save (fused attention's log-sum-exp and no
score matrix, SP's gathered or sharded inputs, SwiGLU, rotary tables) is what is
counted, at the candidate's rows per microbatch. Attention on meta is routed to the
fused kernel a real run takes (torch's meta path is the math one). With activation
checkpointing a block holds its output (as counted, / t with SP), plus once per rank
the largest of its blocks' saved bytes (the block recomputed in backward). Routed
experts on meta see all the microbatch's tokens (no expert parallelism there).

Context parallelism (`context_rows`): the same ranks of the data axis (dp x cp) regrouped
into another cp, each other (cp, dp) with the global batch kept (the same rows per
microbatch, dp x microbatches kept), counted as above for the best row's candidate and
setting: a rank's layers then see seq_len / cp tokens. Memory only: the profile times
the layers at the config's own length, so no step time is predicted for another cp.

Fallback, when the layers cannot run on meta (the reason is printed with the plan):
the profile's tp=1 saved bytes M, per transformer block M · (10 + 24/t + 5as/(ht)) /
(34 + 5as/h) (Korthikanti et al. 2022, eq. 2, as a proportion), M / t with sequence
parallelism (their eq. 3), vocabulary-parallel layers M / t, other layers M (/ t with
SP); t = tp, a = heads, s = sequence length, h = model width.

Step time: the planner's prediction of the candidate (`planner.predict`), with
activation checkpointing adding each block's forward to its backward (in I, the half
that needs the activations), and ZeRO-3 adding per layer and microbatch an all-gather
of its trained parameters before its forward and again before its backward, each
`latency + (N-1)/N · bytes / bandwidth` on the planner's message model (the
reduce-scatter of gradients is not added: pipekit's ZeRO-2 already reduce-scatters
every microbatch, and neither stage's data-parallel traffic is otherwise modelled).
Not modelled: sequence parallelism's time (its all-gathers and reduce-scatters replace
tp's all-reduces: the same bytes, and tp's collectives are not modelled either), the
ZeRO-2 buckets in flight, the allocator's fragmentation, CUDA context and workspaces.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass, field, replace
from typing import cast

from omegaconf import OmegaConf

from ..config import CP_FAMILIES, Config, ConfigError, Run, check_config, resolve
from ..layers.parallel import FakeGroup
from ..models import model_specs
from ..schedules import Schedule, build_schedule
from ..spec import TiedLayerSpec
from .planner import Candidate, activation_peaks, predict
from .profiler import (
    KINDS,
    CommModel,
    LayerCost,
    Profile,
    SavedStorages,  # noqa: F401 - the memory plan's counter, where its tests find it
    meta_saved,
    params_of_layer,
    whole_model,
)

ZERO_STAGES = (0, 1, 2, 3)
BLOCK = "TransformerBlock"
COMPONENTS = ("params", "grads", "master", "optimizer", "gathered", "unsharded_grads", "activations")


@dataclass(frozen=True)
class Option:
    """One memory setting: ZeRO stage, sequence parallelism, activation checkpointing."""

    zero: int
    sp: bool
    ac: bool

    def label(self) -> str:
        return f"ZeRO-{self.zero}, SP {'on' if self.sp else 'off'}, AC {'every block' if self.ac else 'off'}"


@dataclass
class Memory:
    """Bytes on one rank."""

    params: float = 0.0
    grads: float = 0.0
    master: float = 0.0
    optimizer: float = 0.0
    gathered: float = 0.0
    unsharded_grads: float = 0.0
    activations: float = 0.0
    host: float = 0.0  # host memory offload keeps (`state_memory`): not device memory, not in `total`

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in COMPONENTS)


@dataclass
class MemoryRow:
    """A candidate under an option: its worst rank's memory and its predicted step."""

    candidate: Candidate
    option: Option
    memory: Memory  # the rank with the largest total
    per_rank: list[float]
    step_seconds: float
    fits: bool
    runnable: bool = True  # `pipekit train` accepts it (`runnable`; set for the rows `memory_plan` returns)
    timeline: list = field(default_factory=list, repr=False)
    activations_source: str = ""  # where the activation bytes come from (`planned_activations`)

    def record(self) -> dict:
        c = self.candidate
        return {"schedule": c.schedule, "chunks_per_rank": c.chunks_per_rank, "microbatches": c.microbatches,
                "micro_batch": c.micro_batch, "partition": c.partition, "boundaries": c.boundaries,
                "zero_stage": self.option.zero, "sequence_parallel": self.option.sp,
                "activation_checkpointing": self.option.ac, "runnable": self.runnable,
                "activations_source": self.activations_source,
                "bytes": {**{k: getattr(self.memory, k) for k in COMPONENTS}, "total": self.memory.total},
                "host_bytes": self.memory.host,
                "per_rank_total_bytes": self.per_rank, "step_seconds": self.step_seconds, "fits": self.fits}


# ---- parameters ------------------------------------------------------------------
@dataclass(frozen=True)
class Params:
    """Parameter counts of some layers: dense and routed-expert, each trained (gradients, master
    weights, optimizer state) or frozen (the weights alone)."""

    dense: float = 0.0
    expert: float = 0.0
    frozen_dense: float = 0.0
    frozen_expert: float = 0.0

    def __add__(self, other: Params) -> Params:
        return Params(*(a + b for a, b in zip(astuple(self), astuple(other))))

    @property
    def trained(self) -> float:
        return self.dense + self.expert


def layer_params(run: Run) -> list[Params]:
    """Per layer of the whole model (tp=1, ep=1, on the meta device, fine-tuned as the run
    trains it: `profiler.whole_model`): its parameter counts; a tied layer counts at each use
    (`tied_keys` tells a rank's uses apart)."""
    module, _ = whole_model(run, "meta")
    out = []
    for i in range(len(module.specs)):
        count = {(t, e): 0 for t in (True, False) for e in (True, False)}
        for p in params_of_layer(module, i):
            count[p.requires_grad, bool(getattr(p, "expert_parallel", False))] += p.numel()
        out.append(Params(count[True, False], count[True, True], count[False, False], count[False, True]))
    return out


def tied_keys(run: Run) -> list[str | None]:
    """Per layer: the key of the weights it shares with other layers (a `TiedLayerSpec`: a
    GPT's embedding and head), or None."""
    return [spec.key if isinstance(spec, TiedLayerSpec) else None for spec in model_specs(run.model)]


def held_once(layers: list[int], keys: list[str | None]) -> list[int]:
    """`layers` (a rank's), a tied key's later uses left out: the rank holds one copy of it."""
    seen: set[str] = set()
    out = []
    for i in layers:
        if keys[i] is not None:
            if keys[i] in seen:
                continue
            seen.add(keys[i])  # type: ignore[arg-type]
        out.append(i)
    return out


def rank_params(run: Run, split: list[Params]) -> Params:
    """The parameters of `split`'s layers on one rank: dense / tp, experts / ep (and / tp with
    parallel.expert_tp), trained and frozen alike."""
    total = sum(split, Params())
    experts = run.ep * (run.tp if run.config.parallel.expert_tp else 1)
    return Params(total.dense / run.tp, total.expert / experts, total.frozen_dense / run.tp,
                  total.frozen_expert / experts)


def state_memory(params: Params, run: Run, zero: int, gathered_params: Params = Params()) -> Memory:
    """Model state on one rank holding `params` (already split over tp and ep) at ZeRO stage
    `zero` (see the module docstring); `gathered_params`: the parameters (trained and frozen) a
    stage-3 rank holds gathered whole at once. Stage 3 also holds the step's gradients whole, in the reduce
    dtype, until the step's reduce-scatter. A group sharded over one rank (dp=1, or edp=1 for
    experts) is whole already: nothing is gathered and its gradients are the `grads`
    component. Frozen parameters: their weights and nothing else, sharded (and offloaded) at
    stage 3 as the trained ones are. With
    `optimizer.offload` (cpu, nvme) the master weights and optimizer state are not on the
    device, nor ZeRO-2's gradient shards: they count nothing here (`host`); with
    `optimizer.offload_params=cpu` (stage 3) neither are the sharded parameters (what is
    gathered still is), at dp=1 too (FSDP over the rank alone: gathered whole, as at dp > 1)."""
    policy, o = run.precision, run.config.optimizer
    width, grad = policy.param_dtype.itemsize, policy.reduce_dtype.itemsize
    master = policy.master_dtype.itemsize if policy.mixed else 0
    moments = (2 if o.name == "adamw" else (1 if o.momentum else 0)) * policy.master_dtype.itemsize
    mem = Memory()
    groups = ((params.dense, params.frozen_dense, run.zero_shards, gathered_params, True),
              (params.expert, params.frozen_expert, run.zero_shards // run.ep, gathered_params, False))
    for n, frozen, shards, gathered, dense in groups:
        whole = gathered.dense if dense else gathered.expert
        whole_frozen = gathered.frozen_dense if dense else gathered.frozen_expert
        # FSDP shards a group over more than one rank, or, with parameter offload, a rank alone (dp=1; not
        # split experts, which only their edp replicas shard). Parameter offload: the shards live in host
        # memory between uses, and their master weights and state with them; the step's gradient shard
        # is a device buffer (counted)
        fsdp = zero >= 3 and (shards > 1 or (o.offload_params == "cpu" and (dense or run.ep == 1)))
        params_on_host = o.offload_params == "cpu" and fsdp
        mem.params += (not params_on_host) * (n + frozen) * width / (shards if fsdp else 1)
        mem.host += params_on_host * frozen * width / shards  # a frozen shard: its weights, nothing else
        # ZeRO-2 with offload: the gradient shard is host memory, each reduced shard added in as reduced
        grads_on_host = zero == 2 and o.offload != "none"
        mem.grads += (not grads_on_host) * n * grad / (shards if zero >= 2 else 1)
        on_device = o.offload == "none" and not params_on_host
        mem.master += on_device * n * master / (shards if zero >= 1 else 1)
        mem.optimizer += on_device * n * moments / (shards if zero >= 1 else 1)
        mem.host += host_state(n / (shards if zero >= 1 else 1), run, params_on_host, moments, zero)
        if fsdp:
            mem.gathered += (whole + whole_frozen) * width
            mem.unsharded_grads += n * grad
    return mem


def host_state(owned: float, run: Run, params_on_host: bool, moments: int, zero: int = 0) -> float:
    """Host bytes offload keeps for `owned` trained parameters (a rank's shard): with
    `optimizer.offload=cpu` (or parameter offload) their master part (float32 even for a
    float32 model: a host tensor of its own; with parameter offload the shard itself, plus its
    float32 copy when mixed), the optimizer's moments and one host gradient buffer (at ZeRO-2
    the gradient shard itself, in the reduce dtype); the early step (`optimizer.offload_overlap`)
    keeps a second copy of the float32 master and the moments to put back. `moments`: bytes per
    parameter (`state_memory`'s). `nvme` keeps a few buckets at a time (its state is in files):
    counted 0 here but for ZeRO-2's gradient shard, which stays in memory. Not counted: ZeRO-2's
    two staging buffers of one bucket's shard each."""
    o, policy = run.config.optimizer, run.precision
    if o.offload == "nvme":
        return owned * policy.reduce_dtype.itemsize if zero == 2 else 0.0
    if o.offload == "none" and not params_on_host:
        return 0.0
    m = policy.master_dtype.itemsize
    master = (policy.param_dtype.itemsize + (m if policy.mixed else 0)) if params_on_host else m
    saved = m + moments if o.offload_overlap else 0
    return owned * (master + moments + policy.reduce_dtype.itemsize + saved)


def gathered_params(run: Run, splits: list[Params], mine: list[int]) -> Params:
    """The parameters a stage-3 rank holding layers `mine` (each held once) keeps gathered at
    its peak, trained and frozen (FSDP shards and gathers both): with
    `optimizer.reshard_after_forward` one layer at a time (FSDP frees each after its forward
    and after its backward), the largest; without, every layer from its first use to the
    step's end, so all of them."""
    per_layer = [rank_params(run, [splits[i]]) for i in mine]
    if not per_layer:
        return Params()
    if run.config.optimizer.reshard_after_forward:
        return max(per_layer, key=lambda p: p.trained + p.frozen_dense + p.frozen_expert)
    return sum(per_layer, Params())


# ---- activations -------------------------------------------------------------------
def meta_activations(run: Run, rows: int, sp: bool) -> list[tuple[int, int]]:
    """Per layer, one tp rank's (saved bytes, output bytes) for one microbatch of `rows`
    rows, counted by running the run's own layers on the meta device: built at the run's tp
    (a `FakeGroup(tp, 0)` as their tp group, sequence parallel when `sp`), one forward in
    train mode under `SavedStorages`, the loss's saved bytes folded into the last layer.
    Nothing is allocated and nothing communicates (meta collectives only shape). Exact
    for what these layers save, whatever they save (fused attention, SP's gathered inputs);
    routed experts see every token of the microbatch (no expert parallelism on meta).
    Context parallelism (cp > 1): a rank's layers see seq_len / cp tokens, and attention saves
    what it saves for that many (its own queries, keys, values, output and log-sum-exp; the
    ring's one block in flight is not saved), so they are counted at that length."""
    group = FakeGroup(run.tp, 0) if run.tp > 1 else None
    if run.cp > 1:
        cfg = run.config
        local = replace(cfg, train=replace(cfg.train, seq_len=cfg.train.seq_len // run.cp),
                                    parallel=replace(cfg.parallel, cp=1))
        run = replace(run, config=local)
    return meta_saved(run, rows, tp_group=group, sequence_parallel=sp and run.tp > 1)


def planned_activations(run: Run, layers: list[LayerCost], rows: int, sp: bool, ac: bool,
                        cache: dict | None = None) -> tuple[list[float], list[float], str]:
    """`layer_activations` from the meta count (`meta_activations`) at `rows` rows, and where
    the bytes come from; when the layers cannot run on meta, from `layers` (the profile)
    by Korthikanti et al.'s proportions, and the source says why."""
    key = (rows, sp and run.tp > 1)
    if cache is None or key not in cache:
        try:
            found: list[tuple[int, int]] | str = meta_activations(run, rows, key[1])
        except Exception as e:  # noqa: BLE001 -- any layer that cannot run on meta: say so, use the fallback
            found = f"{type(e).__name__}: {e}"
        if cache is not None:
            cache[key] = found
    else:
        found = cache[key]
    if isinstance(found, str):
        held, recompute = layer_activations(run, layers, sp, ac)
        return held, recompute, (f"the tp=1 profile scaled by Korthikanti et al.'s proportions (the layers "
                                 f"did not run on the meta device: {found})")
    held, recompute = layer_activations(run, layers, sp, ac, measured=found)
    return held, recompute, f"counted on the meta device at tp={run.tp}"


def tp_fraction(run: Run, sp: bool) -> float:
    """The share of a transformer block's activations one tp rank keeps (Korthikanti et al.):
    the fallback when the layers cannot be counted on meta."""
    t = run.tp
    if t == 1:
        return 1.0
    if sp:
        return 1.0 / t
    a, h, s = run.model.n_heads, run.model.dim, run.config.train.seq_len
    attn = 5 * a * s / h
    return (10 + 24 / t + attn / t) / (34 + attn)


def layer_activations(run: Run, layers: list[LayerCost], sp: bool, ac: bool,
                      measured: list[tuple[int, int]] | None = None) -> tuple[list[float], list[float]]:
    """Per layer, on one rank: (bytes held per microbatch in flight, bytes of the block
    recomputed in backward: 0 unless `ac` and a block). `measured`: per layer (saved,
    output) bytes of one tp rank (`meta_activations`), used as they are; without it,
    `layers`' tp=1 bytes by Korthikanti et al.'s proportions (the fallback)."""
    t, frac = run.tp, tp_fraction(run, sp)
    held, recompute = [], []
    for i, c in enumerate(layers):
        block = c.name == BLOCK
        if measured is not None:
            saved, out = measured[i]
            held.append(float(out if ac and block else saved))
            recompute.append(float(saved) if ac and block else 0.0)
        elif block:
            full = c.saved_bytes * frac
            held.append(c.out_bytes / (t if sp else 1) if ac else full)
            recompute.append(full if ac else 0.0)
        else:
            split = c.name.startswith("VocabParallel") or sp
            held.append(c.saved_bytes / (t if split else 1))
            recompute.append(0.0)
    return held, recompute


# ---- time ----------------------------------------------------------------------------
def adjusted_layers(run: Run, layers: list[LayerCost], splits: list[Params], comm: CommModel,
                    option: Option) -> list[LayerCost]:
    """The layers' costs (per rank, already / tp) with checkpointing's recompute and ZeRO-3's
    gathers (of every parameter, trained and frozen: FSDP shards both)."""
    width = run.precision.param_dtype.itemsize
    out = []
    for c, split in zip(layers, splits):
        extra_f = extra_b = 0.0
        if option.ac and c.name == BLOCK:
            extra_b += c.F
        if option.zero >= 3:
            mine = rank_params(run, [split])
            for n, shards in ((mine.dense + mine.frozen_dense, run.zero_shards),
                              (mine.expert + mine.frozen_expert, run.zero_shards // run.ep)):
                if n and shards > 1:
                    gather = comm.latency + (shards - 1) / shards * n * width / comm.bandwidth
                    extra_f += gather
                    extra_b += gather
        out.append(replace(c, F=c.F + extra_f, B=c.B + extra_b, I=c.I + extra_b))
    return out


# ---- one candidate's bytes ---------------------------------------------------------------
def rank_memory(run: Run, schedule: Schedule, boundaries: list[int], zero: int, held: list[float],
                recompute: list[float], splits: list[Params], keys: list[str | None]) -> list[Memory]:
    """Per pipeline rank, what it holds running `schedule` cut at `boundaries` at ZeRO stage
    `zero`: the model state of its layers (a tied weight once) and its activations' peak
    (`held` per layer and microbatch in flight, plus its largest block recomputed in backward,
    from `planned_activations`). The one count behind every memory figure the plan prints."""
    stages = list(zip(boundaries, boundaries[1:]))
    peaks = activation_peaks(schedule, [round(sum(held[lo:hi])) for lo, hi in stages])
    mems = []
    for r in range(schedule.pp):
        mine = [i for s in schedule.local_stages(r) for i in range(*stages[s])]
        once = held_once(mine, keys)
        mem = state_memory(rank_params(run, [splits[i] for i in once]), run, zero, gathered_params(run, splits, once))
        mem.activations = peaks[r] + max((recompute[i] for i in mine), default=0.0)
        mems.append(mem)
    return mems


def run_option(run: Run) -> Option:
    """The run's own memory setting: its ZeRO stage, its sequence parallelism (at tp > 1), and
    activation checkpointing when every transformer block is recomputed
    (schedule.activation_checkpoint_interval=1, or schedule.checkpoint_layers matching the
    blocks); a longer interval is not modelled and counts as off (`unmodelled_checkpointing`)."""
    s = run.config.schedule
    ac = s.activation_checkpoint_interval == 1 or bool(s.checkpoint_layers and re.search(s.checkpoint_layers, BLOCK))
    return Option(run.config.optimizer.zero_stage, run.config.parallel.sequence_parallel and run.tp > 1, ac)


def unmodelled_checkpointing(run: Run) -> str | None:
    """Why the run's activation checkpointing is counted as off (`run_option`), or None."""
    k = run.config.schedule.activation_checkpoint_interval
    if k > 1:
        return f"schedule.activation_checkpoint_interval={k} is not modelled: counted without checkpointing"
    return None


def run_memory(run: Run, profile: Profile, candidates: list[Candidate]) -> tuple[list[list[float]], set[str]]:
    """Each candidate's total bytes per pipeline rank at the run's own settings (`run_option`),
    counted as `memory_plan` counts its rows (`rank_memory`), so the candidate table and the
    memory plan's row of the same candidate and option print the same figure; and where the
    activation bytes come from."""
    option, splits, keys = run_option(run), layer_params(run), tied_keys(run)
    activations: dict = {}
    out, sources = [], set()
    for cand in candidates:
        schedule = build_schedule(cand.schedule, run.pp, cand.microbatches, cand.chunks_per_rank)
        held, recompute, source = planned_activations(run, profile.at(cand.micro_batch), cand.micro_batch,
                                                      option.sp, option.ac, activations)
        mems = rank_memory(run, schedule, cand.boundaries, option.zero, held, recompute, splits, keys)
        out.append([m.total for m in mems])
        sources.add(source)
    return out, sources


# ---- the plan --------------------------------------------------------------------------
def options(run: Run) -> list[Option]:
    """Every (ZeRO stage, SP, AC); SP only where tp > 1, ZeRO stages 1-3 only where dp x cp > 1
    (over one rank they shard nothing)."""
    sps = (False, True) if run.tp > 1 else (False,)
    zeros = ZERO_STAGES if run.zero_shards > 1 else (0,)
    return [Option(z, sp, ac) for z in zeros for sp in sps for ac in (False, True)]


def runnable(run: Run, row: MemoryRow) -> bool:
    """Whether `pipekit train` accepts the run with the row's overrides (`row_overrides`: its
    schedule, microbatches, partition, ZeRO stage, checkpointing, SP): the config's own checks
    decide. Refused, for instance: ZeRO-3 or a schedule with nothing to overlap beside
    `schedule.overlap=true`, ZeRO 0-2 with `parallel.dp_shard` (ZeRO-3's hybrid sharding),
    sequence parallelism with `parallel.expert_tp`. The plan still counts such a row's bytes."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(run.config), OmegaConf.from_dotlist(row_overrides(row)))
        cfg = cast(Config, OmegaConf.to_object(merged))
        check_config(cfg)
        resolve(cfg)
    except ConfigError:
        return False
    return True


def memory_plan(run: Run, profile: Profile, comm: CommModel, candidates: list[Candidate],
                budget: float) -> list[MemoryRow]:
    """For each (schedule, chunks) and option, the fastest of `candidates` (microbatches x
    partition) that fits `budget` bytes on every rank, or else the one needing least
    memory; rows that fit first, fastest first, then the rest by memory."""
    splits, keys = layer_params(run), tied_keys(run)
    by_schedule: dict[tuple[str, int, Option], list[MemoryRow]] = {}
    cache: dict[tuple, dict] = {}
    activations: dict = {}  # (rows, sp) -> the meta count, or why there is none
    for cand in candidates:
        layers = [replace(c, **{k: getattr(c, k) / run.tp for k in KINDS}) for c in profile.at(cand.micro_batch)]
        schedule = build_schedule(cand.schedule, run.pp, cand.microbatches, cand.chunks_per_rank)
        for option in options(run):
            held, recompute, source = planned_activations(run, layers, cand.micro_batch, option.sp, option.ac,
                                                          activations)
            mems = rank_memory(run, schedule, cand.boundaries, option.zero, held, recompute, splits, keys)
            worst = max(mems, key=lambda m: m.total)
            key = (id(cand), option.ac, option.zero >= 3)
            if key not in cache:
                cache[key] = predict(schedule, adjusted_layers(run, layers, splits, comm, option), cand.boundaries,
                                     comm, profile.optimizer_seconds_per_param)
            p = cache[key]
            row = MemoryRow(cand, option, worst, [m.total for m in mems], p["step"], worst.total <= budget,
                            timeline=p["timeline"], activations_source=source)
            by_schedule.setdefault((cand.schedule, cand.chunks_per_rank, option), []).append(row)
    best = [min(rows, key=lambda r: (not r.fits, r.step_seconds if r.fits else r.memory.total))
            for rows in by_schedule.values()]
    for row in best:
        row.runnable = runnable(run, row)
    best.sort(key=lambda r: (not r.fits, r.step_seconds if r.fits else r.memory.total,
                             r.option.zero, r.option.sp, r.option.ac))
    return best


# ---- context parallelism -------------------------------------------------------------------
@dataclass
class ContextRow:
    """The best memory row's candidate and setting at another context-parallel degree."""

    cp: int
    dp: int
    microbatches: int
    memory: Memory  # the worst rank's
    fits: bool
    overrides: list[str]

    def record(self) -> dict:
        return {"cp": self.cp, "dp": self.dp, "microbatches": self.microbatches, "fits": self.fits,
                "bytes": {**{k: getattr(self.memory, k) for k in COMPONENTS}, "total": self.memory.total},
                "overrides": self.overrides}


def activations_dominate(row: MemoryRow) -> bool:
    """Whether activations are the largest share of the row's worst rank: at least half its bytes."""
    return row.memory.activations >= 0.5 * row.memory.total


def context_rows(run: Run, profile: Profile, row: MemoryRow, budget: float) -> tuple[list[ContextRow], list[str]]:
    """`row`'s candidate and setting at every other cp the data axis allows (see the module
    docstring), smallest cp first; and one line per cp the config's checks refuse, saying why."""
    axis, cand, option, cfg = run.zero_shards, row.candidate, row.option, run.config
    if run.family not in CP_FAMILIES:
        return [], [f"model.family={run.family} has no context-parallel attention ({', '.join(CP_FAMILIES)} do)"]
    rows, refused = [], []
    for cp in range(1, axis + 1):
        if axis % cp or cp == run.cp:
            continue
        dp = axis // cp
        if (cand.microbatches * run.dp) % dp:
            refused.append(f"cp={cp}: dp={dp} does not divide dp x microbatches = {cand.microbatches * run.dp}")
            continue
        micro = cand.microbatches * run.dp // dp
        overrides = [f"parallel.cp={cp}", f"parallel.dp={dp}", f"schedule.microbatches={micro}"]
        try:
            merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(
                [*row_overrides(row), *overrides]))
            other = cast(Config, OmegaConf.to_object(merged))
            check_config(other)
            at = resolve(other)
            schedule = build_schedule(cand.schedule, at.pp, micro, cand.chunks_per_rank)
        except (ConfigError, ValueError) as e:
            refused.append(f"cp={cp}: {e}")
            continue
        layers = profile.at(cand.micro_batch)
        held, recompute, _ = planned_activations(at, layers, cand.micro_batch, option.sp, option.ac)
        mems = rank_memory(at, schedule, cand.boundaries, option.zero, held, recompute, layer_params(at),
                           tied_keys(at))
        worst = max(mems, key=lambda m: m.total)
        rows.append(ContextRow(cp, dp, micro, worst, worst.total <= budget, overrides))
    return rows, refused


# ---- the report ------------------------------------------------------------------------
def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def memory_table(rows: list[MemoryRow], top: int | None = None) -> str:
    """The rows as a table, in GiB per rank (the worst rank's); a `host GiB` column beside the
    device total when offload keeps state in host memory (`host_state`)."""
    host = any(r.memory.host for r in rows[:top])
    table = [["schedule", "chunks", "mb x rows", "ZeRO", "SP", "AC", "params", "grads", "master", "optim",
              "gathered", "unsh. grads", "activ.", "total GiB", *(["host GiB"] if host else []), "step ms", ""]]
    for r in rows[:top]:
        c, m, o = r.candidate, r.memory, r.option
        note = ("fits" if r.fits else "over budget") + ("" if r.runnable else " (refused by pipekit train)")
        table.append([c.schedule, str(c.chunks_per_rank), f"{c.microbatches} x {c.micro_batch}", str(o.zero),
                      "on" if o.sp else "off", "on" if o.ac else "off",
                      *(_gib(getattr(m, k)) for k in COMPONENTS), _gib(m.total), *([_gib(m.host)] if host else []),
                      f"{r.step_seconds * 1e3:.1f}", note])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def row_overrides(row: MemoryRow) -> list[str]:
    """`pipekit train` overrides of a row: the candidate's, its ZeRO stage, checkpointing and SP."""
    out = [*row.candidate.overrides(), f"optimizer.zero_stage={row.option.zero}",
           f"schedule.activation_checkpoint_interval={1 if row.option.ac else 0}"]
    if row.option.sp:
        out.append("parallel.sequence_parallel=true")
    return out
