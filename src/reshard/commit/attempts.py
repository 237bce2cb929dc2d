"""Attempts on stores without atomic rename (S3, ``memory://``).

There an attempt writes under the final prefix ``<path>/`` directly, so the
attempt id is part of every key it writes: data objects are
``att-<attempt id>.data-r00000-0.safetensors`` and its lease is
``att-<attempt id>.lease.json``. Two attempts at one step never share a key;
``manifest.json`` is written last with a conditional put (``If-None-Match:
*``), so exactly one attempt publishes, and the manifest names only the
winner's objects. A prefix without a valid manifest is never a checkpoint.

Leases (every backend): while a save runs, its coordinator holds a lease on
its attempt (``{"attempt": id, "expires": epoch seconds, "renewed": epoch
seconds}``), written before the attempt is created and renewed every
``ttl/3`` seconds by a background thread. Here it is the key
``att-<attempt id>.lease.json``; where rename is atomic (local) it is the
sidecar ``<attempt directory>.lease.json`` beside the attempt (outside the
committed namespace, deleted after the rename), see :func:`local_lease_key`.
Garbage collection never deletes an attempt with a live lease, whatever its
grace period. :func:`gc_root` deletes only the objects of
attempts that are not the published one and whose lease has expired (or,
without a lease, whose newest object is older than the grace period), and
aborts their open multipart uploads.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..ondisk.manifest import MANIFEST_NAME
from ..planning.planner import SavePlan
from ..storage import Storage

log = logging.getLogger("reshard.commit.attempts")

PREFIX = "att-"
LEASE_SUFFIX = ".lease.json"
DEFAULT_LEASE_TTL_S = 60.0


def lease_ttl_s() -> float:
    """Seconds a lease lasts unless renewed: ``RESHARD_LEASE_TTL_S`` if set
    (a test or a fault matrix that must see a killed job's lease expire),
    else :data:`DEFAULT_LEASE_TTL_S`."""
    v = os.environ.get("RESHARD_LEASE_TTL_S")
    return float(v) if v else DEFAULT_LEASE_TTL_S


def data_name(attempt_id: str, name: str) -> str:
    """The key name (inside the checkpoint) of an attempt's data file."""
    if "." in attempt_id or "/" in attempt_id:
        raise ValueError(f"attempt id {attempt_id!r} must not contain '.' or '/'")
    return f"{PREFIX}{attempt_id}.{name}"


def attempt_of(name: str) -> str | None:
    """The attempt id a key name carries, or None."""
    if not name.startswith(PREFIX) or "." not in name:
        return None
    return name[len(PREFIX):].split(".", 1)[0] or None


def name_plan(plan: SavePlan, attempt_id: str) -> SavePlan:
    """``plan`` with every file renamed to carry ``attempt_id``."""
    import dataclasses

    return dataclasses.replace(
        plan,
        writes={r: tuple(dataclasses.replace(w, file=data_name(attempt_id, w.file)) for w in ws)
                for r, ws in plan.writes.items()},
        files={r: tuple(data_name(attempt_id, f) for f in fs) for r, fs in plan.files.items()})


def rename_files(m: Any, names: dict[str, str]) -> Any:
    """Manifest ``m`` with its data files renamed by ``names`` (in ``files``
    and in every chunk that names them)."""
    import msgspec

    return msgspec.structs.replace(
        m, files={names[n]: fe for n, fe in m.files.items()},
        tensors={k: msgspec.structs.replace(te, chunks=tuple(
            msgspec.structs.replace(c, file=names[c.file]) for c in te.chunks))
            for k, te in m.tensors.items()},
        objects={k: msgspec.structs.replace(oe, chunks=tuple(
            msgspec.structs.replace(c, file=names[c.file]) for c in oe.chunks))
            for k, oe in m.objects.items()})


def lease_key(storage: Storage, path: str, attempt_id: str) -> str:
    return storage.join(path, f"{PREFIX}{attempt_id}{LEASE_SUFFIX}")


def local_lease_key(attempt: str) -> str:
    """The lease of the attempt directory ``attempt`` on a rename-capable
    store: the sidecar ``<attempt>.lease.json`` beside it."""
    return f"{attempt}{LEASE_SUFFIX}"


def read_lease(storage: Storage, key: str, now: float | None = None) -> float | None:
    """Seconds since the lease at ``key`` was last renewed when it is live
    (not expired), else None (no lease, or expired). A lease caught while
    being rewritten (it does not parse) is live while the object is younger
    than its default ttl. A lease whose holder ran on this host and is no
    longer alive (killed) is over at once."""
    now = time.time() if now is None else now
    from ..errors import ManifestError

    try:
        raw = storage.read_bytes(key)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ManifestError):
        return None  # none, or not a regular file (a FIFO: never a lease)
    try:
        rec = json.loads(raw)
        expires = float(rec.get("expires", 0))
        renewed = float(rec.get("renewed", expires - lease_ttl_s()))
    except (ValueError, AttributeError, TypeError):
        mtime = storage.modified_time(key)
        return None if mtime is None or now - mtime >= lease_ttl_s() else max(0.0, now - mtime)
    if rec.get("host") == socket.gethostname() and not _pid_alive(rec.get("pid")):
        return None  # its holder, on this host, is gone (killed): the lease ended with it
    if rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname() \
            and rec.get("attempt") in _ENDED:
        return None  # this process ended it, but deleting it failed (EIO): collectable
    return max(0.0, now - renewed) if expires > now else None


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    try:  # a killed process not yet reaped by its parent (a zombie) is dead
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


#: attempt ids of this process's leases that ended but whose deletion failed
#: (a full disk, EIO): :func:`read_lease` reports them over, so gc collects them
_ENDED: set[str] = set()


class AttemptLease:
    """The coordinator's lease on a running attempt, renewed in the background
    (``ttl_s`` seconds; default :func:`lease_ttl_s`).

    ``start`` writes the lease before any rank writes data; ``stop`` ends the
    renewal and deletes the lease object (after publish or discard). Renewal
    failures are logged, never raised: the save itself fails or succeeds on
    its own, and a lease that lapses only makes the attempt collectable.
    """

    def __init__(self, storage: Storage, path: str, attempt_id: str,
                 ttl_s: float | None = None, key: str | None = None):
        self.storage, self.path, self.attempt_id = storage, path, attempt_id
        self.ttl_s = lease_ttl_s() if ttl_s is None else ttl_s
        self.key = lease_key(storage, path, attempt_id) if key is None else key
        self.renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        now = time.time()
        rec = {"attempt": self.attempt_id, "expires": now + self.ttl_s, "renewed": now,
               "pid": os.getpid(), "host": socket.gethostname()}
        self.storage.write_bytes(self.key, json.dumps(rec).encode())

    def start(self) -> AttemptLease:
        self._write()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name=f"reshard-lease-{self.attempt_id}")
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write()
                self.renewals += 1
            except Exception as e:  # noqa: BLE001 - see the class docstring
                log.warning("renewing the lease %s failed: %s", self.key, e)

    def stop(self, *, delete: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if delete:
            try:
                self.storage.delete_tree(self.key)
            except Exception as e:  # noqa: BLE001 - an expired lease is harmless
                _ENDED.add(self.attempt_id)  # over now: the next gc deletes it
                log.warning("deleting the lease %s failed: %s", self.key, e)


def discard(storage: Storage, path: str, attempt_id: str) -> None:
    """Delete the objects of one attempt under ``path`` (and abort its open
    multipart uploads); never another attempt's, never the manifest, and
    nothing at all when the manifest at ``path`` names this attempt or
    cannot be read: a publish whose answer was lost (the conditional put
    landed, the client saw an error) must not lose its data objects.

    Raises:
        StorageError: the manifest could not be checked (nothing deleted).
    """
    published = _published_attempts(storage, path)
    if published is None or attempt_id in published:
        log.warning("not discarding attempt %s under %s: the manifest there %s", attempt_id, path,
                    "is unreadable" if published is None else "names it (its publish landed)")
        return
    pre = f"{PREFIX}{attempt_id}."
    try:
        names = storage.list_dir(path)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    for key, uid, _ in storage.list_uploads(storage.join(path, pre)):
        storage.abort_upload(key, uid)
    for n in names:
        if n.startswith(pre):
            storage.delete_tree(storage.join(path, n))


@dataclass(frozen=True, kw_only=True)
class Collected:
    """What :func:`gc_root` removed (or would remove, with ``dry_run``).

    Attributes:
        attempts: ``<checkpoint name>/<attempt id>`` of every attempt removed.
        objects: keys deleted.
        uploads: ``(key, upload id)`` of multipart uploads aborted.
        in_progress: ``(<checkpoint name>/<attempt id>, seconds since its
            lease was renewed)`` of every attempt kept for its live lease.
    """

    attempts: tuple[str, ...] = ()
    in_progress: tuple[tuple[str, float], ...] = ()
    objects: tuple[str, ...] = ()
    uploads: tuple[tuple[str, str], ...] = ()


def _published_attempts(storage: Storage, path: str) -> set[str] | None:
    """Attempt ids the manifest at ``path`` relies on (its own and those its
    files carry); empty without a manifest; None if it is unreadable (then
    everything is kept for a person to look at)."""
    from ..errors import CheckpointError
    from ..ondisk.committed import read_manifest

    if not storage.exists(storage.join(path, MANIFEST_NAME)):
        return set()
    try:
        m = read_manifest(storage, path)
    except CheckpointError:
        return None
    return {m.attempt_id} | {a for a in (attempt_of(n) for n in m.files) if a}


def _lease_alive(storage: Storage, path: str, attempt_id: str, names: list[str], now: float,
                 grace_s: float) -> bool:
    from ..errors import ManifestError

    try:
        rec = json.loads(storage.read_bytes(lease_key(storage, path, attempt_id)))
        return float(rec.get("expires", 0)) > now
    except (FileNotFoundError, ValueError, ManifestError):
        pass
    # no lease: alive while its newest object is younger than the grace period
    pre = f"{PREFIX}{attempt_id}."
    times = [storage.modified_time(storage.join(path, n)) for n in names if n.startswith(pre)]
    known = [t for t in times if t is not None]
    return bool(known) and now - max(known) < grace_s


def gc_root(storage: Storage, root: str, *, grace_s: float = 3600.0,
            dry_run: bool = False) -> Collected:
    """Remove abandoned attempts below ``root`` (every checkpoint prefix).

    An attempt is abandoned when it is not the one its checkpoint's manifest
    names and its lease has expired (without a lease: its newest object is
    older than ``grace_s`` seconds). Committed checkpoints' objects and
    objects that carry no attempt id are never touched, except the expired
    lease of a published attempt (its coordinator died between the publish
    and the lease's release).

    Raises:
        StorageError: a listing failed (nothing is guessed from a failed LIST).
    """
    now = time.time()
    attempts: list[str] = []
    objects: list[str] = []
    uploads: list[tuple[str, str]] = []
    live: list[tuple[str, float]] = []
    try:
        children = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return Collected()
    for child in children:
        path = storage.join(root, child)
        try:
            names = storage.list_dir(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        open_uploads = storage.list_uploads(storage.join(path, PREFIX))
        ids = {a for a in (attempt_of(n) for n in names) if a}
        ids |= {a for a in (attempt_of(storage.basename(k)) for k, _, _ in open_uploads) if a}
        if not ids:
            continue
        published = _published_attempts(storage, path)
        if published is None:
            continue
        for a in sorted(ids):
            lease = f"{PREFIX}{a}{LEASE_SUFFIX}"
            if a in published:  # committed; a coordinator killed right after its publish
                if lease in names and not _lease_alive(storage, path, a, [lease], now, grace_s):
                    objects.append(storage.join(path, lease))  # left its lease behind
                    if not dry_run:
                        storage.delete_tree(storage.join(path, lease))
                continue
            age = read_lease(storage, storage.join(path, lease), now) if lease in names else None
            if age is not None:
                live.append((f"{child}/{a}", age))
                continue
            if _lease_alive(storage, path, a, names, now, grace_s):
                continue
            pre = f"{PREFIX}{a}."
            attempts.append(f"{child}/{a}")
            for key, uid, _ in open_uploads:
                if storage.basename(key).startswith(pre):
                    uploads.append((key, uid))
                    if not dry_run:
                        storage.abort_upload(key, uid)
            for n in names:
                if n.startswith(pre):
                    objects.append(storage.join(path, n))
                    if not dry_run:
                        storage.delete_tree(storage.join(path, n))
    return Collected(attempts=tuple(attempts), objects=tuple(objects), uploads=tuple(uploads),
                     in_progress=tuple(live))
