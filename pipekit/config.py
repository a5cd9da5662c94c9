"""Experiment configs: typed dataclasses, merged with YAML and `key=value` overrides,
and resolved once into the `Run` that every part of pipekit takes.

`load_run(path, overrides)` builds `OmegaConf.structured(Config)`, merges the
YAML file and the dot-list overrides (an unknown key or a value of the wrong
type fails with OmegaConf's message naming the key), converts the result to
real dataclasses, checks the values (`check_config`), and `resolve`s the run:
imports `schedule.module`, makes the family's model config, the `Schedule`,
the precision policy and the partition, and checks them against each other —
all before any worker is launched (and again, identically, in each worker,
from the same arguments). `load_config` is the same, returning the keys alone.

    run = load_run("configs/gpt2_tiny.yaml", ["parallel.pp=2"])
    run.model, run.schedule, run.precision, (run.pp, run.dp, run.tp, run.ep)
    train(run); planner.plan(run, ...); check_before_launch(run)

Limits: a `Run` is frozen (its fields cannot be reassigned; it keeps its own
copy of the keys), but the model config and the keys inside it are plain
dataclasses: treat them as read-only.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import importlib.util
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional, cast

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import rules
from .kernels import dispatch as kernel_dispatch
from .models import FAMILIES, config_from_dict, get_model, model_keys, model_specs, model_vocab
from .optim.factory import FUSED
from .optim.lr import check_scheduler
from .optim.offload import steps_on
from .partition import check_boundaries, layer_weights
from .precision import PRECISION_NAMES, Precision, precision_policy
from .schedules import SCHEDULES, Schedule, ScheduleError, build_schedule, load_schedule
from .spec import spec_name
from .topology import default_timeout, local_workers, resolve_device

# The ModelConfig keys that are sizes: when set, each must be >= 1 (checked with the key named as given).
_MODEL_SIZES = ("vocab_size", "max_seq_len", "n_layers", "dim", "n_heads", "n_kv_heads", "hidden",
                "vocab_pad_multiple", "n_experts", "top_k", "n_groups", "topk_groups")


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, DoRA) on the layers `targets` names; the adapted weights freeze."""

    rank: int = 0  # the adapters' rank r (0: no adapters)
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
    # a regex over the stable layer names (layers.3.attn.q, layers.3.mlp.fc; MoE experts' grouped weights
    # layers.3.mlp.experts.w_gate / w_up / w_down: every expert its own adapter)
    targets: str = r"attn\.(q|k|v|o)$"
    dora: bool = False  # weight-decomposed adapters (DoRA): a learned magnitude per output row


@dataclass
class ModelConfig:
    family: str = "gpt2"  # gpt2 | llama | mixtral | toy (with model.init: the weights' own)
    flavour: str = "tiny"  # a named size of the family (pipekit.models FLAVOURS)
    kernels: Optional[str] = None  # auto | triton | torch: the fused kernels' side (pipekit.kernels; float64:
    #                                torch); null: $PIPEKIT_KERNELS, else auto
    # Start from weights: a Hugging Face model dir, a pipekit model.pt or a pipekit checkpoint. The family
    # and every size come from it; each rank reads only the tensors of the stages and shards it holds.
    init: Optional[str] = None
    freeze: Optional[str] = None  # a regex over parameter names (layers.3.attn.q.weight): those are not trained
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Any of these, when set, overrides the flavour's value.
    vocab_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    n_layers: Optional[int] = None
    dim: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None  # llama: grouped-query attention
    hidden: Optional[int] = None  # llama: feed-forward width
    tie_embeddings: Optional[bool] = None
    rope_theta: Optional[float] = None
    # llama | mixtral: rotary scaling as Hugging Face writes it ({rope_type: llama3, factor: 8.0, low_freq_factor: 1.0,
    # high_freq_factor: 4.0, original_max_position_embeddings: 8192}, or {rope_type: linear, factor: 2.0})
    rope_scaling: Optional[dict[str, Any]] = None
    head_dim: Optional[int] = None  # llama | mixtral: each head's width (default dim / n_heads)
    qkv_bias: Optional[bool] = None  # llama: biases on q, k, v (Qwen2)
    qk_norm: Optional[bool] = None  # llama | mixtral: RMSNorm on each q and k head (Qwen3)
    sliding_window: Optional[int] = None  # llama | mixtral: each token sees the last W tokens (Mistral 7B v0.1)
    vocab_pad_multiple: Optional[int] = None  # tables padded to a multiple of this (default 128; masked, exact)
    fused_loss: Optional[bool] = None  # gpt2 | llama | mixtral: head fused into the loss, no logits in training
    # mixtral (MoE): routed experts, experts per token, always-on shared experts, router settings
    n_experts: Optional[int] = None
    top_k: Optional[int] = None
    n_shared_experts: Optional[int] = None
    score: Optional[str] = None  # softmax | sigmoid
    renormalize: Optional[bool] = None  # a token's top_k weights rescaled to sum to 1 (default: when top_k > 1)
    aux_loss_coef: Optional[float] = None
    global_balance: Optional[bool] = None  # the balancing loss on the whole step's loads (microbatches x dp):
    #                                        the same training at any micro_batch / dp / ep; an extra forward
    z_loss_coef: Optional[float] = None
    bias_update_rate: Optional[float] = None  # DeepSeek-V3 aux-loss-free bias: its move per step (0: off)
    n_groups: Optional[int] = None  # device-limited routing (DeepSeek-V3's n_group / topk_group): experts in
    topk_groups: Optional[int] = None  # n_groups groups, each token in its topk_groups best (n_groups=ep: ranks)
    capacity_factor: Optional[float] = None  # unset: dropless
    token_drop_policy: Optional[str] = None  # with a capacity: position | probs (Megatron's moe_token_drop_policy)
    pad_expert_input_to_capacity: Optional[bool] = None  # with a capacity: experts padded to exactly capacity rows


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline stages
    dp: int = 1  # data-parallel replicas
    tp: int = 1  # tensor-parallel ranks per stage
    ep: int = 1  # expert-parallel ranks: MoE experts sharded over groups of ep dp ranks (divides dp)
    # expert tensor parallelism (Megatron's expert-TP): with tp > 1, split each MoE expert's hidden
    # dimension over the tp ranks, so none repeats another's expert work (false: every tp rank runs its
    # experts whole). Needs the experts' hidden divisible by tp.
    expert_tp: bool = False
    # sequence parallelism (Megatron's): with tp > 1, the activations outside attention and the MLP
    # (norms, residual adds, stage boundaries) are split along the sequence over the tp ranks (an
    # all-gather / reduce-scatter replaces each all-reduce); a no-op at tp=1. Needs train.seq_len
    # divisible by tp; MoE blocks route each rank's slice; not with expert_tp.
    sequence_parallel: bool = False
    # context parallelism: cp ranks per data replica split every sequence (each holds chunks i and 2cp-1-i of
    # its 2cp chunks: the same attention work on every rank), attention crossing them by cp_mode: ring (keys and
    # values passed around, merged by log-sum-exp) or ulysses (all-to-all to head shards). world = pp*dp*tp*cp;
    # train.seq_len divisible by 2*cp; ulysses: the heads per tp rank divisible by cp. gpt2, llama, mixtral.
    cp: int = 1
    cp_mode: str = "ring"
    # ZeRO-3's hybrid sharding (FSDP's HSDP): runs of dp_shard consecutive dp ranks shard the parameters,
    # the dp // dp_shard runs replicate each other (all-gathers stay within a run: a node). None: all of dp.
    dp_shard: Optional[int] = None


@dataclass
class ScheduleConfig:
    name: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv | dualpipe_v, one registered by
    #                     schedule.module, or the path of an action-table file (pipekit.schedules.load_schedule)
    module: Optional[str] = None  # a Python module (dotted name, or a .py file) imported before the schedule is
    #                               built, in the launcher and in every worker: it calls register_schedule
    microbatches: int = 4  # per optimizer step and dp replica
    chunks_per_rank: Optional[int] = None  # virtual stages per rank; None: the schedule's own (2 for
    #                                       interleaved_1f1b, zbv and dualpipe_v, else 1)
    partition: str = "parameters"  # uniform | parameters | profile | type:REGEX | boundaries "0,3,7"
    memory_budget_gb: Optional[float] = None  # partition=profile: the memory per rank the stages must fit in
    activation_checkpoint_interval: int = 0  # recompute runs of this many layers (0: off)
    checkpoint_layers: Optional[str] = None  # or recompute layers whose class matches this regex
    overlap: bool = False  # run each forward beside a neighbouring backward of another microbatch (OVERLAP
    #                        actions), so that the MoE all-to-all and tp all-reduce of one hide behind the other


@dataclass
class OptimizerConfig:
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr: float = 1e-4  # end of the cosine decay
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | constant
    # a DeepSpeed scheduler block {type: WarmupLR | WarmupDecayLR | WarmupCosineLR | OneCycle | LRRangeTest,
    # params: {...}}, with DeepSpeed's meaning at every step; when set, it replaces warmup_steps / decay / min_lr
    scheduler: Optional[dict[str, Any]] = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad_norm: Optional[float] = 1.0  # global L2 norm over all parallel groups (None: off)
    name: str = "adamw"  # adamw | sgd
    momentum: float = 0.0  # sgd only
    zero_stage: int = 0  # 0: replicated; 1: optimizer state + master weights sharded over dp; 2: gradients too;
    #                      3: parameters too (each layer FSDP2-sharded over dp; experts stay split over ep only)
    reshard_after_forward: bool = False  # zero_stage=3: free a layer's gathered parameters after each forward
    #                                      (gathered again per microbatch) instead of keeping them for the step
    bucket_mb: float = 25.0  # ZeRO-2 reduce-scatter bucket size, in MB of gradients
    fused: str = "auto"  # auto | true | false: AdamW as one Triton kernel per bucket (pipekit.kernels.adamw);
    #                      auto: on where the master weights are CUDA float32
    offload: str = "none"  # none | cpu | nvme: master weights and optimizer state in host memory (cpu) or in
    #                        files under offload_dir (nvme, streamed a few buckets at a time); the step on the CPU
    offload_dir: Optional[str] = None  # offload=nvme: the directory the state files go in (a fast local disk)
    pin_memory: bool = True  # offload: page-locked host buffers for the device<->host copies (CUDA only)
    offload_params: str = "none"  # none | cpu: zero_stage=3's parameter shards and their gradients in host memory
    #                               between uses (FSDP2's CPUOffloadPolicy), and so their step on the CPU
    #                               (optimizer.offload=none steps as cpu; nvme keeps the state in files)
    offload_overlap: bool = False  # offload=cpu|nvme: each rank's host step begins as soon as its own gradients
    #                                are reduced, overlapping the other stages' cooldown (cpu: a copy of the state,
    #                                kept to put back where the step is then skipped or clipped: same bits, 2x host
    #                                state; nvme: the stepped state to a second file per bucket, kept or dropped)


@dataclass
class Fp16Config:
    """Loss scaling for train.precision=fp16, with DeepSpeed's knobs and meanings."""

    loss_scale: float = 0.0  # 0: dynamic; > 0: this static scale
    initial_scale_power: int = 16  # dynamic scaling starts at 2**this
    loss_scale_window: int = 1000  # clean steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_loss_scale: float = 1.0  # the scale never goes below this
    consecutive_hysteresis: bool = False  # true: a clean step restores the overflow tolerance (DeepSpeed's)


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (this Python's own source, byte tokens) | synthetic | a `prepare-data` dir
    val_every: int = 50  # steps between validation losses (0: never)
    val_batches: int = 2
    # pack whole documents into each row (first fit; a longer one cut into seq_len pieces), padding the rest
    # (labels -100); the model gets each token's position in its document and attends within it. false: a row is
    # a window of the token stream, crossing documents. Needs a prepared dataset and a gpt2/llama/mixtral model.
    pack: bool = False
    # with pack=true: cut each microbatch's padding tail, down to its longest row's last labelled place rounded up
    # to train.seq_len_multiple, so the microbatches of a step differ in length (pipekit.Microbatches); the loss
    # and gradients do not change (causal attention: nothing before the cut reads the tail)
    trim_padding: bool = False


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch: int = 4  # sequences per microbatch
    global_batch: Optional[int] = None  # = micro_batch * schedule.microbatches * parallel.dp (checked)
    seq_len: int = 128
    # sequence-length warm-up (DeepSpeed's seqlen curriculum): from seq_len_start (None: off) up to seq_len over
    # seq_len_warmup_steps steps, rounded down to multiples of seq_len_multiple; seq_len_root 1: linear, 2:
    # square root... (fixed_root). Each batch is cut to its step's length (pipekit/run/curriculum.py).
    seq_len_start: Optional[int] = None
    seq_len_warmup_steps: int = 0
    seq_len_multiple: int = 8
    seq_len_root: float = 1.0
    seed: int = 0
    dtype: str = "float32"  # float32 | float64: the dtype parameters are initialised (and kept) in
    device: str = "auto"  # auto | cpu | cuda (auto: CUDA when every node has a GPU per local worker)
    precision: str = "fp32"  # fp32 | bf16 | fp16: weights and activations; master weights stay fp32
    compile: bool = False  # torch.compile each layer (transformer block) separately
    resume: Optional[str] = None  # auto: the newest complete checkpoint in checkpoint.dir (none: start fresh,
    #                               where out_dir holds no other run); or a checkpoint directory
    #                               (checkpoints/step_00000100; an older one of this run starts a branch)
    max_skipped_steps: int = 5  # stop (diverged) after this many steps in a row skipped for a non-finite loss or
    #                            gradients (fp16 overflows while the loss scale can still fall do not count)
    allow_changed: Optional[str] = None  # on resume, keys that make it another run which may differ from the
    #                                      checkpoint's anyway, comma-separated: model.KEY (as the checkpoint's
    #                                      model names it, e.g. model.aux_loss_coef), train.seed,
    #                                      train.seq_len, data.source, data (the dataset's files at the
    #                                      same data.source, re-prepared: other contents); other keys may always change


@dataclass
class LoggingConfig:
    out_dir: Optional[str] = None  # metrics.jsonl, TensorBoard events and model.pt go here
    log_every: int = 10
    progress: bool = True  # a progress bar on rank 0
    tensorboard: bool = True  # when the tensorboard package is installed
    peak_tflops: Optional[float] = None  # per device, for MFU (None: look up the GPU, or measure the CPU)
    trace_step: Optional[int] = None  # record this step's measured timeline to out_dir (Chrome trace, PNG)
    overwrite: bool = False  # let this run replace another run's files in out_dir


@dataclass
class CheckpointConfig:
    """Resumable, layout-free checkpoints (torch.distributed.checkpoint) under `dir`."""

    every: int = 0  # save every this many steps (0: only at the end of the run)
    keep: int = 2  # keep the newest this many complete checkpoints; older ones are deleted
    dir: Optional[str] = None  # default: {logging.out_dir}/checkpoints (no out_dir: no checkpoints)
    at_end: bool = True  # save one after the last step
    # After passing SIGTERM, SIGINT, SIGHUP or SIGUSR1 on to its workers, `pipekit train`'s launcher
    # waits this long for them to finish the step and save, then kills them: allow a step and a save.
    stop_grace_s: int = 600


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    fp16: Fp16Config = field(default_factory=Fp16Config)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.pp * self.parallel.dp * self.parallel.tp * self.parallel.cp


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


# The keys besides the model's whose change makes a resumed run another run (other weights or
# other batches at the same step): refused on resume unless named in train.allow_changed.
# "data" is the dataset's contents: the fingerprint (sizes, CRC-32s) its meta.json records.
RUN_DEFINING = ("train.seed", "train.seq_len", "data.source", "data")


def load_run(path: str | None = None, overrides: list[str] | None = None) -> Run:
    """Read the YAML file and the `key=value` overrides, check them and resolve the run:
    what `pipekit train` and `pipekit plan` call, in the launcher and in each worker."""
    cfg, given = _merged(path, overrides)
    return resolve(cfg, given)


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """The checked config alone (`load_run(...).config`): every check `load_run` makes is
    made, the model's and the schedule's too."""
    return load_run(path, overrides).config


# The keys that name a path: an empty one (an unset shell variable) is refused, and so is a number or a boolean.
PATH_KEYS = ("logging.out_dir", "checkpoint.dir", "train.resume", "data.source", "model.init", "schedule.module",
             "optimizer.offload_dir")
_BOOL_WORDS = ("optimizer.fused",)  # string keys whose values include true / false


def _schema_types(cls=None, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the schema (`train.resume`) and its annotation."""
    out: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls or Config).items():
        if dataclasses.is_dataclass(hint):
            out.update(_schema_types(hint, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = hint
    return out


_TYPES = _schema_types()
STRING_KEYS = tuple(k for k, t in _TYPES.items() if t in (str, Optional[str]))
SECTIONS = tuple(dict.fromkeys(k.rsplit(".", 1)[0] for k in _TYPES if "." in k))


def _flat(node, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a plain nested dict (a YAML part as given)."""
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _yaml_reason(e: Exception) -> str:
    """A YAML parser error as '<problem> (line L, column C)', its first line when it has no mark."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(e).strip().splitlines()[0].strip()


def _load_file(path: str):
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except IsADirectoryError as e:
        raise ConfigError(f"{path} is a directory; give a YAML file such as configs/gpt2_tiny.yaml") from e
    except Exception as e:  # noqa: BLE001 - yaml's parser errors (yaml is OmegaConf's dependency)
        if type(e).__module__.startswith("yaml"):
            raise ConfigError(f"{path} is not valid YAML: {_yaml_reason(e)}") from e
        raise
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path} holds a YAML {'list' if isinstance(loaded, ListConfig) else 'value'} at its "
                          "top level; a config is a mapping of sections (model:, train:, ...), as in "
                          "configs/gpt2_tiny.yaml")
    return loaded


def _load_override(text: str):
    """One `key=value` override as its own part, so that its errors name it."""
    key, _, value = text.partition("=")
    if not key or any(not piece.strip() for piece in key.split(".")):
        raise ConfigError(f"override {text!r} names no key{'' if key else ' before ='}; write KEY=VALUE, "
                          "e.g. train.steps=100")
    if value.strip() == "" and key in STRING_KEYS:
        raise ConfigError(f"{key}= is empty (an unset shell variable?); give a value, or {key}=null to leave it "
                          "unset")
    try:
        return OmegaConf.from_dotlist([text])
    except Exception as e:  # noqa: BLE001 - yaml's parser errors, on the value alone
        if type(e).__module__.startswith("yaml"):
            raise ConfigError(f"override {text!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                              "quote it, e.g. "
                              f"{key}=\"'{value}'\"") from e
        raise


def _check_given_types(where: str, given: dict[str, Any]) -> None:
    """A string key given a boolean (YAML 1.1 reads no/yes/on/off as one), or a path key a number: refused,
    as OmegaConf would turn it into the text 'False' or '2024' silently."""
    for key, value in given.items():
        if key in SECTIONS and value is not None:
            keys = [k.rsplit(".", 1)[1] for k in _TYPES if k.rsplit(".", 1)[0] == key][:3]
            raise ConfigError(f"{key}={_shown(value)} ({where}): {key} is a section, not a value; set its keys, "
                              f"e.g. {', '.join(f'{key}.{k}' for k in keys)}")
        if key not in STRING_KEYS or value is None or isinstance(value, str):
            continue
        if isinstance(value, bool) and key not in _BOOL_WORDS:
            raise ConfigError(f"{key}={str(value).lower()} ({where}) is a boolean, not text (YAML reads no, yes, "
                              f"on, off as one); quote it ('no') if you mean the word, or leave {key} out")
        if key in PATH_KEYS and not isinstance(value, bool):
            raise ConfigError(f"{key}={value} ({where}) is a number, not a path; quote it "
                              f"('{value}') if you mean that name")


def _merge_error(e: OmegaConfBaseException, where: str) -> ConfigError:
    """OmegaConf's error as one line naming the key and the file or override."""
    key, msg = getattr(e, "full_key", None) or "", str(getattr(e, "msg", None) or e).strip().splitlines()[0]
    return ConfigError(f"bad config ({where}): {f'{key}: ' if key else ''}{msg}{_did_you_mean(key, msg)}")


def _did_you_mean(key: str, msg: str) -> str:
    """"; did you mean optimizer.lr?" for an unknown key that another section has, or that is
    close to one of its section's; "" when nothing is near."""
    if not re.match(r"Key '[^']+' not in ", msg) or "." not in key:
        return ""
    section, name = key.rsplit(".", 1)
    known = sorted(_TYPES)
    elsewhere = [k for k in known if k.rsplit(".", 1)[1] == name and k != key]
    near = elsewhere or ([] if "Did you mean" in msg else  # OmegaConf's own, within the section
                         [k for k in difflib.get_close_matches(key, known, n=3, cutoff=0.75)
                          if k.startswith(f"{section}.")])
    return f"; did you mean {' or '.join(near[:3])}?" if near else ""


def merged_config(path: str | None, overrides: list[str] | None) -> Config:
    """The file and the overrides merged over the schema, each value checked, before the checks
    across keys and the model's (what a DeepSpeed file's mapping needs: parallel.dp)."""
    return _merged(path, overrides)[0]


def _merged(path: str | None, overrides: list[str] | None) -> tuple[Config, set[str]]:
    """The schema merged with the file and the overrides, as real dataclasses, values checked;
    and the keys the file and the overrides set."""
    parts = [(path, _load_file(path))] if path else []
    parts += [(f"override {o!r}", _load_override(o)) for o in overrides or []]
    given: set[str] = set()
    merged = OmegaConf.structured(Config)
    for where, part in parts:
        try:
            flat = _flat(OmegaConf.to_container(part, resolve=False))
        except OmegaConfBaseException as e:
            raise _merge_error(e, where) from e
        _check_given_types(where, flat)
        given.update(flat)
        try:
            merged = OmegaConf.merge(merged, part)
        except OmegaConfBaseException as e:
            raise _merge_error(e, where) from e
    try:
        # to_object's declared return covers any container; merged onto the Config schema it is a Config
        cfg = cast(Config, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise _merge_error(e, path or "overrides") from e
    if cfg.model.init is not None:
        _family_from_weights(cfg.model, [_given(part, "model.family") for _, part in parts],
                             [_given(part, "model.flavour") for _, part in parts])
    if cfg.train.global_batch is None:
        cfg.train.global_batch = cfg.train.micro_batch * cfg.schedule.microbatches * cfg.parallel.dp
    for section, key in (("logging", "out_dir"), ("checkpoint", "dir"), ("train", "resume"), ("data", "source")):
        value = getattr(getattr(cfg, section), key)  # `~/runs/x` is the user's home, as in a shell
        if isinstance(value, str) and value.startswith("~"):
            setattr(getattr(cfg, section), key, os.path.expanduser(value))
    check_config(cfg)
    return cfg, given


def _given(part, key: str):
    """The value `key` has in one merged part (a YAML file, the overrides), or None."""
    try:
        return OmegaConf.select(part, key)
    except OmegaConfBaseException:
        return None


def _family_from_weights(model: ModelConfig, families: list, flavours: list) -> None:
    """With model.init the family is the weights' own: a different model.family given is
    refused in one line, and so is a model.flavour (the sizes are the weights')."""
    assert model.init is not None
    if isinstance(model.init, str) and model.init.startswith("~"):
        model.init = os.path.expanduser(model.init)
    family, _ = pretrained(model.init)
    given = next((f for f in families if f is not None), None)
    if given is not None and given != family:
        raise ConfigError(f"model.family={given} contradicts model.init={model.init}, which holds a {family} model; "
                          "leave model.family out (the weights decide it)")
    flavour = next((f for f in flavours if f is not None), None)
    if flavour is not None:
        raise ConfigError(f"model.flavour={flavour} does not apply with model.init={model.init}: the sizes are the "
                          "weights'; leave model.flavour out")
    model.family = family


def _check_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def _rule(check, *values) -> None:
    """One rule of `pipekit.rules` applied to config values, its words the config's keys."""
    try:
        check(*values, names=rules.CONFIG)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _rule_env(check) -> None:
    """An environment variable's check (PIPEKIT_TIMEOUT's `default_timeout`) as a ConfigError."""
    try:
        check()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_rules(checks) -> None:
    """Raise for the first `(key, value, holds, what is valid)` check that does not hold."""
    for key, value, holds, valid in checks:
        if not holds:
            raise ConfigError(f"{key}={value} must be {valid}")


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _check_positive(cfg: Config) -> None:
    p, s, t = cfg.parallel, cfg.schedule, cfg.train
    _check_rules([(key, value, value >= 1, ">= 1") for key, value in [
        ("parallel.pp", p.pp), ("parallel.dp", p.dp), ("parallel.tp", p.tp), ("parallel.ep", p.ep),
        ("parallel.cp", p.cp),
        ("schedule.microbatches", s.microbatches), ("schedule.chunks_per_rank", s.chunks_per_rank),
        ("train.steps", t.steps), ("train.micro_batch", t.micro_batch), ("train.seq_len", t.seq_len),
        ("logging.log_every", cfg.logging.log_every), ("checkpoint.keep", cfg.checkpoint.keep),
        ("train.max_skipped_steps", t.max_skipped_steps)]
        if value is not None])


def check_config(cfg: Config) -> None:
    """Cross-field checks of values alone; each error names the key and what would be valid.
    (What needs the model or the schedule is checked by `resolve`.)"""
    p, s, t = cfg.parallel, cfg.schedule, cfg.train
    _check_positive(cfg)
    _rule(rules.check_ep, p.ep, p.dp * p.cp)  # experts split over the ranks holding the same weights
    _check_choice("parallel.cp_mode", p.cp_mode, ("ring", "ulysses"))
    _check_model_family(cfg.model)
    _check_lora_values(cfg.model)
    _check_choice("train.dtype", t.dtype, ("float32", "float64"))
    _check_choice("optimizer.decay", cfg.optimizer.decay, ("cosine", "constant"))
    _check_choice("optimizer.name", cfg.optimizer.name, ("adamw", "sgd"))
    _check_choice("optimizer.zero_stage", cfg.optimizer.zero_stage, (0, 1, 2, 3))
    _check_dp_shard(cfg)
    _check_choice("optimizer.fused", str(cfg.optimizer.fused).lower(), FUSED)
    _check_choice("train.device", t.device, ("auto", "cpu", "cuda"))
    _check_choice("train.precision", t.precision, PRECISION_NAMES)
    _check_kernels(cfg)
    _rule_env(default_timeout)
    _check_optimizer(cfg)
    _check_precision(cfg)
    _check_runtime(cfg)
    _check_device(cfg)
    want = t.micro_batch * s.microbatches * p.dp
    if t.global_batch != want:
        raise ConfigError(
            f"train.global_batch={t.global_batch} must equal train.micro_batch * schedule.microbatches * parallel.dp = "
            f"{t.micro_batch} * {s.microbatches} * {p.dp} = {want}"
        )


def _check_offload_params(o: OptimizerConfig) -> None:
    """optimizer.offload_params: none or cpu, at zero_stage=3 only, not with the fused GPU kernel."""
    if o.offload_params == "nvme":
        raise ConfigError("optimizer.offload_params=nvme: ZeRO-3 here is FSDP2, whose parameter offload is host "
                          "memory only; use optimizer.offload_params=cpu (and optimizer.offload=nvme for the "
                          "optimizer state)")
    _check_choice("optimizer.offload_params", o.offload_params, ("none", "cpu"))
    if o.offload_params != "none" and o.zero_stage != 3:
        raise ConfigError(f"optimizer.offload_params={o.offload_params} offloads ZeRO-3's parameter shards, but "
                          f"optimizer.zero_stage={o.zero_stage}; set optimizer.zero_stage=3, or "
                          f"optimizer.offload_params=none (optimizer.offload moves the optimizer at any stage)")
    if o.offload_params != "none" and str(o.fused).lower() == "true":
        raise ConfigError(f"optimizer.fused=true is the GPU kernel, but optimizer.offload_params={o.offload_params} "
                          f"steps the shards on the CPU; use optimizer.fused=auto or false")


def _check_optimizer(cfg: Config) -> None:
    o = cfg.optimizer
    if o.name != "adamw" and str(o.fused).lower() == "true":
        raise ConfigError(f"optimizer.fused=true is fused AdamW, but optimizer.name={o.name}; "
                          "use optimizer.name=adamw, or optimizer.fused=auto or false")
    _rule(rules.check_clip, o.clip_grad_norm)
    _rule_env(lambda: check_scheduler(o.scheduler))
    _check_choice("optimizer.offload", o.offload, ("none", "cpu", "nvme"))
    if o.offload == "nvme" and not o.offload_dir:
        raise ConfigError("optimizer.offload=nvme keeps the optimizer state in files: set optimizer.offload_dir to a "
                          "directory on a fast local disk")
    if o.offload != "none" and str(o.fused).lower() == "true":
        raise ConfigError(f"optimizer.fused=true is the GPU kernel, but optimizer.offload={o.offload} steps on the "
                          f"CPU; use optimizer.fused=auto or false with offload")
    _check_offload_params(o)
    if o.offload_overlap and steps_on(o.offload, o.offload_params) == "none":  # ZeroOptimizer's own rule
        raise ConfigError("optimizer.offload_overlap=true begins the host step early: it needs a host step, "
                          "optimizer.offload=cpu or nvme (or offload_params=cpu), not optimizer.offload=none; set "
                          "one, or optimizer.offload_overlap=false")
    _check_rules([
        ("optimizer.lr", o.lr, _finite(o.lr) and o.lr > 0, "a finite number > 0"),
        ("optimizer.min_lr", o.min_lr, _finite(o.min_lr) and 0 <= o.min_lr <= o.lr,
         f"in [0, optimizer.lr={o.lr}] (where the cosine decay ends)"),
        ("optimizer.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0 (0: no warmup)"),
        ("optimizer.weight_decay", o.weight_decay, _finite(o.weight_decay) and o.weight_decay >= 0,
         "a finite number >= 0 (0: no decay)"),
        ("optimizer.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1), e.g. 0.9"),
        ("optimizer.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1), e.g. 0.95"),
        ("optimizer.eps", o.eps, _finite(o.eps) and o.eps > 0, "a finite number > 0, e.g. 1e-8"),
        ("optimizer.momentum", o.momentum, 0 <= o.momentum < 1, "in [0, 1) (0: plain SGD)"),
        ("optimizer.bucket_mb", o.bucket_mb, _finite(o.bucket_mb) and o.bucket_mb > 0, "a finite number > 0"),
    ])


def _check_precision(cfg: Config) -> None:
    t, f = cfg.train, cfg.fp16
    if t.precision != "fp32" and t.dtype != "float32":
        raise ConfigError(f"train.precision={t.precision} keeps float32 master weights, so it needs "
                          f"train.dtype=float32 (got {t.dtype}); use train.precision=fp32 for {t.dtype}")
    _check_rules([
        ("fp16.loss_scale", f.loss_scale, _finite(f.loss_scale) and f.loss_scale >= 0,
         "a finite number >= 0 (0: dynamic scaling)"),
        ("fp16.loss_scale_window", f.loss_scale_window, f.loss_scale_window >= 1, ">= 1"),
        ("fp16.hysteresis", f.hysteresis, f.hysteresis >= 1, ">= 1"),
        ("fp16.min_loss_scale", f.min_loss_scale, _finite(f.min_loss_scale) and f.min_loss_scale > 0,
         "a finite number > 0"),
    ])


def _check_runtime(cfg: Config) -> None:
    """Data, logging, checkpoint and resume keys (their paths are checked by `pipekit.run.preflight`)."""
    d, t, log, ck = cfg.data, cfg.train, cfg.logging, cfg.checkpoint
    _check_rules([
        ("data.val_every", d.val_every, d.val_every >= 0, ">= 0 (0: no validation)"),
        ("data.val_batches", d.val_batches, d.val_every == 0 or d.val_batches >= 1,
         f">= 1 while data.val_every={d.val_every} (or set data.val_every=0 for no validation)"),
        ("train.seed", t.seed, t.seed >= 0, ">= 0"),
        ("checkpoint.every", ck.every, ck.every >= 0, ">= 0 (0: only at the end of the run)"),
        ("checkpoint.stop_grace_s", ck.stop_grace_s, ck.stop_grace_s >= 1,
         ">= 1 (seconds for the step in flight and the save after a stop signal)"),
        ("logging.trace_step", log.trace_step, log.trace_step is None or 1 <= log.trace_step <= t.steps,
         f"a step in 1..train.steps={t.steps}, or null (no trace)"),
        ("logging.peak_tflops", log.peak_tflops, log.peak_tflops is None or (
            _finite(log.peak_tflops) and log.peak_tflops > 0), "a finite number > 0, or null (look it up or measure)"),
    ])
    _check_paths(cfg)
    _check_pack(cfg)
    for key in (k.strip() for k in (t.allow_changed or "").split(",") if k.strip()):
        if key not in RUN_DEFINING and not re.fullmatch(r"model\.\w+", key):
            raise ConfigError(f"train.allow_changed: {key!r} is not a key that needs allowing; give model.KEY, "
                              f"{', '.join(RUN_DEFINING)} (comma-separated; other keys may change on resume anyway)")
    nowhere = "; neither checkpoint.dir nor logging.out_dir is set (the default is {logging.out_dir}/checkpoints)"
    if t.resume == "auto" and not (ck.dir or log.out_dir):
        raise ConfigError(f"train.resume=auto looks for the newest checkpoint in checkpoint.dir{nowhere}; "
                          "set one, or give train.resume a checkpoint directory")
    if ck.every and not (ck.dir or log.out_dir):
        raise ConfigError(f"checkpoint.every={ck.every} has nowhere to save{nowhere}; set one, or checkpoint.every=0")
    if log.trace_step is not None and not log.out_dir:
        raise ConfigError(f"logging.trace_step={log.trace_step} writes its timeline to logging.out_dir, which is not "
                          "set; set logging.out_dir, or logging.trace_step=null")


def _check_paths(cfg: Config) -> None:
    """A path key that is set names something: not blank (an unset shell variable), no NUL byte."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and (value.strip() == "" or "\0" in value):
            what = ("auto (the newest checkpoint in checkpoint.dir), a checkpoint directory, or null (start fresh)"
                    if key == "train.resume" else "a path, or null (leave it unset)")
            raise ConfigError(f"{key}={value!r} is {'empty' if value.strip() == '' else 'not a path'} (an unset "
                              f"shell variable?); it must be {what}")


_PACKED_FAMILIES = ("gpt2", "llama", "mixtral")  # the zoo models that take (ids, positions)


def _check_pack(cfg: Config) -> None:
    """data.pack=true: documents from a prepared dataset, into a model that takes their positions;
    data.trim_padding only with it."""
    if cfg.data.trim_padding and not cfg.data.pack:
        raise ConfigError("data.trim_padding=true cuts the padding of packed rows, but data.pack=false: rows of the "
                          "token stream have no padding; set data.pack=true, or data.trim_padding=false")
    if not cfg.data.pack:
        return
    if cfg.data.source == "synthetic":
        raise ConfigError("data.pack=true packs documents, but data.source=synthetic has none; give a prepared "
                          "dataset (data.source=stdlib or a `pipekit prepare-data` dir), or data.pack=false")
    if cfg.model.family not in _PACKED_FAMILIES:
        raise ConfigError(f"data.pack=true needs a model that takes packed positions ({', '.join(_PACKED_FAMILIES)});"
                          f" model.family={cfg.model.family} does not: use one of those, or data.pack=false")


def partition_boundaries(text: str) -> list[int] | None:
    """Explicit boundaries written as schedule.partition="0,3,7" (None for a method name)."""
    if not re.fullmatch(r"\s*\[?\s*\d+(\s*,\s*\d+)+\s*\]?\s*", text):
        return None
    return [int(x) for x in text.strip().strip("[]").split(",")]


def _check_lora_values(m: ModelConfig) -> None:
    """model.lora's numbers and model.freeze / lora.targets as regexes (values alone)."""
    lo = m.lora
    _check_rules([
        ("model.lora.rank", lo.rank, isinstance(lo.rank, int) and lo.rank >= 0, "an int >= 0 (0: no adapters)"),
        ("model.lora.alpha", lo.alpha, _finite(lo.alpha) and lo.alpha > 0, "a finite number > 0"),
        ("model.lora.dropout", lo.dropout, _finite(lo.dropout) and 0 <= lo.dropout < 1, "in [0, 1)"),
    ])
    if lo.dora and not lo.rank:
        raise ConfigError("model.lora.dora=true decomposes the adapters, but model.lora.rank=0 adds none; "
                          "set model.lora.rank (e.g. 16)")
    if lo.dora and lo.dropout:
        raise ConfigError(f"model.lora.dora=true with model.lora.dropout={lo.dropout} is not supported (DoRA's "
                          "magnitude would scale a dropped input's base product); use model.lora.dropout=0 with DoRA")
    for key, value in (("model.lora.targets", lo.targets), ("model.freeze", m.freeze)):
        if value is None:
            continue
        try:
            re.compile(value)
        except re.error as e:
            raise ConfigError(f"{key}={value!r} is not a valid regex ({e})") from None


def _check_adapters(cfg: Config, model, specs: list) -> None:
    """model.lora.targets names at least one adaptable linear of the model and model.freeze at
    least one parameter (each refusal lists what exists), read from the layers built on meta."""
    m = cfg.model
    if not m.lora.rank and m.freeze is None:
        return
    from .layers.lora import adaptable_names

    linears, params = [], []
    for i, spec in enumerate(specs):
        layer = spec.build(device="meta")
        prefix = f"tied.{spec.key}." if getattr(spec, "key", None) else f"layers.{i}."
        linears += [prefix + n for n in adaptable_names(layer)]
        params += [prefix + n for n, _ in layer.named_parameters()]
    if m.lora.rank:
        hit = [n for n in linears if re.search(m.lora.targets, n)]
        experts = [n for n in hit if ".experts.w_" in n]
        if m.lora.dora and experts:
            raise ConfigError(f"model.lora.dora=true is not supported on MoE experts, and model.lora.targets="
                              f"{m.lora.targets!r} matches {experts[0]}; leave the experts out of the targets "
                              "(e.g. attn\\.(q|k|v|o)$) or set model.lora.dora=false")
        if not hit:
            kinds = sorted({n.split(".", 2)[2] for n in linears if n.startswith("layers.")})
            raise ConfigError(f"model.lora.targets={m.lora.targets!r} matches no linear layer of the {m.family} "
                              f"model; its linears are layers.N.{{{', '.join(kinds)}}} (e.g. {linears[0]})")
        head = f"layers.{len(specs) - 1}"
        if getattr(model, "fused_loss", False) and head in hit:
            raise ConfigError(f"model.lora.targets={m.lora.targets!r} adapts the head ({head}), which "
                              "model.fused_loss=true multiplies inside the loss; leave the head out of the targets "
                              "or set model.fused_loss=false")
    params = list(dict.fromkeys(params))
    if m.freeze is not None and not any(re.search(m.freeze, n) for n in params):
        raise ConfigError(f"model.freeze={m.freeze!r} matches no parameter; the names look like "
                          f"{', '.join(params[i] for i in range(0, len(params), max(1, len(params) // 4)))}")


def _check_layer_choices(cfg: Config, specs: list, num_stages: int) -> None:
    """schedule.partition, memory_budget_gb, activation_checkpoint_interval and checkpoint_layers,
    against the model's layers and the schedule's stages."""
    s = cfg.schedule
    bounds = partition_boundaries(s.partition)
    if bounds is not None:
        try:
            check_boundaries(bounds, len(specs), num_stages)
        except ValueError as e:
            raise ConfigError(f"schedule.partition: {e}") from e
    elif s.partition not in ("uniform", "parameters", "profile") and not s.partition.startswith("type:"):
        raise ConfigError(f"schedule.partition={s.partition!r} must be uniform, parameters, profile, type:REGEX "
                          f"(layers whose class name matches REGEX weigh 1, e.g. type:Block) or boundaries "
                          f"such as \"0,3,{len(specs)}\"")
    if s.partition.startswith("type:"):
        try:
            layer_weights(specs, s.partition)
        except ValueError as e:
            raise ConfigError(f"schedule.partition: {e}") from e
    if s.memory_budget_gb is not None:
        if s.partition != "profile":
            raise ConfigError(f"schedule.memory_budget_gb={s.memory_budget_gb} applies to schedule.partition=profile, "
                              f"not {s.partition!r}; set schedule.partition=profile or remove the budget")
        if not (_finite(s.memory_budget_gb) and s.memory_budget_gb > 0):
            raise ConfigError(f"schedule.memory_budget_gb={s.memory_budget_gb} must be a number > 0 (GiB per rank)")
    _check_rules([("schedule.activation_checkpoint_interval", s.activation_checkpoint_interval,
                   s.activation_checkpoint_interval >= 0, ">= 0 (0: off)")])
    if s.checkpoint_layers is None:
        return
    if s.activation_checkpoint_interval:
        raise ConfigError(f"schedule.checkpoint_layers={s.checkpoint_layers!r} and schedule.activation_checkpoint_"
                          f"interval={s.activation_checkpoint_interval} are both set; set one of them "
                          "(the interval would override the regex)")
    try:
        pattern = re.compile(s.checkpoint_layers)
    except re.error as e:
        raise ConfigError(f"schedule.checkpoint_layers={s.checkpoint_layers!r} is not a valid regex ({e})") from e
    names = list(dict.fromkeys(spec_name(spec) for spec in specs))
    if not any(pattern.search(name) for name in names):
        raise ConfigError(f"schedule.checkpoint_layers={s.checkpoint_layers!r} matches no layer; "
                          f"the layer class names are: {', '.join(names)}")


def _check_dp_shard(cfg: Config) -> None:
    """parallel.dp_shard divides parallel.dp and shards only ZeRO-3's parameters; ZeRO-3 and
    overlapped schedules do not combine yet (`pipekit.rules`)."""
    _rule(rules.check_overlap, cfg.schedule.overlap, cfg.optimizer.zero_stage)
    _rule(rules.check_dp_shard, cfg.parallel.dp_shard, cfg.parallel.dp, cfg.optimizer.zero_stage)


def _check_device(cfg: Config) -> None:
    """train.device=cuda needs a GPU per worker on this node, known before any worker starts.

    Workers on this node: torchrun's LOCAL_WORLD_SIZE when set (inside a worker, or
    a multi-node launch), else pp*dp*tp (`pipekit train` starts them all here).
    "auto" never fails: it falls back to the CPU.
    """
    if cfg.train.device != "cuda":
        return
    try:
        resolve_device("cuda", local_workers(cfg.world_size))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _check_kernels(cfg: Config) -> None:
    """model.kernels is a mode, and "triton" can run: the package is there, and on the CPU
    only in Triton's interpreter (known before any worker starts)."""
    mode, key = cfg.model.kernels, "model.kernels"
    if mode is None:  # the environment's, read here as in every worker
        try:
            mode, key = kernel_dispatch.env_mode(), kernel_dispatch.ENV
        except ValueError as e:
            raise ConfigError(f"{e} (model.kernels is unset, so the environment's is used)") from None
    if mode is None:
        return
    _check_choice(key, mode, kernel_dispatch.MODES)
    if mode != "triton":
        return
    # train.device=auto may still land on a GPU: only "cpu" is known to need the interpreter here
    blocker = kernel_dispatch.triton_blocker(cfg.train.device != "cpu", f"{key}=triton")
    if blocker is not None:
        raise ConfigError(blocker)


def _check_model_fits(cfg: Config, model, specs: list, chunks: int) -> None:
    p = cfg.parallel
    n_specs = len(specs)
    if n_specs < p.pp * chunks:
        raise ConfigError(
            f"the model has {n_specs} layers (model.n_layers={getattr(model, 'n_layers', '?')} blocks plus "
            f"embedding, norm and head), fewer than parallel.pp * chunks per rank = {p.pp * chunks} stages"
        )
    for key in ("n_heads", "n_kv_heads"):
        value = getattr(model, key, None)
        if value is not None and value % p.tp:
            raise ConfigError(f"model.{key}={value} is not divisible by parallel.tp={p.tp}")
    vocab = model_vocab(model)
    padded = getattr(model, "padded_vocab", vocab)  # the zoo's tables are padded (independently of tp)
    if padded % p.tp:
        shown = vocab if padded == vocab else (
            f"{vocab}, padded to {padded} (a multiple of its vocab_pad_multiple={model.vocab_pad_multiple}),")
        raise ConfigError(f"model.vocab_size={shown} is not divisible by parallel.tp={p.tp}")
    experts = getattr(model, "n_experts", None)
    if experts is not None:
        _rule(rules.check_experts, experts, p.ep, p.dp * p.cp)
    if experts is None and p.ep > 1:
        raise ConfigError(f"parallel.ep={p.ep} shards experts, but model.family={cfg.model.family} has none; "
                          f"use parallel.ep=1 or an MoE family (mixtral)")
    _check_expert_tp(cfg, model)
    _check_sequence_parallel(cfg, model)
    _check_context_parallel(cfg, model)
    _check_seq_len_warmup(cfg)
    max_len = getattr(model, "max_seq_len", None)
    if max_len is not None and cfg.train.seq_len > max_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={max_len}")


def _check_expert_tp(cfg: Config, model) -> None:
    """parallel.expert_tp needs experts, and their hidden width divisible by tp (GPT-2's
    experts are 4*dim wide, which the head check already makes divisible)."""
    p = cfg.parallel
    if not p.expert_tp:
        return
    if getattr(model, "n_experts", None) is None:
        raise ConfigError(f"parallel.expert_tp=true splits MoE experts over tp, but model.family="
                          f"{cfg.model.family} has none; use parallel.expert_tp=false or an MoE model")
    hidden = getattr(model, "hidden", None)
    if hidden is not None and hidden % p.tp:
        raise ConfigError(f"model.hidden={hidden} (each expert's width) is not divisible by parallel.tp={p.tp}, "
                          f"over which parallel.expert_tp=true splits it; use a hidden multiple of {p.tp}, or "
                          "parallel.expert_tp=false")


def _check_sequence_parallel(cfg: Config, model) -> None:
    """parallel.sequence_parallel (at tp > 1; a no-op at tp=1) splits the sequence over tp:
    train.seq_len must be divisible by tp; not with parallel.expert_tp."""
    p = cfg.parallel
    if not p.sequence_parallel or p.tp == 1:
        return
    if cfg.train.seq_len % p.tp:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by parallel.tp={p.tp}, over which "
                          f"parallel.sequence_parallel=true splits the sequence; use a seq_len multiple of {p.tp}")
    if p.expert_tp:
        raise ConfigError("parallel.sequence_parallel=true does not support parallel.expert_tp=true yet (each "
                          "tp rank routes its own sequence slice); use one of them")


def _check_seq_len_warmup(cfg: Config) -> None:
    """train.seq_len_start..seq_len over seq_len_warmup_steps (and data.trim_padding's lengths), in
    multiples of seq_len_multiple that every split of the sequence divides (2*cp chunks; tp with
    sequence parallelism)."""
    t, p = cfg.train, cfg.parallel
    if t.seq_len_start is None and not cfg.data.trim_padding:
        return
    rules: list[tuple[str, Any, bool, str]] = [
        ("train.seq_len_multiple", t.seq_len_multiple, t.seq_len_multiple >= 1, ">= 1")]
    if t.seq_len_start is not None:
        rules += [
            ("train.seq_len_start", t.seq_len_start, 1 <= t.seq_len_start <= t.seq_len,
             f"in [1, train.seq_len={t.seq_len}] (where the warm-up starts)"),
            ("train.seq_len_warmup_steps", t.seq_len_warmup_steps, t.seq_len_warmup_steps >= 1,
             ">= 1 (the steps the warm-up takes)"),
            ("train.seq_len_root", t.seq_len_root, _finite(t.seq_len_root) and t.seq_len_root > 0,
             "a number > 0 (1: linear)"),
        ]
    _check_rules(rules)
    need = (2 * p.cp if p.cp > 1 else 1) * (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    what = "of the warm-up" if t.seq_len_start is not None else "of a trimmed microbatch (data.trim_padding)"
    if t.seq_len_multiple % need:
        raise ConfigError(f"train.seq_len_multiple={t.seq_len_multiple} must be a multiple of {need} (every length "
                          f"{what} is split into 2*cp chunks, and over tp with sequence parallelism)")


CP_FAMILIES = ("gpt2", "llama", "mixtral")  # the families whose attention crosses cp ranks


def _check_context_parallel(cfg: Config, model) -> None:
    """parallel.cp > 1 cuts each sequence into 2*cp chunks (train.seq_len divisible by 2*cp), in
    a family with attention that crosses them; ulysses splits the heads of a tp rank over cp."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return
    family = cfg.model.family
    if family not in CP_FAMILIES:
        raise ConfigError(f"parallel.cp={p.cp} splits each sequence across ranks, which model.family={family} does "
                          f"not support; use parallel.cp=1 or one of {list(CP_FAMILIES)}")
    window = getattr(model, "sliding_window", None)
    if window is not None:
        raise ConfigError(f"parallel.cp={p.cp} with model.sliding_window={window}: sliding-window attention is not "
                          f"implemented under context parallelism; use parallel.cp=1")
    if t.seq_len % (2 * p.cp):
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by 2 * parallel.cp = {2 * p.cp} (each cp rank "
                          f"holds 2 of the sequence's {2 * p.cp} chunks); use a seq_len multiple of {2 * p.cp}")
    if p.sequence_parallel and p.tp > 1 and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(f"train.seq_len={t.seq_len} / parallel.cp={p.cp} = {t.seq_len // p.cp} tokens per cp rank "
                          f"do not split over parallel.tp={p.tp} (sequence parallelism)")
    heads = getattr(model, "n_heads", None)
    if p.cp_mode == "ulysses" and heads is not None and (heads // p.tp) % p.cp:
        raise ConfigError(f"parallel.cp_mode=ulysses splits the {heads // p.tp} attention heads of each tp rank "
                          f"(model.n_heads={heads} / parallel.tp={p.tp}) over parallel.cp={p.cp}, which does not "
                          f"divide them; use cp_mode=ring or a cp dividing {heads // p.tp}")


def _check_model_family(m: ModelConfig) -> None:
    """model.family is in the zoo's registry, and the sizes it takes that are set are >= 1
    (the keys it does not take are refused by name in `model_config`)."""
    _check_choice("model.family", m.family, FAMILIES)
    takes = set(model_keys(m.family))
    _check_rules([(f"model.{key}", getattr(m, key), getattr(m, key) >= 1, ">= 1") for key in _MODEL_SIZES
                  if key in takes and getattr(m, key) is not None])


_NOT_OVERRIDES = ("family", "flavour", "kernels", "init", "freeze", "lora")  # keys that are not the family's fields
# The keys that shape the weights: with model.init they come from the weights, and one that differs is refused.
_FROM_WEIGHTS = ("vocab_size", "max_seq_len", "n_layers", "dim", "n_heads", "n_kv_heads", "hidden", "tie_embeddings",
                 "rope_theta", "n_experts", "top_k", "n_shared_experts", "score", "head_dim", "qkv_bias", "qk_norm")


def model_config(model: ModelConfig):
    """The family's typed model config: the flavour, with the set fields overriding it
    (the registry maps them onto the family's own field names)."""
    overrides = {f.name: getattr(model, f.name) for f in fields(model) if f.name not in _NOT_OVERRIDES}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        takes = sorted(set(model_keys(model.family)) & {f.name for f in fields(model)})
    except ValueError as e:  # an unknown family
        raise ConfigError(f"model: {e}") from e
    bad = sorted(set(overrides) - set(takes))
    if bad:
        raise ConfigError(f"model.{bad[0]} does not apply to the {model.family} model; it takes {takes}")
    try:
        if model.init is not None:
            return _from_weights(model, overrides)
        return get_model(model.family, model.flavour, **overrides)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e


def pretrained(path: str):
    """(family, model config) of model.init's weights; ConfigError when `path` holds none."""
    from .interchange import pretrained_config

    try:
        return pretrained_config(path)
    except (OSError, ValueError) as e:
        said = str(e)
        raise ConfigError(said if said.startswith(f"model.init={path}") else f"model.init={path}: {said}") from None


def _from_weights(model: ModelConfig, overrides: dict):
    """The model config of model.init's weights, with the keys that do not shape them overridden;
    a key that shapes them and differs is refused, naming both values."""
    assert model.init is not None
    _, base = pretrained(model.init)
    for key in _FROM_WEIGHTS:
        if key in overrides and overrides[key] != getattr(base, key, overrides[key]):
            raise ConfigError(f"model.{key}={overrides[key]} contradicts model.init={model.init}, whose {key} is "
                              f"{getattr(base, key)}; leave model.{key} out (the weights decide it)")
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    return config_from_dict(model.family, {**values, **overrides})


# ---- the run, resolved once ----------------------------------------------------
@dataclass(frozen=True)
class Run:
    """A run resolved from its config, once: what `train`, `plan`, the pre-launch checks
    and every worker take, so none of them derives the model or the schedule again.

    `config` holds the checked keys as given (optimizer, data, logging, checkpoint...);
    the rest is what they resolve to. Built by `resolve` (or `load_run`)."""

    config: Config
    model: Any  # the family's typed config (`pipekit.models.get_model`: GPT2Config, LlamaConfig, ...)
    schedule: Schedule  # the validated program every rank runs; the module is built for it
    precision: Precision
    partition: str | tuple[int, ...]  # a method name ("parameters", "profile", "type:Block") or boundaries
    pp: int
    dp: int
    tp: int
    ep: int
    notices: tuple[str, ...] = ()  # "KEY=VALUE has no effect: WHY" for each key set that does nothing here

    @property
    def cp(self) -> int:
        return self.config.parallel.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp * self.cp

    @property
    def zero_shards(self) -> int:
        """The ranks holding the same parameters, over which gradients are reduced and ZeRO
        shards: the data replicas x cp (`Topology.dp`)."""
        return self.dp * self.cp

    @property
    def family(self) -> str:
        return self.config.model.family

    @property
    def global_batch(self) -> int:
        """train.global_batch: loading fills it in when the config leaves it out."""
        global_batch = self.config.train.global_batch
        assert global_batch is not None  # set by `load_run`, checked by `check_config`
        return global_batch


def resolve(cfg: Config | Run, given: set[str] | None = None) -> Run:
    """The run of a value-checked config: the schedule module imported (`schedule.module`),
    the model config, the schedule, the precision policy and the partition made once,
    and checked against each other (layers per stage, heads and vocabulary per tp rank,
    experts per ep rank). ConfigError names the key. A Run is returned as it is.
    `given`: the keys the file and overrides set, which (with those off their defaults)
    get a notice where they have no effect (`NO_EFFECT`)."""
    if isinstance(cfg, Run):
        return cfg
    cfg = copy.deepcopy(cfg)  # the run keeps its own keys: a caller's later edits do not reach it
    p = cfg.parallel
    import_schedule_module(cfg.schedule.module)
    schedule = _schedule(cfg)
    model = model_config(cfg.model)
    specs = model_specs(model)
    _check_model_fits(cfg, model, specs, schedule.chunks_per_rank)
    _check_layer_choices(cfg, specs, schedule.num_stages)
    _check_adapters(cfg, model, specs)
    bounds = partition_boundaries(cfg.schedule.partition)
    return Run(cfg, model, schedule, precision_policy(cfg.train.precision, cfg.train.dtype, cfg.fp16),
               tuple(bounds) if bounds is not None else cfg.schedule.partition, p.pp, p.dp, p.tp, p.ep,
               no_effect_notices(cfg, model, given))


# ---- keys that do nothing in a run ------------------------------------------------
# (key, or a section ending in ".", when it has no effect (config, model config) -> bool, why: formatted with
# c=the config, m=the model config). Each key the user set that a rule matches gets one notice; never an error.
NO_EFFECT: list[tuple[str, Any, str]] = [
    ("optimizer.momentum", lambda c, m: c.optimizer.name != "sgd",
     "momentum is SGD's; optimizer.name={c.optimizer.name} uses optimizer.beta1"),
    ("optimizer.beta1", lambda c, m: c.optimizer.name == "sgd", "AdamW's; optimizer.name=sgd uses optimizer.momentum"),
    ("optimizer.beta2", lambda c, m: c.optimizer.name == "sgd", "AdamW's; optimizer.name=sgd has no second moment"),
    ("optimizer.eps", lambda c, m: c.optimizer.name == "sgd", "AdamW's; optimizer.name=sgd divides by nothing"),
    ("optimizer.reshard_after_forward", lambda c, m: c.optimizer.zero_stage != 3,
     "only ZeRO-3 gathers parameters, and optimizer.zero_stage={c.optimizer.zero_stage}"),
    ("fp16.", lambda c, m: c.train.precision != "fp16",
     "loss scaling is for train.precision=fp16, and this run's is {c.train.precision}"),
    ("model.token_drop_policy", lambda c, m: getattr(m, "capacity_factor", None) is None,
     "tokens are dropped only over a capacity, and model.capacity_factor is unset (dropless)"),
    ("model.pad_expert_input_to_capacity", lambda c, m: getattr(m, "capacity_factor", None) is None,
     "there is no capacity to pad to: model.capacity_factor is unset (dropless)"),
    *[(f"model.{key}", lambda c, m: getattr(m, "n_experts", None) is None,
       "the {c.model.family} model here is dense (no model.n_experts): nothing is routed")
      for key in ("global_balance", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor", "score")],
    ("parallel.sequence_parallel", lambda c, m: c.parallel.tp == 1, "it splits the sequence over tp; parallel.tp=1"),
    ("parallel.expert_tp", lambda c, m: c.parallel.tp == 1, "it splits the experts over tp, and parallel.tp=1"),
    *[(f"model.lora.{key}", lambda c, m: not c.model.lora.rank, "model.lora.rank=0 adds no adapters")
      for key in ("alpha", "dropout", "targets")],
    ("data.val_batches", lambda c, m: c.data.val_every == 0, "data.val_every=0 never validates"),
    *[(f"checkpoint.{key}", lambda c, m: not (c.checkpoint.dir or c.logging.out_dir),
       "neither checkpoint.dir nor logging.out_dir is set, so nothing is saved") for key in ("keep", "at_end")],
    ("train.allow_changed", lambda c, m: c.train.resume is None, "it applies on resume, and train.resume is unset"),
]


def _shown(value) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def no_effect_notices(cfg: Config, model, given: set[str] | None = None) -> tuple[str, ...]:
    """"KEY=VALUE has no effect: WHY" for each key set (in `given`, or off its default) that a
    NO_EFFECT rule says does nothing in this run, in the order of the rules."""
    values = _flat(dataclasses.asdict(cfg))
    defaults = _flat(dataclasses.asdict(Config()))
    chosen = set(given or ()) | {k for k, v in values.items() if v != defaults.get(k)}
    said = []
    for rule_key, idle, why in NO_EFFECT:
        for key in sorted(k for k in chosen if k == rule_key or (rule_key.endswith(".") and k.startswith(rule_key))):
            if key in values and idle(cfg, model):
                said.append(f"{key}={_shown(values[key])} has no effect: {why.format(c=cfg, m=model)}")
    return tuple(dict.fromkeys(said))


def _schedule(cfg: Config) -> Schedule:
    """schedule.name built for the config: a registered generator, or an action-table file
    (whose lines are the pp ranks; schedule.microbatches counts its microbatches)."""
    s, pp = cfg.schedule, cfg.parallel.pp
    try:
        if s.name in SCHEDULES:
            built = build_schedule(s.name, pp, s.microbatches, s.chunks_per_rank, overlap=s.overlap)
            if s.overlap and not built.overlaps:
                raise ConfigError(f"schedule.overlap=true, but {s.name} at parallel.pp={pp} with schedule.microbatches="
                                  f"{s.microbatches} runs no forward next to a backward of another microbatch, so "
                                  "nothing would overlap; overlap needs 2 or more microbatches and a schedule that "
                                  "alternates them (1f1b, dualpipe_v), or leave schedule.overlap out")
            return built
        if not os.path.isfile(s.name):
            raise ConfigError(f"schedule.name={s.name!r} is not one of {list(SCHEDULES)}, nor an action-table file"
                              f"{_registered_hint(s)}")
        if s.overlap:
            raise ConfigError(f"schedule.overlap=true pairs a registered schedule's actions; the action table "
                              f"{s.name} states its own: write the pairs in it (0F5+3B2) and leave schedule.overlap "
                              "out")
        schedule = load_schedule(s.name, microbatches=s.microbatches)
    except ScheduleError as e:
        raise ConfigError(f"schedule: {e}") from e
    if schedule.pp != pp:
        raise ConfigError(f"schedule.name={s.name} is a table of {schedule.pp} ranks (lines), but parallel.pp={pp}")
    if s.chunks_per_rank is not None and s.chunks_per_rank != schedule.chunks_per_rank:
        raise ConfigError(f"schedule.chunks_per_rank={s.chunks_per_rank}, but the table {s.name} places "
                          f"{schedule.chunks_per_rank} stages per rank; leave schedule.chunks_per_rank out")
    return schedule


def _registered_hint(s: ScheduleConfig) -> str:
    if s.module:
        return f" (schedule.module={s.module} was imported and registered no schedule of that name)"
    return " (a schedule registered in your code needs schedule.module=YOUR_MODULE, which calls register_schedule)"


def import_schedule_module(name: str | None) -> None:
    """Import `schedule.module` (once per process): a dotted module name, found on sys.path
    and in the working directory, or the path of a .py file. It is expected to call
    `pipekit.schedules.register_schedule`. ConfigError when it cannot be imported."""
    if not name:
        return
    try:
        if name.endswith(".py"):
            _import_file(name)
            return
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())  # `pipekit` (a console script) does not search it by itself
        importlib.import_module(name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module: any failure is theirs to see, in one line
        raise ConfigError(f"schedule.module={name} could not be imported: {type(e).__name__}: {e}") from e


def _import_file(path: str) -> None:
    """Run the .py file at `path` as a module named after its absolute path (so once per process)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"schedule.module={path} is not a file; give a .py file or a dotted module name")
    key = "pipekit_user_" + re.sub(r"\W", "_", full)
    if key in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(key, full)
    assert spec is not None and spec.loader is not None  # a .py path always gets a source-file loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise


def config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """The config file and the key=value overrides of a command line, in whatever order the
    user gave them (the file first, last or between overrides). ConfigError, in one line,
    for a word that is neither (`train.steps 3`: said as `train.steps=3`) or two files."""
    words = [w for w in (config, *overrides) if w is not None]
    files = [w for w in words if "=" not in w and (w.endswith((".yaml", ".yml")) or os.path.exists(w))]
    if len(files) > 1:
        raise ConfigError(f"one config file, got {len(files)}: {' and '.join(files)}; a second file's settings "
                          "go in as key=value overrides")
    rest = [w for w in words if w not in files]
    for i, word in enumerate(rest):
        if "=" not in word:
            after = rest[i + 1] if i + 1 < len(rest) and "=" not in rest[i + 1] else None
            hint = f" (did you mean {word}={after}?)" if after is not None else ""
            raise ConfigError(f"{word!r} is neither a config file (not found) nor a key=value override{hint}")
    return (files[0] if files else None), rest
