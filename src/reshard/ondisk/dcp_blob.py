"""Decoding one DCP tensor item (a ``torch.save`` zip blob) quickly and without
running anything the blob names.

A DCP data item is the ``torch.save`` of one plain tensor: a zip archive whose
``data.pkl`` is a small pickle calling ``torch._utils._rebuild_tensor_v2`` on a
persistent storage reference (``('storage', torch.<T>Storage, key, location,
numel)``), and whose ``data/<key>`` record holds the storage's bytes.
:func:`decode_tensor_blob` reads the archive with torch's C++ zip reader
(``torch._C.PyTorchFileReader``, the one ``torch.load`` uses) and unpickles
``data.pkl`` with :class:`_TensorUnpickler`, whose ``find_class`` hands out
only stand-ins of its own: a recorder for ``_rebuild_tensor_v2``, a dtype
marker per storage class, ``collections.OrderedDict`` (empty backward hooks);
any other global, any other shape of pickle, is refused. The tensor is then
built from the storage bytes with ``torch.frombuffer`` and a bounds-checked
``as_strided``. Nothing of torch's is called with values from the blob except
those two.

Returns None (the caller then uses ``torch.load(weights_only=True)``) for
anything outside this narrow form (legacy non-zip format, another pickle
layout, a big-endian blob), so the fast path never widens what is accepted.
For a many-small-tensors checkpoint it is several times cheaper per item than
``torch.load(weights_only=True)`` (whose restricted unpickler is pure Python).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
from typing import Any

import torch

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _Refused(Exception):
    pass


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _StorageRef:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype: torch.dtype, key: str, numel: int):
        self.dtype, self.key, self.numel = dtype, key, numel


class _Rebuilt:
    __slots__ = ("storage", "offset", "size", "stride")

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                 hooks: Any = None, *rest: Any):
        if not isinstance(storage, _StorageRef) or rest:
            raise _Refused("unexpected tensor record")
        if not (type(offset) is int and isinstance(size, tuple) and isinstance(stride, tuple)
                and len(size) == len(stride) and all(type(d) is int and d >= 0 for d in size)
                and all(type(s) is int and s >= 0 for s in stride)):
            raise _Refused("unexpected tensor geometry")
        if hooks is not None and not (isinstance(hooks, collections.OrderedDict) and not hooks):
            raise _Refused("backward hooks")
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild(*args: Any) -> _Rebuilt:
    return _Rebuilt(*args)


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise _Refused(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and type(pid[2]) is str and type(pid[4]) is int
                and pid[4] >= 0):
            raise _Refused("unexpected persistent id")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def decode_tensor_blob(raw: bytes | bytearray | memoryview) -> torch.Tensor | None:
    """The tensor a ``torch.save`` blob of one plain CPU tensor holds (a copy
    owning its memory), or None when the blob is not of that narrow form."""
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(raw))
        if reader.has_record("byteorder") and bytes(reader.get_record("byteorder")) != b"little":  # type: ignore[attr-defined]
            return None
        rec = _TensorUnpickler(io.BytesIO(bytes(reader.get_record("data.pkl")))).load()
        if not isinstance(rec, _Rebuilt):
            return None
        ref = rec.storage
        data = bytearray(reader.get_record(f"data/{ref.key}"))
    except (_Refused, pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError,
            KeyError, IndexError, AttributeError):
        return None
    isz = ref.dtype.itemsize
    if len(data) != ref.numel * isz:
        return None
    n = math.prod(rec.size)
    if n:  # the last element the strides reach lies inside the storage
        last = rec.offset + sum((d - 1) * s for d, s in zip(rec.size, rec.stride, strict=True))
        if rec.offset < 0 or last >= ref.numel:
            return None
    base = torch.frombuffer(data, dtype=ref.dtype) if data else torch.empty(0, dtype=ref.dtype)
    if not n:
        return torch.empty(rec.size, dtype=ref.dtype)
    return torch.as_strided(base, rec.size, rec.stride, rec.offset)
