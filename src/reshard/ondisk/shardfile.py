"""Shard files: valid safetensors files written in one streaming pass.

Layout (the safetensors format): an 8-byte little-endian header length, a
JSON header (padded with spaces to a multiple of 8 bytes) naming every tensor
with its dtype, shape and ``data_offsets`` (relative to the end of the
header), then the tensors' bytes back to back. Tensors are ordered by
descending item size so that each one starts at a multiple of its item size,
and the manifest records each chunk's *absolute* byte range in the file, so a
reader never needs the header.

Checksums (xxh3_64, via the ``xxhash`` library): one per block of
``block_bytes`` of each chunk, and one per file: a hash tree over the header
bytes and the block digests (:func:`file_checksum`), so data is hashed once.

With ``block_table=True`` the per-block digests live beside the data: the
file's last safetensors entry, ``__reshard__/blocks`` (dtype U8), holds the
8-byte digests of every block of every item in file order, and the manifest
records per chunk only the root of its blocks (:func:`block_root`) and the
index of its first block in that table (``WrittenItem.block_index``). The
table is covered by the root in the manifest (and by the file checksum), and
readers verify every block they read against it (:class:`BlockTables`).
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import IntegrityError
from ..state.geometry import VIEW_METADATA_PREFIX, safetensors_entry
from ..storage import Storage

if TYPE_CHECKING:
    import torch

#: name of the block-digest table entry of a shard file
BLOCK_TABLE = "__reshard__/blocks"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's elements in row-major order (copies only
    when ``t`` is not contiguous or not on the CPU)."""
    import torch  # (here: listing and inspection, which use this module, need no torch)

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    if t.stride(0) != 1:  # a single element with any stride counts as contiguous
        t = torch.as_strided(t, (t.numel(),), (1,))
    return memoryview(t.view(torch.uint8).numpy().data).cast("B")


def block_digests(data: memoryview, block_bytes: int) -> tuple[str, ...]:
    """xxh3_64 hex digest of each ``block_bytes`` block of ``data``."""
    n = len(data)
    return tuple(
        xxhash.xxh3_64_hexdigest(data[i : min(i + block_bytes, n)]) for i in range(0, n, block_bytes)
    )


def digest_of(blocks: Sequence[str], nbytes: int) -> str:
    """One digest standing for a chunk's block digests (for replica comparison)."""
    return xxhash.xxh3_64_hexdigest((f"{nbytes}:" + ",".join(blocks)).encode())


class BlockHasher:
    """The xxh3_64 digests of the ``block_bytes`` blocks of a byte stream fed
    in pieces of any length (:meth:`update`); :meth:`finish` returns what
    :func:`block_digests` returns for the whole stream. Whole blocks inside a
    piece are hashed in one call each; a block that straddles pieces is
    hashed incrementally."""

    def __init__(self, block_bytes: int):
        self.block = block_bytes
        self.sums: list[str] = []
        self._h: Any = None
        self._fill = 0

    def update(self, mv: memoryview) -> None:
        b, n, i = self.block, len(mv), 0
        if self._fill:
            take = min(b - self._fill, n)
            self._h.update(mv[:take])
            self._fill += take
            i = take
            if self._fill == b:
                self.sums.append(self._h.hexdigest())
                self._h, self._fill = None, 0
        while n - i >= b:
            self.sums.append(xxhash.xxh3_64_hexdigest(mv[i:i + b]))
            i += b
        if i < n:
            self._h = xxhash.xxh3_64()
            self._h.update(mv[i:])
            self._fill = n - i

    def finish(self) -> tuple[str, ...]:
        if self._fill:
            self.sums.append(self._h.hexdigest())
            self._h, self._fill = None, 0
        return tuple(self.sums)


@dataclass(frozen=True, kw_only=True)
class FileItem:
    """One entry of a shard file: a safetensors name, dtype name, shape and bytes.

    The bytes are ``data``, or, when ``pieces`` is set, what ``pieces()``
    yields, in order (``nbytes`` in all): a staged chunk arriving piece by
    piece, each piece valid until the next one is asked for (the staging
    buffers are reused). ``data`` is then unused.

    ``content``: the xxh3_128 (hex) of the bytes (:func:`content_digest`), recorded
    in the file's header metadata (``reshard.content:<name>``) when given, so a
    later save can tell from the header alone that the file holds these bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    itemsize: int
    checksums: tuple[str, ...] | None = None  # precomputed block digests, if any
    pieces: Callable[[], Iterator[memoryview]] | None = None
    nbytes: int = -1
    content: str | None = None

    @property
    def length(self) -> int:
        """The item's bytes."""
        return self.nbytes if self.pieces is not None else len(self.data)


@dataclass(frozen=True, kw_only=True)
class WrittenItem:
    offset: int  # absolute byte offset in the file
    length: int  # bytes
    checksums: tuple[str, ...]
    block_index: int = -1  # first entry in the file's block table (-1: no table)
    root: str = ""  # block_root of the item's block digests ("" without a table)


#: header metadata key prefix of an item's content digest (``reshard.content:<item name>``)
CONTENT_META_PREFIX = "reshard.content:"

#: data files this process found rotten (a checksum mismatch while loading,
#: verifying or copying), by the store's identity of their bytes (a local
#: file's inode: every name of it): never linked by a later incremental save,
#: which writes those bytes again from its staged copy instead
_ROTTEN: set[object] = set()
_ROTTEN_LOCK = threading.Lock()


def _identity(storage: Storage, path: str) -> object:
    try:
        ident = storage.file_identity(path)
    except Exception:  # noqa: BLE001 - gone or unreadable: known by its key
        ident = None
    return ("key", path) if ident is None else ident[0]


def note_rotten(storage: Storage, path: str) -> None:
    """Remember that the bytes of the data file ``path`` do not match their
    checksums (called where a mismatch is found), so that no incremental
    save of this process links them again."""
    ident = _identity(storage, path)
    with _ROTTEN_LOCK:
        _ROTTEN.add(ident)


def is_rotten(storage: Storage, path: str) -> bool:
    """Whether this process found the bytes of ``path`` rotten (:func:`note_rotten`)."""
    with _ROTTEN_LOCK:
        if not _ROTTEN:
            return False
    ident = _identity(storage, path)
    with _ROTTEN_LOCK:
        return ident in _ROTTEN


def content_digest(data: memoryview) -> str:
    """xxh3_128 (hex, 32 digits) of ``data``: the digest an incremental save
    compares to decide a chunk is unchanged (128 bits: an accidental collision
    among 2**40 distinct chunks has a probability below 2**-48)."""
    return xxhash.xxh3_128_hexdigest(data)


def block_root(raw: bytes) -> str:
    """The digest standing for a chunk's blocks: xxh3_64 (hex) of their 8-byte
    digests concatenated, as stored in the block table."""
    return xxhash.xxh3_64_hexdigest(raw)


def nblocks(length: int, block_bytes: int) -> int:
    return -(-length // block_bytes)


@dataclass(frozen=True, kw_only=True)
class FileLayout:
    """Where everything of one shard file goes, known before a byte is written:
    the ``prefix`` (length and JSON header), the write ``order`` of the items,
    each item's offset relative to the end of the prefix (``rel``) and first
    block-table entry (``first``), and the file's ``size`` in bytes. The same
    items in the same order give the same layout (deterministic)."""

    prefix: bytes
    order: tuple[int, ...]
    rel: dict[int, int]
    first: dict[int, int]
    size: int
    table: bool


def layout_shard_file(items: Sequence[FileItem], *, block_bytes: int, checksums: bool,
                      block_table: bool) -> FileLayout:
    """The :class:`FileLayout` of ``items`` written as one shard file (pure)."""
    order = sorted(range(len(items)), key=lambda i: -items[i].itemsize)
    meta: dict[str, str] = {"format": "reshard"}
    header: dict[str, object] = {"__metadata__": meta}
    pos = 0
    rel: dict[int, int] = {}
    for i in order:
        it = items[i]
        n = it.length
        code, shape = safetensors_entry(it.dtype, it.shape)
        if shape != list(it.shape):  # a view (complex128 as float64 pairs): record it
            meta[VIEW_METADATA_PREFIX + it.name] = it.dtype
        if it.content is not None:
            meta[CONTENT_META_PREFIX + it.name] = it.content
        header[it.name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + n]}
        rel[i] = pos
        pos += n
    table = block_table and checksums
    first: dict[int, int] = {}
    if table:
        count = 0
        for i in order:
            first[i] = count
            count += nblocks(items[i].length, block_bytes)
        header[BLOCK_TABLE] = {"dtype": "U8", "shape": [8 * count], "data_offsets": [pos, pos + 8 * count]}
        pos += 8 * count
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    return FileLayout(prefix=prefix, order=tuple(order), rel=rel, first=first, size=len(prefix) + pos,
                      table=table)


def _item_sums(it: FileItem, block_bytes: int, checksums: bool) -> tuple[str, ...]:
    if not checksums:
        return ()
    return it.checksums if it.checksums is not None else block_digests(it.data, block_bytes)


def _written(items: Sequence[FileItem], lay: FileLayout, sums: dict[int, tuple[str, ...]],
             checksums: bool) -> tuple[int, str, list[WrittenItem]]:
    """``(size, whole-file checksum, WrittenItems in input order)`` of a file of ``lay``."""
    base = len(lay.prefix)
    out: list[WrittenItem | None] = [None] * len(items)
    for i in lay.order:
        root = block_root(b"".join(bytes.fromhex(d) for d in sums[i])) if lay.table else ""
        out[i] = WrittenItem(offset=base + lay.rel[i], length=items[i].length, checksums=sums[i],
                             block_index=lay.first.get(i, -1), root=root)
    digest = file_checksum(lay.prefix, [sums[i] for i in lay.order]) if checksums else ""
    return lay.size, digest, [o for o in out if o is not None]


def write_shard_file(
    storage: Storage,
    path: str,
    items: Sequence[FileItem],
    *,
    block_bytes: int,
    checksums: bool,
    durable: bool,
    block_table: bool = False,
    digests: bool = False,
) -> tuple[int, str, list[WrittenItem]]:
    """Write ``items`` to ``path`` as one safetensors file.

    With ``block_table`` (and ``checksums``), the block digests are also
    written into the file's ``__reshard__/blocks`` entry, last in the file
    (``8 * total blocks`` bytes; see the module docstring). ``digests``: the
    block digests are computed (and returned in each ``WrittenItem``) even
    without ``checksums`` (then recorded nowhere in the file: a replica's
    digest needs them).

    Items are written in descending item size (each one starts at a multiple
    of its item size), in input order among equal sizes; an item given as
    ``pieces`` is asked for its pieces when its turn comes.

    Returns ``(file size in bytes, whole-file xxh3_64 hex digest, one
    WrittenItem per input item in input order)``.
    """
    lay = layout_shard_file(items, block_bytes=block_bytes, checksums=checksums, block_table=block_table)
    sums: dict[int, tuple[str, ...]] = {}
    stream = storage.open_write(path, durable=durable)
    raw_parts: list[bytes] = []
    helper = _Helper()
    try:
        stream.write(lay.prefix)
        for i in lay.order:
            it = items[i]
            hashed = checksums or digests
            if it.pieces is not None:
                sums[i] = _write_stream(stream, it.pieces(), it, block_bytes, hashed, helper)
            elif hashed and it.checksums is None:
                sums[i] = _write_stream(stream, iter((it.data,)), it, block_bytes, True, helper)
            else:
                sums[i] = it.checksums if hashed and it.checksums is not None else ()
                stream.write(it.data)
            if lay.table:
                raw_parts.append(b"".join(bytes.fromhex(d) for d in sums[i]))
        if lay.table:
            stream.write(memoryview(b"".join(raw_parts)))
    except BaseException:
        stream.abort()
        raise
    finally:
        helper.close()
    stream.close()
    return _written(items, lay, sums, checksums)


def link_shard_file(
    storage: Storage,
    src: str,
    path: str,
    items: Sequence[FileItem],
    *,
    block_bytes: int,
    checksums: bool,
    block_table: bool = False,
) -> tuple[int, str, list[WrittenItem]] | None:
    """Make ``path`` the file ``src`` (an earlier checkpoint's) instead of
    writing ``items``, when ``src`` is byte for byte the file
    :func:`write_shard_file` would write: same size, and the same prefix,
    whose header names every item with its dtype, shape, offsets and content
    digest (``FileItem.content``, required on every item). Nothing of
    ``src`` but its size and prefix is read; the link is
    :meth:`~reshard.storage.Storage.link_file` (a hard link, or a copy inside
    the store).

    Returns what :func:`write_shard_file` returns, or None when ``src`` is
    another file, is missing or unreadable, was found rotten by this process
    (:func:`note_rotten`), or the store could not link (the caller then
    writes the file). A file that rotted on the store since it was written
    and that nothing has read since is linked as it is: the rot is then in
    every checkpoint naming it, and ``verify`` and every load of any of them
    find it.
    """
    if not items or any(it.content is None for it in items):
        return None
    lay = layout_shard_file(items, block_bytes=block_bytes, checksums=checksums, block_table=block_table)
    try:
        if storage.is_link(src) or storage.size(src) != lay.size or is_rotten(storage, src):
            return None
        if storage.read_bytes(src, 0, len(lay.prefix)) != lay.prefix:
            return None
        sums = _linked_sums(storage, src, items, lay, block_bytes, checksums)
        if not storage.link_file(src, path):
            return None
    except Exception:  # noqa: BLE001 - any doubt: the caller writes the file
        return None
    return _written(items, lay, sums, checksums)


def _linked_sums(storage: Storage, src: str, items: Sequence[FileItem], lay: FileLayout, block_bytes: int,
                 checksums: bool) -> dict[int, tuple[str, ...]]:
    """The block digests of ``items`` in the file ``src`` that holds them:
    given, or read from its block table (8 bytes a block, at its end), so a
    linked file's bytes are never hashed again."""
    if not checksums or all(it.checksums is not None for it in items):
        return {i: _item_sums(items[i], block_bytes, checksums) for i in lay.order}
    if not lay.table:
        return {i: _item_sums(items[i], block_bytes, checksums) for i in lay.order}
    count = sum(nblocks(it.length, block_bytes) for it in items)
    raw = storage.read_bytes(src, lay.size - 8 * count, 8 * count)
    out = {}
    for i in lay.order:
        k, n = lay.first[i], nblocks(items[i].length, block_bytes)
        out[i] = tuple(raw[8 * j:8 * j + 8].hex() for j in range(k, k + n))
    return out


#: bytes of one write while a helper thread hashes the same bytes
_OVERLAP_BYTES = 8 << 20


class _Helper:
    """One helper thread of a file's writer (made when first needed; it
    inherits the writer thread's priority): hashes a segment while the
    writer writes it."""

    def __init__(self) -> None:
        self._ex: Any = None

    def submit(self, fn: Callable[..., Any], *a: Any) -> Any:
        if self._ex is None:
            from concurrent.futures import ThreadPoolExecutor

            self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-hash")
        return self._ex.submit(fn, *a)

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None


def _write_stream(stream: Any, pieces: Iterator[memoryview], it: FileItem, block_bytes: int, hashed: bool,
                  helper: _Helper) -> tuple[str, ...]:
    """Write an item's bytes, given as pieces (each valid until the next is
    asked for), and return its block digests (when ``hashed``). A piece of
    at least 8 MiB is written in segments of 8 MiB, each hashed by the
    helper thread while this thread writes it (xxh3 and ``write`` both
    release the GIL: on two cores the hashing costs no wall time); smaller
    pieces are hashed, then written.

    Raises:
        IntegrityError: the pieces' bytes are not the item's declared size."""
    h = BlockHasher(block_bytes) if hashed else None
    got = 0
    for mv in pieces:
        n = len(mv)
        if h is None or n < _OVERLAP_BYTES:
            if h is not None:
                h.update(mv)
            stream.write(mv)
        else:
            for a in range(0, n, _OVERLAP_BYTES):
                seg = mv[a:a + _OVERLAP_BYTES]
                fut = helper.submit(h.update, seg)
                try:
                    stream.write(seg)
                finally:
                    fut.result()
        got += n
    if got != it.length:
        raise IntegrityError(f"{it.name}: {got} bytes were staged, {it.length} declared")
    return h.finish() if h is not None else ()


def file_checksum(prefix: bytes, block_digests_in_file_order: Sequence[Sequence[str]]) -> str:
    """A file's checksum as a hash tree: xxh3_64 over the safetensors header
    bytes and the block digests of every item in file order. The data bytes
    are hashed once (per block), never twice."""
    h = xxhash.xxh3_64()
    h.update(prefix)
    for digests in block_digests_in_file_order:
        h.update((",".join(digests) + ";").encode())
    return h.hexdigest()


class BlockTables:
    """Per-block digests of the chunks of one checkpoint, for readers.

    A chunk records either its block digests (``checksums``, older manifests
    and foreign formats) or only their root (``digest``) and the index of its
    first block in its file's block table. :meth:`sums` returns the digests
    either way, reading each file's table once (thread safe) and checking the
    chunk's slice against the root in the manifest.
    """

    def __init__(self, st: Storage, ckpt: str, m: Any):
        self.st, self.ckpt, self.m = st, ckpt, m
        self._tables: dict[str, bytes] = {}
        self._sums: dict[tuple[str, int], tuple[str, ...]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def has(c: Any) -> bool:
        """Whether chunk (or object chunk) ``c`` has block digests to verify against."""
        return bool(c.checksums) or bool(getattr(c, "digest", ""))

    def _table(self, name: str) -> bytes:
        with self._lock:
            t = self._tables.get(name)
        if t is None:
            fe = self.m.files[name]
            n = 8 * fe.blocks
            try:
                t = self.st.read_bytes(self.st.join(self.ckpt, name), fe.size - n, n) if n else b""
            except FileNotFoundError:
                raise IntegrityError(f"{self.st.join(self.ckpt, name)}: data file named by the manifest "
                                     "is missing") from None
            with self._lock:
                self._tables[name] = t
        return t

    def sums(self, c: Any) -> tuple[str, ...]:
        """The hex digests of every block of chunk ``c`` (empty when none were saved).

        Raises:
            IntegrityError: the block table does not match the chunk's root
                digest in the manifest (the table was altered or truncated).
        """
        if c.checksums or not getattr(c, "digest", ""):
            return tuple(c.checksums)
        key = (c.file, c.offset)
        got = self._sums.get(key)
        if got is not None:
            return got
        n = nblocks(c.length, self.m.checksum_block_bytes)
        raw = self._table(c.file)[8 * c.block_index:8 * (c.block_index + n)]
        if len(raw) != 8 * n or block_root(raw) != c.digest:
            note_rotten(self.st, self.st.join(self.ckpt, c.file))
            raise IntegrityError(
                f"{self.st.join(self.ckpt, c.file)}: checksum mismatch: the block digests of the chunk "
                f"at file bytes [{c.offset}, {c.offset + c.length}) do not match the manifest's digest "
                "(the file's block table was altered or truncated)")
        got = tuple(raw[8 * k:8 * k + 8].hex() for k in range(n))
        self._sums[key] = got
        return got
