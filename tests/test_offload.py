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
holds the same memory as none; the copies and the host step are the GPU run's. On 2 ranks
(pp=2), every other named schedule with nvme and the early step is bitwise no offload.

Parameter offload (`offload_params="cpu"`, ZeRO-3: FSDP2's CPUOffloadPolicy) in the same
group: pp=2 x dp=2 float64 (with no optimizer offload, which steps as cpu, and with nvme) and
bf16 give bitwise the losses and weights of ZeRO-3 without it, no parameter byte on the
device; a checkpoint saved with it resumes without it at ZeRO-1 pp=1 x dp=4, and one saved
without it resumes with it (and optimizer offload cpu). While those runs train and save, every
tensor handed to a torch.distributed collective is checked (`HostSpy`): none is a host-held
tensor of parameter offload (on a GPU, host memory that NCCL cannot take), and each is on the
topology's device. The moving helper (`gather_rows`) and the step's device are unit-tested
with a fake collective and a fake topology on the meta device.
"""

from __future__ import annotations

import types
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipekit
from pipekit.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from pipekit.config import ConfigError, load_config, load_run
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import LossScaler, ZeroOptimizer
from pipekit.optim.fsdp import gather_rows, host_shard
from pipekit.testing import in_float64, run_distributed

ROOT = Path(__file__).resolve().parents[1]

SEED, BATCH, SEQ, STEPS, CLIP = 3, 8, 8, 3, 0.5
GPT2 = dict(vocab_size=40, max_seq_len=16, n_layers=3, dim=16, n_heads=4)
MIXTRAL = dict(vocab_size=40, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=24, n_experts=4,
               top_k=2)
BUCKET_MB = 0.004  # 512 float64 gradients: a dozen buckets per rank


def _engine(pp, dp, stage, offload="none", root=None, precision="fp32", bucket_mb=BUCKET_MB, tp=1, ep=1,
            params="none", overlap=False, clip=CLIP, scale_power=None, schedule="1f1b", microbatches=2):
    cfg = get_model("mixtral", "tiny", **MIXTRAL) if ep > 1 else get_model("gpt2", "tiny", **GPT2)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, ep=ep)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo,
                                    seed=SEED, schedule=schedule, microbatches=microbatches, precision=precision)
    scaler = LossScaler(initial_scale_power=scale_power, hysteresis=1) if scale_power is not None else None
    zero = ZeroOptimizer(module, "adamw", stage=stage, lr=1e-2, weight_decay=0.1, clip_grad_norm=clip,
                         bucket_mb=bucket_mb, offload=offload, offload_dir=root, offload_params=params,
                         offload_overlap=overlap, loss_scaler=scaler)
    return pipekit.PipelineEngine(module, optimizer=zero)


def _train(engine, ids: torch.Tensor) -> float:
    topo = engine.module.topology
    rows = slice(topo.dp_rank * BATCH // topo.dp, (topo.dp_rank + 1) * BATCH // topo.dp)
    return engine.train_batch(iter([(ids[rows, :-1], ids[rows, 1:])]), reduce_loss=True)


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (BATCH, SEQ + 1), generator=gen) for _ in range(n)]


class HostSpy:
    """While on (`with`), every tensor handed to a torch.distributed collective is checked: that
    it is none of parameter offload's host-held tensors (the shards, their gradients, their master
    weights, the offload's host gradient buffers: host memory on a GPU run, which NCCL cannot
    take) and that it is on the topology's device. `bad`: what failed; `seen`: tensors checked,
    by collective."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "all_to_all_single", "send", "recv", "isend", "irecv")

    def __init__(self, zero: ZeroOptimizer):
        self.zero, self.bad, self.saved = zero, [], {}
        self.seen: dict[str, int] = {}

    def host(self) -> set[int]:
        zero, out = self.zero, set()
        held = [t for b in zero.buckets if b.host for t in (b.param_buf, b.master)]
        held += [g for g in (zero.offload.host_grads if zero.offload is not None else []) if g is not None]
        for p in zero.module.parameters():
            if host_shard(p):
                held += [p.to_local()] + ([p.grad.to_local()] if p.grad is not None else [])
        out = {t.untyped_storage().data_ptr() for t in held}
        return out - {0}

    def check(self, name: str, tensors: list) -> None:
        host, device = self.host(), self.zero.topology.device
        for t in tensors:
            self.seen[name] = self.seen.get(name, 0) + 1
            if t.untyped_storage().data_ptr() in host or t.device != device:
                self.bad.append(f"{name}: a {tuple(t.shape)} tensor on {t.device}")

    def __enter__(self) -> HostSpy:
        for name in self.NAMES:
            real = self.saved[name] = getattr(dist, name)

            def spied(*args, _real=real, _name=name, **kwargs):
                found = [t for a in (*args, *kwargs.values())
                         for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
                self.check(_name, found)
                return _real(*args, **kwargs)
            setattr(dist, name, spied)
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self.saved.items():
            setattr(dist, name, real)


def _run(stage, offload, root, precision="fp32", pp=2, dp=2, spy=False, **more) -> dict:
    engine = _engine(pp, dp, stage, offload, root, precision, **more)
    zero = engine.optimizer
    losses, steps, jobs = [], [], []
    tied = zero._reducer.tied()
    with HostSpy(zero) if spy else nullcontext() as watch:
        for ids in _batches(STEPS, 4):
            losses.append(_train(engine, ids))
            early = zero.offload.last_early if zero.offload is not None else None
            steps.append((zero.last_step_skipped, early.kept if early is not None else None))
            if early is not None:
                zero.offload.last_early = None
                # the tied layer's buckets last, in a job of their own after its pp sum
                jobs.append((len(early.futures), [bi for bi in early.order if bi in tied] == early.order[
                    len(early.order) - len(tied):] and bool(tied) == (early.extended > early.started)))
    weights = {n: t.clone() for n, t in full_state_dict(engine.module).items()}
    out = {"losses": losses, "steps": steps, "weights": weights, "early jobs": jobs, "tied": tied,
           "norm": zero.last_grad_norm, "buckets": len(zero.buckets), "memory": zero.memory_bytes(),
           "host buckets": sum(b.host for b in zero.buckets), "inflight": zero.peak_inflight_bytes,
           "host grad bytes": sum(t.numel() * t.element_size() for t in (
               ([g for g in zero.offload.host_grads if g is not None] + zero.offload._staging)
               if zero.offload is not None and zero.offload.grads_on_host else [])),
           "shards on host": zero.offload is not None and zero.offload.grads_on_host and all(
               g is b.grad_shard for b, g in zip(zero.buckets, zero.offload.host_grads))}
    if watch is not None:
        out["spy"] = (watch.bad, watch.seen)
    if offload == "nvme":
        out["peak_resident"] = zero.offload.peak_resident
        out["resident_after"] = len(zero.offload.resident_now)
        out["state_bytes"] = sum(b.master.numel() * b.master.element_size() * 3 for b in zero.buckets)
    return out


@in_float64
def bitwise(root: str) -> dict:
    out = {}
    for stage in (1, 2, 3):
        out[stage] = {kind: _run(stage, kind, f"{root}/s{stage}", spy=stage == 2 and kind != "none")
                      for kind in ("none", "cpu", "nvme")}
    out["tp=2 x dp=2, ZeRO-2"] = {kind: _run(2, kind, f"{root}/tp", pp=1, tp=2, spy=kind != "none")
                                  for kind in ("none", "nvme")}
    out["dp=4 x ep=2 experts, ZeRO-1"] = {kind: _run(1, kind, f"{root}/ep", pp=1, dp=4, ep=2)
                                          for kind in ("none", "nvme")}
    # parameter offload, against ZeRO-3 without it: alone (its step as offload=cpu), and with nvme
    out["ZeRO-3, parameters offloaded"] = {"none": out[3]["none"],
                                           **{kind: _run(3, "none" if kind == "cpu" else kind, f"{root}/p", spy=True,
                                                         params="cpu") for kind in ("cpu", "nvme")}}
    return out


@in_float64
def early(root: str) -> dict:
    """The early step (offload_overlap), each run against the same one without it: in `bitwise`
    (clipping acts: put back and stepped again), or here (no clipping: kept)."""
    out: dict = {stage: _run(stage, "cpu", root, overlap=True) for stage in (1, 2, 3)}
    out["ZeRO-3, parameters offloaded"] = _run(3, "none", root, params="cpu", overlap=True)
    out["no clipping"] = {kind: _run(2, "cpu", root, clip=None, overlap=kind == "early")
                          for kind in ("cpu", "early")}
    # nvme: the stepped state to a second file per bucket, kept (no clipping) or dropped (clipped)
    out["nvme"] = {stage: _run(stage, "nvme", f"{root}/nvme", overlap=True) for stage in (1, 2, 3)}
    out["nvme"]["ZeRO-3, parameters offloaded"] = _run(3, "nvme", f"{root}/nvme", params="cpu", overlap=True)
    out["nvme, no clipping"] = {kind: _run(1, "nvme", f"{root}/nvme", clip=None, overlap=kind == "early")
                                for kind in ("nvme", "early")}
    return out


def bf16(root: str) -> dict:
    torch.set_default_dtype(torch.float32)
    # fp16 from a loss scale of 2^18: the first steps overflow (skipped on every rank), the early step put back
    fp16 = {kind: _run(1, "cpu", root, precision="fp16", scale_power=18, overlap=kind == "early")
            for kind in ("cpu", "early")}
    fp16["nvme early"] = _run(1, "nvme", f"{root}/fp16", precision="fp16", scale_power=18, overlap=True)
    runs = {kind: _run(1, kind, f"{root}/bf16", precision="bf16") for kind in ("none", "nvme")}
    runs["fp16"] = fp16
    runs["ZeRO-3"] = _run(3, "none", f"{root}/bf16", precision="bf16")
    runs["ZeRO-3, parameters offloaded"] = _run(3, "none", f"{root}/bf16", precision="bf16", params="cpu")
    return runs


@in_float64
def resumes(root: str) -> dict:
    batches = _batches(3, 8)
    out = {}
    plans = {"nvme z2 pp2 -> none z1 pp1": ((2, 2, 2, "nvme", "none"), (1, 4, 1, "none", "none")),
             "params z3 pp2 -> none z1 pp1": ((2, 2, 3, "none", "cpu"), (1, 4, 1, "none", "none")),
             "none z1 pp1 -> params+cpu z3 pp2": ((1, 4, 1, "none", "none"), (2, 2, 3, "cpu", "cpu"))}
    for name, (a, b) in plans.items():
        saving = _engine(*a[:4], root=f"{root}/state", params=a[4])
        for ids in batches[:2]:
            _train(saving, ids)
        path = f"{root}/{name.split()[0]}-{a[2]}"
        with HostSpy(saving.optimizer) as watch:  # the checkpoint's gathers of host-held shards: on the device
            save_checkpoint(path, saving.module, saving.optimizer)
        resumed = _engine(*b[:4], root=f"{root}/state", params=b[4])
        load_checkpoint(path, resumed.module, resumed.optimizer)
        losses = (_train(saving, batches[2]), _train(resumed, batches[2]))
        after, other = full_state_dict(saving.module), full_state_dict(resumed.module)
        out[name] = {"loss": abs(losses[0] - losses[1]),
                     "weights": max((t - other[n]).abs().max().item() for n, t in after.items()),
                     "spy": (watch.bad, watch.seen)}
    return out


def spy_control(root: str) -> dict:
    """HostSpy flags a host-held shard and a tensor off the topology's device (no collective)."""
    engine = _engine(2, 2, 3, root=root, params="cpu")
    spy = HostSpy(engine.optimizer)
    shard = next(b for b in engine.optimizer.buckets if b.host)
    spy.check("a host shard", [shard.param_buf[:2]])
    spy.check("a fresh tensor", [torch.zeros(2)])
    spy.check("off the device", [torch.zeros(2, device="meta")])
    return {"bad": spy.bad, "seen": sum(spy.seen.values())}


def check(root: str) -> tuple:
    return bitwise(root), bf16(root), resumes(root), spy_control(f"{root}/control"), early(f"{root}/early")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(check, 4, str(tmp_path_factory.mktemp("offload")), timeout=400)


def test_offload_is_bitwise_no_offload_at_zero_1_2_3(results):
    for rank, (by_stage, *_) in enumerate(results):
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


def _same(run: dict, base: dict, where: str) -> None:
    assert run["losses"] == base["losses"], f"{where}: losses {run['losses']} != {base['losses']}"
    assert [skip for skip, _ in run["steps"]] == [skip for skip, _ in base["steps"]], f"{where}: other skips"
    for name, t in base["weights"].items():
        assert torch.equal(run["weights"][name], t), f"{where}: {name} differs"


def test_the_early_step_gives_the_bits_of_the_step_after_the_verdict(results):
    """offload_overlap: kept where nothing is clipped or skipped, put back and stepped again where
    clipping acts (CLIP), put back where fp16 overflows skip the step: every bit as without it."""
    for rank, (by_stage, half, _, _, early) in enumerate(results):
        for stage in (1, 2, 3):
            run = early[stage]
            _same(run, by_stage[stage]["cpu"], f"rank {rank}, ZeRO-{stage}, early step")
            assert [kept for _, kept in run["steps"]] == [False] * STEPS, f"rank {rank}: clipped steps kept"
            # GPT-2's tied embedding (both pp ranks hold it): the other buckets begin before its pp sum
            assert run["tied"] and run["early jobs"] == [(2, True)] * STEPS, f"rank {rank}: {run['early jobs']}"
        _same(early["ZeRO-3, parameters offloaded"], by_stage["ZeRO-3, parameters offloaded"]["cpu"],
              f"rank {rank}, parameter offload, early step")
        plain = early["no clipping"]
        _same(plain["early"], plain["cpu"], f"rank {rank}, no clipping")
        assert [kept for _, kept in plain["early"]["steps"]] == [True] * STEPS, f"rank {rank}: {plain['early']}"
        runs = half["fp16"]
        _same(runs["early"], runs["cpu"], f"rank {rank}, fp16")
        skips = [skip for skip, _ in runs["early"]["steps"]]
        assert skips[0] and not skips[-1], f"rank {rank}: fp16 skips {skips}: no overflow, or no recovery"
        assert all(not kept for skip, kept in runs["early"]["steps"] if skip), f"rank {rank}: a skipped step kept"
        _same(runs["nvme early"], runs["cpu"], f"rank {rank}, fp16, nvme early step")
        assert [kept for _, kept in runs["nvme early"]["steps"]] == [kept for _, kept in runs["early"]["steps"]]
        # nvme: put back from its files where clipped, kept (the second file taken) where not
        for stage in (1, 2, 3, "ZeRO-3, parameters offloaded"):
            run = early["nvme"][stage]
            _same(run, by_stage[stage]["nvme"], f"rank {rank}, ZeRO-{stage}, nvme early step")
            assert [kept for _, kept in run["steps"]] == [False] * STEPS, f"rank {rank}: clipped nvme steps kept"
            assert run["peak_resident"] <= 3 and run["resident_after"] == 0, f"rank {rank}: {run['peak_resident']}"
        plain = early["nvme, no clipping"]
        _same(plain["early"], plain["nvme"], f"rank {rank}, nvme, no clipping")
        assert [kept for _, kept in plain["early"]["steps"]] == [True] * STEPS, f"rank {rank}: {plain['early']}"


def test_nvme_keeps_a_few_buckets_in_memory_and_the_state_on_disk(results):
    for rank, (by_stage, *_) in enumerate(results):
        for stage, runs in by_stage.items():
            nvme = runs["nvme"]
            where = f"rank {rank}, ZeRO-{stage}"
            if not isinstance(stage, int):
                continue  # the tp and ep cases: bitwise only
            assert nvme["buckets"] >= 6, f"{where}: only {nvme['buckets']} buckets: nothing streams"
            assert nvme["peak_resident"] <= 3, f"{where}: {nvme['peak_resident']} buckets in memory at once"
            assert nvme["resident_after"] == 0, f"{where}: buckets left in memory between steps"
            assert nvme["memory"]["disk"] >= nvme["state_bytes"], f"{where}: {nvme['memory']}"
            # the state is paged; ZeRO-2's gradient shards (and their two staging buffers) stay in memory
            grads = nvme["host grad bytes"] if stage == 2 else 0
            assert (stage == 2) == (grads > 0), f"{where}: {grads} bytes of host gradient shards"
            assert nvme["memory"]["host"] - grads < nvme["state_bytes"] / 10, f"{where}: {nvme['memory']}, {grads}"


def test_offload_in_bf16_is_bitwise(results):
    for rank, (_, runs, *_) in enumerate(results):
        assert runs["nvme"]["losses"] == runs["none"]["losses"], f"rank {rank}"
        for name, t in runs["none"]["weights"].items():
            assert torch.equal(runs["nvme"]["weights"][name], t), f"rank {rank}: {name}"


def test_offloaded_checkpoints_resume_without_offload_at_another_layout_and_back(results):
    for rank, (_, _, resumed, *_) in enumerate(results):
        for name, r in resumed.items():
            assert r["loss"] <= 1e-10 and r["weights"] <= 1e-10, f"rank {rank}, {name}: {r}"


def test_parameter_offload_keeps_every_shard_on_the_host_and_changes_no_bit(results):
    """The bitwise comparison itself is test_offload_is_bitwise_no_offload_at_zero_1_2_3's (its
    "ZeRO-3, parameters offloaded" case); here: the shards really are host-held, nothing of theirs
    is counted on the device, and bf16 (fp32 host master weights beside bf16 host shards) is
    bitwise too."""
    for rank, (by_stage, runs, *_) in enumerate(results):
        for kind, run in by_stage["ZeRO-3, parameters offloaded"].items():
            if kind == "none":
                continue
            where = f"rank {rank}, offload_params=cpu, offload={kind}"
            assert run["host buckets"] == run["buckets"] > 0, f"{where}: {run['host buckets']} of {run['buckets']}"
            memory = run["memory"]
            assert memory["params"] == memory["grads"] == 0, f"{where}: {memory}"
            assert memory["host"] + memory["disk"] >= 4 * by_stage[3]["none"]["memory"]["params"], where
        base, offloaded = runs["ZeRO-3"], runs["ZeRO-3, parameters offloaded"]
        assert offloaded["host buckets"] > 0 and offloaded["memory"]["params"] == 0, f"rank {rank}"
        assert offloaded["losses"] == base["losses"], f"rank {rank}, bf16"
        for name, t in base["weights"].items():
            assert torch.equal(offloaded["weights"][name], t), f"rank {rank}, bf16: {name}"


def test_no_collective_is_handed_a_host_held_tensor_of_parameter_offload(results):
    """While parameter-offloaded runs train (the tied embedding's gradient summed over pp, the
    norm, the touched flags, the non-finite marks, the p2p of activations) and save checkpoints
    (the shards and their optimizer state gathered whole), each tensor handed to torch.distributed
    is on the topology's device and none is a host-held one; the spy does flag one (and a tensor
    off the device) when shown it. (FSDP's own gathers do not pass through `torch.distributed`'s
    module attributes; FSDP moves the shards to the device itself.)"""
    for rank, (by_stage, _, resumed, control, _) in enumerate(results):
        spied = [(f"training, offload={kind}", run["spy"])
                 for kind, run in by_stage["ZeRO-3, parameters offloaded"].items() if "spy" in run]
        spied += [(f"saving {name}", r["spy"]) for name, r in resumed.items() if name.startswith("params")]
        spied += [(f"ZeRO-2 host gradient shards, {where}, offload={kind}", run["spy"])
                  for where, runs in (("pp=2 x dp=2", by_stage[2]), ("tp=2 x dp=2", by_stage["tp=2 x dp=2, ZeRO-2"]))
                  for kind, run in runs.items() if "spy" in run]
        assert len(spied) == 6, spied
        for what, (bad, seen) in spied:
            assert not bad, f"rank {rank}, {what}: {bad[:5]} ({seen} tensors checked)"
            assert seen.get("all_gather" if what.startswith("saving") else "all_reduce", 0) > 0, (rank, what, seen)
        assert control["seen"] == 3 and len(control["bad"]) == 2, f"rank {rank}: {control}"
        assert control["bad"][0].startswith("a host shard") and control["bad"][1].startswith("off the device")


def test_zero_2_offload_keeps_the_gradient_shards_in_host_memory_as_reduced(results):
    """ZeRO-2 with offload: each bucket's gradient shard is the offload's host buffer (what every
    reduced shard is added into, pass by pass), so the device holds only the buckets in flight; the
    shards count under "host" (they are the ones the spy checks no collective is handed, in
    test_no_collective_is_handed_a_host_held_tensor_of_parameter_offload); the bits are
    test_offload_is_bitwise_no_offload_at_zero_1_2_3's. Below ZeRO-2 no shard is host-held."""
    for rank, (by_stage, *_) in enumerate(results):
        for where, runs in (("pp=2 x dp=2", by_stage[2]), ("tp=2 x dp=2", by_stage["tp=2 x dp=2, ZeRO-2"])):
            base = runs["none"]
            assert not base["shards on host"]
            for kind, run in runs.items():
                if kind == "none":
                    continue
                said = f"rank {rank}, {where}, offload={kind}"
                assert run["shards on host"], said
                assert run["memory"]["grads"] == run["inflight"] > 0, (said, run["memory"], run["inflight"])
                assert base["memory"]["grads"] > run["memory"]["grads"], (said, base["memory"], run["memory"])
                shards = base["memory"]["grads"] - base["inflight"]
                assert run["memory"]["host"] >= shards > 0, (said, run["memory"], shards)
        for stage in (1, 3):
            assert not any(run["shards on host"] for run in by_stage[stage].values()), f"rank {rank}, ZeRO-{stage}"


def test_gather_rows_gathers_on_the_device_it_is_given_and_gives_back_on_the_shards(monkeypatch):
    """The helper that moves a host-held shard for a collective: the all-gather is handed tensors
    on `device` only (a fake all-gather on the meta device: it stops the call there), and the
    whole tensor comes back on the shard's device, rows in rank order (a fake all-gather of two
    ranks, the other holding the short last rows)."""
    class Stop(Exception):
        pass

    handed = []

    def fake_gather(parts, flat, group=None):
        handed.extend([flat, *parts])
        raise Stop

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", fake_gather)
    with pytest.raises(Stop):
        gather_rows(torch.ones(3, 2), (5, 2), None, device=torch.device("meta"))
    assert handed and all(t.device.type == "meta" for t in handed), [t.device for t in handed]

    def two_ranks(parts, flat, group=None):
        parts[0].copy_(flat)
        parts[1].copy_(torch.full_like(flat, 7.0))

    monkeypatch.setattr(dist, "all_gather", two_ranks)
    mine = torch.arange(6.0).view(3, 2)
    whole = gather_rows(mine, (5, 2), None, device=torch.device("cpu"))
    assert whole.device == mine.device and whole.shape == (5, 2)
    assert torch.equal(whole, torch.cat([mine, torch.full((2, 2), 7.0)]))


def test_the_steps_collectives_run_on_the_topologys_device_not_the_buckets():
    """Under parameter offload the buckets' tensors are host tensors; the step's norm, touched
    flags and non-finite marks are made on `Updater.device()`: the topology's (here a fake one on
    the meta device, the buckets on the CPU)."""
    from pipekit.optim.buckets import Bucket
    from pipekit.optim.collectives import Collectives
    from pipekit.optim.stage import Stage
    from pipekit.optim.step import Updater

    p = torch.nn.Parameter(torch.ones(4))
    b = Bucket([p], 0, None, 0, host=True)
    b.param_buf = b.master = p.data.view(-1)
    topo = types.SimpleNamespace(device=torch.device("meta"), pp_group=None, tp_group=None)
    updater = Updater([b], Stage(3), Collectives(), None, topology=topo, master_dtype=torch.float32, fused=False,
                      bucket_numel=4, offloaded=True)
    assert updater.device() == torch.device("meta") and b.param_buf.device.type == "cpu"
    updater.current = [torch.ones(4, device="meta")]
    assert updater.norm().device.type == "meta"


def test_parameter_offload_values_are_checked():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"offload_params='cpu' offloads the parameter shards of ZeRO stage 3, but "
                                         r"stage=1"):
        ZeroOptimizer(module, stage=1, offload_params="cpu")
    with pytest.raises(ValueError, match="parameter offload is host memory only"):
        ZeroOptimizer(module, stage=3, offload_params="nvme")
    with pytest.raises(ValueError, match=r"offload_params='disk' is not one of \['none', 'cpu'\]"):
        ZeroOptimizer(module, stage=3, offload_params="disk")
    with pytest.raises(ValueError, match="fused=True is the device kernel, but offload_params='cpu'"):
        ZeroOptimizer(module, stage=3, offload_params="cpu", fused=True)


@pytest.mark.parametrize("given, said", [
    (["optimizer.zero_stage=2"], "optimizer.offload_params=cpu offloads ZeRO-3's parameter shards, but "
                                 "optimizer.zero_stage=2; set optimizer.zero_stage=3, or "
                                 "optimizer.offload_params=none"),
    (["optimizer.zero_stage=3", "optimizer.offload_params=nvme"], "parameter offload is host memory only"),
    (["optimizer.zero_stage=3", "optimizer.offload_params=disk"], "optimizer.offload_params='disk' is not one of"),
    (["optimizer.zero_stage=3", "optimizer.fused=true"], "optimizer.fused=true is the GPU kernel, but "
                                                         "optimizer.offload_params=cpu"),
])
def test_parameter_offload_is_refused_before_launch_in_one_line(given, said):
    toy = str(ROOT / "configs/toy.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(toy, ["optimizer.offload_params=cpu", *given])
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_parameter_offload_at_dp_1_is_not_noted_as_doing_nothing():
    """dp=1 offloads the parameters too (FSDP over the rank alone: `every_schedule` below)."""
    toy = str(ROOT / "configs/toy.yaml")
    run = load_run(toy, ["parallel.dp=1", "optimizer.zero_stage=3", "optimizer.offload_params=cpu"])
    assert not [n for n in run.notices if "offload_params" in n], run.notices


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


def test_pipekit_train_in_one_process_offloads_parameters_with_the_weights_of_no_offload(tmp_path, monkeypatch):
    """One process (pp=1, dp=1: the single-GPU ZeRO-Infinity run): `pipekit train` with
    offload_param cpu at stage 3 makes a group of the process alone for FSDP, which puts every
    trained parameter's shard on the host, and trains the weights of the same run without
    offload, bit for bit; the group is gone after."""
    import json

    import pipekit.optim.fsdp as fsdp
    from pipekit.cli import main

    sharded = []
    real = fsdp.shard_layers

    def recorded(module, **kw):
        layers = real(module, **kw)
        sharded.append((len(layers), all(host_shard(p) for p in module.parameters() if p.requires_grad)))
        return layers
    monkeypatch.setattr(fsdp, "shard_layers", recorded)

    toy = str(ROOT / "configs/toy.yaml")
    base = ["train.steps=3", "data.val_every=0", "logging.progress=false", "logging.tensorboard=false",
            "parallel.pp=1", "optimizer.bucket_mb=0.001"]
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    for name in ("off", "none"):
        (tmp_path / f"{name}.json").write_text(json.dumps(ds))
        assert main(["train", toy, *base, f"logging.out_dir={tmp_path / name}", "--deepspeed",
                     str(tmp_path / f"{name}.json")]) == 0
        assert not dist.is_initialized()
        ds["zero_optimization"].pop("offload_param", None)
    assert sharded[0][0] > 0 and sharded[0][1] and sharded[1][0] == 0, sharded  # offloaded; then none sharded
    off, none = (torch.load(tmp_path / d / "model.pt")["state_dict"] for d in ("off", "none"))
    assert sorted(off) == sorted(none) and all(torch.equal(off[k], none[k]) for k in none)


def test_the_early_step_without_a_host_step_is_refused_before_launch_in_one_line():
    toy = str(ROOT / "configs/toy.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(toy, ["optimizer.offload_overlap=true"])
    said = "it needs a host step, optimizer.offload=cpu or nvme (or offload_params=cpu), not optimizer.offload=none"
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    for fine in (["optimizer.offload=cpu"], ["optimizer.offload=nvme", "optimizer.offload_dir=/tmp/x"],
                 ["optimizer.zero_stage=3", "optimizer.offload_params=cpu"]):
        assert load_config(toy, ["optimizer.offload_overlap=true", *fine]).optimizer.offload_overlap
    with pytest.raises(ValueError, match="offload_overlap=True .* not offload='none'"):
        ZeroOptimizer(torch.nn.Linear(2, 2), offload_overlap=True)


def test_parameter_offload_in_one_plain_process_is_refused_in_one_line():
    """FSDP moves the offloaded parameters and needs torch.distributed: one plain process (no group)
    is told so, not left training with its parameters on the device."""
    cfg = get_model("gpt2", "tiny", **GPT2)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=pipekit.Topology(),
                                    seed=SEED, microbatches=2)
    with pytest.raises(ValueError, match="offload_params='cpu' .* needs torch.distributed") as e:
        ZeroOptimizer(module, "adamw", stage=3, lr=1e-2, offload_params="cpu")
    assert "\n" not in str(e.value)


@in_float64
def every_schedule(root: str) -> dict:
    """pp=2 (dp=1, so ZeRO-2's shards are whole buckets), ZeRO-2, nvme with the early step against
    no offload, for each named schedule but 1F1B (above): virtual stages (interleaved, ZBV and
    DualPipe-V: two stages on a rank, the first and last together in a V) and split backwards
    (ZB-H1, ZBV, DualPipe-V: the weight gradients come in W actions after the input gradients)."""
    out = {}
    for schedule in ("gpipe", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v"):
        out[schedule] = {kind: _run(2, kind, f"{root}/{schedule}", dp=1, schedule=schedule, microbatches=4,
                                    overlap=kind == "nvme") for kind in ("none", "nvme")}
    # parameter offload at dp=1: FSDP over each rank alone keeps the parameters on the host
    params = {"none": _run(3, "none", root, dp=1)}
    params["cpu"] = _run(3, "none", root, dp=1, params="cpu", spy=True)
    params["early"] = _run(3, "none", root, dp=1, params="cpu", overlap=True)
    out["ZeRO-3 at dp=1, parameters offloaded"] = params
    return out


def test_offload_and_its_early_step_change_no_bit_in_any_schedule_and_dp_1_offloads_parameters(tmp_path):
    for rank, runs in enumerate(run_distributed(every_schedule, 2, str(tmp_path), timeout=300)):
        params = runs.pop("ZeRO-3 at dp=1, parameters offloaded")
        for run in (params["cpu"], params["early"]):
            assert run["memory"]["params"] == run["memory"]["master"] == run["memory"]["optimizer_state"] == 0
            assert run["memory"]["host"] > 0 and run["host buckets"] == run["buckets"], run["memory"]
        assert params["cpu"]["spy"][0] == [] and params["cpu"]["spy"][1], params["cpu"]["spy"]
        for kind in ("cpu", "early"):
            assert params[kind]["losses"] == params["none"]["losses"], kind
            for name, t in params["none"]["weights"].items():
                assert torch.equal(t, params[kind]["weights"][name]), (kind, name)
        for schedule, run in runs.items():
            assert run["nvme"]["losses"] == run["none"]["losses"], (rank, schedule)
            assert run["nvme"]["steps"] == [(False, False)] * STEPS, (rank, schedule)  # clipped: put back, redone
            for name, t in run["none"]["weights"].items():
                assert torch.equal(t, run["nvme"]["weights"][name]), (rank, schedule, name)
