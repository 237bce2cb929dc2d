"""The commit protocol: attempt directories, manifest-last publish, discovery.

A checkpoint is committed when, and only when, ``<path>/manifest.json`` exists
and validates. Two publish strategies, chosen by the storage's capabilities
(after Orbax ``path/atomicity.py``):

* atomic rename (local file system): data and manifest are written in
  ``<path>.incomplete-<attempt_id>/``; the manifest is written last and fsynced,
  then the directory is renamed to ``<path>`` and the parent fsynced.
* manifest marker (object stores, ``memory://``): data is written under
  ``<path>/`` directly and the manifest last; before it exists, readers see
  no checkpoint.
"""

from __future__ import annotations

import hmac
import os
import time
from dataclasses import dataclass
from hashlib import sha256

import msgspec

from .errors import CheckpointNotFoundError, IntegrityError, ManifestError
from .manifest import MANIFEST_NAME, Manifest, decode_manifest, encode_manifest
from .storage import Storage

INCOMPLETE = ".incomplete-"
RETIRED = ".retired-"
#: the coordinator's proof of an attempt's location: written into the attempt
#: before any data, read back by every rank, deleted before the manifest is
#: written (so a committed checkpoint holds only its manifest and data files)
ATTEMPT_NONCE = "attempt-nonce.json"


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


def create_attempt(storage: Storage, attempt: str, attempt_id: str) -> str:
    """Coordinator: create the attempt directory (or prefix) and write
    :data:`ATTEMPT_NONCE` into it: 16 random bytes from ``os.urandom``.
    Returns the nonce (hex) that every rank must read back."""
    nonce = os.urandom(16).hex()
    storage.makedirs(attempt)
    body = msgspec.json.encode({"attempt_id": attempt_id, "nonce": nonce})
    storage.write_bytes(storage.join(attempt, ATTEMPT_NONCE), body, durable=False)
    return nonce


def check_attempt(storage: Storage, attempt: str, nonce: str, *, rank: int) -> None:
    """Every rank: read the coordinator's nonce back through this rank's own
    storage before writing any data.

    Raises:
        CheckpointError: the nonce file is absent (this rank does not see the
            coordinator's storage: node-local disks under one spelling) or
            holds another nonce.
    """
    from .errors import CheckpointError

    p = storage.join(attempt, ATTEMPT_NONCE)
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
    """Return ``m`` with ``extra["hmac_sha256"]`` over its unsigned encoding."""
    extra = {k: v for k, v in m.extra.items() if k != "hmac_sha256"}
    unsigned = msgspec.structs.replace(m, extra=extra)
    mac = hmac.new(key, encode_manifest(unsigned), sha256).hexdigest()
    return msgspec.structs.replace(m, extra={**extra, "hmac_sha256": mac})


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
            durable: bool) -> None:
    """Write the manifest last and make the attempt the checkpoint at ``path``.

    First every file the manifest names is confirmed at its declared size
    (:func:`confirm_files`) and :data:`ATTEMPT_NONCE` is deleted. With
    ``overwrite`` on a rename-capable store, an existing checkpoint is moved
    aside, the new one renamed into place, then the old one deleted.

    Raises:
        IntegrityError: a data file is missing or of another size (nothing published).
        FileExistsError: something appeared at ``path`` during the save.
    """
    confirm_files(storage, attempt, {n: fe.size for n, fe in manifest.files.items()})
    storage.delete_tree(storage.join(attempt, ATTEMPT_NONCE))
    storage.write_bytes(storage.join(attempt, MANIFEST_NAME), encode_manifest(manifest), durable=durable)
    if not storage.capabilities.atomic_rename:
        return
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
    mpath = storage.join(path, MANIFEST_NAME)
    where = mpath
    if storage.is_link(mpath):
        raise ManifestError(f"{where}: manifest is a symbolic link")
    try:
        raw = storage.read_bytes(mpath)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(
            f"{path}: no committed checkpoint here (no {MANIFEST_NAME})"
        ) from None
    m = decode_manifest(raw, where=where)
    if hmac_key is not None:
        check_signature(m, hmac_key, where=where)
    return m


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

    @property
    def step(self) -> int | None:
        return None if self.manifest is None else self.manifest.step


def scan(storage: Storage, root: str) -> list[Entry]:
    """Every child of ``root``: committed checkpoints (with valid manifests),
    abandoned attempts, and directories with an invalid or missing manifest
    (``problem`` says which). Committed ones are ordered by (step, commit time).

    Raises:
        StorageError: listing failed (never reported as "no checkpoints").
    """
    try:
        names = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[Entry] = []
    for name in names:
        p = storage.join(root, name)
        if INCOMPLETE in name or RETIRED in name:
            out.append(Entry(path=p, name=name, manifest=None, abandoned=True,
                             mtime=storage.modified_time(p)))
            continue
        try:
            m = read_manifest(storage, p)
        except CheckpointNotFoundError:
            if _is_dir_like(storage, p):
                out.append(Entry(path=p, name=name, manifest=None, abandoned=True,
                                 problem="no manifest", mtime=storage.modified_time(p)))
            continue
        except (ManifestError, IntegrityError) as e:
            out.append(Entry(path=p, name=name, manifest=None, abandoned=False, problem=str(e)))
            continue
        out.append(Entry(path=p, name=name, manifest=m, abandoned=False))
    return out


def _is_dir_like(storage: Storage, p: str) -> bool:
    try:
        storage.list_dir(p)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def committed(storage: Storage, root: str) -> list[Entry]:
    """Committed checkpoints under ``root``, oldest first, by the step in their
    manifests (commit time where step is absent), never by directory name."""
    done = [e for e in scan(storage, root) if e.manifest is not None]
    return sorted(done, key=lambda e: (e.manifest.step is not None,  # type: ignore[union-attr]
                                       e.manifest.step or 0,  # type: ignore[union-attr]
                                       e.manifest.created_at))  # type: ignore[union-attr]
