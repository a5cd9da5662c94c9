"""The planner's memory model (`pipekit.plan.memory`, `pipekit plan --memory-budget-gb`): each
component against the ZeRO formulas by hand (stage 3's gathered parameters and unsharded
gradients, a tied weight once), against the real optimizer's buffers, the activations
counted on the meta device against the same count on real tensors (tp=1 in this process,
tp=2 over two gloo processes, sequence parallelism off and on), the fallback against
Korthikanti et al.'s tp / SP / checkpointing splits, and the command on Llama-3 8B (meta
device: nothing allocated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipekit.cli import main
from pipekit.config import load_run
from pipekit.models import count_params
from pipekit.plan import memory as memplan
from pipekit.plan import planner, profiler

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = str(ROOT / "configs" / "mixtral_tiny.yaml")
GPT = str(ROOT / "configs" / "gpt2_tiny.yaml")
LLAMA8B = str(ROOT / "configs" / "llama3_8b.yaml")
LLAMA = str(ROOT / "configs" / "llama_tiny.yaml")
QUIET = ["data.source=synthetic", "logging.out_dir=null"]
GPT_SMALL = [*QUIET, "model.dim=32", "model.n_heads=2", "model.n_layers=4", "train.seq_len=16",
             "model.max_seq_len=16", "train.micro_batch=2", "schedule.microbatches=4"]
GIB = 2**30


def _plan_rows(run, budget=GIB, microbatches=None):
    prof = profiler.flop_layers(run, flops_per_second=1e9)
    cands = planner.plan(run, prof, profiler.CommModel(), schedules=["1f1b", "gpipe"], partitions=["parameters"],
                         microbatches=microbatches)
    return prof, memplan.memory_plan(run, prof, profiler.CommModel(), cands, budget)


@pytest.mark.parametrize("reshard", [False, True])
def test_state_components_are_the_zero_formulas(reshard):
    """Mixtral tiny, bf16 AdamW, dp=4 x ep=2 at pp=1: dense parameters sharded over dp=4, the
    routed experts (half of them per rank) over edp=2; bf16 weights, fp32 gradients (the
    engine's reduce dtype), fp32 master weights and two fp32 moments. Stage 3 also holds the
    step's gradients whole in fp32, and gathered bf16 parameters: the whole rank's without
    `optimizer.reshard_after_forward`, its largest layer's with it."""
    run = load_run(MIXTRAL, [*QUIET, "parallel.dp=4", "parallel.ep=2", "train.precision=bf16",
                             f"optimizer.reshard_after_forward={reshard}"])
    m = run.model
    experts = m.n_layers * m.n_experts * 3 * m.dim * m.hidden  # w_gate, w_up, w_down per expert
    dense = count_params(m) - experts
    E = experts / 2  # this rank's half of the experts
    largest = max(p.dense + p.expert / 2 for p in memplan.layer_params(run))
    _, rows = _plan_rows(run)
    got = {r.option.zero: r.memory for r in rows if r.candidate.schedule == "1f1b" and not r.option.ac}
    assert set(got) == {0, 1, 2, 3}
    for z, mem in got.items():
        n, ne = (4, 2) if z >= 3 else (1, 1)
        assert mem.params == pytest.approx(2 * dense / n + 2 * E / ne)
        n, ne = (4, 2) if z >= 2 else (1, 1)
        assert mem.grads == pytest.approx(4 * dense / n + 4 * E / ne)
        n, ne = (4, 2) if z >= 1 else (1, 1)
        assert mem.master == pytest.approx(4 * dense / n + 4 * E / ne)
        assert mem.optimizer == pytest.approx(8 * dense / n + 8 * E / ne)
        whole = largest if reshard else dense + E
        assert mem.gathered == pytest.approx(2 * whole if z == 3 else 0)
        assert mem.unsharded_grads == pytest.approx(4 * (dense + E) if z == 3 else 0)
        assert mem.total == pytest.approx(sum(getattr(mem, k) for k in memplan.COMPONENTS))
    assert got[1].total < got[0].total and got[3].params < got[2].params


def test_stage_0_state_is_what_the_optimizer_allocates():
    from pipekit.optim.factory import make_optimizer

    run = load_run(MIXTRAL, [*QUIET, "parallel.dp=1", "parallel.ep=1", "train.precision=bf16"])
    module, batch = profiler.whole_model(run)
    opt = make_optimizer(module, run.config.optimizer, run.precision)
    x, labels = batch(2)
    out = x
    for i in range(len(module.specs)):
        out = module.run_layer(i, out)
    module.loss_fn(out, labels).backward()
    opt.step()
    real = opt.memory_bytes()
    mem = memplan.state_memory(memplan.rank_params(run, memplan.layer_params(run)), run, 0)
    assert (mem.params, mem.grads, mem.master, mem.optimizer) == (
        real["params"], real["grads"], real["master"], real["optimizer_state"])


@pytest.mark.parametrize("pp", [1, 2])
def test_a_tied_weight_is_counted_once_per_rank_holding_it(pp):
    """GPT-2's embedding and head share one weight: a rank holding both uses holds it once
    (pp=1), each of two ranks holding one use holds it (pp=2). bf16 AdamW, ZeRO-3 over dp=2."""
    run = load_run(GPT, [*GPT_SMALL, f"parallel.pp={pp}", "parallel.dp=2", "train.precision=bf16"])
    splits, keys = memplan.layer_params(run), memplan.tied_keys(run)
    assert keys[0] == keys[-1] == "embed" and splits[0] == splits[-1]
    embed = splits[0].dense
    _, rows = _plan_rows(run)
    row = next(r for r in rows if r.candidate.schedule == "1f1b" and r.option == memplan.Option(3, False, False))
    cuts = row.candidate.boundaries
    per_rank = [sum(p.dense for p in splits[lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
    if pp == 1:
        per_rank = [per_rank[0] - embed]  # the head's use of the embedding's weight: not a second copy
    psi = row.memory.params  # bf16 / 2 shards: the worst rank's psi; it must be one of the ranks' counts
    assert psi in per_rank
    # bf16 params / 2, fp32 grads / 2, fp32 master / 2, two fp32 moments / 2; gathered bf16, unsharded fp32
    assert (row.memory.grads, row.memory.master, row.memory.optimizer) == pytest.approx(
        (4 * psi / 2, 4 * psi / 2, 8 * psi / 2))
    assert (row.memory.gathered, row.memory.unsharded_grads) == pytest.approx((2 * psi, 4 * psi))
    assert memplan.held_once([0, 3, 6, 0], keys) == [0, 3]


def test_sgd_and_fp32_state():
    run = load_run(GPT, [*GPT_SMALL, "optimizer.name=sgd", "optimizer.momentum=0.9", "parallel.dp=2"])
    mem = memplan.state_memory(memplan.Params(1000), run, 1)
    # fp32: no separate master copy; one fp32 momentum buffer, sharded over dp=2 at stage 1
    assert (mem.params, mem.grads, mem.master, mem.optimizer) == (4000, 4000, 0, 2000)


def _real_saved(run, rows: int, tp_group=None, sp: bool = False) -> list[tuple[int, int]]:
    """What `memplan.meta_activations` counts, counted on real CPU tensors: per layer (saved,
    output) bytes of one forward of `rows` rows, the loss's folded into the last layer."""
    module, batch = profiler.whole_model(run, "cpu", tp_group=tp_group, sequence_parallel=sp)
    module.train()
    x, labels = (t.clone() for t in batch(rows))  # own storages, as meta's copies have
    counter = memplan.SavedStorages([p for p in module.parameters() if p.requires_grad])
    found = []
    with counter:
        out = x
        for i in range(len(module.specs)):
            out = module.run_layer(i, out)
            found.append([counter.take(), profiler._nbytes(out)])
        module.loss_fn(out, labels)
        found[-1][0] += counter.take()
    return [(saved, nbytes) for saved, nbytes in found]


LLAMA_SMALL = [*QUIET, "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.hidden=48",
               "model.n_layers=2", "train.seq_len=16", "model.max_seq_len=16", "train.micro_batch=2"]


@pytest.mark.parametrize("config,small", [(GPT, GPT_SMALL), (LLAMA, LLAMA_SMALL)])
def test_meta_activations_are_the_real_saved_bytes_at_tp1(config, small):
    run = load_run(config, small)
    meta = memplan.meta_activations(run, 2, sp=False)
    assert meta == _real_saved(run, 2)
    assert all(saved > 0 for saved, _ in meta[1:-1])  # every block saves something


def _saved_at_tp2(models: list[tuple[str, list[str]]]) -> dict:
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    return {(config, sp): _real_saved(load_run(config, [*small, "parallel.tp=2"]), 2, group, sp)
            for config, small in models for sp in (False, True)}


def test_meta_activations_are_the_real_saved_bytes_at_tp2():
    """GPT-2 and Llama at tp=2 over two gloo processes (one group for all), sequence
    parallelism off and on: each rank's real count is the meta count with a FakeGroup(2, 0),
    layer by layer; SP saves less than without, and tp=2 less than tp=1."""
    from pipekit.testing import run_distributed

    models = [(GPT, GPT_SMALL), (LLAMA, LLAMA_SMALL)]
    ranks = run_distributed(_saved_at_tp2, 2, models, timeout=300)
    for config, small in models:
        run = load_run(config, [*small, "parallel.tp=2"])
        for sp in (False, True):
            meta = memplan.meta_activations(run, 2, sp)
            for real in ranks:
                assert real[config, sp] == meta, (config, sp, real[config, sp], meta)
        one = memplan.meta_activations(load_run(config, small), 2, sp=False)
        blocks = slice(1, 1 + run.model.n_layers)
        off, on = (sum(s for s, _ in memplan.meta_activations(run, 2, sp)[blocks]) for sp in (False, True))
        assert on < off < sum(s for s, _ in one[blocks])


def test_plan_activations_follow_the_meta_count_and_the_schedule():
    run = load_run(GPT, [*GPT_SMALL, "parallel.pp=1", "parallel.tp=2", "parallel.dp=2"])
    prof = profiler.flop_layers(run, flops_per_second=1e9)
    layers = prof.at(2)
    for sp, ac in ((False, False), (True, False), (False, True), (True, True)):
        meta = memplan.meta_activations(run, 2, sp)
        held, recompute, source = memplan.planned_activations(run, layers, 2, sp, ac)
        assert source == "counted on the meta device at tp=2"
        for c, (saved, out), got, again in zip(layers, meta, held, recompute):
            block = ac and c.name == "TransformerBlock"
            assert (got, again) == ((out, saved) if block else (saved, 0))
    # pp=1: 1F1B holds one microbatch at a time, GPipe all 4 of them
    _, rows = _plan_rows(run, microbatches=[4])
    by = {(r.candidate.schedule, r.option): r for r in rows}
    for sp, ac in ((False, False), (True, True)):
        held, recompute, _ = memplan.planned_activations(run, layers, 2, sp, ac)
        one = round(sum(held))
        extra = max(recompute)
        assert by["1f1b", memplan.Option(0, sp, ac)].memory.activations == pytest.approx(one + extra)
        assert by["gpipe", memplan.Option(0, sp, ac)].memory.activations == pytest.approx(4 * one + extra)
        assert by["1f1b", memplan.Option(0, sp, ac)].activations_source == "counted on the meta device at tp=2"


def test_fallback_follows_korthikanti_splits_and_says_so(monkeypatch):
    run = load_run(GPT, [*GPT_SMALL, "parallel.pp=1", "parallel.tp=2", "parallel.dp=2"])
    prof = profiler.flop_layers(run, flops_per_second=1e9)
    layers = prof.at(2)
    a, s, h, t = 2, 16, 32, 2
    frac = (10 + 24 / t + 5 * a * s / (h * t)) / (34 + 5 * a * s / h)
    assert memplan.tp_fraction(run, sp=False) == pytest.approx(frac)

    def cannot(*args):
        raise NotImplementedError("no meta kernel for this op")

    monkeypatch.setattr(memplan, "meta_activations", cannot)
    for sp, ac in ((False, False), (True, False), (False, True), (True, True)):
        held, recompute, source = memplan.planned_activations(run, layers, 2, sp, ac)
        assert "Korthikanti" in source and "NotImplementedError: no meta kernel for this op" in source
        for c, got, again in zip(layers, held, recompute):
            if c.name == "TransformerBlock":
                full = c.saved_bytes * (1 / t if sp else frac)
                assert got == pytest.approx(c.out_bytes / (t if sp else 1) if ac else full)
                assert again == pytest.approx(full if ac else 0)
            elif c.name.startswith("VocabParallel"):
                assert got == pytest.approx(c.saved_bytes / t)
            else:
                assert got == pytest.approx(c.saved_bytes / (t if sp else 1))


def test_checkpointing_and_zero3_cost_time():
    run = load_run(GPT, [*GPT_SMALL, "parallel.dp=2"])
    _, rows = _plan_rows(run)
    by = {(r.candidate.schedule, r.option): r for r in rows}
    base = by["1f1b", memplan.Option(0, False, False)]
    assert by["1f1b", memplan.Option(0, False, True)].step_seconds > base.step_seconds
    assert by["1f1b", memplan.Option(3, False, False)].step_seconds > base.step_seconds
    assert by["1f1b", memplan.Option(2, False, False)].step_seconds == base.step_seconds
    assert not any(o.sp for _, o in by)  # tp=1: no sequence parallelism to choose
    assert all(r.runnable for r in rows) and "runnable" not in memplan.memory_table(rows)


def _refused(*overrides: str) -> set:
    run = load_run(GPT, [*GPT_SMALL, *overrides])
    return {(r.candidate.schedule, r.option.zero) for r in _plan_rows(run)[1] if not r.runnable}


def test_rows_the_config_refuses_are_marked_not_runnable(capsys):
    """A row is runnable when `pipekit train` accepts the run with the row's overrides."""
    assert _refused("parallel.dp=2") == set()
    assert _refused("parallel.dp=2", "schedule.overlap=true") == {("1f1b", 3), ("gpipe", 3)}  # not beside ZeRO-3
    assert _refused("parallel.dp=4", "parallel.dp_shard=2", "optimizer.zero_stage=3") == {
        (s, z) for s in ("1f1b", "gpipe") for z in (0, 1, 2)}  # dp_shard is ZeRO-3's
    run = load_run(MIXTRAL, [*QUIET, "parallel.tp=2", "parallel.expert_tp=true", "train.seq_len=16"])
    rows = _plan_rows(run)[1]
    assert {r.option.sp for r in rows if not r.runnable} == {True} and any(r.runnable for r in rows)
    assert [line.endswith("(refused by pipekit train)") for line in memplan.memory_table(rows).splitlines()[1:]] \
        == [not r.runnable for r in rows]
    assert [r["runnable"] for r in map(memplan.MemoryRow.record, rows)] == [r.runnable for r in rows]
    # the fastest plan, GPipe at 1 microbatch, has nothing to overlap: recommended, but said so
    overlap = [*GPT_SMALL, "parallel.dp=2", "schedule.overlap=true", "--schedule", "gpipe", "--no-profile"]
    assert main(["plan", GPT, *overlap, "--memory-budget-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended: gpipe, 1 microbatches" in out and "(refused by pipekit train: the command below says" in out


def test_too_large_models_are_not_profiled_on_the_cpu():
    assert profiler.too_large_to_profile(load_run(GPT, GPT_SMALL), "cpu") is None
    why = profiler.too_large_to_profile(load_run(LLAMA8B), "cpu")
    assert why is not None and ("FLOPs" in why or "GiB" in why)


LLAMA_8GPU = ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "train.precision=bf16", "--schedule", "1f1b",
              "--microbatches", "16"]


def test_plan_llama3_8b_recommends_a_plan_that_fits(capsys):
    assert main(["plan", LLAMA8B, *LLAMA_8GPU, "--memory-budget-gb", "80", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["memory_plan"]
    best = report["recommended"]
    assert report["fits"] and best["fits"] and best["bytes"]["total"] <= 80 * GIB
    assert best["bytes"]["total"] == pytest.approx(sum(best["bytes"][k] for k in memplan.COMPONENTS))
    fitting = [r for r in report["rows"] if r["fits"]]
    assert best["step_seconds"] == min(r["step_seconds"] for r in fitting)
    assert {r["zero_stage"] for r in report["rows"]} == {0, 1, 2, 3}
    assert {r["sequence_parallel"] for r in report["rows"]} == {False, True}


def test_plan_llama3_8b_says_when_nothing_fits(capsys):
    assert main(["plan", LLAMA8B, *LLAMA_8GPU, "--memory-gb", "4"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("nothing fits")]
    assert len(lines) == 1 and "nothing fits 4 GiB per rank: the least memory is" in lines[0]
    assert "recommended: none fits" in out


def test_memory_flags_conflict(capsys):
    assert main(["plan", GPT, "--no-profile", "--memory-budget-gb", "1", "--memory-gb", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "are the same flag with two values" in err and len(err.splitlines()) == 1


# ---- fine-tuning: frozen weights and adapters ---------------------------------------------
LORA = ["model.lora.rank=4", "model.lora.alpha=8", r"model.lora.targets=attn\.(q|k|v|o)$|mlp\.(gate|up|down)$"]
FINETUNES = {"lora": LORA, "dora": [*LORA, "model.lora.dora=true"],
             "freeze": [r"model.freeze=layers\.[12]\.|^layers\.0\."]}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage once, whole)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}.values())


@pytest.mark.parametrize("precision, offload", [("fp32", "none"), ("bf16", "none"), ("bf16", "cpu")])
@pytest.mark.parametrize("case", sorted(FINETUNES))
def test_a_fine_tuned_run_holds_the_planned_state_bytes(case, precision, offload):
    """Llama small, one process, AdamW, built by `pipekit train`'s own `build` and trained one
    step: the parameters' storages (frozen weights and the optimizer's flat buffer), the gradient
    buffers, the master weights and the moments equal the plan's components byte for byte; no
    frozen weight has a gradient or optimizer state. Offloaded (`optimizer.offload=cpu`), the
    device holds no master weights or moments, in the plan as in the optimizer."""
    from pipekit.models import model_vocab, synthetic_batches
    from pipekit.run.loop import build
    from pipekit.topology import Topology

    run = load_run(LLAMA, [*LLAMA_SMALL, "parallel.pp=1", "schedule.microbatches=2", f"train.precision={precision}",
                           f"optimizer.offload={offload}", *FINETUNES[case]])
    engine = build(run, Topology(alone=True))
    engine.train_batch(next(synthetic_batches(model_vocab(run.model), 4, run.config.train.seq_len, seed=0)))
    params = list(engine.module.parameters())
    frozen = [p for p in params if not p.requires_grad]
    state = engine.optimizer.inner.state
    assert frozen and all(p.grad is None and p not in state for p in frozen)
    real = engine.optimizer.memory_bytes()
    planned = memplan.layer_params(run)
    mem = memplan.state_memory(memplan.rank_params(run, planned), run, 0)
    assert sum(p.frozen_dense for p in planned) == sum(p.numel() for p in frozen)
    assert (mem.params, mem.grads, mem.master, mem.optimizer) == (
        _storage_bytes(params), real["grads"], real["master"], real["optimizer_state"])
    trained = sum(p.numel() for p in params if p.requires_grad)
    assert mem.grads == run.precision.reduce_dtype.itemsize * trained
    on_device = offload == "none"
    assert (mem.master > 0) == (precision == "bf16" and on_device) and (mem.optimizer > 0) == on_device


def test_adapters_are_the_trained_parameters_of_an_adapted_block():
    """Llama small (dim 32, kv dim 16, hidden 48), rank 4 on q, k, v, o, gate, up, down: a block
    trains r (in + out) per target, DoRA's magnitude (out) beside; the rest of it is frozen."""
    full = memplan.layer_params(load_run(LLAMA, LLAMA_SMALL))
    lora = memplan.layer_params(load_run(LLAMA, [*LLAMA_SMALL, *LORA]))
    dora = memplan.layer_params(load_run(LLAMA, [*LLAMA_SMALL, *FINETUNES["dora"]]))
    ins_outs = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 48), (32, 48), (48, 32)]
    block = full[1].dense
    assert lora[1] == memplan.Params(4 * sum(i + o for i, o in ins_outs), 0, block, 0)
    assert dora[1] == memplan.Params(lora[1].dense + sum(o for _, o in ins_outs), 0, block, 0)
    assert lora[0] == memplan.Params(0, 0, full[0].dense, 0)  # the embedding: frozen whole


def test_zero3_shards_and_gathers_the_frozen_weights_too():
    """bf16 AdamW, dp=2 at ZeRO-3: frozen weights are sharded and gathered as the adapters are
    (as DeepSpeed's ZeRO-3 partitions them), with nothing else (no gradient, master or state);
    the adapters are sharded, gathered and reduced like any trained parameter."""
    run = load_run(LLAMA, [*LLAMA_SMALL, *LORA, "parallel.pp=1", "parallel.dp=2", "train.precision=bf16"])
    p = memplan.rank_params(run, memplan.layer_params(run))
    _, rows = _plan_rows(run)
    row = next(r for r in rows if r.candidate.schedule == "1f1b" and r.option == memplan.Option(3, False, False))
    m = row.memory
    assert m.params == pytest.approx(2 * p.frozen_dense / 2 + 2 * p.dense / 2)
    assert (m.grads, m.master, m.optimizer) == pytest.approx((4 * p.dense / 2, 4 * p.dense / 2, 8 * p.dense / 2))
    assert (m.gathered, m.unsharded_grads) == pytest.approx((2 * (p.dense + p.frozen_dense), 4 * p.dense))


def test_parameter_offload_takes_the_shards_and_their_state_off_the_device():
    """ZeRO-3 dp=2 with optimizer.offload_params=cpu: the sharded parameters, their master
    weights and moments are host memory (nothing on the device); the step's gradient shard and
    what is gathered (whole layers, their unsharded gradients) are still the device's. At dp=1
    too (FSDP over the rank alone): there, what is gathered is the whole stage, which without
    offload nothing gathers."""
    base = [*LLAMA_SMALL, "parallel.pp=1", "train.precision=bf16", "optimizer.zero_stage=3"]
    for dp in (2, 1):
        on, off = (load_run(LLAMA, [*base, f"parallel.dp={dp}", f"optimizer.offload_params={v}"])
                   for v in ("cpu", "none"))
        p = memplan.rank_params(on, memplan.layer_params(on))
        whole = memplan.Params(p.dense, p.expert)
        a, b = (memplan.state_memory(p, r, 3, whole) for r in (on, off))
        assert b.params > 0 and b.master > 0 and b.optimizer > 0
        assert (a.params, a.master, a.optimizer) == (0, 0, 0) and a.host > 0
        assert a.grads == b.grads
        if dp == 2:
            assert (a.gathered, a.unsharded_grads) == (b.gathered, b.unsharded_grads)
        else:  # bf16: two bytes a weight, four a reduced gradient
            assert (b.gathered, b.unsharded_grads) == (0, 0)
            assert (a.gathered, a.unsharded_grads) == pytest.approx((2 * p.dense, 4 * p.dense))


def test_a_frozen_block_has_a_near_empty_weight_pass():
    """FLOP-counted: an adapted block's backward computes its input's gradient (I) as a full
    block's does, its weight pass (W) only the adapters' gradients."""
    full = profiler.flop_layers(load_run(LLAMA, LLAMA_SMALL), flops_per_second=1.0).layers[1]
    lora = profiler.flop_layers(load_run(LLAMA, [*LLAMA_SMALL, *LORA]), flops_per_second=1.0).layers[1]
    assert lora.I >= full.I and 0 < lora.W < full.W / 3
    assert full.I + full.W == pytest.approx(full.B) and lora.I + lora.W == pytest.approx(lora.B)


def test_plan_accepts_a_lora_config_and_counts_frozen_weights_apart(capsys):
    small = [*LLAMA_SMALL, *LORA, "parallel.pp=1", "train.precision=bf16", "--schedule", "1f1b"]
    assert main(["plan", LLAMA, *small, "--memory-budget-gb", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    run = load_run(LLAMA, small[:-2])
    planned = memplan.layer_params(run)
    assert [(c["params"], c["frozen"]) for c in report["layers"]] == [(p.dense, p.frozen_dense) for p in planned]
    best = report["memory_plan"]["recommended"]["bytes"]
    trained = sum(p.dense for p in planned)
    assert best["grads"] == 4 * trained and best["optimizer"] == 8 * trained
    assert best["params"] == 2 * (trained + sum(p.frozen_dense for p in planned))
    assert main(["plan", LLAMA, *small]) == 0
    assert "frozen" in capsys.readouterr().out.splitlines()[1]  # the layer table's header


def test_zero_shards_over_the_data_replicas_and_cp():
    """ZeRO shards over every rank holding the same parameters, dp x cp (`Topology.dp`): the
    state of dp=1 x cp=2 is that of dp=2 x cp=1 at each stage; the activations halve with cp."""
    small = [*QUIET, "parallel.pp=1", "train.seq_len=64", "model.max_seq_len=64", "train.micro_batch=2"]
    at_cp = load_run(LLAMA, [*small, "parallel.dp=1", "parallel.cp=2"])
    at_dp = load_run(LLAMA, [*small, "parallel.dp=2", "parallel.cp=1"])
    assert at_cp.zero_shards == at_dp.zero_shards == 2
    params = memplan.rank_params(at_cp, memplan.layer_params(at_cp))
    for zero in (1, 2, 3):
        a, b = memplan.state_memory(params, at_cp, zero), memplan.state_memory(params, at_dp, zero)
        assert a == b, zero
        assert a.optimizer == pytest.approx(memplan.state_memory(params, at_cp, 0).optimizer / 2)
    saved_cp = sum(s for s, _ in memplan.meta_activations(at_cp, 2, False))
    saved_dp = sum(s for s, _ in memplan.meta_activations(at_dp, 2, False))
    assert saved_cp == pytest.approx(saved_dp / 2, rel=0.05)


LONG = [*QUIET, "parallel.pp=2", "parallel.dp=2", "train.seq_len=256", "model.max_seq_len=256",
        "train.micro_batch=1", "schedule.microbatches=4", "--schedule", "1f1b", "--microbatches", "4",
        "--no-profile", "--latency", "1e-4", "--json"]


def test_plan_offers_context_parallelism_when_activations_dominate(capsys):
    """Llama tiny at 256 tokens: activations dominate, so the plan shows the best row at cp=2
    (dp=1, twice the microbatches: the same global batch), its activations halved, and
    recommends it where only it fits."""
    assert main(["plan", LLAMA, *LONG, "--memory-gb", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["memory_plan"]["recommended"]
    assert best["bytes"]["activations"] >= 0.5 * best["bytes"]["total"]
    (row,) = report["context_parallel"]["rows"]
    assert (row["cp"], row["dp"], row["microbatches"]) == (2, 1, 8)
    assert row["bytes"]["activations"] == pytest.approx(best["bytes"]["activations"] / 2, rel=0.1)
    assert main(["plan", LLAMA, *LONG, "--memory-gb", "0.0001"]) == 0  # nothing fits: the least memory's row
    report = json.loads(capsys.readouterr().out)
    least, (row,) = report["memory_plan"]["least_memory"], report["context_parallel"]["rows"]
    assert not report["memory_plan"]["fits"] and report["context_parallel"]["recommended"] is None
    assert row["bytes"]["total"] < least["bytes"]["total"]
    budget = (row["bytes"]["total"] + least["bytes"]["total"]) / 2 / GIB  # between the two: only cp=2 fits
    assert main(["plan", LLAMA, *LONG, "--memory-gb", f"{budget:.9f}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["memory_plan"]["fits"]
    picked = report["context_parallel"]
    assert picked["recommended"]["cp"] == 2 and picked["recommended"]["fits"]
    command = picked["command"].split()
    assert "parallel.cp=2" in command and "parallel.dp=1" in command and "schedule.microbatches=8" in command
    assert command.count("schedule.microbatches=8") == 1 and "schedule.microbatches=4" not in command
    run = load_run(LLAMA, [o for o in command[3:] if "=" in o])  # the command's config resolves
    assert run.cp == 2 and run.global_batch == load_run(LLAMA, [o for o in LONG if "=" in o]).global_batch == 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plan_counts_the_host_memory_offload_keeps(precision, tmp_path):
    """Llama small, one process, AdamW, `optimizer.offload=cpu`, two steps (the second one's
    early step saves moments that exist): the plan's host bytes equal what the optimizer holds
    in host memory (master parts, moments, host gradient buffers) exactly; with the early step
    (`offload_overlap`) its saved copy of master and moments too, within the step counters'
    few bytes. Not offloaded: nothing on the host."""
    from pipekit.models import model_vocab, synthetic_batches
    from pipekit.run.loop import build
    from pipekit.topology import Topology

    held = {}
    for offload, overlap, zero in (("cpu", "false", 0), ("cpu", "true", 0), ("none", "false", 0),
                                   ("cpu", "false", 2), ("nvme", "false", 2)):
        run = load_run(LLAMA, [*LLAMA_SMALL, "parallel.pp=1", "schedule.microbatches=2", f"train.precision={precision}",
                               f"optimizer.offload={offload}", f"optimizer.offload_overlap={overlap}",
                               f"optimizer.zero_stage={zero}", f"optimizer.offload_dir={tmp_path}"])
        memory = memplan.state_memory(memplan.rank_params(run, memplan.layer_params(run)), run, zero)
        planned = memory.host
        if offload == "none":
            assert planned == 0
            continue
        engine = build(run, Topology(alone=True))
        batches = synthetic_batches(model_vocab(run.model), 4, run.config.train.seq_len, seed=0)
        for _ in range(2):
            engine.train_batch(next(batches))
        bytes_ = engine.optimizer.memory_bytes()
        real = held[overlap, zero, offload] = bytes_["host"]
        if zero == 2:  # the gradient shards are host memory: none on the device but the buckets in flight;
            # the two staging buffers (one bucket's shard each) are what the plan leaves out
            assert memory.grads == 0 and bytes_["grads"] == engine.optimizer.peak_inflight_bytes, (memory, bytes_)
            staging = sum(t.numel() * t.element_size() for t in engine.optimizer.offload._staging)
            assert staging > 0 and real == planned + staging, (offload, real, planned, staging)
            continue
        assert real == (planned if overlap == "false" else pytest.approx(planned, rel=1e-3, abs=0)), (real, planned)
    assert held["true", 0, "cpu"] > 1.5 * held["false", 0, "cpu"]  # the early step's saved copy is counted
