"""What is committed, read back: the manifest (its bytes, HMAC signature and digest), the files
it names that are torn, and the small JSON records beside a checkpoint (read_record; they are
written by the commit strategy, :func:`reshard.commit.strategy.write_record`).
The lowest floor of the commit protocol (:mod:`reshard.commit.protocol`): attempts, scans and lineage read
through it.
"""

from __future__ import annotations

import hmac
import json
from hashlib import sha256
from typing import Any

import msgspec
import xxhash

from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ..storage import Storage
from .manifest import (
    MANIFEST_NAME,
    SEAL_KEY,
    Manifest,
    decode_manifest,
    encode_manifest,
)

INCOMPLETE = ".incomplete-"
RETIRED = ".retired-"
QUARANTINED = ".quarantined-"  # a checkpoint renamed aside
QUARANTINE_MARK = ".quarantined.json"  # the marker where rename is not possible
HEAD_NAME = "HEAD"
#: the root's owner record (:mod:`reshard.commit.ownership`)
OWNER_NAME = "OWNER"
_TMP = ".tmp-"
#: the suffix of an attempt's lease (:mod:`reshard.commit.attempts`); beside an
#: attempt directory ``<attempt>.lease.json`` where rename is atomic
ATTEMPT_LEASE = ".lease.json"


def is_leftover(name: str) -> bool:
    """``name`` (a child of a root) is an attempt that never committed or a
    retired checkpoint left behind (``*.incomplete-*``, ``*.retired-*``):
    never a quarantine marker, a record's temporary or an attempt's lease."""
    if name.endswith(QUARANTINE_MARK) or _TMP in name or (
            INCOMPLETE in name and name.endswith(ATTEMPT_LEASE)):
        return False
    return INCOMPLETE in name or RETIRED in name


def sign_manifest(m: Manifest, key: bytes) -> Manifest:
    """Return ``m`` with ``extra["hmac_sha256"]`` over its unsigned encoding
    (without the manifest's own checksum, which is added after, over the
    signed bytes)."""
    extra = {k: v for k, v in m.extra.items() if k not in ("hmac_sha256", SEAL_KEY)}
    unsigned = msgspec.structs.replace(m, extra=extra)
    mac = hmac.new(key, encode_manifest(unsigned), sha256).hexdigest()
    seal = {SEAL_KEY: m.extra[SEAL_KEY]} if SEAL_KEY in m.extra else {}
    return msgspec.structs.replace(m, extra={**extra, **seal, "hmac_sha256": mac})


def check_signature(m: Manifest, key: bytes, *, where: str) -> None:
    mac = m.extra.get("hmac_sha256")
    if not isinstance(mac, str):
        raise IntegrityError(f"{where}: manifest is not signed, but an HMAC key was given")
    if not hmac.compare_digest(sign_manifest(m, key).extra["hmac_sha256"], mac):
        raise IntegrityError(f"{where}: manifest HMAC does not match (tampered, or another key)")


def read_manifest(storage: Storage, path: str, *, hmac_key: bytes | None = None,
                  limits: Any = None) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path`` (within
    ``limits``, :class:`~reshard.ondisk.limits.ReadLimits`; None: the defaults).

    Raises:
        CheckpointNotFoundError: no checkpoint there (no manifest).
        ManifestError: the manifest is unreadable, invalid, larger than a
            limit, a symlink, or not a regular file.
        IntegrityError: sizes inconsistent; HMAC mismatch when a key is given.
    """
    raw = read_manifest_bytes(storage, path, limits=limits)
    where = storage.join(path, MANIFEST_NAME)
    m = decode_manifest(raw, where=where, limits=limits)
    if hmac_key is not None:
        check_signature(m, hmac_key, where=where)
    return m


def read_manifest_bytes(storage: Storage, path: str, *, limits: Any = None) -> bytes:
    """The raw bytes of ``<path>/manifest.json`` (not validated; its size is
    checked against ``limits.manifest_bytes`` before it is read).

    Raises:
        CheckpointNotFoundError: no manifest there.
        ManifestError: the manifest is a symbolic link, a directory, not a
            regular file (a FIFO, socket or device: refused at once), or
            larger than the limit.
    """
    from .limits import default_limits, too_large

    mpath = storage.join(path, MANIFEST_NAME)
    if storage.is_link(mpath):
        raise ManifestError(f"{mpath}: manifest is a symbolic link")
    lim = limits if limits is not None else default_limits()
    try:
        size = storage.size(mpath)
        if size > lim.manifest_bytes:
            raise ManifestError(too_large(mpath, "the manifest", size, lim.manifest_bytes,
                                          "manifest_bytes"))
        return storage.read_bytes(mpath, 0, size)
    except IsADirectoryError:
        raise ManifestError(f"{mpath}: is a directory, not a manifest file") from None
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(
            f"{path}: no committed checkpoint here (no {MANIFEST_NAME})"
        ) from None


def linked_children(storage: Storage, root: str) -> list[str]:
    """Names of the children of ``root`` that are symbolic links (which
    :func:`scan` leaves out)."""
    try:
        names = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if storage.is_link(storage.join(root, n))]


def manifest_digest(raw: bytes) -> str:
    """xxh3_64 hex digest of manifest bytes (binds records to one manifest)."""
    return xxhash.xxh3_64_hexdigest(raw)


def torn_files(storage: Storage, path: str, m: Manifest) -> dict[str, str]:
    """File name -> problem, for the files ``m`` names under ``path`` that are
    missing, a symbolic link, or not of the declared size (one stat per file;
    no checksums). Empty when every file is present at its declared size.

    Raises:
        StorageError: the store failed (never reported as a torn file).
    """
    problems = {}
    for name, fe in m.files.items():
        p = storage.join(path, name)
        if storage.is_link(p):
            problems[name] = f"{p}: is a symbolic link"
            continue
        try:
            size = storage.size(p)
        except (FileNotFoundError, NotADirectoryError):
            problems[name] = f"{p}: missing (manifest declares {fe.size} bytes)"
            continue
        except ManifestError as e:  # a FIFO, a socket, a device: never opened
            problems[name] = str(e)
            continue
        if size != fe.size:
            problems[name] = f"{p}: {size} bytes, manifest declares {fe.size}"
    return problems


def read_record(storage: Storage, path: str) -> dict[str, Any] | None:
    """A JSON record written by :func:`write_record`, or None when there is
    none, it does not parse (a record never written completely is no
    record), it is larger than ``ReadLimits.record_bytes`` (never parsed),
    or it is not a regular file (a FIFO, a directory: never waited on)."""
    from .limits import default_limits

    try:
        size = storage.size(path)
        if size > default_limits().record_bytes:
            return None
        rec = json.loads(storage.read_bytes(path, 0, size))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError,
            RecursionError, ManifestError):
        return None
    return rec if isinstance(rec, dict) else None
