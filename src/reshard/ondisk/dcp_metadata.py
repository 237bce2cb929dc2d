"""The ``.metadata`` of a PyTorch DCP checkpoint, read through a restricted
unpickler (see :mod:`reshard.ondisk.dcp` for the rules): only the DCP
metadata records, ``torch.Size``, torch dtype / layout / memory-format
singletons and a few harmless builtins can be named; anything else is a
:class:`~reshard.errors.ManifestError` before it runs.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import CheckpointError, ManifestError
from ..storage import Storage, resolve

DCP_METADATA = ".metadata"
#: largest ``.metadata`` read (a crafted file cannot make us read more)
MAX_METADATA_BYTES = 1 << 30
#: deepest nesting of ``MARK``s accepted (DCP's records nest a handful of
#: levels; a crafted file of 100k MARKs is refused at this depth instead of
#: being walked to its end)
MAX_MARK_DEPTH = 1000
#: most items on the unpickler's stack above its last MARK when a new
#: container is pushed: the pickler batches a container's items by 1000 and a
#: value nests at most ~1000 levels (its recursion limit), so a real file
#: stays below ~5000; 100k empty lists pushed to be nested are refused here
MAX_FRAME_ITEMS = 10_000

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_LEGACY = "torch.distributed._shard.sharded_tensor.metadata"
# DCP records rebuilt with NEWOBJ + BUILD: a fresh subclass of each per read
_RECORD_CLASSES = (
    (_MD, "Metadata"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "MetadataIndex"),
    (_MD, "StorageMeta"),
    (_FS, "_StorageInfo"),
)


@functools.cache
def _torch_singletons() -> dict[tuple[str, str], Any]:
    """``("torch", name)`` for every dtype, layout and memory format torch
    exposes (immutable C objects: ``BUILD`` cannot set attributes on them)."""
    import torch  # (here: listing a root for DCP folders needs no torch)

    out: dict[tuple[str, str], Any] = {}
    for name, v in vars(torch).items():
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            out[("torch", name)] = v
            if isinstance(v, torch.memory_format):  # how a bare memory format pickles
                out[("torch._utils", f"torch.{name}")] = v
    return out


def _make_tables() -> tuple[dict[tuple[str, str], Any], dict[str, type]]:
    """The allowed globals for one read, and the record classes handed out."""
    import torch
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    mods = {_MD: md, _FS: fs}
    allowed = dict(_torch_singletons())  # immutable C objects: shared between reads
    records: dict[str, type] = {}
    for mod, name in _RECORD_CLASSES:
        base = getattr(mods[mod], name)
        sub = type(name, (base,), {"__module__": f"reshard.ondisk.dcp.<{mod}>"})
        records[name] = sub
        allowed[(mod, name)] = sub
    base_props = md.TensorProperties
    encodings = {e.value: e for e in md._MEM_FORMAT_ENCODING}

    def mem_format_encoding(value: Any) -> Any:
        # the real enum member is only passed to TensorProperties.__setstate__
        # (below); the unpickler sees an int, so it cannot BUILD onto the member
        if type(value) is not int or value not in encodings:
            raise ManifestError(f"invalid _MEM_FORMAT_ENCODING value {value!r}")
        return _MemFormat(value)

    def setstate(self: Any, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[3], _MemFormat):
            raise ManifestError(f"invalid TensorProperties state {state!r:.200}")
        base_props.__setstate__(self, (*state[:3], encodings[state[3].value], state[4]))

    records["TensorProperties"].__setstate__ = setstate  # type: ignore[attr-defined]
    layouts = {str(v): v for v in _torch_singletons().values() if isinstance(v, torch.layout)}

    def get_layout(name: Any) -> Any:
        if type(name) is not str or name not in layouts:
            raise ManifestError(f"unknown torch layout {name!r:.100}")
        return layouts[name]

    def path(*parts: Any) -> str:  # StorageMeta.checkpoint_id: kept as a string
        if not all(type(p) is str for p in parts):
            raise ManifestError("a path in the DCP metadata has non-string parts")
        return "/".join(parts)

    allowed[(_MD, "_MEM_FORMAT_ENCODING")] = mem_format_encoding
    # older torch pickled the sharded-tensor copies of these (same state format)
    allowed[(_LEGACY, "TensorProperties")] = records["TensorProperties"]
    allowed[(_LEGACY, "MEM_FORMAT_ENCODING")] = mem_format_encoding
    allowed[("torch.serialization", "_get_layout")] = get_layout
    allowed[("torch", "Size")] = torch.Size
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    for mod in ("pathlib", "pathlib._local"):
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            allowed[(mod, name)] = path
    return allowed, records


@dataclass(frozen=True)
class _MemFormat:
    value: int


def _bounded_push(load: Any) -> Any:
    """``load`` (an opcode pushing a new container) refused once the stack
    above the last MARK holds MAX_FRAME_ITEMS items."""

    def bounded(self: _MetadataUnpickler) -> None:
        if len(self.stack) >= MAX_FRAME_ITEMS:  # type: ignore[attr-defined]
            raise ManifestError(f"{self.where}: DCP metadata piles more than {MAX_FRAME_ITEMS} "
                                "items on the unpickler's stack (refused: a pickler never does)")
        load(self)

    return bounded


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP ``.metadata`` and nothing else (see the module docstring).

    The pure-Python unpickler, not the C one: the C unpickler grows its memo
    array to the index a ``LONG_BINPUT`` names (4 bytes of a crafted file can
    ask for 2^32 entries, 32 GiB), while this one keeps the memo in a dict;
    ``BYTEARRAY8``, which allocates its declared length before reading, is
    refused. So no allocation exceeds what the file's own bytes can hold.
    """

    def __init__(self, file: Any, *, where: str):
        super().__init__(file)
        self.where = where
        self.allowed, self.records = _make_tables()

    def _refuse_bytearray(self) -> None:
        # BYTEARRAY8 allocates its declared length (8 bytes of the file: up to 2^63)
        # before reading; DCP metadata holds no bytearrays
        raise ManifestError(f"{self.where}: DCP metadata holds a BYTEARRAY8 (refused: no DCP "
                            "record is a bytearray)")

    def _load_mark(self) -> None:
        if len(self.metastack) >= MAX_MARK_DEPTH:  # type: ignore[attr-defined]
            raise ManifestError(f"{self.where}: DCP metadata nests more than {MAX_MARK_DEPTH} "
                                "MARKs (refused: DCP records nest a few levels)")
        pickle._Unpickler.load_mark(self)  # type: ignore[attr-defined]

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BYTEARRAY8[0]] = _refuse_bytearray
    dispatch[pickle.MARK[0]] = _load_mark
    for _op in (pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_SET, pickle.EMPTY_TUPLE):
        dispatch[_op[0]] = _bounded_push(dispatch[_op[0]])
    del _op

    def find_class(self, module: str, name: str) -> Any:
        obj = self.allowed.get((module, name))
        if obj is None:
            raise ManifestError(
                f"{self.where}: DCP metadata names the global {module}.{name}, which is not allowed "
                "(only DCP metadata records, torch.Size and torch dtypes/layouts may appear); "
                "refusing to unpickle it"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise ManifestError(f"{self.where}: DCP metadata uses a persistent id; refusing to unpickle it")


def read_dcp_metadata(path: str | os.PathLike[str], *, storage: Storage | None = None) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of the DCP
    checkpoint directory ``path`` (``path/.metadata``), read through a
    restricted unpickler.

    The records returned are instances of subclasses of torch's DCP classes
    (``isinstance`` holds), made fresh for this read.

    Raises:
        CheckpointNotFoundError: no ``.metadata`` at ``path``.
        ManifestError: the file names any global outside the allow-list (the
            message names its module and name; nothing is executed), is not a
            valid pickle, or does not hold a DCP ``Metadata``.
    """
    st, key = resolve(path, storage)
    return _read_metadata(st, key)


def _read_metadata(st: Storage, key: str, limits: Any = None) -> Any:
    from ..errors import CheckpointNotFoundError
    from .limits import default_limits, too_large

    cap = (limits if limits is not None else default_limits()).dcp_metadata_bytes

    mpath = st.join(key, DCP_METADATA)
    if st.is_link(mpath):
        raise ManifestError(f"{mpath}: DCP metadata is a symbolic link (refused)")
    try:
        size = st.size(mpath)
        if size > cap:
            raise ManifestError(too_large(mpath, "the DCP metadata", size, cap, "dcp_metadata_bytes"))
        raw = st.read_bytes(mpath, 0, size)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"{key}: no DCP checkpoint here (no {DCP_METADATA})") from None
    up = _MetadataUnpickler(io.BytesIO(raw), where=mpath)
    try:
        md = up.load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a malformed pickle raises
        raise ManifestError(f"{mpath}: unreadable DCP metadata: {type(e).__name__}: {e}") from None
    if type(md) is not up.records["Metadata"]:
        raise ManifestError(f"{mpath}: DCP metadata holds a {type(md).__name__}, not a Metadata")
    return md


def is_dcp_checkpoint(path: str | os.PathLike[str], *, storage: Storage | None = None) -> bool:
    """``path`` holds a DCP ``.metadata`` (and no reshard ``manifest.json``)."""
    from .manifest import MANIFEST_NAME

    st, key = resolve(path, storage)
    return st.exists(st.join(key, DCP_METADATA)) and not st.exists(st.join(key, MANIFEST_NAME))


def dcp_checkpoints(storage: Storage, root: str) -> list[tuple[str, float | None]]:
    """``(name, modified time)`` of every child of ``root`` that is a DCP
    checkpoint (a ``.metadata`` and no reshard manifest), by name."""
    from .manifest import MANIFEST_NAME

    try:
        names = storage.list_dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in sorted(names):
        p = storage.join(root, name)
        if storage.exists(storage.join(p, DCP_METADATA)) and not storage.exists(
                storage.join(p, MANIFEST_NAME)):
            out.append((name, storage.modified_time(storage.join(p, DCP_METADATA))))
    return out
