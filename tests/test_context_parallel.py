"""Context parallelism (`Topology(cp=)`, config `parallel.cp`) equals one process.

On 4 gloo ranks, float64, 3 AdamW steps with weight decay and clipping that acts, each
rank's loss, clipping norm and every weight it holds against one process on the whole
batch within 1e-10. Each cp rank holds chunks i and 2cp-1-i of every sequence
(`pipekit.layers.context`); attention crosses the cp ranks by ring or Ulysses. Layouts:
GPT-2 (learned positions at the chunks' real positions) and Llama (grouped-query heads,
rotary at the real positions) at cp=2 (x dp=2) and cp=4, ring and Ulysses; cp=2 x pp=2
with 1F1B, ZBV, GPipe, ZB-H1 (Ulysses), interleaved 1F1B and DualPipe-V (both with
activation checkpointing: the ring runs again in the recompute); cp=2 x tp=2 with
sequence parallelism; cp=2 x dp=2 with ZeRO-3; Mixtral experts at cp=2 x dp=2 x ep=2;
packed documents (positions and boundaries from the data) at cp=2; a seq_len that is not
a power of two (12 at cp=2, 24 at cp=4).
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer
from pipekit.schedules import build_schedule
from pipekit.testing import Reference, in_float64, run_distributed

TOL = 1e-10
SEED, BATCH, STEPS, CLIP = 5, 4, 3, 0.3
MODELS = {
    "gpt2": dict(vocab_size=40, max_seq_len=32, n_layers=2, dim=16, n_heads=4),
    "llama": dict(vocab_size=40, max_seq_len=32, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=24),
    "mixtral": dict(vocab_size=40, max_seq_len=32, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=8,
                    n_experts=4, top_k=2, global_balance=True),
    # the Hugging Face variants at once: Llama 3.1's scaled rope, q/k/v biases, q/k head norms, wide heads
    "llama+": dict(vocab_size=40, max_seq_len=32, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=24,
                   head_dim=8, qkv_bias=True, qk_norm=True,
                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                                 "original_max_position_embeddings": 8}),
}
# (family, seq_len, pp, dp, tp, cp, mode, schedule, microbatches, zero stage, more Topology arguments)
CASES = [
    ("gpt2", 12, 1, 2, 1, 2, "ring", "1f1b", 2, 1, {}),
    ("llama", 16, 1, 2, 1, 2, "ring", "1f1b", 2, 0, {}),
    ("llama", 24, 1, 1, 1, 4, "ring", "1f1b", 1, 1, {}),
    ("gpt2", 16, 1, 1, 1, 4, "ulysses", "1f1b", 2, 0, {}),
    ("llama", 12, 1, 2, 1, 2, "ulysses", "1f1b", 2, 1, {}),
    ("llama", 16, 2, 1, 1, 2, "ring", "1f1b", 2, 1, {}),
    ("gpt2", 16, 2, 1, 1, 2, "ulysses", "zbv", 4, 0, {}),
    ("llama", 16, 1, 1, 2, 2, "ring", "gpipe", 2, 1, {"sequence_parallel": True}),
    ("gpt2", 16, 1, 2, 1, 2, "ring", "1f1b", 2, 3, {}),
    ("mixtral", 16, 1, 2, 1, 2, "ring", "1f1b", 2, 1, {"ep": 2}),
    ("gpt2", 16, 2, 1, 1, 2, "ring", "gpipe", 2, 0, {}),
    ("llama", 16, 2, 1, 1, 2, "ring", "interleaved_1f1b", 4, 1, {"activation_checkpoint_interval": 1}),
    ("llama", 16, 2, 1, 1, 2, "ulysses", "zb_h1", 2, 0, {}),
    ("gpt2", 16, 2, 1, 1, 2, "ring", "dualpipe_v", 4, 1, {"activation_checkpoint_interval": 1}),
    ("llama+", 16, 1, 1, 2, 2, "ring", "1f1b", 2, 1, {"sequence_parallel": True}),
    ("llama+", 12, 1, 2, 1, 2, "ulysses", "1f1b", 2, 0, {}),
]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _build(family, pp, dp, tp, cp, mode, schedule, microbatches, stage, more):
    cfg = get_model(family.rstrip("+"), "tiny", **MODELS[family])
    specs = model_specs(cfg)
    more = dict(more)
    module_kw = {k: more.pop(k) for k in ("activation_checkpoint_interval",) if k in more}
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, cp=cp, cp_mode=mode, **more)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    schedule=build_schedule(schedule, pp, microbatches), **module_kw)
    zero = ZeroOptimizer(module, "adamw", stage=stage, lr=1e-2, weight_decay=0.1, clip_grad_norm=CLIP)
    return cfg, specs, topo, module, pipekit.PipelineEngine(module, optimizer=zero)


@in_float64
def run_case(family, seq, pp, dp, tp, cp, mode, schedule, microbatches, stage, more) -> dict:
    cfg, specs, topo, module, engine = _build(family, pp, dp, tp, cp, mode, schedule, microbatches, stage, more)
    ref = Reference(specs, model_loss(cfg).build(), adamw, seed=SEED, clip=CLIP)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        ids = torch.randint(0, 40, (BATCH, seq + 1), generator=gen)
        ref.train_beside(engine, (ids[:, :-1], ids[:, 1:]))
    ref.compare(module, topo, grads=False)
    return {"worst": ref.worst, "where": ref.where, "norm": ref.grad_norm}


def _packed_rows(seq: int, gen: torch.Generator) -> tuple:
    """Rows of a few whole documents each (boundaries off the chunk edges), padding at the end
    (labels -100): ((ids, positions), labels)."""
    ids = torch.randint(0, 40, (BATCH, seq), generator=gen)
    positions = torch.zeros(BATCH, seq, dtype=torch.long)
    labels = torch.randint(0, 40, (BATCH, seq), generator=gen)
    for b in range(BATCH):
        cuts = sorted(torch.randperm(seq - 2, generator=gen)[:2].add(1).tolist())
        start = 0
        for end in [*cuts, seq - 1]:
            positions[b, start:end] = torch.arange(end - start)
            start = end
        positions[b, seq - 1:] = torch.arange(1)
        labels[b, seq - 1:] = -100
    return (ids, positions), labels


@in_float64
def packed(family: str) -> dict:
    seq = 16
    cfg, specs, topo, module, engine = _build(family, 1, 2, 1, 2, "ring", "1f1b", 2, 1, {})
    ref = Reference(specs, model_loss(cfg).build(), adamw, seed=SEED, clip=CLIP)
    gen = torch.Generator().manual_seed(9)
    for _ in range(STEPS):
        (ids, positions), labels = _packed_rows(seq, gen)
        rows = slice(topo.data_rank * BATCH // 2, (topo.data_rank + 1) * BATCH // 2)
        loss = engine.train_batch(iter([((ids[rows], positions[rows]), labels[rows])]), reduce_loss=True)
        ref.record("loss", abs(loss - ref.step(((ids, positions), labels))))
        ref.record("grad_norm", abs(engine.last_grad_norm - ref.grad_norm))
    ref.compare(module, topo, grads=False)
    return {"worst": ref.worst, "where": ref.where}


def check() -> tuple:
    return [run_case(*case) for case in CASES], {f: packed(f) for f in ("gpt2", "llama")}


@pytest.fixture(scope="module")
def results():
    return run_distributed(check, 4, timeout=500)


def test_every_context_parallel_layout_equals_one_process(results):
    for rank, (cases, _) in enumerate(results):
        for case, r in zip(CASES, cases):
            where = f"rank {rank}, (family, seq, pp, dp, tp, cp, mode, schedule, M, ZeRO, more)={case}"
            assert r["norm"] > CLIP, f"{where}: the clipping never acted"
            for what, diff in r["worst"].items():
                assert diff <= TOL, f"{where}: {what} differs by {diff:.3g} (at {r['where'][what]})"


def test_packed_documents_at_cp2_equal_one_process(results):
    for rank, (_, packs) in enumerate(results):
        for family, r in packs.items():
            for what, diff in r["worst"].items():
                assert diff <= TOL, f"rank {rank}, {family}: {what} differs by {diff:.3g} (at {r['where'][what]})"


def _losses(out) -> list[float]:
    import json

    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r["loss"] for r in records if "loss" in r and r.get("kind", "step") == "step"]


def test_pipekit_train_at_cp2_follows_the_cp1_curve(tmp_path):
    """`pipekit train configs/llama_tiny.yaml parallel.cp=2` (2 workers, ring) and ulysses give the
    losses of the same run at cp=1 (float32: within 1e-5)."""
    from pathlib import Path

    from pipekit.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs/llama_tiny.yaml")
    common = ["parallel.pp=1", "train.steps=3", "train.seq_len=32", "train.micro_batch=2", "schedule.microbatches=2",
              "data.val_every=0", "logging.progress=false", "logging.tensorboard=false", "logging.log_every=1",
              "checkpoint.at_end=false"]
    curves = {}
    for name, more in {"cp1": [], "ring": ["parallel.cp=2"], "ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"]
                       }.items():
        assert main(["train", config, *common, *more, f"logging.out_dir={tmp_path / name}"]) == 0, name
        curves[name] = _losses(tmp_path / name)
    assert len(curves["cp1"]) == 3
    for name in ("ring", "ulysses"):
        assert max(abs(a - b) for a, b in zip(curves[name], curves["cp1"])) < 1e-5, curves


@pytest.mark.parametrize("overrides, said", [
    (["train.seq_len=30", "parallel.cp=2"], "train.seq_len=30 is not divisible by 2 * parallel.cp = 4"),
    (["parallel.cp=8", "parallel.cp_mode=ulysses", "train.seq_len=32"],
     "parallel.cp_mode=ulysses splits the 4 attention heads of each tp rank"),
    (["parallel.cp=2", "parallel.cp_mode=stripes"], "parallel.cp_mode"),
    (["parallel.cp=0"], "parallel.cp"),
    (["parallel.cp=2", "model.sliding_window=16"], "model.sliding_window=16: sliding-window attention is not"),
])
def test_bad_context_parallel_settings_are_refused_before_launch(overrides, said, capsys):
    from pathlib import Path

    from pipekit.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs/llama_tiny.yaml")
    assert main(["train", config, "parallel.pp=1", *overrides, "--show"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


def test_a_sliding_window_layer_refuses_context_parallelism():
    from pipekit.layers import CausalSelfAttention
    from pipekit.layers.parallel import context_parallel
    from pipekit.testing import FakeGroup

    with context_parallel(FakeGroup(2), "ring"), pytest.raises(ValueError, match="not implemented under context"):
        CausalSelfAttention(16, 4, 2, rope_theta=1e4, sliding_window=4)


def test_a_family_without_attention_refuses_cp(capsys):
    from pathlib import Path

    from pipekit.cli import main

    toy = str(Path(__file__).resolve().parents[1] / "configs/toy.yaml")
    assert main(["train", toy, "parallel.pp=1", "parallel.cp=2", "--show"]) == 2
    assert "model.family=toy does not support" in capsys.readouterr().err
