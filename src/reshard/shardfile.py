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
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from .sharding import VIEW_METADATA_PREFIX, safetensors_entry
from .storage import Storage


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's elements in row-major order (copies only
    when ``t`` is not contiguous or not on the CPU)."""
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


def write_shard_file(
    storage: Storage,
    path: str,
    items: Sequence[FileItem],
    *,
    block_bytes: int,
    checksums: bool,
    durable: bool,
) -> tuple[int, str, list[WrittenItem]]:
    """Write ``items`` to ``path`` as one safetensors file.

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
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    base = len(prefix)
    out: list[WrittenItem | None] = [None] * len(items)
    stream = storage.open_write(path, durable=durable)
    try:
        stream.write(prefix)
        for i in order:
            it = items[i]
            if checksums:
                sums = it.checksums if it.checksums is not None else block_digests(it.data, block_bytes)
            else:
                sums = ()
            stream.write(it.data)
            out[i] = WrittenItem(offset=base + rel[i], length=len(it.data), checksums=sums)
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
