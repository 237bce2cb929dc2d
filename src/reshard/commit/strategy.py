"""One commit strategy per store: what a store's capabilities imply for an attempt,
a publish, a listing, retention and gc, decided in one object chosen once per
store (after Orbax ``path/atomicity.py``, whose ``TemporaryPath`` has an
atomic-rename kind and a commit-file kind).

* :class:`RenameCommit` (``Capabilities.atomic_rename``: the local file
  system): an attempt is a directory of its own, ``<path>.incomplete-<id>/``,
  that the publish renames to ``<path>`` once its manifest is written and
  fsynced; whatever is set aside (a retired checkpoint, a quarantined one, a
  moved manifest, a record's temporary) is renamed, so nothing half-written
  is ever under a committed name.
* :class:`MarkerCommit` (object stores, ``memory://``): attempts write under
  the final prefix in keys that carry the attempt id
  (:mod:`reshard.commit.attempts`), and the manifest, put last with
  ``put_if_absent``, is the commit marker; what is set aside is copied or
  marked by a record. Where the store has conditional puts, the root's
  ``HEAD`` is replaced by compare-and-swap.

:func:`strategy_for` is the one place that reads ``atomic_rename``; every
pipeline (save, copy, tier copy, DCP conversion, listing, retention, gc) asks
the strategy, never the capabilities. The strategies hold no state: one
instance per kind of store, cached by the store's :class:`Capabilities`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..errors import CheckpointError
from ..ondisk.committed import _TMP, INCOMPLETE, QUARANTINE_MARK, QUARANTINED, RETIRED, is_leftover
from ..ondisk.manifest import MANIFEST_NAME, Manifest, decode_manifest, encode_sealed
from ..storage import Capabilities, Storage
from . import attempts

#: the coordinator's proof of an attempt's location: written into the attempt
#: before any data, read back by every rank, deleted before the manifest is
#: written (so a committed checkpoint holds only its manifest and data files)
ATTEMPT_NONCE = "attempt-nonce.json"

#: seconds: a record's temporary (``*.tmp-<id>``) younger than this is never
#: collected, whatever the grace: its writer renames it within one call
TMP_MIN_AGE_S = 60.0


class CommitStrategy(ABC):
    """How checkpoints are committed on one kind of store: every decision that
    depends on whether the store renames atomically, in one object.

    Attributes:
        kind: ``"rename"`` or ``"marker"``.
        shares_prefix: attempts write under the final prefix, so every key an
            attempt writes carries its id, a listing finds the attempts inside
            a checkpoint's prefix and gc collects them by their lease there.
        keeps_plan: the stored plan file (``plan.json``) may be written into
            the attempt (not where attempts share the prefix: one attempt's
            plan would be another's).
    """

    kind: ClassVar[str]
    shares_prefix: ClassVar[bool]
    keeps_plan: ClassVar[bool]

    # -- the attempt
    @abstractmethod
    def attempt_path(self, storage: Storage, path: str, attempt_id: str) -> str:
        """Where the attempt ``attempt_id`` at ``path`` writes."""

    @abstractmethod
    def data_name(self, attempt_id: str, name: str) -> str:
        """The name (inside the attempt) under which the attempt writes the
        plan's file ``name``."""

    @abstractmethod
    def name_files(self, manifest: Manifest, attempt_id: str) -> Manifest:
        """``manifest`` (planned with the plain file names) naming the data
        files by the keys the attempt ``attempt_id`` wrote them under
        (:meth:`data_name`), in ``files`` and in every chunk."""

    def nonce_key(self, storage: Storage, attempt: str, attempt_id: str) -> str:
        """Where the attempt's nonce (:data:`ATTEMPT_NONCE`) lives."""
        return storage.join(attempt, self.data_name(attempt_id, ATTEMPT_NONCE))

    @abstractmethod
    def attempt_lease(self, storage: Storage, path: str, attempt: str,
                      attempt_id: str) -> attempts.AttemptLease:
        """The coordinator's lease on the attempt (not started)."""

    @abstractmethod
    def discard(self, storage: Storage, attempt: str, attempt_id: str | None) -> None:
        """Remove a failed attempt: never a committed checkpoint, never
        another attempt's keys."""

    @abstractmethod
    def vanished(self, storage: Storage, attempt: str, path: str) -> bool:
        """The attempt was removed under the running save (and nothing was
        published at ``path``): a gc that ignored its lease, a person, a script."""

    # -- the publish
    @abstractmethod
    def check_target(self, storage: Storage, path: str, *, overwrite: bool) -> None:
        """Refuse to save at ``path`` what this commit cannot publish there."""

    @abstractmethod
    def publish(self, storage: Storage, attempt: str, path: str, manifest: Manifest, *,
                overwrite: bool, durable: bool) -> int:
        """Write the manifest last and make the attempt the checkpoint at
        ``path`` (files already confirmed, nonce deleted); returns the bytes of
        the manifest written."""

    @abstractmethod
    def prove_publish(self, storage: Storage, where: str) -> None:
        """Before a job takes a root: prove that the store honours what this
        commit relies on."""

    @abstractmethod
    def write_record(self, storage: Storage, path: str, record: dict[str, Any]) -> None:
        """Write a small JSON record beside the checkpoints: a reader sees the
        old record or the new one, never a torn one."""

    #: the root's ``HEAD`` is replaced by compare-and-swap (:func:`reshard.commit.listing.write_head`)
    swaps_head: bool = False

    # -- retention and gc
    @abstractmethod
    def manifest_aside(self, storage: Storage, mpath: str, aside: str) -> bytes:
        """Move the manifest ``mpath`` (the proof of the commit) to ``aside``;
        returns its bytes where :meth:`manifest_back` needs them."""

    @abstractmethod
    def manifest_back(self, storage: Storage, mpath: str, aside: str, raw: bytes) -> None:
        """Undo :meth:`manifest_aside` (a reader came meanwhile)."""

    @abstractmethod
    def drop_manifest(self, storage: Storage, mpath: str, aside: str) -> str | None:
        """Take the manifest away before an unconditional deletion; returns
        where it now is (to delete last), or None."""

    @abstractmethod
    def finish_deletion(self, storage: Storage, path: str, aside: str | None) -> None:
        """Delete the checkpoint at ``path`` whose manifest is gone (moved to ``aside``)."""

    @abstractmethod
    def quarantine(self, storage: Storage, root: str, name: str, record: dict[str, Any],
                   new_id: str) -> str:
        """Set ``root/name`` aside so that nothing lists, loads or deletes it;
        returns the name it now has."""

    @abstractmethod
    def collect_attempts(self, storage: Storage, root: str, *, grace_s: float,
                         inflight: set[str], dry_run: bool) -> tuple[list[str], dict[str, float]]:
        """gc of the attempts under ``root`` that never committed: returns
        what was (or would be) removed and the attempts in progress (name ->
        seconds since their lease was renewed; never removed)."""

    @abstractmethod
    def attempts_in_progress(self, storage: Storage, root: str, now: float) -> dict[str, float]:
        """Attempts under ``root`` whose lease is live: name -> seconds since
        it was renewed."""


class RenameCommit(CommitStrategy):
    """Atomic rename: an attempt is a sibling directory renamed into place."""

    kind = "rename"
    shares_prefix = False
    keeps_plan = True

    def attempt_path(self, storage: Storage, path: str, attempt_id: str) -> str:
        return f"{path}{INCOMPLETE}{attempt_id}"

    def data_name(self, attempt_id: str, name: str) -> str:
        return name

    def name_files(self, manifest: Manifest, attempt_id: str) -> Manifest:
        """``manifest`` itself: an attempt's directory holds the plain names."""
        return manifest

    def attempt_lease(self, storage: Storage, path: str, attempt: str,
                      attempt_id: str) -> attempts.AttemptLease:
        storage.makedirs(storage.parent(attempt) or "/")
        return attempts.AttemptLease(storage, path, attempt_id, key=attempts.local_lease_key(attempt))

    def discard(self, storage: Storage, attempt: str, attempt_id: str | None) -> None:
        storage.delete_tree(attempt)

    def vanished(self, storage: Storage, attempt: str, path: str) -> bool:
        return not storage.exists(attempt) and not storage.exists(storage.join(path, MANIFEST_NAME))

    def check_target(self, storage: Storage, path: str, *, overwrite: bool) -> None:
        """Anything at ``path`` that is not a committed checkpoint is never
        replaced, ``overwrite`` or not; a committed one only with ``overwrite``."""
        if not storage.exists(storage.join(path, MANIFEST_NAME)):
            if _non_empty(storage, path):
                raise FileExistsError(f"{path}: exists and is not a committed checkpoint; refusing to "
                                      "replace it (choose another path)")
            return
        _refuse_unless_overwrite(path, overwrite)

    def publish(self, storage: Storage, attempt: str, path: str, manifest: Manifest, *,
                overwrite: bool, durable: bool) -> int:
        """The manifest into the attempt (fsynced), then the attempt renamed
        to ``path``; with ``overwrite``, an existing checkpoint is moved aside
        first and deleted after."""
        raw = encode_sealed(manifest)
        storage.write_bytes(storage.join(attempt, MANIFEST_NAME), raw, durable=durable)
        if durable:
            storage.fsync_dir(attempt)
        retired = None
        if storage.exists(path) and not _non_empty(storage, path):
            storage.delete_tree(path)  # an empty directory the user made: take its place
        if storage.exists(path):
            if not overwrite or not storage.exists(storage.join(path, MANIFEST_NAME)):
                raise FileExistsError(f"{path}: appeared during the save and is not ours to replace")
            retired = f"{path}{RETIRED}{manifest.attempt_id}"
            storage.rename_dir(path, retired)
        storage.rename_dir(attempt, path)
        if durable:
            storage.fsync_dir(storage.parent(path) or "/")
        if retired is not None:
            storage.delete_tree(retired)
        return len(raw)

    def prove_publish(self, storage: Storage, where: str) -> None:
        """Nothing to prove: the file system's own rename."""

    def write_record(self, storage: Storage, path: str, record: dict[str, Any]) -> None:
        """A temporary file, fsynced, renamed over ``path``, the parent fsynced."""
        data = json.dumps(record, sort_keys=True).encode()
        tmp = f"{path}{_TMP}{os.urandom(4).hex()}"
        try:
            storage.write_bytes(tmp, data, durable=True)
            storage.rename_dir(tmp, path)  # os.rename: atomic for files as for directories
        except BaseException:
            storage.delete_tree(tmp)
            raise
        storage.fsync_dir(storage.parent(path) or "/")

    def manifest_aside(self, storage: Storage, mpath: str, aside: str) -> bytes:
        storage.rename_dir(mpath, aside)  # writes nothing: frees a full disk
        return b""

    def manifest_back(self, storage: Storage, mpath: str, aside: str, raw: bytes) -> None:
        storage.rename_dir(aside, mpath)

    def drop_manifest(self, storage: Storage, mpath: str, aside: str) -> str | None:
        try:
            storage.rename_dir(mpath, aside)
        except CheckpointError:
            if storage.exists(mpath):
                raise
            return None
        return aside

    def finish_deletion(self, storage: Storage, path: str, aside: str | None) -> None:
        """Renamed out of the committed namespace
        (``<name>.incomplete-deleting-<id>``), then deleted, then ``aside``."""
        doomed = f"{path}{INCOMPLETE}deleting-{os.urandom(4).hex()}"
        try:
            storage.rename_dir(path, doomed)
        except CheckpointError:
            if storage.exists(path):
                raise
            doomed = ""  # another deleter took it
        storage.fsync_dir(storage.parent(path) or "/")
        if aside is not None:
            storage.delete_tree(aside)
        if doomed:
            storage.delete_tree(doomed)

    def quarantine(self, storage: Storage, root: str, name: str, record: dict[str, Any],
                   new_id: str) -> str:
        """Renamed to ``<name>.quarantined-<id>``, its record beside it."""
        new = f"{name}{QUARANTINED}{new_id}"
        storage.rename_dir(storage.join(root, name), storage.join(root, new))
        self.write_record(storage, storage.join(root, new + QUARANTINE_MARK), record)
        return new

    def collect_attempts(self, storage: Storage, root: str, *, grace_s: float,
                         inflight: set[str], dry_run: bool) -> tuple[list[str], dict[str, float]]:
        """``*.incomplete-*`` attempts and ``*.retired-*`` leftovers older than
        ``grace_s`` (a deletion's leftover at once; never one in ``inflight``
        nor one whose lease is live) with their lease sidecars, then expired
        leases whose attempt is gone, then records' temporaries older than
        ``grace_s`` and :data:`TMP_MIN_AGE_S`."""
        now = time.time()
        live = self.attempts_in_progress(storage, root, now)
        out = []
        for name in _children(storage, root):
            p = storage.join(root, name)
            if not is_leftover(name) or storage.is_link(p):
                continue
            if name.split(INCOMPLETE, 1)[0] in inflight or name in live:
                continue
            # a deletion's leftover (``.incomplete-deleting-``) is never a running save: at once
            mtime = storage.modified_time(p)
            if mtime is not None and now - mtime < grace_s and f"{INCOMPLETE}deleting-" not in name:
                continue
            out.append(name)
            if not dry_run:
                storage.delete_tree(p)
                storage.delete_tree(attempts.local_lease_key(p))
        names = _children(storage, root)
        for child in names:  # an expired lease whose attempt is gone (its coordinator died)
            if INCOMPLETE not in child or not child.endswith(attempts.LEASE_SUFFIX):
                continue
            attempt = child[: -len(attempts.LEASE_SUFFIX)]
            if attempt in live or attempt in names:
                continue
            p = storage.join(root, child)
            if attempts.read_lease(storage, p, now) is None:
                out.append(child)
                if not dry_run:
                    storage.delete_tree(p)
        for child in names:
            if _TMP not in child:  # a record's temporary left by a SIGKILL (HEAD.tmp-..., ...)
                continue
            p = storage.join(root, child)
            mtime = storage.modified_time(p)
            # a live writer renames its temporary within one call: never one younger
            # than TMP_MIN_AGE_S, whatever the grace (gc --grace 0 beside a running job)
            if mtime is not None and now - mtime < max(grace_s, TMP_MIN_AGE_S):
                continue
            out.append(child)
            if not dry_run:
                storage.delete_tree(p)
        return out, live

    def attempts_in_progress(self, storage: Storage, root: str, now: float) -> dict[str, float]:
        """``step-%08d.incomplete-<id>`` directories with a live sidecar lease."""
        names = storage.list_dir(root) if storage.exists(root) else []
        out: dict[str, float] = {}
        suffix = attempts.LEASE_SUFFIX
        for child in names:
            if INCOMPLETE in child and not child.endswith(suffix) and child + suffix in names:
                age = attempts.read_lease(storage, storage.join(root, child + suffix), now)
                if age is not None:
                    out[child] = age
        return out


class MarkerCommit(CommitStrategy):
    """Manifest marker: attempts share the final prefix, the manifest put last
    only if absent is the commit.

    Args:
        swaps_head: the store's conditional puts are atomic
            (``Capabilities.conditional_put``): ``HEAD`` is compare-and-swapped.
    """

    kind = "marker"
    shares_prefix = True
    keeps_plan = False

    def __init__(self, *, swaps_head: bool) -> None:
        self.swaps_head = swaps_head

    def attempt_path(self, storage: Storage, path: str, attempt_id: str) -> str:
        return path

    def data_name(self, attempt_id: str, name: str) -> str:
        """``att-<attempt id>.<name>``: attempts at one step never share a key."""
        return attempts.data_name(attempt_id, name)

    def name_files(self, manifest: Manifest, attempt_id: str) -> Manifest:
        """Every data file renamed to ``att-<attempt id>.<name>``
        (:func:`reshard.commit.attempts.rename_files`)."""
        renamed: Manifest = attempts.rename_files(
            manifest, {n: self.data_name(attempt_id, n) for n in manifest.files})
        return renamed

    def attempt_lease(self, storage: Storage, path: str, attempt: str,
                      attempt_id: str) -> attempts.AttemptLease:
        return attempts.AttemptLease(storage, path, attempt_id)

    def discard(self, storage: Storage, attempt: str, attempt_id: str | None) -> None:
        """The keys (and open uploads) carrying ``attempt_id``
        (:func:`reshard.commit.attempts.discard`); without an id, the prefix
        unless a manifest is there."""
        if attempt_id is not None:
            attempts.discard(storage, attempt, attempt_id)
        elif not storage.exists(storage.join(attempt, MANIFEST_NAME)):
            storage.delete_tree(attempt)

    def vanished(self, storage: Storage, attempt: str, path: str) -> bool:
        return False  # a prefix is no directory: nothing to find removed

    def check_target(self, storage: Storage, path: str, *, overwrite: bool) -> None:
        """Other attempts' keys at ``path`` are no obstacle; a committed
        checkpoint is never replaced (no atomic replace: publish under a new step)."""
        if not storage.exists(storage.join(path, MANIFEST_NAME)):
            return
        _refuse_unless_overwrite(path, overwrite)
        raise CheckpointError(f"{path}: overwrite is refused on a store without atomic rename; "
                              "publish under a new step instead")

    def publish(self, storage: Storage, attempt: str, path: str, manifest: Manifest, *,
                overwrite: bool, durable: bool) -> int:
        """Put ``path/manifest.json`` only if absent (the data objects, named
        by the manifest, are already durable), then read it back.

        Raises:
            FileExistsError: another writer published this checkpoint first;
                this attempt's objects are not named by it and are discarded
                by the caller.
        """
        raw = encode_sealed(manifest)
        where = storage.join(path, MANIFEST_NAME)
        try:
            storage.put_if_absent(where, raw)
        except FileExistsError:
            raise FileExistsError(
                f"{path}: another writer published this checkpoint first (conditional put of "
                f"{MANIFEST_NAME} refused); attempt {manifest.attempt_id} published nothing "
                "(save under a new step)") from None
        # the publish relied on the conditional put: prove it, the manifest there is ours
        try:
            back = storage.read_bytes(where)
        except FileNotFoundError:
            back = b""
        if back != raw:
            try:
                other = decode_manifest(back, where=where).attempt_id if back else None
            except CheckpointError:
                other = "unreadable"
            raise FileExistsError(
                f"{path}: the manifest read back after publishing is not attempt {manifest.attempt_id}'s "
                f"(it is {'absent' if other is None else repr(other)}): another writer replaced it, "
                "the store did not honour the conditional put; this save is not committed") from None
        return len(raw)

    def prove_publish(self, storage: Storage, where: str) -> None:
        storage.check_publish(where)

    def write_record(self, storage: Storage, path: str, record: dict[str, Any]) -> None:
        """A plain put: whole-object writes are atomic there."""
        storage.write_bytes(path, json.dumps(record, sort_keys=True).encode())

    def manifest_aside(self, storage: Storage, mpath: str, aside: str) -> bytes:
        raw = storage.read_bytes(mpath)
        storage.write_bytes(aside, raw)
        storage.delete_tree(mpath)
        return raw

    def manifest_back(self, storage: Storage, mpath: str, aside: str, raw: bytes) -> None:
        storage.put_if_absent(mpath, raw)
        storage.delete_tree(aside)

    def drop_manifest(self, storage: Storage, mpath: str, aside: str) -> str | None:
        if storage.exists(mpath):
            storage.delete_tree(mpath)
        return None

    def finish_deletion(self, storage: Storage, path: str, aside: str | None) -> None:
        storage.delete_tree(path)
        if aside is not None:
            storage.delete_tree(aside)

    def quarantine(self, storage: Storage, root: str, name: str, record: dict[str, Any],
                   new_id: str) -> str:
        """Kept in place, marked by ``<name>.quarantined.json``."""
        self.write_record(storage, storage.join(root, name + QUARANTINE_MARK), record)
        return name

    def collect_attempts(self, storage: Storage, root: str, *, grace_s: float,
                         inflight: set[str], dry_run: bool) -> tuple[list[str], dict[str, float]]:
        """The attempts whose lease has expired and their open multipart
        uploads (:func:`reshard.commit.attempts.gc_root`): ``<checkpoint>/<attempt id>``."""
        got = attempts.gc_root(storage, root, grace_s=grace_s, dry_run=dry_run)
        return list(got.attempts), dict(got.in_progress)

    def attempts_in_progress(self, storage: Storage, root: str, now: float) -> dict[str, float]:
        """``<checkpoint>/<attempt id>`` of the attempts with a live lease under their prefix."""
        return dict(attempts.gc_root(storage, root, grace_s=math.inf, dry_run=True).in_progress)


def strategy_for(storage: Storage) -> CommitStrategy:
    """The commit strategy of ``storage``, chosen by its capabilities (the one
    place that reads ``atomic_rename``): one shared instance per kind."""
    return _for_capabilities(storage.capabilities)


@functools.cache
def _for_capabilities(caps: Capabilities) -> CommitStrategy:
    if caps.atomic_rename:
        return RenameCommit()
    return MarkerCommit(swaps_head=caps.conditional_put)


def write_record(storage: Storage, path: str, record: dict[str, Any]) -> None:
    """Write a small JSON record durably, atomically as the store allows (the
    one place such records are written): :meth:`CommitStrategy.write_record`."""
    strategy_for(storage).write_record(storage, path, record)


def _refuse_unless_overwrite(path: str, overwrite: bool) -> None:
    if not overwrite:
        raise FileExistsError(f"{path}: a committed checkpoint is already there "
                              "(pass SaveOptions(overwrite=True) to replace it)")


def _non_empty(storage: Storage, path: str) -> bool:
    """``path`` exists and is a file or a directory with entries."""
    if not storage.exists(path):
        return False
    try:
        return bool(storage.list_dir(path))
    except (NotADirectoryError, FileNotFoundError):
        return True


def _children(storage: Storage, root: str) -> list[str]:
    try:
        return storage.list_dir(root) if storage.exists(root) else []
    except (FileNotFoundError, NotADirectoryError):
        return []
