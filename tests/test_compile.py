"""`train.compile`: `PipelineModule(compile=True)` (torch.compile per layer, CPU inductor)
trains exactly like eager, keeps every name, and is layout invariant.

A tiny GPT-2 (vocab 32, 2 blocks, dim 16, 4 heads; float32) is trained for 3
steps of SGD with momentum through `PipelineEngine` (1F1B, 2 microbatches of
2 x 8 tokens) from the same seed, with compile=True and compile=False:

- at pp=1: the losses, every gradient and every weight agree, and the
  parameter names and state_dict keys are identical (compiling in place adds
  no `_orig_mod.` prefix);
- at pp=2 (two gloo ranks): compile=True gives the one-process eager losses,
  gradients and weights, and the ranks' state_dict keys together are the
  one-process keys.

Tolerance: 1e-5 relative, the bound layout invariance is held to in float32 (the
float64 suites hold 1e-10, README's opening; float32 rounds ~1e-7 per op): each loss
to its eager value (|a - b| / |b|), and every weight and gradient tensor to the
model's largest eager entry of its kind (max|a - b| / max|b| over all tensors: the
relative error of the concatenated vector). Inductor
fuses and reorders float ops (Welford LayerNorm, online softmax, vectorised
reductions, FMA contraction), so its kernels round differently from eager
ATen by a few ulps per op (~1e-7 relative in float32). Per tensor that can be
large: the key bias's gradient is mathematically zero (softmax ignores a
shift shared by all keys), so its value is rounding noise (~1e-12), and the
query/key gradients of this near-uniform attention are small differences of
larger terms. Against the model's scale the differences measured on a 2-core
VM were 1.6e-7 (gradients) and 7e-8 (weights), the losses bitwise equal.
SGD with momentum carries a gradient difference linearly into the weights
(Adam's normalisation could turn rounding noise in a near-zero gradient into
a full-size step).

Processes and cost: eager runs in the pytest process; every compiled run runs
in spawned workers (`run_distributed`, world 1 and 2), with one intra-op
thread. The first compiles three graphs with inductor (the embedding, one
transformer block, whose graph the second block reuses, and the final
LayerNorm), forward and backward: ~25-50 s on a 2-core VM with a cold cache.
Inductor's on-disk caches (under /tmp/torchinductor_$USER) then serve the
pp=2 ranks, which build the same graphs for the same microbatch shapes, and
later runs. That needs the same kind of process: a cache key depends on the
thread count (kernels specialise on it) and, in torch 2.13, on import order
(pickle names `torch.contiguous_format` after the first module in
`sys.modules` with a `torch` attribute), so graphs compiled in the pytest
process would miss in the workers. Spawning also keeps dynamo's state and
inductor's compile pool out of the pytest process.
"""

from __future__ import annotations

import contextlib
import functools
import shutil

import pytest
import torch
import torch._dynamo
import torch._inductor.config

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.testing import run_distributed

TOL = 1e-5
SEED, DATA_SEED = 11, 5
STEPS, BATCH, SEQ, MICROBATCHES = 3, 4, 8, 2
MODEL = dict(vocab_size=32, vocab_pad_multiple=8, max_seq_len=16, n_layers=2, dim=16, n_heads=4)


def _compile_unsupported() -> str | None:
    """Why torch.compile with CPU inductor cannot run here, or None when it can."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python / platform"
    cxx = torch._inductor.config.cpp.cxx[-1] or "g++"
    if shutil.which(cxx) is None:
        return f"CPU inductor needs a C++ compiler and {cxx!r} is not on PATH"
    return None


UNSUPPORTED = _compile_unsupported()
pytestmark = pytest.mark.skipif(UNSUPPORTED is not None, reason=str(UNSUPPORTED))


def train(compile: bool, pp: int = 1) -> dict:
    """Train the tiny GPT-2 for STEPS steps on this rank's share of a pp-stage layout
    (one intra-op thread); return its losses, final weights and gradients by name, its
    state_dict keys and the names of its compiled layers.

    At pp > 1 inductor compiles in-process (compile_threads=1): the ranks find their
    graphs in the cache, and a compile pool per rank would only cost start-up time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    cfg = get_model("gpt2", "tiny", **MODEL)
    topo = pipekit.Topology(pp=pp, dp=1) if pp > 1 else None
    inductor = torch._inductor.config.patch(compile_threads=1) if pp > 1 else contextlib.nullcontext()
    try:
        with inductor:
            module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                            compile=compile, schedule="1f1b", microbatches=MICROBATCHES)
            opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
            engine = pipekit.PipelineEngine(module, optimizer=opt)
            gen = torch.Generator().manual_seed(DATA_SEED)
            losses = []
            for _ in range(STEPS):
                ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
                losses.append(engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]), reduce_loss=True))
    finally:
        torch.set_num_threads(threads)
    layers = [*module.layers.items(), *((f"tied.{k}", m) for k, m in module.tied.items())]
    return {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in module.named_parameters()},
        "state_dict_keys": list(module.state_dict()),
        "compiled": [name for name, layer in layers if getattr(layer, "_compiled_call_impl", None) is not None],
    }


@functools.cache
def eager() -> dict:
    return train(compile=False)


def relative_errors(run: dict, ref: dict, kind: str) -> dict[str, float]:
    """max|a - b| of each tensor of `kind` ("weights", "grads"), over the model's largest |b|."""
    scale = max(t.abs().max() for t in ref[kind].values())
    return {n: ((t - ref[kind][n]).abs().max() / scale).item() for n, t in run[kind].items()}


def assert_matches(run: dict, ref: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"], strict=True)):
        assert abs(a - b) / abs(b) <= TOL, f"{what}: loss of step {step} is {a!r}, eager gives {b!r}"
    for kind in ("weights", "grads"):
        for name, err in relative_errors(run, ref, kind).items():
            assert err <= TOL, f"{what}: {kind} of {name} differ by {err:.3g} of the model's largest"


def test_compiled_layers_train_like_eager_with_the_same_names():
    ref = eager()
    (run,) = run_distributed(train, 1, True, timeout=300)
    assert run["compiled"] == ["1", "2", "3", "tied.embed"], "compile=True must compile every layer with parameters"
    assert ref["compiled"] == []
    assert list(run["weights"]) == list(ref["weights"])
    assert run["state_dict_keys"] == ref["state_dict_keys"]
    assert not any("_orig_mod" in k for k in run["state_dict_keys"])
    assert_matches(run, ref, "compile=True, pp=1")


def test_compiled_pipeline_of_two_stages_gives_the_one_process_eager_run():
    ref = eager()
    per_rank = run_distributed(train, 2, True, 2, timeout=300)
    for rank, run in enumerate(per_rank):
        assert run["compiled"], f"rank {rank} compiled no layer"
        assert_matches(run, ref, f"compile=True, pp=2, rank {rank}")
    assert set().union(*(run["state_dict_keys"] for run in per_rank)) == set(ref["state_dict_keys"])
