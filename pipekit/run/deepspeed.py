"""A DeepSpeed `ds_config.json` as pipekit overrides: `pipekit train CONFIG --deepspeed ds.json`.

`from_deepspeed(ds, dp)` reads the file's keys into `key=value` overrides of pipekit's config
(which then checks them as it checks any override; keys given on the command line beside the
file come after, so they win), and one-line notes for keys that change nothing here. A key
not in `MAPPED`, `NOTED` or the refusals below is refused in one line naming it (a typo such
as `reduce_bucket_sizee` is not ignored). What is mapped, with DeepSpeed's meaning:

- batch: `train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
  dp`, any two of them giving the third as DeepSpeed's engine derives it (only the batch
  size: micro = batch / dp, accumulation 1); "auto" counts as not given (the Hugging Face
  Trainer's placeholder). Accumulation steps are the pipeline's microbatches.
- `optimizer`: `Adam` (its `adam_w_mode`, default true: decoupled weight decay), `AdamW`
  (always decoupled, as DeepSpeed makes it), `SGD`, with their `params` and, where a param
  is left out, the defaults of the optimizer DeepSpeed builds (FusedAdam / CPU Adam: lr
  1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0; with `torch_adam: true`, torch's
  AdamW: weight decay 0.01); a param given as "auto" is left to pipekit's config.
- `scheduler`: `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` (with its
  momentum cycling), `LRRangeTest`, as `optimizer.scheduler` (pipekit.optim.lr: DeepSpeed's
  lr at every step, its defaults, its step count: `total_num_steps` is not train.steps); the
  block replaces any the config holds. No `scheduler`: the learning rate is constant, as
  DeepSpeed keeps it (pipekit's own warmup and cosine decay are turned off).
- `gradient_clipping` (0: none), `zero_optimization.stage`, `fp16` (`enabled`, `loss_scale`
  0 = dynamic, `initial_scale_power`, `loss_scale_window`, `hysteresis`, `min_loss_scale`,
  `consecutive_hysteresis`; at stage 0 DeepSpeed's fp16 optimizer has no hysteresis, so
  neither is set there: every overflow halves the scale), `bf16.enabled`, `steps_per_print`.

- `zero_optimization.offload_optimizer` (`device` cpu / nvme, `nvme_path`, `pin_memory`) as
  `optimizer.offload` / `offload_dir` / `pin_memory` (pipekit.optim.offload); `offload_param`
  (`device` cpu, `pin_memory`) at stage 3 as `optimizer.offload_params=cpu` (FSDP2's
  CPUOffloadPolicy: the shards, their gradients and so their step on the host), below stage 3
  noted (DeepSpeed offloads parameters at stage 3 only); one `optimizer.pin_memory` for both
  blocks (pinned when either asks; DeepSpeed 0.19.8's default for both: true);
  `activation_checkpointing.partition_activations` as sequence parallelism; `pipeline.stages`,
  `partition`, `activation_checkpoint_interval` as `parallel.pp`, `schedule.partition`,
  `schedule.activation_checkpoint_interval`; "auto" as the pipekit config's value.

Refused in one line (so nothing runs other than the file says): a torch scheduler by name,
per-param-group lists in a scheduler's params, `offload_param.device` nvme (FSDP2 offloads
parameters to host memory only), `offload_optimizer.ratio` < 1, `cpu_checkpointing`, Adam's L2
mode with weight decay. Checked
against DeepSpeed's own engine and classes: tests/test_deepspeed_parity.py (losses),
tests/test_lr_schedules.py (the lr of every step, the loss scale).
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from ..config import ConfigError
from ..optim.lr import check_scheduler

# keys that change nothing in a pipekit run, and why (one note each when present)
NOTED = {
    "wall_clock_breakdown": "pipekit's timings are logging.trace_step's timeline",
    "zero_allow_untested_optimizer": "ZeroOptimizer wraps any torch optimizer",
    "prescale_gradients": "pipekit averages gradients once, in their reduction dtype",
    "communication_data_type": "gradients are reduced in their own dtype (fp32 master: fp32)",
    "activation_checkpointing.contiguous_memory_optimization": "recomputed blocks free their activations as they "
                                                               "go",
    "activation_checkpointing.number_checkpoints": "pipekit recomputes the runs schedule.activation_checkpoint_"
                                                   "interval (or checkpoint_layers) names",
    "activation_checkpointing.synchronize_checkpoint_boundary": "recomputation needs no device sync here",
    "activation_checkpointing.profile": "logging.trace_step times every action, recomputation included",
    "pipeline.seed_layers": "pipekit always seeds each layer by its global index (the same weights at any layout)",
    "pipeline.pipe_partitioned": "a stage sends its whole output (1/tp of it with sequence parallelism)",
    "pipeline.grad_partitioned": "a stage sends its whole input gradient (1/tp of it with sequence parallelism)",
    "flops_profiler": "pipekit plan profiles the layers",
    "tensorboard": "logging.tensorboard writes TensorBoard events to logging.out_dir",
    "zero_optimization.contiguous_gradients": "gradients always live in flat buckets",
    "zero_optimization.overlap_comm": "ZeRO-2 reductions always overlap the backward",
    "zero_optimization.reduce_scatter": "ZeRO-2 always reduce-scatters",
    "zero_optimization.allgather_partitions": "ZeRO 1-2 always all-gather the updated partitions",
    "zero_optimization.allgather_bucket_size": "the all-gather follows the reduction's buckets",
    "zero_optimization.reduce_bucket_size": "it counts elements; pipekit's optimizer.bucket_mb counts MB and "
                                            "changes no result",
    "zero_optimization.round_robin_gradients": "the partition of each bucket is fixed",
    "zero_optimization.sub_group_size": "the step (offloaded too) goes bucket by bucket: optimizer.bucket_mb",
    "zero_optimization.stage3_prefetch_bucket_size": "FSDP2 prefetches one layer ahead",
    "zero_optimization.stage3_param_persistence_threshold": "FSDP2 shards every layer",
    "zero_optimization.stage3_max_live_parameters": "FSDP2 gathers one layer at a time",
    "zero_optimization.stage3_max_reuse_distance": "FSDP2 gathers one layer at a time",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "pipekit's checkpoints are always whole "
                                                                   "(layout-free)",
    "fp16.auto_cast": "pipekit casts the layers' weights, not their inputs",
}
_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
        "scheduler", "gradient_clipping", "zero_optimization", "fp16", "bf16", "steps_per_print",
        "activation_checkpointing", "pipeline", "curriculum_learning"}
_CURRICULUM = {"enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type", "schedule_config"}
_ACT = {"partition_activations", "cpu_checkpointing"}
_PIPE = {"stages", "partition", "activation_checkpoint_interval"}
_ZERO = {"stage", "offload_optimizer", "offload_param"}
_FP16 = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
         "consecutive_hysteresis"}
_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
_PARAMS = {"lr", "betas", "eps", "weight_decay", "momentum", "adam_w_mode", "torch_adam"}
_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # FusedAdam's / CPU Adam's


def read_deepspeed(path: str) -> dict:
    """The JSON object in `path`; ConfigError naming what is wrong."""
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed {path}: no such file; give a DeepSpeed config (ds_config.json)")
    try:
        with open(path) as f:
            ds = json.load(f)
    except ValueError as e:
        raise ConfigError(f"--deepspeed {path} is not valid JSON ({e})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed {path} holds a JSON {type(ds).__name__}, not an object of DeepSpeed keys")
    return ds


def with_deepspeed(path: str | None, ds: dict | str, overrides: list[str] | tuple = ()) -> tuple[list[str], list[str]]:
    """The overrides `pipekit train PATH --deepspeed DS OVERRIDES...` runs with: DeepSpeed config
    `ds` (a dict or a path) mapped at the dp, and with the "auto" values, of the config file
    `path` and `overrides` merged, followed by `overrides` (which win); and the notes. For
    Python: `load_run(path, with_deepspeed(path, ds, overrides)[0])`."""
    from ..config import merged_config

    base = merged_config(path, list(overrides))
    mapped, notes = from_deepspeed(ds, base.parallel.dp, base)
    return [*mapped, *overrides], notes


def from_deepspeed(ds: dict | str, dp: int, base: Any = None) -> tuple[list[str], list[str]]:
    """(pipekit overrides, notes) for DeepSpeed config `ds` (a dict or a path) at `dp` data-parallel
    replicas; ConfigError naming the first key that cannot be run as DeepSpeed would run it.

    "auto" (the Hugging Face Trainer's placeholder, filled from the Trainer's own arguments) is
    filled from pipekit's config: `base`, the config the file is merged into (a
    `pipekit.config.Config`; None: pipekit's defaults). A key set to "auto" maps to nothing, so
    the config's value stays, and one note lists them; a scheduler's "auto" params take the
    run's numbers (total_num_steps: train.steps, warmup_num_steps: optimizer.warmup_steps, a
    peak lr: the optimizer's lr, a warmup's start: 0)."""
    if isinstance(ds, str):
        ds = read_deepspeed(ds)
    out: list[str] = []
    notes: list[str] = []
    _walk(ds, "", notes)
    autos = _autos(ds, "")
    if autos:
        notes.append(f"ds_config keys set to \"auto\" take pipekit's config values: {', '.join(autos)}")
    out += _batch(ds, dp)
    out += _optimizer(ds.get("optimizer"))
    out += _scheduler(_filled(ds.get("scheduler"), ds.get("optimizer"), base))
    clip = ds.get("gradient_clipping", 0.0)
    if clip != "auto":
        if not _is_number(clip):
            raise ConfigError(f"ds_config gradient_clipping={clip!r} must be a number (0: none) or \"auto\"")
        out.append(f"optimizer.clip_grad_norm={clip if clip > 0 else 'null'}")
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage != "auto":
        out.append(f"optimizer.zero_stage={stage}")  # DeepSpeed's default: stage 0
    out += _offload(zero, notes)
    out += _precision(ds, notes)
    out += _checkpointing(ds.get("activation_checkpointing") or {})
    out += _pipeline(ds.get("pipeline") or {})
    out += _curriculum(ds.get("curriculum_learning") or {})
    if "steps_per_print" in ds:
        out.append(f"logging.log_every={ds['steps_per_print']}")
    return out, notes


def _checkpointing(block: dict) -> list[str]:
    """activation_checkpointing: partition_activations (each tp rank keeping its slice of the saved
    activations) is sequence parallelism; cpu_checkpointing is refused."""
    if block.get("cpu_checkpointing") is True:
        raise ConfigError("ds_config activation_checkpointing.cpu_checkpointing=true: pipekit does not move saved "
                          "activations to host memory; set it false (recomputation: "
                          "schedule.activation_checkpoint_interval)")
    if block.get("partition_activations") is True:
        return ["parallel.sequence_parallel=true"]  # a no-op at tp=1, as DeepSpeed's partitioning is
    return []


_PARTITIONS = ("parameters", "uniform", "profile")


def _pipeline(block: dict) -> list[str]:
    """pipeline: stages -> parallel.pp, partition (PipelineModule's partition_method: parameters,
    uniform, type:REGEX) -> schedule.partition, activation_checkpoint_interval -> the same key."""
    out = []
    stages = block.get("stages", "auto")
    if stages != "auto":
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ConfigError(f"ds_config pipeline.stages={stages!r} must be a whole number >= 1 (or \"auto\")")
        out.append(f"parallel.pp={stages}")
    method = block.get("partition")
    if method is not None:
        if not isinstance(method, str) or not (method.lower() in _PARTITIONS or method.lower().startswith("type:")):
            raise ConfigError(f"ds_config pipeline.partition={method!r} is not a partition method pipekit runs: give "
                              f"parameters, uniform, type:REGEX (as DeepSpeed's PipelineModule) or profile")
        out.append(f"schedule.partition={method if method.lower().startswith('type:') else method.lower()}")
    interval = block.get("activation_checkpoint_interval")
    if interval is not None:
        out.append(f"schedule.activation_checkpoint_interval={interval}")
    return out


def _curriculum(block: dict) -> list[str]:
    """curriculum_learning (seqlen; fixed_linear or fixed_root) as the sequence-length warm-up:
    min_difficulty -> train.seq_len_start, max_difficulty -> train.seq_len, total_curriculum_step
    -> train.seq_len_warmup_steps, difficulty_step -> train.seq_len_multiple, root_degree ->
    train.seq_len_root (pipekit/run/curriculum.py: DeepSpeed's length at every step)."""
    if not block.get("enabled", False):
        return []
    where = "ds_config curriculum_learning"
    kind, schedule = block.get("curriculum_type", "seqlen"), block.get("schedule_type")
    if kind != "seqlen":
        raise ConfigError(f"{where}.curriculum_type={kind!r}: pipekit's curriculum is the sequence length; use seqlen")
    if schedule not in ("fixed_linear", "fixed_root"):
        raise ConfigError(f"{where}.schedule_type={schedule!r} is not one pipekit runs: give fixed_linear or "
                          f"fixed_root")
    cfg = block.get("schedule_config") or {}
    missing = [k for k in ("min_difficulty", "max_difficulty") if k not in block]
    missing += [f"schedule_config.{k}" for k in ("total_curriculum_step", "difficulty_step") if k not in cfg]
    if schedule == "fixed_root" and "root_degree" not in cfg:
        missing.append("schedule_config.root_degree")
    if missing:
        raise ConfigError(f"{where} needs {', '.join(missing)} (DeepSpeed has no default for them)")
    return [f"train.seq_len_start={block['min_difficulty']}", f"train.seq_len={block['max_difficulty']}",
            f"train.seq_len_warmup_steps={cfg['total_curriculum_step']}",
            f"train.seq_len_multiple={cfg['difficulty_step']}",
            f"train.seq_len_root={cfg.get('root_degree', 1) if schedule == 'fixed_root' else 1}"]


def _autos(ds: Any, prefix: str) -> list[str]:
    """The dotted keys of `ds` set to "auto"."""
    if not isinstance(ds, dict):
        return []
    out = []
    for key, value in ds.items():
        if value == "auto" and f"{prefix}{key}" not in NOTED:  # a NOTED key has its own note
            out.append(f"{prefix}{key}")
        elif isinstance(value, dict):
            out += _autos(value, f"{prefix}{key}.")
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# a scheduler's "auto" params: what fills them (from the optimizer block's lr, or else the config)
_SCHEDULER_AUTO = {
    "total_num_steps": lambda lr, cfg: cfg.train.steps,
    "warmup_num_steps": lambda lr, cfg: cfg.optimizer.warmup_steps,
    "warmup_max_lr": lambda lr, cfg: lr,
    "cycle_max_lr": lambda lr, cfg: lr,
    "warmup_min_lr": lambda lr, cfg: 0.0,
    "cycle_min_lr": lambda lr, cfg: 0.0,
}


def _filled(block: Any, optimizer: Any, base: Any) -> Any:
    """The scheduler block with its "auto" params filled from the run (`from_deepspeed`)."""
    if not isinstance(block, dict) or not isinstance(block.get("params"), dict):
        return block
    params = block["params"]
    autos = [k for k, v in params.items() if v == "auto"]
    if not autos:
        return block
    if base is None:
        from ..config import Config

        base = Config()
    given = ((optimizer or {}).get("params") or {}).get("lr") if isinstance(optimizer, dict) else None
    lr = given if _is_number(given) else base.optimizer.lr
    for key in autos:
        if key not in _SCHEDULER_AUTO:
            raise ConfigError(f"ds_config scheduler.params.{key}=\"auto\": pipekit fills only "
                              f"{sorted(_SCHEDULER_AUTO)} from its config; give {key} a value")
    return {**block, "params": {**params, **{k: _SCHEDULER_AUTO[k](lr, base) for k in autos}}}


# offload_optimizer's keys: mapped, or without effect here (and why)
_OFFLOAD_MAPPED = {"device", "nvme_path", "pin_memory", "ratio"}
_OFFLOAD_NOTED = {
    "buffer_count": "pipekit streams the state one bucket ahead and one behind",
    "fast_init": "pipekit writes the state files once, at the start",
    "pipeline_read": "pipekit always reads the next bucket while one steps",
    "pipeline_write": "pipekit always writes a bucket while the next one steps",
    "pipeline": "pipekit always overlaps the state files' reads and writes with the step",
}


# offload_param's keys: mapped, or without effect here (DeepSpeed's NVMe parameter buffers: pipekit
# offloads parameters to host memory only)
_PARAM_MAPPED = {"device", "pin_memory"}
_PARAM_NOTED = {
    "nvme_path": "pipekit offloads parameters to host memory only (device cpu)",
    "buffer_count": "it counts DeepSpeed's NVMe parameter buffers; pipekit offloads parameters to host memory only",
    "buffer_size": "it sizes DeepSpeed's NVMe parameter buffers; pipekit offloads parameters to host memory only",
    "max_in_cpu": "it bounds DeepSpeed's NVMe parameter cache; pipekit keeps every offloaded shard in host memory",
}


def _offload_block(zero: dict, name: str, mapped: set[str], noted: dict[str, str], notes: list[str]) -> tuple:
    """(block, its device) of zero_optimization.`name`, its keys checked (typos refused, the
    ones without effect noted)."""
    block = zero.get(name) or {}
    where = f"ds_config zero_optimization.{name}"
    for key in block:
        if key in noted:
            notes.append(f"{where}.{key} has no effect in pipekit: {noted[key]}")
        elif key not in mapped:
            near = difflib.get_close_matches(key, sorted(mapped | set(noted)), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(f"{where} key {key!r} is not one DeepSpeed knows{hint}")
    device = block.get("device", "none") or "none"
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{where}.device={device!r} must be one of cpu, nvme, none")
    return block, device


def _offload(zero: dict, notes: list[str]) -> list[str]:
    """zero_optimization.offload_optimizer as optimizer.offload / offload_dir, offload_param as
    optimizer.offload_params (stage 3; noted below it, where DeepSpeed ignores it too), and their
    pin_memory (DeepSpeed 0.19.8's default for both: true) as the one optimizer.pin_memory."""
    block, device = _offload_block(zero, "offload_optimizer", _OFFLOAD_MAPPED, _OFFLOAD_NOTED, notes)
    param, param_device = _offload_block(zero, "offload_param", _PARAM_MAPPED, _PARAM_NOTED, notes)
    where = "ds_config zero_optimization.offload_optimizer"
    out, pins = [], []
    if device != "none":
        if block.get("ratio", 1.0) != 1.0:
            raise ConfigError(f"{where}.ratio={block['ratio']}: pipekit offloads all of the optimizer or none of "
                              f"it; remove ratio (or set 1.0)")
        out.append(f"optimizer.offload={device}")
        pins.append(bool(block.get("pin_memory", True)))
        if device == "nvme":
            if not block.get("nvme_path"):
                raise ConfigError(f"{where}.device=nvme needs nvme_path (the directory the state files go in)")
            out.append(f"optimizer.offload_dir={block['nvme_path']}")
    stage = zero.get("stage", 0)
    if param_device == "nvme":
        raise ConfigError("ds_config zero_optimization.offload_param.device=nvme: pipekit's ZeRO-3 is FSDP2, whose "
                          "parameter offload is host memory only; use device cpu (offload_optimizer.device=nvme "
                          "still puts the optimizer state on disk)")
    if param_device == "cpu" and stage != "auto" and stage != 3:
        notes.append(f"ds_config zero_optimization.offload_param has no effect at zero_optimization.stage {stage}: "
                     f"DeepSpeed offloads parameters at stage 3 only, and so does pipekit")
    elif param_device == "cpu":
        out.append("optimizer.offload_params=cpu")
        pins.append(bool(param.get("pin_memory", True)))
    if pins:
        out.append(f"optimizer.pin_memory={any(pins)}")
        if len(set(pins)) > 1:
            notes.append("ds_config offload_optimizer.pin_memory and offload_param.pin_memory differ: pipekit has one "
                         "optimizer.pin_memory for both and pins (page-locked memory acts on CUDA only)")
    return out


def _walk(ds: dict, prefix: str, notes: list[str]) -> None:
    """Refuse keys DeepSpeed would not know here (naming the nearest known one); note the NOTED."""
    known = {"": _TOP | {k for k in NOTED if "." not in k}, "zero_optimization.": _ZERO, "fp16.": _FP16,
             "bf16.": {"enabled"}, "optimizer.": {"type", "params"}, "optimizer.params.": _PARAMS,
             "scheduler.": {"type", "params"}, "activation_checkpointing.": _ACT, "pipeline.": _PIPE,
             "curriculum_learning.": _CURRICULUM,
             "curriculum_learning.schedule_config.": {"total_curriculum_step", "difficulty_step", "root_degree"}}
    for key, value in ds.items():
        full = f"{prefix}{key}"
        if full in NOTED:
            notes.append(f"ds_config {full} has no effect in pipekit: {NOTED[full]}")
            continue
        mine = known.get(prefix)
        if mine is None:  # params of a section mapped as a whole (an offload block, a scheduler's)
            continue
        if key not in mine and f"{prefix}{key}" not in NOTED:
            names = sorted(mine | {k[len(prefix):] for k in NOTED if k.startswith(prefix) and "." not in
                                   k[len(prefix):]})
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix}{near[0]}?" if near else ""
            raise ConfigError(f"ds_config key {full!r} is not a DeepSpeed key pipekit knows{hint} (see the "
                              f"migration table in the README)")
        if isinstance(value, dict) and f"{full}." in known:
            _walk(value, f"{full}.", notes)


def _given(ds: dict, key: str) -> int | None:
    value = ds.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ds_config {key}={value!r} must be a whole number >= 1 (or \"auto\")")
    return value


def _batch(ds: dict, dp: int) -> list[str]:
    """train.micro_batch, schedule.microbatches and train.global_batch by DeepSpeed's rule."""
    total, micro, gas = (_given(ds, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                   "gradient_accumulation_steps"))
    if total is not None and micro is not None and gas is not None:
        if total != micro * gas * dp:
            raise ConfigError(f"ds_config train_batch_size={total} is not train_micro_batch_size_per_gpu * "
                              f"gradient_accumulation_steps * dp = {micro} * {gas} * {dp} = {micro * gas * dp}")
    elif total is not None and micro is not None:
        gas = total // (micro * dp)
        if gas * micro * dp != total:
            raise ConfigError(f"ds_config train_batch_size={total} is not a multiple of "
                              f"train_micro_batch_size_per_gpu * dp = {micro} * {dp}")
    elif total is not None and gas is not None:
        micro = total // (gas * dp)
        if micro * gas * dp != total:
            raise ConfigError(f"ds_config train_batch_size={total} is not a multiple of gradient_accumulation_steps "
                              f"* dp = {gas} * {dp}")
    elif total is not None:
        gas, micro = 1, total // dp
        if micro * dp != total:
            raise ConfigError(f"ds_config train_batch_size={total} does not split over dp={dp} replicas")
    elif micro is not None:
        gas = gas or 1
    else:
        return []
    assert micro is not None and gas is not None
    return [f"train.micro_batch={micro}", f"schedule.microbatches={gas}", f"train.global_batch={micro * gas * dp}"]


# an optimizer param as the pipekit fields it sets (an "auto" param sets none of them)
_FIELDS = {"lr": ("lr",), "betas": ("beta1", "beta2"), "eps": ("eps",), "weight_decay": ("weight_decay",),
           "momentum": ("momentum",)}


def _optimizer(opt: Any) -> list[str]:
    """optimizer.* for DeepSpeed's optimizer block: its params over the defaults of the optimizer
    DeepSpeed builds. A param given as "auto" (the HF Trainer's placeholder, which the Trainer
    fills from its own arguments) is left to pipekit's config, as an "auto" batch key is."""
    if opt is None:
        return []
    kind = str(opt.get("type", "")) if isinstance(opt, dict) else str(opt)
    name = _OPTIMIZERS.get(kind.lower())
    if name is None:
        raise ConfigError(f"ds_config optimizer type {kind!r} is not one pipekit runs; give one of "
                          f"{sorted(_OPTIMIZERS.values())}")
    raw = opt.get("params") or {}
    auto = {k for k, v in raw.items() if v == "auto"}
    given = {k: v for k, v in raw.items() if k not in auto}
    decoupled = name == "AdamW" or given.get("adam_w_mode", True)  # DeepSpeed: type AdamW forces it
    defaults = dict(_DEFAULTS)
    if given.get("torch_adam") and decoupled:
        defaults["weight_decay"] = 0.01  # torch.optim.AdamW's own default, which torch_adam=true gets
    params: dict = {**(defaults if name != "SGD" else {"weight_decay": 0.0, "momentum": 0.0}), **given}
    if name == "SGD":
        if "lr" not in raw:
            raise ConfigError("ds_config optimizer SGD needs params.lr (torch's SGD has no default)")
        head, values = "sgd", {k: params.get(k) for k in ("lr", "momentum", "weight_decay")}
    else:
        if not decoupled and ("weight_decay" in auto or params["weight_decay"]):
            decay = "auto" if "weight_decay" in auto else params["weight_decay"]
            raise ConfigError(f"ds_config optimizer Adam with adam_w_mode=false adds weight_decay={decay} to the "
                              f"gradient (L2), which pipekit's AdamW does not; use adam_w_mode=true (decoupled) or "
                              f"weight_decay=0")
        betas = params["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"ds_config optimizer.params.betas={betas!r} must be two numbers [beta1, beta2] "
                              f"(or \"auto\")")
        head = "adamw"
        values = {"lr": params["lr"], "beta1": betas[0], "beta2": betas[1], "eps": params["eps"],
                  "weight_decay": params["weight_decay"]}
    left = {field for key in auto for field in _FIELDS.get(key, ())}
    return [f"optimizer.name={head}", *(f"optimizer.{k}={v}" for k, v in values.items() if k not in left)]


def _scheduler(block: Any) -> list[str]:
    """DeepSpeed's scheduler block as optimizer.scheduler, whole (null first: a block the config
    holds is replaced, not merged into); none: a constant lr."""
    out = ["optimizer.warmup_steps=0", "optimizer.decay=constant", "optimizer.scheduler=null"]
    if block is None:
        return out  # DeepSpeed without a scheduler: constant
    try:
        check_scheduler(block, "ds_config scheduler")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return [*out, f"optimizer.scheduler={json.dumps(block)}"]


def _precision(ds: dict, notes: list[str]) -> list[str]:
    fp16, bf16 = ds.get("fp16") or {}, ds.get("bf16") or {}
    for name, block in (("fp16", fp16), ("bf16", bf16)):
        if block.get("enabled", False) not in (True, False, "auto"):
            raise ConfigError(f"ds_config {name}.enabled={block['enabled']!r} must be true, false or \"auto\"")
    on16, onb16 = fp16.get("enabled") is True, bf16.get("enabled") is True
    if on16 and onb16:
        raise ConfigError("ds_config enables both fp16 and bf16; choose one")
    if onb16:
        return ["train.precision=bf16"]
    if not on16:
        if "auto" in (fp16.get("enabled"), bf16.get("enabled")):
            return []  # "auto": the config's train.precision
        return ["train.precision=fp32"]  # neither: DeepSpeed trains in fp32
    out = ["train.precision=fp16"]
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale"):
        if key in fp16 and fp16[key] != "auto":
            out.append(f"fp16.{key}={fp16[key]}")
    if not (ds.get("zero_optimization") or {}).get("stage", 0):  # DeepSpeed's FP16_Optimizer: no hysteresis
        given = [k for k in ("hysteresis", "consecutive_hysteresis") if k in fp16]
        if given:
            notes.append(f"ds_config fp16.{given[0]} has no effect at zero_optimization.stage 0 (DeepSpeed's fp16 "
                         f"optimizer there halves the scale at every overflow), so none here either")
        return [*out, "fp16.hysteresis=1", "fp16.consecutive_hysteresis=false"]
    for key in ("hysteresis", "consecutive_hysteresis"):
        if key in fp16 and fp16[key] != "auto":
            out.append(f"fp16.{key}={str(fp16[key]).lower() if isinstance(fp16[key], bool) else fp16[key]}")
    return out
