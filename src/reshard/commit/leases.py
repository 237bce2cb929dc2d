"""Reader leases: a reader (a load, verify, export, conversion, diff, an
evaluation's pin) holds a lease on the checkpoint it reads for as long as it
reads, renewed by one keeper thread per process, and retention and gc never
delete a checkpoint with a live one (DESIGN.md section 1: "readers hold
leases"; the seed: before deleting, confirm that no reader still uses it).

A lease is a small JSON record beside the checkpoint (never inside it):
``<parent>/<name>.lease-<pid>-<random>.json`` = ``{"expires", "renewed",
"ttl_s", "pid", "host", "what"}`` (epoch seconds), on every backend (a local
file, an S3 object, a ``memory://`` key). It is live while ``expires`` is in
the future and, when its holder ran on this host, while that process lives
(a killed reader's lease ends with it; on another host it ends at
``expires``). One lease per load group: the coordinator takes it, not every
rank.

A deleter (:func:`reshard.commit.protocol.retire_checkpoint`) and a reader
never both believe they own a checkpoint: the deleter looks for live leases,
takes the checkpoint out of the committed namespace (its manifest first),
looks again, and puts it back if a lease appeared; the reader writes its
lease, then reads the manifest, and when the manifest is gone while a
deletion is in flight waits (at most :data:`CONFIRM_WAIT_S`) for the
deleter's second look to put it back. So a reader that read the manifest
after its lease was written never loses a file to retention or gc.

Where the lease cannot be written (a read-only mount, read-only credentials,
a full disk) the reader warns once per root and reads unprotected, unless it
asked for the lease (``required``: then it raises).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from ..ondisk.manifest import MANIFEST_NAME
from ..storage import Storage

log = logging.getLogger("reshard.commit.leases")

#: the infix of a reader lease's name: ``<checkpoint name>.lease-<id>.json``
LEASE = ".lease-"
#: the suffix of the record a deletion leaves while it checks for readers
#: (``<name>.deleting-<id>.json``: the manifest, moved aside on a local root)
DELETING = ".deleting-"
#: seconds a reader whose checkpoint's manifest is gone waits for an
#: in-flight deletion to put it back (the deleter's second look takes milliseconds)
CONFIRM_WAIT_S = 2.0


def reader_ttl_s() -> float:
    """Seconds a reader lease lasts unless renewed: ``RESHARD_LEASE_TTL_S``
    if set, else 60 (as an attempt's lease)."""
    from .attempts import lease_ttl_s

    return lease_ttl_s()


# --------------------------------------------------------------------------- the keeper


class _Keeper:
    """One daemon thread per process renewing every registered lease at a
    third of its ttl (reader leases here, owner leases in
    :mod:`reshard.commit.ownership`). A lease's ``_renew()`` never raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[int, Any] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: Any) -> None:
        with self._lock:
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name="reshard-leases")
                self._thread.start()
        self._wake.set()

    def remove(self, lease: Any) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                leases = list(self._leases.values())
            now = time.monotonic()
            due = [x for x in leases if now >= x.next_renew]
            for x in due:
                x._renew()
            with self._lock:
                nxt = min((x.next_renew for x in self._leases.values()), default=now + 5.0)
            self._wake.wait(max(0.05, min(5.0, nxt - time.monotonic())))
            self._wake.clear()

    def _after_fork(self) -> None:  # a forked child renews nothing of its parent's
        self._lock = threading.Lock()
        self._leases = {}
        self._thread = None
        self._wake = threading.Event()


KEEPER = _Keeper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=KEEPER._after_fork)


# --------------------------------------------------------------------------- reader leases


_WARNED: set[str] = set()  # roots whose unwritable lease was warned about (once per root)
#: names of this process's reader leases that were released but could not be
#: deleted (EIO, a full disk): over, whatever they say (gc removes them)
_ENDED: set[str] = set()


def lease_name(name: str) -> str:
    """A fresh reader lease's key name for the checkpoint called ``name``."""
    return f"{name}{LEASE}{os.getpid()}-{os.urandom(4).hex()}.json"


def _where(storage: Storage, path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    return storage.parent(path), storage.basename(path)


class ReaderLease:
    """A reader's renewed lease on the checkpoint at ``path`` (use
    :func:`reader_lease`).

    Attributes:
        path: the checkpoint.
        key: the lease record (None before :meth:`acquire`, or when it could not be written).
        held: the lease is written and renewed.
        why_not: why it is not held (the store's error), when it is not.
        renewals: renewals so far.
    """

    def __init__(self, storage: Storage, path: str, *, what: str = "read", ttl_s: float | None = None):
        self.storage, self.path, self.what = storage, path.rstrip("/"), what
        self.ttl_s = reader_ttl_s() if ttl_s is None else float(ttl_s)
        self.key: str | None = None
        self.held = False
        self.why_not: str | None = None
        self.renewals = 0
        self.next_renew = float("inf")
        # a renewal in flight and a release never overlap: a renewal that wrote the file after
        # the release deleted it left a lease on a checkpoint nothing reads (until it expired)
        self._io = threading.Lock()

    def _record(self) -> bytes:
        now = time.time()
        return json.dumps({"expires": now + self.ttl_s, "renewed": now, "ttl_s": self.ttl_s,
                           "pid": os.getpid(), "host": socket.gethostname(),
                           "what": self.what[:200]}).encode()

    def acquire(self, *, required: bool = False,
                refusal: str = "refusing to read unprotected (LoadOptions(require_lease=True))",
                ) -> ReaderLease:
        """Write the lease and start renewing it. ``refusal``: what the error
        of a ``required`` lease that could not be written says after the
        store's error (which option asked for the lease).

        Raises:
            CheckpointError: ``required`` and the lease could not be written.
        """
        root, name = _where(self.storage, self.path)
        if not name:
            return self
        self.key = self.storage.join(root, lease_name(name))
        try:
            self.storage.write_bytes(self.key, self._record(), durable=False)
        except (CheckpointError, OSError) as e:
            self.key, self.why_not = None, f"{type(e).__name__}: {e}"
            msg = (f"{self.path}: the reader lease could not be written ({self.why_not}); "
                   "reading unprotected: retention or gc may delete this checkpoint while it is read")
            if required:
                raise CheckpointError(f"{msg.split(';')[0]}; {refusal}") from e
            if root not in _WARNED:
                _WARNED.add(root)
                log.warning("%s (warned once per root)", msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=4)
            return self
        self.held = True
        self.next_renew = time.monotonic() + self.ttl_s / 3
        KEEPER.add(self)
        return self

    def _renew(self) -> None:
        self.next_renew = time.monotonic() + self.ttl_s / 3
        with self._io:
            key = self.key
            if key is None:  # released meanwhile
                return
            try:
                self.storage.write_bytes(key, self._record(), durable=False)
                self.renewals += 1
            except Exception as e:  # noqa: BLE001 - a lapse only makes the checkpoint deletable
                log.warning("renewing the reader lease %s failed: %s", key, e)

    def confirm(self) -> None:
        """After the lease is written: when the checkpoint's manifest is gone
        while a deletion is in flight (its manifest moved aside), wait up to :data:`CONFIRM_WAIT_S` for
        the deleter to see this lease and put it back. Returns at once when
        the manifest is there or nothing is being deleted (the caller's own
        read then reports what it finds)."""
        if not self.held:
            return
        st = self.storage
        mpath = st.join(self.path, MANIFEST_NAME)
        try:
            if st.exists(mpath) or not _deleting(st, self.path):
                return
        except (CheckpointError, OSError):
            return
        deadline = time.monotonic() + CONFIRM_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.02)
            try:
                if st.exists(mpath):
                    return
                if not _deleting(st, self.path):
                    return
            except (CheckpointError, OSError):
                return

    def release(self) -> None:
        """Stop renewing and delete the lease (an error is logged: an
        unrenewed lease expires by itself)."""
        KEEPER.remove(self)
        self.next_renew = float("inf")
        with self._io:  # after a renewal in flight, which must not write the file back
            if self.key is None:
                return
            key, self.key, self.held = self.key, None, False
            try:
                self.storage.delete_tree(key)
            except Exception as e:  # noqa: BLE001
                _ENDED.add(self.storage.basename(key))  # over now: no deleter waits for it, gc removes it
                log.warning("deleting the reader lease %s failed (it counts as released): %s", key, e)


def _deleting(st: Storage, path: str) -> bool:
    """A deletion of the checkpoint at ``path`` may be in flight: its
    manifest was moved aside (``<name>.deleting-*.json`` beside it)."""
    root, name = _where(st, path)
    try:
        return any(n.startswith(name + DELETING) for n in st.list_dir(root))
    except (FileNotFoundError, NotADirectoryError):
        return False


@contextlib.contextmanager
def reader_lease(storage: Storage, path: str, *, what: str = "read", ttl_s: float | None = None,
                 required: bool = False, refusal: str | None = None) -> Iterator[ReaderLease]:
    """Hold a reader lease on the checkpoint at ``path`` (a key of
    ``storage``) for the block: written before the block reads anything,
    renewed every ``ttl_s / 3`` seconds (default :func:`reader_ttl_s`),
    deleted after it. Retention and gc keep the checkpoint while the lease is
    live. Where the lease cannot be written the block runs unprotected after
    one warning per root, unless ``required`` (``refusal``: the end of that
    error, see :meth:`ReaderLease.acquire`).

    Raises:
        CheckpointError: ``required`` and the lease could not be written.
    """
    kw = {} if refusal is None else {"refusal": refusal}
    lease = ReaderLease(storage, path, what=what, ttl_s=ttl_s).acquire(required=required, **kw)
    try:
        lease.confirm()
        yield lease
    finally:
        lease.release()


def _alive(rec: dict[str, Any], now: float, name: str = "") -> bool:
    from .attempts import _pid_alive

    if name in _ENDED and rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname():
        return False
    try:
        if float(rec.get("expires", 0)) <= now:
            return False
    except (TypeError, ValueError):
        return False
    return not (rec.get("host") == socket.gethostname() and not _pid_alive(rec.get("pid")))


def live_readers(storage: Storage, root: str, names: Any = None,
                 now: float | None = None) -> dict[str, int]:
    """Checkpoint name -> number of live reader leases on it, among the
    children of ``root`` (only ``names`` when given). Unreadable lease
    records are not counted (a record is written whole)."""
    from ..ondisk.committed import read_record

    now = time.time() if now is None else now
    try:
        children = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out: dict[str, int] = {}
    for child in children:
        if LEASE not in child or not child.endswith(".json"):
            continue
        base = child.split(LEASE, 1)[0]
        if names is not None and base not in names:
            continue
        rec = read_record(storage, storage.join(root, child))
        if rec is not None and _alive(rec, now, child):
            out[base] = out.get(base, 0) + 1
    return out


def expired_leases(storage: Storage, root: str, now: float | None = None) -> list[str]:
    """Keys of reader lease records under ``root`` that are no longer live
    (expired, or their holder on this host is dead): left by killed readers,
    for gc to remove."""
    from ..ondisk.committed import read_record

    now = time.time() if now is None else now
    try:
        children = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for child in children:
        if LEASE in child and child.endswith(".json") and ".lease.json" not in child:
            key = storage.join(root, child)
            rec = read_record(storage, key)
            if rec is None:
                mtime = storage.modified_time(key)
                if mtime is not None and now - mtime < reader_ttl_s():
                    continue  # being written, or unreadable but young
            elif _alive(rec, now, child):
                continue
            out.append(key)
    return out


def pin_finalizer(obj: Any, lease: ReaderLease) -> None:
    """Release ``lease`` when ``obj`` is garbage-collected."""
    weakref.finalize(obj, lease.release)


@contextlib.contextmanager
def pin(path: str | os.PathLike[str], *, ttl_s: float | None = None, storage: Storage | None = None,
        required: bool = True, what: str = "pin") -> Iterator[ReaderLease]:
    """Pin the checkpoint at ``path`` for a longer task (an evaluation, an
    export by hand, a copy to another store): a reader lease held and
    renewed (every ``ttl_s / 3`` seconds; default :func:`reader_ttl_s`) for
    the block, so no retention or gc deletes the checkpoint meanwhile (they
    report it "in use by N readers" and delete it once released). A pinning
    process that dies releases it by dying (on its host at once, elsewhere
    after ``ttl_s``).

    Example::

        with reshard.pin(path) as lease:
            evaluate(lease.path)

    The checkpoint must be there once the lease is written (a reshard
    manifest, or a DCP ``.metadata``): one deleted meanwhile (say between
    :func:`reshard.latest` and ``pin``) is an error, never a pin of nothing.

    The newest checkpoint of a root a job keeps pruning is pinned with
    :func:`reshard.pin_latest` (``pin(latest(root))`` leaves a gap in which
    retention may delete the checkpoint before the lease is written).

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path`` (the lease is
            deleted again).
        CheckpointError: ``required`` (the default) and the lease could not
            be written (a read-only mount or credentials, a full disk).
    """
    from ..storage import resolve

    st, key = resolve(path, storage)
    with held_checkpoint(st, key, what=what, ttl_s=ttl_s, required=required,
                         refusal="refusing to pin it unprotected (reshard.pin(required=False) goes on "
                                 "without a lease)") as lease:
        yield lease


@contextlib.contextmanager
def held_checkpoint(st: Storage, key: str, *, what: str, refusal: str, ttl_s: float | None = None,
                    required: bool = True) -> Iterator[ReaderLease]:
    """:func:`reader_lease` on a checkpoint that must be there once the lease
    is confirmed (a reshard manifest or a DCP ``.metadata``): what
    :func:`pin` and ``CheckpointManager.lease`` hold.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``key`` (the lease is
            deleted again), also where the lease could not be written.
        CheckpointError: ``required`` and the lease could not be written
            (``refusal``: the end of that error).
    """
    with contextlib.ExitStack() as stack:
        try:
            lease = stack.enter_context(reader_lease(st, key, what=what, ttl_s=ttl_s, required=required,
                                                     refusal=refusal))
        except CheckpointError as e:  # a missing root, say: say what is missing
            if not isinstance(e, CheckpointNotFoundError) and not _present(st, key):
                raise _not_there(st, key) from e
            raise
        if not _present(st, key):  # after confirm(): a deletion in flight has settled
            raise _not_there(st, key)
        yield lease


def _present(st: Storage, key: str) -> bool:
    """The checkpoint ``key`` is there: its manifest, or a DCP ``.metadata``."""
    from ..ondisk.dcp_metadata import DCP_METADATA

    return st.exists(st.join(key, MANIFEST_NAME)) or st.exists(st.join(key, DCP_METADATA))


def _not_there(st: Storage, key: str) -> CheckpointNotFoundError:
    """The error of a pin or lease of ``key`` where no checkpoint is."""
    return CheckpointNotFoundError(f"{st.url(key)}: no checkpoint to pin (no {MANIFEST_NAME} here: "
                                   "never committed, or deleted, e.g. by retention)")
