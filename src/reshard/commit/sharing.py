"""Which bytes a checkpoint shares with others and which it alone holds.

Incremental saves (:mod:`reshard.saving.incremental`) give an unchanged
file a second name in the next checkpoint instead of writing it again: a
hard link on a local file system (one inode, several names), a shared
object in ``memory://``. The bytes then stay on the store as long as any
checkpoint names them, and deleting one checkpoint frees only the files no
other name holds. Nothing here is bookkeeping of our own: the store's link
counts are the truth (:meth:`reshard.storage.Storage.file_identity`), so a
deletion never writes anything first and a crash at any point of one loses
no byte a kept checkpoint names. On S3 a copy inside the store is a second
object: each checkpoint holds all its bytes.

Used by ``reshard ls`` (logical and own bytes per checkpoint), ``reshard gc
--dry-run`` (what deleting would free) and the manager's free-space check
before a save (the bytes the newest save wrote itself).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import NotARegularFileError
from ..ondisk.manifest import Manifest
from ..storage import Storage


@dataclass(frozen=True, kw_only=True)
class Holding:
    """One checkpoint's bytes (data files named by its manifest).

    Attributes:
        logical: bytes of every file the manifest names.
        own: bytes of the files no other name holds (what deleting this
            checkpoint alone frees).
        shared: ``logical - own``: files other names hold too (other
            checkpoints, in this root or elsewhere).
        written: bytes its save wrote itself (files without an ``origin``).
    """

    logical: int
    own: int
    shared: int
    written: int


def holding(st: Storage, path: str, m: Manifest) -> Holding:
    """The :class:`Holding` of the checkpoint at ``path`` (one ``lstat`` per
    file on a local file system; none where the store has no links). A file
    missing from the store counts as neither own nor shared."""
    logical = own = 0
    for name, fe in m.files.items():
        logical += fe.size
        try:
            ident = st.file_identity(st.join(path, name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        if ident is None or ident[1] <= 1:
            own += fe.size
    written = sum(fe.size for fe in m.files.values() if not fe.origin)
    return Holding(logical=logical, own=own, shared=logical - own, written=written)


def _files_under(st: Storage, path: str) -> Iterable[str]:
    """Every file below ``path`` (a checkpoint directory or an attempt)."""
    try:
        names = st.list_dir(path)
    except NotADirectoryError:
        yield path
        return
    except FileNotFoundError:
        return
    for n in names:
        p = st.join(path, n)
        if st.is_link(p):
            yield p
            continue
        try:
            st.list_dir(p)
        except NotADirectoryError:
            yield p
            continue
        except FileNotFoundError:
            continue
        yield from _files_under(st, p)


#: a path's files: ``(identity or None, names in the whole store, size)`` each
Census = dict[str, list[tuple[object, int, int]]]


def tracks_links(st: Storage) -> bool:
    """Whether ``st`` tells which names share bytes (a local file system,
    ``memory://``); elsewhere (S3) every name holds bytes of its own."""
    return type(st).file_identity is not Storage.file_identity


def census(st: Storage, paths: Iterable[str], manifests: dict[str, Manifest] | None = None) -> Census:
    """For each of ``paths`` (checkpoint directories, attempts), its files'
    identities, link counts and sizes (one ``lstat`` per file), taken before
    a deletion so that what it freed can be told after it (only regular
    files: a FIFO, socket or device among them is skipped). On a store that
    does not track links (S3) nothing is listed: a path's files are those its
    manifest in ``manifests`` names (none without one)."""
    out: Census = {}
    if not tracks_links(st):
        for root in paths:
            m = (manifests or {}).get(root)
            out[root] = [] if m is None else [(None, 1, fe.size) for fe in m.files.values()]
        return out
    for root in paths:
        rows = out.setdefault(root, [])
        for f in _files_under(st, root):
            try:
                size = st.size(f)
                ident = st.file_identity(f)
            except (FileNotFoundError, NotADirectoryError, NotARegularFileError):
                continue  # gone meanwhile, or a FIFO/socket/device: holds no bytes, never opened
            rows.append((None, 1, size) if ident is None else (ident[0], ident[1], size))
    return out


def freed(c: Census, deleted: Iterable[str]) -> tuple[int, int]:
    """``(bytes freed, bytes named)`` by deleting ``deleted`` (paths of the
    census ``c``): a file's bytes are freed when every name they have lies
    below the deleted paths (a local file: its ``st_nlink`` names); where
    the store has no links, every file's bytes are freed."""
    named = free = 0
    seen: dict[object, list[int]] = {}  # identity -> [names found, names in all, size]
    for root in deleted:
        for ident, nlink, size in c.get(root, []):
            named += size
            if ident is None:
                free += size
                continue
            got = seen.setdefault(ident, [0, nlink, size])
            got[0] += 1
    free += sum(size for found, total, size in seen.values() if found >= total)
    return free, named


def freed_by(st: Storage, paths: Iterable[str]) -> tuple[int, int]:
    """:func:`freed` of deleting ``paths`` now (nothing is deleted)."""
    paths = list(paths)
    return freed(census(st, paths), paths)


def stored_bytes(c: Census) -> int:
    """Bytes the store holds for the census's files, each distinct file once."""
    seen: dict[object, int] = {}
    total = 0
    for rows in c.values():
        for ident, _, size in rows:
            if ident is None:
                total += size
            else:
                seen[ident] = size
    return total + sum(seen.values())
