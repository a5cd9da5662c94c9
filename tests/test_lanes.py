"""`pipekit.comm.Lanes`: an OVERLAP's forward runs on a side stream, joined after.

The streams are a device module's (torch.cuda on a GPU, torch.cpu's placeholders
here); a recording stand-in with the same four calls shows the protocol the engine
follows on either: the side stream waits for the engine thread's stream before
the forward, the forward runs with the side stream current on its own thread,
the engine thread's stream waits for it after both lanes, and consecutive
overlaps alternate side streams so a forward never shares a stream with the
backward beside it (which runs where its own forward ran). The thread-local
state a forward needs (grad mode, the CUDA device) reaches its thread; a step
under torch.autocast is refused in one line.
The exactness of overlapped schedules across ranks is tests/test_moe_overlap.py.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import pipekit
from pipekit.comm import Lanes
from pipekit.models.toy import ToyConfig, lm_loss, toy_lm
from pipekit.schedules import Kind, build_schedule

M = 4
CFG = ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)


class _Stream:
    def __init__(self, owner: _Streams, name: str):
        self.owner, self.name = owner, name

    def wait_stream(self, other: _Stream) -> None:
        self.owner.log.append(("wait", self.name, other.name))


class _Streams:
    """torch.cuda's stream calls, recorded: Stream, current_stream, stream, set_device."""

    def __init__(self):
        self.log: list[tuple] = []
        self.local = threading.local()
        self.main = _Stream(self, "main")
        self.made: list[tuple] = []

    def Stream(self, *device):  # noqa: N802 (torch's name)
        self.made.append(device)
        return _Stream(self, f"side{len(self.made) - 1}")

    def current_stream(self) -> _Stream:
        return getattr(self.local, "stream", self.main)

    @contextlib.contextmanager
    def stream(self, s: _Stream):
        before = self.current_stream()
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = before

    def set_device(self, index: int) -> None:
        self.log.append(("set_device", index, threading.current_thread().name))


def _engine(overlap: bool, streams=None):
    schedule = build_schedule("1f1b", 1, M, overlap=overlap)
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, seed=3, schedule=schedule)
    engine = pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    if streams is not None:
        engine.lanes = Lanes(torch.device("cpu"), streams=streams)
    return engine


def _batch(seed: int):
    ids = torch.randint(0, CFG.vocab, (M * 2, 9), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def test_an_overlapped_forward_runs_on_a_side_stream_joined_after_and_alternates():
    streams = _Streams()
    engine = _engine(True, streams)
    overlaps = [a for a in engine.schedule.ranks[0] if a.kind is Kind.OVERLAP]
    assert len(overlaps) == M - 1  # 0F1+0B0, 0F2+0B1, 0F3+0B2
    forward = engine._forward
    seen = []

    def spy(st, a):
        seen.append((str(a), streams.current_stream().name, threading.current_thread() is threading.main_thread(),
                     torch.is_grad_enabled()))
        streams.log.append(("forward", str(a)))
        forward(st, a)

    engine._forward = spy
    for step in range(2):
        streams.log.clear()
        seen.clear()
        engine.train_batch(_batch(step))
        on_side = [s for s in seen if not s[2]]
        assert [s[0] for s in on_side] == [str(a.pair[0]) for a in overlaps]
        # F1 beside B0 (whose forward ran on the main stream): side0; F2 beside B1 (F1's side0): side1; F3: side0
        assert [s[1] for s in on_side] == ["side0", "side1", "side0"], on_side
        assert all(s[3] for s in on_side), "grad mode did not reach the forward's thread"
        assert all(s[1] == "main" for s in seen if s[2]), "a forward on the engine's thread left the main stream"
        waits = [e for e in streams.log if e[0] != "set_device"]
        for a, side in zip(overlaps, ["side0", "side1", "side0"]):
            i = waits.index(("forward", str(a.pair[0])))
            assert waits[i - 1] == ("wait", side, "main"), waits  # inputs and weights first
            assert waits[i + 1] == ("wait", "main", side), waits  # then everything after waits for it
    assert streams.made == [(), ()]  # the CPU's streams take no device


def test_a_step_under_autocast_is_refused_in_one_line_naming_the_precision_to_set():
    engine = _engine(True)
    for step in (engine.train_batch, engine.eval_batch):
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
                ValueError, match=r"^(train|eval)_batch ran under torch.autocast\('cpu', dtype=torch.bfloat16\), "
                                  r"which pipekit does not take.*precision=\"bf16\".*train.precision=bf16"):
            step(_batch(0))
    assert float(engine.train_batch(_batch(0))) > 0  # outside it, the same engine steps


def test_on_a_gpu_the_lanes_make_device_streams_and_set_the_device_on_the_forward_thread():
    streams = _Streams()
    lanes = Lanes(torch.device("cuda", 1), streams=streams)
    assert streams.made == [(torch.device("cuda", 1),)] * 2
    run, join = lanes.forward_lane((0, 1), (0, 0))
    seen = []
    thread = threading.Thread(target=run, args=(lambda: seen.append(streams.current_stream().name),), name="fwd")
    thread.start()
    thread.join()
    join()
    assert seen == ["side0"]
    assert streams.log == [("wait", "side0", "main"), ("set_device", 1, "fwd"), ("wait", "main", "side0")]
    run, _ = lanes.forward_lane((0, 2), (0, 1))  # beside the backward of the forward that ran on side0
    assert lanes.ran_on[(0, 2)].name == "side1"
    lanes.new_step()
    assert lanes.ran_on == {}
