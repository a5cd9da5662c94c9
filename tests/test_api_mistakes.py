"""A new user's mistakes in the Python API: one error naming the argument and what would be valid.

The command line's table is tests/test_mistakes.py; this is the API's. Each row is a call as
a user would write it, the exception type, and a piece of the one line it must say. No row
may surface as an error from deep inside (an AttributeError on a string, torch.distributed's
words for a size that was never an int).
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer

CFG = get_model("gpt2", "tiny", n_layers=2, dim=16, n_heads=2, vocab_size=64, max_seq_len=16)
SPECS = model_specs(CFG)


@pytest.fixture(scope="module")
def module():
    return pipekit.PipelineModule(SPECS, loss_fn=model_loss(CFG))


API_MISTAKES = [  # (id, call(module), exception, a piece of the one line)
    ("topology-as-a-string", lambda m: pipekit.PipelineModule(SPECS, topology="pp=2"), TypeError,
     "PipelineModule(topology=...) takes a pipekit.Topology"),
    ("pp-zero", lambda m: pipekit.Topology(pp=0), ValueError, "Topology(pp=0): pp must be an int >= 1"),
    ("pp-a-string", lambda m: pipekit.Topology(pp="2"), ValueError, "Topology(pp='2'): pp must be an int >= 1"),
    ("tp-a-float", lambda m: pipekit.Topology(tp=2.0), ValueError, "Topology(tp=2.0): tp must be an int >= 1"),
    ("dp-zero", lambda m: pipekit.Topology(dp=0), ValueError, "Topology(dp=0): dp must be an int >= 1 (or None"),
    ("expert-tp-a-string", lambda m: pipekit.Topology(expert_tp="yes"), TypeError,
     "Topology(expert_tp=...) must be True or False"),
    ("engine-of-a-string", lambda m: pipekit.PipelineEngine("model"), TypeError,
     "PipelineEngine takes a pipekit.PipelineModule"),
    ("zero-optimizer-of-none", lambda m: ZeroOptimizer(None), TypeError,
     "ZeroOptimizer takes the parameters to train"),
    ("zero-stage-a-string", lambda m: ZeroOptimizer(m.parameters(), stage="1", module=m), ValueError,
     "ZeRO stage must be 0, 1, 2 or 3 (an int), got '1' (a str)"),
    ("zero-stage-four", lambda m: ZeroOptimizer(m.parameters(), stage=4, module=m), ValueError,
     "ZeRO stage must be 0, 1, 2 or 3 (an int), got 4"),
    ("negative-clip", lambda m: pipekit.PipelineEngine(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                                       clip_grad_norm=-1.0), ValueError, "clip"),
    ("layer-spec-of-a-built-layer", lambda m: pipekit.LayerSpec(torch.nn.Linear(2, 2)), TypeError,
     "LayerSpec takes the layer's class and its arguments"),
    ("loss-fn-a-string", lambda m: pipekit.PipelineModule(SPECS, loss_fn="ce"), TypeError,
     "PipelineModule(loss_fn=...) takes a function (output, labels) -> a scalar tensor"),
    ("seed-a-string", lambda m: pipekit.PipelineModule(SPECS, seed="1"), TypeError,
     "PipelineModule(seed=...) must be an int"),
    ("compile-a-string", lambda m: pipekit.PipelineModule(SPECS, compile="yes"), TypeError,
     "PipelineModule(compile=...) must be True or False, got str 'yes'"),
    ("optimizer-over-other-tensors", lambda m: pipekit.PipelineEngine(
        m, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)), ValueError,
     "the optimizer (SGD) holds 1 of 1 tensors that are not this PipelineModule's parameters (the first of shape "
     "(2,))"),
    ("lr-scheduler-a-string", lambda m: pipekit.PipelineEngine(m, optimizer=torch.optim.SGD, lr_scheduler="cosine"),
     TypeError, "lr_scheduler must be a torch LR scheduler over the engine's optimizer"),
    ("unknown-schedule", lambda m: pipekit.PipelineModule(SPECS, schedule="bogus"), Exception,
     "unknown schedule 'bogus'"),
]


@pytest.mark.parametrize("call, kind, said", [r[1:] for r in API_MISTAKES], ids=[r[0] for r in API_MISTAKES])
def test_an_api_mistake_gets_one_clear_error(module, call, kind, said):
    with pytest.raises(kind) as e:
        call(module)
    text = str(e.value)
    assert said in text, text
    assert len(text.splitlines()) == 1, text


class _Detach(torch.nn.Module):
    def forward(self, x):
        return x.detach()


class _Stop(_Detach):
    stops_gradient = True


def _cross_entropy(out, labels):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())


TRAINING_MISTAKES = [  # (id, loss_fn, a layer inserted after layer 1 or None, exception, a piece of the line)
    ("loss-a-python-float", lambda o, y: _cross_entropy(o, y).item(), None, TypeError,
     "loss_fn <lambda> returned float ("),
    ("loss-per-token", lambda o, y: torch.nn.functional.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="none"),
     None, TypeError, "returned a tensor of shape (16,); it must return one number"),
    ("loss-detached", lambda o, y: _cross_entropy(o, y).detach(), None, RuntimeError,
     "loss_fn <lambda> returned a loss that does not require grad"),
    ("layer-detaches", _cross_entropy, _Detach, RuntimeError,
     "layer 2 (_Detach) returned a tensor that does not require grad though its input does"),
]


@pytest.mark.parametrize("loss_fn, layer, kind, said", [r[1:] for r in TRAINING_MISTAKES],
                         ids=[r[0] for r in TRAINING_MISTAKES])
def test_a_training_mistake_names_the_loss_fn_or_layer(loss_fn, layer, kind, said):
    specs = SPECS[:2] + [pipekit.LayerSpec(layer)] + SPECS[2:] if layer else SPECS
    m = pipekit.PipelineModule(specs, loss_fn=loss_fn)
    before = [p.detach().clone() for p in m.parameters()]
    engine = pipekit.PipelineEngine(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    with pytest.raises(pipekit.PipelineError) as e:
        engine.train_batch((x, y))
    first = str(e.value).splitlines()[0]
    assert f"{kind.__name__}: " in first and said in first, first
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # no step was taken


def test_token_ids_that_are_not_ids_of_this_vocabulary_are_named():
    """A float tensor of ids, or an id beyond the table: one line, the same in every layout (at
    tp > 1 such an id once embedded as zeros on every rank, silently)."""
    m = pipekit.PipelineModule(SPECS, loss_fn=_cross_entropy)
    engine = pipekit.PipelineEngine(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    with pytest.raises(TypeError, match=r"token ids must be integers \(torch.long\), got a torch.float32 tensor"):
        engine.train_batch((x.float(), y))
    with pytest.raises(pipekit.PipelineError, match=r"RuntimeError: a token id lies outside \[0, 128\)"):
        engine.train_batch((x + 1000, y))


def test_a_layer_that_stops_the_gradient_on_purpose_trains_the_rest():
    m = pipekit.PipelineModule(SPECS[:2] + [pipekit.LayerSpec(_Stop)] + SPECS[2:], loss_fn=_cross_entropy)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    engine = pipekit.PipelineEngine(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    engine.train_batch((torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))))
    moved = {n.split(".")[1] for n, p in m.named_parameters() if n.startswith("layers.") and
             not torch.equal(before[n], p)}
    assert moved == {"3", "4"}  # the block after the cut and the final norm; the block before it stays


def test_a_second_engine_on_a_module_takes_it_over_and_the_first_says_so():
    """A notebook cell run twice builds a second engine on the same module: it trains, as a
    fresh engine does; the first, whose hooks are gone, refuses in one line instead of both
    moving the same gradients (once an AssertionError deep in the backward)."""
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    first_m = pipekit.PipelineModule(SPECS, loss_fn=_cross_entropy)
    alone = pipekit.PipelineModule(SPECS, loss_fn=_cross_entropy)
    first = pipekit.PipelineEngine(first_m, optimizer=torch.optim.SGD(first_m.parameters(), lr=0.1))
    second = pipekit.PipelineEngine(first_m, optimizer=torch.optim.SGD(first_m.parameters(), lr=0.1))
    reference = pipekit.PipelineEngine(alone, optimizer=torch.optim.SGD(alone.parameters(), lr=0.1))
    for _ in range(2):
        assert second.train_batch((x, y)) == reference.train_batch((x, y))
    assert all(torch.equal(a, b) for a, b in zip(first_m.parameters(), alone.parameters()))
    with pytest.raises(RuntimeError) as e:
        first.train_batch((x, y))
    assert "parameters are trained by a newer ZeroOptimizer (stage 0) built over the same module" in str(e.value)


def test_metrics_left_by_another_model_do_not_break_the_next_one():
    """Forward passes outside an engine record MoE metrics that nobody pops; a model of another
    size under the same layer name then starts its own sums instead of failing on a shape."""
    from pipekit import auxloss

    tracker = auxloss.MetricsTracker()
    tracker.record("moe/1/tokens_per_expert", torch.ones(8))
    tracker.record("moe/1/tokens_per_expert", torch.full((4,), 2.0))
    tracker.record("moe/1/tokens_per_expert", torch.full((4,), 3.0))
    total, n = tracker.pop()["moe/1/tokens_per_expert"]
    assert n == 2 and torch.equal(total, torch.full((4,), 5.0))
