"""Typed, pickle-free encoding of plain Python values (common state).

Values round-trip with their Python types: ``None``, ``bool``, ``int`` (any
size), ``float`` (NaN and +-inf included), ``str``, ``bytes``, ``list``,
``tuple``, ``dict`` (any encodable keys, e.g. ints, insertion order kept),
``collections.Counter``, ``collections.OrderedDict``, ``set``, ``frozenset``,
``slice``, ``complex``, NumPy arrays and scalars (e.g.
``numpy.random.get_state()``), small torch tensors (complex64/complex128
included), ``torch.dtype``, ``torch.device``, ``pathlib`` paths (the concrete
or pure class is kept), ``datetime.datetime`` / ``date`` / ``time`` /
``timedelta`` (naive, ``datetime.timezone`` offsets and ``zoneinfo.ZoneInfo``
zones). Anything else -- ``enum.Enum`` members (``IntEnum`` included),
``decimal.Decimal``, ``fractions.Fraction``, arbitrary objects -- is refused
with a TypeError naming the value's path and type, never pickled.

Encoded form: JSON in which every JSON object is a tag ``{"$tag": payload}``,
so user data can never be confused with a tag. Decoding only builds the types
listed above: nothing is imported or called by name.
"""

from __future__ import annotations

import base64
import collections
import datetime as _dt
import enum
import math
import pathlib
import sys
import zoneinfo
from collections.abc import Callable
from typing import Any

import msgspec

from ..errors import ManifestError

_INT64 = 2**63


def _enc_float(x: float) -> Any:
    if math.isnan(x):
        return {"$float": "nan"}
    if math.isinf(x):
        return {"$float": "inf" if x > 0 else "-inf"}
    return x


_PATHS: dict[str, type[pathlib.PurePath]] = {
    "posix": pathlib.PosixPath, "windows": pathlib.WindowsPath,
    "pure_posix": pathlib.PurePosixPath, "pure_windows": pathlib.PureWindowsPath,
}
_PATH_KIND: dict[type, str] = {c: k for k, c in _PATHS.items()}


def _enc_tz(tz: _dt.tzinfo | None, *, path: str) -> Any:
    if tz is None:
        return None
    if type(tz) is _dt.timezone:
        off = tz.utcoffset(None)
        name = tz.tzname(None)
        default = str(_dt.timezone(off))
        return {"offset_us": (off.days * 86400 + off.seconds) * 10**6 + off.microseconds,
                "name": None if name == default else name}
    if type(tz) is zoneinfo.ZoneInfo and tz.key is not None:
        return {"zone": tz.key}
    t = type(tz)
    raise TypeError(f"{path or 'value'}: cannot store a datetime whose tzinfo is a "
                    f"{t.__module__}.{t.__qualname__} (datetime.timezone and zoneinfo.ZoneInfo are stored)")


def _dec_tz(p: Any) -> _dt.tzinfo | None:
    if p is None:
        return None
    if "zone" in p:
        return zoneinfo.ZoneInfo(str(p["zone"]))
    off = _dt.timedelta(microseconds=int(p["offset_us"]))
    return _dt.timezone(off) if p["name"] is None else _dt.timezone(off, str(p["name"]))


def _time_fields(v: _dt.time | _dt.datetime) -> list[int]:
    return [v.hour, v.minute, v.second, v.microsecond, v.fold]


def to_json(value: Any, *, path: str = "") -> Any:
    """Encode ``value`` into JSON-compatible data; TypeError names the path of an
    unsupported value."""
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -_INT64 <= value < _INT64 else {"$bigint": str(value)}
    if t is float:
        return _enc_float(value)
    if t is list:
        return [to_json(v, path=f"{path}[{i}]") for i, v in enumerate(value)]
    if t is tuple:
        return {"$tuple": [to_json(v, path=f"{path}[{i}]") for i, v in enumerate(value)]}
    if t is dict or t is collections.OrderedDict or t is collections.Counter:
        tag = {dict: "$dict", collections.OrderedDict: "$odict", collections.Counter: "$counter"}[t]
        return {tag: [[to_json(k, path=f"{path}.<key>"), to_json(v, path=f"{path}.{k}")]
                      for k, v in value.items()]}
    if t is bytes or t is bytearray:
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if t is set or t is frozenset:
        items = [to_json(v, path=f"{path}.<item>") for v in value]
        items.sort(key=lambda e: msgspec.json.encode(e))
        return {"$set" if t is set else "$frozenset": items}
    if t is slice:
        return {"$slice": [to_json(value.start), to_json(value.stop), to_json(value.step)]}
    # torch and NumPy values exist only where their packages are imported: the
    # listing and inspection that decode values need neither (no start-up cost)
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"{path or 'value'}: NumPy object arrays are not supported")
        arr = np.ascontiguousarray(value)  # (at least 1-D: keep the caller's shape)
        return {"$ndarray": [arr.dtype.str, list(value.shape), base64.b64encode(arr.tobytes()).decode("ascii")]}
    if np is not None and isinstance(value, np.generic):
        arr = np.asarray(value)
        return {"$npscalar": [arr.dtype.str, base64.b64encode(arr.tobytes()).decode("ascii")]}
    if t is complex:
        return {"$complex": [_enc_float(value.real), _enc_float(value.imag)]}
    if torch is not None and isinstance(value, torch.dtype):
        return {"$torch_dtype": str(value).removeprefix("torch.")}
    if torch is not None and t is torch.device:
        return {"$torch_device": str(value)}
    if t in _PATH_KIND:
        return {"$path": [_PATH_KIND[t], str(value)]}
    if t is _dt.datetime:
        return {"$datetime": [value.year, value.month, value.day, *_time_fields(value),
                              _enc_tz(value.tzinfo, path=path)]}
    if t is _dt.date:
        return {"$date": [value.year, value.month, value.day]}
    if t is _dt.time:
        return {"$time": [*_time_fields(value), _enc_tz(value.tzinfo, path=path)]}
    if t is _dt.timedelta:
        return {"$timedelta": [value.days, value.seconds, value.microseconds]}
    if torch is not None and isinstance(value, torch.Tensor):
        from ..state.sharding import dtype_name

        cpu = value.detach().to("cpu").contiguous()
        flat = cpu.reshape(-1).clone(memory_format=torch.contiguous_format)  # stride 1, even for 1 element
        raw = flat.view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
        return {"$tensor": [dtype_name(cpu.dtype), list(cpu.shape), base64.b64encode(raw).decode("ascii")]}
    if isinstance(value, enum.Enum):  # IntEnum/StrEnum too: storing the int would lose the type
        raise TypeError(f"{path or 'value'}: cannot store the enum member {value!r} "
                        f"(type {t.__module__}.{t.__qualname__}) in reshard's pickle-free encoding; "
                        "store its .value or .name and rebuild the member in load_state_dict")
    if isinstance(value, int) and not isinstance(value, bool):  # int subclasses: store the int
        return to_json(int(value), path=path)
    if isinstance(value, float):
        return _enc_float(float(value))
    if isinstance(value, str):
        return str(value)
    raise TypeError(f"{path or 'value'}: cannot store a value of type {t.__module__}.{t.__qualname__} "
                    "in reshard's pickle-free encoding")


def from_json(data: Any) -> Any:
    """Decode data produced by :func:`to_json`; ManifestError on an unknown tag
    or a malformed payload."""
    try:
        return _from_json(data)
    except ManifestError:
        raise
    except RecursionError:  # (a RuntimeError: before it)
        raise ManifestError("encoded value is nested too deeply to decode") from None
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
        # RuntimeError: torch's own refusals (torch.device("bogus"), a view of a bad size)
        raise ManifestError(f"encoded value is malformed: {type(e).__name__}: {str(e)[:200]}") from None


def _from_json(data: Any) -> Any:
    """Decode one encoded value: the containers here (each level of nesting
    costs the interpreter the same frames as it always did, so the depth at
    which :func:`from_json` reports "nested too deeply" is kept), every other
    tag by its entry in :data:`_LEAVES`.

    Raises:
        ManifestError: not a single-tag object, an unknown tag or payload.
        TypeError, ValueError, KeyError, IndexError: a malformed payload
            (:func:`from_json` reports them as ManifestError).
    """
    if isinstance(data, list):
        return [_from_json(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise ManifestError(f"encoded value: expected a single-tag object, got keys {sorted(data)}")
    tag, p = next(iter(data.items()))
    if tag == "$tuple":
        return tuple(_from_json(v) for v in p)
    if tag in ("$dict", "$odict", "$counter"):
        cls = {"$dict": dict, "$odict": collections.OrderedDict, "$counter": collections.Counter}[tag]
        out = cls()
        for k, v in p:
            out[_from_json(k)] = _from_json(v)
        return out
    if tag == "$set":
        return {_from_json(v) for v in p}
    if tag == "$frozenset":
        return frozenset(_from_json(v) for v in p)
    if tag == "$slice":
        return slice(*(_from_json(v) for v in p))
    if tag == "$complex":
        return complex(_from_json(p[0]), _from_json(p[1]))
    leaf = _LEAVES.get(tag)
    if leaf is None:
        raise ManifestError(f"encoded value: unknown tag {tag!r}")
    return leaf(p)


def _dec_ndarray(p: Any) -> Any:
    import numpy as np

    dt, shape, b64 = p
    return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dt)).reshape(shape).copy()


def _dec_npscalar(p: Any) -> Any:
    import numpy as np

    dt, b64 = p
    return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dt))[0]


def _dec_torch_dtype(p: Any) -> Any:
    import torch

    dtype = getattr(torch, str(p), None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"encoded value: unknown torch dtype {p!r}")
    return dtype


def _dec_torch_device(p: Any) -> Any:
    import torch

    return torch.device(str(p))


def _dec_path(p: Any) -> pathlib.PurePath:
    kind, s = p
    if kind not in _PATHS:
        raise ManifestError(f"encoded value: unknown path kind {kind!r}")
    try:
        return _PATHS[kind](str(s))
    except (NotImplementedError, OSError):  # a WindowsPath read on POSIX (or back): keep its flavour
        return _PATHS["pure_" + kind](str(s))


def _dec_datetime(p: Any) -> _dt.datetime:
    *f, tz = p
    y, mo, d, h, mi, s, us, fold = (int(x) for x in f)
    return _dt.datetime(y, mo, d, h, mi, s, us, tzinfo=_dec_tz(tz), fold=fold)


def _dec_date(p: Any) -> _dt.date:
    return _dt.date(*(int(x) for x in p))


def _dec_time(p: Any) -> _dt.time:
    *f, tz = p
    h, mi, s, us, fold = (int(x) for x in f)
    return _dt.time(h, mi, s, us, tzinfo=_dec_tz(tz), fold=fold)


def _dec_timedelta(p: Any) -> _dt.timedelta:
    return _dt.timedelta(days=int(p[0]), seconds=int(p[1]), microseconds=int(p[2]))


def _dec_tensor(p: Any) -> Any:
    import torch

    from ..state.sharding import torch_dtype

    name, shape, b64 = p
    raw = bytearray(base64.b64decode(b64))
    dtype = torch_dtype(name)
    if (not isinstance(shape, list) or len(shape) > 64
            or not all(type(d) is int and 0 <= d < 2**62 for d in shape)):
        raise ManifestError(f"encoded tensor: shape {str(shape)[:80]} is not a list of at most 64 "
                            "non-negative ints")
    numel = math.prod(shape)
    if numel * dtype.itemsize != len(raw):  # nothing allocated from a shape alone
        raise ManifestError(f"encoded tensor: {len(raw)} bytes of data for shape {shape} of {name} "
                            f"({numel * dtype.itemsize} expected)")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


#: the decoder of each tag that holds no encoded value (its payload -> the
#: value); ``float``, ``int`` and ``b64decode`` are called directly, as before
_LEAVES: dict[str, Callable[[Any], Any]] = {
    "$float": float, "$bigint": int, "$bytes": base64.b64decode,
    "$ndarray": _dec_ndarray, "$npscalar": _dec_npscalar,
    "$torch_dtype": _dec_torch_dtype, "$torch_device": _dec_torch_device, "$path": _dec_path,
    "$datetime": _dec_datetime, "$date": _dec_date, "$time": _dec_time,
    "$timedelta": _dec_timedelta, "$tensor": _dec_tensor,
}


def encode(value: Any, *, path: str = "") -> bytes:
    """Value -> canonical bytes (JSON); equal values give equal bytes."""
    return msgspec.json.encode(to_json(value, path=path))


def decode(raw: bytes | memoryview) -> Any:
    """Bytes from :func:`encode` -> value; ManifestError if malformed."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ManifestError(f"encoded value is not valid JSON: {e}") from None
    except RecursionError:
        raise ManifestError("encoded value is nested too deeply to decode") from None
    return from_json(data)
