"""Offload: master weights and optimizer state in host memory (`cpu`) or in files (`nvme`).

ZeRO-Offload and ZeRO-Infinity's idea, over pipekit's buckets (buckets.py). With offload on,
each bucket's master part is a host tensor of its own (not a view of the parameters, even
for a float32 model), the wrapped optimizer is built over pieces of those host tensors, and
its step runs on the CPU, one bucket at a time:

    gradient    the bucket's reduced, unscaled and clipped gradient (on the device, where
                the norm and the non-finite check were made as without offload) is copied
                into a host buffer: pinned and asynchronous on CUDA, one buffer per bucket
                for `cpu`, a fresh one per bucket for `nvme`. At ZeRO-2 the gradient shards
                themselves live in host memory instead (`add_grad`): each bucket's reduced
                shard, every backward pass, is copied out as soon as its reduce-scatter is
                done (pinned, asynchronous, through two staging buffers in turn) and added
                into the host shard, so the device holds only the buckets in flight; the
                norm, the non-finite check and the clipping then read the host shards
    step        the wrapped optimizer steps that bucket's pieces only (the others have no
                `.grad` at that moment, so torch's optimizers pass them by): the same
                per-element arithmetic as one step over all of them
    back        the updated master part is copied into the parameters' owned part on the
                device (pinned: asynchronous); the all-gather of ZeRO 1/2 follows as before

`nvme` also pages each bucket out after its step: its master part and every per-element
optimizer entry (gathered into one flat host tensor per key, of which each piece's entry is
a view) are written to `offload_dir/<rank dir>/bucket<i>.bin` and their storages freed
(resized to 0 bytes: the tensors and the optimizer's references to them stay valid). The
step reads bucket i + 1 in a background thread while bucket i steps and writes bucket i − 1
behind it, so at most three buckets are resident at once: host memory is bounded by a few
buckets, not by the model. Scalar entries (a step count) stay in memory. Anything that reads
the state (checkpoints, `state_dict`) takes one bucket in at a time (`resident`).

On a CPU-only run `cpu` offload holds the same memory as none (host and device are one), but
every copy, buffer and step above is the one a GPU run makes, so it is tested here.

Parameter offload (ZeRO-3, `offload_params="cpu"`; `pipekit.optim.fsdp`): FSDP keeps the
parameter shards themselves in host memory, so their step is this one, whatever `offload`
says (`none` becomes `cpu`, as FSDP2's CPUOffloadPolicy steps the optimizer on the CPU; `nvme`
pages the state as above). Such a bucket's (`Bucket.host`) master part is already in host
memory — the shard itself (a float32 model) or its float32 copy —, so `cpu` keeps it instead
of copying it again, and "back" writes into the host shard, which FSDP copies to the device
at its next all-gather.

The early step (`overlap`, `cpu` or `nvme`; `ZeroOptimizer(offload_overlap=True)`): the step needs a
world-wide verdict — the non-finite check and the global gradient norm, both collectives over
every stage — which a pipeline stage whose backward ends first (the last, in 1F1B) would wait
for, idle, while the others finish their cooldown. Instead, once its own gradients are reduced
(over dp) and unscaled, `start` copies them to the host and steps every bucket in a background
thread, as if nothing were clipped or skipped, first saving each bucket's master part and its
stepped pieces' state into buffers kept between steps. `finish` takes the verdict: nothing
clipped (the coefficient is exactly 1 within the norm) and nothing skipped keeps the step;
skipped puts every bucket back as it was; clipped puts them back and steps again over the
gradients times the coefficient — the multiplication the device's gradients get. So the bits
are those of the step after the verdict, and the cost is one more copy of the offloaded state
in host memory, plus a second step wherever clipping acts. With `nvme` the state is in files,
so the copy is a file: the early step streams the buckets through memory as the step does
and writes each one's stepped state to `bucket<i>.next` beside the `bucket<i>.bin` it read
(each gradient copied to the host just before its bucket steps, one at a time); kept, each
.next replaces its .bin and the master parts are read back for the parameters; put back,
the .next files are dropped and only what lives in memory (step counts, entries a first step
made) is restored, then, clipped, the buckets step again from their files. Host memory stays
a few buckets; the disk holds the state twice during the step. A stage holding a tied layer
starts its other buckets first and adds the tied layer's (`extend`) once its pp sum (the
partner stage's gradient) arrives.

ZeRO-1 keeps whole gradients on the device by definition (its reduce-scatter is at the last
pass, into a shard of the whole bucket), and ZeRO-3's are reduced by FSDP at the step itself, so
theirs are copied to the host there, as reduced.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .buckets import Bucket
from .stage import Stage

OFFLOADS = ("none", "cpu", "nvme")
PARAM_OFFLOADS = ("none", "cpu")


def check_offload_params(offload_params: str, stage: int) -> None:
    """ValueError in one line when `offload_params` is not one of PARAM_OFFLOADS, or is on
    below ZeRO stage 3 (only stage 3 shards the parameters themselves)."""
    if offload_params == "nvme":
        raise ValueError("offload_params='nvme': ZeRO-3 here is FSDP2, whose parameter offload is host memory "
                         "only (CPUOffloadPolicy); use offload_params='cpu' (and offload='nvme' for the optimizer "
                         "state)")
    if offload_params not in PARAM_OFFLOADS:
        raise ValueError(f"offload_params={offload_params!r} is not one of {list(PARAM_OFFLOADS)}")
    if offload_params != "none" and stage != 3:
        raise ValueError(f"offload_params={offload_params!r} offloads the parameter shards of ZeRO stage 3, but "
                         f"stage={stage}; use stage=3, or offload_params='none' (offload= moves the optimizer at "
                         f"any stage)")


def check_offload(offload: str, offload_dir: str | None) -> None:
    """ValueError naming the value when `offload` is not one of OFFLOADS, or nvme has no directory."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not one of {list(OFFLOADS)}")
    if offload == "nvme" and not offload_dir:
        raise ValueError("offload='nvme' keeps the optimizer state in files: give offload_dir (a directory on a "
                         "fast local disk)")


def steps_on(offload: str, offload_params: str) -> str:
    """Where the offloaded step runs as asked: `offload`, but "cpu" where only the parameters
    are offloaded (their master weights and state are host memory: so is their step)."""
    return "cpu" if offload == "none" and offload_params == "cpu" else offload


def check_overlap(kind: str, overlap: bool) -> None:
    """ValueError in one line when the early step (`overlap`) is asked without a host step
    (`kind`: `steps_on`'s answer, "none")."""
    if overlap and kind not in ("cpu", "nvme"):
        raise ValueError(f"offload_overlap=True starts the host step before the world's verdict: it needs a host "
                         f"step, offload='cpu' or 'nvme' (or offload_params='cpu'), not offload={kind!r}")


@dataclass
class Early:
    """One early step (`Offload.start`, `extend`): the buckets in order, their host gradients
    and hyperparameters, the parameters stepped, one job per start or extend; `started`/`done`/
    `verdict` (time.monotonic) and `kept` (the verdict left it as it was) say what happened;
    `extended`: when the last `extend` came (0.0: none)."""
    order: list[int]
    grads: dict[int, torch.Tensor]
    hyper: dict[int, dict]
    touched: set[int]
    futures: list[Future] = field(default_factory=list)
    started: float = 0.0
    extended: float = 0.0
    done: float = 0.0
    verdict: float = 0.0  # when `finish` was given the verdict
    kept: bool = False


class Offload:
    """The host (and disk) side of the buckets' master weights and optimizer state (module
    docstring). Made by `ZeroOptimizer(offload=...)` before the wrapped optimizer, which is
    built over the host master parts; `attach` gives it that optimizer."""

    def __init__(self, kind: str, buckets: list[Bucket], stage: Stage, *, offload_dir: str | None = None,
                 pin_memory: bool = True, device: torch.device | None = None, overlap: bool = False):
        check_offload(kind, offload_dir)
        check_overlap(kind, overlap)
        assert kind != "none"
        self.kind, self.buckets, self.stage, self.overlap = kind, buckets, stage, overlap
        self._early_pool: ThreadPoolExecutor | None = None  # overlap: the thread the early step runs in
        self._saved: dict[int, dict[int, dict[str, Any] | None]] = {}  # overlap: bucket -> its pieces' saved state
        self._saved_bufs: dict[int, dict[tuple, torch.Tensor]] = {}  # overlap: the copies, kept between steps
        self._saved_flats: dict[int, set[str]] = {}  # overlap, nvme: the flat entries a bucket had before
        self.last_early: Early | None = None
        if device is None:  # the gradients' device: the buckets' (a host-held shard's are on the topology's)
            device = next((b.param_buf.device for b in buckets), torch.device("cpu"))
        self.pinned = pin_memory and device.type == "cuda" and kind == "cpu"  # nvme pages its storages: pageable
        self.host_grads: list[torch.Tensor | None] = [None] * len(buckets)  # cpu: one per bucket, kept
        # ZeRO-2: the gradient shards themselves in host memory (never paged: pinned either way), each
        # bucket's reduced shard added in as reduced (`add_grad`), through two staging buffers in turn
        self.grads_on_host = stage.shards_grads
        self.pin_grads = pin_memory and device.type == "cuda"
        self._staging: list[torch.Tensor] = []  # free staging buffers
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor, int]] = []  # (event, buffer, shard, n), oldest first
        if self.grads_on_host:
            for bi, b in enumerate(buckets):
                if b.grad_shard is not None:
                    b.grad_shard = torch.zeros(b.grad_shard.shape, dtype=b.grad_shard.dtype, pin_memory=self.pin_grads)
                    self.host_grads[bi] = b.grad_shard
            widest_shard = max((g.numel() for g in self.host_grads if g is not None), default=0)
            dtype = next((g.dtype for g in self.host_grads if g is not None), torch.float32)
            self._staging = [torch.empty(widest_shard, dtype=dtype, pin_memory=self.pin_grads) for _ in range(2)]
        self.inner: torch.optim.Optimizer | None = None
        self.flats: list[dict[str, torch.Tensor]] = [{} for _ in buckets]  # nvme: per-element entries, flat
        self.resident_now: set[int] = set()
        self.peak_resident = 0
        self.directory: str | None = None
        self._io: ThreadPoolExecutor | None = None
        if kind == "nvme":
            assert offload_dir is not None
            os.makedirs(offload_dir, exist_ok=True)
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self.directory = tempfile.mkdtemp(prefix=f"pipekit-offload-rank{rank}-", dir=offload_dir)
            weakref.finalize(self, shutil.rmtree, self.directory, True)
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipekit-offload")
        # Each bucket's master part, a host tensor of its own, and the pieces the wrapped optimizer
        # steps: views, made while the storage is there; nvme writes the bucket out at once (so at
        # most one bucket's copy is in memory while they are made).
        self.pieces: list[list[torch.Tensor]] = []
        for bi, b in enumerate(buckets):
            if kind == "nvme":
                b.master = _paged(b.master.numel(), b.master.dtype).copy_(b.master)
            elif not b.host:  # a host-held shard's master is host memory already: kept
                b.master = torch.empty(b.master.shape, dtype=b.master.dtype, pin_memory=self.pinned).copy_(b.master)
            self.pieces.append([b.master[x:e] for x, e, _ in b.pieces])
            self.resident_now.add(bi)
            if kind == "nvme":
                self._page_out(bi)

    def attach(self, inner: torch.optim.Optimizer | None) -> None:
        """The wrapped optimizer, built over `pieces`."""
        self.inner = inner

    # ---- ZeRO-2: the gradient shards in host memory, as reduced ------------------------------
    def add_grad(self, b: Bucket, reduced: torch.Tensor) -> None:
        """Add bucket `b`'s reduced shard `reduced` (on the device; its buffer may be freed at
        once) into its host gradient shard: copied into a staging buffer (pinned: asynchronous,
        an event marks its landing), added on the host when that buffer is needed again or at
        `flush`. Oldest first, so each shard meets its passes' gradients in order."""
        if not self._staging:
            self._land(self._pending.pop(0))
        buf, n = self._staging.pop(), reduced.numel()
        buf[:n].copy_(reduced, non_blocking=self.pin_grads)
        event = None
        if self.pin_grads:
            event = torch.cuda.Event()
            event.record()
        assert b.grad_shard is not None and b.grad_shard.numel() == n
        self._pending.append((event, buf, b.grad_shard, n))

    def _land(self, pending: tuple[Any, torch.Tensor, torch.Tensor, int]) -> None:
        event, buf, shard, n = pending
        if event is not None:
            event.synchronize()
        shard.add_(buf[:n])
        self._staging.append(buf)

    def flush(self) -> None:
        """Every staged gradient added into its host shard (before anything reads them)."""
        while self._pending:
            self._land(self._pending.pop(0))

    # ---- the step -------------------------------------------------------------------
    def step(self, grads: list[torch.Tensor], touched: set[int], hyper: Callable[[int], dict]) -> None:
        """The wrapped optimizer's step, bucket by bucket on the host (module docstring); each
        bucket's updated master part is copied into the parameters' owned part."""
        self._steps(self._order(), lambda bi: self._host_grad(bi, grads[bi]),
                    lambda bi: hyper(self.buckets[bi].group_index), touched)
        if self.pinned:
            torch.cuda.current_stream().synchronize()  # the host buffers are reused at the next step

    def _steps(self, order: list[int], grad_of: Callable[[int], torch.Tensor], hyper_of: Callable[[int], dict],
               touched: set[int], *, back: bool = True, to: str = ".bin") -> None:
        """Step the buckets of `order` over `grad_of(bi)`; `back`: each master into the parameters
        after its step. nvme: bucket i + 1 read while i steps, i written (to `bucket<i><to>`)
        behind i + 1; every write done on return."""
        nvme = self.kind == "nvme"
        reading: dict[int, Future] = {}
        if order and nvme:
            reading[order[0]] = self._submit(self._page_in, order[0])
        for n, bi in enumerate(order):
            if nvme:
                if n + 1 < len(order):  # read the next bucket while this one steps
                    reading[order[n + 1]] = self._submit(self._page_in, order[n + 1])
                reading.pop(bi).result()
            self._step_bucket(bi, grad_of(bi), hyper_of(bi), touched)
            if back:
                self._back(bi)
            if nvme:
                self._submit(lambda b: self._page_out(b, to), bi)  # written behind the next bucket's step
        if self._io is not None:
            self._io.submit(lambda: None).result()  # every write done: state on disk, pages given back

    def _order(self) -> list[int]:
        return [bi for bi, b in enumerate(self.buckets) if b.pieces]

    def _step_bucket(self, bi: int, host_grad: torch.Tensor, hyper: dict, touched: set[int]) -> None:
        """The wrapped optimizer steps bucket `bi`'s pieces (those in `touched`) over `host_grad`."""
        inner = self.inner
        assert inner is not None
        b, group = self.buckets[bi], inner.param_groups[bi]
        group.update(hyper)
        for piece, (a, e, p) in zip(group["params"], b.pieces):
            piece.grad = host_grad[a:e] if id(p) in touched else None
        inner.step()  # only this bucket's pieces have a .grad: the others are passed by
        for piece in group["params"]:
            piece.grad = None

    def _back(self, bi: int) -> None:
        """Bucket `bi`'s updated master part into the parameters' owned part (pinned: asynchronous)."""
        b = self.buckets[bi]
        self.stage.owned(b, b.param_buf).copy_(b.master, non_blocking=self.pinned)

    # ---- the early step (overlap) ----------------------------------------------------------
    def start(self, grads: Any, touched: set[int], hyper: Callable[[int], dict],
              only: list[int] | None = None) -> Early:
        """Begin the step before the world's verdict (`overlap`): each bucket's gradient
        (`grads[bi]`: reduced and unscaled, not yet clipped) copied to the host here, then, in a
        background thread, each bucket's state saved and stepped as if nothing were clipped or
        skipped. `only`: those buckets now, the others by `extend` (a tied layer's, once its pp
        sum is in). `finish` takes the verdict."""
        assert self.overlap
        early = Early([], {}, {}, touched)
        early.started = time.monotonic()
        self.extend(early, grads, hyper, only)
        return early

    def extend(self, early: Early, grads: Any, hyper: Callable[[int], dict], only: list[int] | None = None) -> None:
        """Add buckets `only` (None: every one) to the early step, stepped after those before."""
        keep = None if only is None else set(only)
        order = [bi for bi in self._order() if keep is None or bi in keep]
        # nvme: each bucket's gradient copied to the host in the thread, just before its step (one
        # at a time, as without overlap); the device's gradients are left as they are until `finish`
        for bi in order:
            early.grads[bi] = grads[bi] if self.kind == "nvme" else self._host_grad(bi, grads[bi])
            early.hyper[bi] = hyper(self.buckets[bi].group_index)
        early.order += order
        if early.futures:
            early.extended = time.monotonic()
        if self._early_pool is None:
            self._early_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipekit-early-step")
        early.futures.append(self._early_pool.submit(self._early_steps, early, order))

    def _early_steps(self, early: Early, order: list[int]) -> None:
        with torch.no_grad():  # a thread of its own: autograd's mode is per thread
            if self.kind == "nvme":  # the stepped state to bucket<i>.next, the files as they were kept
                for bi in order:
                    self._save_scalars(bi, early.touched)
                self._steps(order, lambda bi: self._host_grad(bi, early.grads[bi]), early.hyper.__getitem__,
                            early.touched, back=False, to=".next")
            else:
                for bi in order:
                    self._save(bi, early.touched)
                    self._step_bucket(bi, early.grads[bi], early.hyper[bi], early.touched)
        early.done = time.monotonic()

    def finish(self, early: Early, *, skip: bool, coef: torch.Tensor | None) -> None:
        """The verdict for an early step: kept where nothing was skipped or clipped (the clipping
        coefficient `coef` is exactly 1 within the norm); skipped: every bucket's state put back
        as it was; clipped: put back, then stepped again over the gradients times `coef` (the
        same multiplication the device's gradients got). Then the masters go to the parameters."""
        assert early.futures
        early.verdict = time.monotonic()
        for job in early.futures:
            job.result()
        clipped = coef is not None and coef.item() != 1.0
        early.kept = not (skip or clipped)
        self.last_early = early
        if self.kind == "nvme":
            self._finish_paged(early, skip=skip, factor=coef.to(device="cpu") if clipped and coef is not None else None)
            return
        if not early.kept:
            for bi in early.order:
                self._restore(bi)
        if skip:
            return
        if clipped:
            assert coef is not None
            factor = coef.to(device="cpu")
            with torch.no_grad():
                for bi in early.order:
                    self._step_bucket(bi, early.grads[bi].mul_(factor), early.hyper[bi], early.touched)
        for bi in early.order:
            self._back(bi)
        if self.pinned:
            torch.cuda.current_stream().synchronize()

    def _finish_paged(self, early: Early, *, skip: bool, factor: torch.Tensor | None) -> None:
        """`finish` for nvme, whose early step wrote each bucket's stepped state to
        `bucket<i>.next` beside the file it read: kept, each .next becomes the bucket's file and
        its master part is read back into the parameters; else the .next files are dropped and
        the in-memory entries (step counts, entries a first step made) put back, and, clipped,
        the buckets step again from their files over the gradients times `factor`."""
        assert self.inner is not None
        if early.kept:
            for bi in early.order:
                os.replace(self._path(bi, ".next"), self._path(bi))
                self._saved.pop(bi, None)
                self._saved_flats.pop(bi, None)
                master = self.buckets[bi].master
                if master.numel():
                    with open(self._path(bi), "rb") as f:  # the master part leads the file
                        f.readinto(_bytes_of(master))
                self._back(bi)
                _release(master)
            return
        for bi in early.order:
            os.remove(self._path(bi, ".next"))
            self._restore_scalars(bi)
        if skip:
            return
        assert factor is not None
        with torch.no_grad():
            self._steps(early.order, lambda bi: self._host_grad(bi, early.grads[bi]).mul_(factor),
                        early.hyper.__getitem__, early.touched)

    def _save_scalars(self, bi: int, touched: set[int]) -> None:
        """nvme's `_save`: the per-element entries stay in the bucket's file (the early step writes
        another), so only what is in memory is kept: each stepped piece's scalar entries (a step
        count), whether it had state at all, and which flat entries the bucket had."""
        inner = self.inner
        assert inner is not None
        b, group = self.buckets[bi], inner.param_groups[bi]
        entries: dict[int, dict[str, Any] | None] = {}
        for i, (piece, (_, _, p)) in enumerate(zip(group["params"], b.pieces)):
            if id(p) not in touched:
                continue
            state = inner.state.get(piece)
            entries[i] = None if not state else {
                k: (v.clone() if v.shape != piece.shape else None) if isinstance(v, torch.Tensor) else v
                for k, v in state.items()}  # None: a per-element entry, in the file
        self._saved[bi] = entries
        self._saved_flats[bi] = set(self.flats[bi])

    def _restore_scalars(self, bi: int) -> None:
        inner = self.inner
        assert inner is not None
        group = inner.param_groups[bi]
        before = self._saved_flats.pop(bi)
        for key in [k for k in self.flats[bi] if k not in before]:  # made by this (first) step: not in the file
            del self.flats[bi][key]
        for i, entry in self._saved.pop(bi).items():
            piece = group["params"][i]
            if entry is None:  # made by this step (a first one): gone again
                inner.state.pop(piece, None)
                continue
            state = inner.state[piece]
            for k in [k for k in state if k not in entry]:
                del state[k]
            for k, v in entry.items():
                if v is not None:
                    state[k] = v

    def _save(self, bi: int, touched: set[int]) -> None:
        """Bucket `bi`'s master part and the optimizer state of its pieces in `touched`, copied
        into buffers kept from step to step (`_restore` puts them back)."""
        inner = self.inner
        assert inner is not None
        b, group = self.buckets[bi], inner.param_groups[bi]
        bufs = self._saved_bufs.setdefault(bi, {})
        entries: dict[int, dict[str, Any] | None] = {}

        def kept(key: tuple, t: torch.Tensor) -> torch.Tensor:
            buf = bufs.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = bufs[key] = torch.empty_like(t, device="cpu")
            return buf.copy_(t)

        kept(("master",), b.master)
        for i, (piece, (_, _, p)) in enumerate(zip(group["params"], b.pieces)):
            if id(p) not in touched:
                continue  # not stepped: nothing changes
            state = inner.state.get(piece)
            entries[i] = None if not state else {
                k: kept((i, k), v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        self._saved[bi] = entries

    def _restore(self, bi: int) -> None:
        inner = self.inner
        assert inner is not None
        b, group = self.buckets[bi], inner.param_groups[bi]
        b.master.copy_(self._saved_bufs[bi][("master",)])
        for i, entry in self._saved.pop(bi).items():
            piece = group["params"][i]
            if entry is None:  # made by this step (a first one): gone again
                inner.state.pop(piece, None)
                continue
            state = inner.state[piece]
            for k in [k for k in state if k not in entry]:
                del state[k]
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor):
                    state[k].copy_(v)
                else:
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v

    def _host_grad(self, bi: int, grad: torch.Tensor) -> torch.Tensor:
        """`grad` (the device's, unscaled and clipped) in a host buffer: bucket `bi`'s own (cpu),
        or a fresh one freed after the step (nvme). At ZeRO-2 `grad` is in host memory already
        (the host shard, or its copy in the master dtype): itself."""
        if self.grads_on_host:
            return grad
        buf = self.host_grads[bi]
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
            buf = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pinned)
            if self.kind == "cpu":
                self.host_grads[bi] = buf
        buf.copy_(grad, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream().synchronize()  # the copy lands before the CPU reads it
        return buf

    # ---- nvme: paging ---------------------------------------------------------------------
    @contextmanager
    def resident(self, bi: int) -> Iterator[None]:
        """Bucket `bi`'s master part and optimizer state in memory inside the block (nvme: read
        in, and written out again after; cpu: always)."""
        if self.kind != "nvme":
            yield
            return
        self._submit(self._page_in, bi).result()
        try:
            yield
        finally:
            self._submit(self._page_out, bi).result()

    @contextmanager
    def all_resident(self) -> Iterator[None]:
        """Every bucket in memory inside the block (a same-layout `state_dict`: as much host
        memory as `cpu` offload, for that moment)."""
        if self.kind != "nvme":
            yield
            return
        for bi in range(len(self.buckets)):
            self._submit(self._page_in, bi).result()
        try:
            yield
        finally:
            for bi in range(len(self.buckets)):
                self._submit(self._page_out, bi).result()

    def _submit(self, fn: Callable[[int], None], bi: int) -> Future:
        assert self._io is not None
        return self._io.submit(fn, bi)

    def _tensors(self, bi: int) -> list[torch.Tensor]:
        flats = self.flats[bi]
        return [self.buckets[bi].master] + [flats[k] for k in sorted(flats)]

    def _path(self, bi: int, suffix: str = ".bin") -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"bucket{bi}{suffix}")

    def _page_in(self, bi: int) -> None:
        if bi in self.resident_now:
            return
        tensors = self._tensors(bi)
        with open(self._path(bi), "rb") as f:
            for t in tensors:
                if t.numel():
                    f.readinto(_bytes_of(t))
        self.resident_now.add(bi)
        self.peak_resident = max(self.peak_resident, len(self.resident_now))

    def _page_out(self, bi: int, to: str = ".bin") -> None:
        """Gather bucket `bi`'s per-element optimizer entries into its flat tensors (an entry
        made since, at a first step or a load, is copied in and becomes a view), write the
        master part and the flats to its file (`bucket<i><to>`), and give their pages back."""
        if bi not in self.resident_now:
            return
        new = self._gather_state(bi)
        tensors = self._tensors(bi)
        path = self._path(bi, to)
        with open(path + ".tmp", "wb") as f:
            for t in tensors:
                if t.numel():
                    f.write(_bytes_of(t))
        os.replace(path + ".tmp", path)
        for t in tensors:
            _release(t)
        self.resident_now.discard(bi)
        if new:
            _trim()  # the entries a first step (or a load) made piece by piece, freed now: back to the system

    def _gather_state(self, bi: int) -> bool:
        """Bucket `bi`'s per-element entries as views of its flats (`_page_out`); whether any
        was made anew (copied in)."""
        inner, new = self.inner, False
        if inner is None:
            return new
        b, flats = self.buckets[bi], self.flats[bi]
        for piece, (a, e, _) in zip(inner.param_groups[bi]["params"], b.pieces):
            state: dict[str, Any] = inner.state.get(piece, {})
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or value.shape != piece.shape:
                    continue  # a scalar (the step count) stays in memory
                flat = flats.get(key)
                if flat is None:
                    flat = flats[key] = _paged(b.master.numel(), value.dtype)
                part = flat[a:e]
                if value.data_ptr() != part.data_ptr() or value.untyped_storage().data_ptr() != \
                        flat.untyped_storage().data_ptr():
                    part.copy_(value.reshape(-1))
                    state[key] = part.view_as(piece)
                    new = True
        return new

    # ---- accounting -------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes of master weights, optimizer state and gradient buffers held in host memory now."""
        held = self.resident_now if self.kind == "nvme" else range(len(self.buckets))  # nvme: the pages in use
        total = sum(t.numel() * t.element_size() for bi in held for t in self._tensors(bi))
        total += sum(g.numel() * g.element_size() for g in self.host_grads if g is not None)
        total += sum(t.numel() * t.element_size() for t in self._staging + [p[1] for p in self._pending])
        if self.kind == "cpu" and self.inner is not None:
            total += sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.numel() > 1)
        total += sum(t.numel() * t.element_size() for bufs in self._saved_bufs.values() for t in bufs.values())
        return total

    def disk_bytes(self) -> int:
        if self.directory is None:
            return 0
        return sum(os.path.getsize(os.path.join(self.directory, f)) for f in os.listdir(self.directory))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous host tensor `t`, writable (for a file's readinto and write)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


# nvme's paged tensors: each over an anonymous memory map of its own, so that paging out gives its
# pages back to the system at once (madvise MADV_DONTNEED: the next touch finds zeros, and reading
# the file fills it again), whatever the allocator would do with a freed block (glibc keeps blocks
# under its moving mmap threshold in its heap, where they stay resident).
_MAPS: dict[int, mmap.mmap] = {}  # data_ptr of a paged tensor -> its map (kept alive by the tensor's base)


def _paged(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor of `numel` elements over a memory map of its own."""
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    area = mmap.mmap(-1, numel * dtype.itemsize)
    t = torch.frombuffer(area, dtype=dtype, count=numel)
    _MAPS[t.data_ptr()] = area
    weakref.finalize(t, _MAPS.pop, t.data_ptr(), None)
    return t


def _trim() -> None:
    """Return the C heap's free memory to the system (glibc's malloc_trim; elsewhere nothing): a
    first step makes the optimizer's entries piece by piece, in blocks the heap keeps once freed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _release(t: torch.Tensor) -> None:
    """Give the pages of paged tensor `t` back (its contents are in its bucket's file)."""
    area = _MAPS.get(t.data_ptr())
    if area is not None:
        area.madvise(mmap.MADV_DONTNEED)
