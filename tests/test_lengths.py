"""Lengths that change: a sequence-length warm-up, and microbatches of different lengths in one step.

Sequence-length warm-up (`train.seq_len_start`, pipekit/run/curriculum.py): DeepSpeed's
seqlen curriculum, the same curve at every layout and after a resume.

The length of every step equals DeepSpeed's `CurriculumScheduler` (fixed_linear and
fixed_root) asked for the step DeepSpeed's engine asks for (its global step + 1). On 4
gloo ranks, float64, GPT-2, 6 steps warming up from 4 to 16 tokens: pp=2 x dp=2 (1F1B,
ZeRO-1) and cp=2 x dp=2 (ring) give the one-process losses within 1e-10 (every step's
shapes new), and a resume from the step-2 checkpoint, in the middle of the warm-up,
gives the uninterrupted run's losses bitwise.

Mixed lengths (`pipekit.Microbatches`): on the same 4 ranks, float64, GPT-2, 3 AdamW
steps with clipping, each step's 8 microbatches of their own lengths (4 to 16 tokens)
and rows (1 or 2), at pp=2 x dp=2 with each of the six schedules and at cp=2 x pp=2
(ring): the loss, the clipping norm and every weight within 1e-10 of one process
looping over the same 8 microbatches (gradient accumulation, each microbatch weighted
by its valid tokens). `data.trim_padding` (each packed microbatch cut after its last
label) at pp=2 x dp=2 gives the losses of one process that trims nothing, within 1e-10.
In this process: a non-token loss weighs microbatches by their rows, the stage shapes
of a length seen before are reused (not traced again), and the misuses are named.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import pipekit
from pipekit.config import ConfigError, load_config, load_run
from pipekit.data import BatchSampler, TokenDataset, prepare_data
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer
from pipekit.run.curriculum import seq_len_at, trimmed, truncated
from pipekit.run.loop import train
from pipekit.schedules import build_schedule
from pipekit.testing import Reference, in_float64, run_distributed

STEPS = 6
MODEL = ["model.family=gpt2", "model.n_layers=2", "model.dim=16", "model.n_heads=4", "model.vocab_size=40",
         "train.seq_len=16", "train.seq_len_start=4", "train.seq_len_warmup_steps=5", "train.seq_len_multiple=4",
         "train.dtype=float64", "data.source=synthetic", "data.val_every=0", "logging.progress=false",
         "logging.tensorboard=false", "logging.log_every=1", f"train.steps={STEPS}", "optimizer.warmup_steps=0",
         "optimizer.lr=1e-2", "checkpoint.every=2", "checkpoint.keep=3", "train.micro_batch=2",
         "schedule.microbatches=2"]
LAYOUTS = {"pp2_dp2": ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=1"],
           "cp2_dp2": ["parallel.pp=1", "parallel.dp=2", "parallel.cp=2"],
           "one": ["parallel.pp=1", "parallel.dp=1", "train.micro_batch=4"]}


def losses(out: str) -> dict[int, float]:
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "step" in r and "loss" in r}


def _run(layout: str, out: str, *extra: str) -> dict[int, float]:
    train(load_run(None, [*MODEL, *LAYOUTS[layout], f"logging.out_dir={out}", *extra]))
    return losses(out)


# ---- mixed lengths: the engine given pipekit.Microbatches ---------------------------------------
TOL, SEED, CLIP, M = 1e-10, 5, 0.3, 4
GPT2 = dict(vocab_size=40, max_seq_len=32, n_layers=2, dim=16, n_heads=4)
# (pp, dp, cp, schedule, chunks per rank)
MIXED = [(2, 2, 1, "gpipe", 1), (2, 2, 1, "1f1b", 1), (2, 2, 1, "interleaved_1f1b", 2), (2, 2, 1, "zb_h1", 1),
         (2, 2, 1, "zbv", 2), (2, 2, 1, "dualpipe_v", 2), (2, 1, 2, "1f1b", 1)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def mixed_steps(steps: int = 3) -> list[list[tuple]]:
    """Each step's 2*M microbatches (those of replica r: r*M .. r*M + M-1), of lengths 4..16 and
    1 or 2 rows, a few labels masked."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(2 * M):
            rows, length = int(torch.randint(1, 3, (), generator=gen)), 4 * int(torch.randint(1, 5, (), generator=gen))
            ids = torch.randint(0, 40, (rows, length + 1), generator=gen)
            labels = ids[:, 1:].masked_fill(torch.rand(rows, length, generator=gen) < 0.2, -100)
            micro.append((ids[:, :-1], labels))
        out.append(micro)
    return out


def reference_step(ref: Reference, micro: list[tuple]) -> float:
    """One process: gradient accumulation over every microbatch, each weighted by its valid tokens."""
    ref.optimizer.zero_grad()
    valid = sum(int((y != -100).sum()) for _, y in micro)
    total = 0.0
    for x, y in micro:
        loss = ref.loss_fn(ref.model(x), y) * (int((y != -100).sum()) / valid)
        loss.backward()
        total += loss.item()
    ref.grad_norm = torch.nn.utils.clip_grad_norm_(ref.parameters, CLIP).item()
    ref.optimizer.step()
    return total


@in_float64
def mixed_case(pp: int, dp: int, cp: int, schedule: str, chunks: int) -> dict:
    cfg = get_model("gpt2", "tiny", **GPT2)
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=pp, dp=dp, cp=cp)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    schedule=build_schedule(schedule, pp, M, chunks))
    engine = pipekit.PipelineEngine(module, optimizer=ZeroOptimizer(module, "adamw", lr=1e-2, weight_decay=0.1,
                                                                    clip_grad_norm=CLIP))
    ref = Reference(specs, model_loss(cfg).build(), adamw, seed=SEED, clip=CLIP)
    shapes = set()
    for micro in mixed_steps():
        everyone = micro if dp == 2 else micro[:M]
        mine = everyone[topo.data_rank * M:(topo.data_rank + 1) * M]
        shapes |= {tuple(x.shape) for x, _ in mine}
        loss = engine.train_batch(pipekit.Microbatches(mine), reduce_loss=True)
        ref.record("loss", abs(loss - reference_step(ref, everyone)))
        ref.record("grad_norm", abs(engine.last_grad_norm - ref.grad_norm))
    ref.compare(module, topo, grads=False)
    return {"worst": ref.worst, "where": ref.where, "traced": len(engine._io), "shapes": len(shapes)}


# ---- data.trim_padding: packed rows, each microbatch cut after its last label -------------------
TRIM = ["model.family=gpt2", "model.n_layers=2", "model.dim=16", "model.n_heads=4", "model.vocab_size=256",
        "model.max_seq_len=32", "train.seq_len=32", "train.seq_len_multiple=4", "train.dtype=float64",
        "data.pack=true", "data.val_every=0", "logging.progress=false", "logging.tensorboard=false",
        "logging.log_every=1", "train.steps=4", "optimizer.warmup_steps=0", "optimizer.lr=1e-2",
        "checkpoint.every=0", "checkpoint.at_end=false", "train.micro_batch=1", "schedule.microbatches=4"]


def _trim_run(data: str, out: str, *extra: str) -> dict[int, float]:
    train(load_run(None, [*TRIM, f"data.source={data}", f"logging.out_dir={out}", *extra]))
    return losses(out)


def prepared(tmp: str) -> str:
    """A prompt/response dataset whose documents (6 to 25 tokens) leave packed rows' tails empty."""
    rng = np.random.default_rng(2)
    lines = [{"prompt": "q" * int(rng.integers(1, 8)) + "?", "response": "r" * int(rng.integers(4, 18))}
             for _ in range(40)]
    src = os.path.join(tmp, "sft.jsonl")
    with open(src, "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    prepare_data([src], os.path.join(tmp, "data"), val_fraction=0.0)
    return os.path.join(tmp, "data")


def _group(tmp: str, data: str) -> dict:
    full = os.path.join(tmp, "pp")
    out = {"pp": _run("pp2_dp2", full), "cp": _run("cp2_dp2", os.path.join(tmp, "cp"))}
    out["resumed"] = _run("pp2_dp2", os.path.join(tmp, "again"), f"train.resume={full}/checkpoints/step_00000002",
                          f"checkpoint.dir={tmp}/again_ckpt")
    out["mixed"] = [mixed_case(*case) for case in MIXED]
    out["trimmed"] = _trim_run(data, os.path.join(tmp, "trim"), "parallel.pp=2", "parallel.dp=2",
                               "data.trim_padding=true")
    return out


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    return prepared(str(tmp_path_factory.mktemp("sft")))


@pytest.fixture(scope="module")
def results(tmp_path_factory, sft_data):
    tmp = str(tmp_path_factory.mktemp("warmup"))
    group = run_distributed(_group, 4, tmp, sft_data, timeout=500)[0]
    return group, _run("one", os.path.join(tmp, "one"))


def test_the_lengths_grow_as_configured():
    t = load_config(None, [*MODEL, "checkpoint.every=0"]).train
    assert [seq_len_at(t, s) for s in range(1, 8)] == [4, 8, 8, 12, 16, 16, 16]


def test_every_layout_warms_up_on_the_one_process_curve(results):
    group, one = results
    assert sorted(one) == list(range(1, STEPS + 1))
    for name in ("pp", "cp"):
        assert sorted(group[name]) == sorted(one)
        for step, loss in one.items():
            assert abs(group[name][step] - loss) <= 1e-10, (name, step, group[name][step], loss)


def test_a_resume_in_the_middle_of_the_warm_up_continues_the_curve_bitwise(results):
    group, _ = results
    assert sorted(group["resumed"]) == [3, 4, 5, 6]
    assert all(group["resumed"][s] == group["pp"][s] for s in (3, 4, 5, 6)), (group["resumed"], group["pp"])


def test_truncation_cuts_every_sequence_tensor():
    ids, pos, labels = torch.zeros(2, 9), torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9)
    (a, b), c = truncated(((ids, pos), labels), 4)
    assert a.shape == b.shape == c.shape == (2, 4)


@pytest.mark.parametrize("over, said", [
    (["train.seq_len_start=20"], "train.seq_len_start=20 must be in [1, train.seq_len=16]"),
    (["train.seq_len_warmup_steps=0"], "train.seq_len_warmup_steps=0 must be >= 1"),
    (["parallel.cp=4", "parallel.pp=1"], "train.seq_len_multiple=4 must be a multiple of 8"),
])
def test_bad_warm_up_settings_are_named(over, said):
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
        load_run(None, [*MODEL, "checkpoint.every=0", *over])


@pytest.mark.parametrize("schedule, more", [("fixed_linear", {}), ("fixed_root", {"root_degree": 2}),
                                            ("fixed_root", {"root_degree": 3})])
@pytest.mark.parametrize("low, high, total, step", [(8, 128, 50, 8), (10, 64, 17, 16), (64, 1024, 300, 64)])
def test_each_steps_length_is_deepspeeds(schedule, more, low, high, total, step):
    """DeepSpeed's engine asks its curriculum scheduler for global_steps + 1 before each forward:
    pipekit's step s (1-based) is that number."""
    ds = pytest.importorskip("deepspeed.runtime.data_pipeline.curriculum_scheduler")
    scheduler = ds.CurriculumScheduler({
        "curriculum_type": "seqlen", "min_difficulty": low, "max_difficulty": high, "schedule_type": schedule,
        "schedule_config": {"total_curriculum_step": total, "difficulty_step": step, **more}})
    t = load_config(None, [f"train.seq_len={high}", f"model.max_seq_len={high}", "checkpoint.every=0",
                           f"train.seq_len_start={low}",
                           f"train.seq_len_warmup_steps={total}", f"train.seq_len_multiple={step}",
                           f"train.seq_len_root={more.get('root_degree', 1)}"]).train
    for s in range(1, total + 20):
        assert seq_len_at(t, s) == scheduler.update_difficulty(s), s


def test_mixed_length_microbatches_equal_one_process_in_every_schedule(results):
    group, _ = results
    for case, r in zip(MIXED, group["mixed"]):
        for what, diff in r["worst"].items():
            assert diff <= TOL, f"(pp, dp, cp, schedule, chunks)={case}: {what} differs by {diff:.3g} at " \
                                f"{r['where'][what]}"
        assert r["traced"] == r["shapes"] > 1, f"{case}: {r['traced']} shapes traced for {r['shapes']} input shapes"


def test_trimmed_padding_trains_as_one_untrimmed_process(results, sft_data, tmp_path):
    group, _ = results
    lengths = set()
    for rank in (0, 1):  # the microbatches the pp=2 x dp=2 run trained on
        sampler = BatchSampler(TokenDataset(sft_data), 8, 32, dp_rank=rank, dp_size=2, seed=0, pack=True)
        for step in range(4):
            lengths |= {x[0].shape[1] for x, _ in trimmed(sampler.batch(step), 4, 4)}
    assert len(lengths) > 1 and max(lengths) <= 32 and min(lengths) < 32, lengths  # some cut, not all alike
    one = _trim_run(sft_data, str(tmp_path / "one"), "train.micro_batch=2")
    assert sorted(group["trimmed"]) == sorted(one) == [1, 2, 3, 4]
    for step, loss in one.items():
        assert abs(group["trimmed"][step] - loss) <= 1e-10, (step, group["trimmed"][step], loss)


def test_trimming_cuts_after_the_last_label_rounded_up():
    ids = torch.arange(24).reshape(2, 12)
    labels = torch.full((2, 12), -100)
    labels[0, :3] = 1  # microbatch 0 (row 0): last label at place 2 -> 3 -> 4
    labels[1, :9] = 1  # microbatch 1 (row 1): place 8 -> 9 -> 12
    micro = trimmed(((ids, ids), labels), 2, 4)
    assert isinstance(micro, pipekit.Microbatches)
    assert [(x[0].shape, y.shape) for x, y in micro] == [((1, 4), (1, 4)), ((1, 12), (1, 12))]
    assert trimmed((ids, torch.full((2, 12), -100)), 1, 4)[0][0].shape == (2, 4)  # no label: one multiple


def test_trim_padding_needs_packed_rows():
    with pytest.raises(ConfigError, match="data.trim_padding=true cuts the padding of packed rows"):
        load_run(None, [*MODEL, "checkpoint.every=0", "data.trim_padding=true"])


@pytest.fixture
def toy_engine(float64):
    """pp=1, 2 microbatches, a toy model of one linear layer and a non-token (MSE) loss."""
    specs = [pipekit.LayerSpec(torch.nn.Linear, 3, 2)]
    module = pipekit.PipelineModule(specs, loss_fn=torch.nn.functional.mse_loss, topology=pipekit.Topology(),
                                    seed=1, microbatches=2)
    return pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))


def test_a_non_token_loss_weighs_microbatches_by_their_rows(toy_engine):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, generator=gen), torch.randn(3, 2, generator=gen)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict({k.split(".")[-1]: v for k, v in toy_engine.module.state_dict().items()})
    want = torch.nn.functional.mse_loss(ref(x), y)  # the mean over all 3 rows, one process
    got = toy_engine.eval_batch(pipekit.Microbatches([(x[:1], y[:1]), (x[1:], y[1:])]))
    assert abs(float(got) - want.item()) <= 1e-12


def test_a_length_seen_before_is_not_traced_again(toy_engine, monkeypatch):
    traced = []
    real = toy_engine.module.stage_io_meta
    monkeypatch.setattr(toy_engine.module, "stage_io_meta", lambda x: traced.append(x.shape) or real(x))
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    for _ in range(3):
        toy_engine.train_batch(pipekit.Microbatches([(a, torch.zeros(2, 2)), (b, torch.zeros(1, 2))]))
    assert traced == [(2, 3), (1, 3)]


def test_microbatches_misuse_is_named(toy_engine):
    x, y = torch.randn(2, 3), torch.randn(2, 2)
    with pytest.raises(ValueError, match="Microbatches holds 3 microbatches, but the schedule runs 2"):
        toy_engine.train_batch(pipekit.Microbatches([(x, y)] * 3))
    with pytest.raises(ValueError, match=r"labels given for microbatches \[0\] but None for \[1\]"):
        toy_engine.train_batch(pipekit.Microbatches([(x, y), (x, None)]))
    with pytest.raises(TypeError, match="item 1 is Tensor"):
        toy_engine.train_batch(pipekit.Microbatches([(x, y), x]))
