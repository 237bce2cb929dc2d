"""Asynchronous save: snapshot into library-owned staging buffers, then plan,
persist and publish in a background thread.

Two completions on one handle (after tensorstore's ``copy``/``commit``
futures): ``staged`` once every byte is in staging memory (the caller may then
mutate every tensor; for CPU tensors before ``async_save`` returns, for CUDA
tensors after a side-stream copy into pinned buffers is synchronised), and
``committed`` once the manifest is durable.

Staging buffers come from a :class:`BufferPool` reused across saves, so
resident memory stays flat over repeated saves of the same state. Buffers are
allocated and returned to the pool on the caller's thread (the background
thread only marks them done). CPU tensors of 1 MiB and more are copied into
them by ``SaveOptions.staging_threads`` copy threads, in slices, while the
caller's thread walks the state; every copy ends before ``async_save``
returns.

The background thread runs at a lower priority than the caller
(``SaveOptions.background_nice``, Linux): its hashing and writing compete
with the training step for the same cores, and the step should win.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collectives import (
    Arrival,
    Collectives,
    SingleProcess,
    TorchCollectives,
    arrive,
    checkpoint_timeout_s,
    get_collectives,
    group_timeout_s,
    is_broken,
)
from ..options import SaveOptions, hmac_key_of
from ..storage import Storage, resolve
from .pending import SAVERS, SAVERS_LOCK, warn_pending_error
from .pending import raise_pending_error as raise_pending_error  # re-exported
from .save import SaveResult, Snapshot, check_step, collect, finish_digests, run_save

log = logging.getLogger("reshard.saving.staging")


class BufferPool:
    """Reusable byte buffers (pinned host memory when CUDA is available and
    ``pin`` is set), keyed by size in bytes.

    ``take(n)`` returns a free buffer of exactly ``n`` bytes or allocates one;
    ``give_back(bufs)`` returns buffers for reuse. Both are called on the
    caller's thread.
    """

    def __init__(self, *, pin: bool = False):
        self.pin = pin and torch.cuda.is_available()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocated_bytes = 0

    def take(self, n: int) -> torch.Tensor:
        free = self._free.get(n)
        if free:
            return free.pop()
        self.allocated_bytes += n
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)

    def trim(self, keep: set[int]) -> None:
        """Free the spare buffers of sizes not in ``keep`` (no longer staged):
        a state whose tensor sizes change does not grow the pool forever."""
        for n in [n for n in self._free if n not in keep]:
            self.allocated_bytes -= n * len(self._free.pop(n))

    def give_back(self, bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            self._free[b.numel()].append(b)


class SaveHandle:
    """The handle of one asynchronous save.

    Attributes:
        staged: Future, done once every byte is in library-owned buffers.
        committed: Future of the :class:`SaveResult`, done once the manifest
            is durable (or failed).
        skipped: True when the request was skipped because ``max_pending``
            saves were in flight and ``SaveOptions.if_busy == "skip"``.
        stall_s: seconds the caller was blocked (staging included).
    """

    def __init__(self, path: str, step: int | None, *, skipped: bool = False):
        self.path, self.step, self.skipped = path, step, skipped
        self.staged: Future[None] = Future()
        self.committed: Future[SaveResult | None] = Future()
        self.stall_s = 0.0
        self._abort = threading.Event()
        self._reported = False  # the failure was raised to the caller (once is enough)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until committed; return the SaveResult (None if skipped).

        Raises:
            CheckpointError: the background save failed (on every rank); it
                is then not raised again by the next save of the group.
            TimeoutError: not committed within ``timeout`` seconds.
        """
        if self.committed.exception(timeout) is not None:
            self._reported = True
        return self.committed.result()

    def done(self) -> bool:
        return self.committed.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.committed.exception(timeout)

    def abandon(self) -> None:
        """Ask the background save not to publish (if it has not yet)."""
        self._abort.set()


@dataclass
class _Slot:
    handle: SaveHandle
    buffers: list[torch.Tensor]
    thread: threading.Thread
    started: float = field(default_factory=time.monotonic)
    #: the longest one collective of the save waits (s; None: unknown) and its ranks
    timeout_s: float | None = None
    world_size: int = 1


class _Saver:
    """Per process group: the pool, the in-flight saves, the groups used by
    background and control collectives."""

    def __init__(self, group: Any):
        self.group = group
        self.pool = BufferPool(pin=True)
        self.pending: list[_Slot] = []
        self.error: BaseException | None = None
        self.error_handle: SaveHandle | None = None
        self.lock = threading.Lock()
        self.timed: dict[float | None, Collectives] = {}
        self._copiers: ThreadPoolExecutor | None = None
        self._copiers_pid = 0
        base = get_collectives(group)
        self.rank, self.world_size = base.rank, base.world_size
        self.single = isinstance(base, SingleProcess)
        if self.single:
            self.ctl: Collectives = base
        else:
            from ..collectives import new_checkpoint_group

            # all ranks reach here on their first async_save, in the same order
            self.ctl = TorchCollectives(new_checkpoint_group(group))

    def bg_for(self, timeout_s: float | None) -> Collectives:
        """The background group of saves with ``timeout_s``
        (``SaveOptions.timeout_s``; None: the training group's timeout),
        created once by every rank on the caller's thread, and again after
        a failure made it unusable (a lost peer, a timeout)."""
        if self.single:
            return self.ctl
        timeout_s = checkpoint_timeout_s(self.group, timeout_s)
        got = self.timed.get(timeout_s)
        if got is None or is_broken(got):
            from ..collectives import new_checkpoint_group

            got = self.timed[timeout_s] = TorchCollectives(new_checkpoint_group(self.group, timeout_s))
        return got

    def copiers(self, threads: int) -> ThreadPoolExecutor:
        """The staging copy threads (made on the first save that uses them;
        resized when ``threads`` changes)."""
        ex, pid = self._copiers, os.getpid()
        if ex is None or ex._max_workers != threads or self._copiers_pid != pid:
            if ex is not None and self._copiers_pid == pid:
                ex.shutdown(wait=True)
            # (a forked child has none of its parent's threads: it makes its own)
            ex = self._copiers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reshard-stage")
            self._copiers_pid = pid
        return ex

    def reclaim(self) -> None:
        keep = []
        for s in self.pending:
            if s.handle.committed.done():
                s.thread.join()
                self.pool.give_back(s.buffers)
                exc = s.handle.committed.exception()
                if exc is not None and self.error is None and not s.handle._reported:
                    self.error, self.error_handle = exc, s.handle
            else:
                keep.append(s)
        self.pending = keep


def _saver(group: Any) -> _Saver:
    key = group if group is not None else "default"
    with SAVERS_LOCK:
        s = SAVERS.get(key)
        if s is None:
            s = SAVERS[key] = _Saver(group)
        return s


def async_save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    group: Any = None,
    options: SaveOptions | None = None,
    storage: Storage | None = None,
) -> SaveHandle:
    """Snapshot ``state`` into staging buffers and save it in the background.

    Returns once ``handle.staged`` is done (for CPU tensors); the caller may
    then mutate every tensor. At most ``options.max_pending`` saves are in
    flight: a further request blocks until the oldest commits, or with
    ``if_busy="skip"`` is skipped with a warning (``handle.skipped``; the
    decision is agreed across ranks). Background collectives run on a
    separate gloo group, never the training group.

    Failures: a background save that fails logs one warning on the
    coordinator when it fails (step, path, cause) and sets the exception of
    ``handle.committed`` (``handle.wait()`` raises it). It never costs a later
    save: the next ``save``/``async_save`` of the group saves its own step
    and surfaces an earlier failure that nobody waited for as a
    ``RuntimeWarning`` (once).

    Raises:
        CheckpointError: staging failed on any rank (then reported by the
            handle: the background save fails on every rank).
    """
    t0 = time.perf_counter()
    step = check_step(step)
    opts = options or SaveOptions()
    if opts.hmac_key is None or not opts.hmac_key:  # the environment's key (NO_HMAC_KEY: none)
        opts = dataclasses.replace(opts, hmac_key=hmac_key_of(opts.hmac_key))
    # every rank checks in before its first async_save makes the background groups
    arrive(group, Arrival(kind="async_save", what=f"async_save of step {step} at {os.fspath(path)}",
                          timeout_s=opts.arrival_timeout_s), checkpoint_timeout_s(group, opts.timeout_s))
    saver = _saver(group)
    saver.reclaim()
    st, key = resolve(path, storage)
    busy = len(saver.pending) >= opts.max_pending
    if opts.if_busy == "skip":
        busy = saver.ctl.all_reduce_ints([int(busy)], "max")[0] > 0
        if busy:
            warnings.warn(f"async_save of step {step} skipped: {len(saver.pending)} save(s) still "
                          "in flight", RuntimeWarning, stacklevel=2)
            h = SaveHandle(st.url(key), step, skipped=True)
            h.staged.set_result(None)
            h.committed.set_result(None)
            return h
    while len(saver.pending) >= opts.max_pending:
        saver.pending[0].handle.committed.exception()  # wait, errors surface below
        saver.reclaim()
    warn_pending_error(group, step=step)
    handle = SaveHandle(st.url(key), step)
    bg = saver.bg_for(opts.timeout_s)
    buffers: list[torch.Tensor] = []
    cuda_stream = None
    threads = opts.staging_threads or _cpus()
    copies: list[Future[Any]] = []

    def stage(t: torch.Tensor) -> torch.Tensor:
        nonlocal cuda_stream
        n = t.numel() * t.element_size()
        buf = saver.pool.take(n)
        buffers.append(buf)
        dst = buf.view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
        if t.is_cuda:
            if cuda_stream is None:
                cuda_stream = torch.cuda.Stream(device=t.device)
                cuda_stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(cuda_stream):
                dst.copy_(t, non_blocking=True)
        elif threads > 1 and n >= _THREADED_COPY_MIN:
            copies.extend(_copy_on(saver.copiers(threads), dst, t))
        else:
            dst.copy_(t)
        return dst

    snap: Snapshot | None = None
    err: BaseException | None = None
    try:
        try:
            snap = collect(state, saver.rank, opts, copy=stage)
        finally:  # every copy ends before the caller may touch its tensors again
            for f in copies:
                f.exception()
        for f in copies:
            f.result()
        saver.pool.trim({b.numel() for b in buffers})
        if cuda_stream is not None:
            cuda_stream.synchronize()
    except Exception as e:  # noqa: BLE001 - reported to every rank by the background save
        err = e
    handle.staged.set_result(None)
    handle.stall_s = time.perf_counter() - t0

    def work() -> None:
        nonlocal snap
        _lower_priority(opts.background_nice)
        res: SaveResult | None = None
        failure: BaseException | None = None
        try:
            t_sum = time.perf_counter()
            if snap is not None:
                finish_digests(snap, opts)
            t_sum = time.perf_counter() - t_sum
            if prev is not None:
                prev.join()
            res = run_save(bg, st, key, snap, err, step=step, options=opts, t0=time.perf_counter(),
                           abort=handle._abort)
            # "stage": the caller's stall (copies into staging buffers); "checksum": background
            res.timings.update(stage=handle.stall_s, checksum=t_sum)
        except BaseException as e:  # noqa: BLE001
            failure = e
        # Drop the snapshot (the staged tensor views) here, before the outcome
        # wakes the caller: freeing a tensor releases the GIL, and a thread that
        # takes it back after interpreter finalisation began is ended by
        # pthread_exit inside libtorch's noexcept deallocator -> std::terminate
        # (SIGABRT). Once the outcome is set, this thread runs no torch code.
        snap = None
        if failure is not None:
            if saver.rank == 0:  # reported when it happens: one line, on the coordinator
                log.warning("asynchronous save of step %s to %s failed: %s: %s", step, key,
                            type(failure).__name__, " ".join(str(failure).split())[:2000])
            handle.committed.set_exception(failure)
        else:
            handle.committed.set_result(res)

    # background saves of one group run one after another, in request order on
    # every rank: they share the background group, whose collectives must not
    # interleave between saves (concurrent ones mismatch across ranks)
    prev = saver.pending[-1].thread if saver.pending else None
    th = threading.Thread(target=work, name=f"reshard-async-save-{step}", daemon=True)
    saver.pending.append(_Slot(handle=handle, buffers=buffers, thread=th, world_size=bg.world_size,
                               timeout_s=group_timeout_s(bg.group) if isinstance(bg, TorchCollectives)
                               else None))
    th.start()
    return handle


#: CPU tensors of at least this many bytes are copied by the staging threads,
#: in slices of _COPY_SLICE_BYTES (smaller ones on the caller's thread)
_THREADED_COPY_MIN = 1 << 20
_COPY_SLICE_BYTES = 16 << 20


def _cpus() -> int:
    """Staging copy threads by default: the CPUs this process may run on, at most 4."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def _copy_on(ex: ThreadPoolExecutor, dst: torch.Tensor, src: torch.Tensor) -> list[Future[Any]]:
    """Copy ``src`` into ``dst`` (same shape, contiguous) on the executor,
    in slices of about ``_COPY_SLICE_BYTES`` when ``src`` is contiguous
    (``copy_`` releases the GIL: the slices run in parallel, beside the
    caller's state walk)."""
    if not src.is_contiguous() or src.dim() == 0:
        return [ex.submit(dst.copy_, src)]
    s, d = src.view(-1), dst.view(-1)
    step = max(1, _COPY_SLICE_BYTES // max(1, src.element_size()))
    return [ex.submit(d[a:a + step].copy_, s[a:a + step]) for a in range(0, s.numel(), step)]


def _lower_priority(nice: int | None) -> None:
    """Raise the calling thread's nice value by ``nice``. Linux only: there
    the nice value is per thread (``PRIO_PROCESS`` with a thread id) and the
    threads it starts inherit it; elsewhere a thread id is no process id, and
    the priority is left as it is. Best effort (an error keeps the default)."""
    if not nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def wait_all(group: Any = None, timeout: float | None = None) -> None:
    """Wait for every in-flight save of ``group`` (or of all groups)."""
    savers = list(SAVERS.values()) if group is None else [_saver(group)]
    for s in savers:
        for slot in list(s.pending):
            slot.handle.committed.exception(timeout)
        s.reclaim()


_AT_EXIT_SEEN: set[int] = set()
_EXITING = threading.Event()


def exiting() -> bool:
    """Whether the process's exit has begun (the exit wait for pending saves runs)."""
    return _EXITING.is_set()


def _at_exit() -> None:
    """Process exit waits for pending commits (an ``async_save`` the program
    never waited for is committed complete before the process ends) and joins
    every background save thread, committed ones included, so none is alive
    (running torch code) once interpreter finalisation begins. A Ctrl-C
    during that wait abandons the pending saves without publishing (the
    commit protocol leaves nothing half-way: no manifest, no older checkpoint
    deleted) and waits up to 30 s per save for its thread to stop. A save
    that failed (or was abandoned) and whose failure no ``wait()`` or later
    save raised is named in one line on stderr: the exit itself cannot
    raise it."""
    # it runs twice (the interpreter's thread shutdown, then atexit): the second
    # time only for saves started since (a save abandoned the first time, whose
    # thread outlived its 30 s join, is not waited for again without a limit)
    _EXITING.set()
    slots = [slot for s in SAVERS.values() for slot in s.pending if id(slot) not in _AT_EXIT_SEEN]
    _AT_EXIT_SEEN.update(id(slot) for slot in slots)
    try:
        for slot in slots:
            if not slot.handle.committed.done():
                h = slot.handle
                bound = ("" if slot.world_size == 1 else
                         f"; each of its collectives waits at most {slot.timeout_s:.0f} s for the "
                         f"other ranks (ranks 0-{slot.world_size - 1}), a lost rank ends it within "
                         "seconds" if slot.timeout_s is not None else
                         f"; its collectives wait for ranks 0-{slot.world_size - 1} as long as "
                         "their group's timeout")
                _exit_line(f"reshard: exit waits for the asynchronous save of step {h.step} to "
                           f"{h.path} to commit (in flight for {time.monotonic() - slot.started:.0f}"
                           f" s{bound}); Ctrl-C abandons it")
            slot.handle.committed.exception()
            slot.thread.join()
    except KeyboardInterrupt:
        for slot in slots:
            slot.handle.abandon()
        for slot in slots:
            slot.thread.join(timeout=30)
        for slot in slots:
            if not slot.handle.committed.done() or slot.handle.committed.exception() is not None:
                _exit_note(slot.handle, "was abandoned at exit (interrupted; nothing published)")
        return
    # a failure nobody will see otherwise: the program ended without waiting
    # for the save, and no later save warned of it (warn_pending_error)
    for s in SAVERS.values():
        failed = [slot.handle for slot in s.pending if slot.handle.committed.exception() is not None]
        if s.error_handle is not None and s.error_handle not in failed:
            failed.append(s.error_handle)
        for h in failed:
            if not h._reported:
                h._reported = True
                _exit_note(h, f"failed and was never waited for (nothing published): {h.committed.exception()}")


def _exit_note(h: SaveHandle, what: str) -> None:
    """One line on stderr at exit about an asynchronous save."""
    _exit_line(f"reshard: the asynchronous save of step {h.step} to {h.path} {' '.join(what.split())}")


def _exit_line(line: str) -> None:
    """One line on stderr at exit (best effort: stderr may already be closed)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# Run before concurrent.futures' own exit hook: the interpreter's thread
# shutdown (threading._shutdown) calls the hooks registered with
# threading._register_atexit, last registered first, before the atexit
# module's. concurrent.futures.thread registers one that stops every pool's
# workers and refuses new work ("cannot schedule new futures after interpreter
# shutdown"); a background save still writing or committing then would hang on
# a work item no worker runs, or fail its commit. Importing the module first
# makes this hook the later one, so pending saves finish (or are abandoned on
# a second Ctrl-C) while the pools still work. atexit stays as the fallback.
import concurrent.futures.thread  # noqa: E402,F401  (registers its hook now)

_register_thread_atexit = getattr(threading, "_register_atexit", None)
if _register_thread_atexit is not None:
    _register_thread_atexit(_at_exit)
atexit.register(_at_exit)
