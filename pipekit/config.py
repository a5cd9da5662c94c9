"""Experiment configs: typed dataclasses, merged with YAML and `key=value` overrides.

`load_config(path, overrides)` builds `OmegaConf.structured(Config)`, merges
the YAML file and the dot-list overrides (an unknown key or a value of the
wrong type fails with OmegaConf's message naming the key), converts the
result to real dataclasses, and runs the cross-field checks of
`check_config`, all before any worker is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schedules import SCHEDULES, ScheduleError, build_schedule


@dataclass
class ModelConfig:
    name: str = "toy"  # the built-in toy language model (the zoo arrives with its own issue)
    vocab: int = 64
    dim: int = 64
    wide_dim: int = 96
    blocks: int = 3  # MLP blocks at each of the two widths
    mlp_ratio: int = 2


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline stages
    dp: int = 1  # data-parallel replicas


@dataclass
class ScheduleConfig:
    name: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    microbatches: int = 4  # per optimizer step and dp replica
    chunks_per_rank: int = 1  # virtual stages per rank (interleaved_1f1b)
    partition: str = "parameters"  # uniform | parameters | type:REGEX
    activation_checkpoint_interval: int = 0


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch: int = 32  # sequences per optimizer step, over all dp replicas
    seq_len: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 25
    dtype: str = "float32"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    out_dir: Optional[str] = None  # where metrics and the final weights go (None: nothing written)

    @property
    def world_size(self) -> int:
        return self.parallel.pp * self.parallel.dp


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


def model_specs(model: ModelConfig) -> list:
    """The spec list a model config describes (nothing is built)."""
    from .models.toy import ToyConfig, toy_lm

    return toy_lm(ToyConfig(model.vocab, model.dim, model.wide_dim, model.blocks, model.mlp_ratio))


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    schema = OmegaConf.structured(Config)
    try:
        parts = [schema]
        if path:
            parts.append(OmegaConf.load(path))
        parts.append(OmegaConf.from_dotlist(list(overrides or [])))
        cfg = OmegaConf.to_object(OmegaConf.merge(*parts))
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config{f' {path}' if path else ''}: {e}") from e
    check_config(cfg)
    return cfg


def check_config(cfg: Config) -> None:
    """Cross-field checks; each error names the key and what would be valid."""
    p, s, t = cfg.parallel, cfg.schedule, cfg.train
    for key, value in [("parallel.pp", p.pp), ("parallel.dp", p.dp), ("schedule.microbatches", s.microbatches),
                       ("schedule.chunks_per_rank", s.chunks_per_rank), ("train.steps", t.steps)]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if s.name not in SCHEDULES:
        raise ConfigError(f"schedule.name={s.name!r} is not one of {list(SCHEDULES)}")
    if cfg.model.name != "toy":
        raise ConfigError(f"model.name={cfg.model.name!r}: only 'toy' is built in so far")
    if t.dtype not in ("float32", "float64", "bfloat16"):
        raise ConfigError(f"train.dtype={t.dtype!r} is not one of ['float32', 'float64', 'bfloat16']")
    per_step = p.dp * s.microbatches
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be a multiple of parallel.dp * schedule.microbatches = "
            f"{p.dp} * {s.microbatches} = {per_step}"
        )
    n_layers = len(model_specs(cfg.model))
    if n_layers < p.pp * s.chunks_per_rank:
        raise ConfigError(
            f"the model has {n_layers} layers, fewer than parallel.pp * schedule.chunks_per_rank = "
            f"{p.pp * s.chunks_per_rank} stages"
        )
    try:
        build_schedule(s.name, p.pp, s.microbatches, s.chunks_per_rank)
    except ScheduleError as e:
        raise ConfigError(f"schedule: {e}") from e
