"""A stage's backward in two passes: input grads now (`I`), weight grads later (`W`),
no work done twice.

Plan (the zero-bubble split; torch.distributed.pipelining's `stage_backward_input`
and `stage_backward_weight` take the same route):

1. `backward_input(outputs, grads, inputs, params)` walks the autograd graph under the
   outputs and records its *shape* (each node's type and edges). The *input part* is
   every node from which a stage input is reachable: what `torch.autograd.grad(outputs,
   inputs)` runs. The nodes between a parameter and the input part are the parameter's
   own (run only for its weight grad); the input-part nodes with an edge into them are
   its *boundary*; parameters sharing boundary nodes form a group. One engine call
   computes the input grads (`retain_graph=True`) and captures the gradients entering
   the boundary nodes. An output that depends on no input is a boundary itself, with
   its given grad; with no input to differentiate (a first stage's input is token ids)
   the input pass does nothing, not even the walk, and the weight pass is one engine
   call from the outputs. Everything but the walk depends only on the graph's shape,
   so it is worked out once per shape (`_plan`, cached, in positions of the walk):
   the next microbatches of a stage pay for the walk alone.
2. `backward_weight(work)` restarts the engine at the boundaries, with the captured
   gradients, into the parameters (`inputs=`): autograd computes only the edges that
   lead to them, so a boundary node (a matmul's backward, say) now computes just its
   weight-side product, and the parameters' `.grad` accumulate with their
   post-accumulate-grad hooks firing as in a plain backward (ZeRO's bucketing relies
   on them). Groups share an engine call (each call walks the whole graph under its
   roots, the main cost of W at small sizes) unless a boundary of one lies below a
   boundary of the other on a path through a node that computes something (anything
   but a view or a pass-through add, `_FREE`): that node would run again. In a call,
   a boundary that another root reaches gets its captured gradient in place of what
   arrives (a pre-hook), so nothing counts twice; one reached only through `_FREE`
   nodes from a single root (a matmul under its bias add) needs neither capture nor
   hook, since what arrives is bit for bit what arrived in the input pass. A GPT
   block's ten groups take six calls.

Limits: a group whose boundary nodes lie one below the other (a weight used twice
along one path) recomputes the input-part nodes between them; a custom autograd
Function on a boundary computes all its input grads in both passes; a region under
(non-reentrant) activation checkpointing is recomputed by each engine call that needs
its activations. Tensor hooks on a boundary's output run in both passes, each time on
what arrived, so the weight grads see them once, as in a full backward; but where a
pre-hook replaces what arrives at a boundary, the weight pass uses the gradient from
before them. A parameter whose gradient sums three or more contributions may differ
from a full backward in the last bit (the order of the sum). The engine is entered
through `torch.autograd.graph._engine_run_backward`, as `torch.autograd.backward` and
`grad` enter it after their argument checks, which cost about as much as a small call:
the gradients the weight pass starts from are the engine's own, and the outputs'
shapes are checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge

# the node a leaf's gradient flows into (torch's stubs for torch._C._functions leave it out)
_LEAF = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]

# Node types whose backward only re-views or passes on its gradient: recomputing one
# between two weight-pass roots costs nothing, so their groups may share an engine call.
_FREE = frozenset({
    "AddBackward0", "AddBackward1", "AliasBackward0", "CloneBackward0", "PermuteBackward0",
    "ReshapeAliasBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "TBackward0", "TransposeBackward0", "TransposeBackward1", "UnsafeViewBackward0",
    "UnsqueezeBackward0", "ViewBackward0",
})

_CACHE_SIZE = 64  # graph shapes remembered (a stage usually has one; MoE routing may make more)


@dataclass(frozen=True)
class _Group:
    """Parameters whose weight grads start from the same boundary nodes."""

    params: tuple[int, ...]  # indices into backward_input's params (those requiring grad)
    slots: tuple[int, ...]  # indices into _Plan.slots: the boundary inputs restarted with saved grads
    lives: tuple[int, ...]  # slots whose gradient reaches the group (its own, and its derived boundaries')
    outputs: tuple[int, ...]  # indices of outputs outside the input part (roots with their given grads)


@dataclass(frozen=True)
class _Call:
    """One engine call of the weight pass."""

    groups: tuple[_Group, ...]
    clamps: tuple[tuple[tuple[int, int], ...], ...]  # per boundary another root reaches: its
    # ((input nr, slot), ...), the captured grads that replace what arrives there


@dataclass(frozen=True)
class _Plan:
    """The split of one graph shape, in positions of `_walk`'s order."""

    inside: tuple[int, ...]  # outputs in the input part: the roots of the input pass
    slots: tuple[tuple[int, int], ...]  # (position, input nr): boundary inputs the input pass captures
    calls: tuple[_Call, ...]


@dataclass
class WeightGradWork:
    """What `backward_input` leaves for `backward_weight`: the graph stays alive through it."""

    plan: _Plan
    edges: tuple  # per plan slot: its GradientEdge (the node holds the graph under it)
    saved: list  # per plan slot: the gradient that flowed into it during the input pass (or None)
    params: list[torch.Tensor]
    outputs: list[tuple[torch.Tensor, torch.Tensor]]  # (output, its grad), indexed as backward_input's


_plans: dict = {}


def _walk(roots, params) -> tuple[list, dict, tuple]:
    """(nodes, node -> position, shape) of the graph under `roots`, breadth-first. The
    shape is flat: per node its type, then for a leaf's accumulator its index in `params`
    (-1 for any other leaf), else its number of edges and each edge's child position and
    input nr (-1 alone for an edge to nothing). Equal shapes mean equal graphs up to
    which tensors they hold."""
    tag = {id(p): i for i, p in enumerate(params)}
    index: dict[Any, int] = {}  # autograd node -> its position
    nodes: list[Any] = []
    shape: list[Any] = []
    for r in roots:
        if r is not None and r not in index:
            index[r] = len(nodes)
            nodes.append(r)
    add = shape.append
    for node in nodes:  # grows while we go
        kind = type(node)
        add(kind)
        if kind is _LEAF:
            add(tag.get(id(node.variable), -1))
            continue
        edges = node.next_functions
        add(len(edges))
        for child, nr in edges:
            if child is None:
                add(-1)
                continue
            pos = index.get(child)
            if pos is None:
                pos = index[child] = len(nodes)
                nodes.append(child)
            add(pos)
            add(nr)
    return nodes, index, tuple(shape)


def _unflatten(shape) -> tuple[list, list]:
    """(type, edges as (child, input nr)) per node, and per node its leaf tag (None if not a leaf)."""
    kinds: list[type] = []
    edges: list[tuple[tuple[int, int], ...]] = []
    tags: list[int | None] = []
    i = 0
    while i < len(shape):
        kind, i = shape[i], i + 1
        kinds.append(kind)
        if kind is _LEAF:
            edges.append(())
            tags.append(shape[i])
            i += 1
            continue
        n, i, es = shape[i], i + 1, []
        for _ in range(n):
            if shape[i] == -1:
                i += 1
            else:
                es.append((shape[i], shape[i + 1]))
                i += 2
        edges.append(tuple(es))
        tags.append(None)
    return list(zip(kinds, edges)), tags


def _lookup(key) -> _Plan:
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _CACHE_SIZE:
            del _plans[next(iter(_plans))]
        plan = _plans[key] = _plan(*key)
    return plan


def _plan(shape, roots, inputs) -> _Plan:
    """The split of a graph of this shape, whose outputs enter at `roots` ((position,
    input nr) or None) and whose differentiated inputs sit at `inputs` (positions or None)."""
    shape, tags = _unflatten(shape)
    edges = [e for _, e in shape]
    parents: list[list[tuple[int, int]]] = [[] for _ in shape]  # per position: (parent, input nr)
    for p, es in enumerate(edges):
        for c, nr in es:
            parents[c].append((p, nr))
    input_part = _above([p for p in inputs if p is not None], parents)
    outside: dict[int, list[int]] = {}  # position -> outputs rooted there, outside the input part
    for k, r in enumerate(roots):
        if r is not None and r[0] not in input_part:
            outside.setdefault(r[0], []).append(k)
    groups = _groups(tags, input_part, parents, outside)
    rooted = {r[0] for r in roots if r is not None}
    calls = _calls(shape, edges, parents, input_part, rooted, [g[0] for g in groups])
    derived = {b: top for _, _, d in calls for b, top in d.items()}
    entries = {b: sorted({nr for _, nr in parents[b]} | {r[1] for r in roots if r is not None and r[0] == b})
               for bs, _, _ in groups for b in bs if b not in derived}  # boundary -> input nrs grads enter by
    slots = [(b, nr) for b in sorted(entries) for nr in entries[b]]
    slot_of = {s: i for i, s in enumerate(slots)}

    def at(bs):
        return tuple(slot_of[(b, nr)] for b in sorted(bs) for nr in entries[b])

    def clamp(b):
        return tuple((nr, slot_of[(b, nr)]) for nr in entries[b])

    made = [_Group(tuple(params), at(bs - derived.keys()), at({derived.get(b, b) for b in bs}), tuple(sorted(outs)))
            for bs, params, outs in groups]
    inside = tuple(k for k, r in enumerate(roots) if r is not None and r[0] in input_part)
    return _Plan(inside, tuple(slots), tuple(_Call(tuple(made[g] for g in members), tuple(map(clamp, clamps)))
                                             for members, clamps, _ in calls))


def _above(starts, parents) -> set:
    """`starts` and every position from which one of them is reachable."""
    found, stack = set(), list(starts)
    while stack:
        p = stack.pop()
        if p not in found:
            found.add(p)
            stack.extend(q for q, _ in parents[p])
    return found


def _groups(tags, input_part, parents, outside) -> list[tuple[set, list[int], set]]:
    """(boundary positions, parameter indices, outputs) per group of parameters sharing
    boundary nodes or outputs (union-find over their closures), in parameter order."""
    leaves = sorted((t, p) for p, t in enumerate(tags) if t is not None and t >= 0)
    owner: dict = {}  # boundary position or ("out", k) -> first leaf index holding it
    link = list(range(len(leaves)))

    def find(i):
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    closures = []
    for i, (_, pos) in enumerate(leaves):
        boundary, outs = _closure(pos, input_part, parents, outside)
        closures.append((boundary, outs))
        for key in [*boundary, *(("out", k) for k in outs)]:
            if key in owner:
                link[find(i)] = find(owner[key])
            else:
                owner[key] = i
    by_root: dict[int, tuple[set, list[int], set]] = {}
    for i, (param, _) in enumerate(leaves):
        boundary, outs = closures[i]
        if not boundary and not outs:
            continue  # not under these outputs: no gradient from this pass
        g = by_root.setdefault(find(i), (set(), [], set()))
        g[0].update(boundary)
        g[1].append(param)
        g[2].update(outs)
    return list(by_root.values())


def _closure(start, input_part, parents, outside) -> tuple[set, set]:
    """(boundary positions, outputs) above a leaf, walking up through nodes outside the input part."""
    boundary, outs, seen, stack = set(), set(), set(), [start]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        outs.update(outside.get(p, ()))
        for q, _ in parents[p]:
            if q in input_part:
                boundary.add(q)
            else:
                stack.append(q)
    return boundary, outs


def _calls(shape, edges, parents, input_part, rooted, boundaries) -> list[tuple[list[int], list[int], dict]]:
    """Groups (given by their boundary sets) into engine calls, top of the graph first.
    Two groups conflict when a boundary of one reaches one of the other through a node
    outside `_FREE`. Per call: (group indices, boundaries to clamp, {derived boundary: the
    root it derives from}); see `_derived`."""
    bit = {b: 1 << i for i, b in enumerate(sorted(set().union(*boundaries)))}
    below, costly, rank = _reach(shape, edges, input_part, bit)
    masks = [sum(bit[b] for b in bs) for bs in boundaries]
    danger = [_or(costly[b] for b in bs) for bs in boundaries]
    order = sorted(range(len(boundaries)), key=lambda g: -max((rank[b] for b in boundaries[g]), default=len(shape)))
    calls: list[list] = []  # [members, mask, danger]
    for g in order:
        for call in calls:
            if not (danger[g] & call[1] or call[2] & masks[g]):
                call[0].append(g)
                call[1] |= masks[g]
                call[2] |= danger[g]
                break
        else:
            calls.append([[g], masks[g], danger[g]])
    out = []
    for members, _, _ in calls:
        mine = {b for g in members for b in boundaries[g]}
        reached = _or(below[b] for b in mine)
        clamps: list[int] = []
        derived: dict[int, int] = {}
        for b in sorted(mine, key=lambda b: -rank[b]):  # a chain's top before its foot
            if bit[b] & reached:
                top = _derived(b, parents, shape, mine, rooted)
                if top is None:
                    clamps.append(b)
                else:
                    derived[b] = derived.get(top, top)
        out.append((sorted(members), sorted(clamps), derived))
    return out


def _derived(b, parents, shape, mine, rooted):
    """The boundary of `mine` whose gradient alone reaches boundary `b`, through single edges
    into `_FREE` nodes (a bias add above its matmul, say): then what arrives at `b` in the
    weight pass is bit for bit what arrived in the input pass, and `b` needs neither a
    saved gradient nor a clamp. None if there is no such boundary."""
    q = b
    while q not in rooted and len(parents[q]) == 1:
        p = parents[q][0][0]
        if shape[p][0].__name__ not in _FREE:
            return None
        if p in mine:
            return p
        q = p
    return None


def _reach(shape, edges, input_part, bit) -> tuple[dict, dict, dict]:
    """Per input-part position: the boundaries strictly below it (bit sets), those of them
    reached through a node outside `_FREE` (itself included), and its rank in a
    children-first order."""
    below: dict[int, int] = {}
    costly: dict[int, int] = {}
    rank: dict[int, int] = {}
    for p in _postorder(edges, input_part):
        reach = hard = 0
        for c, _ in edges[p]:
            if c in input_part:
                reach |= bit.get(c, 0) | below[c]
                hard |= costly[c]
        below[p] = reach
        costly[p] = hard if shape[p][0].__name__ in _FREE else reach
        rank[p] = len(rank)
    return below, costly, rank


def _postorder(edges, keep) -> list[int]:
    """The positions in `keep`, each after every child of it in `keep`."""
    order, done = [], set()
    for start in sorted(keep):
        if start in done:
            continue
        done.add(start)
        stack = [(start, iter(edges[start]))]
        while stack:
            p, it = stack[-1]
            for c, _ in it:
                if c in keep and c not in done:
                    done.add(c)
                    stack.append((c, iter(edges[c])))
                    break
            else:
                order.append(p)
                stack.pop()
    return order


def _or(values) -> int:
    out = 0
    for v in values:
        out |= v
    return out


def backward_input(outputs, grads, inputs, params) -> tuple[list[torch.Tensor], WeightGradWork]:
    """Input grads of a stage (zeros for an input the outputs do not depend on) and the
    work its weight grads still need (`backward_weight`).

    `outputs`: tensors requiring grad; `grads`: their grads (None for a scalar loss);
    `inputs`: the stage's float input leaves; `params`: the parameters to leave work for.
    """
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    for k, (o, g) in enumerate(zip(outputs, grads)):
        if g.shape != o.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{k}] has a shape of {g.shape} "
                               f"and output[{k}] has a shape of {o.shape}.")
    params = [p for p in params if p.requires_grad]
    want = [x for x in inputs if x.requires_grad]
    if not want:  # nothing to differentiate now (a first stage): W runs the whole backward
        outs = tuple(k for k, o in enumerate(outputs) if o.requires_grad)
        plan = _Plan((), (), (_Call((_Group(tuple(range(len(params))), (), (), outs),), ()),) if outs else ())
        return [torch.zeros_like(x) for x in inputs], WeightGradWork(plan, (), [], params, list(zip(outputs, grads)))
    ends = [get_gradient_edge(o) if o.requires_grad else None for o in outputs]
    nodes, index, shape = _walk([e.node if e is not None else None for e in ends], params)
    roots = tuple(None if e is None else (index[e.node], e.output_nr) for e in ends)
    at = tuple(index.get(get_gradient_edge(x).node) for x in want)
    plan = _lookup((shape, roots, at))
    pairs = [(outputs[k], grads[k]) for k in plan.inside]
    captures = tuple(GradientEdge(nodes[p], nr) for p, nr in plan.slots)
    found: tuple[torch.Tensor | None, ...]  # None: unreachable (allow_unreachable)
    if pairs and want:
        found = _engine_run_backward(tuple(o for o, _ in pairs), tuple(g for _, g in pairs), True, False,
                                     tuple(want) + captures, allow_unreachable=True, accumulate_grad=False)
    else:
        found = (None,) * (len(want) + len(captures))
    by_input = {id(x): g for x, g in zip(want, found)}
    reached = [by_input.get(id(x)) for x in inputs]
    input_grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, reached)]
    work = WeightGradWork(plan, captures, list(found[len(want):]), params, list(zip(outputs, grads)))
    return input_grads, work


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the weight grads `backward_input` left, into each parameter's `.grad`."""
    jobs = [job for call in work.plan.calls if (job := _job(work, call))[0]]  # all before the engine runs
    for roots, grads, params, clamps in jobs:
        hooks = [node.register_prehook(_clamp(found)) for node, found in clamps]
        try:
            _engine_run_backward(roots, grads, True, False, params, allow_unreachable=True, accumulate_grad=True)
        finally:
            for h in hooks:
                h.remove()
    work.plan, work.edges, work.saved, work.outputs = _Plan((), (), ()), (), [], []


def _job(work: WeightGradWork, call: _Call) -> tuple:
    """(roots, their grads, params, [(node, {input nr: grad})] to clamp) of one engine call."""
    saved, edges = work.saved, work.edges
    roots, grads, params = [], [], []
    for group in call.groups:
        if not group.outputs and all(saved[s] is None for s in group.lives):
            continue  # no gradient reached it in the input pass
        params += [work.params[i] for i in group.params]
        for s in group.slots:
            if saved[s] is not None:
                roots.append(edges[s])
                grads.append(saved[s])
        for k in group.outputs:
            out, g = work.outputs[k]
            roots.append(get_gradient_edge(out))
            grads.append(g)
    clamps = [(edges[slots[0][1]].node, {nr: saved[s] for nr, s in slots}) for slots in call.clamps]
    return tuple(roots), tuple(grads), tuple(params), clamps


def _clamp(found: dict):
    """A pre-hook giving a boundary node the gradients it received in the input pass."""
    def hook(grad_outputs):
        return tuple(found.get(i) for i in range(len(grad_outputs)))

    return hook
