"""pipekit.partition against a brute-force oracle, plus methods, helpers and error messages."""

import itertools
import random

import pytest
from torch import nn

from pipekit.partition import describe, layer_weights, partition, partition_weights, stage_of
from pipekit.spec import LayerSpec, TiedLayerSpec


def all_partitions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [0, *cuts, n]


def stage_sums(weights, bounds):
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def stage_lengths(bounds):
    return [b - a for a, b in zip(bounds, bounds[1:])]


def oracle(weights, k):
    """(least heaviest stage, then least longest stage among those), by enumeration."""
    return min((max(stage_sums(weights, b)), max(stage_lengths(b))) for b in all_partitions(len(weights), k))


def check_shape(bounds, n, k):
    assert len(bounds) == k + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(b > a for a, b in zip(bounds, bounds[1:])), bounds


@pytest.mark.parametrize("pool", [range(0, 10), range(1, 4), [0, 0, 0, 1, 2, 7]], ids=["mixed", "small", "zeros"])
def test_matches_brute_force(pool):
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randint(1, 9)
        k = rng.randint(1, min(n, 5))
        weights = [rng.choice(pool) for _ in range(n)]
        bounds = partition_weights(weights, k)
        check_shape(bounds, n, k)
        got = (max(stage_sums(weights, bounds)), max(stage_lengths(bounds)))
        assert got == oracle(weights, k), (weights, k, bounds)


def test_float_weights_match_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 8)
        k = rng.randint(1, min(n, 4))
        weights = [rng.random() for _ in range(n)]
        bounds = partition_weights(weights, k)
        check_shape(bounds, n, k)
        assert max(stage_sums(weights, bounds)) == pytest.approx(oracle(weights, k)[0], rel=1e-12)


def test_deterministic():
    weights = [3, 0, 0, 5, 1, 0, 2, 2, 0, 4]
    assert partition_weights(weights, 4) == partition_weights(list(weights), 4)


def test_tie_break_spreads_zero_weights():
    # one matching layer then a run of zero-weight ones: the zeros split 4/4, not 2/6
    assert partition_weights([1] + [0] * 8 + [1, 1, 1], 4) == [0, 5, 10, 11, 12]
    # embedding, 10 blocks, head: 3 layers per stage, block weights 2, 3, 3, 2
    assert partition_weights([0] + [1] * 10 + [0], 4) == [0, 3, 6, 9, 12]
    # all zero: as even as the layer counts allow
    assert partition_weights([0] * 10, 3) == [0, 3, 6, 10]


def test_tie_break_order():
    # rule 1 beats weight evenness below the bottleneck: B* = 50 (the first layer
    # alone), then 4 + 4 layers (weights 4, 28) rather than 6 + 2 (weights 18, 14)
    assert partition_weights([50, 1, 1, 1, 1, 7, 7, 7, 7], 3) == [0, 1, 5, 9]
    # rule 2: B* = 5 and L = 3 leave six partitions. Stage 0 takes weight 3, nearest
    # 11 / 3; for stage 1, weights 3 and 5 are equally near 8 / 2 and lengths 2 and 3
    # equally near 5 / 2, so the leftmost end wins
    assert partition_weights([1, 2, 2, 1, 2, 2, 1], 3) == [0, 2, 4, 7]
    # rule 2, leftmost on a tie: 10 equal layers into 4 stages
    assert partition_weights([1] * 10, 4) == [0, 2, 5, 7, 10]


def feasible(weights, k, cap):
    """Independent greedy check used to verify large cases."""
    stages, total = 1, 0
    for w in weights:
        if w > cap:
            return False
        if total + w > cap:
            stages, total = stages + 1, 0
        total += w
    return stages <= k


def test_large_case_is_optimal():
    rng = random.Random(0)
    weights = [rng.randint(0, 1000) for _ in range(2000)]
    bounds = partition_weights(weights, 64)
    check_shape(bounds, 2000, 64)
    best = max(stage_sums(weights, bounds))
    assert feasible(weights, 64, best) and not feasible(weights, 64, best - 1)


def test_large_case_with_many_zeros():
    rng = random.Random(1)
    weights = [rng.choice([0, 0, 0, 0, 1]) for _ in range(3000)]
    bounds = partition_weights(weights, 100)
    check_shape(bounds, 3000, 100)
    best = max(stage_sums(weights, bounds))
    assert feasible(weights, 100, best) and not feasible(weights, 100, best - 1)


# ---------------------------------------------------------------- methods on specs


def relu(x):
    return x.relu()


def test_uniform():
    specs = [LayerSpec(nn.Linear, 4, 4) for _ in range(8)]
    assert partition(specs, 4, "uniform") == [0, 2, 4, 6, 8]
    assert partition(specs, 3, "uniform") == [0, 3, 5, 8]
    assert partition(specs, 1, "uniform") == [0, 8]
    assert partition(specs, 8, "uniform") == list(range(9))


def test_parameters_balances_param_counts():
    # 110, relu (0), 110, 220, 210, 11 parameters: best heaviest stage is 221
    specs = [
        LayerSpec(nn.Linear, 10, 10),
        relu,
        LayerSpec(nn.Linear, 10, 10),
        LayerSpec(nn.Linear, 10, 20),
        LayerSpec(nn.Linear, 20, 10),
        LayerSpec(nn.Linear, 10, 1),
    ]
    assert layer_weights(specs, "parameters") == [110, 0, 110, 220, 210, 11]
    assert partition(specs, 3, "parameters") == [0, 3, 4, 6]
    assert partition(specs, 3) == [0, 3, 4, 6]  # parameters is the default
    assert partition(specs, 3, "uniform") == [0, 2, 4, 6]


def test_parameters_count_tied_specs_at_every_position():
    specs = [
        TiedLayerSpec("emb", nn.Embedding, 100, 8),
        LayerSpec(nn.Linear, 8, 8),
        LayerSpec(nn.Linear, 8, 8),
        TiedLayerSpec("emb", nn.Embedding, 100, 8, forward_fn=lambda m, x: x @ m.weight.t()),
    ]
    assert layer_weights(specs, "parameters") == [800, 72, 72, 800]
    assert partition(specs, 3, "parameters") == [0, 1, 3, 4]


def test_type_regex():
    specs = [LayerSpec(nn.Embedding, 10, 4)] + [LayerSpec(nn.Linear, 4, 4), relu] * 5 + [LayerSpec(nn.LayerNorm, 4)]
    assert layer_weights(specs, "type:^linear$") == [0] + [1, 0] * 5 + [0]
    bounds = partition(specs, 2, "type:LINEAR")  # case-insensitive
    linears = [sum(layer_weights(specs, "type:linear")[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert sorted(linears) == [2, 3] and bounds == [0, 6, 12]
    assert partition(specs, 3, "type:relu|embed") == [0, 4, 8, 12]


def test_explicit_boundaries():
    specs = [relu] * 6
    assert partition(specs, 3, [0, 1, 5, 6]) == [0, 1, 5, 6]
    assert partition(specs, 2, (0, 3, 6)) == [0, 3, 6]


def test_stage_of_and_describe():
    bounds = [0, 2, 5, 6]
    assert [stage_of(bounds, i) for i in range(6)] == [0, 0, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="layer index 6 .*0..5"):
        stage_of(bounds, 6)
    specs = [LayerSpec(nn.Linear, 10, 10), relu, LayerSpec(nn.Linear, 10, 100), relu, relu, relu]
    table = describe(specs, bounds).splitlines()
    assert table[0].split() == ["stage", "layers", "#layers", "#params"]
    assert table[1].split() == ["0", "0:2", "2", "110"]
    assert table[2].split() == ["1", "2:5", "3", "1,100"]
    assert table[3].split() == ["2", "5:6", "1", "0"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_bad_num_stages(k):
    with pytest.raises(ValueError, match=rf"num_stages must be an int >= 1, got {k!r}"):
        partition([relu] * 4, k, "uniform")


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot cut 5 layers into 8 stages; use at most 5 stages"):
        partition([relu] * 5, 8, "uniform")
    with pytest.raises(ValueError, match="cannot cut 5 layers into 8 stages"):
        partition_weights([1] * 5, 8)
    with pytest.raises(ValueError, match="empty spec list"):
        partition([], 1, "uniform")


def test_bad_weights():
    with pytest.raises(ValueError, match=r"weight -1 of layer 2"):
        partition_weights([1, 2, -1], 2)
    with pytest.raises(ValueError, match=r"weight nan of layer 0"):
        partition_weights([float("nan"), 1], 2)


@pytest.mark.parametrize(
    "bounds, message",
    [
        ([0, 3, 3, 6], r"make stage 1 empty \(3:3\)"),
        ([0, 4, 2, 6], r"make stage 1 empty \(4:2\)"),
        ([1, 3, 5, 6], r"\[1, 3, 5, 6\] must start at 0 and end at 6"),
        ([0, 3, 5, 7], r"\[0, 3, 5, 7\] must start at 0 and end at 6"),
        ([0, 3, 6], r"\[0, 3, 6\] have 3 entries; 3 stages need 4"),
        ([0, 1.5, 3, 6], r"must be ints"),
    ],
)
def test_bad_explicit_boundaries(bounds, message):
    with pytest.raises(ValueError, match=message):
        partition([relu] * 6, 3, bounds)


@pytest.mark.parametrize("method", ["balanced", "params", 3, None])
def test_unknown_method(method):
    message = rf"unknown partition method {method!r}.*'uniform', 'parameters', 'type:REGEX'.*list of boundaries"
    with pytest.raises(ValueError, match=message):
        partition([relu] * 4, 2, method)


def test_type_regex_errors():
    specs = [LayerSpec(nn.Linear, 4, 4), relu, LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.LayerNorm, 4)]
    with pytest.raises(ValueError, match=r"'\[unclosed' is not a valid regex"):
        partition(specs, 2, "type:[unclosed")
    with pytest.raises(ValueError, match=r"'type:Attention' matches no layer; .*: Linear, relu, LayerNorm$"):
        partition(specs, 2, "type:Attention")


def test_bad_entries():
    with pytest.raises(TypeError, match=r"entry 1 .* built nn.Module \(Linear\)"):
        partition([relu, nn.Linear(2, 2)], 2, "uniform")
    with pytest.raises(TypeError, match=r"entry 0 .* int 42"):
        partition([42, relu], 2, "parameters")
