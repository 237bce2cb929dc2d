"""Asynchronous save: snapshot into library-owned staging buffers, then plan,
persist and publish in a background thread.

Two completions on one handle (after tensorstore's ``copy``/``commit``
futures): ``staged`` once every byte is in staging memory (the caller may then
mutate every tensor), and ``committed`` once the manifest is durable.

When ``staged`` completes (DESIGN.md section 2):

* the default mode: before ``async_save`` returns for CPU tensors; for CUDA
  tensors once the device-to-host copies on the device's side stream have
  run (a CUDA event), and the caller's current stream waits for them before
  ``async_save`` returns, so the loop's later kernels on it never race them;
* the overlap mode (``SaveOptions(overlap_staging=True)``): later, CPU and
  CUDA alike: ``async_save`` returns after the walk of the state and the
  copies run during the loop's next forward and backward. The loop calls
  :func:`wait_for_staging` (``CheckpointManager.wait_for_staging()``) before
  it next mutates the state; a version-counter and data-pointer guard fails
  the save (on every rank, nothing published) when a tensor changed before
  it was staged.

Staging runs under a host-memory budget (``SaveOptions.staging_budget_bytes``)
in slabs reused across saves (:mod:`reshard.saving.staging_pool`): a state
larger than the budget is staged in pieces, in write order, each piece
written and its slab reused while later pieces are staged
(:mod:`reshard.saving.staging_run`). CPU tensors of 1 MiB and more are copied
by ``SaveOptions.staging_threads`` copy threads while the caller's thread
walks the state.

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
from collections.abc import Mapping
from concurrent.futures import Future
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
from .save import SaveResult, Snapshot, check_step, collect, run_save
from .snapshot import _cpus  # staging copy threads by default: as the hashing threads
from .staging_budget import PeakRss, staging_budget
from .staging_run import Stager

log = logging.getLogger("reshard.saving.staging")


class SaveHandle:
    """The handle of one asynchronous save.

    Attributes:
        staged: Future, done once every byte is in library-owned buffers
            (see the module docstring for when, per mode and device).
        committed: Future of the :class:`SaveResult`, done once the manifest
            is durable (or failed).
        skipped: True when the request was skipped because ``max_pending``
            saves were in flight and ``SaveOptions.if_busy == "skip"``.
        stall_s: seconds ``async_save`` blocked the caller (staging included
            in the default mode; the walk of the state in the overlap mode).
        staging_wait_s: seconds :func:`wait_for_staging` blocked the caller
            waiting for this save's ``staged`` (the overlap mode's visible
            stall is ``stall_s + staging_wait_s``).
    """

    def __init__(self, path: str, step: int | None, *, skipped: bool = False):
        self.path, self.step, self.skipped = path, step, skipped
        self.staged: Future[None] = Future()
        self.committed: Future[SaveResult | None] = Future()
        self.stall_s = 0.0
        self.staging_wait_s = 0.0
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
    thread: threading.Thread
    started: float = field(default_factory=time.monotonic)
    #: the longest one collective of the save waits (s; None: unknown) and its ranks
    timeout_s: float | None = None
    world_size: int = 1
    #: set once ``thread`` is started (after staging, or when staging waits for it)
    running: threading.Event = field(default_factory=threading.Event)


class _Saver:
    """Per process group: the stager (its slab pool, copy threads and CUDA
    side streams), the in-flight saves, the groups used by background and
    control collectives."""

    def __init__(self, group: Any):
        self.group = group
        self.stager = Stager()
        self.pending: list[_Slot] = []
        self.error: BaseException | None = None
        self.error_handle: SaveHandle | None = None
        self.lock = threading.Lock()
        self.timed: dict[float | None, Collectives] = {}
        base = get_collectives(group)
        self.rank, self.world_size = base.rank, base.world_size
        self.single = isinstance(base, SingleProcess)
        if self.single:
            self.ctl: Collectives = base
        else:
            from ..collectives import new_checkpoint_group

            # all ranks reach here on their first async_save, in the same order
            self.ctl = TorchCollectives(new_checkpoint_group(group))

    @property
    def pool(self) -> Any:
        """The staging slab pool (:class:`~reshard.saving.staging_pool.SlabPool`)."""
        return self.stager.pool

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

    def reclaim(self) -> None:
        keep = []
        for s in self.pending:
            if s.handle.committed.done():
                s.thread.join()
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

    Default mode: returns once ``handle.staged`` is done for CPU tensors
    (CUDA tensors: once their copies are queued on the device's side stream,
    after which the caller's current stream waits for them); the caller may
    then mutate every tensor. A state larger than
    ``SaveOptions.staging_budget_bytes`` is staged in pieces written while
    later pieces are staged, so that stall then includes writing all but the
    last budget's worth. Overlap mode (``SaveOptions.overlap_staging``):
    returns once the state is walked; the loop calls
    :func:`wait_for_staging` before it next mutates the state.

    At most ``options.max_pending`` saves are in flight: a further request
    blocks until the oldest commits, or with ``if_busy="skip"`` is skipped
    with a warning (``handle.skipped``; the decision is agreed across ranks).
    Background collectives run on a separate gloo group, never the training
    group.

    Failures: a background save that fails logs one warning on the
    coordinator when it fails (step, path, cause) and sets the exception of
    ``handle.committed`` (``handle.wait()`` raises it). It never costs a later
    save: the next ``save``/``async_save`` of the group saves its own step
    and surfaces an earlier failure that nobody waited for as a
    ``RuntimeWarning`` (once).

    Raises:
        CheckpointError: staging failed on any rank, or (overlap mode) a
            tensor was changed before it was staged (reported by the
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
    if _skip_when_busy(saver, opts, step):
        h = SaveHandle(st.url(key), step, skipped=True)
        h.staged.set_result(None)
        h.committed.set_result(None)
        return h
    while len(saver.pending) >= opts.max_pending:
        saver.pending[0].handle.committed.exception()  # wait, errors surface below
        saver.reclaim()
    warn_pending_error(group, step=step)
    save = _AsyncSave(saver, st, key, step, opts)
    save.walk(state)
    save.enqueue()
    save.stage()
    save.handle.stall_s = time.perf_counter() - t0
    save.returned.set()
    return save.handle


def _skip_when_busy(saver: _Saver, opts: SaveOptions, step: int | None) -> bool:
    """Whether this request is skipped (``if_busy="skip"`` and ``max_pending``
    saves in flight on any rank: agreed by one all-reduce); warns when so."""
    if opts.if_busy != "skip":
        return False
    busy = saver.ctl.all_reduce_ints([int(len(saver.pending) >= opts.max_pending)], "max")[0] > 0
    if busy:  # stacklevel: the caller of async_save
        warnings.warn(f"async_save of step {step} skipped: {len(saver.pending)} save(s) still "
                      "in flight", RuntimeWarning, stacklevel=3)
    return busy


class _AsyncSave:
    """One admitted asynchronous save, in named steps: :meth:`walk` (the
    state into the staging run, caller's thread), :meth:`enqueue` (its
    background thread, queued behind the group's previous save),
    :meth:`stage` (the rest of the staging: the caller's thread in the
    default mode, a staging thread in the overlap mode), and :meth:`work`
    (the background thread: plan, persist, publish)."""

    def __init__(self, saver: _Saver, st: Storage, key: str, step: int | None, opts: SaveOptions):
        self.saver, self.st, self.key, self.step, self.opts = saver, st, key, step, opts
        self.handle = SaveHandle(st.url(key), step)
        self.bg = saver.bg_for(opts.timeout_s)
        self.budget = staging_budget(opts.staging_budget_bytes)
        self.rss = PeakRss().start()
        self.run = saver.stager.start(budget=self.budget, overlap=opts.overlap_staging,
                                      threads=opts.staging_threads or _cpus())
        saver.pool.on_alloc = self.rss.sample
        self.handle.staged = self.run.staged
        self.snap: Snapshot | None = None
        self.err: BaseException | None = None
        #: the caller's stall is known (set when async_save returns)
        self.returned = threading.Event()
        self.prev: _Slot | None = None
        self.slot: _Slot | None = None
        self._start_lock = threading.Lock()

    def walk(self, state: Mapping[str, Any]) -> None:
        """Describe every tensor and hand it to the staging run; a failure
        is kept for the background save, which reports it to every rank."""
        try:
            self.snap = collect(state, self.saver.rank, self.opts, stage=self.run)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the background save
            self.err, self.snap = e, None
            self.run.abandon()

    def enqueue(self) -> None:
        """The background thread (not started yet), after the group's
        previous save. Background saves of one group run one after another,
        in request order on every rank: they share the background group,
        whose collectives must not interleave between saves (concurrent ones
        mismatch across ranks)."""
        saver, bg = self.saver, self.bg
        self.prev = saver.pending[-1] if saver.pending else None
        th = threading.Thread(target=self.work, name=f"reshard-async-save-{self.step}", daemon=True)
        self.slot = _Slot(handle=self.handle, thread=th, world_size=bg.world_size,
                          timeout_s=group_timeout_s(bg.group) if isinstance(bg, TorchCollectives) else None)
        saver.pending.append(self.slot)
        self.run.on_wait = self.start_writer

    def start_writer(self) -> None:
        """Start the background save once: when staging finished, or earlier
        when staging must wait for the writer to free a slab (a state larger
        than the budget is written piece by piece while later pieces are
        staged). Started later than that, its writes would compete with the
        copies of the stall for the same cores."""
        slot = self.slot
        assert slot is not None  # enqueue() made it
        with self._start_lock:
            if not slot.running.is_set():
                slot.thread.start()
                slot.running.set()

    def stage(self) -> None:
        """Stage the rest and start the writer: before returning in the
        default mode, on a staging thread in the overlap mode."""
        if self.err is not None:
            self.start_writer()
            return
        if self.opts.overlap_staging:
            threading.Thread(target=self._stage_rest, name=f"reshard-stage-{self.step}", daemon=True).start()
        else:
            self._stage_rest()

    def _stage_rest(self) -> None:
        try:
            self.run.stage_rest()
        finally:
            self.start_writer()

    def work(self) -> None:
        """The background thread: after the previous save of the group, plan,
        persist and publish; then set ``handle.committed``."""
        _lower_priority(self.opts.background_nice)
        res: SaveResult | None = None
        failure: BaseException | None = None
        try:
            prev = self.prev
            if prev is not None:  # the previous save of the group first (its thread once started)
                prev.running.wait()
                prev.thread.join()
                self.prev = None  # the run keeps this save (its on_wait) until the next one starts
            res = run_save(self.bg, self.st, self.key, self.snap, self.err, step=self.step, options=self.opts,
                           t0=time.perf_counter(), abort=self.handle._abort)
        except BaseException as e:  # noqa: BLE001
            failure = e
        finally:
            self.run.close()  # every slab back to the pool (the staging stops if it has not ended)
        peak = self.rss.stop()
        if res is not None:
            res = self._with_staging(res, peak)
        # Drop the snapshot (the staged tensor views) here, before the outcome
        # wakes the caller: freeing a tensor releases the GIL, and a thread that
        # takes it back after interpreter finalisation began is ended by
        # pthread_exit inside libtorch's noexcept deallocator -> std::terminate
        # (SIGABRT). Once the outcome is set, this thread runs no torch code.
        self.snap = None
        self._settle(res, failure)

    def _with_staging(self, res: SaveResult, peak: int) -> SaveResult:
        """``res`` with the staging's figures, once the caller's stall is known."""
        self.returned.wait()
        h = self.handle
        # "stage": the caller's stall; hashing runs while writing ("write")
        res.timings.update(stage=h.stall_s, checksum=0.0, staging_wait=h.staging_wait_s)
        return dataclasses.replace(res, peak_rss_bytes=peak, staging_peak_bytes=self.saver.pool.peak_in_use_bytes,
                                   staging_budget_bytes=self.budget)

    def _settle(self, res: SaveResult | None, failure: BaseException | None) -> None:
        """Complete ``handle.committed`` (a failure: one warning on the coordinator)."""
        if failure is not None:
            if self.saver.rank == 0:  # reported when it happens: one line, on the coordinator
                log.warning("asynchronous save of step %s to %s failed: %s: %s", self.step, self.key,
                            type(failure).__name__, " ".join(str(failure).split())[:2000])
            self.handle.committed.set_exception(failure)
        else:
            self.handle.committed.set_result(res)


def wait_for_staging(group: Any = None, timeout: float | None = None) -> float:
    """Block until every in-flight asynchronous save of ``group`` (None:
    of every group) has staged every byte: the one call a training loop
    makes, in the overlap mode (``SaveOptions(overlap_staging=True)``),
    before it mutates the state again (before ``optimizer.step()``; a loop
    that mutates earlier, in the forward, calls it before that). Cheap when
    nothing is in flight (call it every step). Waiting counts into each
    handle's ``staging_wait_s``. In the default mode it returns at once for
    CPU tensors and waits for CUDA copies still on their side stream.

    Returns:
        The seconds it blocked.

    Raises:
        TimeoutError: a save was not staged within ``timeout`` seconds.
    """
    t0 = time.perf_counter()
    if group is None:
        savers = list(SAVERS.values())
    else:
        got = SAVERS.get(group)
        savers = [got] if got is not None else []
    for s in savers:
        for slot in list(s.pending):
            h = slot.handle
            if not h.staged.done():
                t1 = time.perf_counter()
                h.staged.exception(timeout)
                h.staging_wait_s += time.perf_counter() - t1
    return time.perf_counter() - t0


def prewarm_staging(state: Mapping[str, Any] | None = None, *, nbytes: int | None = None,
                    group: Any = None, options: SaveOptions | None = None) -> int:
    """Allocate (and fault in) the staging slabs of ``group``'s asynchronous
    saves ahead of the first save, so it pays for no page fault or pinned
    allocation (torchtitan#4188 does the same for its pinned buffers).

    Args:
        state: size the pool for this state (this rank's tensor bytes, at
            most the budget); or
        nbytes: that many bytes (at most the budget); neither: the whole
            budget.
        group: the process group the saves will use (every rank of it calls
            this: it creates the group's checkpoint groups on first use, as
            ``async_save`` does).
        options: the SaveOptions the saves will use (for the budget).

    Returns:
        The bytes the pool holds (pinned where CUDA is available).
    """
    opts = options or SaveOptions()
    budget = staging_budget(opts.staging_budget_bytes)
    saver = _saver(group)
    if nbytes is None:
        if state is None:
            nbytes = budget
        else:
            counter = _Counter()
            collect(state, saver.rank, opts, stage=counter)
            nbytes = counter.nbytes
    return saver.stager.prewarm(nbytes, budget)


class _Counter:
    """A stand-in staging run that only adds up the tensors' bytes."""

    def __init__(self) -> None:
        self.nbytes = 0

    def add(self, index: int, fqn: str, tensor: torch.Tensor, *, content: bool = False) -> None:
        self.nbytes += tensor.numel() * tensor.element_size()




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
            if slot.running.is_set():
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
