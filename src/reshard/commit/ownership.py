"""One writer per root: the owner lease (DESIGN.md section 1, "A root has one
writer; readers hold leases").

A job takes ownership of a checkpoint root when it first uses it as a writer
(``CheckpointManager`` construction, on the coordinator): the record
``<root>/OWNER`` = ``{"job", "job_source", "host", "pid", "start",
"renewed", "expires", "ttl_s", "lease", "policy", "require_signed",
"released"}`` (epoch seconds; ``policy``: the job's retention policy, so a
person's ``reshard gc`` never deletes what the owner's retention keeps;
``hmac_sha256`` over the rest when the job has an HMAC key). It is created
and replaced only by a compare-and-swap on the version read
(:meth:`reshard.storage.Storage.put_if_match`: S3 ``If-Match`` /
``If-None-Match: *``, ``memory://`` under its lock, a local root under a
POSIX lock then an atomic rename), so of two jobs taking a root at once one
wins and the other is refused; and it is renewed every ``ttl_s / 3``
seconds by the process's lease keeper (:mod:`reshard.commit.leases`) with
the same swap, so a job that lost the root (its lease lapsed and another
job took it) finds out at its next renewal and saves nothing more.

A second job on a root whose owner is live is refused with one line naming
the owner, unless it is the same job restarting:

* the same job id, given (``CheckpointManager(job_id=...)``,
  ``RESHARD_JOB_ID``) or taken from a launcher id that survives a restart
  (``SLURM_JOB_ID``, with ``SLURM_ARRAY_TASK_ID``; torchrun's
  ``TORCHELASTIC_RUN_ID``, the ``--rdzv-id``, never its default ``"none"``);
* or the owner ran on this host and its process is gone (killed);
* or the same process (a second manager on the root: one job).

Otherwise the lease's stated ttl must pass (the owner died on another host,
or hung). ``close()`` (and the process's exit) releases the root: the record
stays, marked ``released``, so what the root requires (signing) outlives
the job.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from ..errors import CheckpointError, IntegrityError, RootOwnedError
from ..ondisk.committed import OWNER_NAME
from ..storage import Storage
from .leases import KEEPER

log = logging.getLogger("reshard.commit.ownership")

#: launcher variables whose value identifies a job across its restarts, in order
JOB_ID_VARS = ("RESHARD_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def owner_ttl_s() -> float:
    """Seconds an owner lease lasts unless renewed: ``RESHARD_OWNER_TTL_S``,
    else ``RESHARD_LEASE_TTL_S``, else 60."""
    v = os.environ.get("RESHARD_OWNER_TTL_S")
    if v:
        return float(v)
    from .attempts import lease_ttl_s

    return lease_ttl_s()


def job_identity(given: str | None = None) -> tuple[str | None, str]:
    """``(job id, where it came from)``: ``given``; else ``RESHARD_JOB_ID``;
    else ``SLURM_JOB_ID`` (a requeued job keeps it; an array task adds
    ``SLURM_ARRAY_TASK_ID``); else torchrun's ``TORCHELASTIC_RUN_ID`` (the
    ``--rdzv-id``; its default ``"none"`` on multi-node launches is no id);
    else ``(None, "none")``: a job known only by its process."""
    if given:
        return str(given), "given"
    v = os.environ.get("RESHARD_JOB_ID")
    if v:
        return v, "RESHARD_JOB_ID"
    v = os.environ.get("SLURM_JOB_ID")
    if v:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return (f"slurm-{v}" + (f"-{task}" if task else "")), "SLURM_JOB_ID"
    v = os.environ.get("TORCHELASTIC_RUN_ID")
    if v and v.strip().lower() != "none":
        return f"torchrun-{v}", "TORCHELASTIC_RUN_ID"
    return None, "none"


def _sign(rec: dict[str, Any], key: bytes) -> str:
    body = json.dumps({k: v for k, v in rec.items() if k != "hmac_sha256"}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def signature_ok(rec: dict[str, Any], key: bytes | None) -> bool:
    """The record carries an HMAC that ``key`` verifies."""
    mac = rec.get("hmac_sha256")
    return key is not None and isinstance(mac, str) and hmac.compare_digest(_sign(rec, key), mac)


def owner_key(storage: Storage, root: str) -> str:
    return storage.join(root, OWNER_NAME)


def read_owner(storage: Storage, root: str) -> tuple[dict[str, Any] | None, str | None]:
    """The root's owner record (None: none, or unreadable) and its version tag."""
    from ..ondisk.limits import default_limits

    key = owner_key(storage, root)
    try:
        if storage.size(key) > default_limits().record_bytes:
            return None, None
        raw, tag = storage.read_tagged(key)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None, None
    except CheckpointError as e:  # a FIFO, a device: never an owner
        log.warning("%s: %s", key, e)
        return None, None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None, tag
    return (rec if isinstance(rec, dict) else None), tag


def is_live(rec: dict[str, Any] | None, now: float | None = None) -> bool:
    """The owner recorded is live: not released, its lease not expired, and
    (when it ran on this host) its process alive."""
    from .attempts import _pid_alive

    if not rec or rec.get("released"):
        return False
    now = time.time() if now is None else now
    try:
        if float(rec.get("expires", 0)) <= now:
            return False
    except (TypeError, ValueError):
        return False
    return not (rec.get("host") == socket.gethostname() and not _pid_alive(rec.get("pid")))


def describe(rec: dict[str, Any], now: float | None = None) -> str:
    """One phrase naming an owner: job, host, pid, start, lease."""
    now = time.time() if now is None else now
    job = rec.get("job") or "an unnamed job"
    start = rec.get("start")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) if isinstance(start, (int, float)) else "?"
    try:
        left = f"{float(rec.get('expires', 0)) - now:.0f} s"
    except (TypeError, ValueError):
        left = "?"
    return (f"job {job!r} (host {rec.get('host')}, pid {rec.get('pid')}, started {when}, lease "
            f"renewed {now - float(rec.get('renewed') or now):.0f} s ago, expires in {left})")


class OwnerLease:
    """This process's ownership of one root (see the module docstring);
    shared by every manager of the process on that root (``refs``).

    Attributes:
        record: the owner record as last written.
        lost: why ownership was lost (another job took the root), else None.
    """

    def __init__(self, storage: Storage, root: str, record: dict[str, Any], tag: str | None,
                 key_bytes: bytes | None):
        self.storage, self.root, self.record, self.tag = storage, root, record, tag
        self._key = key_bytes
        self.ttl_s = float(record.get("ttl_s") or owner_ttl_s())
        self.refs = 0
        #: the owner record this lease replaced when it took the root (None: none was there)
        self.replaced: dict[str, Any] | None = None
        self.lost: str | None = None
        self.renewals = 0
        self.next_renew = time.monotonic() + self.ttl_s / 3
        self._lock = threading.Lock()

    # -- writing
    def _write(self, rec: dict[str, Any]) -> None:
        """Compare-and-swap ``rec`` over the version this lease last wrote.

        Raises:
            FileExistsError: another writer replaced the record."""
        if self._key is not None:
            rec = {**rec, "hmac_sha256": _sign(rec, self._key)}
        else:
            rec = {k: v for k, v in rec.items() if k != "hmac_sha256"}
        data = json.dumps(rec, sort_keys=True).encode()
        key = owner_key(self.storage, self.root)
        self.storage.put_if_match(key, data, self.tag)
        raw, tag = self.storage.read_tagged(key)
        if raw != data:  # replaced between our swap and this read: not ours any more
            raise FileExistsError(f"{key}: replaced by another writer")
        self.record, self.tag = rec, tag

    def _renew(self) -> None:
        self.next_renew = time.monotonic() + self.ttl_s / 3
        with self._lock:
            if self.lost is not None:
                return
            now = time.time()
            try:
                self._write({**self.record, "renewed": now, "expires": now + self.ttl_s})
                self.renewals += 1
            except FileExistsError:
                other, _ = read_owner(self.storage, self.root)
                self.lost = (f"{self.root}: this job no longer owns the root: "
                             + (f"{describe(other)} took it" if other else "its owner record was removed")
                             + " (this job's lease lapsed); nothing more is saved by this job")
                KEEPER.remove(self)
                log.error("%s", self.lost)
            except Exception as e:  # noqa: BLE001 - retried at the next renewal
                log.warning("renewing the owner lease of %s failed: %s", self.root, e)

    def check(self) -> None:
        """Raises RootOwnedError when ownership was lost."""
        if self.lost is not None:
            raise RootOwnedError(self.lost)

    def release(self, *, quiet: bool = False) -> None:
        """Mark the root released (the record stays: what the root requires
        outlives the job); nothing when ownership was lost. ``quiet``: a
        failure is logged at debug level (the interpreter's exit, when the
        store may be gone: the lease expires by itself)."""
        KEEPER.remove(self)
        with self._lock:
            if self.lost is not None:
                return
            now = time.time()
            try:
                self._write({**self.record, "released": True, "renewed": now, "expires": now})
            except Exception as e:  # noqa: BLE001 - a lapsed lease ends by itself
                (log.debug if quiet else log.warning)(
                    "releasing the owner lease of %s failed (it expires by itself): %s", self.root, e)
            self.lost = f"{self.root}: released by this job"


# --------------------------------------------------------------------------- the process's leases

_HELD: dict[tuple[Any, ...], OwnerLease] = {}
_HELD_LOCK = threading.Lock()


def _ident(storage: Storage, root: str) -> tuple[Any, ...]:
    return (type(storage).__name__, storage.url_scheme, storage.canonical(root))


#: seconds the interpreter's exit waits for its owner leases to be released
#: (a store that does not answer must not hold the exit: the lease expires)
EXIT_RELEASE_S = 2.0


def _release_all() -> None:
    with _HELD_LOCK:
        held = list(_HELD.values())
        _HELD.clear()
    if not held:
        return
    def release() -> None:
        for x in held:
            x.release(quiet=True)

    t = threading.Thread(target=release, daemon=True, name="reshard-release-owner")
    try:
        t.start()
    except RuntimeError:  # no new threads at this point of the interpreter's shutdown
        release()
        return
    t.join(EXIT_RELEASE_S)


atexit.register(_release_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HELD.clear)


def acquire(storage: Storage, root: str, *, job_id: str | None = None,
            policy: dict[str, Any] | None = None, require_signed: bool | None = None,
            hmac_key: bytes | None = None, ttl_s: float | None = None) -> OwnerLease:
    """Take (or join, within this process) ownership of ``root``.

    Args:
        job_id: this job's id (None: :func:`job_identity` from the environment).
        policy: the job's retention policy, recorded for ``reshard gc``.
        require_signed: True: the root requires signed checkpoints from now
            on (needs ``hmac_key``); None: as the previous owner recorded;
            False: no longer (needs the key when it was required).
        hmac_key: signs the record; checks a requirement recorded before.

    Raises:
        RootOwnedError: a live owner holds the root (one line: who, how to proceed).
        IntegrityError: the root requires signing and this job has no key, or
            the recorded requirement's signature does not verify.
        StorageError: the store failed.
    """
    ident = _ident(storage, root)
    with _HELD_LOCK:
        mine = _HELD.get(ident)
        if mine is not None and mine.lost is None:
            mine.refs += 1
            return mine
    job, source = job_identity(job_id)
    ttl = owner_ttl_s() if ttl_s is None else float(ttl_s)
    me_host, me_pid = socket.gethostname(), os.getpid()
    for _ in range(8):  # a lost swap: read again and decide again
        rec, tag = read_owner(storage, root)
        now = time.time()
        if rec is not None and is_live(rec, now):
            same_process = rec.get("host") == me_host and rec.get("pid") == me_pid
            same_job = job is not None and rec.get("job") == job
            if not (same_process or same_job):
                raise RootOwnedError(
                    f"{root} is owned by {describe(rec, now)}; this job "
                    f"({job or 'unnamed'}, host {me_host}, pid {me_pid}) is refused before it writes. "
                    "Stop that job (or wait for its lease to expire), give this job the same job id "
                    "if it is that job restarting (job_id= or RESHARD_JOB_ID), or save to another root")
        required = bool(rec and rec.get("require_signed"))
        if required and not signature_ok(rec or {}, hmac_key):
            why = "this job has no HMAC key" if hmac_key is None else "its signature does not verify with this job's key"
            raise IntegrityError(f"{root} requires signed checkpoints (recorded by job "
                                 f"{(rec or {}).get('job') or 'unnamed'} in {OWNER_NAME}), but {why}: "
                                 "give the key (RESHARD_HMAC_KEY_FILE, --hmac-key-file or hmac_key=)")
        want = required if require_signed is None else bool(require_signed)
        if want and hmac_key is None:
            raise IntegrityError(f"{root}: require_signed needs an HMAC key (RESHARD_HMAC_KEY_FILE, "
                                 "--hmac-key-file or SaveOptions(hmac_key=))")
        new = {"job": job, "job_source": source, "host": me_host, "pid": me_pid, "start": now,
               "renewed": now, "expires": now + ttl, "ttl_s": ttl, "lease": os.urandom(8).hex(),
               "policy": dict(policy or {}), "require_signed": want, "released": False}
        lease = OwnerLease(storage, root, {"ttl_s": ttl}, tag, hmac_key)
        lease.replaced = rec
        try:
            lease._write(new)
        except FileExistsError:
            continue
        if rec is not None and is_live(rec, now):
            log.warning("%s: taking over from %s (%s)", root, describe(rec, now),
                        "the same process" if rec.get("pid") == me_pid else f"the same job id {job!r}")
        lease.refs = 1
        with _HELD_LOCK:
            _HELD[ident] = lease
        KEEPER.add(lease)
        return lease
    raise RootOwnedError(f"{root}: could not take ownership: its {OWNER_NAME} record changed at "
                         "every attempt (another job is taking the root); refused")


def drop(lease: OwnerLease) -> None:
    """One manager is done with ``lease``: released when it was the last."""
    with _HELD_LOCK:
        lease.refs -= 1
        if lease.refs > 0:
            return
        for k, v in list(_HELD.items()):
            if v is lease:
                del _HELD[k]
    lease.release()
