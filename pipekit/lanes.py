"""The streams an OVERLAP's two lanes run on.

An OVERLAP runs a forward on a second thread while the engine's thread runs a
backward (`PipelineEngine._overlap`). Their collectives already go to different
process groups (`pipekit.comm.lane`: the backward's twin groups), and on a GPU
each NCCL group queues its work on its own stream. What is left is the compute:
on one CUDA stream the forward's kernels would queue behind the backward's, and
the forward's all-to-all behind both. So the forward lane runs on a side stream:

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
from collections.abc import Callable
from typing import Any

import torch


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
