"""Retention, leases and garbage collection of :class:`reshard.CheckpointManager`
(a mixin of it: the manager's public methods ``lease``, ``candidates``,
``plan_retention``, ``apply_retention``, ``gc_abandoned`` and
``attempts_in_progress`` live here).

Sidecars beside the checkpoints: ``<name>.lease-<id>.json`` (a reader holds
the checkpoint until ``expires``: :mod:`reshard.commit.leases`); attempts
hold their own leases (:mod:`reshard.commit.attempts`).

Deleting a committed checkpoint happens in one method,
:meth:`RetentionMixin._delete_checkpoint`, for all three paths (retention
after a save, the deletion before a save that would not fit, ``reshard
gc``); it calls :func:`reshard.commit.protocol.retire_checkpoint`, which
refuses a checkpoint a reader holds. Nothing is written before the
deletions: verification records made while deciding are written after
them (``_deferred``), so retention frees a full disk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..commit import ownership
from ..commit.leases import LEASE as _READER_LEASE
from ..commit.leases import expired_leases, held_checkpoint, live_readers
from ..commit.lineage import Head, lineage_of
from ..commit.protocol import (
    DELETED,
    Entry,
    committed,
    finish_interrupted,
    linked_children,
    read_head,
    retire_checkpoint,
)
from ..commit.retention import Candidate, Decision, Policy, decide
from ..commit.strategy import TMP_MIN_AGE_S, strategy_for  # noqa: F401 - TMP_MIN_AGE_S re-exported

if TYPE_CHECKING:
    from ..saving.staging import SaveHandle
    from ..storage import Storage

log = logging.getLogger("reshard.manager.manager")

LEASE = _READER_LEASE


@dataclass(frozen=True, kw_only=True)
class RetentionPlan:
    """What retention will delete, and the checks made to decide it.

    Attributes:
        decision: keep (with reasons) and delete.
        checks: (name, what was checked, passed) in the order they ran.
    """

    decision: Decision
    checks: tuple[tuple[str, str, bool], ...] = ()


class RetentionMixin:
    """What :class:`reshard.CheckpointManager` does to decide and apply
    retention, hold leases and collect abandoned attempts. The manager
    provides the attributes below and ``verify_checkpoint``/``is_verified``/``_name``."""

    storage: Storage
    root: str
    policy: Policy
    gc_grace_s: float
    checksum_before_delete: bool
    last_plan: RetentionPlan | None
    last_in_progress: dict[str, float]
    #: what the last apply_retention did with each checkpoint it was to delete:
    #: "deleted", "already removed" (another deleter), "in use by N readers"
    last_outcomes: dict[str, str]
    _pending: list[tuple[str, SaveHandle]]
    #: verification records decided before deletions, written after them
    _deferred: list[Any]
    #: what the last gc_abandoned removed beside the attempts: finished
    #: interrupted deletions, expired reader leases, orphan verification records
    last_litter: list[str]

    smoke_tensors: int
    #: True while a closing manager applies its last retention: the resume
    #: source is no longer pinned for its run (:meth:`source_pinned`)
    _releasing_source: bool = False

    if TYPE_CHECKING:  # provided by CheckpointManager
        def _name(self, which: str | int) -> str: ...

        def verify_checkpoint(self, which: str | int, *, how: str = "smoke",
                              record: bool = True) -> bool: ...

        def is_verified(self, name: str, entry: Entry | None = None) -> bool: ...

        def _verified_path(self, name: str) -> str: ...

    # ------------------------------------------------------------ leases
    @contextlib.contextmanager
    def lease(self, step: int | str, ttl_s: float = 3600.0) -> Iterator[str]:
        """Hold checkpoint ``step`` (a step or a name) against retention and
        gc while reading it (export, conversion, a tier copy, an evaluation):
        a reader lease (:mod:`reshard.commit.leases`) renewed every
        ``ttl_s / 3`` seconds while the block runs, deleted after it. Yields
        its path.

        Raises:
            CheckpointNotFoundError: no checkpoint ``step`` is there (never
                committed, or deleted before the lease held it); no lease is left.
            CheckpointError: the lease could not be written."""
        name = self._name(step)
        path = self.storage.join(self.root, name)
        with held_checkpoint(self.storage, path, what="CheckpointManager.lease", ttl_s=ttl_s,
                             refusal="refusing to hold it unprotected"):
            yield path

    def _leased(self, names: set[str]) -> set[str]:
        return set(live_readers(self.storage, self.root, names))

    def _linked(self, names: set[str]) -> set[str]:
        """The checkpoints a symbolic link in the root points at (an operator's
        ``best -> step-00000300``): retention keeps them, as it keeps a leased
        one, so the link never dangles."""
        st = self.storage
        where = {st.canonical(st.join(self.root, n)): n for n in names}
        return {where[t] for link in linked_children(st, self.root)
                if (t := st.canonical(st.join(self.root, link))) in where}

    # ------------------------------------------------------------ retention
    def candidates(self, entries: list[Entry] | None = None) -> list[Candidate]:
        """Retention's view of the committed checkpoints (lineage from HEAD,
        verification records re-checked, leases, in-flight saves and the
        targets of symbolic links in the root)."""
        entries = committed(self.storage, self.root) if entries is None else entries
        head = Head.from_record(read_head(self.storage, self.root))
        lin = lineage_of(entries, head)
        pinned = lin.source is not None and self.source_pinned(head)
        readers = live_readers(self.storage, self.root, {e.name for e in entries})
        linked = self._linked({e.name for e in entries})
        inflight = {n for n, _ in self._pending}
        # this run's newest save (not its resume source) is never deleted by its own retention,
        # whatever the step of a checkpoint it joined the lineage of
        own = getattr(self, "_last_committed", None)
        if own is not None and own == getattr(self, "_resumed_from", None):
            own = None
        out = []
        for e in entries:
            m = e.manifest
            assert m is not None
            metric = m.extra.get("metric")
            out.append(Candidate(name=e.name, step=m.step if m.step is not None else -1,
                                 verified=self.is_verified(e.name, e),
                                 metric=float(metric) if isinstance(metric, (int, float)) else None,
                                 protected=e.name in linked or e.name in inflight or e.name == own,
                                 readers=readers.get(e.name, 0),
                                 current=e.name in lin.current,
                                 resume_source=pinned and e.name == lin.source,
                                 created_at=m.created_at))
        return out

    def source_pinned(self, head: Head | None) -> bool:
        """Whether retention keeps the checkpoint ``head`` names (the resume
        source): only while a run that resumed from it is alive, for that run's
        way back (a rollback from a rollback). Alive: the root's owner lease is
        live (not released by ``close``, not expired, its process alive when on
        this host) and is the lease of the run that wrote ``head`` (any live
        owner when ``head`` names none). A run that ended or died pins nothing,
        and neither does this manager once it is closing (its last retention)."""
        if head is None or head.name is None:
            return False
        if self._releasing_source:
            return False
        rec, _ = ownership.read_owner(self.storage, self.root)
        if not ownership.is_live(rec):
            return False
        assert rec is not None
        return head.owner is None or rec.get("lease") == head.owner

    def plan_retention(self, *, checksums: bool | None = None, smoke_newer: bool = False,
                       dry_run: bool = False) -> RetentionPlan:
        """What retention deletes, after the checks that make it safe; the
        same code path for a dry run (which records and deletes nothing).

        ``smoke_newer``: first smoke-test the checkpoints newer than the
        newest verified one (``reshard gc``). Then, whenever the decision
        deletes a checkpoint that verifies and at most one verified
        checkpoint of the current lineage would remain, that one is verified
        again (every checksum unless ``checksums`` is False, the manager's
        ``checksum_before_delete`` by default); if it fails, it counts as
        unverified and the decision is made again."""
        full = self.checksum_before_delete if checksums is None else checksums
        cands = {c.name: c for c in self.candidates()}
        checks: list[tuple[str, str, bool]] = []
        if smoke_newer:
            newest = max((c.step for c in cands.values() if c.verified and c.current), default=None)
            for c in sorted(cands.values(), key=lambda c: (c.step, c.created_at)):
                if not c.verified and (newest is None or c.step > newest):
                    ok = self._verify_deferred(c.name, "smoke", dry_run)
                    checks.append((c.name, "smoke test", ok))
                    cands[c.name] = replace(c, verified=ok)
        rechecked: set[str] = set()
        while True:
            d = decide(list(cands.values()), self.policy)
            gone_verified = [n for n in d.delete if cands[n].verified]
            left = [c for c in cands.values() if c.verified and c.current and c.name in d.keep]
            if not gone_verified or len(left) != 1 or left[0].name in rechecked:
                return RetentionPlan(decision=d, checks=tuple(checks))
            kept = left[0].name
            rechecked.add(kept)
            ok = self._verify_deferred(kept, "checksums" if full else "structure", dry_run)
            checks.append((kept, "verified again with checksums" if full
                           else "verified again (structure and sizes)", ok))
            if not ok:
                log.warning("retention: %s failed its verification; keeping older checkpoints", kept)
                cands[kept] = replace(cands[kept], verified=False)

    def _verify_deferred(self, name: str, how: str, dry_run: bool) -> bool:
        """:meth:`verify_checkpoint` whose record is written after the
        deletions (``_deferred``), never before: a full disk must not stop
        retention from freeing it."""
        from ..catalog.records import check_and_record

        deferred = getattr(self, "_deferred", None)
        return check_and_record(self.storage, self.root, name, smoke_tensors=self.smoke_tensors,
                                how=how, record=not dry_run, deferred=deferred)

    def apply_retention(self, *, dry_run: bool = False, checksums: bool | None = None,
                        smoke_newer: bool = False, allowed: set[str] | None = None) -> Decision:
        """Delete what the policy no longer keeps (coordinator only), after
        the checks of :meth:`plan_retention`. Nothing is written before the
        deletions (verification records made while deciding are written
        after them), so retention frees a full disk. ``allowed``: delete
        only these names (``reshard gc`` beside a live owner: what the
        owner's retention would delete too). :attr:`last_outcomes` says what
        became of each: "deleted", "already removed", "in use by N readers".
        """
        self._deferred = []
        try:
            plan = self.plan_retention(checksums=checksums, smoke_newer=smoke_newer, dry_run=dry_run)
            self.last_plan = plan
            self.last_outcomes = {}
            if not dry_run:
                for name in plan.decision.delete:
                    if allowed is not None and name not in allowed:
                        continue
                    log.info("retention: deleting %s", name)
                    self.last_outcomes[name] = out = self._delete_checkpoint(name)
                    if out != DELETED:
                        log.info("retention: %s not deleted: %s", name, out)
        finally:
            self._write_deferred()
        return plan.decision

    def _write_deferred(self) -> None:
        """Write the verification records decided while retention ran (after
        its deletions freed space); one that still fails is logged: the
        checkpoint stays unverified, which only keeps older ones."""
        from ..catalog.records import write_outcome

        todo, self._deferred = list(getattr(self, "_deferred", [])), []
        for name, kw in todo:
            if not self.storage.exists(self.storage.join(self.root, name)):
                continue
            try:
                write_outcome(self.storage, self.root, name, **kw)
            except Exception as e:  # noqa: BLE001 - the outcome stands; the record is a cache
                log.warning("the verification record of %s could not be written: %s", name, e)

    def _delete_checkpoint(self, name: str) -> str:
        """Delete the committed checkpoint ``name``: the one call site of every
        deletion of a committed checkpoint (retention after a save, the
        deletion before a save that would not fit, ``reshard gc``), so a
        rule about what may be deleted is applied here once
        (:func:`reshard.commit.protocol.retire_checkpoint`: never one a live
        reader lease holds; manifest moved aside first, checked for readers
        again, then renamed out of the committed namespace and deleted;
        nothing written first, so it frees a full disk; :meth:`gc_abandoned`
        finishes an interrupted deletion). Its verification record goes after
        it (a record left by an interruption is collected by gc).

        Returns:
            "deleted", "already removed" (another deleter was first) or
            "in use by N readers" (kept)."""
        out = retire_checkpoint(self.storage, self.root, name)
        if out == DELETED:
            self.storage.delete_tree(self._verified_path(name))
        return out

    def gc_abandoned(self, grace_s: float | None = None, *, dry_run: bool = False) -> list[str]:
        """Delete ``*.incomplete-*`` attempts, ``*.retired-*`` leftovers
        (an overwrite's or a retention's interrupted deletion) and records'
        temporaries (``HEAD.tmp-*``: a write killed before its rename) older than
        ``grace_s`` seconds (temporaries: and older than :data:`TMP_MIN_AGE_S`,
        so a running job's record being written is never taken) (never one of this manager's in-flight saves,
        never an attempt whose lease is live, whatever ``grace_s``: those are
        in :attr:`last_in_progress`; never a quarantined checkpoint), and
        expired leases whose attempt is gone. On a store without atomic rename
        (S3): the attempts whose lease has expired, and their open multipart
        uploads (:func:`reshard.commit.attempts.gc_root`); returns ``<checkpoint>/<attempt
        id>`` names. Which of the two is the store's commit strategy's
        (:meth:`reshard.commit.strategy.CommitStrategy.collect_attempts`)."""
        grace = self.gc_grace_s if grace_s is None else grace_s
        removed, self.last_in_progress = strategy_for(self.storage).collect_attempts(
            self.storage, self.root, grace_s=grace, inflight=set(self._pending_names()), dry_run=dry_run)
        self.last_litter = self._gc_records(dry_run)
        return removed

    def _gc_records(self, dry_run: bool) -> list[str]:
        """The litter of interrupted work, beside the checkpoints: a deletion
        interrupted after its manifest was moved aside (finished:
        :func:`reshard.commit.protocol.finish_interrupted`), reader leases
        that are over (a killed reader's), verification records whose
        checkpoint is gone. Returns the names removed."""
        from ..catalog.records import VERIFIED

        st = self.storage
        try:
            names = st.list_dir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = finish_interrupted(st, self.root, names, dry_run=dry_run)
        for key in expired_leases(st, self.root):
            out.append(st.basename(key))
            if not dry_run:
                st.delete_tree(key)
        present = set(names)
        for child in names:
            if child.endswith(VERIFIED) and child[: -len(VERIFIED)] not in present:
                out.append(child)
                if not dry_run:
                    st.delete_tree(st.join(self.root, child))
        return out

    def attempts_in_progress(self, now: float | None = None) -> dict[str, float]:
        """Attempts under the root whose lease is live (a save is running):
        name (``step-%08d.incomplete-<id>``, or ``<checkpoint>/<attempt id>``
        where attempts share the final prefix) -> seconds since the lease was
        renewed. gc and retention never delete these, whatever the grace."""
        now = time.time() if now is None else now
        return strategy_for(self.storage).attempts_in_progress(self.storage, self.root, now)

    def _pending_names(self) -> list[str]:
        return [n for n, _ in self._pending]
