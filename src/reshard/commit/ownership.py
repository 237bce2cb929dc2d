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
job took it) finds out at its next renewal, or at the latest before its next
save or retention pass (:meth:`OwnerLease.check` reads the record), and saves
and deletes nothing more.

A second job on a root whose owner is live is refused with one line naming
the owner, unless it is the same job restarting:

* the same job id, given (``CheckpointManager(job_id=...)``,
  ``RESHARD_JOB_ID``) or taken from a launcher id that survives a restart
  (``SLURM_JOB_ID``, with ``SLURM_ARRAY_TASK_ID``; torchrun's
  ``TORCHELASTIC_RUN_ID``, the ``--rdzv-id``, never its default ``"none"``);
* or the owner ran on this host and its process is gone (killed);
* or the same process (a second manager on the root: one job).

Otherwise, for an owner on another host, the lease's stated ttl must pass
(it died, or hung). An owner on this host whose process (pid, started before
the lease) is alive keeps the root even when its lease expired (its renewals
fail: a full disk): an expired lease proves death only on another host. ``close()`` (and the process's exit) releases the root: the record
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


def _process_started(pid: int) -> float | None:
    """Epoch seconds the process ``pid`` of this host started (Linux
    ``/proc``: its ``starttime`` in clock ticks after ``btime``), None where
    it cannot be read (no ``/proc``, the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


#: seconds of slack when comparing a process's start with its lease's ``start``
#: (``btime`` is whole seconds; the clock may have been stepped a little)
_START_SLACK_S = 2.0


def owner_process_alive(rec: dict[str, Any]) -> bool:
    """The owner recorded ran on this host and its process is still the one
    that took the lease: the pid is alive (not a zombie) and that process
    started before the lease's ``start`` (a process that started later is
    another one that reused the pid). False for an owner on another host."""
    from .attempts import _pid_alive

    pid = rec.get("pid")
    if rec.get("host") != socket.gethostname() or not isinstance(pid, int) or not _pid_alive(pid):
        return False
    started, start = _process_started(pid), rec.get("start")
    if started is None or not isinstance(start, (int, float)):
        return True
    return started <= float(start) + _START_SLACK_S


def is_live(rec: dict[str, Any] | None, now: float | None = None) -> bool:
    """The owner recorded is live: not released, and either it ran on this
    host and its process (pid and start time) is alive, whatever its
    lease's expiry (a live owner whose renewals fail, e.g. on a full disk,
    still owns the root: an expired lease proves death only on another
    host), or it ran on another host and its lease has not expired."""
    if not rec or rec.get("released"):
        return False
    if rec.get("host") == socket.gethostname() and isinstance(rec.get("pid"), int):
        return owner_process_alive(rec)
    now = time.time() if now is None else now
    try:
        return float(rec.get("expires", 0)) > now
    except (TypeError, ValueError):
        return False


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
        #: when this lease's renewals began failing (epoch seconds; None: the
        #: last one succeeded) and the last failure
        self.failing_since: float | None = None
        self.failure: str | None = None
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

    def _lapsed_at(self) -> str:
        """When this lease's last written expiry was (local time)."""
        try:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(self.record["expires"])))
        except (KeyError, TypeError, ValueError):
            return "?"

    def _lose(self, other: dict[str, Any] | None) -> str:
        """Record that another job took the root (``other``: the record now
        there); the keeper renews this lease no more. Called under ``_lock``."""
        self.lost = (f"{self.root}: this job no longer owns the root: its lease lapsed at "
                     f"{self._lapsed_at()} and "
                     + (f"{describe(other)} took it" if other else "its owner record was removed")
                     + "; nothing more is saved (or deleted by retention) by this job")
        KEEPER.remove(self)
        log.error("%s", self.lost)
        return self.lost

    def _retake(self, other: dict[str, Any] | None, tag: str | None) -> bool:
        """When ``other`` (the record now there, version ``tag``) was written
        by this very process (another manager of this job on the root, e.g.
        one made with another storage object, took it or released it), write
        this lease back over it: one job, not a second writer. True when
        done. Called under ``_lock``."""
        if other is None or other.get("host") != socket.gethostname() or other.get("pid") != os.getpid():
            return False
        self.tag = tag
        now = time.time()
        try:
            self._write({**self.record, "renewed": now, "expires": now + self.ttl_s})
        except FileExistsError:
            return False
        return True

    def _renew(self) -> None:
        """Extend the lease by its ttl (the keeper, every ``ttl_s / 3``).
        Never raises: another writer's record marks the lease lost; any
        other failure (a full disk, EIO) is logged and retried at the next
        tick, its start kept in ``failing_since``."""
        self.next_renew = time.monotonic() + self.ttl_s / 3
        with self._lock:
            if self.lost is not None:
                return
            now = time.time()
            try:
                self._write({**self.record, "renewed": now, "expires": now + self.ttl_s})
                self.renewals += 1
                self.failing_since = self.failure = None
            except FileExistsError:
                other, tag = read_owner(self.storage, self.root)
                if not self._retake(other, tag):
                    self._lose(other)
            except Exception as e:  # noqa: BLE001 - retried at the next renewal
                if self.failing_since is None:
                    self.failing_since = now
                self.failure = f"{type(e).__name__}: {e}"
                log.warning("renewing the owner lease of %s failed: %s", self.root, e)

    def check(self) -> None:
        """Before this job writes (each save, each retention): it still owns
        the root. The owner record is read: it must still name this lease.
        When the lease this job last wrote has expired (its renewals have
        been failing for longer than its ttl), one renewal is tried now: its
        compare-and-swap succeeds only when no other job wrote the record
        since, so the job then still owns the root alone. A record written by
        another manager of this same process (one job) is written back over.

        Raises:
            RootOwnedError: ownership was lost (another job took the root, the
                record was removed, or the lease lapsed and cannot be renewed
                now). StorageError: the record could not be read."""
        if self.lost is not None:
            raise RootOwnedError(self.lost)
        rec, tag = read_owner(self.storage, self.root)
        if rec is None or rec.get("lease") != self.record.get("lease"):
            with self._lock:
                if self.lost is None and not self._retake(rec, tag):
                    self._lose(rec)
            if self.lost is not None:
                raise RootOwnedError(self.lost)
            return
        if float(self.record.get("expires") or 0) > time.time():
            return
        self._renew()
        if self.lost is not None:
            raise RootOwnedError(self.lost)
        if self.failing_since is not None:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.failing_since))
            raise RootOwnedError(
                f"{self.root}: this job's owner lease lapsed at {self._lapsed_at()} (its renewals have "
                f"failed since {since}: {self.failure}); no other job took the root, but this job "
                "writes nothing (no save, no retention) until a renewal succeeds")
        log.warning("%s: this job's owner lease had lapsed (its renewals failed); renewed now, "
                    "no other job took the root meanwhile", self.root)

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
                lapsed = ""
                if float(rec.get("expires") or 0) <= now:
                    lapsed = (" (its lease lapsed, but its process is alive on this host: its "
                              "renewals are failing, e.g. a full disk; an expired lease proves "
                              "death only on another host)")
                raise RootOwnedError(
                    f"{root} is owned by {describe(rec, now)}{lapsed}; this job "
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
