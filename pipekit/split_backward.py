"""A stage's backward in two passes: input grads now (`I`), weight grads later (`W`),
no work done twice.

Plan (the zero-bubble split; torch.distributed.pipelining's `stage_backward_input`
and `stage_backward_weight` take the same route):

1. `backward_input(outputs, grads, inputs, params)` walks the autograd graph under the
   outputs once. The *input part* is every node from which a stage input is
   reachable: what `torch.autograd.grad(outputs, inputs)` runs. The nodes between a
   parameter and the input part are the parameter's own (run only for its weight
   grad); the input-part nodes with an edge into them are its *boundary*. While
   the input grads are computed (`retain_graph=True`), hooks on the boundary nodes
   save the gradients flowing into them. An output that depends on no input (a
   first stage's, whose input is token ids) is a boundary itself, with its given
   grad, so there the input pass does nothing and the weight pass all the work.
2. `backward_weight(split)` runs, per group of parameters sharing boundary nodes,
   `torch.autograd.backward` from those boundaries (with the saved gradients) into
   the group's parameters: autograd computes only the edges that lead to them, so
   a boundary node (a matmul's backward, say) now computes just its weight-side
   product, and the parameters' `.grad` accumulate with their post-accumulate-grad
   hooks firing as in a plain backward (ZeRO's bucketing relies on them).

Limits: a group whose boundary nodes lie one below the other (a weight used twice
along one path) recomputes the input-part nodes between them (the lower node's
saved gradient replaces what arrives there, so nothing counts twice); a custom
autograd Function on a boundary computes all its input grads in both passes; a
region under (non-reentrant) activation checkpointing is recomputed by each pass
that needs its activations, so up to twice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class _Group:
    """Parameters whose weight grads start from the same boundary nodes."""

    params: list[torch.Tensor] = field(default_factory=list)
    boundary: set = field(default_factory=set)  # input-part nodes, restarted with saved grads
    outputs: set = field(default_factory=set)  # indices of outputs outside the input part


@dataclass
class WeightGradWork:
    """What `backward_input` leaves for `backward_weight`: the graph stays alive through it."""

    groups: list[_Group]
    saved: dict  # boundary node -> the grads that flowed into it during the input pass
    outputs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # k -> (output k, its grad), outside the input part


def _node(t: torch.Tensor):
    """The autograd node a tensor's gradient flows into: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        with torch.enable_grad():
            return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _parents(roots) -> dict:
    """node -> the nodes that send it gradient, over the graph under `roots`."""
    parents, seen, stack = defaultdict(list), set(roots), list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    parents.update({r: parents[r] for r in roots})
    return parents


def _above(starts, parents) -> set:
    """`starts` and every node from which one of them is reachable."""
    found, stack = set(), [n for n in starts if n in parents]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(parents[node])
    return found


def _plan(params, input_part, parents, root_index) -> list[_Group]:
    """Group the parameters by shared boundary nodes (union-find over their closures)."""
    owner: dict = {}  # boundary node or ("out", k) -> group index
    link = list(range(len(params)))

    def find(i):
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    closures = []
    for i, p in enumerate(params):
        boundary, outs = _param_closure(_node(p), input_part, parents, root_index)
        closures.append((boundary, outs))
        for key in [*boundary, *(("out", k) for k in outs)]:
            if key in owner:
                link[find(i)] = find(owner[key])
            else:
                owner[key] = i
    by_root: dict[int, _Group] = {}
    for i, p in enumerate(params):
        boundary, outs = closures[i]
        if not boundary and not outs:
            continue  # not under these outputs: no gradient from this pass
        g = by_root.setdefault(find(i), _Group())
        g.params.append(p)
        g.boundary |= boundary
        g.outputs |= outs
    return list(by_root.values())


def _param_closure(start, input_part, parents, root_index) -> tuple[set, set]:
    """(boundary nodes, indices of outputs) above a parameter's accumulator, walking up
    through nodes outside the input part."""
    boundary, outs, seen, stack = set(), set(), set(), [start] if start in parents else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        outs |= root_index.get(node, set())
        for parent in parents[node]:
            if parent in input_part:
                boundary.add(parent)
            else:
                stack.append(parent)
    return boundary, outs


def backward_input(outputs, grads, inputs, params) -> tuple[list[torch.Tensor], WeightGradWork]:
    """Input grads of a stage (zeros for an input the outputs do not depend on) and the
    work its weight grads still need (`backward_weight`).

    `outputs`: tensors requiring grad; `grads`: their grads (None for a scalar loss);
    `inputs`: the stage's float input leaves; `params`: the parameters to leave work for.
    """
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    roots = [_node(o) for o in outputs]
    parents = _parents([r for r in roots if r is not None])
    want = [x for x in inputs if x.requires_grad]
    input_part = _above([_node(x) for x in want], parents)
    root_index = defaultdict(set)
    for k, r in enumerate(roots):
        if r is not None and r not in input_part:
            root_index[r].add(k)
    params = [p for p in params if p.requires_grad]
    groups = _plan(params, input_part, parents, root_index)
    saved: dict = {}
    handles = [node.register_prehook(_saver(saved, node)) for g in groups for node in g.boundary]
    try:
        pairs = [(o, g) for o, g, r in zip(outputs, grads, roots) if r in input_part]
        found = (torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], retain_graph=True,
                                     allow_unused=True) if pairs and want else [None] * len(want))
    finally:
        for h in handles:
            h.remove()
    by_input = {id(x): g for x, g in zip(want, found)}
    input_grads = [by_input.get(id(x)) for x in inputs]
    input_grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, input_grads)]
    outside = {k: (outputs[k], grads[k]) for ks in root_index.values() for k in ks}
    return input_grads, WeightGradWork(groups, saved, outside)


def _saver(saved: dict, node):
    def hook(grad_outputs):
        saved[node] = grad_outputs

    return hook


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the weight grads `backward_input` left, into each parameter's `.grad`."""
    for group in work.groups:
        roots, grads = [], []
        for node in group.boundary:
            for i, g in enumerate(work.saved.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    grads.append(g)
        for k in sorted(group.outputs):
            out, g = work.outputs[k]
            roots.append(get_gradient_edge(out))
            grads.append(g)
        if not roots:
            continue
        clamps = ([node.register_prehook(lambda _, g=work.saved[node]: g) for node in group.boundary
                   if node in work.saved] if len(group.boundary) > 1 else [])
        try:
            torch.autograd.backward(roots, grads, inputs=group.params, retain_graph=True)
        finally:
            for h in clamps:
                h.remove()
    work.groups, work.saved, work.outputs = [], {}, {}
