"""ZeRO stage 3 (FSDP2 inside pipeline stages): every layout equals one process.

On 4 gloo ranks, float64, GPT-2 (embedding and head tied: at pp=2 they live on two
pipeline ranks) trains 3 AdamW steps with global-norm clipping under
`ZeroOptimizer(stage=3)`: every layer FSDP-sharded over dp, gradients reduce-scattered
once per step. Layouts: dp=4; pp=2 x dp=2 with 1F1B, ZBV (split backward: I and W
accumulate into the gathered parameters) and 1F1B re-gathering the parameters per
microbatch (`reshard_after_forward`); tp=2 x dp=2 (FSDP shards the tp shards). Each rank
checks its loss, the clipping norm, every gradient shard and every gathered weight
against one process within 1e-10, and that each sharded parameter holds 1/dp of the
elements.
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer
from pipekit.testing import reference_model, reference_name, reference_slice, run_distributed

TOL = 1e-10
SEED = 3
BATCH, SEQ, STEPS, CLIP = 8, 8, 3, 0.5
GPT2 = dict(vocab_size=40, max_seq_len=16, n_layers=3, dim=16, n_heads=4)
CASES = [  # (pp, dp, tp, schedule, microbatches, reshard_after_forward)
    (1, 4, 1, "1f1b", 2, False),
    (2, 2, 1, "1f1b", 2, False),
    (2, 2, 1, "zbv", 4, False),
    (2, 2, 1, "1f1b", 2, True),
    (1, 2, 2, "gpipe", 2, False),
]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def run_case(pp, dp, tp, name, microbatches, reshard) -> dict:
    from torch.distributed.tensor import DTensor

    torch.set_default_dtype(torch.float64)
    cfg = get_model("gpt2", "tiny", **GPT2)
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED, schedule=name,
                                    microbatches=microbatches)
    zero = ZeroOptimizer(module, "adamw", stage=3, lr=1e-2, weight_decay=0.1, clip_grad_norm=CLIP,
                         reshard_after_forward=reshard)
    engine = pipekit.PipelineEngine(module, optimizer=zero)
    ref = reference_model(specs, SEED)
    ref_loss_fn = model_loss(cfg).build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_params = dict(ref.named_parameters())
    params = list(module.named_parameters())
    worst = {"loss": 0.0, "weight": 0.0, "grad_norm": 0.0}
    sharded = [n for n, p in params if isinstance(p, DTensor)]
    fraction = max((p.to_local().numel() / p.numel() for _, p in params if isinstance(p, DTensor)), default=1.0)
    gen = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        ids = torch.randint(0, 40, (BATCH, SEQ + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:]
        rows = slice(topo.dp_rank * BATCH // dp, (topo.dp_rank + 1) * BATCH // dp)
        loss = engine.train_batch(iter([(x[rows], y[rows])]), reduce_loss=True)
        ref_opt.zero_grad()
        ref_loss = ref_loss_fn(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        ref_opt.step()
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss.item()))
        worst["grad_norm"] = max(worst["grad_norm"], abs(engine.last_grad_norm - ref_norm))
        for n, p in params:
            r = ref_params[reference_name(n, specs)]
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            worst["weight"] = max(worst["weight"], _diff(full, reference_slice(r.detach(), p, topo)))
    return {"worst": worst, "sharded": len(sharded), "params": len(params), "fraction": fraction,
            "clipped": ref_norm > CLIP, "dp": dp}


def check() -> list:
    return [run_case(*case) for case in CASES]


@pytest.fixture(scope="module")
def results():
    return run_distributed(check, 4, timeout=400)


def test_zero3_layouts_match_one_process(results):
    for rank, res in enumerate(results):
        for case, r in zip(CASES, res):
            where = f"rank {rank}, (pp, dp, tp, schedule, M, reshard_after_forward)={case}"
            for what, diff in r["worst"].items():
                assert diff <= TOL, f"{where}: {what} differs by {diff:.3g}"
            assert r["clipped"], f"{where}: the clipping never acted"
            assert r["sharded"] == r["params"], f"{where}: {r['params'] - r['sharded']} parameters not sharded"
            assert r["fraction"] <= 1 / r["dp"] + 0.25, f"{where}: a rank holds {r['fraction']:.2f} of a parameter"
