"""Whole models with the Triton kernels (in Triton's CPU interpreter) against the same models
with the PyTorch references, float32.

One process: a tiny GPT-2 (LayerNorm), Llama (RMSNorm, rotary, SwiGLU) and Mixtral-style
model (the same, SwiGLU inside the experts) — the loss and every parameter's gradient with
kernels("triton") equal kernels("torch") within TOL. Then pp=2: one spawned gloo group where
each worker calls `set_kernels("triton")` and trains a PipelineEngine for 2 steps (SGD, then
AdamW), against the one-process nn.Sequential trained with kernels("torch") in this process.

Tolerance TOL = 1e-5 relative and absolute (torch.testing.assert_close): the kernels differ
from the references by a few ulps only (the norms' row statistics and their weight
gradients are summed in another order — the weight gradient as per-block partial sums then
a sum over blocks; SwiGLU's sigmoid is computed another way); those
differences pass through two blocks, the loss and the backward's matmuls. Measured here:
losses within 9.5e-7 (at ~5.5), gradients within 9e-8 at magnitudes up to 0.44; at pp=2
after 2 SGD steps (lr 0.1) the weights within 6e-8. AdamW's weights are held to
ADAMW_ATOL = 1e-4 (lr / 10) instead: Adam divides each element's update by that element's
own gradient history, so where a gradient is near zero its few-ulp difference is a large
relative one and the step moves by a visibly different fraction of lr (measured 8.5e-6,
too close to 1e-5 to be a stable bound); 1e-4 still catches any real error, which moves
weights by ~lr.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import pipekit
from pipekit.kernels import glu as glu_kernels
from pipekit.kernels import kernels, set_kernels
from pipekit.kernels import norm as norm_kernels
from pipekit.kernels import rotary as rotary_kernels
from pipekit.models import get_model, model_loss, model_specs
from pipekit.testing import Reference, reference_name, run_distributed

pytest.importorskip("triton")
# the modules by path: pipekit.kernels exports functions of the same names
gemm_kernels = importlib.import_module("pipekit.kernels.grouped_gemm")
permute_kernels = importlib.import_module("pipekit.kernels.moe_permute")

TOL = dict(rtol=1e-5, atol=1e-5)  # the reasons: the module docstring
ADAMW_ATOL = 1e-4  # AdamW's weights after 2 steps at lr 1e-3 (module docstring)
SEED = 0
# small but whole: every layer kind of the family, two blocks, awkward sequence length 11
MODELS = {
    "gpt2": get_model("gpt2", "tiny", n_layers=2, dim=64, vocab_size=96),
    "llama": get_model("llama", "tiny", n_layers=2, dim=64, hidden=96, vocab_size=96),
    "mixtral": get_model("mixtral", "tiny", n_layers=2, vocab_size=96),
}
# the wired kernels' Triton autograd Functions, and those each family must run (GPT-2's MLP is
# GELU, not a GLU; Mixtral's experts take the Triton grouped GEMM: gemm "auto" under kernels="triton")
TRITON_FUNCTIONS = {"norm": norm_kernels._NormFn, "rotary": rotary_kernels._Rotary, "glu": glu_kernels._GLU,
                    "gemm": gemm_kernels._GroupedGemm, "permute": permute_kernels._Permute,
                    "unpermute": permute_kernels._Unpermute}
EXPECTED = {"gpt2": {"norm"}, "llama": {"norm", "rotary", "glu"},
            "mixtral": {"norm", "rotary", "glu", "gemm", "permute", "unpermute"}}


def batch(cfg, rows: int = 2, seq: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def count_triton_calls() -> list[str]:
    """Wrap each wired kernel's Triton autograd Function so that its runs are recorded (this process only)."""
    ran: list[str] = []
    for name, fn in TRITON_FUNCTIONS.items():
        apply = fn.apply

        def counted(*args, _name=name, _apply=apply):
            ran.append(_name)
            return _apply(*args)

        fn.apply = counted  # type: ignore[method-assign]
    return ran


def restore_triton_calls() -> None:
    for fn in TRITON_FUNCTIONS.values():
        if "apply" in fn.__dict__:  # ours: remove it, autograd.Function's apply shows again
            delattr(fn, "apply")


def loss_and_grads(cfg, mode: str) -> tuple[torch.Tensor, dict, set]:
    module = pipekit.PipelineModule(model_specs(cfg), seed=SEED)
    x, y = batch(cfg)
    ran = count_triton_calls()
    try:
        with kernels(mode):
            loss = model_loss(cfg).build()(module(x), y)
            loss.backward()
    finally:
        restore_triton_calls()
    return loss.detach(), {n: p.grad for n, p in module.named_parameters()}, set(ran)


@pytest.mark.parametrize("family", list(MODELS))
def test_model_with_triton_kernels_equals_torch(family):
    cfg = MODELS[family]
    loss_t, grads_t, ran_t = loss_and_grads(cfg, "triton")
    loss_r, grads_r, ran_r = loss_and_grads(cfg, "torch")
    assert ran_t == EXPECTED[family] and ran_r == set()
    torch.testing.assert_close(loss_t, loss_r, **TOL)
    assert grads_t.keys() == grads_r.keys()
    for name in grads_r:
        assert grads_t[name] is not None, name
        torch.testing.assert_close(grads_t[name], grads_r[name], **TOL, msg=name)


# ---- pp=2, spawned workers with kernels set to "triton" ----------------------------------------
PP_CFG = MODELS["llama"]
STEPS = 2
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)}


def pp_worker(steps: int) -> dict:
    """One pp rank: set_kernels("triton") here (a spawned process: the parent's kernels mode is
    not inherited, the environment is), then for each optimizer a fresh engine trained for
    `steps` steps; returns the environment it saw, which Triton Functions ran, and its
    weights under their nn.Sequential names."""
    import triton  # noqa: F401  (already imported by pipekit.kernels, after the environment was set)

    from pipekit.kernels import kernels_mode
    from pipekit.kernels.dispatch import interpreting

    set_kernels("triton")
    out: dict = {"env": os.environ.get("TRITON_INTERPRET"), "interpreting": interpreting(), "mode": kernels_mode()}
    ran = count_triton_calls()
    specs = model_specs(PP_CFG)
    for opt_name, make in OPTIMIZERS.items():
        module = pipekit.PipelineModule(specs, loss_fn=model_loss(PP_CFG), seed=SEED, schedule="1f1b",
                                        microbatches=2, topology=pipekit.Topology(pp=2, dp=1))
        engine = pipekit.PipelineEngine(module, optimizer=make(module.parameters()))
        losses = [engine.train_batch(iter([batch(PP_CFG, rows=4, seed=s)]), reduce_loss=True) for s in range(steps)]
        out[opt_name] = {"losses": losses, "weights": {reference_name(n, specs): p.detach().clone()
                                                       for n, p in module.named_parameters()}}
    out["ran"] = sorted(set(ran))
    return out


def reference_run(opt_name: str, steps: int) -> tuple[list[float], dict]:
    ref = Reference(model_specs(PP_CFG), model_loss(PP_CFG).build(), OPTIMIZERS[opt_name], seed=SEED)
    with kernels("torch"):
        losses = [ref.step(batch(PP_CFG, rows=4, seed=s)) for s in range(steps)]
    return losses, {n: p.detach() for n, p in ref.model.named_parameters()}


def test_pp2_engine_with_triton_kernels_matches_one_process_torch():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py; the spawned workers inherit os.environ
    per_rank = run_distributed(pp_worker, 2, STEPS, timeout=240)
    for rank, got in enumerate(per_rank):
        assert (got["env"], got["interpreting"], got["mode"]) == ("1", True, "triton"), f"rank {rank}: {got}"
    # rank 0 holds the embedding and the first block, rank 1 the second block, the norm and the head
    assert set(per_rank[0]["ran"]) | set(per_rank[1]["ran"]) == {"norm", "rotary", "glu"}
    for opt_name in OPTIMIZERS:
        ref_losses, ref_weights = reference_run(opt_name, STEPS)
        for rank, got in enumerate(per_rank):
            torch.testing.assert_close(torch.tensor(got[opt_name]["losses"]), torch.tensor(ref_losses), **TOL)
            assert got[opt_name]["weights"], f"rank {rank} owns no parameters"
            tol = TOL if opt_name == "sgd" else dict(rtol=TOL["rtol"], atol=ADAMW_ATOL)
            for name, w in got[opt_name]["weights"].items():
                torch.testing.assert_close(w, ref_weights[name], **tol, msg=f"{opt_name}, rank {rank}: {name}")
        names = set(per_rank[0][opt_name]["weights"]) | set(per_rank[1][opt_name]["weights"])
        assert names == set(ref_weights), "the two ranks together hold every parameter"
