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
from collections.abc import Sequence
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


@dataclass(frozen=True, kw_only=True)
class FileItem:
    """One entry of a shard file: a safetensors name, dtype name, shape and bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    itemsize: int
    checksums: tuple[str, ...] | None = None  # precomputed block digests, if any


@dataclass(frozen=True, kw_only=True)
class WrittenItem:
    offset: int  # absolute byte offset in the file
    length: int  # bytes
    checksums: tuple[str, ...]
    block_index: int = -1  # first entry in the file's block table (-1: no table)
    root: str = ""  # block_root of the item's block digests ("" without a table)


def block_root(raw: bytes) -> str:
    """The digest standing for a chunk's blocks: xxh3_64 (hex) of their 8-byte
    digests concatenated, as stored in the block table."""
    return xxhash.xxh3_64_hexdigest(raw)


def nblocks(length: int, block_bytes: int) -> int:
    return -(-length // block_bytes)


def write_shard_file(
    storage: Storage,
    path: str,
    items: Sequence[FileItem],
    *,
    block_bytes: int,
    checksums: bool,
    durable: bool,
    block_table: bool = False,
) -> tuple[int, str, list[WrittenItem]]:
    """Write ``items`` to ``path`` as one safetensors file.

    With ``block_table`` (and ``checksums``), the block digests are also
    written into the file's ``__reshard__/blocks`` entry, last in the file
    (``8 * total blocks`` bytes; see the module docstring).

    Returns ``(file size in bytes, whole-file xxh3_64 hex digest, one
    WrittenItem per input item in input order)``.
    """
    order = sorted(range(len(items)), key=lambda i: -items[i].itemsize)
    meta: dict[str, str] = {"format": "reshard"}
    header: dict[str, object] = {"__metadata__": meta}
    pos = 0
    rel: dict[int, int] = {}
    for i in order:
        it = items[i]
        n = len(it.data)
        code, shape = safetensors_entry(it.dtype, it.shape)
        if shape != list(it.shape):  # a view (complex128 as float64 pairs): record it
            meta[VIEW_METADATA_PREFIX + it.name] = it.dtype
        header[it.name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + n]}
        rel[i] = pos
        pos += n
    table = block_table and checksums
    first: dict[int, int] = {}
    if table:
        count = 0
        for i in order:
            first[i] = count
            count += nblocks(len(items[i].data), block_bytes)
        header[BLOCK_TABLE] = {"dtype": "U8", "shape": [8 * count], "data_offsets": [pos, pos + 8 * count]}
        pos += 8 * count
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    base = len(prefix)
    out: list[WrittenItem | None] = [None] * len(items)
    stream = storage.open_write(path, durable=durable)
    raw_parts: list[bytes] = []
    try:
        stream.write(prefix)
        for i in order:
            it = items[i]
            if checksums:
                sums = it.checksums if it.checksums is not None else block_digests(it.data, block_bytes)
            else:
                sums = ()
            stream.write(it.data)
            root = ""
            if table:
                raw = b"".join(bytes.fromhex(d) for d in sums)
                raw_parts.append(raw)
                root = block_root(raw)
            out[i] = WrittenItem(offset=base + rel[i], length=len(it.data), checksums=sums,
                                 block_index=first.get(i, -1), root=root)
        if table:
            stream.write(memoryview(b"".join(raw_parts)))
    except BaseException:
        stream.abort()
        raise
    stream.close()
    written = [o for o in out if o is not None]
    digest = file_checksum(prefix, [out[i].checksums for i in order]) if checksums else ""  # type: ignore[union-attr]
    return base + pos, digest, written


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
            raise IntegrityError(
                f"{self.st.join(self.ckpt, c.file)}: checksum mismatch: the block digests of the chunk "
                f"at file bytes [{c.offset}, {c.offset + c.length}) do not match the manifest's digest "
                "(the file's block table was altered or truncated)")
        got = tuple(raw[8 * k:8 * k + 8].hex() for k in range(n))
        self._sums[key] = got
        return got
