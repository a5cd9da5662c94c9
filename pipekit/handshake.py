"""The shape handshake: the microbatch input shapes every pipeline rank sizes its buffers by.

Only the rank of stage 0 is sure to be given inputs. At the first step it sends their
shapes (a length, then a JSON text) to every other pipeline rank, which answers with
one flag: whether it was given inputs itself. No later step communicates.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from . import comm
from .microbatch import all_tensors


def _shapes(x) -> tuple:
    """(is a tuple, ((shape, dtype), ...)) of a microbatch's inputs: what sizes every buffer."""
    return isinstance(x, tuple), tuple((tuple(t.shape), t.dtype) for t in all_tensors(x))


def _shapes_to_json(shapes: tuple) -> list:
    return [shapes[0], [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in shapes[1]]]


def _shapes_from_json(obj: list) -> tuple:
    return bool(obj[0]), tuple((tuple(shape), getattr(torch, dtype)) for shape, dtype in obj[1])


def _meta_of(shapes: tuple):
    """Meta tensors of the shapes recorded by `_shapes`."""
    is_tuple, items = shapes
    metas = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in items)
    return metas if is_tuple else metas[0]


def _shape_text(shapes: tuple) -> str:
    items = ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in shapes[1])
    return f"({items})" if shapes[0] else items


class InputShapes:
    """The microbatch input shapes that size every receive buffer, agreed at the first step.

    At its first step the rank holding stage 0 (the owner) posts its shapes to every
    other pipeline rank (a length and a JSON text, before any action), and each of
    them posts the owner one flag: whether it was given inputs. The others wait for
    the shapes before their first action; the owner reads the flags after its last
    (so a silent peer still fails at a named action). No later step communicates: a
    rank given inputs sizes from them (so shapes may change between steps while every
    rank passes inputs); a rank given none at the first step takes that step's shapes
    for good, so the owner then refuses inputs of other shapes, and a rank that was
    given inputs then cannot do without them later (it could not know the shapes).
    """

    def __init__(self, topo, timeout, stages: list[int], owner: int, microbatches: int):
        """`topo`: the Topology; `stages`: this rank's virtual stages; `owner`: the pp rank of stage 0;
        `microbatches`: a step's."""
        self.topo, self.timeout, self.microbatches = topo, timeout, microbatches
        self.stages = stages
        self.owner = owner
        self.first: tuple | None = None  # the owner's shapes at the first step
        self.had_inputs: bool | None = None  # this rank's inputs at the first step (None: no step yet)
        self.without: list[int] = []  # known on the owner after the first step: pp ranks given no inputs
        self._flags: dict = {}  # on the owner during the first step: pp rank -> (posted receive, flag)

    def _where(self) -> str:
        t = self.topo
        return f"rank {t.rank} (pp_rank {t.pp_rank}, dp_rank {t.dp_rank}, stages {self.stages})"

    def examples(self, micro_in: list | None, posted: list, *, uniform: bool = False) -> list:
        """Per microbatch: its inputs (`micro_in`, None: none given), or meta tensors shaped
        as the first step's, to size this step's buffers; the first step's sends go to
        `posted`. Microbatches of different shapes (`pipekit.Microbatches`) need every
        pipeline rank to size from its own inputs. `uniform`: every microbatch is shaped as
        the first (an even split of a batch), whose inputs then stand for all of them."""
        m = self.microbatches
        if micro_in is None or uniform:
            return [self._example(None if micro_in is None else micro_in[0], posted)] * m
        first = self._example(micro_in[0], posted)
        return [first, *(self._example(x, posted) for x in micro_in[1:])]

    def _example(self, example, posted: list):
        mine = None if example is None else _shapes(example)
        if self.had_inputs is None:
            self._first_step(mine, posted)
        if mine is None:
            if self.had_inputs:
                raise ValueError(
                    f"{self._where()} got no inputs, but it was given them at the first step, so the rank of "
                    f"stage 0 does not hold the shapes fixed and this rank cannot know them; pass None for the "
                    "inputs from the first step on (the shapes then stay the first step's), or pass them every step"
                )
            assert self.first is not None  # a rank given no inputs got them from stage 0's at the first step
            return _meta_of(self.first)
        if self.topo.pp_rank == self.owner:
            fixed = self.without
        else:
            fixed = [] if self.had_inputs else [self.topo.pp_rank]
        if fixed and mine != self.first:
            assert self.first is not None  # fixed: the first step's shapes are stage 0's, held since
            raise ValueError(
                f"{self._where()}: the inputs' microbatch shapes changed from {_shape_text(self.first)} at the "
                f"first step to {_shape_text(mine)}, but pipeline rank(s) {fixed} passed no inputs then and size "
                "their buffers from the first step's shapes; keep the shapes fixed (microbatches of other lengths "
                "included), or pass the inputs on every pipeline rank from the first step on"
            )
        return example

    def _first_step(self, mine: tuple | None, posted: list) -> None:
        t, device = self.topo, self.topo.device
        self.had_inputs = mine is not None
        if t.pp == 1:
            self.first = mine
            return
        if t.pp_rank == self.owner:
            assert mine is not None  # the rank of stage 0 is always given inputs (`_check_needs`)
            self.first = mine
            text = torch.tensor(list(json.dumps(_shapes_to_json(mine)).encode()), dtype=torch.uint8, device=device)
            length = torch.tensor([text.numel()], dtype=torch.int64, device=device)
            for r in range(t.pp):
                if r != self.owner:
                    posted += comm.send([length, text], t.global_rank(r))
                    flag = torch.zeros(1, dtype=torch.int64, device=device)
                    self._flags[r] = (dist.irecv(flag, src=t.global_rank(r)), flag)
            return
        owner = t.global_rank(self.owner)
        posted += comm.send([torch.tensor([int(self.had_inputs)], dtype=torch.int64, device=device)], owner)
        try:
            (length,) = comm.recv([torch.empty(1, dtype=torch.int64, device="meta")], owner, device, self.timeout)
            (text,) = comm.recv([torch.empty(int(length), dtype=torch.uint8, device="meta")], owner, device,
                                self.timeout)
        except (comm.PeerTimeout, comm.PeerClosed) as e:
            raise type(e)(f"{self._where()} waiting for the inputs' shapes from rank {owner} (stage 0) at the "
                          f"first step: {e}") from e
        self.first = _shapes_from_json(json.loads(bytes(text.cpu().tolist()).decode()))
        if mine is not None and mine != self.first:
            raise ValueError(f"{self._where()}: its inputs' microbatch shapes {_shape_text(mine)} differ from those "
                             f"of rank {owner} (stage 0), {_shape_text(self.first)}; pass the same batch on every "
                             "pipeline rank of a data-parallel replica, or None where it is not needed")

    def finish_first_step(self) -> None:
        """On the owner after its first step: read which ranks were given no inputs."""
        flags, self._flags = self._flags, {}
        for r, (work, flag) in flags.items():
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as e:
                raise comm.PeerTimeout(f"{self._where()}: no word from pp_rank {r} on its inputs at the first "
                                       f"step ({e})") from e
            if not flag.item():
                self.without.append(r)
