"""Overlapped schedules: a forward beside a backward, equal to one process.

`schedule.overlap` (`build_schedule(..., overlap=True)`) merges neighbouring forward
and backward actions into OVERLAP actions, which the engine runs on two threads with
the backward's collectives on twin groups (`pipekit.comm.lane`). On 8 gloo ranks, float64,
a Mixtral-style model (16 experts, top-1, 1 sequence of 4 tokens per microbatch and
rank, so experts go without tokens) trains 3 AdamW steps with global-norm clipping:

- pp=2 x dp=4 x ep=2 with 1F1B (its first rank overlaps; its last cannot: each of its
  forwards feeds the backward after it), and
- pp=2 x dp=2 x tp=2 x ep=2, expert-TP, DualPipe-V (both ranks overlap, the all-to-all
  and the tp all-reduces inside both lanes),

and every rank checks the loss, the clipping norm, every gradient and weight against
one process within 1e-10, and that its overlapped actions ran. The schedule-level
checks (pairing, lowering, validation, simulation) are in tests/test_schedules.py.
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.moe import Router
from pipekit.schedules import Kind, build_schedule
from pipekit.testing import Reference, in_float64, run_distributed

TOL = 1e-10
SEED = 7
BATCH, SEQ, STEPS, CLIP = 8, 4, 3, 0.05
MIXTRAL = dict(vocab_size=32, max_seq_len=16, n_layers=4, dim=16, n_heads=4, n_kv_heads=2, hidden=8,
               n_experts=16, top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0)
CASES = [  # (pp, dp, tp, ep, expert_tp, schedule, microbatches)
    (2, 4, 1, 2, False, "1f1b", 2),
    (2, 2, 2, 2, True, "dualpipe_v", 4),
]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@in_float64
def run_case(pp, dp, tp, ep, expert_tp, name, microbatches) -> dict:
    cfg = get_model("mixtral", "tiny", **MIXTRAL)
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, ep=ep, expert_tp=expert_tp)
    schedule = build_schedule(name, pp, microbatches, overlap=True)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED, schedule=schedule)
    engine = pipekit.PipelineEngine(module, optimizer=_adamw(module.parameters()), clip_grad_norm=CLIP,
                                    record_timeline=True)
    ref = Reference(specs, model_loss(cfg).build(), _adamw, seed=SEED, clip=CLIP)
    counts: list[torch.Tensor] = []
    for m in ref.model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda mod, args, out: counts.append(out.counts_E))
    gen = torch.Generator().manual_seed(5)
    dead = overlapped = 0
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (BATCH, SEQ + 1), generator=gen)
        counts.clear()
        ref.train_beside(engine, (ids[:, :-1], ids[:, 1:]))
        overlapped += sum("+" in e.action for e in engine.timeline)
        dead += sum(int((c == 0).sum()) for c in counts)
        ref.compare(module, topo)
    planned = sum(a.kind is Kind.OVERLAP for a in schedule.ranks[topo.pp_rank]) * STEPS
    return {"worst": ref.worst, "dead": dead, "clipped": ref.grad_norm > CLIP, "overlapped": overlapped,
            "planned": planned, "pp_rank": topo.pp_rank}


def check() -> list:
    return [run_case(*case) for case in CASES]


@pytest.fixture(scope="module")
def results():
    return run_distributed(check, 8, timeout=400)


def test_overlapped_schedules_match_one_process(results):
    for rank, res in enumerate(results):
        for case, r in zip(CASES, res):
            where = f"rank {rank}, (pp, dp, tp, ep, expert_tp, schedule, M)={case}"
            for what, diff in r["worst"].items():
                assert diff <= TOL, f"{where}: {what} differs by {diff:.3g}"
            assert r["dead"] > 0, f"{where}: every expert got a token in every step; the test lost its point"
            assert r["clipped"], f"{where}: the clipping never acted"
            assert r["overlapped"] == r["planned"], where
        assert res[0]["overlapped"] > 0 or res[0]["pp_rank"] == 1, f"rank {rank}: 1F1B's first rank overlapped nothing"
        assert res[1]["overlapped"] > 0, f"rank {rank}: DualPipe-V overlapped nothing"


def test_overlap_is_refused_where_it_cannot_run_in_one_line(tmp_path):
    from types import SimpleNamespace

    from pipekit.config import ConfigError, load_config
    from pipekit.engine import PipelineEngine

    table = tmp_path / "mine.txt"
    table.write_text("0F0 0F1+0B0 0B1\n")
    with pytest.raises(ConfigError, match=r"the action table .*mine.txt states its own: write the pairs in it"):
        load_config(None, [f"schedule.name={table}", "schedule.overlap=true", "parallel.pp=1",
                           "schedule.microbatches=2"])
    assert load_config(None, [f"schedule.name={table}", "parallel.pp=1", "schedule.microbatches=2"])
    with pytest.raises(ConfigError, match=r"1f1b at parallel.pp=1 with schedule.microbatches=1 runs no forward next "
                                          r"to a backward of another microbatch, so nothing would overlap"):
        load_config(None, ["schedule.overlap=true", "parallel.pp=1", "schedule.microbatches=1"])
    with pytest.raises(ConfigError, match=r"optimizer.zero_stage=3 cannot run with schedule.overlap=true yet"):
        load_config(None, ["schedule.overlap=true", "parallel.dp=2", "optimizer.zero_stage=3"])
    zero3 = SimpleNamespace(topo=SimpleNamespace(device=torch.device("cuda", 0)), schedule=SimpleNamespace(name="1f1b"),
                            optimizer=SimpleNamespace(sharded_layers=[object()]))
    with pytest.raises(ValueError, match=r"schedule '1f1b' \(OVERLAP actions\): stage=3 cannot run with "
                                         r"overlap=True yet"):
        PipelineEngine._open_lanes(zero3)  # ZeRO-3 through the API, on a GPU as on the CPU
