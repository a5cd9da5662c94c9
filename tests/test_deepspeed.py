"""A DeepSpeed ds_config.json read as pipekit overrides (pipekit/run/deepspeed.py): DeepSpeed's
batch rule, optimizer defaults and precision keys; typos and what is not mapped yet refused in
one line; keys without effect noted. The schedulers and the loss scale against DeepSpeed's own:
tests/test_lr_schedules.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipekit.cli import main
from pipekit.config import ConfigError, load_config
from pipekit.run.deepspeed import from_deepspeed

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ds, dp, want", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (2, 4, 16)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, 2, (2, 4, 16)),
    ({"train_batch_size": 16}, 4, (4, 1, 16)),  # DeepSpeed: accumulation 1, micro = batch / dp
    ({"train_micro_batch_size_per_gpu": 3}, 2, (3, 1, 6)),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (3, 2, 12)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}, 1,
     (2, 1, 2)),
])
def test_the_batch_follows_deepspeeds_rule(ds, dp, want):
    overrides, _ = from_deepspeed(ds, dp)
    got = {o.split("=")[0]: int(o.split("=")[1]) for o in overrides
           if o.split("=")[0] in ("train.micro_batch", "schedule.microbatches", "train.global_batch")}
    assert (got["train.micro_batch"], got["schedule.microbatches"], got["train.global_batch"]) == want


def test_optimizers_take_deepspeeds_defaults_and_no_scheduler_is_a_constant_lr():
    overrides, _ = from_deepspeed({"optimizer": {"type": "Adam", "params": {"lr": 2e-4}}}, 1)
    for want in ("optimizer.name=adamw", "optimizer.lr=0.0002", "optimizer.beta1=0.9", "optimizer.beta2=0.999",
                 "optimizer.eps=1e-08", "optimizer.weight_decay=0.0", "optimizer.warmup_steps=0",
                 "optimizer.decay=constant", "optimizer.clip_grad_norm=null", "optimizer.zero_stage=0",
                 "train.precision=fp32"):
        assert want in overrides, (want, overrides)
    assert "optimizer.scheduler=null" in overrides
    block = {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}
    scheduled, _ = from_deepspeed({"scheduler": block}, 1)
    assert load_config(str(ROOT / "configs/toy.yaml"), scheduled).optimizer.scheduler == block
    torch_adamw, _ = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, 1)
    assert "optimizer.weight_decay=0.01" in torch_adamw  # torch.optim.AdamW's default, not FusedAdam's
    forced, _ = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False,
                                                                          "weight_decay": 0.1}}}, 1)
    assert "optimizer.weight_decay=0.1" in forced  # DeepSpeed: type AdamW is decoupled whatever adam_w_mode says
    sgd, _ = from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, 1)
    assert {"optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9"} <= set(sgd)


def test_precision_keys():
    fp16, _ = from_deepspeed({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                       "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 2,
                                       "consecutive_hysteresis": True}, "zero_optimization": {"stage": 2}}, 1)
    assert {"train.precision=fp16", "fp16.loss_scale=0", "fp16.initial_scale_power=12", "fp16.loss_scale_window=500",
            "fp16.hysteresis=3", "fp16.min_loss_scale=2", "fp16.consecutive_hysteresis=true"} <= set(fp16)
    stage0, _ = from_deepspeed({"fp16": {"enabled": True, "hysteresis": 3}}, 1)
    assert "fp16.hysteresis=1" in stage0  # DeepSpeed's stage-0 fp16 optimizer has no hysteresis
    assert "train.precision=bf16" in from_deepspeed({"bf16": {"enabled": True}}, 1)[0]


@pytest.mark.parametrize("ds, said", [
    ({"zero_optimization": {"reduce_bucket_sizee": 5e8}},
     "'zero_optimization.reduce_bucket_sizee' is not a DeepSpeed key pipekit knows; did you mean "
     "zero_optimization.reduce_bucket_size?"),
    ({"train_batch_sise": 8}, "did you mean train_batch_size?"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size=10 is not train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp = 2 * 2 * 2 = 8"),
    ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}, "is not a multiple of"),
    ({"scheduler": {"type": "WarmupLRR", "params": {}}}, "ds_config scheduler.type='WarmupLRR' is not a DeepSpeed "
                                                         "scheduler pipekit runs; did you mean WarmupLR?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
     "parameter offload is host memory only"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}}, "did you mean pin_memory?"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "device=nvme needs nvme_path"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "ratio=0.3"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}, "(L2)"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer type 'Lamb' is not one pipekit runs"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
])
def test_what_cannot_run_as_deepspeed_would_is_refused_in_one_line(ds, said):
    with pytest.raises(ConfigError) as e:
        from_deepspeed(ds, 2)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_pipekit_train_deepspeed_merges_the_file_under_the_overrides_and_notes_keys_without_effect(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
                              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                              "zero_optimization": {"stage": 1, "overlap_comm": True}, "steps_per_print": 1}))
    toy = str(ROOT / "configs/toy.yaml")
    argv = ["train", toy, "parallel.pp=1", "optimizer.lr=1e-3", "--deepspeed", str(ds)]
    assert main([*argv, "--show"]) == 0
    out = capsys.readouterr()
    assert "zero_optimization.overlap_comm has no effect in pipekit" in out.err
    cfg = load_config(toy, ["parallel.pp=1", *from_deepspeed(str(ds), 1)[0], "optimizer.lr=1e-3"])
    assert (cfg.train.micro_batch, cfg.schedule.microbatches, cfg.optimizer.zero_stage) == (4, 2, 1)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.clip_grad_norm == 0.5  # the command line wins over the file
    assert "lr: 0.001" in out.out and "clip_grad_norm: 0.5" in out.out
    assert main([*argv, "train.steps=2", "data.val_every=0", f"logging.out_dir={tmp_path / 'run'}",
                 "logging.progress=false", "logging.tensorboard=false"]) == 0
    assert (tmp_path / "run" / "model.pt").is_file()


# Every key the README's migration table names, with a ds_config that holds it and what pipekit makes of
# it: an override it maps to, a note, or a refusal (the words of each).
TABLE = {
    "train_batch_size": ({"train_batch_size": 16}, "train.global_batch=16"),
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 3}, "train.micro_batch=3"),
    "gradient_accumulation_steps": ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5},
                                    "schedule.microbatches=5"),
    "optimizer": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.name=sgd"),
    "Adam": ({"optimizer": {"type": "Adam"}}, "optimizer.name=adamw"),
    "adam_w_mode": ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
                    ConfigError("(L2)")),
    "AdamW": ({"optimizer": {"type": "AdamW"}}, "optimizer.weight_decay=0.0"),
    "SGD": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, "optimizer.momentum=0.9"),
    "params": ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, "optimizer.eps=1e-06"),
    "lr": ({"optimizer": {"type": "AdamW", "params": {"lr": 0.02}}}, "optimizer.lr=0.02"),
    "betas": ({"optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.9]}}}, "optimizer.beta1=0.8"),
    "eps": ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-5}}}, "optimizer.eps=1e-05"),
    "weight_decay": ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.3}}}, "optimizer.weight_decay=0.3"),
    "momentum": ({"optimizer": {"type": "SGD", "params": {"lr": 1, "momentum": 0.5}}}, "optimizer.momentum=0.5"),
    "torch_adam": ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, "optimizer.weight_decay=0.01"),
    "scheduler": ({"scheduler": {"type": "WarmupLR"}}, '"type": "WarmupLR"'),
    "WarmupLR": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}}}, '"warmup_num_steps": 7'),
    "warmup_type": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}}, '"linear"'),
    "WarmupDecayLR": ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}}, "WarmupDecayLR"),
    "WarmupCosineLR": ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}},
                       "WarmupCosineLR"),
    "OneCycle": ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}},
                 "OneCycle"),
    "cycle_momentum": ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                                     "cycle_momentum": False}}},
                       '"cycle_momentum": false'),
    "LRRangeTest": ({"scheduler": {"type": "LRRangeTest"}}, "LRRangeTest"),
    "total_num_steps": ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
                        '"total_num_steps": 200'),
    "gradient_clipping": ({"gradient_clipping": 0.7}, "optimizer.clip_grad_norm=0.7"),
    "zero_optimization.stage": ({"zero_optimization": {"stage": 2}}, "optimizer.zero_stage=2"),
    "zero_optimization.offload_optimizer": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                                            "optimizer.offload=cpu"),
    "device": ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
               "optimizer.offload=nvme"),
    "nvme_path": ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
                  "optimizer.offload_dir=/x"),
    "pin_memory": ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
                   "optimizer.pin_memory=True"),
    "buffer_count": ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 4}}},
                     "offload_optimizer.buffer_count has no effect"),
    "fast_init": ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "fast_init": True}}},
                  "offload_optimizer.fast_init has no effect"),
    "pipeline_read": ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pipeline_read": True}}},
                      "offload_optimizer.pipeline_read has no effect"),
    "pipeline_write": ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pipeline_write": True}}},
                       "offload_optimizer.pipeline_write has no effect"),
    "ratio": ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, ConfigError("ratio=0.5")),
    "zero_optimization.offload_param": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                                        "optimizer.offload_params=cpu"),
    "fp16": ({"fp16": {"enabled": True}}, "train.precision=fp16"),
    "enabled": ({"bf16": {"enabled": True}}, "train.precision=bf16"),
    "loss_scale": ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale=128"),
    "initial_scale_power": ({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "initial_scale_power": 8}},
                            "fp16.initial_scale_power=8"),
    "loss_scale_window": ({"fp16": {"enabled": True, "loss_scale_window": 50}}, "fp16.loss_scale_window=50"),
    "hysteresis": ({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "hysteresis": 3}},
                   "fp16.hysteresis=3"),
    "consecutive_hysteresis": ({"zero_optimization": {"stage": 1},
                                "fp16": {"enabled": True, "consecutive_hysteresis": True}},
                               "fp16.consecutive_hysteresis=true"),
    "min_loss_scale": ({"fp16": {"enabled": True, "min_loss_scale": 4}}, "fp16.min_loss_scale=4"),
    "bf16.enabled": ({"bf16": {"enabled": False}}, "train.precision=fp32"),
    "activation_checkpointing.partition_activations": (
        {"activation_checkpointing": {"partition_activations": True}}, "parallel.sequence_parallel=true"),
    "cpu_checkpointing": ({"activation_checkpointing": {"cpu_checkpointing": True}},
                          ConfigError("cpu_checkpointing=true")),
    "number_checkpoints": ({"activation_checkpointing": {"number_checkpoints": 2}},
                           "activation_checkpointing.number_checkpoints has no effect"),
    "contiguous_memory_optimization": ({"activation_checkpointing": {"contiguous_memory_optimization": True}},
                                       "contiguous_memory_optimization has no effect"),
    "synchronize_checkpoint_boundary": ({"activation_checkpointing": {"synchronize_checkpoint_boundary": True}},
                                        "synchronize_checkpoint_boundary has no effect"),
    "profile": ({"activation_checkpointing": {"profile": True}}, "activation_checkpointing.profile has no effect"),
    "pipeline.stages": ({"pipeline": {"stages": 4}}, "parallel.pp=4"),
    "pipeline.partition": ({"pipeline": {"partition": "uniform"}}, "schedule.partition=uniform"),
    "uniform": ({"pipeline": {"partition": "Uniform"}}, "schedule.partition=uniform"),
    "type:REGEX": ({"pipeline": {"partition": "type:Block"}}, "schedule.partition=type:Block"),
    "pipeline.activation_checkpoint_interval": ({"pipeline": {"activation_checkpoint_interval": 2}},
                                                "schedule.activation_checkpoint_interval=2"),
    "seed_layers": ({"pipeline": {"seed_layers": True}}, "pipeline.seed_layers has no effect"),
    "pipe_partitioned": ({"pipeline": {"pipe_partitioned": False}}, "pipeline.pipe_partitioned has no effect"),
    "grad_partitioned": ({"pipeline": {"grad_partitioned": False}}, "pipeline.grad_partitioned has no effect"),
    "steps_per_print": ({"steps_per_print": 5}, "logging.log_every=5"),
    "curriculum_learning": ({"curriculum_learning": {"enabled": True, "min_difficulty": 8, "max_difficulty": 64,
                                                     "schedule_type": "fixed_linear", "schedule_config": {
                                                         "total_curriculum_step": 10, "difficulty_step": 8}}},
                            "train.seq_len_start=8"),
    "fixed_linear": ({"curriculum_learning": {"enabled": True, "min_difficulty": 8, "max_difficulty": 64,
                                              "schedule_type": "fixed_linear", "schedule_config": {
                                                  "total_curriculum_step": 10, "difficulty_step": 8}}},
                     "train.seq_len_root=1"),
    "fixed_root": ({"curriculum_learning": {"enabled": True, "min_difficulty": 8, "max_difficulty": 64,
                                            "schedule_type": "fixed_root", "schedule_config": {
                                                "total_curriculum_step": 10, "difficulty_step": 8,
                                                "root_degree": 2}}}, "train.seq_len_root=2"),
    "curriculum_type": ({"curriculum_learning": {"enabled": True, "curriculum_type": "vocabularyrarity"}},
                        ConfigError("curriculum_type='vocabularyrarity'")),
    "schedule_type": ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_discrete"}},
                      ConfigError("schedule_type='fixed_discrete' is not one pipekit runs")),
    "min_difficulty": ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear",
                                                "max_difficulty": 64}}, ConfigError("needs min_difficulty")),
    "max_difficulty": ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear", "min_difficulty": 8,
                                                "max_difficulty": 64, "schedule_config": {
                                                    "total_curriculum_step": 3, "difficulty_step": 8}}},
                       "train.seq_len=64"),
    "total_curriculum_step": ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear",
                                                       "min_difficulty": 8, "max_difficulty": 64}},
                              ConfigError("schedule_config.total_curriculum_step")),
    "difficulty_step": ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear", "min_difficulty": 8,
                                                 "max_difficulty": 64, "schedule_config": {
                                                     "total_curriculum_step": 3, "difficulty_step": 16}}},
                        "train.seq_len_multiple=16"),
    "root_degree": ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_root", "min_difficulty": 8,
                                             "max_difficulty": 64, "schedule_config": {
                                                 "total_curriculum_step": 3, "difficulty_step": 8}}},
                    ConfigError("schedule_config.root_degree")),
    '"auto"': ({"gradient_clipping": "auto"}, 'set to "auto" take pipekit\'s config values: gradient_clipping'),
    "overlap_comm": ({"zero_optimization": {"overlap_comm": True}}, "overlap_comm has no effect"),
    "contiguous_gradients": ({"zero_optimization": {"contiguous_gradients": True}}, "contiguous_gradients has no"),
    "sub_group_size": ({"zero_optimization": {"sub_group_size": 1e9}}, "sub_group_size has no effect"),
    "stage3_*": ({"zero_optimization": {"stage3_max_live_parameters": 1e9}}, "stage3_max_live_parameters has no"),
    "wall_clock_breakdown": ({"wall_clock_breakdown": True}, "wall_clock_breakdown has no effect"),
    "prescale_gradients": ({"prescale_gradients": True}, "prescale_gradients has no effect"),
    "communication_data_type": ({"communication_data_type": "fp32"}, "communication_data_type has no effect"),
    "tensorboard": ({"tensorboard": {"enabled": True}}, "tensorboard has no effect"),
    "flops_profiler": ({"flops_profiler": {"enabled": True}}, "flops_profiler has no effect"),
}
# backticked words in the table's first column that are values or names of files, not keys
NOT_KEYS = {"pipekit/run/deepspeed.py", "NOTED", "parameters", "cpu", "nvme", "cpu / nvme", "log", "linear",
            "false", "true", "mapped", "noted"}


def _table_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| ds_config key | pipekit |"):text.index("Checked against DeepSpeed 0.19.8")]
    keys = set()
    for row in table.splitlines()[2:]:
        if row.startswith("|"):
            first = row.split("|")[1]
            keys.update(w.strip() for w in first.split("`")[1::2])
    return keys - NOT_KEYS


def test_every_key_of_the_readme_migration_table_is_exercised_here():
    missing = sorted(_table_keys() - set(TABLE))
    assert not missing, f"README migration-table keys without a case in TABLE: {missing}"


@pytest.mark.parametrize("key", sorted(TABLE))
def test_each_migration_table_key_does_what_the_table_says(key):
    ds, expected = TABLE[key]
    if isinstance(expected, ConfigError):
        with pytest.raises(ConfigError) as e:
            from_deepspeed(ds, 1)
        assert str(expected) in str(e.value) and "\n" not in str(e.value), str(e.value)
        return
    overrides, notes = from_deepspeed(ds, 1)
    said = " ".join([*overrides, *notes])
    assert expected in said, f"{key}: {expected!r} not in {overrides} / {notes}"


def test_offload_param_is_parameter_offload_at_stage_3_and_a_note_below():
    """DeepSpeed 0.19.8 offloads parameters at ZeRO stage 3 only (below it the block is read and
    ignored) and pins by default; pipekit: optimizer.offload_params=cpu at stage 3, one
    optimizer.pin_memory for both offload blocks, a note below stage 3, nvme refused in one line
    saying why, its NVMe-only keys noted, a typo refused."""
    def mapped(zero: dict, dp: int = 2) -> tuple[list[str], list[str]]:
        return from_deepspeed({"zero_optimization": zero}, dp)

    out, notes = mapped({"stage": 3, "offload_param": {"device": "cpu"}})
    assert {"optimizer.zero_stage=3", "optimizer.offload_params=cpu", "optimizer.pin_memory=True"} <= set(out)
    assert not any(o.startswith("optimizer.offload=") for o in out) and not notes, (out, notes)
    assert load_config(str(ROOT / "configs/toy.yaml"), ["parallel.dp=2", *out]).optimizer.offload_params == "cpu"
    out, _ = mapped({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                     "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    assert {"optimizer.offload_params=cpu", "optimizer.offload=cpu", "optimizer.pin_memory=False"} <= set(out)
    out, notes = mapped({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                         "offload_optimizer": {"device": "cpu"}})
    assert "optimizer.pin_memory=True" in out and any("pin_memory differ" in n for n in notes), (out, notes)
    out, notes = mapped({"stage": 2, "offload_param": {"device": "cpu"}})
    assert not any("offload_params" in o for o in out)
    assert any("offload_param has no effect at zero_optimization.stage 2" in n for n in notes), notes
    out, notes = mapped({"stage": 3, "offload_param": {"device": "none", "buffer_size": 1e8, "max_in_cpu": 1e9}})
    assert not any("offload_params" in o for o in out)
    assert sum("offload_param.buffer_size has no effect" in n or "offload_param.max_in_cpu has no effect" in n
               for n in notes) == 2, notes
    with pytest.raises(ConfigError, match=r"offload_param\.device=nvme: pipekit's ZeRO-3 is FSDP2, whose parameter "
                                          r"offload is host memory only") as e:
        mapped({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean pin_memory"):
        mapped({"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}})
    auto, _ = mapped({"stage": "auto", "offload_param": {"device": "cpu"}})  # the config's stage: checked there
    with pytest.raises(ConfigError, match="optimizer.offload_params=cpu offloads ZeRO-3's parameter shards, but "
                                          "optimizer.zero_stage=0"):
        load_config(str(ROOT / "configs/toy.yaml"), ["parallel.dp=2", *auto])
