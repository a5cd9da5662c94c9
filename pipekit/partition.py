"""Cut a spec list into contiguous pipeline stages.

`partition(specs, num_stages, method)` returns boundaries `[0, b1, ..., n]`:
stage i holds `specs[b[i]:b[i+1]]`, and every stage holds at least one entry.

Methods:
  "uniform"      every entry weighs 1 (balance the number of layers);
  "parameters"   an entry weighs its parameter count, counted on the meta
                 device; plain callables weigh 0, and a tied spec weighs its
                 full count at every position (each stage holding it stores a copy);
  "type:REGEX"   an entry weighs 1 when its class name matches REGEX
                 (`re.search`, case-insensitive), else 0;
  [0, b1, ..., n] explicit boundaries, validated and returned as a list.

The balanced methods are exact, not greedy. `partition_weights` finds the
least possible weight B* of the heaviest stage with Nicol's parametric search
(for each stage in turn, a binary search over where it ends, probing each
candidate bottleneck with a greedy feasibility check: O(k^2 log^2 n) bisections),
then chooses one partition among the optimal ones by this tie-break:

  1. fewest layers in the longest stage (least L such that some partition has
     every stage weighing <= B* and holding <= L layers) -- this spreads
     zero-weight entries (callables, unmatched types) instead of piling them up;
  2. then boundaries are placed left to right, each within the positions that
     keep the rest feasible, at the one whose stage weight is nearest to an
     even share of the remaining weight over the remaining stages; then whose
     stage length is nearest an even share of the remaining layers; then the
     leftmost (so early stages, which keep the most activations in flight under
     1F1B, get the lighter side of a tie).

Limits: weights must be finite and non-negative. Integer weights are handled
exactly; float weights are compared through prefix-sum differences, so
"optimal" holds up to the rounding of those sums.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

from torch import nn

from .spec import LayerSpec, built_module_error, count_parameters, spec_name

VALID_METHODS = "'uniform', 'parameters', 'type:REGEX' (e.g. 'type:Block'), or a list of boundaries"


def partition(specs: list, num_stages: int, method: str | list[int] = "parameters") -> list[int]:
    """Boundaries `[0, b1, ..., len(specs)]` cutting `specs` into `num_stages` non-empty stages."""
    if isinstance(method, (list, tuple)):
        return check_boundaries(method, len(specs), num_stages)
    _check_counts(len(specs), num_stages)
    return partition_weights(layer_weights(specs, method), num_stages)


def layer_weights(specs: list, method: str) -> list[int]:
    """The weight of every entry of `specs` under a balanced `method`."""
    for i, spec in enumerate(specs):
        _check_entry(spec, i)
    if method == "uniform":
        return [1] * len(specs)
    if method == "parameters":
        return _parameter_weights(specs)
    if isinstance(method, str) and method.startswith("type:"):
        return _type_weights(specs, method[len("type:"):])
    raise ValueError(f"unknown partition method {method!r}; valid methods: {VALID_METHODS}")


def partition_weights(weights: Sequence[float], num_stages: int) -> list[int]:
    """Optimal contiguous partition of `weights` into `num_stages` non-empty stages.

    Minimises the heaviest stage, then applies the tie-break in the module
    docstring. Returns boundaries `[0, ..., len(weights)]`.
    """
    _check_counts(len(weights), num_stages)
    _check_weights(weights)
    prefix = list(accumulate(weights, initial=0))
    cap = _bottleneck(prefix, num_stages)
    max_len = _shortest_longest_stage(prefix, num_stages, cap)
    return _place(prefix, num_stages, cap, max_len)


def stage_of(boundaries: list[int], layer_index: int) -> int:
    """The stage that holds layer `layer_index`."""
    n = boundaries[-1]
    if not 0 <= layer_index < n:
        raise ValueError(f"layer index {layer_index} is outside the model's {n} layers (valid: 0..{n - 1})")
    return bisect_right(boundaries, layer_index) - 1


def describe(specs: list, boundaries: list[int]) -> str:
    """A small table for logs: stage, layer range, number of layers, number of parameters."""
    check_boundaries(boundaries, len(specs), len(boundaries) - 1)
    rows = [("stage", "layers", "#layers", "#params")]
    for s, (lo, hi) in enumerate(zip(boundaries, boundaries[1:])):
        params = sum(count_parameters(spec) for spec in specs[lo:hi])
        rows.append((str(s), f"{lo}:{hi}", str(hi - lo), f"{params:,}"))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def check_boundaries(boundaries, num_layers: int, num_stages: int) -> list[int]:
    """Validate explicit boundaries and return them as a list of ints."""
    _check_counts(num_layers, num_stages)
    b = list(boundaries)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in b):
        raise ValueError(f"explicit boundaries {b} must be ints, e.g. {_example(num_layers, num_stages)}")
    if len(b) != num_stages + 1:
        raise ValueError(
            f"explicit boundaries {b} have {len(b)} entries; {num_stages} stages need {num_stages + 1}, "
            f"e.g. {_example(num_layers, num_stages)}"
        )
    if b[0] != 0 or b[-1] != num_layers:
        raise ValueError(f"explicit boundaries {b} must start at 0 and end at {num_layers} (the number of layers)")
    for s, (lo, hi) in enumerate(zip(b, b[1:])):
        if hi <= lo:
            raise ValueError(
                f"explicit boundaries {b} make stage {s} empty ({lo}:{hi}); boundaries must be strictly increasing"
            )
    return b


# ---------------------------------------------------------------- validation


def _check_counts(num_layers: int, num_stages: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_layers == 0:
        raise ValueError(f"cannot cut an empty spec list into {num_stages} stages; it needs at least one layer")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_stages} stages; use at most {num_layers} stages"
        )


def _check_weights(weights: Sequence[float]) -> None:
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {w!r} of layer {i} is invalid; weights must be finite non-negative numbers")


def _check_entry(spec, index: int) -> None:
    if isinstance(spec, LayerSpec):
        return
    if isinstance(spec, nn.Module):
        raise built_module_error(spec, index)
    if not callable(spec):
        raise TypeError(
            f"entry {index} of the spec list is {type(spec).__name__} {spec!r}; "
            "expected a LayerSpec, TiedLayerSpec or plain callable"
        )


def _example(num_layers: int, num_stages: int) -> list[int]:
    return [round(s * num_layers / num_stages) for s in range(num_stages + 1)]


# ---------------------------------------------------------------- weights



def _type_weights(specs: list, pattern: str) -> list[int]:
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise ValueError(f"partition method 'type:{pattern}': {pattern!r} is not a valid regex ({err})") from None
    names = [spec_name(spec) for spec in specs]
    weights = [1 if regex.search(name) else 0 for name in names]
    if not any(weights):
        known = ", ".join(dict.fromkeys(names))
        raise ValueError(f"partition method 'type:{pattern}' matches no layer; the layer class names are: {known}")
    return weights


def _parameter_weights(specs: list) -> list[int]:
    """Parameter counts; entries with equal (class, args, kwargs) are built once."""
    cache: dict = {}
    weights = []
    for spec in specs:
        key = _spec_key(spec)
        if key not in cache:
            cache[key] = count_parameters(spec)
        weights.append(cache[key])
    return weights


def _spec_key(spec):
    if not isinstance(spec, LayerSpec):
        return ("callable",)
    key = (spec.module_cls, spec.args, tuple(sorted(spec.kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return ("id", id(spec))
    return key


# ---------------------------------------------------------------- algorithm
# `prefix[j]` is the weight of layers [0, j); stage [i, j) weighs prefix[j] - prefix[i].


def _reach(prefix: list, i: int, cap, max_len: int) -> int:
    """Largest j <= i + max_len with stage [i, j) weighing <= cap (i itself if layer i is too heavy)."""
    hi = min(i + max_len, len(prefix) - 1) + 1
    return bisect_right(prefix, cap, i, hi, key=lambda x: x - prefix[i]) - 1


def _reach_back(prefix: list, j: int, cap, max_len: int) -> int:
    """Smallest i >= j - max_len with stage [i, j) weighing <= cap."""
    return bisect_left(prefix, -cap, max(0, j - max_len), j + 1, key=lambda x: x - prefix[j])


def _feasible(prefix: list, num_stages: int, cap, max_len: int) -> bool:
    """Can the layers be cut into <= num_stages stages of weight <= cap and length <= max_len?

    Greedy from the left, which is optimal for interval-monotone limits; with
    at least num_stages layers, fewer stages can always be split up to exactly
    num_stages without breaking either limit.
    """
    n, i = len(prefix) - 1, 0
    for _ in range(num_stages):
        j = _reach(prefix, i, cap, max_len)
        if j == i:
            return False
        if j == n:
            return True
        i = j
    return False


def _bottleneck(prefix: list, num_stages: int):
    """Least weight of the heaviest stage (Nicol's algorithm).

    Stage p starts at i. Let j* be the smallest end with prefix[j*] - prefix[i]
    feasible. Either some optimal partition ends stage p at or after j*, and
    then B* is exactly that weight (a candidate), or one ends it before, and
    then one ends it at j* - 1 (a stage lighter than B*; the rest, a suffix,
    stays feasible), so the search continues from there. B* is the least
    candidate.
    """
    n, best, i = len(prefix) - 1, math.inf, 0
    for p in range(num_stages - 1):
        last = n - (num_stages - 1 - p)  # leave one layer for each later stage
        j = _first_feasible_end(prefix, num_stages, i, last)
        if j is None:
            i = last
            continue
        best = min(best, prefix[j] - prefix[i])
        if j == i + 1:
            return best
        i = j - 1
    return min(best, prefix[n] - prefix[i])


def _first_feasible_end(prefix: list, num_stages: int, i: int, last: int):
    """Smallest j in (i, last] whose stage weight [i, j) is a feasible bottleneck, or None."""
    n = len(prefix) - 1
    lo, hi = i + 1, last + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(prefix, num_stages, prefix[mid] - prefix[i], n):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo <= last else None


def _shortest_longest_stage(prefix: list, num_stages: int, cap) -> int:
    """Least L such that stages of weight <= cap and length <= L cover all layers."""
    n = len(prefix) - 1
    lo, hi = -(-n // num_stages), n
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(prefix, num_stages, cap, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _place(prefix: list, num_stages: int, cap, max_len: int) -> list[int]:
    """Boundaries under both limits, each placed by the tie-break of the module docstring.

    `earliest[m]` is the first position from which the remaining layers fit in
    m stages (greedy from the right); a boundary must lie at or after it and
    within reach of the previous boundary, which keeps every later step feasible.
    """
    n = len(prefix) - 1
    earliest = [n]
    for _ in range(num_stages - 1):
        earliest.append(_reach_back(prefix, earliest[-1], cap, max_len))
    bounds = [0]
    for p in range(1, num_stages):
        prev, rest = bounds[-1], num_stages - p
        lo = max(prev + 1, earliest[rest])
        hi = min(_reach(prefix, prev, cap, max_len), n - rest)
        bounds.append(_pick(prefix, prev, lo, hi, rest + 1))
    return bounds + [n]


def _pick(prefix: list, prev: int, lo: int, hi: int, stages_left: int) -> int:
    """The end in [lo, hi] nearest an even share of what remains: weight, then length, then leftmost."""
    n = len(prefix) - 1
    share_w = (prefix[n] - prefix[prev]) / stages_left
    share_n = (n - prev) / stages_left
    return min(range(lo, hi + 1), key=lambda j: (abs(prefix[j] - prefix[prev] - share_w), abs(j - prev - share_n), j))
