"""CheckpointManager: cadence, retention with verify-before-delete, leases,
garbage collection of abandoned attempts, preemption and resume.

Layout under ``root``: committed checkpoints ``step-%08d/`` (``step-%08d.1/``,
``.2``, ... when the name is taken: another lineage's or a quarantined
checkpoint's); attempts ``step-%08d.incomplete-<id>/``; quarantined
checkpoints ``<name>.quarantined-<id>/`` (or a ``<name>.quarantined.json``
marker on stores without rename); the ``HEAD`` record (the checkpoint the
current lineage resumed from, :mod:`reshard.commit.lineage`); sidecars written by the
manager beside the checkpoints (never inside one, which is never modified):
``<name>.verified.json`` (verification record bound to the manifest digest and
file sizes, :mod:`reshard.catalog.records`) and ``<name>.lease-<id>.json`` (a reader
holds the checkpoint until ``expires``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgspec

from ..catalog.records import VERIFIED, check_and_record, record_holds
from ..catalog.verify import latest_entry, resumable
from ..collectives import Arrival, arrive, checkpoint_timeout_s
from ..collectives_deferred import Deferred
from ..commit import ownership
from ..commit.lineage import Head, lineage_of, resume_order
from ..commit.ownership import OwnerLease, job_identity, read_owner
from ..commit.protocol import (
    QUARANTINED,
    Entry,
    committed,
    read_head,
    scan,
)
from ..commit.retention import Policy
from ..commit.strategy import strategy_for
from ..errors import CheckpointError, IntegrityError, RootOwnedError, StorageError
from ..loading.load import LoadResult
from ..ondisk.committed import OWNER_NAME
from ..options import SaveOptions, check_timeout, hmac_key_of
from ..saving.save import SaveResult, save
from ..saving.staging import SaveHandle, async_save, exiting, prewarm_staging, wait_for_staging
from ..storage import Storage, resolve
from .resume import restore_collective, start_lineage
from .retention import LEASE, RetentionMixin, RetentionPlan

log = logging.getLogger("reshard.manager.manager")

__all__ = ["LEASE", "CheckpointManager", "RetentionPlan", "young_daly_interval"]


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Optimal checkpoint interval in seconds, ``sqrt(2 * C * MTBF)``.

    C is the non-hidden (foreground) cost of one checkpoint and MTBF the mean
    time between failures, both in seconds. Young, "A first order
    approximation to the optimum checkpoint interval", CACM 17(9), 1974;
    Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", FGCS 22(3), 2006 (first-order term).
    """
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("cost_s must be >= 0 and mtbf_s > 0")
    return math.sqrt(2.0 * cost_s * mtbf_s)


class CheckpointManager(RetentionMixin):
    """Periodic checkpoints under ``root`` with safe retention and resume.

    Args:
        root: directory (or URL prefix) holding the checkpoints.
        every_steps: save when ``step % every_steps == 0``.
        every_seconds: save when this many seconds passed since the last save.
        interval: "auto": Young/Daly interval from the measured foreground
            cost of recent saves and ``mtbf_s`` (logged when it changes).
        mtbf_s: mean time between failures, seconds (for ``interval="auto"``).
        keep_last, keep_every, keep_best, metric_mode: retention policy (see
            :mod:`reshard.commit.retention`); the newest verified checkpoint of the
            current lineage, the lineage's newest and the resume source are
            always kept, and nothing is deleted before a newer one passed the
            smoke test.
        checksum_before_delete: before retention deletes the last older
            verified checkpoint, the one kept in its place is verified again
            with every checksum (True, the default), or by structure and
            sizes only (False).
        use_async: save with :func:`reshard.async_save`.
        smoke_tensors: tensors trial-loaded (checksums verified) by the smoke test.
        gc_grace_s: abandoned attempts older than this are deleted.
        preempt_signals: signals that request a save at the next step
            boundary followed by a clean stop (``should_stop``).
        options: SaveOptions for every save.
        group: process group.
        writer: this manager saves into ``root`` (default): its coordinator
            takes ownership of the root now, before the job trains (an owner
            lease renewed in the background, :mod:`reshard.commit.ownership`);
            a second job on a root a live job owns is refused here with
            :class:`~reshard.errors.RootOwnedError` naming the owner, unless
            it is the same job restarting (the same ``job_id``, a launcher
            id that survives restarts, or an owner on this host whose process
            is gone). ``writer=False``: a manager that only reads, lists or
            collects the root (an evaluation, ``reshard ls``/``gc``) takes
            no ownership and refuses to save.
        job_id: this job's id across its restarts (default: ``RESHARD_JOB_ID``,
            ``SLURM_JOB_ID``, torchrun's ``TORCHELASTIC_RUN_ID`` unless
            ``"none"``; see :func:`reshard.commit.ownership.job_identity`).
        require_signed: the root requires signed checkpoints from now on
            (recorded in the owner record, signed with the HMAC key: needs
            one), so no job resumes from an unsigned checkpoint there; None:
            as the root's record says; False: no longer (needs the key).
        collect_other_lineages: retention also deletes checkpoints of other
            lineages (the branch a rollback left, a finished job's) once this
            lineage passed them; by default a job deletes its own lineage only.
        on_save_error: ``hook(step, path, exception)``, called on every rank
            when an asynchronous save fails, at the moment it fails (on the
            save's background thread: keep it short and thread-safe; an
            exception it raises is logged). A failure given to the hook
            counts as reported: ``wait``/``close`` do not raise it again.
        timeout_s: seconds every collective of a save, a restore and the
            manager's own agreement may wait for the other ranks
            (``SaveOptions.timeout_s`` / ``LoadOptions.timeout_s``: a
            checkpoint group with that timeout, independent of the training
            group's; a ``restore`` given its own ``LoadOptions`` uses theirs);
            None: ``options.timeout_s`` (default 600 s,
            :data:`reshard.options.DEFAULT_TIMEOUT_S`). A rank lost during a
            save (killed: its connections close) fails it on every other
            rank within seconds, and the exit wait for a background save
            ends with it; the exit wait prints one line saying what it waits
            for and how long each collective may wait.

    Failures (the failure budget: a fault costs at most the save it hit):
        A background save that fails is reported when it fails: one warning
        line on the coordinator (step, path, cause), the handle's
        ``committed`` future and ``on_save_error``. It never costs a later
        save: ``save``/``maybe_save`` always attempt their own step (an
        earlier failure nobody was told of is surfaced as a
        ``RuntimeWarning`` by that next save, which goes ahead). ``wait``
        and ``close`` wait for every pending save, then raise the first
        failure not yet reported (by the hook, a warning or
        ``SaveHandle.wait``), once. A synchronous save raises its own
        failure only.
    """

    def __init__(self, root: str | os.PathLike[str], *, every_steps: int | None = None,
                 every_seconds: float | None = None, interval: str | None = None,
                 mtbf_s: float | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int = 0, metric_mode: str = "min",
                 use_async: bool = False, smoke_tensors: int = 4, gc_grace_s: float = 3600.0,
                 preempt_signals: Sequence[int] = (signal.SIGTERM,),
                 options: SaveOptions | None = None, group: Any = None,
                 storage: Storage | None = None, checksum_before_delete: bool = True,
                 on_save_error: Callable[[int | None, str, BaseException], Any] | None = None,
                 timeout_s: float | None = None, writer: bool = True, job_id: str | None = None,
                 require_signed: bool | None = None, collect_other_lineages: bool = False):
        if interval not in (None, "auto"):
            raise ValueError("interval must be None or 'auto'")
        if interval == "auto" and not mtbf_s:
            raise ValueError("interval='auto' needs mtbf_s")
        for name, v, low in (("every_steps", every_steps, 1), ("keep_last", keep_last, 0),
                             ("keep_every", keep_every, 1), ("keep_best", keep_best, 0)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"CheckpointManager({name}=...) must be an int >= {low}"
                                 f"{'' if name == 'keep_best' else ' (or None)'}, got {v!r}")
        if every_seconds is not None and not (isinstance(every_seconds, (int, float))
                                              and not isinstance(every_seconds, bool)
                                              and every_seconds > 0):
            raise ValueError(f"CheckpointManager(every_seconds=...) must be a number of seconds > 0 "
                             f"(or None), got {every_seconds!r}")
        if timeout_s is not None:
            check_timeout(timeout_s, "CheckpointManager(timeout_s=...)")
        self.storage, self.root = resolve(root, storage)
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.interval, self.mtbf_s = interval, mtbf_s
        self.policy = Policy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                             mode=metric_mode, collect_other_lineages=collect_other_lineages)
        self.use_async = use_async
        self.smoke_tensors = smoke_tensors
        self.gc_grace_s = gc_grace_s
        self.options = options or SaveOptions()
        if timeout_s is not None:
            self.options = replace(self.options, timeout_s=timeout_s)
        self.timeout_s = self.options.timeout_s
        self.group = group
        # the manager's own collectives (cadence votes, names) share the bound
        # (their checkpoint group is made at the first of them)
        self.coll = Deferred(group, self.timeout_s)
        self.costs: list[float] = []
        self.last_save_time = time.monotonic()
        self.should_stop = False
        self._preempt = threading.Event()
        self._pending: list[tuple[str, SaveHandle]] = []
        self._auto_logged: float | None = None
        self.checksum_before_delete = checksum_before_delete
        self.on_save_error = on_save_error
        self._failed: list[SaveHandle] = []  # failed background saves of this manager
        self.last_plan: RetentionPlan | None = None
        #: attempts the last gc kept for their live lease: name -> seconds since renewed
        self.last_in_progress: dict[str, float] = {}
        # lineage of this run: the HEAD id and the parent of the next save
        self._lineage: str | None = None
        self._parent: str | None = None
        self._last_committed: str | None = None
        #: the checkpoint this manager's restore resumed from (pinned while the run is alive)
        self._resumed_from: str | None = None
        self._releasing_source = False
        self._joined = False
        self._closing = False
        self.last_outcomes: dict[str, str] = {}
        self.last_litter: list[str] = []
        self._deferred: list[Any] = []
        self.writer = writer
        self.job_id = job_identity(job_id)[0]
        self._owner: OwnerLease | None = None
        self._owner_done: Any = None
        self.storage.makedirs(self.root)
        self._owner_args: dict[str, Any] | None = None
        if writer and self.coll.rank == 0:  # ownership before the job trains (other ranks: at restore/save)
            strategy_for(self.storage).prove_publish(self.storage, self.storage.join(self.root, OWNER_NAME))
            self._owner_args = dict(
                job_id=job_id, require_signed=require_signed, hmac_key=hmac_key_of(self.options.hmac_key),
                policy={"keep_last": keep_last, "keep_every": keep_every, "keep_best": keep_best,
                        "mode": metric_mode, "collect_other_lineages": collect_other_lineages})
            try:
                self._take_root()
            except StorageError as e:
                if "no space left on device" not in str(e):
                    raise
                # the root is free for this job (a live foreign owner is refused before any write),
                # but full: ownership is recorded at the first save, once retention freed space
                log.warning("%s: the disk is full: this job's ownership of the root is recorded "
                            "at its first save, after retention frees space (%s)", self.root, e)
        self._old_handlers: dict[int, Any] = {}
        if preempt_signals and threading.current_thread() is threading.main_thread():
            for sig in preempt_signals:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    # ------------------------------------------------------------ naming
    @staticmethod
    def name_for(step: int) -> str:
        """The base name of ``step``'s checkpoint (a save may add a suffix)."""
        return f"step-{step:08d}"

    def path_for(self, step: int) -> str:
        """Path of ``step``'s checkpoint: the current lineage's, else the base name."""
        return self.storage.join(self.root, self._name(step))

    def _on_signal(self, signum: int, frame: Any) -> None:
        """A preemption signal: a save at the next step boundary, while the
        training loop is alive. One that arrives while the process is raising
        or unwinding an exception, closing the manager or exiting (no step
        boundary will come) is not deferred: the handler that was there
        before the manager runs (the default one ends the process), as it
        would without reshard."""
        why = ("exiting" if self._closing or sys.is_finalizing() or exiting()
               or not threading.main_thread().is_alive()
               else "unwinding an exception" if sys.exc_info()[1] is not None else None)
        if why is None:
            log.warning("signal %d: a checkpoint will be saved at the next step boundary", signum)
            self._preempt.set()
            return
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        log.warning("signal %d while %s: no checkpoint is deferred to a step boundary that will "
                    "not come; handled as without reshard", signum, why)
        if callable(old):
            old(signum, frame)
            return
        if old == signal.SIG_IGN:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def request_preemption(self) -> None:
        """Same as receiving a preemption signal."""
        self._preempt.set()

    # ------------------------------------------------------------ cadence
    def current_interval_s(self) -> float | None:
        """Seconds between time-based saves (``every_seconds`` or Young/Daly)."""
        if self.interval == "auto":
            recent = self.costs[-5:]
            cost = sum(recent) / len(recent) if recent else 0.0
            t = young_daly_interval(cost, float(self.mtbf_s))  # type: ignore[arg-type]
            if self._auto_logged is None or abs(t - self._auto_logged) > 0.1 * max(t, 1e-9):
                log.info("checkpoint interval (Young/Daly): %.1f s from cost %.3f s, MTBF %.0f s",
                         t, cost, self.mtbf_s)
                self._auto_logged = t
            return t
        return self.every_seconds

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step (agreed across ranks when the
        decision depends on time or signals)."""
        want = bool(self.every_steps and step % self.every_steps == 0)
        iv = self.current_interval_s()
        timed = iv is not None and time.monotonic() - self.last_save_time >= iv
        pre = self._preempt.is_set()
        if self.coll.world_size > 1:
            # one all-reduce: the coordinator's clock decides "timed", any rank's signal "pre"
            votes = self.coll.all_reduce_ints([int(timed and self.coll.rank == 0), int(pre)], "max")
            timed, pre = bool(votes[0]), bool(votes[1])
            if pre:
                self._preempt.set()
        return want or timed or pre

    def maybe_save(self, step: int, state: Mapping[str, Any], *,
                   metric: float | None = None) -> SaveResult | SaveHandle | None:
        """Save if :meth:`should_save`. After a preemption request, the save is
        synchronous and ``should_stop`` becomes True (also when it, or the
        wait for the saves still in flight, raises).

        Never raises an earlier background save's failure (see the class
        docstring): a checkpoint step is always attempted.

        Raises:
            CheckpointError: this step's synchronous save failed."""
        self._process_finished()
        if not self.should_save(step):
            return None
        if self._preempt.is_set():
            try:
                res = self.save(step, state, metric=metric, sync=True)
                self.wait()
            finally:
                self.should_stop = True
            return res
        return self.save(step, state, metric=metric)

    def save(self, step: int, state: Mapping[str, Any], *, metric: float | None = None,
             sync: bool | None = None) -> SaveResult | SaveHandle:
        """Save ``state`` as the checkpoint of ``step`` under the root now.

        Its name is ``step-%08d``, or ``step-%08d.1`` (``.2``, ...) when that
        name is taken (by a checkpoint of another lineage, a quarantined one,
        one the lineage refers to, or an earlier save of this step), so a
        save after a fall back past a torn step proceeds. The coordinator
        chooses the name; every rank uses it. The manifest records the parent
        (the checkpoint resumed from, then the previous save of this run) and
        this run's lineage (:mod:`reshard.commit.lineage`).

        Asynchronous (``use_async``): returns the handle once staged; its
        failure is reported when it happens (see the class docstring). An
        earlier save's failure never stops this one.

        Raises:
            CheckpointError: as :func:`reshard.save` for a synchronous save
                (its own failure only); StorageError when the root cannot be
                listed to choose the name.
        """
        # every rank checks in before the manager's own collectives (the lineage, the name):
        # a save called on some ranks only fails there within the bound, naming the others
        self._arrive("save", f"CheckpointManager.save of step {step} under {self.root}",
                     self.options.arrival_timeout_s)
        extra = dict(self.options.extra)
        if metric is not None:
            extra["metric"] = float(metric)
        if self._lineage is None and not self._joined:
            self._join_lineage(step)
        if self.use_async and not sync and self.options.if_busy == "block":
            # the oldest in-flight save commits (and retention runs) before the
            # next is handed off: keep_last=K then holds at most K committed
            # checkpoints plus the one being written (plus the resume source)
            while len(self._pending) >= self.options.max_pending:
                self._pending[0][1].committed.exception()
                self._process_finished()
        if self.coll.rank == 0:
            self._make_room(step)
        name = self._agreed_name(step)
        # incremental by default: every checkpoint stays self-contained (linked or
        # copied inside the store, docs/design.md); SaveOptions(incremental=False) opts out
        opts = SaveOptions(**{**self.options.__dict__, "extra": extra, "parent": self._parent,
                              "lineage": self._lineage,
                              "incremental": self.options.incremental is not False})
        path = self.storage.join(self.root, name)
        t0 = time.perf_counter()
        self.last_save_time = time.monotonic()
        if self.use_async and not sync:
            h = async_save(state, path, step=step, group=self.group, options=opts, storage=self.storage)
            h.committed.add_done_callback(functools.partial(self._on_done, h))
            self.costs.append(h.stall_s)
            self._pending.append((name, h))
            self._parent = name
            return h
        res = save(state, path, step=step, group=self.group, options=opts, storage=self.storage)
        self.costs.append(time.perf_counter() - t0)
        self._parent = self._last_committed = name
        self._after_commit(name)
        return res

    def _make_room(self, step: int) -> None:
        """Coordinator, before a save: when the store reports free space
        (local: ``statvfs``) and it is less than the bytes the newest
        checkpoint's save wrote (the expected size of this one: the files an
        incremental save linked are not counted), apply retention first, so the
        checkpoints it no longer keeps free their space (never the newest
        verified one, the resume source or the lineage's newest: the
        retention rules); newer checkpoints left unverified (their record's
        write failed) are smoke-tested first, as ``reshard gc`` does. Never raises: the save's own check (exact, from
        its plan) fails it up front if it still does not fit."""
        try:
            free = self.storage.free_bytes(self.root)
            if free is None:
                return
            entries = committed(self.storage, self.root)
            if not entries or entries[-1].manifest is None:
                return
            # the bytes the newest save wrote itself (an incremental save links the
            # unchanged files: they need no space, and deleting a checkpoint that
            # shares them frees none of them: reshard.commit.sharing)
            need = sum(fe.size for fe in entries[-1].manifest.files.values() if not fe.origin)
            if free >= need:
                return
            log.warning("%s: %d bytes free, the save of step %d needs about %d: applying "
                        "retention first", self.root, free, step, need)
            # smoke_newer: a checkpoint whose verification record failed (a full disk, EIO)
            # is tested again here, else it would hold the older verified ones forever
            self._retention_after_commit(smoke_newer=True)
        except CheckpointError as e:
            log.warning("%s: freeing space before the save of step %d failed (%s: %s)",
                        self.root, step, type(e).__name__, e)

    def _join_lineage(self, step: int) -> None:
        """At the first save of a manager that did not resume (restore found
        nothing, or was not called): the same job restarting (the root's
        previous owner had this job's id, or both are unnamed, or the root
        has no owner record) joins the root's current lineage (the HEAD's
        id), so its saves count as the lineage's descendants; another job
        (the previous owner's job id differs from this one's) starts a
        lineage of its own (:func:`~reshard.manager.resume.start_lineage`: a
        fresh-start HEAD). Before, every such manager joined, and without a
        HEAD every checkpoint in the root was its lineage: a job started
        beside a finished job's checkpoints deleted them, and its own first
        checkpoints for theirs of a greater step."""
        self._joined = True
        same = b"1"
        if self.coll.rank == 0:
            try:
                prev = self._owner.replaced if self._owner is not None else read_owner(self.storage, self.root)[0]
            except CheckpointError:
                prev = None
            same = b"1" if prev is None or prev.get("job") == self.job_id else b""
        if not self.coll.broadcast_bytes(same if self.coll.rank == 0 else None):
            start_lineage(self, f"CheckpointManager.save of step {step} under {self.root} (starting "
                                "this job's lineage: writing HEAD)")
            return
        try:
            head = Head.from_record(read_head(self.storage, self.root)) if self.coll.rank == 0 else None
        except CheckpointError:
            head = None
        ids = self.coll.broadcast_bytes((head.id if head else "").encode() if self.coll.rank == 0 else None)
        self._lineage = ids.decode() or None

    def _agreed_name(self, step: int) -> str:
        """The coordinator's choice of the name for ``step``, on every rank."""
        mine: dict[str, Any] = {}
        if self.coll.rank == 0:
            try:
                self._check_writer()
                mine = {"name": self._free_name(step)}
            except RootOwnedError as e:
                mine = {"owner": str(e)}
            except Exception as e:  # noqa: BLE001 - every rank raises it
                mine = {"error": f"{type(e).__name__}: {e}"}
        got = msgspec.json.decode(self.coll.broadcast_bytes(
            msgspec.json.encode(mine) if self.coll.rank == 0 else None))
        if "owner" in got:  # refused before anything of this save is written
            raise RootOwnedError(f"the save of step {step} is refused: {got['owner']}")
        if "error" in got:
            raise StorageError(f"{self.root}: choosing the checkpoint name of step {step} failed "
                               f"on the coordinator: {got['error']}")
        return str(got["name"])

    def _take_root(self) -> None:
        """Coordinator: take ownership of the root (see ``writer``)."""
        assert self._owner_args is not None
        self._owner = ownership.acquire(self.storage, self.root, **self._owner_args)
        self._owner_done = weakref.finalize(self, ownership.drop, self._owner)

    def _check_writer(self) -> None:
        """Coordinator: this manager may save (it owns the root, or was not
        made to own it only because it is a reader).

        Raises:
            RootOwnedError: made with ``writer=False``, or ownership was lost."""
        if not self.writer:
            raise RootOwnedError(f"{self.root}: this CheckpointManager was made with writer=False "
                                 "(a reader); it takes no ownership of the root and does not save")
        if self._owner is None and self._owner_args is not None:  # a full disk at construction
            self._take_root()
        if self._owner is not None:
            self._owner.check()

    def _check_owner(self, hmac_key: bytes | None) -> None:
        """Coordinator, at restore: ownership still held, and a root that
        requires signed checkpoints is only resumed with an HMAC key.

        Raises:
            RootOwnedError: ownership was lost. IntegrityError: the root requires signing, no key."""
        if self._owner is not None:
            self._owner.check()
        rec, _ = ownership.read_owner(self.storage, self.root)
        if rec and rec.get("require_signed") and hmac_key is None:
            raise IntegrityError(f"{self.root} requires signed checkpoints (recorded by job "
                                 f"{rec.get('job') or 'unnamed'} in {OWNER_NAME}), but no HMAC key "
                                 "was given: refusing to resume from it (RESHARD_HMAC_KEY_FILE, "
                                 "--hmac-key-file, or LoadOptions(hmac_key=))")

    def _free_name(self, step: int) -> str:
        """``name_for(step)``, or the first free ``.1``, ``.2``, ... suffix."""
        taken = set(self.storage.list_dir(self.root)) if self.storage.exists(self.root) else set()
        taken |= {n.split(QUARANTINED, 1)[0] for n in taken if QUARANTINED in n}
        for e in scan(self.storage, self.root):
            if e.manifest is not None and e.manifest.parent:
                taken.add(e.manifest.parent)
        head = Head.from_record(read_head(self.storage, self.root))
        if head is not None and head.name:
            taken.add(head.name)
        taken |= {n for n, _ in self._pending}
        if self._parent:
            taken.add(self._parent)
        base = self.name_for(step)
        if base not in taken:
            return base
        i = 1
        while f"{base}.{i}" in taken:
            i += 1
        log.info("%s is taken; saving step %d as %s.%d", base, step, base, i)
        return f"{base}.{i}"

    def _on_done(self, h: SaveHandle, _f: Any = None) -> None:
        """On the background thread, when a save ends: a failure goes to
        ``on_save_error`` at once (which then counts as its report)."""
        exc = h.committed.exception()
        if exc is None or self.on_save_error is None:
            return
        h._reported = True
        try:
            self.on_save_error(h.step, h.path, exc)
        except Exception as e:  # noqa: BLE001 - a hook's error must not end the save thread
            log.warning("on_save_error raised for the save of step %s: %s: %s", h.step,
                        type(e).__name__, e)

    def wait_for_staging(self, timeout: float | None = None) -> float:
        """The hook a training loop calls before it mutates the state
        (before ``optimizer.step()``) when the manager saves in the overlap
        mode (``use_async`` with ``SaveOptions(overlap_staging=True)``):
        blocks until every in-flight save of this manager's group (of
        every group when the manager has none) has staged every byte
        (:func:`reshard.wait_for_staging`). Cheap when
        nothing is in flight: call it every step. Trainer integrations call
        it at their pre-optimizer-step hook.

        Returns:
            The seconds it blocked.

        Raises:
            TimeoutError: not staged within ``timeout`` seconds.
        """
        return wait_for_staging(self.group, timeout)

    def prewarm_staging(self, state: Mapping[str, Any] | None = None) -> int:
        """Allocate the staging slabs of this manager's asynchronous saves
        now (for ``state``'s bytes, at most the staging budget; without it,
        the whole budget), so the first save faults no page
        (:func:`reshard.prewarm_staging`; every rank calls it). Returns the
        bytes the pool holds."""
        return prewarm_staging(state, group=self.group, options=self.options)

    def wait(self) -> None:
        """Wait for every in-flight save, then verify and apply retention.

        Raises:
            CheckpointError: a background save of this manager failed and
                was not yet reported (by ``on_save_error``, a later save's
                warning or ``SaveHandle.wait``): the first such failure,
                once, after every pending save finished.
        """
        try:
            for _, h in self._pending:
                h.committed.exception()
        finally:
            self._process_finished()
        fresh = [h for h in self._failed if not h._reported]
        self._failed.clear()
        for h in fresh:
            h._reported = True
        if fresh:
            h = fresh[0]
            more = f" ({len(fresh) - 1} more failed)" if len(fresh) > 1 else ""
            raise CheckpointError(f"the asynchronous save of step {h.step} to {h.path} failed: "
                                  f"{h.committed.exception()}{more}") from h.committed.exception()

    def _process_finished(self) -> None:
        done = [(n, h) for n, h in self._pending if h.done()]
        self._pending = [(n, h) for n, h in self._pending if not h.done()]
        for name, h in done:
            if h.exception() is None and not h.skipped:
                self._last_committed = name
                self._after_commit(name)
            else:
                if h.exception() is not None:
                    self._failed.append(h)
                if self._parent == name:  # never committed: the next save's parent is the last one that did
                    self._parent = self._last_committed

    def _after_commit(self, name: str) -> None:
        """The coordinator's housekeeping after ``name`` committed: its
        verification record, retention, gc of abandoned attempts. It runs on
        rank 0 alone, so a failure of the store here (a full disk, an I/O
        error) must not raise: the save did commit, the other ranks have
        returned, and an exception on one rank would leave the ranks in
        mismatched collectives. It is logged as a warning (with what was
        left undone: an unverified checkpoint keeps older ones; an undeleted
        one is kept) and the next commit's housekeeping tries again."""
        if self.coll.rank != 0:
            return
        for what, step in (("its verification record", lambda: self.verify_checkpoint(name)),
                           ("retention", self._retention_after_commit),
                           ("gc of abandoned attempts", self.gc_abandoned)):
            try:
                step()
            except CheckpointError as e:
                log.warning("%s committed, but %s failed on the coordinator (%s: %s); left as "
                            "it is (nothing is deleted that retention keeps), retried after the "
                            "next save", self.storage.join(self.root, name), what,
                            type(e).__name__, e)

    def _retention_after_commit(self, *, smoke_newer: bool = False) -> None:
        """This run's retention (after a commit, before a save on a full
        disk, at close), by the coordinator. Nothing is deleted by a run that
        no longer owns the root.

        Raises:
            RootOwnedError: ownership was lost (the callers log it). CheckpointError: as apply_retention."""
        if self._owner is not None:
            self._owner.check()  # another job took the root: its checkpoints are not ours to delete
        moved = self._head_moved()
        if moved is None:
            self.apply_retention(smoke_newer=smoke_newer)
        else:
            log.warning("%s: HEAD changed since this run resumed (another run resumed from "
                        "%s); this run (lineage %s) deletes nothing: its retention would "
                        "follow the other run's lineage", self.root, moved.name, self._lineage)

    def _head_moved(self) -> Head | None:
        """The root's HEAD when another run sharing the root resumed since
        this run resumed or joined, and saves (a requeued job while the old
        one still runs: a checkpoint of the HEAD's lineage exists), else
        None. Such a run never applies retention: its lineage is not the
        root's current one, and retention by the current lineage would
        delete the other run's checkpoints (its newest included). A HEAD
        written by a reader that does not save (an evaluation resuming with
        a manager) does not stop retention."""
        if not self._joined:
            return None
        head = Head.from_record(read_head(self.storage, self.root))
        if head is None or head.id == self._lineage:
            return None
        saving = any(e.manifest is not None and e.manifest.lineage == head.id
                     for e in committed(self.storage, self.root))
        return head if saving else None

    # ------------------------------------------------------------ verification
    def _verified_path(self, name: str) -> str:
        return self.storage.join(self.root, name + VERIFIED)

    def _name(self, which: str | int) -> str:
        """A checkpoint name from a name or a step (the current lineage's
        newest checkpoint of that step, else ``name_for(step)``)."""
        if isinstance(which, str):
            return which
        entries = committed(self.storage, self.root)
        lin = lineage_of(entries, Head.from_record(read_head(self.storage, self.root)))
        for e in resume_order(entries, lin):
            if e.step == which:
                return e.name
        return self.name_for(which)

    def verify_checkpoint(self, which: str | int, *, how: str = "smoke",
                          record: bool = True) -> bool:
        """Check the checkpoint ``which`` (a name, or a step) and record the
        outcome beside it (``<name>.verified.json``, bound to the manifest's
        digest and every file's size: see :meth:`is_verified`).

        ``how``: "smoke" (the restore smoke test: structure check of
        coverage, files and sizes, then a trial load into CPU memory of
        ``smoke_tensors`` tensors with their checksums verified),
        "checksums" (:func:`reshard.verify` of every byte) or "structure"
        (structure and sizes only). ``record=False`` changes nothing on
        storage (a dry run)."""
        return check_and_record(self.storage, self.root, self._name(which),
                                smoke_tensors=self.smoke_tensors, how=how, record=record)

    def is_verified(self, name: str, entry: Entry | None = None) -> bool:
        """Whether ``name`` has a passing verification record that still
        describes it: the record's manifest digest equals the digest of the
        manifest now there and every file has the size recorded (one manifest
        read and one stat per file). A changed checkpoint is unverified."""
        return record_holds(self.storage, self.root, name, entry)

    # ------------------------------------------------------------ resume
    def latest_step(self) -> int | None:
        """Step of the checkpoint :func:`reshard.latest` returns (or None)."""
        e = latest_entry(self.storage, self.root)
        return None if e is None else e.step

    def restore(self, state: Mapping[str, Any], *, step: int | None = None,
                name: str | None = None, allow_fresh_start: bool = False,
                record_head: bool = True, accept: Callable[[Any], bool] | None = None,
                **load_kwargs: Any) -> LoadResult | None:
        """Load the newest checkpoint of the current lineage that loads (or
        the checkpoint of ``step``: the current lineage's first when several
        hold it; or the checkpoint called ``name``); collective: every rank
        reaches the same outcome and every rank falls back together.

        Tried in :func:`reshard.commit.lineage.resume_order`. A checkpoint that is
        unloadable (a file missing or short, a bad manifest, a checksum
        mismatch: ``IntegrityError`` or ``ManifestError`` on any rank) is
        quarantined by the coordinator (renamed aside or marked, never
        deleted) with a warning, and the next one is tried; one that vanished
        meanwhile is skipped. On success the coordinator writes the root's
        ``HEAD`` record naming the checkpoint resumed from; the saves that
        follow continue its lineage. ``record_head=False`` (an evaluation or
        an export reading a live training root) writes no ``HEAD``: a restore
        of an older step then never rolls the training run's lineage back.
        A manager restored that way must not save (its saves would join the
        lineage of the existing ``HEAD``, not of the checkpoint it loaded).
        ``accept(manifest) -> bool``: only checkpoints it accepts are
        candidates. Default, when neither ``step`` nor ``name`` is given:
        :func:`reshard.catalog.verify.resumable`, so a checkpoint marked
        model-only (a TorchTitan ``last_save_model_only`` save, a seed
        checkpoint: ``extra["content"] == "model_only"``) is never resumed as
        a training state, as :func:`reshard.latest` never returns one; a
        checkpoint named by ``step`` or ``name`` is loaded whatever it holds.

        Returns:
            The LoadResult (``notes["fallback"]`` lists what was skipped), or
            None for a fresh start (an empty root, or ``allow_fresh_start``).

        Raises:
            StorageError: the store failed (never a reason to quarantine or
                to fall back: it may be transient).
            CheckpointError: checkpoints exist (or were quarantined) but none
                loads; the checkpoint of ``step`` (``name``) is committed but
                its manifest is damaged (set aside now, the error names it); a
                mismatch with ``state`` (e.g. ShardingError).
            CheckpointNotFoundError: no committed checkpoint but abandoned
                attempts exist (a silent fresh start would lose the run), or
                ``step`` (``name``) is not committed.
        """
        if load_kwargs.get("options") is None:  # the manager's timeout (LoadOptions given: theirs)
            from ..options import LoadOptions

            load_kwargs = {**load_kwargs, "options": LoadOptions(timeout_s=self.timeout_s)}
        if accept is None and step is None and name is None:
            accept = resumable
        opts = load_kwargs["options"]
        self._arrive("restore", f"CheckpointManager.restore of {self.root}",
                     getattr(opts, "arrival_timeout_s", None), getattr(opts, "timeout_s", self.timeout_s))
        return restore_collective(self, state, step=step, name=name,
                                  allow_fresh_start=allow_fresh_start, load_kwargs=load_kwargs,
                                  record_head=record_head, accept=accept)

    def _arrive(self, kind: str, what: str, bound: float | None, timeout_s: Any = None) -> None:
        """Every rank of the manager's group checks in (:func:`reshard.collectives.arrive`)
        before a save or restore issues its first collective: called on some
        ranks only, it raises CheckpointError on those within ``bound`` seconds,
        naming the ranks that did not come."""
        t = self.timeout_s if timeout_s is None else timeout_s
        arrive(self.group, Arrival(kind=f"manager-{kind}", what=what, timeout_s=bound),
               checkpoint_timeout_s(self.group, t))

    def _resumed(self, head: Head) -> None:
        self._lineage, self._parent, self._joined = head.id, head.name, True
        self._last_committed = head.name
        self._resumed_from = head.name

    def _owner_lease(self) -> str | None:
        """Coordinator: the id of the owner lease this manager holds (the
        ``lease`` of ``OWNER``), recorded in the HEAD it writes; None when it
        holds none (a reader, another rank, a full disk at construction)."""
        lease = self._owner.record.get("lease") if self._owner is not None else None
        return lease if isinstance(lease, str) else None

    def _release_source(self) -> None:
        """Coordinator, at :meth:`close`: the run ends, so the checkpoint it
        resumed from is no longer kept for it (:meth:`source_pinned`);
        retention applies once more without that pin, when this run resumed
        and committed a checkpoint since (``keep_last=2`` then leaves 2). A
        failure is logged: closing never raises for it."""
        if (self.coll.rank != 0 or not self.writer or self._owner is None or self._resumed_from is None
                or self._last_committed in (None, self._resumed_from)):
            return
        self._releasing_source = True
        try:
            self._retention_after_commit()
        except CheckpointError as e:
            log.warning("%s: retention at close failed (%s: %s)", self.root, type(e).__name__, e)
        finally:
            self._releasing_source = False

    def close(self) -> None:
        """Wait for in-flight saves, apply retention once more without the
        pin on the checkpoint this run resumed from (:meth:`source_pinned`: it
        is kept while the run is alive only), release the root and restore
        the signal handlers replaced.

        Raises:
            CheckpointError: as :meth:`wait` (the handlers are restored first)."""
        self._closing = True
        try:
            self.wait()
            self._release_source()
        finally:
            if self._owner_done is not None:  # the root is released (the record stays)
                self._owner_done()
                self._owner = None
            if threading.current_thread() is threading.main_thread():
                for sig, old in self._old_handlers.items():
                    signal.signal(sig, old)
            self._old_handlers.clear()
