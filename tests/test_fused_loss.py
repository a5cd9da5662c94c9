"""`fused_loss=True` (the head fused into the loss, `FusedLinearCrossEntropy`): the same model
as without it, trained without the (B, T, Vp/tp) logits.

- one process, float64: the loss and every gradient equal the unfused model's (1e-12) for
  GPT-2 tied, GPT-2 untied, Llama untied and tied, and Mixtral, with ignored labels and a
  vocabulary of 77 padded to 80;
- one spawned group of 4 ranks (pp=2 x tp=2), float64: GPT-2 tied under 1F1B (the tie spans
  the pipeline), Llama untied under ZB-H1 (input and weight grads split: the fused loss's
  gradients cross `pipekit.split_backward`) and Mixtral tied under ZBV, each trained fused for
  3 AdamW steps, equal the one-process unfused model step by step: loss, every local
  gradient and weight within 1e-10 (a tp shard against its slice);
- Triton's interpreter, float32: a tiny GPT-2's fused loss and gradients under
  kernels("triton") equal the unfused model's (same kernels elsewhere) within 1e-5;
- bf16: the loss takes the last stage's output in bf16 (no float32 copy of h), gives a
  float32 loss, and matches the unfused loss;
- eval and generate still see logits: eval_batch's outputs, module(x) in eval mode and
  greedy sampling equal the unfused model's; training goes on after eval; the parameter
  names are the unfused model's; `model.fused_loss` is a config key of the zoo's families.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import pipekit
from pipekit.config import ConfigError, load_run
from pipekit.kernels import kernels
from pipekit.models import get_model, model_loss, model_specs
from pipekit.run.generate import sample
from pipekit.testing import Reference, in_float64, run_distributed

SEED = 7
IGNORE = -100
SMALL = dict(vocab_size=77, vocab_pad_multiple=8, max_seq_len=16, n_layers=2, dim=16, n_heads=4)
MODELS = {
    "gpt2-tied": ("gpt2", dict(SMALL)),
    "gpt2-untied": ("gpt2", dict(SMALL, tie_embeddings=False)),
    "llama-untied": ("llama", dict(SMALL, n_kv_heads=2, hidden=24)),
    "llama-tied": ("llama", dict(SMALL, n_kv_heads=2, hidden=24, tie_embeddings=True)),
    "mixtral-tied": ("mixtral", dict(SMALL, n_kv_heads=2, hidden=24, n_experts=4, tie_embeddings=True,
                                aux_loss_coef=0.0)),  # the balance loss is per microbatch: not layout-free
}


def config(name: str, fused: bool):
    family, kw = MODELS[name]
    return get_model(family, "tiny", fused_loss=fused, **kw)


def batch(rows: int = 4, seq: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and next-token labels, a quarter of the labels ignored (a whole row's in row 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (rows, seq + 1), generator=g)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    y[torch.rand(y.shape, generator=g) < 0.25] = IGNORE
    y[0] = IGNORE
    return x, y


def loss_and_grads(cfg) -> tuple[torch.Tensor, dict]:
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED)
    x, y = batch()
    loss = module.loss_fn(module(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_loss_and_gradients_equal_the_unfused_model_in_float64(name, float64):
    loss_f, grads_f = loss_and_grads(config(name, True))
    loss_u, grads_u = loss_and_grads(config(name, False))
    assert grads_f.keys() == grads_u.keys()  # the same parameters, the same names
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-12, atol=1e-12)
    for n, g in grads_u.items():
        if g is None:  # e.g. experts no token was routed to: none either way
            assert grads_f[n] is None, n
            continue
        torch.testing.assert_close(grads_f[n], g, rtol=1e-12, atol=1e-12, msg=n)


# ---- pp=2 x tp=2, fused, against one process unfused ------------------------------------------
STEPS = 3
LAYOUT_CASES = [("gpt2-tied", "1f1b"), ("llama-untied", "zb_h1"), ("mixtral-tied", "zbv")]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@in_float64
def fused_layout_worker(cases: list) -> dict:
    """On each of the 4 ranks: per (model, schedule), a fused model at pp=2 x tp=2 and the
    one-process unfused reference, trained side by side; the worst differences seen."""
    topo = pipekit.Topology(pp=2, dp=1, tp=2)
    out = {}
    for name, schedule in cases:
        cfg, ref_cfg = config(name, True), config(name, False)
        module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                        schedule=schedule, microbatches=2)
        engine = pipekit.PipelineEngine(module, optimizer=adamw(module.parameters()))
        ref = Reference(model_specs(ref_cfg), model_loss(ref_cfg).build(), adamw, seed=SEED)
        for step in range(STEPS):
            ref.train_beside(engine, batch(seed=step))
            touched = []
            for n, p in module.named_parameters():
                if ref.tensor(n).grad is None:  # (an expert no token reached): none here either
                    assert p.grad is None or not p.grad.any(), n
                else:
                    touched.append((n, p))
            ref.compare(touched, topo)
        out[name] = ref.worst
    return out


def test_fused_loss_at_pp2_tp2_trains_like_one_process_unfused():
    per_rank = run_distributed(fused_layout_worker, 4, LAYOUT_CASES, timeout=240)
    for rank, result in enumerate(per_rank):
        for name, worst in result.items():
            assert max(worst.values()) < 1e-10, f"rank {rank}, {name}: {worst}"


# ---- Triton (interpreter), float32 --------------------------------------------------------------
def test_fused_loss_with_triton_kernels_equals_the_unfused_model_in_float32(monkeypatch):
    pytest.importorskip("triton")
    lce = importlib.import_module("pipekit.kernels.linear_cross_entropy")  # the package exports a function so named
    ran = []
    stats = lce._TritonStep.stats
    monkeypatch.setattr(lce._TritonStep, "stats", staticmethod(lambda *a: ran.append(1) or stats(*a)))
    small = dict(SMALL, n_layers=1, dim=32)
    with kernels("triton"):
        results = [loss_and_grads(get_model("gpt2", "tiny", fused_loss=fused, **small)) for fused in (True, False)]
    assert ran, "the fused loss took the Triton side"
    (loss_f, grads_f), (loss_u, grads_u) = results
    # float32: the same matmuls in another grouping (chunk of the logits vs the whole), the
    # softmax summed in another order: a few ulps, through one block's backward
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=1e-5)
    for n, g in grads_u.items():
        torch.testing.assert_close(grads_f[n], g, rtol=1e-5, atol=1e-5, msg=n)


# ---- bf16 -----------------------------------------------------------------------------------------
def test_bf16_fused_loss_takes_h_in_bf16_and_matches_the_unfused_loss():
    losses, seen = {}, []
    for fused in (True, False):
        cfg = config("llama-untied", fused)
        module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED, microbatches=2,
                                        precision="bf16")
        forward = module.loss_fn.forward
        module.loss_fn.forward = lambda out, y, f=forward: seen.append((out.dtype, out.shape[-1])) or f(out, y)
        engine = pipekit.PipelineEngine(module, optimizer=adamw)
        losses[fused] = engine.train_batch(batch())
    # fused: h (D=16) as the layers left it; unfused: the logits (Vp=80) taken to float32
    assert seen == [(torch.bfloat16, 16)] * 2 + [(torch.float32, 80)] * 2
    # the same bf16 logits either way (a chunk's or all), softmax in float32: float32 rounding
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-5)


def test_the_fused_loss_itself_is_float32_for_bf16_layers():
    cfg = config("gpt2-tied", True)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED, precision="bf16")
    x, y = batch()
    loss = module.loss_fn(module(x), y)
    assert loss.dtype == torch.float32
    loss.backward()
    assert module.tied["embed"].wte.weight.grad.dtype == torch.bfloat16


# ---- eval, generate, names, config ----------------------------------------------------------------
def test_eval_and_generate_get_logits_with_fused_loss_and_training_goes_on(float64):
    modules = {}
    for fused in (True, False):
        cfg = config("gpt2-tied", fused)
        modules[fused] = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED,
                                                microbatches=2)
    assert modules[True].state_dict().keys() == modules[False].state_dict().keys()
    engines = {f: pipekit.PipelineEngine(m, optimizer=adamw) for f, m in modules.items()}
    x, y = batch()
    evals = {f: e.eval_batch((x, y), return_outputs=True) for f, e in engines.items()}
    (loss_f, out_f), (loss_u, out_u) = evals[True], evals[False]
    assert out_f.shape == (4, 8, 80)  # the padded vocabulary's logits
    torch.testing.assert_close(out_f, out_u, rtol=0, atol=0)
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-12, atol=1e-12)
    trained = {f: e.train_batch((x, y)) for f, e in engines.items()}  # after eval, training again
    torch.testing.assert_close(trained[True], trained[False], rtol=1e-12, atol=1e-12)
    for m in modules.values():
        m.eval()
    assert modules[True](x).shape == (4, 8, 80)
    tokens = {f: sample(m, [1, 2, 3], 5, max_len=16, temperature=0) for f, m in modules.items()}
    assert tokens[True] == tokens[False]


def test_fused_loss_is_a_model_config_key_of_the_zoo():
    for family in ("gpt2", "llama", "mixtral"):
        assert load_run(None, [f"model.family={family}", "model.fused_loss=true"]).model.fused_loss
    assert not load_run(None, ["model.family=llama"]).model.fused_loss
    with pytest.raises(ConfigError, match="model.fused_loss does not apply to the toy model"):
        load_run(None, ["model.family=toy", "model.fused_loss=true"])
