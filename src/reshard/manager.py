"""CheckpointManager: cadence, retention with verify-before-delete, leases,
garbage collection of abandoned attempts, preemption and resume.

Layout under ``root``: committed checkpoints ``step-%08d/``; attempts
``step-%08d.incomplete-<id>/``; sidecars written by the manager beside them
(never inside a committed checkpoint, which is never modified):
``step-%08d.verified.json`` (the restore smoke test passed) and
``step-%08d.lease-<id>.json`` (a reader holds the checkpoint until ``expires``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .collectives import SingleProcess, get_collectives
from .commit import INCOMPLETE, Entry, committed, delete_checkpoint, scan
from .errors import CheckpointError, CheckpointNotFoundError, IntegrityError, ManifestError
from .load import LoadResult, load
from .options import LoadOptions, SaveOptions
from .retention import Candidate, Decision, Policy, decide
from .save import SaveResult, save
from .sharding import ShardedTensor, torch_dtype
from .staging import SaveHandle, async_save
from .storage import Storage, resolve
from .verify import verify

log = logging.getLogger("reshard.manager")

VERIFIED = ".verified.json"
LEASE = ".lease-"


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


class CheckpointManager:
    """Periodic checkpoints under ``root`` with safe retention and resume.

    Args:
        root: directory (or URL prefix) holding the checkpoints.
        every_steps: save when ``step % every_steps == 0``.
        every_seconds: save when this many seconds passed since the last save.
        interval: "auto": Young/Daly interval from the measured foreground
            cost of recent saves and ``mtbf_s`` (logged when it changes).
        mtbf_s: mean time between failures, seconds (for ``interval="auto"``).
        keep_last, keep_every, keep_best, metric_mode: retention policy (see
            :mod:`reshard.retention`); the newest verified checkpoint is
            always kept, and nothing is deleted before a newer one passed the
            smoke test.
        use_async: save with :func:`reshard.async_save`.
        smoke_tensors: tensors trial-loaded (checksums verified) by the smoke test.
        gc_grace_s: abandoned attempts older than this are deleted.
        preempt_signals: signals that request a save at the next step
            boundary followed by a clean stop (``should_stop``).
        options: SaveOptions for every save.
        group: process group.
    """

    def __init__(self, root: str | os.PathLike[str], *, every_steps: int | None = None,
                 every_seconds: float | None = None, interval: str | None = None,
                 mtbf_s: float | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int = 0, metric_mode: str = "min",
                 use_async: bool = False, smoke_tensors: int = 4, gc_grace_s: float = 3600.0,
                 preempt_signals: Sequence[int] = (signal.SIGTERM,),
                 options: SaveOptions | None = None, group: Any = None,
                 storage: Storage | None = None):
        if interval not in (None, "auto"):
            raise ValueError("interval must be None or 'auto'")
        if interval == "auto" and not mtbf_s:
            raise ValueError("interval='auto' needs mtbf_s")
        self.storage, self.root = resolve(root, storage)
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.interval, self.mtbf_s = interval, mtbf_s
        self.policy = Policy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                             mode=metric_mode)
        self.use_async = use_async
        self.smoke_tensors = smoke_tensors
        self.gc_grace_s = gc_grace_s
        self.options = options or SaveOptions()
        self.group = group
        self.coll = get_collectives(group)
        self.costs: list[float] = []
        self.last_save_time = time.monotonic()
        self.should_stop = False
        self._preempt = threading.Event()
        self._pending: list[tuple[int, SaveHandle]] = []
        self._auto_logged: float | None = None
        self.storage.makedirs(self.root)
        self._old_handlers: dict[int, Any] = {}
        if preempt_signals and threading.current_thread() is threading.main_thread():
            for sig in preempt_signals:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    # ------------------------------------------------------------ naming
    @staticmethod
    def name_for(step: int) -> str:
        return f"step-{step:08d}"

    def path_for(self, step: int) -> str:
        return self.storage.join(self.root, self.name_for(step))

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.warning("signal %d: a checkpoint will be saved at the next step boundary", signum)
        self._preempt.set()

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
            votes = self.coll.all_gather_json([timed if self.coll.rank == 0 else False, pre])
            timed = bool(votes[0][0])
            pre = any(v[1] for v in votes)
            if pre:
                self._preempt.set()
        return want or timed or pre

    def maybe_save(self, step: int, state: Mapping[str, Any], *,
                   metric: float | None = None) -> SaveResult | SaveHandle | None:
        """Save if :meth:`should_save`. After a preemption request, the save is
        synchronous and ``should_stop`` becomes True."""
        self._process_finished()
        if not self.should_save(step):
            return None
        if self._preempt.is_set():
            res = self.save(step, state, metric=metric, sync=True)
            self.wait()
            self.should_stop = True
            return res
        return self.save(step, state, metric=metric)

    def save(self, step: int, state: Mapping[str, Any], *, metric: float | None = None,
             sync: bool | None = None) -> SaveResult | SaveHandle:
        """Save ``state`` as ``root/step-%08d`` now."""
        extra = dict(self.options.extra)
        if metric is not None:
            extra["metric"] = float(metric)
        opts = SaveOptions(**{**self.options.__dict__, "extra": extra})
        path = self.path_for(step)
        t0 = time.perf_counter()
        self.last_save_time = time.monotonic()
        if self.use_async and not sync:
            h = async_save(state, path, step=step, group=self.group, options=opts, storage=self.storage)
            self.costs.append(h.stall_s)
            self._pending.append((step, h))
            return h
        res = save(state, path, step=step, group=self.group, options=opts, storage=self.storage)
        self.costs.append(time.perf_counter() - t0)
        self._after_commit(step)
        return res

    def wait(self) -> None:
        """Wait for in-flight saves, then verify and apply retention.

        Raises:
            CheckpointError: a background save failed (raised once: the
                failed save is then no longer pending).
        """
        try:
            for _, h in self._pending:
                h.wait()
        finally:
            self._process_finished()

    def _process_finished(self) -> None:
        done = [(s, h) for s, h in self._pending if h.done()]
        self._pending = [(s, h) for s, h in self._pending if not h.done()]
        for step, h in done:
            if h.exception() is None and not h.skipped:
                self._after_commit(step)
            # a failed background save is raised by the next save (reshard.staging)

    def _after_commit(self, step: int) -> None:
        if self.coll.rank == 0:
            self.verify_checkpoint(step)
            self.apply_retention()
            self.gc_abandoned()

    # ------------------------------------------------------------ verification
    def _verified_path(self, name: str) -> str:
        return self.storage.join(self.root, name + VERIFIED)

    def verify_checkpoint(self, step: int) -> bool:
        """Restore smoke test of ``step``: structure check (coverage, files and
        sizes), then a trial load into CPU memory of a sample of tensors with
        their checksums verified. Records the outcome beside the checkpoint."""
        name = self.name_for(step)
        path = self.path_for(step)
        problems: list[str] = []
        try:
            rep = verify(path, checksums=False, storage=self.storage)
            problems.extend(rep.problems)
            m = rep.manifest
            if m is not None and not problems:
                names = sorted(m.tensors, key=lambda k: (sum(c.length for c in m.tensors[k].chunks), k))
                k = min(self.smoke_tensors, len(names))
                pick = names[: k // 2] + names[len(names) - (k - k // 2):]  # smallest and largest
                targets = [ShardedTensor(k, torch.empty(m.tensors[k].global_shape,
                                                        dtype=torch_dtype(m.tensors[k].dtype)),
                                         global_shape=m.tensors[k].global_shape,
                                         global_offset=(0,) * len(m.tensors[k].global_shape))
                           for k in dict.fromkeys(pick)]
                if targets:
                    load({"smoke": targets}, path, group=SingleProcess(), strict=False,
                         options=LoadOptions(checksums=True), storage=self.storage)
        except CheckpointError as e:
            problems.append(f"{type(e).__name__}: {e}")
        ok = not problems
        rec = {"ok": ok, "time": time.time(), "problems": problems[:20]}
        self.storage.write_bytes(self._verified_path(name), json.dumps(rec).encode())
        if not ok:
            log.warning("checkpoint %s failed its smoke test: %s", path, problems[:3])
        return ok

    def is_verified(self, name: str) -> bool:
        try:
            rec = json.loads(self.storage.read_bytes(self._verified_path(name)))
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return False
        return bool(rec.get("ok"))

    # ------------------------------------------------------------ leases
    @contextlib.contextmanager
    def lease(self, step: int, ttl_s: float = 3600.0) -> Iterator[str]:
        """Hold checkpoint ``step`` against retention while reading it
        (export, conversion, a tier copy, an evaluation). Yields its path."""
        name = self.name_for(step)
        lp = self.storage.join(self.root, f"{name}{LEASE}{os.getpid()}-{os.urandom(3).hex()}.json")
        self.storage.write_bytes(lp, json.dumps({"expires": time.time() + ttl_s}).encode())
        try:
            yield self.path_for(step)
        finally:
            self.storage.delete_tree(lp)

    def _leased(self, names: set[str]) -> set[str]:
        out: set[str] = set()
        now = time.time()
        for child in self.storage.list_dir(self.root):
            if LEASE not in child:
                continue
            base = child.split(LEASE, 1)[0]
            try:
                rec = json.loads(self.storage.read_bytes(self.storage.join(self.root, child)))
            except (FileNotFoundError, ValueError):
                continue
            if rec.get("expires", 0) > now and base in names:
                out.add(base)
        return out

    # ------------------------------------------------------------ retention
    def candidates(self, entries: list[Entry] | None = None) -> list[Candidate]:
        entries = committed(self.storage, self.root) if entries is None else entries
        names = {e.name for e in entries}
        leased = self._leased(names)
        inflight = {self.name_for(s) for s, _ in self._pending}
        out = []
        for e in entries:
            m = e.manifest
            assert m is not None
            metric = m.extra.get("metric")
            out.append(Candidate(name=e.name, step=m.step if m.step is not None else -1,
                                 verified=self.is_verified(e.name),
                                 metric=float(metric) if isinstance(metric, (int, float)) else None,
                                 protected=e.name in leased or e.name in inflight))
        return out

    def apply_retention(self, *, dry_run: bool = False) -> Decision:
        """Delete what the policy no longer keeps (coordinator only)."""
        d = decide(self.candidates(), self.policy)
        if not dry_run:
            for name in d.delete:
                log.info("retention: deleting %s", name)
                delete_checkpoint(self.storage, self.storage.join(self.root, name))
                self.storage.delete_tree(self._verified_path(name))
        return d

    def gc_abandoned(self, grace_s: float | None = None, *, dry_run: bool = False) -> list[str]:
        """Delete ``*.incomplete-*`` attempts older than ``grace_s`` seconds
        (never one of this manager's in-flight saves)."""
        grace = self.gc_grace_s if grace_s is None else grace_s
        now = time.time()
        inflight = {self.name_for(s) for s, _ in self._pending}
        out = []
        for e in scan(self.storage, self.root):
            if not e.abandoned or INCOMPLETE not in e.name:
                continue
            if e.name.split(INCOMPLETE, 1)[0] in inflight:
                continue
            if e.mtime is not None and now - e.mtime < grace:
                continue
            out.append(e.name)
            if not dry_run:
                self.storage.delete_tree(e.path)
        return out

    # ------------------------------------------------------------ resume
    def latest_step(self) -> int | None:
        done = committed(self.storage, self.root)
        return done[-1].step if done else None

    def restore(self, state: Mapping[str, Any], *, step: int | None = None,
                allow_fresh_start: bool = False, **load_kwargs: Any) -> LoadResult | None:
        """Load the newest committed checkpoint that loads (or ``step``).

        A checkpoint whose structure check fails (a file missing or
        truncated) or whose load hits corruption is skipped with a warning,
        falling back to the next older one.

        Returns:
            The LoadResult, or None for a fresh start (an empty root, or
            ``allow_fresh_start``).

        Raises:
            CheckpointError: checkpoints exist but none loads.
            CheckpointNotFoundError: no committed checkpoint but abandoned
                attempts exist (a silent fresh start would lose the run), or
                ``step`` is not committed.
        """
        entries = committed(self.storage, self.root)
        if step is not None:
            entries = [e for e in entries if e.step == step]
            if not entries:
                raise CheckpointNotFoundError(f"{self.root}: no committed checkpoint of step {step}")
        failures: list[str] = []
        for e in reversed(entries):
            rep = verify(e.path, checksums=False, storage=self.storage)
            oks = self.coll.all_gather_json(rep.ok)
            if not all(oks):
                msg = f"{e.path}: unloadable ({'; '.join(rep.problems[:3]) or 'on another rank'})"
                failures.append(msg)
                warnings.warn(msg + "; falling back to an older checkpoint", RuntimeWarning,
                              stacklevel=2)
                continue
            try:
                res = load(state, e.path, group=self.group, storage=self.storage, **load_kwargs)
            except (IntegrityError, ManifestError, CheckpointNotFoundError) as err:
                failures.append(f"{e.path}: {err}")
                warnings.warn(f"{e.path}: load failed ({err}); falling back to an older checkpoint",
                              RuntimeWarning, stacklevel=2)
                continue
            if failures:
                res.notes["fallback"] = failures
            return res
        if failures:
            raise CheckpointError(f"{self.root}: {len(failures)} checkpoint(s) exist but none loads:\n  "
                                  + "\n  ".join(failures))
        abandoned = [e.name for e in scan(self.storage, self.root) if e.abandoned]
        if abandoned and not allow_fresh_start:
            raise CheckpointNotFoundError(
                f"{self.root}: no committed checkpoint, but {len(abandoned)} abandoned attempt(s) "
                f"{abandoned[:3]}; refusing a silent fresh start (pass allow_fresh_start=True)")
        return None

    def close(self) -> None:
        """Wait for in-flight saves and restore the signal handlers replaced."""
        try:
            self.wait()
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig, old in self._old_handlers.items():
                    signal.signal(sig, old)
            self._old_handlers.clear()
