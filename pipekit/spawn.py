"""Run a function on N local processes joined in a gloo group: the planner's profiler and
ping-pong use it, and so do the tests (`pipekit.testing.run_distributed` is this).

`run_distributed(fn, world_size, *args)` spawns `world_size` workers, each
initialising `torch.distributed` over a file store in a fresh temporary
directory, with one intra-op thread, then calling `fn(*args)`. It returns the
list of per-rank return values. `init="env"` instead sets MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE and starts no group (`fn` calls
`pipekit.init_distributed()` or `Topology()`, as a script's own
torch.multiprocessing workers would); `init="none"` sets nothing and starts
no group. A worker exception is re-raised in the parent with the rank and
the worker's traceback; a worker that neither returns nor fails within
`timeout` seconds fails the call instead of hanging it. `fn` must be a
module-level function (it is pickled by name). Limits: one machine; gloo only
(the workers run on the CPU).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

INITS = ("file", "env", "none")


def _worker(rank: int, world_size: int, init: str, init_file: str, port: int, fn, args, results,
            op_timeout: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if init == "file":
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=op_timeout),
            )
        elif init == "env":
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world_size))
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, not shared-memory tensors, which die with this process
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, op_timeout: float = 60.0,
                    init: str = "file") -> list:
    """Run `fn(*args)` on `world_size` gloo ranks; return each rank's result, in rank order.

    `init`: "file" (each worker joins a gloo group over a file store first, with
    `op_timeout`), "env" (each worker gets MASTER_ADDR, MASTER_PORT (a free port), RANK
    and WORLD_SIZE, and no group: `fn` starts it) or "none" (no group, no variables)."""
    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {list(INITS)}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pipekit-dist-") as tmp:
        init_file = os.path.join(tmp, "store")
        port = _free_port() if init == "env" else 0
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init, init_file, port, fn, args, results, op_timeout),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collect(procs, results, world_size: int, timeout: float) -> list:
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode != 0]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting") \
                    from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
        out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [out[r] for r in range(world_size)]
