"""Staging under a host-memory budget: the :class:`Stager` of a process
group (its slab pool, copy threads and CUDA side streams) and the
:class:`StagingRun` of one asynchronous save.

How one save stages (DESIGN.md section 2, "SaveHandle.staged"):

1. **The walk** (caller's thread): :func:`reshard.saving.save.collect` describes
   every tensor and hands it to :meth:`StagingRun.add`, which (in the default
   mode) copies it at once into slabs while the run holds at most half of
   the budget (the "eager" half: the copies overlap the rest of the walk);
   the overlap mode copies nothing on the caller's thread.
2. **The rest** (:meth:`StagingRun.stage_rest`; the caller's thread in the
   default mode, a staging thread in the overlap mode) copies every other
   tensor in **write order**: by descending item size, then by position in
   the state, the order in which the shard-file writer asks for them (a shard
   file holds its tensors by descending item size). When the budget is full
   it waits for the writer to write a piece and give its slab back. A tensor
   larger than a slab is copied in pieces (slices of its row-major bytes), so
   nothing ever needs more than one slab at a time.
3. **The writer** (the background save's persist step,
   :func:`reshard.saving.save.persist`) asks for each chunk's bytes with
   :meth:`StagingRun.chunk`: a generator of the chunk's staged pieces in
   order, each waited for (its copy, or its CUDA event) and given back to
   the pool once the writer asks for the next. That generator is the one
   point where a staged chunk's bytes are in host memory just before they
   are written (an incremental checkpoint's digest is computed there).

Why this never deadlocks: the writer asks for chunks in write order and the
producer stages them in the same order; the eager half never holds more than
half the slabs, so the producer always has slabs once the writer has written
what precedes the chunk it waits for.

Memory: at most the budget in slabs (pinned included), plus, per run, one
scratch-free copy per piece (no temporary of a tensor's size: a
non-contiguous tensor is copied slice by slice straight into its slab).

CUDA: every device has one side stream, made once (:meth:`Stager.stream`);
a save's copies on it first wait for the caller's current stream; each piece
is a non-blocking device-to-host copy into a pinned slab followed by a CUDA
event, and the source's memory is marked in use by the side stream
(``record_stream``) so the caching allocator does not hand it out while the
copy runs. ``staged`` completes once those events have (a host wait on the
events; never a device-wide synchronize). In the default mode the caller's
current stream waits for the side stream before ``async_save`` returns, so
kernels the loop launches afterwards on that stream run after the copies.

The mutation guard (overlap mode): every source's version counter
(``tensor._version``) and data pointer are taken when the walk meets it and
compared when each of its pieces is copied and once more when the whole
state is staged; a difference fails the save (:class:`CheckpointError`
naming the tensor). It sees in-place operations that go through PyTorch's
dispatcher (``add_``, ``copy_``, ``optimizer.step()`` with ``foreach`` or the
for-loop kernels) and a tensor whose storage was replaced; it cannot see
writes through ``.data`` (a tensor with its own version counter), fused
optimizer kernels that do not bump the counter (``torch.optim.AdamW(fused=True)``
on torch 2.13), kernels that write through a raw pointer (custom CUDA or
Triton kernels, NCCL into a buffer), or a write still running when the last
check is made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..errors import CheckpointError
from .staging_pool import Slab, SlabPool

#: pieces are at most this many bytes (a copy thread's unit of work)
MAX_PIECE_BYTES = 16 << 20
#: a piece is never cut smaller than this when a fresh slab could hold more
MIN_PIECE_BYTES = 4 << 10
#: CPU pieces of at least this many bytes go to the copy threads
THREADED_COPY_MIN = 1 << 20
_ALIGN = 64


class _Piece:
    """Bytes [start, start + nbytes) of one source, staged in ``view`` (a
    uint8 region of ``slab``); ready once ``futs`` (CPU copies on the copy
    threads) are done or ``event`` (CUDA) has completed."""

    __slots__ = ("slab", "view", "start", "nbytes", "fut", "event", "released")

    def __init__(self, slab: Slab, view: torch.Tensor, start: int, nbytes: int):
        self.slab, self.view, self.start, self.nbytes = slab, view, start, nbytes
        self.fut: Future[None] | None = None
        self.event: Any = None
        self.released = False

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()  # a host wait on this event only
        if self.fut is not None:
            self.fut.result()


class _Source:
    """One tensor of the state to stage (snapshot tensor ``index``)."""

    __slots__ = ("index", "fqn", "tensor", "nbytes", "itemsize", "version", "ptr", "pieces",
                 "issued", "needed", "error", "cuda", "want_content", "content", "hashed")

    def __init__(self, index: int, fqn: str, tensor: torch.Tensor):
        self.index, self.fqn = index, fqn
        self.tensor: torch.Tensor | None = tensor
        self.itemsize = tensor.element_size()
        self.nbytes = tensor.numel() * self.itemsize
        self.version = tensor._version
        self.ptr = tensor.data_ptr()
        self.pieces: list[_Piece] = []
        self.issued = 0  # bytes whose copy has been issued
        self.needed: bool | None = None  # None: not known yet (before the save's plan)
        self.error: str | None = None
        self.cuda = tensor.is_cuda
        #: an incremental save's chunk with a file of its own: its xxh3_128
        #: (``content``) is computed from the caller's tensor before its first
        #: byte is staged (CPU, contiguous tensors; else None: written in full)
        self.want_content = False
        self.content: str | None = None
        self.hashed = False


def flat_parts(t: torch.Tensor, a: int, b: int) -> list[torch.Tensor]:
    """Views of ``t`` whose elements, each flattened row-major and
    concatenated, are elements [a, b) of ``t``'s row-major flattening: at
    most ``2 * ndim - 1`` of them, none a copy (so a slice of a
    non-contiguous tensor is copied straight into its staging slab)."""
    if a >= b:
        return []
    if t.is_contiguous() or t.dim() <= 1:
        return [t.reshape(-1)[a:b]] if t.is_contiguous() else [t[a:b]]
    inner = t[0].numel()
    r0, r1 = a // inner, (b - 1) // inner
    if r0 == r1:
        return flat_parts(t[r0], a - r0 * inner, b - r0 * inner)
    out: list[torch.Tensor] = []
    if a % inner:
        out += flat_parts(t[r0], a % inner, inner)
        r0 += 1
    full = b // inner
    if full > r0:
        out.append(t[r0:full])
    if b % inner:
        out += flat_parts(t[full], 0, b % inner)
    return out


def _copy_parts(dst: torch.Tensor, parts: list[torch.Tensor], non_blocking: bool = False) -> None:
    k = 0
    for p in parts:
        m = p.numel()
        dst[k:k + m].view(p.shape).copy_(p, non_blocking=non_blocking)
        k += m


class Stager:
    """The staging of one process group's asynchronous saves on this rank:
    the slab pool (:class:`~reshard.saving.staging_pool.SlabPool`, reused
    across saves), the copy threads and one CUDA side stream per device
    (made once). One :class:`StagingRun` per save; runs stage one after
    another (a run starts once the previous one is staged)."""

    def __init__(self) -> None:
        self.pool = SlabPool(pin=True)
        self._copiers: ThreadPoolExecutor | None = None
        self._copiers_pid = 0
        self._streams: dict[int, Any] = {}
        self.last: StagingRun | None = None

    def copiers(self, threads: int) -> ThreadPoolExecutor:
        """The staging copy threads (made on the first save that uses them;
        resized when ``threads`` changes; a forked child makes its own)."""
        ex, pid = self._copiers, os.getpid()
        if ex is None or ex._max_workers != threads or self._copiers_pid != pid:
            if ex is not None and self._copiers_pid == pid:
                ex.shutdown(wait=True)
            ex = self._copiers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reshard-stage")
            self._copiers_pid = pid
        return ex

    def stream(self, device: torch.device) -> Any:
        """The side stream of CUDA ``device``: made on first use, then reused
        by every save."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
        return s

    def start(self, *, budget: int, overlap: bool, threads: int) -> StagingRun:
        """A new run with ``budget`` bytes, once the previous run is staged."""
        prev = self.last
        if prev is not None and not prev.staged.done():
            prev.staged.exception()
        self.pool.configure(budget)
        self.pool.reset_peak()
        run = self.last = StagingRun(self, overlap=overlap, threads=threads)
        return run

    def prewarm(self, nbytes: int, budget: int) -> int:
        """Allocate slabs for ``nbytes`` (at most ``budget``) now; the pool's bytes."""
        self.pool.configure(budget)
        return self.pool.prewarm(nbytes)


class StagingRun:
    """The staging of one asynchronous save (see the module docstring).

    Attributes:
        staged: Future, done once every needed byte is in the pool's slabs
            (or the run was closed).
        overlap: the overlap mode (a staging thread stages the rest; the
            mutation guard is on).
        staged_bytes: bytes copied so far.
    """

    def __init__(self, stager: Stager, *, overlap: bool, threads: int):
        self.stager, self.overlap, self.threads = stager, overlap, threads
        self.pool = stager.pool
        self.cond = self.pool.cond
        self.sources: list[_Source] = []
        self._by_index: dict[int, _Source] = {}
        self.staged: Future[None] = Future()
        self.staged_bytes = 0
        self._cur: dict[bool, tuple[Slab, int] | None] = {True: None, False: None}
        self._eager_slabs = 0
        self._eager_open = True
        self._closing = False
        self._error: BaseException | None = None
        #: called (once or more) when staging must wait for the writer to free a
        #: slab: the save starts its writer then (it starts it anyway once staged)
        self.on_wait: Callable[[], None] | None = None
        #: CUDA devices whose side stream waited for the caller's current stream
        #: (in add(), on the caller's thread: a staging thread's current stream is another)
        self._waited: set[int | None] = set()
        self._cuda_used: set[int] = set()

    # -- the walk (caller's thread)
    def add(self, index: int, fqn: str, tensor: torch.Tensor, *, content: bool = False) -> None:
        """Take the source of snapshot tensor ``index``; copy it now while
        the eager half of the budget has room. ``content``: compute the
        xxh3_128 of its bytes (:meth:`content`) before staging it."""
        src = _Source(index, fqn, tensor.detach() if tensor.requires_grad else tensor)
        src.want_content = content and not src.cuda and src.tensor is not None \
            and src.tensor.is_contiguous()
        if src.cuda and src.nbytes:
            dev = tensor.device
            if dev.index not in self._waited:  # the copies see every kernel the caller queued
                self.stager.stream(dev).wait_stream(torch.cuda.current_stream(dev))
                self._waited.add(dev.index)
        self.sources.append(src)
        self._by_index[index] = src
        # the overlap mode copies nothing on the caller's thread: it returns after the walk
        if self._eager_open and src.nbytes and not self.overlap:
            try:
                self._stage(src, eager=True)
            except Exception as e:  # noqa: BLE001 - the save fails with it, on every rank
                self._fail(e)

    def nbytes(self) -> int:
        """The bytes of every source."""
        return sum(s.nbytes for s in self.sources)

    # -- the rest (caller's thread or the staging thread)
    def stage_rest(self) -> None:
        """Stage every source not yet staged, in write order, waiting for
        slabs as the writer frees them; then complete ``staged``."""
        try:
            for src in sorted(self.sources, key=lambda s: (-s.itemsize, s.index)):
                if self._closing or self._error is not None:
                    break
                if src.needed is False or src.issued >= src.nbytes:
                    continue
                self._stage(src, eager=False)
        except Exception as e:  # noqa: BLE001 - the save fails with it
            self._fail(e)
        except BaseException as e:  # Ctrl-C in the stall: the save fails, the interrupt goes on
            self._fail(e)
            self._complete()
            raise
        self._complete()

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            if self._error is None:
                self._error = e
            self._eager_open = False
            self.cond.notify_all()

    def _alloc(self, eager: bool, remaining: int, isz: int) -> tuple[Slab, int, int] | None:
        """Room for up to ``remaining`` bytes (a multiple of ``isz``) in the
        current slab of the region, or a new slab. Eager: None when the eager
        half is used up or no slab is free right now (never waits). Call
        with ``cond`` held."""
        want = min(remaining, MAX_PIECE_BYTES)
        cur = self._cur[eager]
        if cur is not None:
            slab, off = cur
            at = -(-off // _ALIGN) * _ALIGN
            room = (slab.nbytes - at) // isz * isz
            if room >= min(want, MIN_PIECE_BYTES) and room > 0:
                take = min(want, room)
                self._cur[eager] = (slab, at + take)
                return slab, at, take
            self._close_slab(slab)
            self._cur[eager] = None
        got: Slab | None
        if eager:
            if self._eager_slabs >= self.pool.max_slabs // 2:
                self._eager_open = False
                return None
            got = self.pool.try_acquire()
            if got is None:
                self._eager_open = False
                return None
            self._eager_slabs += 1
        else:
            got = self.pool.try_acquire()
            if got is None:  # the budget is full: the writer must run to free a slab
                if self.on_wait is not None:
                    self.on_wait()
                got = self.pool.acquire(lambda: self._closing)
            if got is None:
                return None
        slab = got
        take = min(want, slab.nbytes // isz * isz)
        self._cur[eager] = (slab, take)
        return slab, 0, take

    def _close_slab(self, slab: Slab) -> None:
        slab.open = False
        if slab.refs == 0:
            self.pool.release(slab)

    def _stage(self, src: _Source, *, eager: bool) -> None:
        if src.want_content and not src.hashed:
            self._hash(src)
        while src.issued < src.nbytes:
            with self.cond:
                if self._closing or self._error is not None or src.needed is False:
                    return
                got = self._alloc(eager, src.nbytes - src.issued, src.itemsize)
                if got is None:
                    return
                slab, at, take = got
                slab.refs += 1
            piece = _Piece(slab, slab.buf[at:at + take], src.issued, take)
            try:
                self._copy(src, piece)
            except BaseException:
                with self.cond:
                    self._drop(piece)
                raise
            with self.cond:
                src.issued += take
                self.staged_bytes += take
                if self._closing or src.needed is False:
                    drop = True
                else:
                    src.pieces.append(piece)
                    drop = False
                self.cond.notify_all()
            if drop:
                piece.wait()
                with self.cond:
                    self._drop(piece)

    def _hash(self, src: _Source) -> None:
        """The xxh3_128 of ``src``'s bytes, from the caller's tensor, before
        any of it is staged: the mutation guard (overlap mode) and the
        default mode's stall cover it as they cover the copies."""
        from ..ondisk.shardfile import content_digest, tensor_bytes

        try:
            t = src.tensor
            if t is not None and src.needed is not False:
                src.content = content_digest(tensor_bytes(t))
        finally:
            with self.cond:
                src.hashed = True
                self.cond.notify_all()

    def content(self, index: int) -> str | None:
        """The xxh3_128 (hex) of snapshot tensor ``index``'s bytes when it
        was added with ``content=True`` and could be hashed (a CPU,
        contiguous tensor); else None. Waits until it is computed."""
        src = self._by_index[index]
        if not src.want_content:
            return None
        with self.cond:
            while (not src.hashed and not self._closing and self._error is None
                   and not self.staged.done()):
                self.cond.wait(1.0)
        return src.content if src.hashed else None

    def _copy(self, src: _Source, piece: _Piece) -> None:
        t, isz = src.tensor, src.itemsize
        assert t is not None  # dropped only once the run is staged
        parts = flat_parts(t, piece.start // isz, (piece.start + piece.nbytes) // isz)
        dst = piece.view.view(t.dtype)
        if src.cuda:
            dev = t.device
            stream = self.stager.stream(dev)  # it waited for the caller's stream in add()
            with torch.cuda.stream(stream):
                _copy_parts(dst, parts, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy ran
            piece.event = ev
            self._cuda_used.add(dev.index)
            return

        def run() -> None:
            _copy_parts(dst, parts)
            if self.overlap:
                self._check(src)

        if self.threads > 1 and piece.nbytes >= THREADED_COPY_MIN:
            piece.fut = self.stager.copiers(self.threads).submit(run)
        else:
            run()

    def _check(self, src: _Source) -> None:
        """The mutation guard for ``src`` (after a copy of it completed)."""
        t = src.tensor
        if t is None or src.error is not None:
            return
        v, p = t._version, t.data_ptr()
        if v != src.version or p != src.ptr:
            why = (f"its version counter went from {src.version} to {v}" if v != src.version
                   else "its data pointer moved (its storage was replaced)")
            src.error = (f"tensor {src.fqn!r} was modified before it was staged ({why}): with "
                         "SaveOptions(overlap_staging=True) the loop must call "
                         "reshard.wait_for_staging() (CheckpointManager.wait_for_staging()) "
                         "before it mutates the state; this save is abandoned, nothing is published")

    def _complete(self) -> None:
        """Every copy issued: close the current slabs; wait for the CPU copies
        (and, in the overlap mode, the CUDA events), check the guard, set
        ``staged``. Default mode with CUDA copies: the caller's streams wait
        for the side streams, and a waiter thread completes ``staged``."""
        with self.cond:
            for eager in (True, False):
                cur = self._cur[eager]
                if cur is not None:
                    self._close_slab(cur[0])
                    self._cur[eager] = None
            pieces = [p for s in self.sources for p in s.pieces]
        for p in pieces:
            if p.fut is not None:
                try:
                    p.fut.result()
                except BaseException as e:  # noqa: BLE001
                    self._fail(e)
        if self._cuda_used and not self.overlap:
            for idx in self._cuda_used:
                dev = torch.device("cuda", idx)
                torch.cuda.current_stream(dev).wait_stream(self.stager.stream(dev))
            threading.Thread(target=self._finish, args=(pieces,), name="reshard-staged",
                             daemon=True).start()
            return
        self._finish(pieces)

    def _finish(self, pieces: list[_Piece]) -> None:
        try:
            for p in pieces:
                if p.event is not None:
                    p.event.synchronize()
            if self.overlap:
                for s in self.sources:
                    if s.needed is not False and (s.issued or not s.nbytes):
                        self._check(s)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        for s in self.sources:
            s.tensor = None  # the caller's memory is no longer referenced
        if not self.staged.done():
            self.staged.set_result(None)
        with self.cond:
            self.cond.notify_all()

    # -- the writer (the background save's persist step)
    def need(self, needed: set[int]) -> None:
        """The snapshot tensors this rank writes or hashes (known once the
        save's plan is): the others are no longer staged, and what was
        staged of them is given back."""
        with self.cond:
            drop: list[_Piece] = []
            for s in self.sources:
                s.needed = s.index in needed
                if not s.needed:
                    drop.extend(s.pieces)
                    s.pieces = []
            self.cond.notify_all()
        for p in drop:
            try:
                p.wait()
            finally:
                with self.cond:
                    self._drop(p)

    def chunk(self, index: int) -> Iterator[memoryview]:
        """The staged bytes of snapshot tensor ``index``, piece by piece, in
        order: each piece waited for (its copy or CUDA event) and given back
        to the pool when the next is asked for (or the generator is closed).

        Raises:
            CheckpointError: the mutation guard found the tensor changed
                before it was staged, or staging failed.
        """
        src = self._by_index[index]
        k = 0
        while True:
            with self.cond:
                while (k >= len(src.pieces) and src.issued < src.nbytes and not self._closing
                       and self._error is None and not self.staged.done()):
                    self.cond.wait(1.0)
                if self._error is not None:
                    raise CheckpointError(f"staging {src.fqn!r} failed: {type(self._error).__name__}: "
                                          f"{self._error}") from self._error
                if k >= len(src.pieces):
                    if src.issued < src.nbytes:
                        raise CheckpointError(f"staging {src.fqn!r} stopped before every byte was staged")
                    return
                p = src.pieces[k]
            try:
                p.wait()
                if self.overlap and p.event is not None:
                    self._check(src)
                if src.error is not None:
                    raise CheckpointError(src.error)
                yield memoryview(p.view.numpy().data).cast("B")
            finally:
                with self.cond:
                    self._drop(p)
            k += 1

    def _drop(self, p: _Piece) -> None:
        """Give piece ``p``'s room back (its slab returns to the pool when it
        holds no other unwritten piece). Call with ``cond`` held."""
        if p.released:
            return
        p.released = True
        s = p.slab
        s.refs -= 1
        if s.refs == 0 and not s.open:
            self.pool.release(s)

    def finish(self) -> None:
        """After the writer: raise the first guard failure or staging error.

        Raises:
            CheckpointError: naming the tensor changed before it was staged.
        """
        if not self.staged.done():
            self.staged.exception()
        if self._error is not None:
            raise CheckpointError(f"staging failed: {type(self._error).__name__}: {self._error}") \
                from self._error
        for s in self.sources:
            if s.error is not None and s.needed is not False:
                raise CheckpointError(s.error)

    def abandon(self) -> None:
        """The walk failed: stop, give every slab back and complete ``staged``."""
        self.close()
        self._complete()

    def close(self) -> None:
        """The save is over (committed or failed): stop staging and give every
        slab back. Waits for copies in flight."""
        with self.cond:
            self._closing = True
            pieces = [p for s in self.sources for p in s.pieces if not p.released]
            for s in self.sources:
                s.pieces = []
            self.cond.notify_all()
        for p in pieces:
            try:
                p.wait()
            except BaseException:  # noqa: BLE001, S110 - the failure is the save's, reported already
                pass
            with self.cond:
                self._drop(p)
