"""Writing one Hugging Face safetensors shard: its header, then each tensor
streamed in blocks read through :func:`reshard.load`, fsync, validation
(used by :func:`reshard.formats.hf_export.export_hf`)."""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import xxhash

from ..collectives import SingleProcess
from ..errors import ManifestError
from ..loading.load import load
from ..ondisk.manifest import Manifest, TensorEntry
from ..ondisk.shardfile import tensor_bytes
from ..options import LoadOptions
from ..state.sharding import (
    VIEW_METADATA_PREFIX,
    ShardedTensor,
    itemsize,
    numel,
    safetensors_entry,
    torch_dtype,
)
from ..storage import Storage

_VALIDATE_BLOCK = 4 << 20
#: tensors larger than this are read and written in blocks of whole rows of
#: at most this many saved bytes (bytes)
READ_BLOCK_BYTES = 32 << 20


@dataclass(frozen=True, kw_only=True)
class _Item:
    out: str  # output (Hugging Face) name
    saved: str  # fqn of the tensor in the checkpoint that holds the bytes
    src_dtype: str
    dtype: str  # output dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * itemsize(self.dtype)


#: safetensors ``__metadata__`` key (a JSON string) and index ``metadata`` key
#: (an object) recording the tied weights an export left out: ``{alias: target}``
TIED_KEY = "tied_weights"


def _header(items: list[_Item], tied: Mapping[str, str] | None = None) -> tuple[bytes, list[_Item]]:
    """The safetensors prefix (u64 length + JSON header padded with spaces to
    8 bytes) and the data order: larger item sizes first, so every tensor
    starts at a multiple of its item size. ``tied``: recorded in ``__metadata__``."""
    order = sorted(items, key=lambda it: (-itemsize(it.dtype), it.out))
    meta: dict[str, str] = {"format": "pt"}
    if tied:
        meta[TIED_KEY] = json.dumps(dict(sorted(tied.items())), separators=(",", ":"))
    header: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for it in order:
        code, shape = safetensors_entry(it.dtype, it.shape)
        if shape != list(it.shape):  # a view (complex128 as float64 pairs): record it
            meta[VIEW_METADATA_PREFIX + it.out] = it.dtype
        header[it.out] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + it.nbytes]}
        pos += it.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb, order


def _write_all(fd: int, data: bytes | memoryview) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        mv = mv[os.write(fd, mv):]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sub_manifest(m: Manifest, fqn: str) -> Manifest:
    """``m`` reduced to the one tensor ``fqn`` and the files its chunks name."""
    te = m.tensors[fqn]
    used = {c.file for c in te.chunks}
    return msgspec.structs.replace(m, tensors={fqn: te}, objects={}, values=None, aliases={},
                                   files={f: m.files[f] for f in used})


def _anon_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in its own anonymous memory map, unmapped (given
    back to the OS) as soon as the tensor is freed. The allocator would keep
    freed blocks of this size in its heaps, and an export's RSS would grow to
    the size of the model instead of one tensor."""
    n = numel(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u8 = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)
    return u8.view(dtype).reshape(shape)


@dataclass(frozen=True)
class _Block:
    """One read request: the box ``[offset, offset + shape)`` of the saved
    tensor, or, with ``flat``, elements ``[flat[0], flat[1])`` of the
    row-major flattening of the whole tensor. Either way a contiguous byte
    range of the tensor in row-major order, so blocks are written back to back."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None = None


def _blocks(it: _Item, te: TensorEntry) -> list[_Block]:
    """The requests that read ``it`` with at most about ``READ_BLOCK_BYTES``
    saved bytes in memory: blocks of whole rows when the saved chunks are
    boxes (row-, column-, block-sharded), flat element ranges when every
    chunk is a flat range of the whole tensor (ZeRO / FSDP flat shards),
    otherwise the whole tensor in one request."""
    shape = it.shape
    whole = [_Block(offset=(0,) * len(shape), shape=shape)]
    isz = itemsize(it.src_dtype)
    if not shape or numel(shape) * isz <= READ_BLOCK_BYTES:
        return whole
    if all(c.flattened_range is None for c in te.chunks):
        rows = shape[0]
        step = max(1, READ_BLOCK_BYTES // max(numel(shape[1:]) * isz, 1))
        return [_Block(offset=(r0,) + (0,) * (len(shape) - 1),
                       shape=(min(rows, r0 + step) - r0, *shape[1:]))
                for r0 in range(0, rows, step)]
    if all(tuple(c.local_shape) == shape for c in te.chunks):
        n, step = numel(shape), max(1, READ_BLOCK_BYTES // isz)
        return [_Block(offset=(0,) * len(shape), shape=shape, flat=(a, min(n, a + step)))
                for a in range(0, n, step)]
    return whole


def _read_block(st: Storage, key: str, m: Manifest, it: _Item, blk: _Block,
                opts: LoadOptions, one: SingleProcess) -> torch.Tensor:
    """One block of the saved tensor ``it.saved``, in the saved dtype, through
    ``reshard.load`` of one request (checksums verified as at any load)."""
    dtype = torch_dtype(it.src_dtype)
    if blk.flat is None:
        buf = _anon_empty(blk.shape, dtype)
        req = ShardedTensor(it.saved, buf, global_shape=it.shape, global_offset=blk.offset)
    else:
        buf = _anon_empty((blk.flat[1] - blk.flat[0],), dtype)
        req = ShardedTensor(it.saved, buf, global_shape=it.shape, global_offset=blk.offset,
                            local_shape=blk.shape, flattened_range=slice(*blk.flat))
    load({"t": req}, key, group=one, options=opts, storage=st, manifest=_sub_manifest(m, it.saved))
    return buf


def _stream_items(st: Storage, key: str, m: Manifest, order: list[_Item], opts: LoadOptions,
                  one: SingleProcess, write: Any) -> tuple[int, dict[str, str]]:
    """Stream the bytes of each item of ``order`` through ``write`` in blocks
    (see :func:`_blocks`; cast to the item's dtype if asked), one block in
    memory at a time. Returns the data bytes written and the xxh3 of each
    item's bytes by output name (for the shard's validation)."""
    total = 0
    digests: dict[str, str] = {}
    for it in order:
        h = xxhash.xxh3_64()
        for blk in _blocks(it, m.tensors[it.saved]):
            t = _read_block(st, key, m, it, blk, opts, one)
            if t.dtype != torch_dtype(it.dtype):
                cast = _anon_empty(tuple(t.shape), torch_dtype(it.dtype))
                cast.copy_(t)
                t = cast
            data = tensor_bytes(t)
            write(data)
            h.update(data)
            total += len(data)
            del t, data
        digests[it.out] = h.hexdigest()
    return total, digests


def _write_shard(st: Storage, key: str, m: Manifest, path: str, shard: list[_Item],
                 opts: LoadOptions, one: SingleProcess, validate: bool, pb: Any,
                 tied: Mapping[str, str] | None = None) -> int:
    """Write one shard: its header, then each tensor streamed in blocks (see
    :func:`_blocks`), cast if asked; fsync; validate."""
    prefix, order = _header(shard, tied)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, prefix)

        def write(data: memoryview) -> None:
            _write_all(fd, data)
            pb.update(len(data))

        total, digests = _stream_items(st, key, m, order, opts, one, write)
        total += len(prefix)
        os.fsync(fd)
    finally:
        os.close(fd)
    if validate:
        _validate_shard(path, order, digests)
    return total


def _validate_shard(path: str, order: list[_Item], digests: Mapping[str, str]) -> None:
    """Check the written shard: ``safetensors`` parses it and lists exactly the
    names, dtypes and shapes written, and the bytes at each tensor's
    ``data_offsets`` (as the file's own header declares them) hash to what was
    written. Reads in blocks of ``_VALIDATE_BLOCK`` bytes (no mapping of the
    shard, so memory stays bounded)."""
    from safetensors import safe_open

    want = {it.out: it for it in order}
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        if keys != set(want):
            raise ManifestError(f"{path}: safetensors lists {sorted(keys ^ set(want))[:5]} unexpectedly")
        for name, it in want.items():
            sl = f.get_slice(name)
            code, shape = sl.get_dtype(), tuple(sl.get_shape())
            wcode, wshape = safetensors_entry(it.dtype, it.shape)
            if code != wcode or list(shape) != wshape:
                raise ManifestError(f"{path}: {name}: reads back as {code} {list(shape)}, "
                                    f"written as {wcode} {wshape}")
    fd = os.open(path, os.O_RDONLY)
    try:
        (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, hlen, 8))
        buf = bytearray(_VALIDATE_BLOCK)
        mv = memoryview(buf)
        for name in want:
            lo, hi = header[name]["data_offsets"]
            h = xxhash.xxh3_64()
            pos = 8 + hlen + lo
            end = 8 + hlen + hi
            while pos < end:
                n = os.preadv(fd, [mv[:min(len(mv), end - pos)]], pos)
                if n <= 0:
                    raise ManifestError(f"{path}: {name}: file ends at {pos}, before {end}")
                h.update(mv[:n])
                pos += n
            if h.hexdigest() != digests[name]:
                raise ManifestError(f"{path}: {name}: bytes read back differ from those written")
    finally:
        os.close(fd)


