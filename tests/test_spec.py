"""pipekit.spec: lazy, seeded, layout-independent layer construction."""

import pytest
import torch
from torch import nn

from pipekit.spec import LayerSpec, TiedLayerSpec, build_layer, count_parameters, layer_seed


class Counting(nn.Module):
    """A module that counts how often it is constructed."""

    built = 0

    def __init__(self, width):
        super().__init__()
        Counting.built += 1
        self.lin = nn.Linear(width, width)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_build_is_lazy():
    Counting.built = 0
    spec = LayerSpec(Counting, 4)
    specs = [spec, LayerSpec(Counting, 8)]
    assert Counting.built == 0 and "Counting" in repr(spec)
    module = build_layer(specs, 1, seed=0)
    assert Counting.built == 1 and module.lin.in_features == 8


def test_same_seed_and_index_same_weights():
    spec = LayerSpec(nn.Linear, 6, 5, bias=True)
    a = weights(spec.build(seed=3, index=7))
    assert same(a, weights(spec.build(seed=3, index=7)))
    assert same(a, weights(LayerSpec(nn.Linear, 6, 5).build(seed=3, index=7)))  # a new spec too
    assert not torch.equal(a[0], weights(spec.build(seed=3, index=8))[0])
    assert not torch.equal(a[0], weights(spec.build(seed=4, index=7))[0])


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    LayerSpec(nn.Linear, 16, 16).build(seed=1, index=2)
    LayerSpec(nn.Linear, 16, 16).build(seed=1, index=2, device="meta")
    assert torch.equal(torch.get_rng_state(), before)


def test_cpu_build_seeds_no_other_generator(monkeypatch):
    """torch.manual_seed would reseed every GPU (or queue it until CUDA starts), unrestored."""
    calls = []
    for mod, name in [(torch.cuda, "manual_seed_all"), (torch.cuda, "manual_seed"), (torch.mps, "manual_seed")]:
        monkeypatch.setattr(mod, name, lambda seed, _n=name: calls.append(_n))
    LayerSpec(nn.Linear, 4, 4).build(seed=0, index=1)
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_untouched_and_builds_reproducible():
    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state()
    a = weights(LayerSpec(nn.Linear, 8, 8).build(seed=1, index=0, device="cuda"))
    LayerSpec(nn.Linear, 8, 8).build(seed=1, index=0)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    assert same(a, weights(LayerSpec(nn.Linear, 8, 8).build(seed=1, index=0, device="cuda")))


def test_meta_build_and_count_parameters():
    module = LayerSpec(nn.Linear, 1000, 1000).build(device="meta")
    assert all(p.device.type == "meta" for p in module.parameters())
    assert count_parameters(LayerSpec(nn.Linear, 1000, 1000)) == 1000 * 1000 + 1000
    assert count_parameters(LayerSpec(nn.Linear, 3, 4, bias=False)) == 12
    assert count_parameters(TiedLayerSpec("emb", nn.Embedding, 50, 8)) == 400
    assert count_parameters(torch.relu) == 0


def test_tied_copies_identical():
    head = TiedLayerSpec("emb", nn.Embedding, 20, 6, forward_fn=lambda m, x: x @ m.weight.t())
    specs = [TiedLayerSpec("emb", nn.Embedding, 20, 6), LayerSpec(nn.Linear, 6, 6), head]
    first, last = build_layer(specs, 0, seed=9), build_layer(specs, 2, seed=9)
    assert first is not last and torch.equal(first.weight, last.weight)
    assert torch.equal(last.weight, LayerSpec(nn.Embedding, 20, 6).build(seed=9, index=0).weight)
    assert not torch.equal(last.weight, LayerSpec(nn.Embedding, 20, 6).build(seed=9, index=2).weight)
    assert head.tied_weight_attr == ["weight"] and "key='emb'" in repr(head)


def test_build_layer_entries():
    def reshape(x):
        return x.flatten(1)

    specs = [reshape, nn.Linear(2, 2), 42, LayerSpec(nn.Linear, 2, 2)]
    assert build_layer(specs, 0, seed=0) is reshape
    with pytest.raises(TypeError, match=r"entry 1 .* built nn.Module \(Linear\).*LayerSpec\(cls, \*args\)"):
        build_layer(specs, 1, seed=0)
    with pytest.raises(TypeError, match=r"entry 2 .* is 42; expected a LayerSpec, TiedLayerSpec or callable"):
        build_layer(specs, 2, seed=0)
    assert isinstance(build_layer(specs, 3, seed=0), nn.Linear)


def test_spec_rejects_bad_classes():
    with pytest.raises(TypeError, match="needs a module class or factory, got 42"):
        LayerSpec(42)
    with pytest.raises(TypeError, match="built Tensor, expected an nn.Module"):
        LayerSpec(torch.zeros, 3).build()


def test_layer_seed():
    assert layer_seed(0, 0) == layer_seed(0, 0)
    seeds = {layer_seed(s, i) for s in range(20) for i in range(200)}
    assert len(seeds) == 20 * 200
    assert all(0 <= s < 2**63 for s in seeds)
    # neighbours differ in many bits, not just the last few
    assert bin(layer_seed(0, 0) ^ layer_seed(0, 1)).count("1") > 10
    assert bin(layer_seed(0, 0) ^ layer_seed(1, 0)).count("1") > 10


def test_a_module_list_as_deepspeed_takes_it_is_refused_with_the_spec_to_write():
    import pipekit

    for layers in ([nn.Linear(8, 8), nn.ReLU()], nn.Sequential(nn.Linear(8, 8), nn.ReLU())):
        with pytest.raises(TypeError, match=r"entry 0 of the spec list is a built nn.Module \(Linear\).*"
                                            r"LayerSpec\(nn.Linear, 8, 8\) for nn.Linear\(8, 8\)"):
            pipekit.PipelineModule(layers, loss_fn=nn.MSELoss())
