"""A ds_config's `scheduler` and fp16 loss scaling run as DeepSpeed runs them (pipekit/optim/lr.py,
pipekit/optim/scaler.py), checked against DeepSpeed itself where it is installed.

The lr schedules: for each DeepSpeed scheduler (both warmup types, defaults and non-default
params), the lr (and OneCycle's betas) that pipekit's LR scheduler gives at each of 60
optimizer steps equals what DeepSpeed's engine (deepspeed.initialize on a tiny nn.Linear,
engine.backward / engine.step) had in its optimizer before the same step, within 1e-12: the
engine, not only the scheduler classes, so the step count (the constructor sets step 0's lr;
the engine steps the scheduler after each optimizer step) is DeepSpeed's. Then the same
through `pipekit train --deepspeed` (the lr each step ran on, from metrics.jsonl) and through
`train.build`'s engine (OneCycle's betas, and a resume's). The loss scale: pipekit's
LossScaler against DeepSpeed's DynamicLossScaler (ZeRO 1-3) and its stage-0 fp16 optimizer's
update, over a sweep of their knobs and random and adversarial overflow sequences.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pipekit.config import ConfigError, OptimizerConfig, load_config
from pipekit.optim import LossScaler
from pipekit.optim.factory import lr_schedule
from pipekit.optim.lr import KINDS, check_scheduler
from pipekit.run.deepspeed import from_deepspeed

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60
LR = 2e-3  # the optimizer block's lr (WarmupCosineLR scales it; WarmupLR with no max takes it)


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    """DeepSpeed on the CPU, in a one-process gloo group (made here unless one is up already)."""
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as env:
        env.setenv("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
        env.setenv("LOCAL_RANK", "0")
        ds = pytest.importorskip("deepspeed")
        made = not dist.is_initialized()
        if made:
            store = tmp_path_factory.mktemp("ds") / "store"
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            pytest.skip("a process group of more than one process is up")
        ds.comm.init_distributed(dist_backend="gloo")
        yield ds
        if made and dist.is_initialized():
            dist.destroy_process_group()


def deepspeed_steps(ds, block: dict, steps: int = STEPS) -> list[tuple[float, tuple]]:
    """(lr, betas) in DeepSpeed's optimizer before each of `steps` engine steps, with `block`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "scheduler": block}
    engine, optimizer, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    seen, x = [], torch.randn(1, 4)
    for _ in range(steps):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], tuple(group["betas"])))
        engine.backward(engine(x).square().sum())
        engine.step()
    return seen


def pipekit_steps(block: dict, steps: int = STEPS, name: str = "adamw") -> list[tuple[float, tuple]]:
    """(lr, betas) before each of `steps` steps under `factory.lr_schedule` (what train.build makes)."""
    o = OptimizerConfig(lr=LR, scheduler=block, name=name, beta1=0.9, beta2=0.999)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2))
    schedule = lr_schedule(optimizer, o, steps=10)  # train.steps: DeepSpeed's blocks count their own
    seen = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], tuple(group["betas"])))
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return seen


BLOCKS = {
    "warmup-log-defaults": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},  # max: the optimizer's lr
    "warmup-linear": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 7, "warmup_type": "linear"}},
    "warmup-of-one-step": {"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "linear"}},
    "decay-log": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 10}},
    "decay-linear": {"type": "WarmupDecayLR", "params": {"total_num_steps": 40, "warmup_min_lr": 1e-4,
                                                         "warmup_max_lr": 2e-3, "warmup_num_steps": 5,
                                                         "warmup_type": "linear"}},
    "cosine-log": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 10}},
    "cosine-linear": {"type": "WarmupCosineLR", "params": {"total_num_steps": 45, "warmup_num_steps": 8,
                                                           "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
                                                           "warmup_type": "linear"}},
    "one-cycle": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                 "cycle_first_step_size": 10}},
    "one-cycle-stairs-decay": {"type": "OneCycle", "params": {
        "cycle_min_lr": 2e-4, "cycle_max_lr": 3e-3, "cycle_first_step_size": 7, "cycle_second_step_size": 13,
        "cycle_first_stair_count": 3, "cycle_second_stair_count": 4, "decay_lr_rate": 0.5, "decay_step_size": 5,
        "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}},
    "one-cycle-no-momentum": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                             "cycle_first_step_size": 6, "decay_lr_rate": 0.2,
                                                             "decay_step_size": 3, "cycle_momentum": False}},
    "range-test": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5,
                                                     "lr_range_test_step_rate": 2.0}},
    "range-test-staircase": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 4,
                                                               "lr_range_test_staircase": True}},
}


def test_every_scheduler_is_in_the_table():
    assert {b["type"] for b in BLOCKS.values()} == set(KINDS)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_each_step_runs_on_deepspeeds_lr(deepspeed, name):
    theirs, mine = deepspeed_steps(deepspeed, BLOCKS[name]), pipekit_steps(BLOCKS[name])
    for step, ((lr, betas), (want_lr, want_betas)) in enumerate(zip(mine, theirs)):
        assert abs(lr - want_lr) <= 1e-12, f"{name} step {step}: lr {lr} != DeepSpeed's {want_lr}"
        assert max(abs(a - b) for a, b in zip(betas, want_betas)) <= 1e-12, (
            f"{name} step {step}: betas {betas} != DeepSpeed's {want_betas}")


def test_one_cycle_with_sgd_moves_no_momentum_as_in_deepspeed():
    schedule = lr_schedule(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=LR),
                           OptimizerConfig(lr=LR, name="sgd", scheduler=BLOCKS["one-cycle"]), 10)
    assert type(schedule) is torch.optim.lr_scheduler.LambdaLR  # DeepSpeed cycles only an optimizer with betas


def test_pipekit_train_deepspeed_runs_each_step_on_deepspeeds_lr(deepspeed, tmp_path):
    block = BLOCKS["decay-linear"]
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
                              "scheduler": block}))
    steps = 12
    argv = ["train", str(ROOT / "configs/toy.yaml"), "parallel.pp=1", f"train.steps={steps}", "data.val_every=0",
            "logging.log_every=1", f"logging.out_dir={tmp_path / 'run'}", "logging.progress=false",
            "logging.tensorboard=false", "--deepspeed", str(ds)]
    # its own process: a one-worker `pipekit train` ends the process group it finds, which DeepSpeed holds here
    subprocess.run([sys.executable, "-c", "import sys; from pipekit.cli import main; sys.exit(main(sys.argv[1:]))",
                    *argv], check=True, cwd=ROOT, timeout=300)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ran = {r["step"]: r["lr"] for r in records if "lr" in r}
    theirs = deepspeed_steps(deepspeed, block, steps)
    assert sorted(ran) == list(range(1, steps + 1))
    for step in range(1, steps + 1):  # pipekit's step n is the n-th optimizer step, DeepSpeed's n - 1
        assert abs(ran[step] - theirs[step - 1][0]) <= 1e-12, (step, ran[step], theirs[step - 1][0])


def test_the_training_engine_cycles_adams_betas_and_a_resume_restores_them(deepspeed):
    from pipekit.config import load_run
    from pipekit.run.loop import batches, build
    from pipekit.run.resume import _restore_schedule
    from pipekit.topology import Topology

    block = BLOCKS["one-cycle-stairs-decay"]
    run = load_run(str(ROOT / "configs/toy.yaml"), [
        "parallel.pp=1", "train.device=cpu", f"optimizer.lr={LR}", f"optimizer.scheduler={json.dumps(block)}"])
    engine = build(run, Topology(alone=True))
    data = batches(run, engine.topo)
    steps = 9
    theirs = deepspeed_steps(deepspeed, block, steps + 1)
    for step in range(steps):
        group = engine.optimizer.param_groups[0]
        assert abs(group["lr"] - theirs[step][0]) <= 1e-12 and group["betas"] == pytest.approx(theirs[step][1],
                                                                                             abs=1e-12), step
        engine.train_batch(data)
    _restore_schedule(engine, 3)  # as a resume from the checkpoint of step 3 sets it
    group = engine.optimizer.param_groups[0]
    assert abs(group["lr"] - theirs[3][0]) <= 1e-12 and group["betas"] == pytest.approx(theirs[3][1], abs=1e-12)


# ---- what is not a scheduler pipekit runs: one line naming the key ----
@pytest.mark.parametrize("block, said", [
    ({"type": "WarmupLr", "params": {}}, "optimizer.scheduler.type='WarmupLr' is not a DeepSpeed scheduler "
                                         "pipekit runs; did you mean WarmupLR?"),
    ({"type": "StepLR", "params": {"step_size": 3}}, "DeepSpeed would take torch's own by name"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 3}}, "optimizer.scheduler.params.warmup_num_step is not a "
                                                             "param of WarmupLR; did you mean warmup_num_steps?"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "warmup_type='cosine' must be log or linear"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps=0 must be a whole number >= 1"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3]}}, "one value per param group"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}, "params.total_num_steps is needed by "
                                                                  "WarmupDecayLR"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}, "total_num_steps='auto' must be a whole"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_max_mom": 1.5}},
     "cycle_max_mom=1.5 must be in [0, 1)"),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}, "params.cycle_min_lr is needed by OneCycle"),
    ({"type": "LRRangeTest", "params": {"last_batch_iteration": 5}}, "last_batch_iteration=5 must be -1"),
    ({"type": "WarmupLR", "parms": {}}, "optimizer.scheduler.parms is not a key of a scheduler block; did you mean "
                                        "params?"),
])
def test_a_block_pipekit_cannot_run_is_refused_in_one_line(block, said):
    with pytest.raises(ValueError) as e:
        check_scheduler(block)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_config_and_the_ds_config_refuse_with_their_own_key_names():
    bad = {"type": "WarmupLR", "params": {"warmup_typ": "log"}}
    with pytest.raises(ConfigError, match=r"optimizer\.scheduler\.params\.warmup_typ is not a param of WarmupLR"):
        load_config(str(ROOT / "configs/toy.yaml"), [f"optimizer.scheduler={json.dumps(bad)}"])
    with pytest.raises(ConfigError, match=r"ds_config scheduler\.params\.warmup_typ is not a param"):
        from_deepspeed({"scheduler": bad}, 1)


def test_a_ds_config_scheduler_replaces_the_configs_block(tmp_path):
    toy = tmp_path / "toy.yaml"
    toy.write_text((ROOT / "configs/toy.yaml").read_text().replace(
        "optimizer:\n", "optimizer:\n  scheduler: {type: WarmupDecayLR, params: {total_num_steps: 9}}\n", 1))
    block = BLOCKS["warmup-linear"]
    overrides, _ = from_deepspeed({"scheduler": block}, 1)
    assert load_config(str(toy), overrides).optimizer.scheduler == block
    assert load_config(str(toy), from_deepspeed({}, 1)[0]).optimizer.scheduler is None  # DeepSpeed: a constant lr


# ---- fp16 loss scaling ----
def overflow_sequences(window: int, n: int = 160) -> dict[str, list[bool]]:
    rng = random.Random(window)
    return {
        **{f"random-{p}": [rng.random() < p for _ in range(n)] for p in (0.05, 0.3, 0.7)},
        "bursts": [(i // 5) % 3 == 0 for i in range(n)],
        "every-window": [i % window == window - 1 for i in range(n)],  # just before the scale would double
        "every-window+1": [i % (window + 1) == window for i in range(n)],
        "every-window+2": [i % (window + 2) == window + 1 for i in range(n)],
        "alternating": [i % 2 == 0 for i in range(n)],
        "clean-then-down-to-the-floor": [False] * (3 * window + 2) + [True] * n,
    }


KNOBS = [(power, window, hysteresis, min_scale)
         for power in (1, 3, 16) for window in (1, 2, 3, 7) for hysteresis in (1, 2, 3) for min_scale in (1.0, 4.0)]


@pytest.mark.parametrize("consecutive", [False, True])
def test_the_loss_scale_follows_deepspeeds_dynamic_loss_scaler(deepspeed, consecutive):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    for power, window, hysteresis, min_scale in KNOBS:
        for name, overflows in overflow_sequences(window).items():
            theirs = DynamicLossScaler(init_scale=2 ** power, scale_window=window, min_scale=min_scale,
                                       delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
            mine = LossScaler(initial_scale_power=power, scale_window=window, hysteresis=hysteresis,
                              min_scale=min_scale, consecutive_hysteresis=consecutive)
            where = f"{name} power={power} window={window} hysteresis={hysteresis} min={min_scale}"
            for i, overflow in enumerate(overflows):
                try:
                    theirs.update_scale(overflow)
                except Exception as e:  # DeepSpeed's ZeRO optimizer ends the run: an overflow at the floor
                    assert "already at minimum" in str(e)
                    mine.update(overflow)
                    assert mine.scale == min_scale and mine.tolerance == 1, where  # skipped, at the floor
                    break
                mine.update(overflow)
                assert (mine.scale, mine.tolerance) == (theirs.cur_scale, theirs.cur_hysteresis), f"{where} step {i}"


def test_at_stage_0_the_loss_scale_follows_deepspeeds_fp16_optimizer(deepspeed):
    """DeepSpeed's stage-0 fp16 optimizers have no hysteresis and no error at the floor: the
    ds_config maps to hysteresis 1 there, which is that update, at the floor too."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile

    overrides, notes = from_deepspeed({"fp16": {"enabled": True, "hysteresis": 4, "consecutive_hysteresis": True}}, 1)
    assert {"fp16.hysteresis=1", "fp16.consecutive_hysteresis=false"} <= set(overrides)
    assert any("fp16.hysteresis has no effect at zero_optimization.stage 0" in n for n in notes)
    for power, window, _, min_scale in KNOBS:
        for name, overflows in overflow_sequences(window).items():
            args = {"init_scale": 2 ** power, "scale_window": window, "min_scale": min_scale, "delayed_shift": 4,
                    "consecutive_hysteresis": False}
            theirs = types.SimpleNamespace(verbose=False, loss_scale_config=LossScaleConfig(
                torch.float16, True, 0, args, profile=LossScaleProfile.FUSED, initial_dynamic_scale=2 ** power))
            mine = LossScaler(initial_scale_power=power, scale_window=window, hysteresis=1, min_scale=min_scale)
            for i, overflow in enumerate(overflows):
                FP16_Optimizer._update_scale(theirs, overflow)
                mine.update(overflow)
                assert mine.scale == theirs.loss_scale_config.cur_scale, f"{name} {power} {window} {min_scale} step {i}"


def test_consecutive_hysteresis_reaches_the_scaler_from_the_config_and_the_ds_config():
    from pipekit.config import load_run

    overrides, _ = from_deepspeed({"fp16": {"enabled": True, "consecutive_hysteresis": True, "hysteresis": 3},
                                   "zero_optimization": {"stage": 1}}, 1)
    assert {"fp16.consecutive_hysteresis=true", "fp16.hysteresis=3"} <= set(overrides)
    cfg = load_config(str(ROOT / "configs/toy.yaml"), ["train.precision=fp16", "fp16.consecutive_hysteresis=true"])
    assert cfg.fp16.consecutive_hysteresis is True
    scaling = load_run(str(ROOT / "configs/toy.yaml"), ["train.precision=fp16", "fp16.consecutive_hysteresis=true",
                                                        "parallel.pp=1", "train.device=cpu"]).precision.loss_scaling
    assert scaling is not None and scaling.consecutive_hysteresis is True


def test_the_first_doubling_after_an_overflow_is_on_the_window_plus_first_clean_step():
    s = LossScaler(initial_scale_power=4, scale_window=3, hysteresis=1)
    s.update(True)
    seen = []
    for _ in range(7):
        s.update(False)
        seen.append(s.scale)
    assert seen == [8, 8, 8, 16, 16, 16, 32]  # DeepSpeed's stable interval: window clean steps, then the next

