"""Point-to-point transfer of stage activations and their gradients.

Shapes and dtypes are known in advance on both sides (from a meta-device run
of the model, on input shapes that the stage-0 rank sends once, at the first
step, to ranks given no inputs), so a message is just its tensors, sent one
`isend` each in a fixed order. Sends are posted and their handles
returned: the caller keeps the tensors alive and waits at the end of the step
(so sends never block, which is what the schedule simulator assumes).
Receives can be posted ahead (`post_recv`) and waited for when the data is
needed (`wait_recv`, with a timeout). Posting early matters on gloo: a send
that finds its receive already posted goes out at once, one that does not waits
for the receiver to post it and ask for the data, a round trip between two
processes that the engine's `recv_ahead` takes out of the critical path (see
the README's Performance section for what it is worth). Messages between two
ranks match in the order they were posted, so receives must be posted in the
order the peer sends them.

Lanes. Communication lanes: a forward and a backward that run at once never share a process group.

An OVERLAP action (`pipekit.schedules.ir`) runs a forward of one microbatch beside a
backward of another, on two threads, so that the collectives inside one (the MoE
all-to-all, a tensor-parallel all-reduce) hide behind the other's compute. Collectives
on one group must be issued in the same order on every member, and two threads give
no order. So while an engine runs overlapped actions, every collective inside the
model goes through `lane(group)`: a forward uses the group itself, a backward (any
code the autograd engine runs, a checkpointed recomputation included) its twin, a
second group of the same ranks (`Topology.backward_twins`). Each lane's collectives
then come in program order on every rank, as they do without overlap.

Without twins registered `lane` returns its argument: nothing changes.

Streams (`Lanes`): the streams an OVERLAP's two lanes run on. An OVERLAP runs
a forward on a second thread while the engine's thread runs a backward
(`PipelineEngine._overlap`). Their collectives already go to different process
groups (`lane` above: the backward's twin groups), and on a GPU each NCCL group
queues its work on its own stream. What is left is the compute: on one CUDA
stream the forward's kernels would queue behind the backward's, and the
forward's all-to-all behind both. So the forward lane runs on a side stream:

- before it starts, its stream waits for the engine thread's stream (inputs that
  arrived there, weights a step changed: everything queued so far);
- after both lanes are done, the engine thread's stream waits for it, so every
  action after the OVERLAP (a send of its output, the next backward, the step)
  sees its work, as it would on one stream.

A backward's kernels run on the stream its forward ran on (the autograd engine's
rule), so the backward of a microbatch whose forward was overlapped runs on that
side stream, whichever thread calls it. There are two side streams, and each
forward takes the one its partner backward does not run on: the two lanes never
share a stream, and a tensor one lane frees is never the block the other lane is
writing at the same time (a freed block goes back to its own stream's pool).

On the CPU `torch.cpu`'s streams are placeholders (waits do nothing, work runs
in order on its thread), so the program here is the one a GPU runs, and exact.
Thread-local state the forward needs is carried to its thread: grad mode and,
on a GPU, the current device (autocast is refused around a step: the engine's
`_refuse_autocast`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class PeerTimeout(RuntimeError):
    """A peer did not deliver a message in time."""


class PeerClosed(RuntimeError):
    """A peer closed its connection before delivering a message (it stopped or crashed)."""


_CLOSED = ("Connection closed", "Connection reset", "Broken pipe", "closed by peer")


def float_entries(x) -> list[torch.Tensor]:
    """The floating-point tensors of an activation: those that carry gradients back."""
    if isinstance(x, torch.Tensor):  # the common case, one tensor
        return [x] if x.is_floating_point() else []
    items = x if isinstance(x, tuple) else (x,)
    return [t for t in items if t.is_floating_point()]


def send(tensors: list[torch.Tensor], dst: int) -> list[tuple[dist.Work, torch.Tensor]]:
    """Post one non-blocking send per tensor to global rank `dst`."""
    posted = []
    for t in tensors:
        t = t.detach().contiguous()
        work = dist.isend(t, dst=dst)
        assert work is not None  # None only on a rank outside the group: the default group has them all
        posted.append((work, t))
    return posted


def recv(like: list[torch.Tensor], src: int, device: torch.device, timeout: datetime.timedelta) -> list[torch.Tensor]:
    """Receive tensors shaped like the (meta) tensors `like` from global rank `src`."""
    return wait_recv(post_recv(like, src, device), timeout)


class PostedRecv:
    """Receives posted into fresh buffers, not yet waited for."""

    def __init__(self, bufs: list[torch.Tensor], works: list, src: int):
        self.bufs, self.works, self.src = bufs, works, src


def post_recv(like: list[torch.Tensor], src: int, device: torch.device) -> PostedRecv:
    """Post one non-blocking receive per tensor shaped like the (meta) tensors `like` from global rank `src`."""
    bufs = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in like]
    return PostedRecv(bufs, [dist.irecv(b, src=src) for b in bufs], src)


def wait_recv(posted: PostedRecv, timeout: datetime.timedelta) -> list[torch.Tensor]:
    """The buffers of `posted` once every receive in it has completed (PeerTimeout, PeerClosed otherwise)."""
    src = posted.src
    for w in posted.works:
        try:
            w.wait(timeout=timeout)
        except RuntimeError as e:
            if any(mark in str(e) for mark in _CLOSED):
                raise PeerClosed(f"rank {src} closed its connection before sending (it stopped or failed; its own "
                                 f"error, if any, is reported by that rank) ({e})") from e
            raise PeerTimeout(f"no message from rank {src} within {timeout.total_seconds():.0f} s ({e})") from e
    return posted.bufs


def wait_all(posted: list[tuple[dist.Work, torch.Tensor]], timeout: datetime.timedelta) -> None:
    for w, _ in posted:
        w.wait(timeout=timeout)
    posted.clear()


# Lanes: a forward and a backward that run at once never share a process group.
_twins: dict = {}  # process group -> its backward twin


def use_backward_twins(twins: dict) -> None:
    """From now on backward passes in this process communicate over `twins[group]` for each group."""
    _twins.update(twins)


def lane(group):
    """The group a collective on `group` uses here: its backward twin inside a backward pass
    (when one is registered), else `group`."""
    if group is None or not _twins or torch._C._current_graph_task_id() == -1:
        return group
    return _twins.get(group, group)


class Lanes:
    """Side streams for OVERLAP forwards on `device` (a `torch.device`), and which stream each
    (stage, microbatch)'s forward ran on this step. `streams`: the device module (torch.cuda,
    torch.cpu, or a stand-in with the same Stream / current_stream / stream / set_device)."""

    def __init__(self, device: torch.device, streams: Any = None):
        self.device = device
        self.streams = streams if streams is not None else torch.get_device_module(device)
        self.side = [self._new_stream(), self._new_stream()]
        self.ran_on: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> its forward's side stream

    def _new_stream(self):
        return self.streams.Stream(self.device) if self.device.type == "cuda" else self.streams.Stream()

    def new_step(self) -> None:
        """Forget last step's forwards (their backwards are done)."""
        self.ran_on.clear()

    def stream_for(self, backward_key: tuple[int, int]):
        """The side stream a forward beside the backward of `backward_key` takes: not the one that
        backward runs on (its forward's, where that forward was overlapped)."""
        busy = self.ran_on.get(backward_key)
        return self.side[1] if busy is self.side[0] else self.side[0]

    def forward_lane(self, forward_key: tuple[int, int], backward_key: tuple[int, int]
                     ) -> tuple[Callable[[Callable[[], None]], None], Callable[[], None]]:
        """(run, join) for one OVERLAP, both made on the engine's thread: `run(fn)` runs fn on the
        forward lane's stream (call it on the forward's thread); `join()` makes the engine thread's
        stream wait for that stream (call it after both lanes finished)."""
        main = self.streams.current_stream()
        side = self.stream_for(backward_key)
        side.wait_stream(main)
        self.ran_on[forward_key] = side
        carried = _thread_state(self.device, self.streams)

        def run(fn: Callable[[], None]) -> None:
            with carried(), self.streams.stream(side):
                fn()

        def join() -> None:
            main.wait_stream(side)

        return run, join


def _thread_state(device: torch.device, streams: Any) -> Callable[[], contextlib.AbstractContextManager]:
    """A context manager factory that sets, on another thread, the calling thread's grad mode
    and (CUDA) current device: both thread-local in torch."""
    grad = torch.is_grad_enabled()
    cuda_index = device.index if device.type == "cuda" else None

    @contextlib.contextmanager
    def carried():
        if cuda_index is not None:
            streams.set_device(cuda_index)
        with torch.set_grad_enabled(grad):
            yield

    return carried
