"""What a root holds: its children (scan: committed, quarantined, abandoned), the committed ones
in order (committed, order_key), and the HEAD record of the lineage (read_head, write_head: a
compare-and-swap where the store has conditional puts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, IntegrityError, ManifestError
from ..ondisk.committed import (
    _TMP,
    ATTEMPT_LEASE,
    HEAD_NAME,
    INCOMPLETE,
    QUARANTINE_MARK,
    QUARANTINED,
    is_leftover,
    manifest_digest,
    read_manifest_bytes,
    read_record,
)
from ..ondisk.manifest import (
    MANIFEST_NAME,
    Manifest,
    decode_manifest,
)
from ..storage import Storage
from .strategy import strategy_for, write_record


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
        if is_leftover(name):
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
        if strategy_for(storage).shares_prefix and (m is not None or problem == "no manifest"):
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
    rely on (``<name>/<attempt id>``, as :func:`reshard.commit.attempts.gc_root`
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


# planning.data_file_name, and chunk_file_name (a chunk's file of its own, incremental saves)
_SHARD_FILE = re.compile(r"^data-(r\d{5}-\d+|c[0-9a-f]{16})\.safetensors$")


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
    return strategy_for(storage).shares_prefix and any(attempt_of(n) for n in names)


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
    """The root's ``HEAD`` record (see :mod:`reshard.commit.lineage`), or None."""
    return read_record(storage, storage.join(root, HEAD_NAME))


def read_head_tagged(storage: Storage, root: str) -> tuple[dict[str, Any] | None, str | None]:
    """The root's ``HEAD`` record (None: none, or it does not parse) and the
    version tag to pass to :func:`write_head` as ``expect`` (None: no HEAD
    object). The tag is read only where :func:`write_head` swaps
    conditionally (no rename, conditional puts); elsewhere it is None."""
    path = storage.join(root, HEAD_NAME)
    if not strategy_for(storage).swaps_head:
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
    if not strategy_for(storage).swaps_head:
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
