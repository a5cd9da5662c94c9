"""Offload (`ZeroOptimizer(offload="cpu" | "nvme")`, pipekit.optim.offload) changes no bit.

On 4 gloo ranks, pp=2 x dp=2, float64 GPT-2 (embedding and head tied over the two
pipeline ranks), 3 AdamW steps with weight decay and clipping that acts: for ZeRO 1, 2
and 3, the losses and every weight with `cpu` and with `nvme` offload are bitwise those
without (small buckets, so nvme streams many of them through its bounded buffer); bf16
(fp32 host master weights) is bitwise too. nvme leaves at most three buckets in memory
at once and its state files hold the master weights and both Adam moments. A checkpoint
of an nvme-offloaded ZeRO-2 run at pp=2 x dp=2 resumes without offload at ZeRO-1 pp=1 x
dp=4, and a checkpoint without offload resumes with cpu offload at ZeRO-3: one more step
gives the saving side's loss and weights (1e-10). On this CPU-only machine `cpu` offload
holds the same memory as none; the copies and the host step are the GPU run's.
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer
from pipekit.testing import in_float64, run_distributed

SEED, BATCH, SEQ, STEPS, CLIP = 3, 8, 8, 3, 0.5
GPT2 = dict(vocab_size=40, max_seq_len=16, n_layers=3, dim=16, n_heads=4)
MIXTRAL = dict(vocab_size=40, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=24, n_experts=4,
               top_k=2)
BUCKET_MB = 0.004  # 512 float64 gradients: a dozen buckets per rank


def _engine(pp, dp, stage, offload="none", root=None, precision="fp32", bucket_mb=BUCKET_MB, tp=1, ep=1):
    cfg = get_model("mixtral", "tiny", **MIXTRAL) if ep > 1 else get_model("gpt2", "tiny", **GPT2)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, ep=ep)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo,
                                    seed=SEED, schedule="1f1b", microbatches=2, precision=precision)
    zero = ZeroOptimizer(module, "adamw", stage=stage, lr=1e-2, weight_decay=0.1, clip_grad_norm=CLIP,
                         bucket_mb=bucket_mb, offload=offload, offload_dir=root)
    return pipekit.PipelineEngine(module, optimizer=zero)


def _train(engine, ids: torch.Tensor) -> float:
    topo = engine.module.topology
    rows = slice(topo.dp_rank * BATCH // topo.dp, (topo.dp_rank + 1) * BATCH // topo.dp)
    return engine.train_batch(iter([(ids[rows, :-1], ids[rows, 1:])]), reduce_loss=True)


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (BATCH, SEQ + 1), generator=gen) for _ in range(n)]


def _run(stage, offload, root, precision="fp32", pp=2, dp=2, **more) -> dict:
    engine = _engine(pp, dp, stage, offload, root, precision, **more)
    losses = [_train(engine, ids) for ids in _batches(STEPS, 4)]
    zero = engine.optimizer
    out = {"losses": losses, "weights": {n: t.clone() for n, t in full_state_dict(engine.module).items()},
           "norm": zero.last_grad_norm, "buckets": len(zero.buckets), "memory": zero.memory_bytes()}
    if offload == "nvme":
        out["peak_resident"] = zero.offload.peak_resident
        out["resident_after"] = len(zero.offload.resident_now)
        out["state_bytes"] = sum(b.master.numel() * b.master.element_size() * 3 for b in zero.buckets)
    return out


@in_float64
def bitwise(root: str) -> dict:
    out = {}
    for stage in (1, 2, 3):
        out[stage] = {kind: _run(stage, kind, f"{root}/s{stage}") for kind in ("none", "cpu", "nvme")}
    out["tp=2 x dp=2, ZeRO-2"] = {kind: _run(2, kind, f"{root}/tp", pp=1, tp=2) for kind in ("none", "nvme")}
    out["dp=4 x ep=2 experts, ZeRO-1"] = {kind: _run(1, kind, f"{root}/ep", pp=1, dp=4, ep=2)
                                          for kind in ("none", "nvme")}
    return out


def bf16(root: str) -> dict:
    torch.set_default_dtype(torch.float32)
    return {kind: _run(1, kind, f"{root}/bf16", precision="bf16") for kind in ("none", "nvme")}


@in_float64
def resumes(root: str) -> dict:
    batches = _batches(3, 8)
    out = {}
    plans = {"nvme z2 pp2 -> none z1 pp1": ((2, 2, 2, "nvme"), (1, 4, 1, "none")),
             "none z1 pp1 -> cpu z3 pp2": ((1, 4, 1, "none"), (2, 2, 3, "cpu"))}
    for name, (a, b) in plans.items():
        saving = _engine(*a, root=f"{root}/state")
        for ids in batches[:2]:
            _train(saving, ids)
        path = f"{root}/{name.split()[0]}-{a[2]}"
        save_checkpoint(path, saving.module, saving.optimizer)
        resumed = _engine(*b, root=f"{root}/state")
        load_checkpoint(path, resumed.module, resumed.optimizer)
        losses = (_train(saving, batches[2]), _train(resumed, batches[2]))
        after, other = full_state_dict(saving.module), full_state_dict(resumed.module)
        out[name] = {"loss": abs(losses[0] - losses[1]),
                     "weights": max((t - other[n]).abs().max().item() for n, t in after.items())}
    return out


def check(root: str) -> tuple:
    return bitwise(root), bf16(root), resumes(root)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(check, 4, str(tmp_path_factory.mktemp("offload")), timeout=400)


def test_offload_is_bitwise_no_offload_at_zero_1_2_3(results):
    for rank, (by_stage, _, _) in enumerate(results):
        for stage, runs in by_stage.items():
            base = runs["none"]
            assert base["norm"] is not None and base["norm"] > CLIP, f"{stage}: the clipping never acted"
            for kind in ("cpu", "nvme"):
                if kind not in runs:
                    continue
                where = f"rank {rank}, ZeRO-{stage}, offload={kind}"
                assert runs[kind]["losses"] == base["losses"], f"{where}: losses {runs[kind]['losses']} != " \
                                                                f"{base['losses']}"
                for name, t in base["weights"].items():
                    assert torch.equal(runs[kind]["weights"][name], t), f"{where}: {name} differs"
                assert runs[kind]["memory"]["master"] == runs[kind]["memory"]["optimizer_state"] == 0


def test_nvme_keeps_a_few_buckets_in_memory_and_the_state_on_disk(results):
    for rank, (by_stage, _, _) in enumerate(results):
        for stage, runs in by_stage.items():
            nvme = runs["nvme"]
            where = f"rank {rank}, ZeRO-{stage}"
            if not isinstance(stage, int):
                continue  # the tp and ep cases: bitwise only
            assert nvme["buckets"] >= 6, f"{where}: only {nvme['buckets']} buckets: nothing streams"
            assert nvme["peak_resident"] <= 3, f"{where}: {nvme['peak_resident']} buckets in memory at once"
            assert nvme["resident_after"] == 0, f"{where}: buckets left in memory between steps"
            assert nvme["memory"]["disk"] >= nvme["state_bytes"], f"{where}: {nvme['memory']}"
            assert nvme["memory"]["host"] < nvme["state_bytes"] / 10, f"{where}: {nvme['memory']}"


def test_offload_in_bf16_is_bitwise(results):
    for rank, (_, runs, _) in enumerate(results):
        assert runs["nvme"]["losses"] == runs["none"]["losses"], f"rank {rank}"
        for name, t in runs["none"]["weights"].items():
            assert torch.equal(runs["nvme"]["weights"][name], t), f"rank {rank}: {name}"


def test_offloaded_checkpoints_resume_without_offload_at_another_layout_and_back(results):
    for rank, (_, _, resumed) in enumerate(results):
        for name, r in resumed.items():
            assert r["loss"] <= 1e-10 and r["weights"] <= 1e-10, f"rank {rank}, {name}: {r}"


def test_offload_values_are_checked():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="offload='disk' is not one of"):
        ZeroOptimizer(module, offload="disk")
    with pytest.raises(ValueError, match="give offload_dir"):
        ZeroOptimizer(module, offload="nvme")
    with pytest.raises(ValueError, match="fused=True is the device kernel"):
        ZeroOptimizer(module, offload="cpu", fused=True)


def test_one_process_offload_steps_as_torch_adamw(tmp_path):
    """Stage 0, one process: offloaded nvme equals torch.optim.AdamW on the same module, and its
    state_dict round-trips."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3).double(), torch.nn.Linear(5, 3).double()
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(a.parameters(), lr=0.1)
    zero = ZeroOptimizer(b, "adamw", lr=0.1, offload="nvme", offload_dir=str(tmp_path), bucket_mb=1e-4)
    for _ in range(3):
        x = torch.randn(4, 5, dtype=torch.float64)
        for m, opt in ((a, ref), (b, zero)):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    state = zero.state_dict()
    again = ZeroOptimizer(torch.nn.Linear(5, 3).double(), "adamw", lr=0.1, offload="nvme",
                          offload_dir=str(tmp_path), bucket_mb=1e-4)
    again.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(state["masters"], again.state_dict()["masters"]))


def test_pipekit_train_with_a_ds_config_offloading_to_nvme_gives_the_weights_of_no_offload(tmp_path, capsys):
    """`pipekit train --deepspeed ds.json` with offload_optimizer nvme: the state files are made
    under nvme_path, the keys without effect are noted, and the trained weights are bitwise
    those of the same run without offload."""
    import json
    from pathlib import Path

    from pipekit.cli import main

    toy = str(Path(__file__).resolve().parents[1] / "configs/toy.yaml")
    base = ["train.steps=3", "data.val_every=0", "logging.progress=false", "logging.tensorboard=false",
            "parallel.pp=1", "optimizer.bucket_mb=0.001"]
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
          "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nv"),
                                                                  "buffer_count": 4, "pin_memory": True}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert main(["train", toy, *base, f"logging.out_dir={tmp_path / 'off'}", "--deepspeed",
                 str(tmp_path / "ds.json")]) == 0
    assert "offload_optimizer.buffer_count has no effect in pipekit" in capsys.readouterr().err
    assert (tmp_path / "nv").is_dir()
    ds["zero_optimization"].pop("offload_optimizer")
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert main(["train", toy, *base, f"logging.out_dir={tmp_path / 'none'}", "--deepspeed",
                 str(tmp_path / "ds.json")]) == 0
    off, none = (torch.load(tmp_path / d / "model.pt")["state_dict"] for d in ("off", "none"))
    assert sorted(off) == sorted(none) and all(torch.equal(off[k], none[k]) for k in none)
