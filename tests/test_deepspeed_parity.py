"""A ds_config.json runs in pipekit as DeepSpeed's own engine runs it (issue 25).

The pipekit side is built *from* the ds_config, through `from_deepspeed` and `pipekit.run.loop.build`
(as `pipekit train CONFIG --deepspeed ds.json` builds it); DeepSpeed's side is `deepspeed.initialize`
on the same layers with the same starting weights and the same batches. Both train 50 fp32 optimizer
steps of 4 microbatches and must agree at every step on the loss within 1e-6, on the clipping norm
within 1e-5 relative, on the learning rate exactly:

- pp=1: DeepSpeed's engine (forward, `backward`, `step` per microbatch) against pipekit's engine, in
  one process at ZeRO-1 and over two data-parallel replicas at ZeRO-2;
- pp=2, two processes: DeepSpeed's pipeline engine (`deepspeed.pipe.PipelineModule`, `train_batch`)
  against pipekit's, cut at pipekit's boundaries, the tied embedding / head on both stages: ZeRO-0
  (without clipping, see below), and ZeRO-1 with clipping and a WarmupDecayLR schedule (DeepSpeed's
  pipeline engine refuses ZeRO-2 and 3).

What a DeepSpeed user must know:
- pipekit decays only matrices (`pipekit.optim.factory.param_groups`: biases and norm weights get
  weight_decay 0, as in nanoGPT and Megatron), while DeepSpeed decays every parameter it is given in
  one group. The same `optimizer.params.weight_decay` trains differently unless DeepSpeed is given
  pipekit's groups (`deepspeed.initialize(model_parameters=groups)`, as here) or weight_decay is 0.
- at pp > 1 without ZeRO, DeepSpeed clips by the first stage's gradient norm alone (a test below
  pins it); pipekit by the whole model's, as DeepSpeed does at pp=1 and with ZeRO-1.
- the loss: pipekit's is the token-weighted mean over the step's microbatches, DeepSpeed's the mean
  of the per-microbatch means: the same here, where every microbatch has as many tokens as the
  others and no label is ignored; with ignored (padding) labels they differ.

On the CPU: DS_ACCELERATOR=cpu (set here, before deepspeed is imported), the gloo group the workers
already hold, `torch_adam: true` (DeepSpeed's CPU Adam op is not built with DS_BUILD_OPS=0), and
DeepSpeed's shared-memory all-reduce op turned off (`_join_deepspeed`). DeepSpeed's pipeline engine
sends an activation as it is, and gloo refuses a non-contiguous tensor (the toy's expanded positions):
its layers' outputs are made contiguous by a forward hook, which changes no value.

Also here: the two ds_configs of configs/deepspeed/ (ZeRO-2 with optimizer offload and fp16; ZeRO-3
with offload and bf16, as the HF Trainer writes them) read by `from_deepspeed`, without deepspeed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from pipekit.config import ConfigError, load_run
from pipekit.run.deepspeed import NOTED, from_deepspeed
from pipekit.testing import reference_model, run_distributed

os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported: no GPU probe, gloo
try:
    import deepspeed
except ImportError:  # the engine tests skip; the ds_config files are still read
    deepspeed = None
needs_deepspeed = pytest.mark.skipif(deepspeed is None, reason="deepspeed is not installed "
                                                                "(DS_BUILD_OPS=0 pip install -e '.[deepspeed]')")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 50
TOLERANCE = 1e-6  # on the loss, absolute
NORM_TOLERANCE = 1e-5  # on the clipping norm, relative (DESIGN.md's bar for gradients in fp32)
# a small toy model (pipekit's zoo family `toy`: tied embedding and head, (hidden, positions) activations)
PIPEKIT = ["model.family=toy", "model.vocab_size=32", "model.dim=16", "model.n_layers=2", "train.seq_len=8",
           "train.device=cpu", "train.dtype=float32", f"train.steps={STEPS}", "data.source=synthetic",
           "data.val_every=0", "schedule.name=1f1b"]
DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-8, "weight_decay": 0.1,
                                              "torch_adam": True}},
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000,
}


def _pipekit(ds: dict, pp: int = 1, dp: int = 1):
    """pipekit's run, engine and this rank's batches for `ds` at `pp` stages and `dp` replicas, built
    as `pipekit train --deepspeed ds.json` builds them."""
    from pipekit.run.loop import batches, build
    from pipekit.topology import Topology

    overrides, _ = from_deepspeed(ds, dp=dp)
    run = load_run(None, [*PIPEKIT, f"parallel.pp={pp}", f"parallel.dp={dp}", *overrides])
    topo = Topology(pp=pp, dp=dp, tp=1, device="cpu")
    return run, build(run, topo), batches(run, topo)


def _groups(params, weight_decay: float) -> list[dict]:
    """pipekit's decay grouping (matrices decay, vectors do not) for DeepSpeed's parameters."""
    params = [p for p in params if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _join_deepspeed() -> None:
    """DeepSpeed's comm layer over the gloo group this worker already holds, with the variables it
    reads of a launcher (PipelineModule needs LOCAL_RANK). Its CPU shared-memory all-reduce op is
    turned off: only DeepSpeed's inference all-reduce uses it, and building it is a g++ compile of
    about 100 s on a 2-core machine."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def _data_parallel(ds: dict) -> dict:
    """pp=1 at dp = the world size: DeepSpeed's engine on the reference model beside pipekit's engine,
    each rank on its rows of the global batch; the losses (of the global batch) and the norms."""
    import torch.distributed as dist

    _join_deepspeed()
    run, engine, data = _pipekit(ds, dp=dist.get_world_size())
    model = reference_model(engine.module.specs, run.config.train.seed)  # pipekit's starting weights
    loss_fn = engine.module.loss_fn
    wd = ds["optimizer"]["params"]["weight_decay"]
    ds_engine, *_ = deepspeed.initialize(model=model, model_parameters=_groups(model.parameters(), wd), config=ds)
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    out = {"pipekit": [], "deepspeed": [], "pipekit_norm": [], "deepspeed_norm": [], "lr": []}
    for _ in range(STEPS):
        x, y = next(data)
        out["lr"].append((engine.optimizer.param_groups[0]["lr"], ds_engine.get_lr()[0]))
        out["pipekit"].append(engine.train_batch((x, y), reduce_loss=True))
        out["pipekit_norm"].append(engine.last_grad_norm)
        total = 0.0
        for m in range(gas):
            rows = slice(m * micro, (m + 1) * micro)
            loss = loss_fn(ds_engine(x[rows]), y[rows])
            ds_engine.backward(loss)
            ds_engine.step()
            total += loss.detach()
        dist.all_reduce(total)  # this rank's microbatches, then every rank's: the global batch's mean
        out["deepspeed"].append(total.item() / gas / dist.get_world_size())
        out["deepspeed_norm"].append(ds_engine.get_global_grad_norm())
    return out


def _keep_clipping_norms(ds_engine) -> list[tuple[float, float]]:
    """(the norm DeepSpeed clipped by, this rank's own gradient norm) at each step. Without ZeRO (in
    fp32) DeepSpeed's engine clips in `clip_fp32_gradients` and keeps no norm (`get_global_grad_norm()`
    is None): this is that method's own line, keeping what `clip_grad_norm_` returns."""
    from deepspeed.runtime.utils import clip_grad_norm_

    norms: list[tuple[float, float]] = []

    def clip() -> None:
        params = [p for p in ds_engine.module.parameters() if p.grad is not None]
        here = torch.stack([p.grad.norm() ** 2 for p in params]).sum().sqrt().item()
        norms.append((float(clip_grad_norm_(parameters=ds_engine.module.parameters(),
                                            max_norm=ds_engine.gradient_clipping(), mpu=ds_engine.mpu)), here))

    ds_engine.clip_fp32_gradients = clip
    return norms


def _contiguous(module, inputs, output):
    """A forward hook: the layer's output, contiguous (for DeepSpeed's p2p over gloo)."""
    return tuple(t.contiguous() for t in output) if isinstance(output, tuple) else output.contiguous()


def _pipeline(ds: dict, steps: int = STEPS) -> dict:
    """pp=2: DeepSpeed's pipeline engine beside pipekit's, the same partition; the losses and norms."""
    from deepspeed.pipe import PipelineModule, TiedLayerSpec

    from pipekit.spec import LayerSpec, tied_first_index
    from pipekit.spec import TiedLayerSpec as PipekitTied

    _join_deepspeed()
    run, engine, data = _pipekit(ds, pp=2)
    specs, seed = engine.module.specs, run.config.train.seed
    reference = reference_model(specs, seed)  # every layer with pipekit's starting weights
    layers = [TiedLayerSpec(s.key, s.module_cls, *s.args, forward_fn=s.forward_fn,
                            tied_weight_attr=s.tied_weight_attr, **s.kwargs) if isinstance(s, PipekitTied)
              else reference[i] if isinstance(s, LayerSpec) else s for i, s in enumerate(specs)]
    for layer in layers:  # DeepSpeed sends an activation as it is, and gloo refuses the toy's expanded
        if isinstance(layer, torch.nn.Module):  # positions (pipekit's p2p makes them contiguous first)
            layer.register_forward_hook(_contiguous)

    class SamePartition(PipelineModule):
        """DeepSpeed's pipeline module cut where pipekit cut (it has no explicit partition method)."""

        def _partition_layers(self, method="uniform"):
            self.parts = list(engine.module.boundaries)
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    module = SamePartition(layers, num_stages=2, loss_fn=engine.module.loss_fn)
    with torch.no_grad():
        for key, tied in module.tied_modules.items():  # DeepSpeed built these from their class: pipekit's weights
            tied.load_state_dict(reference[tied_first_index(specs)[key]].module.state_dict())
    wd = ds["optimizer"]["params"]["weight_decay"]
    ds_engine, *_ = deepspeed.initialize(model=module, model_parameters=_groups(module.parameters(), wd), config=ds)
    clipped = _keep_clipping_norms(ds_engine)
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    out = {"pipekit": [], "deepspeed": [], "pipekit_norm": [], "deepspeed_norm": [], "first_stage_norm": [],
           "lr": [], "layers": [sorted(map(int, engine.module.layers)), sorted(map(int, module.fwd_map))]}
    for _ in range(steps):
        x, y = next(data)
        out["lr"].append((engine.optimizer.param_groups[0]["lr"], ds_engine.get_lr()[0]))
        out["pipekit"].append(engine.train_batch((x, y), reduce_loss=True))
        out["pipekit_norm"].append(engine.last_grad_norm)
        parts = iter([(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]) for m in range(gas)])
        out["deepspeed"].append(ds_engine.train_batch(parts).item())
        if ds["zero_optimization"]["stage"] == 0 and ds.get("gradient_clipping"):
            norm, here = clipped[-1]
            out["deepspeed_norm"].append(norm)
            out["first_stage_norm"].append(here)
        else:
            out["deepspeed_norm"].append(ds_engine.get_global_grad_norm())
    return out


def _worst(out: dict) -> tuple[float, float]:
    """The worst loss difference and the worst relative difference of the clipping norms (0 when
    DeepSpeed computed none: without clipping, ZeRO-0 keeps no norm). The learning rates must be equal."""
    assert all(abs(a - b) <= 1e-12 for a, b in out["lr"]), out["lr"]
    losses = max(abs(a - b) for a, b in zip(out["pipekit"], out["deepspeed"]))
    norms = max((abs(a - float(b)) / float(b) for a, b in zip(out["pipekit_norm"], out["deepspeed_norm"])
                 if b is not None), default=0.0)
    return losses, norms


def _say(what: str, out: dict, began: float) -> None:
    losses, norms = _worst(out)
    diffs = [abs(a - b) for a, b in zip(out["pipekit"], out["deepspeed"])]
    print(f"{what}: {len(diffs)} steps, worst loss difference {losses:.2e} (at step {diffs.index(losses) + 1}; "
          f"steps 2-10: {max(diffs[1:10], default=0):.2e}, 11-{len(diffs)}: {max(diffs[10:], default=0):.2e}), "
          f"worst relative clipping-norm difference {norms:.2e}, lr "
          f"{out['lr'][0][0]:.2e} .. {out['lr'][-1][0]:.2e}, {time.perf_counter() - began:.1f} s")


@needs_deepspeed
@pytest.mark.parametrize("dp, stage", [(1, 1), (2, 2)])
def test_data_parallel_trains_as_deepspeeds_engine_at_zero_stage(dp, stage):
    """ZeRO-1 in one process; ZeRO-2 over two replicas (DeepSpeed's batch rule with dp = 2: the same
    train_batch_size, half the accumulation steps)."""
    ds = {**DS_CONFIG, "zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 4 // dp}
    began = time.perf_counter()
    per_rank = run_distributed(_data_parallel, dp, ds, timeout=300)
    for rank, out in enumerate(per_rank):
        _say(f"pp=1 dp={dp} zero {stage} rank {rank}", out, began)
        losses, norms = _worst(out)
        assert len(out["pipekit"]) == STEPS and out["pipekit"][-1] < out["pipekit"][0]  # it trained
        assert sum(n > DS_CONFIG["gradient_clipping"] for n in out["pipekit_norm"]) > STEPS // 2  # clipping acted
        assert losses < TOLERANCE and norms < NORM_TOLERANCE, out


WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                                    "warmup_num_steps": 10, "total_num_steps": 60}}


@needs_deepspeed
@pytest.mark.parametrize("stage, clip, scheduler", [(0, 0.0, None), (1, 0.5, WARMUP_DECAY)])
def test_two_stages_train_as_deepspeeds_pipeline_engine_over_microbatches(stage, clip, scheduler):
    """ZeRO-0 without clipping (see the next test for why); ZeRO-1 with clipping and an LR schedule."""
    ds = {**DS_CONFIG, "zero_optimization": {"stage": stage}, "gradient_clipping": clip}
    if scheduler is not None:
        ds["scheduler"] = scheduler
    began = time.perf_counter()
    per_rank = run_distributed(_pipeline, 2, ds, timeout=300)
    for rank, out in enumerate(per_rank):
        _say(f"pp=2 zero {stage} rank {rank}", out, began)
        losses, norms = _worst(out)
        pipekit_layers, deepspeed_layers = out["layers"]
        assert pipekit_layers == deepspeed_layers, out["layers"]  # the same layers on each stage
        assert losses < TOLERANCE and norms < NORM_TOLERANCE, out
    assert per_rank[0]["pipekit"][-1] < per_rank[0]["pipekit"][0]
    assert not clip or sum(n > clip for n in per_rank[0]["pipekit_norm"]) > STEPS // 2  # clipping acted


@needs_deepspeed
def test_deepspeeds_pipeline_engine_without_zero_clips_by_the_first_stages_norm_only():
    """A DeepSpeed behaviour pipekit does not copy: at pp > 1 in fp32 without ZeRO, DeepSpeed's
    `clip_grad_norm_` counts only the gradients of pipeline rank 0 (`mpu.get_model_parallel_rank() == 0`;
    a pipeline module's parameters carry no `model_parallel` mark), so it clips every stage by the
    first stage's norm. pipekit clips by the whole model's norm, as DeepSpeed does at pp=1 and with
    ZeRO-1 at pp=2 (above): the same ds_config with gradient_clipping trains differently there."""
    per_rank = run_distributed(_pipeline, 2, {**DS_CONFIG, "zero_optimization": {"stage": 0}}, 1, timeout=300)
    (norm,), (first_stage,) = per_rank[0]["deepspeed_norm"], per_rank[0]["first_stage_norm"]
    assert abs(norm - first_stage) < NORM_TOLERANCE * norm
    assert per_rank[1]["deepspeed_norm"] == [norm]  # rank 1 clips by rank 0's norm too
    assert per_rank[0]["pipekit_norm"][0] > 1.2 * norm  # the whole model's norm, as at pp=1


# ---- the two ds_configs of configs/deepspeed/ ---------------------------------------------------
# Read by from_deepspeed only, not yet trained against DeepSpeed: its optimizer offload steps through
# its cpu_adam op (not built with DS_BUILD_OPS=0; a JIT build of minutes), and its fp16 and ZeRO-3
# offload are GPU paths. pipekit's own offload, loss scaling and schedulers are tested in
# tests/test_offload.py and tests/test_lr_schedules.py.
CONFIGS = ROOT / "configs" / "deepspeed"


def _keys(ds: dict, prefix: str = "") -> list[str]:
    """Every key of a ds_config, dotted (`zero_optimization.overlap_comm`)."""
    return [k for key, value in ds.items() for k in
            [f"{prefix}{key}", *(_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [])]]


def _check_notes(ds: dict, notes: list[str]) -> None:
    """Each key of `ds` without effect in pipekit said once, each note one line."""
    assert all("\n" not in note for note in notes), notes
    for key in _keys(ds):
        if key in NOTED:
            assert sum(note.startswith(f"ds_config {key} ") for note in notes) == 1, (key, notes)


def test_the_zero2_offload_fp16_config_maps_with_one_note_per_key_without_effect():
    """A DeepSpeed tutorial's ZeRO-2 config: optimizer offload to pinned host memory, dynamic fp16
    loss scaling, WarmupLR, accumulation and clipping. pin_memory is carried (it acts on CUDA only)."""
    ds = json.loads((CONFIGS / "zero2_offload_fp16.json").read_text())
    overrides, notes = from_deepspeed(str(CONFIGS / "zero2_offload_fp16.json"), dp=2)
    assert {"train.micro_batch=8", "schedule.microbatches=4", "train.global_batch=64", "optimizer.zero_stage=2",
            "optimizer.offload=cpu", "optimizer.pin_memory=True", "train.precision=fp16", "fp16.loss_scale=0",
            "fp16.loss_scale_window=1000", "fp16.initial_scale_power=16", "fp16.hysteresis=2", "fp16.min_loss_scale=1",
            "optimizer.clip_grad_norm=1.0", "optimizer.beta2=0.95", "optimizer.weight_decay=0.1"} <= set(overrides)
    assert any(o.startswith("optimizer.scheduler={") and "WarmupLR" in o for o in overrides), overrides
    _check_notes(ds, notes)
    run = load_run(None, [*PIPEKIT, "parallel.dp=2", *overrides])  # pipekit's config takes every override
    assert run.config.optimizer.offload == "cpu" and run.config.train.precision == "fp16"


def test_the_hf_trainers_zero3_bf16_config_maps():
    """The Hugging Face Trainer's ZeRO-3 config: parameters and optimizer offloaded, bf16, WarmupCosineLR,
    "auto" wherever the Trainer fills a value in from its own arguments (pipekit: from its config).
    offload_param (the parameter shards themselves in host memory) is optimizer.offload_params=cpu;
    "auto" keys keep the config's values (listed in one note), the scheduler's "auto" steps are the
    run's."""
    from pipekit.config import merged_config

    ds = json.loads((CONFIGS / "zero3_bf16.json").read_text())
    base = merged_config(None, [*PIPEKIT, "parallel.dp=2", "train.steps=7", "optimizer.warmup_steps=3"])
    overrides, notes = from_deepspeed(ds, dp=2, base=base)
    assert {"optimizer.zero_stage=3", "optimizer.offload=cpu", "optimizer.offload_params=cpu",
            "optimizer.pin_memory=True"} <= set(overrides)
    assert not any(o.split("=")[0] in ("optimizer.lr", "optimizer.beta1", "optimizer.clip_grad_norm",
                                       "train.micro_batch", "train.precision") for o in overrides), overrides
    scheduler = json.loads(next(o for o in overrides if o.startswith("optimizer.scheduler={")).split("=", 1)[1])
    assert scheduler["params"]["total_num_steps"] == 7 and scheduler["params"]["warmup_num_steps"] == 3
    _check_notes(ds, notes)
    auto = [n for n in notes if "set to \"auto\"" in n]
    assert len(auto) == 1 and "gradient_clipping" in auto[0] and "bf16.enabled" in auto[0], notes
    run = load_run(None, [*PIPEKIT, "parallel.dp=2", "train.precision=bf16", *overrides])
    assert run.config.optimizer.zero_stage == 3 and run.config.train.precision == "bf16"
    assert run.config.optimizer.offload_params == "cpu"


def test_the_two_configs_train_with_pipekit_train(tmp_path):
    """Both files through `pipekit train --deepspeed` (dp=2 on this CPU: 2 gloo workers), 2 steps
    each: ZeRO-2, cpu offload, fp16 loss scaling, WarmupLR; and ZeRO-3 with the parameters and
    the optimizer offloaded, bf16 from the config, WarmupCosineLR with "auto" steps."""
    from pipekit.cli import main

    common = [*PIPEKIT, "parallel.dp=2", "train.steps=2", "data.val_every=0", "logging.progress=false",
              "logging.tensorboard=false", "data.source=synthetic", "checkpoint.every=0", "checkpoint.at_end=false"]
    zero2 = ["train.micro_batch=2", "train.global_batch=null"]
    for name, path, more in (("zero2", CONFIGS / "zero2_offload_fp16.json", zero2),
                             ("zero3", CONFIGS / "zero3_bf16.json", ["train.precision=bf16", "train.micro_batch=2",
                                                                 "schedule.microbatches=2"])):
        out = tmp_path / name
        code = main(["train", *common, f"logging.out_dir={out}", "--deepspeed", str(path), *more])
        assert code == 0, name
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if r.get("kind", "step") == "step" and "loss" in r]
        assert len(steps) == 2 and all(r["loss"] == r["loss"] for r in steps), (name, records[-3:])


def test_auto_optimizer_params_are_left_to_pipekits_config():
    """As the HF Trainer fills "auto" from its arguments, pipekit keeps its own config's value."""
    overrides, _ = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                                             "eps": 1e-6, "weight_decay": "auto"}}}, 1)
    assert "optimizer.eps=1e-06" in overrides and "optimizer.name=adamw" in overrides
    assert not any(o.split("=")[0] in ("optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.weight_decay")
                   for o in overrides), overrides
    with pytest.raises(ConfigError, match=r"betas=\[0.9\] must be two numbers"):
        from_deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, 1)
