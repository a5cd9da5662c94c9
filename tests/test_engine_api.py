"""The Python API as a user writes it against the engine.

- `train_batch` / `eval_batch` take the batch itself (a tuple, or a list as a
  DataLoader gives it) or an iterator of batches; anything else is refused.
- Only the ranks that use the data need it: None for the inputs off stage 0,
  for the labels off the last stage, for the whole batch on a middle rank; the
  weights are bit-identical to the run where every rank gets everything.
- The loss costs no communication unless asked (`reduce_loss=True`).
- `Topology()` / `init_distributed()` at world size 1 and under
  torch.multiprocessing (env variables, or the script's own group).
- The schedule, interleaving included, is declared once, on the module.

One spawned gloo group of 2 ranks, started the torch.multiprocessing way (from
MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), runs every two-rank check; one
process of its own runs the world-of-one checks. float64, a tiny toy model.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
import torch.distributed as dist

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.models.toy import ToyConfig, lm_loss, toy_lm
from pipekit.optim import ZeroOptimizer
from pipekit.schedules import Kind, ScheduleError, build_schedule
from pipekit.spec import LayerSpec
from pipekit.testing import Reference, in_float64, run_distributed

CFG = ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)
SEED, BATCH, SEQ, LR = 7, 8, 3, 0.1
TOL = 1e-10


def _batch(step: int, rows: int = BATCH):
    """Tokens and labels, the labels masked unevenly (-100) so that token weighting matters."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab, (rows, SEQ), generator=gen)
    y = (5 * x + 3) % CFG.vocab
    y[0, :] = -100
    y[1, 1:] = -100
    return x, y


pytestmark = pytest.mark.usefixtures("float64")  # this file's in-process tests run in float64 (conftest.py)


def _engine(topo=None, *, microbatches=2, engine_kwargs=None, **module_kwargs) -> pipekit.PipelineEngine:
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, seed=SEED,
                                    microbatches=microbatches, **module_kwargs)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    return pipekit.PipelineEngine(module, optimizer=opt, **(engine_kwargs or {}))


def _weights(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _reference() -> Reference:
    """The whole model in one process, trained with the same SGD on the whole batches."""
    return Reference(toy_lm(CFG), lm_loss, functools.partial(torch.optim.SGD, lr=LR), seed=SEED)


# ---- the batch: the thing itself or an iterator ----------------------------------------------
def test_train_batch_takes_a_tuple_a_list_a_generator_or_a_data_loader_iterator():
    x, y = _batch(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    forms = {"tuple": (x, y), "list": [x, y], "generator": (b for b in [(x, y)]), "loader": iter(loader)}
    runs = {}
    for name, data in forms.items():
        engine = _engine()
        runs[name] = (engine.train_batch(data, reduce_loss=True), _weights(engine))
    loss, weights = runs["tuple"]
    assert all(r[0] == loss and _same(r[1], weights) for r in runs.values()), {k: r[0] for k, r in runs.items()}


def test_anything_else_is_refused_with_a_clear_error():
    x, y = _batch(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    engine = _engine()
    assert "or an iterator of batches, got dict" in _error(lambda: engine.train_batch({"inputs": x, "labels": y}))
    assert "pass iter(loader) for a DataLoader" in _error(lambda: engine.train_batch(loader))
    assert "a batch must be a pair (inputs, labels)" in _error(lambda: engine.train_batch((x, y, y)))
    assert "got tuple of 3" in _error(lambda: engine.eval_batch((x, y, y)))
    assert "holds stages [0] and needs the inputs (stage 0 reads them) and the labels" in _error(
        lambda: engine.train_batch(None))


# ---- the loss: no communication unless asked -----------------------------------------------------
def test_the_loss_is_a_tensor_by_default_and_a_float_when_asked():
    x, y = _batch(0)
    want = _reference().loss((x, y))
    engine = _engine()
    local = engine.eval_batch((x, y))
    assert isinstance(local, torch.Tensor) and local.dim() == 0 and local.dtype == torch.float64
    assert not local.requires_grad and abs(local.item() - want) < TOL
    reduced = engine.eval_batch((x, y), reduce_loss=True)
    assert isinstance(reduced, float) and abs(reduced - want) < TOL
    loss, out = engine.eval_batch((x, y), return_outputs=True)
    assert abs(loss.item() - want) < TOL and out.shape == (BATCH, SEQ, CFG.vocab)
    trained = engine.train_batch((x, y))
    assert isinstance(trained, torch.Tensor) and abs(trained.item() - want) < TOL


# ---- the schedule, declared once --------------------------------------------------------------
def test_interleaving_is_declared_once_on_the_module():
    declared = _engine(schedule="interleaved_1f1b", chunks_per_rank=2)
    assert (declared.schedule.name, declared.schedule.chunks_per_rank) == ("interleaved_1f1b", 2)
    assert declared.schedule is declared.module.schedule  # the engine runs the module's
    built = _engine(schedule=build_schedule("interleaved_1f1b", 1, 2, 2), microbatches=None)  # the same, as a Schedule
    batch = _batch(0)
    losses = [e.train_batch(batch, reduce_loss=True) for e in (declared, built)]
    assert losses[0] == losses[1] and _same(_weights(declared), _weights(built))


def test_a_schedule_on_the_module_brings_its_chunks_placement_and_microbatches():
    zbv = _engine(schedule="zbv", microbatches=4)  # its own chunks (2) and placement (v)
    assert (zbv.schedule.name, zbv.module.chunks_per_rank, zbv.num_microbatches) == ("zbv", 2, 4)
    assert zbv.module.placement == (0, 0)
    table = build_schedule("zb_h1", 1, 4)
    for microbatches in (None, 4):  # a Schedule's own count, or the same count said again
        module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, seed=SEED, schedule=table,
                                        microbatches=microbatches)
        engine = pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=LR))
        assert engine.schedule is table and engine.num_microbatches == 4
    assert pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss).schedule.name == "1f1b"  # the default, built


def test_interleaved_1f1b_with_one_chunk_is_refused_not_run_as_1f1b():
    assert _engine(schedule="interleaved_1f1b").module.chunks_per_rank == 2  # named alone: its own 2 chunks
    with pytest.raises(ScheduleError, match=r"got chunks_per_rank=1 \(with one it is plain 1F1B"):
        _engine(schedule="interleaved_1f1b", chunks_per_rank=1)
    with pytest.raises(ScheduleError, match=r"got chunks_per_rank=1.*schedule='interleaved_1f1b', chunks_per_rank=2"):
        _engine(schedule="interleaved_1f1b", chunks_per_rank=1)
    with pytest.raises(ScheduleError, match=r"got chunks_per_rank=1"):
        _engine(schedule=build_schedule("interleaved_1f1b", 1, 2, 1), microbatches=None)


def test_the_schedule_is_said_once_on_the_module():
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss)
    for kwargs in ({"schedule": "1f1b"}, {"num_microbatches": 2}, {"schedule": "zbv", "num_microbatches": 4}):
        with pytest.raises(TypeError, match=r"declare it there: PipelineModule\(\.\.\., schedule=\.\.\., "
                                            r"microbatches=\.\.\.\)"):
            pipekit.PipelineEngine(module, **kwargs)
    with pytest.raises(ScheduleError, match=r"1f1b runs 1 chunk per rank, got chunks_per_rank=2"):
        _engine(chunks_per_rank=2)  # virtual stages need a schedule that runs them
    with pytest.raises(TypeError, match=r"placement"):
        pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, schedule="zbv", placement="looping")
    with pytest.raises(ScheduleError, match=r"zbv runs 2 chunks per rank, got chunks_per_rank=3"):
        _engine(schedule="zbv", chunks_per_rank=3)
    with pytest.raises(TypeError, match=r"schedule must be a registered name .* got int"):
        _engine(schedule=3)
    table = build_schedule("zb_h1", 1, 4)
    with pytest.raises(ValueError, match=r"microbatches=2, but schedule 'zb_h1' runs 4; leave microbatches out"):
        _engine(schedule=table, microbatches=2)
    with pytest.raises(ValueError, match=r"chunks_per_rank=2, but schedule 'zb_h1' runs 1"):
        _engine(schedule=table, microbatches=None, chunks_per_rank=2)
    with pytest.raises(ValueError, match=r"schedule 'zb_h1' is for pp=2, but the topology has pp=1"):
        _engine(schedule=build_schedule("zb_h1", 2, 4), microbatches=None)


# ---- the action handlers: one table, registrable -------------------------------------------------
def test_an_action_kind_s_handler_can_be_registered_and_an_unknown_one_is_named():
    forward = pipekit.engine.PipelineEngine._forward
    seen = []

    def counted_forward(engine, step, action):
        seen.append(str(action))
        forward(engine, step, action)

    pipekit.engine.register_action("F", counted_forward, replace=True)
    try:
        engine = _engine()  # engines built from now on take the registered handler
    finally:
        pipekit.engine.register_action(Kind.F, forward, replace=True)
    assert engine.train_batch(_batch(0), reduce_loss=True) == _engine().train_batch(_batch(0), reduce_loss=True)
    assert seen == ["0F0", "0F1"] and _engine().handlers[Kind.F] is forward
    with pytest.raises(ValueError, match=r"action kind F already has a handler; pass replace=True"):
        pipekit.engine.register_action(Kind.F, forward)
    with pytest.raises(ValueError, match=r"unknown action kind 'X'; the kinds are F, "):
        pipekit.engine.register_action("X", forward)
    del engine.handlers[Kind.B]  # this engine's own table
    with pytest.raises(pipekit.PipelineError, match=r"(?s)failed at action #1 0B0 .*KeyError.*no handler for action "
                                                    r"kind B; register one.*>>    1 0B0"):
        engine.train_batch(_batch(1))


# ---- two ranks, started the torch.multiprocessing way ---------------------------------------------
@in_float64
def _two_ranks(store_file: str) -> dict:
    """Every two-rank check, in one group; its result is checked by the tests below."""
    rank = int(os.environ["RANK"])
    if rank == 0:  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set: init_distributed() joins them ...
        pipekit.init_distributed()
    topo = pipekit.Topology(pp=2)  # ... and so does a Topology built without it (rank 1)
    out = {"grid": (dist.get_backend(), dist.get_world_size(), topo.rank, topo.pp_rank, str(topo.device))}
    out.update(_only_what_each_rank_uses(topo))
    out.update(_middle_rank_passes_nothing(topo))
    out.update(_shapes_are_agreed_once(topo))
    out.update(_loss_per_replica(pipekit.Topology(pp=1, dp=2)))
    out.update(_declared_once_at_pp2(topo))
    out.update(_receives_posted_ahead(topo))
    out.update(_plain_optimizer_unused_parameter(pipekit.Topology(pp=1, dp=2)))
    out.update(_plain_optimizer_empty_stage(topo))
    out.update(_plain_optimizer_experts(pipekit.Topology(pp=1, dp=2, ep=2)))
    first_loss = out["losses_full"][0]
    dist.destroy_process_group()
    # The script's own group (torch.multiprocessing without those variables): init_distributed is a no-op.
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        del os.environ[key]
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    group = dist.group.WORLD
    pipekit.init_distributed()
    engine = _engine(pipekit.Topology(pp=2))
    out["own_group"] = (dist.group.WORLD is group, engine.train_batch(_batch(0), reduce_loss=True) == first_loss)
    return out


def _only_what_each_rank_uses(topo) -> dict:
    """pp=2, 1F1B: rank 0 gets (inputs, None), rank 1 (None, labels), against every rank getting both."""
    first = topo.pp_rank == 0
    full, lean, ref = _engine(topo), _engine(topo), _reference()
    out = {"losses_full": [], "losses_lean": [], "losses_ref": []}
    for step in range(2):
        x, y = _batch(step)
        out["losses_full"].append(full.train_batch((x, y), reduce_loss=True))
        got = lean.train_batch((x, None) if first else (None, y))
        out["losses_lean"].append(None if got is None else (got.dtype, got.dim(), got.item()))
        out["losses_ref"].append(ref.step((x, y)))
    out["lean_same_weights"] = _same(_weights(full), _weights(lean))
    x, y = _batch(5)
    out["eval_lean"] = lean.eval_batch((x, None) if first else (None, y))
    out["eval_lean"] = None if out["eval_lean"] is None else out["eval_lean"].item()
    out["eval_full"] = full.eval_batch((x, y), reduce_loss=True)
    out["eval_ref"] = ref.loss((x, y))
    # shapes may change between steps while every rank passes its inputs (4 rows, not 8)
    x, y = _batch(6, rows=4)
    out["changed_shape"] = (full.train_batch((x, y), reduce_loss=True), ref.step((x, y)))
    # ... but not where a rank passed none at the first step: the rank of stage 0 refuses
    # before communicating (rank 1 sits this one out); nor may a rank given inputs then go without
    if first:
        out["lean_new_shape"] = _error(lambda: lean.train_batch((x, None)))
    else:
        out["full_without_inputs"] = _error(lambda: full.train_batch((None, y)))
    # a rank that needs data and got None: named, before any communication
    needy = _engine(topo)
    out["needs"] = _error(lambda: needy.train_batch((None, y) if first else (x, None)))
    out["needs_nothing_given"] = _error(lambda: needy.eval_batch(None))
    return out


def _middle_rank_passes_nothing(topo) -> dict:
    """ZBV at pp=2 (declared on the module): rank 0 holds stages 0 and 3, rank 1 only middle ones."""
    first = topo.pp_rank == 0
    full = _engine(topo, schedule="zbv", microbatches=4)
    lean = _engine(topo, schedule="zbv", microbatches=4)
    out = {"zbv": (lean.schedule.name, lean.module.local_stages), "zbv_losses": []}
    for step in range(2):
        x, y = _batch(step)
        want = full.train_batch((x, y))
        got = lean.train_batch((x, y) if first else None)
        out["zbv_losses"].append(None if got is None else (got.item(), want.item()))
    out["zbv_same_weights"] = _same(_weights(full), _weights(lean))
    x, y = _batch(5)
    got, want = lean.eval_batch((x, y) if first else None), full.eval_batch((x, y))
    out["zbv_eval"] = None if got is None else (got.item(), want.item())
    return out


def _shapes_are_agreed_once(topo) -> dict:
    """A middle-rank-free check that None inputs work from the first step, with eval first."""
    first = topo.pp_rank == 0
    engine = _engine(topo, microbatches=4)
    x, y = _batch(3)
    losses = [engine.eval_batch((x, None) if first else (None, y), reduce_loss=True),
              engine.train_batch((x, None) if first else (None, y), reduce_loss=True)]
    return {"eval_first": losses, "eval_first_ref": _reference().loss((x, y))}


def _loss_per_replica(topo) -> dict:
    """pp=1 x dp=2: each replica's own loss by default; the global batch's when asked."""
    x, y = _batch(4)
    rows = slice(topo.dp_rank * BATCH // 2, (topo.dp_rank + 1) * BATCH // 2)
    ref = _reference()
    engine = _engine(topo)
    mine = engine.eval_batch((x[rows], y[rows]))
    both = engine.eval_batch((x[rows], y[rows]), reduce_loss=True)
    return {"replica": (mine.item(), ref.loss((x[rows], y[rows]))), "global": (both, ref.loss((x, y))),
            "trained_replica": (engine.train_batch((x[rows], y[rows])).item(), ref.loss((x[rows], y[rows])))}


def _declared_once_at_pp2(topo) -> dict:
    declared = _engine(topo, schedule="interleaved_1f1b", chunks_per_rank=2)
    old = _engine(topo, schedule=build_schedule("interleaved_1f1b", 2, 2, 2), microbatches=None)  # as a Schedule
    batch = _batch(0)
    losses = [e.train_batch(batch, reduce_loss=True) for e in (declared, old)]
    return {"interleaved_pp2": (declared.schedule.name, declared.module.local_stages, losses[0] == losses[1],
                                _same(_weights(declared), _weights(old)))}


def _receives_posted_ahead(topo) -> dict:
    """The same steps with receives posted at need (0), one ahead, the default and all at once:
    the same losses and weights, on a schedule whose ranks exchange both ways (ZBV) and on GPipe."""
    out = {}
    for name in ("zbv", "gpipe"):
        engines = {ahead: _engine(topo, schedule=name, microbatches=4,
                                  engine_kwargs=None if ahead is None else {"recv_ahead": ahead})
                   for ahead in (0, 1, None, 1000)}
        losses = {ahead: [e.train_batch(_batch(step), reduce_loss=True) for step in range(2)]
                  for ahead, e in engines.items()}
        losses[0].append(engines[0].eval_batch(_batch(5), reduce_loss=True))
        losses[1000].append(engines[1000].eval_batch(_batch(5), reduce_loss=True))
        same = [losses[a] == losses[0][:len(losses[a])] and _same(_weights(e), _weights(engines[0]))
                for a, e in engines.items()]
        out[f"ahead_{name}"] = (same, losses[0][-1] == losses[1000][-1], engines[None].recv_ahead)
    return out


class WithUnused(torch.nn.Module):
    """A linear map beside a parameter that no forward uses: it never gets a gradient."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.unused = torch.nn.Parameter(torch.ones(dim))

    def forward(self, h):
        return torch.tanh(self.lin(h))


def _double(x):
    return 2.0 * x


def _against_one_process(specs, engines: dict, topo, steps: int = 2, **module_kwargs) -> dict:
    """Train each engine (name -> optimizer maker) on this replica's rows and the whole specs in
    one process with torch's AdamW on the whole batch; the worst weight difference per engine."""
    ref = Reference(specs, lm_loss, functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.1), seed=SEED)
    trained = {}
    for name, make in engines.items():
        module = pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=topo, seed=SEED, microbatches=2,
                                        **module_kwargs)
        engine = pipekit.PipelineEngine(module, optimizer=make(module))
        for step in range(steps):
            engine.train_batch(ref.rows(_batch(step), topo))
        trained[name] = module
    for step in range(steps):
        ref.step(_batch(step))
    return {name: ref.compare(module, topo, grads=False, what=name) for name, module in trained.items()}


def _plain_optimizer_unused_parameter(topo) -> dict:
    """pp=1 x dp=2, a plain torch AdamW: a parameter that got no gradient anywhere stays put
    (weight decay, moments and all), as in one process."""
    specs = [LayerSpec(torch.nn.Embedding, CFG.vocab, 8), LayerSpec(WithUnused, 8), LayerSpec(torch.nn.Linear, 8,
                                                                                               CFG.vocab)]
    adamw = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)}
    return {"unused_param": _against_one_process(specs, adamw, topo)}


def _plain_optimizer_empty_stage(topo) -> dict:
    """pp=2, stage 1 a lone function (no parameters on rank 1): a torch optimizer class or
    factory works on every rank, and an instance wherever there are parameters to give it."""
    specs = [LayerSpec(torch.nn.Embedding, CFG.vocab, 8), LayerSpec(torch.nn.Linear, 8, CFG.vocab), _double]
    factory = functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.1)
    makers = {"factory": lambda m: factory,
              "instance": lambda m: factory(m.parameters()) if list(m.parameters()) else factory}
    return {"empty_stage": _against_one_process(specs, makers, topo, partition=[0, 2, 3]),
            "empty_stage_params": len(list(pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=topo,
                                                                   partition=[0, 2, 3]).parameters()))}


def _trained_weights(specs, loss, make, topo, batches) -> list[torch.Tensor]:
    module = pipekit.PipelineModule(specs, loss_fn=loss, topology=topo, seed=SEED, microbatches=2)
    engine = pipekit.PipelineEngine(module, optimizer=make(module))
    for batch in batches:
        engine.train_batch(batch)
    return _weights(engine)


def _plain_optimizer_experts(topo) -> dict:
    """pp=1 x dp=2 x ep=2 (the experts shared out over the two ranks): a plain AdamW over
    module.parameters() trains exactly as ZeroOptimizer given the expert groups explicitly
    (their own dp group, summed over ep), which is what `pipekit train` builds."""
    cfg = get_model("mixtral", "tiny", n_layers=1)
    gen = torch.Generator().manual_seed(10 + topo.dp_rank)
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in torch.randint(0, 256, (2, 4, 9), generator=gen)]

    def explicit(module):
        experts = [p for p in module.parameters() if getattr(p, "expert_parallel", False)]
        others = [p for p in module.parameters() if not getattr(p, "expert_parallel", False)]
        groups = [{"params": others}, {"params": experts, "dp_group": topo.edp_group, "ep_group": topo.ep_group}]
        return ZeroOptimizer(groups, "adamw", module=module, lr=LR)

    plain = _trained_weights(model_specs(cfg), model_loss(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                             topo, batches)
    return {"experts": (_same(plain, _trained_weights(model_specs(cfg), model_loss(cfg), explicit, topo, batches)),
                        len(plain))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("own-group") / "store")
    return run_distributed(_two_ranks, 2, store, init="env", timeout=240)


def test_torch_multiprocessing_with_env_variables_works_as_torchrun(two_ranks):
    assert [r["grid"] for r in two_ranks] == [("gloo", 2, 0, 0, "cpu"), ("gloo", 2, 1, 1, "cpu")]


def test_a_scripts_own_process_group_is_used_as_it_is(two_ranks):
    assert all(r["own_group"] == (True, True) for r in two_ranks)


def test_each_rank_needs_only_the_data_its_stages_use(two_ranks):
    r0, r1 = two_ranks
    assert r0["lean_same_weights"] and r1["lean_same_weights"]  # bit-identical to every rank given everything
    assert r0["losses_lean"] == [None, None]
    for (dtype, dim, got), full, ref in zip(r1["losses_lean"], r1["losses_full"], r1["losses_ref"]):
        assert dtype == torch.float64 and dim == 0
        assert abs(got - full) < TOL and abs(full - ref) < TOL  # dp=1: this replica is the global batch
    assert r0["losses_full"] == r1["losses_full"]
    assert r0["eval_lean"] is None and abs(r1["eval_lean"] - r1["eval_ref"]) < TOL
    assert abs(r0["eval_full"] - r0["eval_ref"]) < TOL


def test_a_middle_rank_passes_nothing(two_ranks):
    r0, r1 = two_ranks
    assert r0["zbv"] == ("zbv", [0, 3]) and r1["zbv"] == ("zbv", [1, 2])
    assert r0["zbv_same_weights"] and r1["zbv_same_weights"]
    assert r1["zbv_losses"] == [None, None] and r1["zbv_eval"] is None
    assert all(got == want for got, want in r0["zbv_losses"]) and r0["zbv_eval"][0] == r0["zbv_eval"][1]


def test_shapes_come_from_the_first_step_even_an_eval_step(two_ranks):
    for r in two_ranks:
        assert all(abs(loss - r["eval_first_ref"]) < TOL for loss in r["eval_first"])


def test_shapes_may_change_between_steps_when_every_rank_passes_inputs(two_ranks):
    for r in two_ranks:
        got, want = r["changed_shape"]
        assert abs(got - want) < TOL


def test_a_shape_change_that_a_rank_cannot_know_fails_clearly(two_ranks):
    r0, r1 = two_ranks
    assert ("ValueError: rank 0 (pp_rank 0, dp_rank 0, stages [0]): the inputs' microbatch shapes changed from "
            "[4, 3] int64 at the first step to [2, 3] int64, but pipeline rank(s) [1] passed no inputs then"
            in r0["lean_new_shape"])
    assert ("ValueError: rank 1 (pp_rank 1, dp_rank 0, stages [1]) got no inputs, but it was given them at the "
            "first step" in r1["full_without_inputs"])


def test_a_rank_that_needs_data_and_got_none_is_told_what(two_ranks):
    r0, r1 = two_ranks
    assert ("ValueError: rank 0 (pp_rank 0, dp_rank 0) holds stages [0] and needs the inputs (stage 0 reads them), "
            "but got None; pass them on this rank" in r0["needs"])
    assert ("rank 1 (pp_rank 1, dp_rank 0) holds stages [1] and needs the labels (the last stage, 1, computes "
            "the loss)" in r1["needs"])
    assert "holds stages [0] and needs the inputs" in r0["needs_nothing_given"]
    assert "holds stages [1] and needs the labels" in r1["needs_nothing_given"]


def test_the_default_loss_is_each_replicas_own_and_the_asked_one_the_global_batchs(two_ranks):
    for r in two_ranks:
        for what in ("replica", "global", "trained_replica"):
            got, want = r[what]
            assert abs(got - want) < TOL, (what, got, want)
    assert two_ranks[0]["replica"][1] != two_ranks[1]["replica"][1]  # the replicas' losses differ


def test_interleaving_declared_on_the_module_at_pp2(two_ranks):
    assert two_ranks[0]["interleaved_pp2"] == ("interleaved_1f1b", [0, 2], True, True)
    assert two_ranks[1]["interleaved_pp2"] == ("interleaved_1f1b", [1, 3], True, True)


def test_receives_posted_ahead_change_nothing_but_the_wait(two_ranks):
    for r in two_ranks:
        for name in ("zbv", "gpipe"):
            assert r[f"ahead_{name}"] == ([True] * 4, True, 4), (name, r[f"ahead_{name}"])


def test_a_plain_optimizer_leaves_a_parameter_without_gradient_alone_at_dp2(two_ranks):
    for r in two_ranks:
        assert r["unused_param"]["adamw"] <= TOL, r["unused_param"]


def test_a_plain_optimizer_reduces_experts_over_their_own_groups_at_ep2(two_ranks):
    assert all(r["experts"][0] and r["experts"][1] > 0 for r in two_ranks), [r["experts"] for r in two_ranks]


def test_a_plain_optimizer_on_a_half_precision_model_gets_fp32_master_weights():
    x, y = _batch(0)
    runs = {}
    for name, make in {"plain": lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                       "zero": lambda m: ZeroOptimizer(m, "adamw", lr=LR)}.items():
        module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, seed=SEED, microbatches=2, precision="bf16")
        engine = pipekit.PipelineEngine(module, optimizer=make(module))
        for step in range(2):
            engine.train_batch(_batch(step))
        runs[name] = (_weights(engine), {b.master.dtype for b in engine.optimizer.buckets})
    assert _same(runs["plain"][0], runs["zero"][0]) and runs["plain"][1] == {torch.float32}


def test_a_plain_optimizer_is_wrapped_once_fresh_and_anything_else_is_named():
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, seed=SEED)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    assert isinstance(engine.optimizer, ZeroOptimizer) and engine.optimizer.stage == 0
    assert engine.optimizer.param_groups is opt.param_groups  # an LR scheduler made for `opt` still applies
    engine.train_batch(_batch(0))
    assert not opt.state  # the wrapper steps; the torch optimizer it was made from holds nothing
    other = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, seed=SEED)
    used = torch.optim.SGD(other.parameters(), lr=LR, momentum=0.9)
    other(torch.zeros(1, SEQ, dtype=torch.long)).sum().backward()
    used.step()
    with pytest.raises(ValueError, match=r"SGD already holds state .* wrap a fresh one"):
        pipekit.PipelineEngine(other, optimizer=used)
    with pytest.raises(TypeError, match=r"optimizer must be a pipekit.optim.ZeroOptimizer, .* got str"):
        pipekit.PipelineEngine(module, optimizer="adamw")


def test_a_stage_without_parameters_works_with_a_plain_optimizer(two_ranks):
    assert [r["empty_stage_params"] for r in two_ranks] == [3, 0]  # rank 1 holds nothing to optimise
    for r in two_ranks:
        assert all(worst <= TOL for worst in r["empty_stage"].values()), r["empty_stage"]


def test_recv_ahead_must_be_a_count():
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"recv_ahead must be an int >= 0 .* got " + re.escape(repr(bad))):
            pipekit.PipelineEngine(_engine().module, recv_ahead=bad)


# ---- one rank: a plain process, and RANK=0 WORLD_SIZE=1 ------------------------------------------
@in_float64
def _world_of_one() -> dict:
    out = {}
    pipekit.init_distributed()  # plain `python script.py`: no variables, no group needed
    out["plain"] = (dist.is_initialized(), repr(pipekit.Topology()))
    engine = _engine()
    out["plain_loss"] = engine.train_batch(_batch(0), reduce_loss=True)
    weights = _weights(engine)
    os.environ.update(WORLD_SIZE="2", RANK="0")
    out["no_master"] = _error(pipekit.init_distributed)
    del os.environ["WORLD_SIZE"]
    out["rank_only"] = _error(pipekit.init_distributed)
    os.environ.update(WORLD_SIZE="1")  # a launcher's one worker, without MASTER_ADDR / MASTER_PORT
    pipekit.init_distributed()
    topo = pipekit.Topology()
    out["one_rank_group"] = (dist.is_initialized(), dist.get_world_size(), repr(topo), topo.pp_group, topo.dp_group)
    engine = _engine(topo)
    out["group_loss"] = engine.train_batch(_batch(0), reduce_loss=True)
    out["same_weights"] = _same(weights, _weights(engine))
    return out


@pytest.fixture(scope="module")
def world_of_one():
    return run_distributed(_world_of_one, 1, init="none", timeout=120)[0]


def test_world_size_one_works_with_or_without_a_launcher(world_of_one):
    r = world_of_one
    grid = "Topology(pp=1, dp=1, tp=1, rank=0 -> pp_rank=0, dp_rank=0, tp_rank=0)"
    assert r["plain"] == (False, grid)
    assert r["one_rank_group"] == (True, 1, grid, None, None)
    assert r["plain_loss"] == r["group_loss"] and r["same_weights"]


def test_a_launch_missing_its_variables_is_named(world_of_one):
    assert ("ValueError: RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR and MASTER_PORT are not"
            in world_of_one["no_master"])
    assert "ValueError: RANK=0 is set but WORLD_SIZE is not" in world_of_one["rank_only"]
