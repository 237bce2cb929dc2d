"""The commit protocol: attempt directories, manifest-last publish, discovery.

A checkpoint is committed when, and only when, ``<path>/manifest.json`` exists
and validates. Two publish strategies, chosen by the storage's capabilities
(after Orbax ``path/atomicity.py``):

* atomic rename (local file system): data and manifest are written in
  ``<path>.incomplete-<attempt_id>/``; the manifest is written last and fsynced,
  then the directory is renamed to ``<path>`` and the parent fsynced.
* manifest marker (object stores, ``memory://``): data is written under
  ``<path>/`` directly, in keys that carry the attempt id
  (:mod:`reshard.attempts`), and the manifest last with a conditional put
  (``If-None-Match: *``): exactly one attempt publishes a step; before the
  manifest exists, readers see no checkpoint.

Beside the checkpoints of a root live small JSON records, each written by
:func:`write_record` (atomic where the store can rename): the ``HEAD`` record
(the checkpoint the current lineage resumed from, :mod:`reshard.lineage`) and
quarantine markers. On stores without rename but with conditional puts the
``HEAD`` is replaced by compare-and-swap (:func:`write_head`: S3 ``If-Match``
on the ETag read, ``If-None-Match: *`` when there was none), so of two jobs
resuming one root at once the second gets a clear error naming the first. A checkpoint found unloadable by a restore is quarantined:
renamed aside to ``<name>.quarantined-<id>`` where rename is atomic, else
marked by a ``<name>.quarantined.json`` record; either way it is never listed
as committed, never returned by ``latest`` and never deleted by retention or
garbage collection.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import time
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

import msgspec
import xxhash

from .errors import CheckpointError, CheckpointNotFoundError, IntegrityError, ManifestError
from .manifest import (
    MANIFEST_NAME,
    SEAL_KEY,
    Manifest,
    decode_manifest,
    encode_manifest,
    encode_sealed,
)
from .storage import Storage

INCOMPLETE = ".incomplete-"
RETIRED = ".retired-"
QUARANTINED = ".quarantined-"  # a checkpoint renamed aside
QUARANTINE_MARK = ".quarantined.json"  # the marker where rename is not possible
HEAD_NAME = "HEAD"
_TMP = ".tmp-"
#: the coordinator's proof of an attempt's location: written into the attempt
#: before any data, read back by every rank, deleted before the manifest is
#: written (so a committed checkpoint holds only its manifest and data files)
ATTEMPT_NONCE = "attempt-nonce.json"
#: the suffix of an attempt's lease (:mod:`reshard.attempts`); beside an
#: attempt directory ``<attempt>.lease.json`` where rename is atomic
ATTEMPT_LEASE = ".lease.json"


def new_attempt_id() -> str:
    """A unique attempt id from the clock and ``os.urandom`` (never from the
    Python/NumPy/torch generators, which save must not disturb)."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.urandom(4).hex()}"


def attempt_path(storage: Storage, path: str, attempt_id: str) -> str:
    """Where an attempt writes: a sibling directory where rename is atomic,
    else the final prefix itself."""
    if storage.capabilities.atomic_rename:
        return f"{path}{INCOMPLETE}{attempt_id}"
    return path


def nonce_key(storage: Storage, attempt: str, attempt_id: str) -> str:
    """Where an attempt's nonce lives: :data:`ATTEMPT_NONCE` in the attempt
    directory, or, where attempts share the final prefix (no rename), a key
    carrying the attempt id (``att-<id>.attempt-nonce.json``), so concurrent
    attempts never overwrite each other's."""
    if storage.capabilities.atomic_rename:
        return storage.join(attempt, ATTEMPT_NONCE)
    from .attempts import data_name

    return storage.join(attempt, data_name(attempt_id, ATTEMPT_NONCE))


def create_attempt(storage: Storage, attempt: str, attempt_id: str) -> str:
    """Coordinator: create the attempt directory (or prefix) and write
    :data:`ATTEMPT_NONCE` into it: 16 random bytes from ``os.urandom``.
    Returns the nonce (hex) that every rank must read back."""
    nonce = os.urandom(16).hex()
    storage.makedirs(attempt)
    body = msgspec.json.encode({"attempt_id": attempt_id, "nonce": nonce})
    storage.write_bytes(nonce_key(storage, attempt, attempt_id), body, durable=False)
    return nonce


def check_attempt(storage: Storage, attempt: str, nonce: str, *, rank: int,
                  attempt_id: str = "") -> None:
    """Every rank: read the coordinator's nonce back through this rank's own
    storage before writing any data.

    Raises:
        CheckpointError: the nonce file is absent (this rank does not see the
            coordinator's storage: node-local disks under one spelling) or
            holds another nonce.
    """
    from .errors import CheckpointError

    p = nonce_key(storage, attempt, attempt_id)
    try:
        got = msgspec.json.decode(storage.read_bytes(p)).get("nonce")
    except (FileNotFoundError, NotADirectoryError):
        got = None
    except (msgspec.DecodeError, AttributeError):
        got = "<unreadable>"
    if got != nonce:
        why = "" if got is None else f" (its {ATTEMPT_NONCE} holds another attempt's nonce)"
        raise CheckpointError(
            f"rank {rank} cannot see the attempt written by the coordinator at {attempt}{why}: "
            "node-local storage? every rank must see the same checkpoint location")


def confirm_files(storage: Storage, attempt: str, files: dict[str, int]) -> None:
    """Coordinator, before publishing: every file the manifest names exists in
    the attempt at its declared size (one ``size`` call per file, from up to 16
    threads).

    Raises:
        IntegrityError: files missing or of another size (all listed).
    """
    from concurrent.futures import ThreadPoolExecutor

    def stat(name: str) -> str | None:
        p = storage.join(attempt, name)
        try:
            got = storage.size(p)
        except (FileNotFoundError, NotADirectoryError):
            return f"{p}: missing (the writer reported {files[name]} bytes)"
        return None if got == files[name] else f"{p}: {got} bytes, the writer reported {files[name]}"

    names = sorted(files)
    if len(names) > 8:
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="reshard-stat") as ex:
            found = list(ex.map(stat, names))
    else:
        found = [stat(n) for n in names]
    bad = [f for f in found if f is not None]
    if bad:
        raise IntegrityError(f"{len(bad)} of {len(names)} data file(s) not as written, refusing to "
                             "publish: " + "; ".join(bad[:10]))


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


def check_target(storage: Storage, path: str, *, overwrite: bool) -> None:
    """Refuse to save over a committed checkpoint unless ``overwrite`` (and
    never on a store without atomic rename, where a replace could not be
    atomic: publish under a new step instead). Anything else already at
    ``path`` on a rename-capable store (a directory that is not a committed
    checkpoint) is never replaced, ``overwrite`` or not."""
    if not storage.exists(storage.join(path, MANIFEST_NAME)):
        if storage.capabilities.atomic_rename and _non_empty(storage, path):
            raise FileExistsError(f"{path}: exists and is not a committed checkpoint; refusing to "
                                  "replace it (choose another path)")
        return
    if not overwrite:
        raise FileExistsError(f"{path}: a committed checkpoint is already there "
                              "(pass SaveOptions(overwrite=True) to replace it)")
    if not storage.capabilities.atomic_rename:
        from .errors import CheckpointError

        raise CheckpointError(f"{path}: overwrite is refused on a store without atomic rename; "
                              "publish under a new step instead")


def _non_empty(storage: Storage, path: str) -> bool:
    """``path`` exists and is a file or a directory with entries."""
    if not storage.exists(path):
        return False
    try:
        return bool(storage.list_dir(path))
    except (NotADirectoryError, FileNotFoundError):
        return True


def publish(storage: Storage, attempt: str, path: str, manifest: Manifest, *, overwrite: bool,
            durable: bool) -> int:
    """Write the manifest last and make the attempt the checkpoint at ``path``;
    returns the bytes of the manifest written (sealed, :func:`encode_sealed`).

    First every file the manifest names is confirmed at its declared size
    (:func:`confirm_files`) and :data:`ATTEMPT_NONCE` is deleted. With
    ``overwrite`` on a rename-capable store, an existing checkpoint is moved
    aside, the new one renamed into place, then the old one deleted.

    Raises:
        IntegrityError: a data file is missing or of another size (nothing published).
        FileExistsError: something appeared at ``path`` during the save.
    """
    confirm_files(storage, attempt, {n: fe.size for n, fe in manifest.files.items()})
    storage.delete_tree(nonce_key(storage, attempt, manifest.attempt_id))
    if not storage.capabilities.atomic_rename:
        return publish_marker(storage, path, manifest)
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


def publish_marker(storage: Storage, path: str, manifest: Manifest) -> int:
    """Publish on a store without rename: put ``path/manifest.json`` only if
    absent (the data objects, named by the manifest, are already durable);
    returns the bytes of the manifest put.

    Raises:
        FileExistsError: another writer published this checkpoint first; this
            attempt's objects are not named by it and are discarded by the caller.
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


def delete_checkpoint(storage: Storage, path: str) -> None:
    """Delete the committed checkpoint at ``path`` so that no moment of the
    deletion leaves a listed checkpoint with missing files. Where rename is
    atomic, the directory is first renamed to an abandoned attempt's name
    (``<path>.incomplete-deleting-<id>``), then deleted; elsewhere the
    manifest (the proof of the commit) is deleted first, then the rest. An
    interrupted deletion leaves only what ``gc`` removes."""
    if storage.capabilities.atomic_rename:
        doomed = f"{path}{INCOMPLETE}deleting-{os.urandom(4).hex()}"
        storage.rename_dir(path, doomed)
        storage.fsync_dir(storage.parent(path) or "/")
        storage.delete_tree(doomed)
        return
    mpath = storage.join(path, MANIFEST_NAME)
    if storage.exists(mpath):
        storage.delete_tree(mpath)
    storage.delete_tree(path)


def read_manifest(storage: Storage, path: str, *, hmac_key: bytes | None = None) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: no checkpoint there (no manifest).
        ManifestError: the manifest is unreadable or invalid, or is a symlink.
        IntegrityError: sizes inconsistent; HMAC mismatch when a key is given.
    """
    raw = read_manifest_bytes(storage, path)
    where = storage.join(path, MANIFEST_NAME)
    m = decode_manifest(raw, where=where)
    if hmac_key is not None:
        check_signature(m, hmac_key, where=where)
    return m


def read_manifest_bytes(storage: Storage, path: str) -> bytes:
    """The raw bytes of ``<path>/manifest.json`` (not validated).

    Raises:
        CheckpointNotFoundError: no manifest there.
        ManifestError: the manifest is a symbolic link or a directory.
    """
    mpath = storage.join(path, MANIFEST_NAME)
    if storage.is_link(mpath):
        raise ManifestError(f"{mpath}: manifest is a symbolic link")
    try:
        return storage.read_bytes(mpath)
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
        if size != fe.size:
            problems[name] = f"{p}: {size} bytes, manifest declares {fe.size}"
    return problems


def write_record(storage: Storage, path: str, record: dict[str, Any]) -> None:
    """Write a small JSON record durably and, where the store can rename,
    atomically (a temporary file, fsynced, renamed over ``path``, the parent
    fsynced): a reader sees the old record or the new one, never a torn one.
    On stores without rename, a plain put (whole-object writes are atomic
    there). The one place such records are written, so a store with
    conditional puts can make the replace conditional here."""
    data = json.dumps(record, sort_keys=True).encode()
    if not storage.capabilities.atomic_rename:
        storage.write_bytes(path, data)
        return
    tmp = f"{path}{_TMP}{os.urandom(4).hex()}"
    try:
        storage.write_bytes(tmp, data, durable=True)
        storage.rename_dir(tmp, path)  # os.rename: atomic for files as for directories
    except BaseException:
        storage.delete_tree(tmp)
        raise
    storage.fsync_dir(storage.parent(path) or "/")


def read_record(storage: Storage, path: str) -> dict[str, Any] | None:
    """A JSON record written by :func:`write_record`, or None when there is
    none or it does not parse (a record never written completely is no record)."""
    try:
        rec = json.loads(storage.read_bytes(path))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def quarantine(storage: Storage, root: str, name: str, *, reason: str,
               attempt_id: str | None) -> str:
    """Set the checkpoint ``root/name`` aside so that nothing lists it as
    committed, loads it or deletes it: rename it to
    ``<name>.quarantined-<id>`` where the store renames atomically, else write
    the marker ``<name>.quarantined.json``. Returns the name it now has (the
    same name, on stores that keep it in place)."""
    rec = {"name": name, "reason": reason[:2000], "time": time.time(), "attempt_id": attempt_id}
    if storage.capabilities.atomic_rename:
        new = f"{name}{QUARANTINED}{new_attempt_id()}"
        storage.rename_dir(storage.join(root, name), storage.join(root, new))
        write_record(storage, storage.join(root, new + QUARANTINE_MARK), rec)
        return new
    write_record(storage, storage.join(root, name + QUARANTINE_MARK), rec)
    return name


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A child of a root: a committed checkpoint (``manifest`` set) or an
    attempt that never committed (``abandoned``)."""

    path: str
    name: str
    manifest: Manifest | None
    abandoned: bool
    problem: str | None = None
    mtime: float | None = None
    digest: str | None = None  # xxh3_64 of manifest.json (see manifest_digest)
    quarantined: bool = False  # set aside by a restore; ``problem`` says why

    @property
    def step(self) -> int | None:
        return None if self.manifest is None else self.manifest.step


def scan(storage: Storage, root: str) -> list[Entry]:
    """Every child of ``root`` that is ours: committed checkpoints (with valid
    manifests), quarantined ones (``quarantined``; their manifest when it
    still reads), abandoned attempts (``*.incomplete-*`` / ``*.retired-*``, or
    a directory of reshard shard files without a manifest), and directories
    with an invalid manifest (``problem`` says which). Records (``HEAD``,
    sidecars) are not entries; other children (e.g. ``tensorboard/``) are
    left out, and so is a symbolic link (to another checkpoint, here or
    elsewhere): it is not one of the root's checkpoints, so ``latest``,
    ``restore``, retention and gc never see it twice nor delete through it
    (``reshard ls`` names it, :func:`linked_children`).

    Raises:
        StorageError: listing failed (never reported as "no checkpoints").
    """
    try:
        names = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    marks = {n[: -len(QUARANTINE_MARK)] for n in names if n.endswith(QUARANTINE_MARK)}
    out: list[Entry] = []
    for name in names:
        p = storage.join(root, name)
        if name.endswith(QUARANTINE_MARK) or _TMP in name or storage.is_link(p) or (
                INCOMPLETE in name and name.endswith(ATTEMPT_LEASE)):  # an attempt's lease
            continue
        if INCOMPLETE in name or RETIRED in name:
            out.append(Entry(path=p, name=name, manifest=None, abandoned=True,
                             mtime=storage.modified_time(p)))
            continue
        m, digest, problem = None, None, None
        try:
            raw = read_manifest_bytes(storage, p)
            m = decode_manifest(raw, where=storage.join(p, MANIFEST_NAME))
            digest = manifest_digest(raw)
        except CheckpointNotFoundError:
            # only a directory holding our shard files is an attempt; anything
            # else (tensorboard/, logs/, a record, a stray file) is not ours:
            # never listed, never deleted
            if not _holds_shard_files(storage, p) and not (
                    QUARANTINED in name or name in marks):
                continue
            problem = "no manifest"
        except (ManifestError, IntegrityError) as e:
            problem = str(e)
        if QUARANTINED in name or name in marks:
            rec = read_record(storage, storage.join(root, name + QUARANTINE_MARK)) or {}
            if QUARANTINED in name or m is None or rec.get("attempt_id") in (None, m.attempt_id):
                out.append(Entry(path=p, name=name, manifest=m, abandoned=False, digest=digest,
                                 quarantined=True, mtime=storage.modified_time(p),
                                 problem=str(rec.get("reason") or problem or "quarantined")))
                continue
        if not storage.capabilities.atomic_rename and (m is not None or problem == "no manifest"):
            extra = _prefix_attempts(storage, p, name, m)  # attempts share the prefix: one entry each
            if extra is not None:
                out.extend(extra)
                if m is None:
                    continue
        if m is None:
            out.append(Entry(path=p, name=name, manifest=None, abandoned=problem == "no manifest",
                             problem=problem, mtime=storage.modified_time(p)))
            continue
        out.append(Entry(path=p, name=name, manifest=m, abandoned=False, digest=digest))
    return out


def _prefix_attempts(storage: Storage, p: str, name: str, m: Manifest | None) -> list[Entry] | None:
    """On a store without rename, where every attempt at a step writes under
    the checkpoint's own prefix (keys ``att-<id>.*``): one abandoned
    :class:`Entry` per attempt found there that the manifest ``m`` does not
    rely on (``<name>/<attempt id>``, as :func:`reshard.attempts.gc_root`
    names them; a killed job's attempt, a losing concurrent writer, one still
    running). None when the prefix holds no attempt keys at all (then the
    caller's own rules apply)."""
    from .attempts import PREFIX, attempt_of

    try:
        names = storage.list_dir(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    ids: dict[str, list[str]] = {}
    for n in names:
        a = attempt_of(n)
        if a is not None:
            ids.setdefault(a, []).append(n)
    if not ids:
        return None
    used = set() if m is None else {m.attempt_id} | {a for a in map(attempt_of, m.files) if a}
    out = []
    for a, keys in sorted(ids.items()):
        if a in used:
            continue
        data = [k for k in keys if _SHARD_FILE.match(k[len(PREFIX) + len(a) + 1:])]
        times = [t for t in (storage.modified_time(storage.join(p, k)) for k in keys[:8]) if t is not None]
        why = (f"incomplete attempt {a}: {len(data)} data object(s), no manifest naming them"
               + ("" if m is None else f" (the checkpoint is attempt {m.attempt_id}'s)"))
        out.append(Entry(path=p, name=f"{name}/{a}", manifest=None, abandoned=True, problem=why,
                         mtime=max(times) if times else None))
    return out


_SHARD_FILE = re.compile(r"^data-r\d{5}-\d+\.safetensors$")  # planning.data_file_name


def _holds_shard_files(storage: Storage, p: str) -> bool:
    """``p`` holds our shard files, or (where attempts share the final prefix)
    any key of an attempt (``att-<id>.*``: data, nonce or lease)."""
    from .attempts import attempt_of

    try:
        names = storage.list_dir(p)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if any(_SHARD_FILE.match(n) for n in names):
        return True
    return not storage.capabilities.atomic_rename and any(attempt_of(n) for n in names)


def committed(storage: Storage, root: str) -> list[Entry]:
    """Committed checkpoints under ``root``, oldest first, by the step in their
    manifests (commit time where step is absent), never by directory name."""
    done = [e for e in scan(storage, root) if e.manifest is not None and not e.quarantined]
    return sorted(done, key=order_key)


def order_key(e: Entry) -> tuple[bool, int, float]:
    """Sort key of a committed entry: by step (entries without one first),
    then commit time. Never the name."""
    m = e.manifest
    assert m is not None
    return (m.step is not None, m.step or 0, m.created_at)


def read_head(storage: Storage, root: str) -> dict[str, Any] | None:
    """The root's ``HEAD`` record (see :mod:`reshard.lineage`), or None."""
    return read_record(storage, storage.join(root, HEAD_NAME))


def read_head_tagged(storage: Storage, root: str) -> tuple[dict[str, Any] | None, str | None]:
    """The root's ``HEAD`` record (None: none, or it does not parse) and the
    version tag to pass to :func:`write_head` as ``expect`` (None: no HEAD
    object). The tag is read only where :func:`write_head` swaps
    conditionally (no rename, conditional puts); elsewhere it is None."""
    path = storage.join(root, HEAD_NAME)
    caps = storage.capabilities
    if caps.atomic_rename or not caps.conditional_put:
        return read_record(storage, path), None
    try:
        data, tag = storage.read_tagged(path)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    try:
        rec = json.loads(data)
    except ValueError:
        return None, tag
    return (rec if isinstance(rec, dict) else None), tag


_UNREAD = "\0unread"  # write_head's default: the tag is read just before the swap


def write_head(storage: Storage, root: str, record: dict[str, Any], *,
               expect: str | None = _UNREAD) -> None:
    """Replace the root's ``HEAD`` record.

    Where the store renames atomically: :func:`write_record` (the last writer
    wins, atomically). Where it cannot rename but has conditional puts (S3,
    ``memory://``): a compare-and-swap on the HEAD as read by
    :func:`read_head_tagged` (``expect``: its tag, None when there was no
    HEAD; by default the HEAD is read again just before the swap), so another
    writer's HEAD is never overwritten silently. Elsewhere a plain put.

    Raises:
        CheckpointError: another writer replaced (or created, or removed)
            ``HEAD`` since it was read; the message names the HEAD it wrote.
            Nothing is changed.
        StorageError: the store failed.
    """
    path = storage.join(root, HEAD_NAME)
    caps = storage.capabilities
    if caps.atomic_rename or not caps.conditional_put:
        write_record(storage, path, record)
        return
    if expect == _UNREAD:
        _, expect = read_head_tagged(storage, root)
    try:
        storage.put_if_match(path, json.dumps(record, sort_keys=True).encode(), expect)
    except FileExistsError as e:
        other = read_head(storage, root)
        who = (f"it now names {other.get('name')!r} (HEAD id {other.get('id')!r}, attempt "
               f"{other.get('attempt_id')!r})" if other is not None else "it is now absent or unreadable")
        raise CheckpointError(
            f"{path}: another writer replaced HEAD while this job was resuming ({who}); "
            f"this job's HEAD naming {record.get('name')!r} was not written. Two jobs resume "
            f"from one root: stop one, or give each its own root") from e
