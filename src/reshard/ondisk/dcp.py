"""Import of PyTorch Distributed Checkpoint (DCP) directories, without unpickling.

A DCP checkpoint (``torch.distributed.checkpoint.save`` with the default
``FileSystemWriter``) is a directory holding ``.metadata`` (a pickle of
``torch.distributed.checkpoint.metadata.Metadata``) and ``__<rank>_<n>.distcp``
data files. Every tensor item in a data file is a ``torch.save`` blob of one
chunk; every BYTE_IO item (non-tensor state) is the ``torch.save`` of a Python
value. ``Metadata.storage_data`` maps ``MetadataIndex(fqn, chunk offset)`` to
``_StorageInfo(relative_path, offset, length, transform_descriptors)``.

Nothing here unpickles without restriction (DESIGN.md section 3):

* ``.metadata`` is read by :class:`_MetadataUnpickler`, whose ``find_class``
  resolves only the DCP metadata records, ``torch.Size``, torch dtype / layout
  / memory-format singletons and a few harmless builtins; any other global is
  refused with :class:`~reshard.errors.ManifestError` before anything runs.
  The DCP record classes it hands out are fresh subclasses made for each read,
  and the callables (layout and enum look-ups, paths) are wrappers, so a
  crafted pickle cannot alter torch's own classes (``BUILD`` on a class object
  only touches the throwaway subclass).
* Data items are decoded with ``torch.load(..., weights_only=True)`` (torch's
  restricted unpickler) and must be plain strided tensors of the dtype and
  shape the metadata declares; anything else is an
  :class:`~reshard.errors.IntegrityError` when it is read.

API:

* :func:`read_dcp_metadata` -- the ``Metadata`` record of a DCP directory.
* :func:`open_dcp` -- ``(storage, manifest)``: a read-only :class:`Storage`
  presenting each DCP tensor chunk as a virtual file of its raw row-major
  bytes (decoded lazily, bounded LRU), and a reshard :class:`Manifest` over
  it, for ``reshard.load(state, path, storage=..., manifest=...)``.
  ``reshard.load(state, path)`` does this by itself when ``path`` holds a
  ``.metadata`` and no ``manifest.json``.
* :func:`reshard.formats.dcp_convert.convert_dcp` -- write a committed reshard
  checkpoint from a DCP one.

Only the default ``torch_save`` serialization of ``FileSystemWriter`` is
supported; stream transforms (``transform_descriptors``, e.g. compression
extensions) and the safetensors serialization are refused.
"""

from __future__ import annotations

import collections
import io
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, IntegrityError, ManifestError, ShardingError, StorageError
from ..state.sharding import dtype_name, itemsize, numel
from ..storage import Capabilities, Storage, WriteStream, resolve
from . import codec
from .dcp_blob import decode_tensor_blob
from .dcp_metadata import (  # noqa: F401 - the listing helpers live there (no torch)
    DCP_METADATA,
    _read_metadata,
    dcp_checkpoints,
    is_dcp_checkpoint,
    read_dcp_metadata,
)
from .dcp_values import DCP_TENSOR_PATHS, DCP_VALUES
from .manifest import Chunk, FileEntry, Manifest, TensorEntry, check_file_name, validate_manifest

__all__ = [
    "DCP_METADATA",
    "DCPStorage",
    "is_dcp_checkpoint",
    "open_dcp",
    "read_dcp_metadata",
]

#: a DCP item (torch.save blob) at most this large (bytes) is read with one
#: ranged read and decoded from memory; a larger one is streamed
WHOLE_BLOB_BYTES = 16 << 20
#: default bound of the decoded-chunk cache of :class:`DCPStorage`, in bytes
DEFAULT_CACHE_BYTES = 256 << 20
# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class _Item:
    """One DCP tensor chunk served as a virtual file."""

    fqn: str
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    file: str  # DCP data file (relative)
    offset: int  # of the torch.save blob in it
    length: int

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * itemsize(self.dtype)


class DCPStorage(Storage):
    """A read-only view of a DCP checkpoint directory: each tensor chunk is a
    virtual file (named as in the manifest :func:`open_dcp` returns) holding
    the chunk's raw row-major bytes.

    A chunk is decoded from its ``torch.save`` blob on first use with
    ``torch.load(weights_only=True)`` and kept in an LRU bounded to
    ``cache_bytes`` (a chunk larger than that is decoded, served and dropped),
    so memory is at most ``cache_bytes`` plus one decoded chunk per reader
    thread. ``bytes_read`` counts bytes served; ``blob_bytes_read`` the bytes
    read from the underlying storage.
    """

    capabilities = Capabilities(atomic_rename=False, listing=True, ranged_reads=True, durable_sync=False)

    def __init__(self, base: Storage, root: str, items: Mapping[str, _Item], *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        super().__init__()
        self.base, self.root, self.items = base, root, dict(items)
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._cached = 0
        self._decoding: dict[str, threading.Lock] = {}
        self.decodes = 0
        self._checked_files: set[str] = set()
        self._file_sizes: dict[str, int] = {}

    # -- the chunk cache
    @property
    def cached_bytes(self) -> int:
        return self._cached

    @property
    def blob_bytes_read(self) -> int:
        return self.base.bytes_read

    def _item(self, path: str) -> tuple[str, _Item]:
        name = self.basename(path)
        it = self.items.get(name)
        if it is None or self.parent(path) not in (self.root, ""):
            raise FileNotFoundError(path)
        return name, it

    def chunk(self, name: str, *, keep: bool = True) -> torch.Tensor:
        """The decoded bytes (uint8, 1-D) of virtual file ``name``; ``keep``:
        put them in the LRU (a reader of the whole chunk does not need to)."""
        with self._lock:
            t = self._cache.get(name)
            if t is not None:
                self._cache.move_to_end(name)
                return t
            lk = self._decoding.setdefault(name, threading.Lock())
        with lk:
            with self._lock:
                t = self._cache.get(name)
                if t is not None:
                    self._cache.move_to_end(name)
                    return t
            t = self._decode(name, self.items[name])
            with self._lock:
                self._decoding.pop(name, None)
                n = t.numel()
                if keep and n <= self.cache_bytes:
                    self._cache[name] = t
                    self._cached += n
                    while self._cached > self.cache_bytes:
                        _, old = self._cache.popitem(last=False)
                        self._cached -= old.numel()
        return t

    def tensor(self, name: str) -> torch.Tensor:
        """Virtual file ``name`` decoded as its tensor (dtype and shape of the chunk)."""
        from ..state.sharding import torch_dtype

        it = self.items[name]
        return self.chunk(name).view(torch_dtype(it.dtype)).reshape(it.shape)

    def _decode(self, name: str, it: _Item) -> torch.Tensor:
        where = f"{self.base.join(self.root, it.file)}: DCP item {it.fqn!r} chunk at {list(it.global_offset)}"
        fpath = self.base.join(self.root, it.file)
        if it.file not in self._checked_files:
            if self.base.is_link(fpath):
                raise ManifestError(f"{fpath}: DCP data file is a symbolic link (refused)")
            self._checked_files.add(it.file)
        with self._lock:
            size = self._file_sizes.get(it.file)
        if size is None:  # one stat per data file, not one per item
            try:
                size = self.base.size(fpath)
            except FileNotFoundError:
                raise IntegrityError(f"{where}: data file is missing") from None
            with self._lock:
                self._file_sizes[it.file] = size
        if it.offset + it.length > size:
            raise IntegrityError(f"{where}: bytes [{it.offset}, {it.offset + it.length}) reach past "
                                 f"the end ({size} bytes) of the file")
        if it.length <= WHOLE_BLOB_BYTES:  # one ranged read, then decoded from memory
            raw = self.base.read_bytes(fpath, it.offset, it.length)
            obj = decode_tensor_blob(raw)  # the narrow fast path (dcp_blob), else torch.load
            if obj is None:
                obj = _torch_load(io.BytesIO(raw), where=where)
        else:  # torch.load reads the storage record with one readinto straight into the
            # tensor's memory: no intermediate copy of a large blob
            obj = _torch_load(_BlobReader(self.base, fpath, it.offset, it.length), where=where)
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise IntegrityError(f"{where}: holds a {type(obj).__module__}.{type(obj).__qualname__}, "
                                 "not a tensor (refused)")
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            raise IntegrityError(f"{where}: holds a {obj.layout} tensor, not a plain strided one")
        try:
            got = dtype_name(obj.dtype)
        except ShardingError:
            got = str(obj.dtype)
        if got != it.dtype or tuple(obj.shape) != it.shape:
            raise IntegrityError(f"{where}: holds a {got} tensor of shape {list(obj.shape)}, the metadata "
                                 f"declares {it.dtype} {list(it.shape)}")
        t = obj.detach()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != it.nbytes:
            t = t.clone(memory_format=torch.contiguous_format)  # drop a larger shared storage
        flat = t.reshape(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:
            flat = torch.as_strided(flat, (1,), (1,))
        self.decodes += 1
        return flat.view(torch.uint8)

    # -- reading
    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        name, it = self._item(path)
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        n = len(buf)
        if offset < 0 or offset + n > it.nbytes:
            raise IntegrityError(f"{path}: bytes [{offset}, {offset + n}) reach past the "
                                 f"{it.nbytes} bytes of DCP item {it.fqn!r}")
        if n:
            src = self.chunk(name, keep=n < it.nbytes)[offset:offset + n]
            np.frombuffer(buf, dtype=np.uint8)[:] = src.numpy()
        self._count_read(n)

    def size(self, path: str) -> int:
        """The decoded size of virtual file ``path``, once the DCP data file
        holding it is confirmed present and long enough (one ``size`` call
        per data file), so a load's check of every needed file, before any
        target is written, covers the DCP files too.

        Raises:
            FileNotFoundError: no such item, or its DCP data file is missing.
            IntegrityError: the data file ends before the item's bytes.
        """
        _, it = self._item(path)
        fpath = self.base.join(self.root, it.file)
        with self._lock:
            fsize = self._file_sizes.get(it.file)
        if fsize is None:
            fsize = self.base.size(fpath)
            with self._lock:
                self._file_sizes[it.file] = fsize
        if it.offset + it.length > fsize:
            raise IntegrityError(f"{fpath}: DCP item {it.fqn!r} bytes [{it.offset}, "
                                 f"{it.offset + it.length}) reach past the end ({fsize} bytes) of the file")
        return it.nbytes

    def exists(self, path: str) -> bool:
        try:
            self._item(path)
        except FileNotFoundError:
            return path.rstrip("/") == self.root
        return True

    def list_dir(self, path: str) -> list[str]:
        if path.rstrip("/") != self.root:
            raise FileNotFoundError(path)
        return sorted(self.items)

    def modified_time(self, path: str) -> float | None:
        return self.base.modified_time(self.base.join(self.root, DCP_METADATA))

    # -- writing: refused
    def makedirs(self, path: str) -> None:
        raise StorageError(f"{path}: a DCP checkpoint is read-only")

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        raise StorageError(f"{path}: a DCP checkpoint is read-only")

    def rename_dir(self, src: str, dst: str) -> None:
        raise StorageError(f"{src}: a DCP checkpoint is read-only")

    def delete_tree(self, path: str) -> None:
        raise StorageError(f"{path}: a DCP checkpoint is read-only")


class _BlobReader(io.RawIOBase):
    """A seekable, read-only file over bytes ``[offset, offset + length)`` of
    ``path`` in ``storage`` (reads are ranged reads of the storage)."""

    def __init__(self, storage: Storage, path: str, offset: int, length: int):
        super().__init__()
        self.st, self.path, self.base, self.length, self.pos = storage, path, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        pos = off if whence == 0 else self.pos + off if whence == 1 else self.length + off
        if pos < 0:
            raise ValueError("negative seek position")
        self.pos = pos
        return pos

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self.length - self.pos))
        if n:
            self.st.read_into(self.path, self.base + self.pos, mv[:n])
            self.pos += n
        return n


def _torch_load(raw: Any, *, where: str) -> Any:
    """``torch.load(weights_only=True)`` of one item (bytes or a seekable
    file); any refusal or decoding failure is an IntegrityError naming the item."""
    try:
        return torch.load(io.BytesIO(raw) if isinstance(raw, bytes) else raw, weights_only=True,
                          map_location="cpu")
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = ""
        if "reshard.state.sharding" in str(e):  # a reshard Stateful's state_dict saved by dcp.save
            hint = (": a reshard ShardedObject/ShardedTensor pickled by dcp.save (save reshard "
                    "adapters with reshard.save, or give dcp.save DCP-native state: get_state_dict)")
        raise IntegrityError(f"{where}: not loadable with torch.load(weights_only=True){hint} "
                             f"({type(e).__name__}: {msg[:300]})") from None


# --------------------------------------------------------------------------- manifest


def _ints(x: Any, *, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(x, (torch.Size, tuple, list)) or not all(type(v) is int for v in x):
        raise ManifestError(f"{where}: {what} must be a sequence of ints, got {x!r:.200}")
    return tuple(x)


def _value_paths(md: Any, byte_fqns: list[str], tensor_fqns: list[str]) -> dict[str, tuple[Any, ...]]:
    """Original state-dict paths of the DCP keys (``planner_data`` of the
    default planner); a key without one stands for itself."""
    pdata = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, tuple[Any, ...]] = {}
    for k in [*byte_fqns, *tensor_fqns]:
        p = pdata.get(k)
        if (isinstance(p, tuple) and p and all(type(c) in (str, int) for c in p)
                and ".".join(map(str, p)) == k):
            out[k] = p
        else:
            out[k] = (k,)
    return out


@dataclass(frozen=True)
class _StorageIndex:
    """``storage_data`` of a DCP ``Metadata``, checked.

    Attributes:
        infos: ``(fqn, chunk offset)`` -> its ``_StorageInfo`` (offset None
            for a BYTE_IO item); each location lies inside its data file.
        file_sizes: data file name (relative) -> size in bytes, in the order
            first named.
    """

    infos: Mapping[tuple[str, tuple[int, ...] | None], Any]
    file_sizes: Mapping[str, int]


@dataclass(frozen=True)
class _TensorIndex:
    """The tensors of a DCP ``state_dict_metadata``.

    Attributes:
        items: virtual file name (``dcp-NNNNNN``) -> the DCP chunk it serves.
        tensors: fqn -> its manifest entry (non-empty chunks, sorted by offset).
        skipped: fqn -> why the tensor is not offered (a dtype off the allow-list).
        byte_fqns: the BYTE_IO keys, sorted.
    """

    items: Mapping[str, _Item]
    tensors: Mapping[str, TensorEntry]
    skipped: Mapping[str, str]
    byte_fqns: tuple[str, ...]


@dataclass(frozen=True)
class _ByteValues:
    """The BYTE_IO values of a DCP checkpoint, as the manifest records them.

    Attributes:
        paths: DCP key -> its state-dict path (tensors' keys included).
        table: DCP key -> ``[state-dict path, length of its default group's path]``
            (the manifest's ``extra[DCP_VALUES]``).
        values: DCP key -> value in :mod:`reshard.ondisk.codec`'s encoding.
        skipped: DCP key -> why it was not decoded.
    """

    paths: Mapping[str, tuple[Any, ...]]
    table: Mapping[str, list[Any]]
    values: Mapping[str, Any]
    skipped: Mapping[str, str]


def _build(st: Storage, key: str, md: Any, *, values: bool,
           limits: Any = None) -> tuple[dict[str, _Item], Manifest]:
    """The virtual files and the manifest of the DCP checkpoint ``md`` (its
    ``Metadata``) at ``key`` of ``st``, in steps: the storage index
    (:func:`_index_storage`), the tensors (:func:`_index_tensors`), the
    values (:func:`_byte_values`), the manifest (:func:`_dcp_manifest`).

    Raises:
        ManifestError, IntegrityError: as :func:`open_dcp`; AttributeError,
            TypeError, KeyError from records of the right class with wrong
            contents (:func:`open_dcp` reports them as ManifestError).
    """
    where = st.join(key, DCP_METADATA)
    sdm = md.state_dict_metadata
    sdata = md.storage_data
    if not isinstance(sdm, dict) or not isinstance(sdata, dict):
        raise ManifestError(f"{where}: state_dict_metadata and storage_data must be dicts")
    index = _index_storage(st, key, sdata, where)
    ti = _index_tensors(sdm, index.infos, where)
    bv = _byte_values(st, key, md, where, ti, index.infos, values=values, limits=limits)
    m = _dcp_manifest(st, md, where, index, ti, bv)
    validate_manifest(m, where=f"{where} (as a reshard manifest)")
    return dict(ti.items), m


def _index_storage(st: Storage, key: str, sdata: dict[Any, Any], where: str) -> _StorageIndex:
    """Check ``storage_data`` field by field: every key a ``MetadataIndex``,
    every value a ``_StorageInfo`` without stream transforms whose data file
    is a plain name, present, not a link, and holds its bytes.

    Raises:
        ManifestError: a malformed record, a file name outside the directory,
            a symbolic link, stream transforms.
        IntegrityError: a data file is missing or ends before a location.
    """
    from torch.distributed.checkpoint import metadata as dm
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    infos: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    file_sizes: dict[str, int] = {}
    for idx, info in sdata.items():
        fqn = getattr(idx, "fqn", None)
        if type(fqn) is not str or not isinstance(idx, dm.MetadataIndex):
            raise ManifestError(f"{where}: storage_data key {idx!r:.200} is not a MetadataIndex")
        off = None if idx.offset is None else _ints(idx.offset, what="offset", where=f"{where}: {fqn}")
        if not isinstance(info, _StorageInfo):
            raise ManifestError(f"{where}: storage_data[{fqn!r}] is not a _StorageInfo")
        rel, o, n = info.relative_path, info.offset, info.length
        if type(rel) is not str or type(o) is not int or type(n) is not int or o < 0 or n < 0:
            raise ManifestError(f"{where}: storage_data[{fqn!r}] has a malformed location {info!r:.200}")
        check_file_name(rel, where=f"{where}: {fqn}")
        if getattr(info, "transform_descriptors", None):
            raise ManifestError(f"{where}: {fqn}: stream transforms {info.transform_descriptors!r} "
                                "are not supported by this reader")
        if rel not in file_sizes:
            p = st.join(key, rel)
            if st.is_link(p):
                raise ManifestError(f"{p}: DCP data file is a symbolic link (refused)")
            try:
                file_sizes[rel] = st.size(p)
            except FileNotFoundError:
                raise IntegrityError(f"{p}: data file named by the DCP metadata is missing") from None
        if o + n > file_sizes[rel]:
            raise IntegrityError(f"{where}: {fqn}: bytes [{o}, {o + n}) reach past the end "
                                 f"({file_sizes[rel]} bytes) of {rel!r}")
        infos[(fqn, off)] = info
    return _StorageIndex(infos=infos, file_sizes=file_sizes)


def _index_tensors(sdm: dict[Any, Any], infos: Mapping[tuple[str, tuple[int, ...] | None], Any],
                   where: str) -> _TensorIndex:
    """Sort ``state_dict_metadata`` into tensors (:func:`_tensor_entry`, in
    key order: the virtual files are numbered in that order) and BYTE_IO keys.

    Raises:
        ManifestError: a key that is not a str, unknown storage metadata, or
            a malformed tensor record.
    """
    from torch.distributed.checkpoint import metadata as dm

    items: dict[str, _Item] = {}
    tensors: dict[str, TensorEntry] = {}
    skipped_tensors: dict[str, str] = {}
    byte_fqns: list[str] = []
    for fqn in sorted(sdm):
        meta = sdm[fqn]
        if type(fqn) is not str:
            raise ManifestError(f"{where}: state_dict_metadata key {fqn!r:.100} is not a str")
        if isinstance(meta, dm.BytesStorageMetadata):
            byte_fqns.append(fqn)
            continue
        if not isinstance(meta, dm.TensorStorageMetadata):
            raise ManifestError(f"{where}: {fqn}: unknown storage metadata {type(meta).__name__}")
        entry = _tensor_entry(fqn, meta, infos, items, where)
        if isinstance(entry, str):
            skipped_tensors[fqn] = entry
        else:
            tensors[fqn] = entry
    return _TensorIndex(items=items, tensors=tensors, skipped=skipped_tensors, byte_fqns=tuple(byte_fqns))


def _tensor_entry(fqn: str, meta: Any, infos: Mapping[tuple[str, tuple[int, ...] | None], Any],
                  items: dict[str, _Item], where: str) -> TensorEntry | str:
    """The manifest entry of tensor ``fqn`` (its ``TensorStorageMetadata``
    ``meta``), adding a virtual file to ``items`` for each non-empty chunk;
    a str: the reason the tensor is not offered (a dtype off reshard's
    allow-list; a load that asks for it reports it missing).

    Raises:
        ManifestError: malformed properties, chunks or sizes, a layout other
            than strided, a chunk of another rank or without storage_data.
    """
    from torch.distributed.checkpoint import metadata as dm

    w = f"{where}: tensor {fqn!r}"
    props = meta.properties
    if not isinstance(props, dm.TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise ManifestError(f"{w}: malformed TensorProperties")
    try:
        dt = dtype_name(props.dtype)
    except ShardingError:
        return f"dtype {props.dtype} is not on reshard's allow-list"
    if props.layout != torch.strided:
        raise ManifestError(f"{w}: layout {props.layout} is not supported")
    gshape = _ints(meta.size, what="size", where=w)
    if not isinstance(meta.chunks, list):
        raise ManifestError(f"{w}: chunks must be a list")
    chunks: list[Chunk] = []
    for c in meta.chunks:
        if not isinstance(c, dm.ChunkStorageMetadata):
            raise ManifestError(f"{w}: malformed chunk {c!r:.200}")
        off = _ints(c.offsets, what="chunk offsets", where=w)
        shape = _ints(c.sizes, what="chunk sizes", where=w)
        if len(off) != len(gshape) or len(shape) != len(gshape):
            raise ManifestError(f"{w}: chunk at {list(off)} has another rank than {list(gshape)}")
        if numel(shape) == 0:
            continue  # an empty shard (uneven FSDP): nothing to read
        info = infos.get((fqn, off))
        if info is None:
            raise ManifestError(f"{w}: chunk at {list(off)} has no storage_data entry")
        name = f"dcp-{len(items):06d}"
        it = _Item(fqn=fqn, global_offset=off, shape=shape, dtype=dt, file=info.relative_path,
                   offset=info.offset, length=info.length)
        items[name] = it
        chunks.append(Chunk(global_offset=off, local_shape=shape, file=name, offset=0,
                            length=it.nbytes))
    return TensorEntry(dtype=dt, global_shape=gshape,
                       chunks=tuple(sorted(chunks, key=lambda c: c.global_offset)))


def _byte_values(st: Storage, key: str, md: Any, where: str, ti: _TensorIndex,
                 infos: Mapping[tuple[str, tuple[int, ...] | None], Any], *, values: bool,
                 limits: Any) -> _ByteValues:
    """Every BYTE_IO item is kept as the value of its own DCP key; its
    state-dict path and default group (the largest container without a
    tensor below it) are recorded, so that a load regroups the values into
    the paths it asks for (:func:`reshard.ondisk.dcp_values.regroup`). Each
    is decoded by :func:`_decode_value` (``values``: else none is); one
    that fails is listed as skipped, with the reason."""
    vals: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    all_tensors = [*ti.tensors, *ti.skipped]
    paths = _value_paths(md, list(ti.byte_fqns), all_tensors)
    tensor_prefixes = {paths[f][:i] for f in all_tensors for i in range(1, len(paths[f]) + 1)}
    groups: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], str]]] = {}
    order = {k: i for i, k in enumerate(md.planner_data)} if isinstance(md.planner_data, dict) else {}
    for fqn in sorted(ti.byte_fqns, key=lambda k: (order.get(k, len(order)), k)):
        vp = paths[fqn]
        cut = next((i for i in range(1, len(vp) + 1) if vp[:i] not in tensor_prefixes), len(vp))
        groups.setdefault(vp[:cut], []).append((vp[cut:], fqn))
    table: dict[str, list[Any]] = {}
    for root, members in groups.items():
        for _sub, fqn in members:
            table[fqn] = [list(paths[fqn]), len(root)]
            if not values:
                skipped[fqn] = "not decoded (values=False)"
                continue
            try:
                vals[fqn] = _decode_value(st, key, where, fqn, infos, limits)
            except (CheckpointError, TypeError, ValueError) as e:
                skipped[fqn] = f"{type(e).__name__}: {e}"[:500]
    return _ByteValues(paths=paths, table=table, values=vals, skipped=skipped)


def _decode_value(st: Storage, key: str, where: str, fqn: str,
                  infos: Mapping[tuple[str, tuple[int, ...] | None], Any], limits: Any) -> Any:
    """BYTE_IO item ``fqn``, read (at most ``limits.value_bytes``), decoded
    with ``torch.load(weights_only=True)`` and encoded by :func:`codec.to_json`.

    Raises:
        ManifestError: no storage_data entry, or larger than ``value_bytes``.
        IntegrityError: not loadable with ``torch.load(weights_only=True)``.
        TypeError: a value the codec cannot store.
    """
    info = infos.get((fqn, None))
    if info is None:
        raise ManifestError(f"{fqn}: no storage_data entry")
    from .limits import default_limits, too_large

    cap = (limits if limits is not None else default_limits()).value_bytes
    if isinstance(info.length, int) and info.length > cap:
        raise ManifestError(too_large(f"{where}: value {fqn!r}", "the encoded value",
                                      info.length, cap, "value_bytes"))
    raw = st.read_bytes(st.join(key, info.relative_path), info.offset, info.length)
    return codec.to_json(_torch_load(raw, where=f"{where}: value {fqn!r}"), path=fqn)


def _dcp_manifest(st: Storage, md: Any, where: str, index: _StorageIndex, ti: _TensorIndex,
                  bv: _ByteValues) -> Manifest:
    """The reshard manifest of the checked parts (not yet validated): world
    size from the data files' ``__<rank>_`` names, ``extra`` recording the
    DCP source, its value table, tensor paths and what was skipped; the step
    from a top-level ``step`` or TorchTitan's ``train_state.step`` value."""
    ranks = [re.match(r"__(\d+)_", f) for f in index.file_sizes]
    world = 1 + max((int(r.group(1)) for r in ranks if r is not None), default=0)
    sm = getattr(md, "storage_meta", None)
    save_id = getattr(sm, "save_id", None)
    extra: dict[str, Any] = {"source": "dcp", "dcp_version": md.version if type(md.version) is str else None,
                             "dcp_files": len(index.file_sizes)}
    if bv.table:
        extra[DCP_VALUES] = dict(bv.table)
    paths = bv.paths
    tensor_paths = {f: list(paths[f]) for f in ti.tensors if paths[f] != (f,)}
    if tensor_paths:
        extra[DCP_TENSOR_PATHS] = tensor_paths
    if bv.skipped:
        extra["dcp_skipped_values"] = dict(bv.skipped)
    if ti.skipped:
        extra["dcp_skipped_tensors"] = dict(ti.skipped)
    try:
        created = st.modified_time(where) or 0.0
    except Exception:  # noqa: BLE001
        created = 0.0
    # the training step the state dict saved at its top level ({"app": ..., "step": 5}), as DCP's
    # own tutorials do, or in TorchTitan's train state ({"train_state": {"step": 5, ...}});
    # reshard's manifests carry it as `step`
    vals = bv.values
    found = [v for v in (vals.get("step"), vals.get("train_state.step")) if type(v) is int]
    step = found[0] if found else None
    return Manifest(
        attempt_id=f"dcp-{save_id}" if type(save_id) is str else "dcp",
        created_at=round(created, 3), world_size=world, checksum_block_bytes=1 << 20,
        tensors=dict(ti.tensors), values=dict(vals),
        step=step, files={name: FileEntry(size=it.nbytes) for name, it in ti.items.items()}, extra=extra,
    )


def open_dcp(
    path: str | os.PathLike[str],
    *,
    storage: Storage | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    values: bool = True,
    limits: Any = None,
) -> tuple[DCPStorage, Manifest]:
    """Present the DCP checkpoint at ``path`` as ``(storage, manifest)`` for
    ``reshard.load(state, path, storage=storage, manifest=manifest)``.

    The manifest lists every tensor (dtype, global shape, one chunk per
    non-empty DCP chunk, no checksums: DCP records none) over virtual files of
    ``storage``; common values come from the BYTE_IO items, decoded with
    ``torch.load(weights_only=True)``, one per DCP key (``sched.last_epoch``,
    ``optim.param_groups.0.lr``), with their state-dict paths recorded so
    that :func:`reshard.load` regroups them into the paths the target state
    asks for (:mod:`reshard.ondisk.dcp_values`: ``optim.param_groups`` as
    one list, a dict whose keys were exactly ``0..n-1`` as a list).
    Values that cannot be decoded that way or stored in reshard's encoding are
    skipped and listed in ``manifest.extra["dcp_skipped_values"]``; tensors of
    a dtype outside reshard's allow-list (float8 variants, ...) in
    ``manifest.extra["dcp_skipped_tensors"]`` (a strict load asking for one
    reports it missing).

    Args:
        storage: backend holding the DCP directory (default: resolve ``path``).
        cache_bytes: bound of the decoded-chunk LRU (see :class:`DCPStorage`).
        values: decode the BYTE_IO values (False: list them all as skipped).
        limits: :class:`~reshard.ondisk.limits.ReadLimits` (``dcp_metadata_bytes``,
            ``value_bytes``); None: the defaults.

    Raises:
        CheckpointNotFoundError: no ``.metadata`` at ``path``.
        ManifestError: the metadata is refused (a global outside the
            allow-list, malformed records, unsupported dtype or transforms,
            a data file name outside the directory, a symbolic link).
        IntegrityError: a declared byte range reaches past its data file.
    """
    st, key = resolve(path, storage)
    md = _read_metadata(st, key, limits)
    try:
        items, m = _build(st, key, md, values=values, limits=limits)
    except (AttributeError, TypeError, KeyError) as e:  # records of the right class, wrong contents
        raise ManifestError(f"{st.join(key, DCP_METADATA)}: malformed DCP metadata: "
                            f"{type(e).__name__}: {e}") from None
    return DCPStorage(st, key, items, cache_bytes=cache_bytes), m
