"""Values users keep in state (issue 10 item 6): complex tensors, torch dtypes
and devices, paths, dates and durations round-trip typed and pickle-free;
enums, Decimal, Fraction and arbitrary objects are refused with the path and
the type named."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import fractions
import json
import pathlib
import struct
import zoneinfo
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.ondisk import codec

GSHAPE = (5, 3)


def _complex(dtype: torch.dtype) -> torch.Tensor:
    n = GSHAPE[0] * GSHAPE[1]
    real = torch.arange(n, dtype=torch.float64).reshape(GSHAPE) * 1.5 - 4
    imag = torch.arange(n, dtype=torch.float64).reshape(GSHAPE).flip(0) * -0.25 + 1 / 3
    return torch.complex(real, imag).to(dtype)


def _rows(rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(GSHAPE[0], world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def _state(fill: bool) -> dict[str, Any]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    start, n = _rows(rank, world)
    out: dict[str, Any] = {}
    for name, dtype in (("c64", torch.complex64), ("c128", torch.complex128)):
        full = _complex(dtype)
        local = full[start:start + n].clone() if fill else torch.full((n, 3), complex(9, 9), dtype=dtype)
        out[name] = reshard.ShardedTensor(name, local, global_shape=GSHAPE, global_offset=(start, 0))
    out["plain_c64"] = _complex(torch.complex64) if fill else torch.zeros(GSHAPE, dtype=torch.complex64)
    out["meta"] = {"dtype": torch.bfloat16, "device": torch.device("cuda", 1),
                   "dir": pathlib.PurePosixPath("/data/run-1"), "when": dt.datetime(2026, 12, 1, 9, 30),
                   "every": dt.timedelta(minutes=15), "z": 1 + 2j}
    return out


def r_save_complex(path: str) -> None:
    reshard.save(_state(True), path, step=3)


def r_load_complex(path: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    st = _state(False)
    res = reshard.load(st, path)
    start, n = _rows(rank, world)
    bad = []
    for name, dtype in (("c64", torch.complex64), ("c128", torch.complex128)):
        got = st[name].data
        want = _complex(dtype)[start:start + n]
        if got.dtype != dtype or not torch.equal(got, want):
            bad.append(f"rank {rank}: {name}: {got} != {want}")
    if not torch.equal(st["plain_c64"], _complex(torch.complex64)):
        bad.append(f"rank {rank}: plain_c64")
    if res.values.get("meta") != _state(True)["meta"]:
        bad.append(f"rank {rank}: values {res.values}")
    return bad


@pytest.mark.parametrize("load_world", [1, 3])
def test_complex_tensors_reshard_across_ranks(pool: Any, tmp_path: Path, load_world: int) -> None:
    """complex64 and complex128 tensors sharded by rows on 2 ranks load bit-exact
    on 1 and 3 ranks; the shard files stay valid safetensors (complex128 as
    float64 pairs, recorded in the file's metadata)."""
    path = str(tmp_path / "ck")
    pool.run(2, r_save_complex, path)
    assert pool.run(load_world, r_load_complex, path) == [[]] * load_world
    m = reshard.inspect(path)
    assert m.tensors["c64"].dtype == "complex64" and m.tensors["c128"].dtype == "complex128"
    from safetensors import safe_open

    seen = {}
    for f in sorted((tmp_path / "ck").glob("*.safetensors")):
        (hlen,) = struct.unpack("<Q", f.read_bytes()[:8])
        meta = json.loads(f.read_bytes()[8:8 + hlen])["__metadata__"]
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                seen[k] = sf.get_tensor(k)
                if k == "c128" or k.startswith("c128"):
                    assert meta[f"reshard.view.{k}"] == "complex128"
    c128 = [v for k, v in seen.items() if k.startswith("c128")]
    assert c128 and all(v.dtype == torch.float64 and v.shape[-1] == 2 for v in c128)
    assert any(v.dtype == torch.complex64 for k, v in seen.items() if k.startswith("c64"))


def test_complex_hf_round_trip(tmp_path: Path) -> None:
    """export_hf / import_hf keep complex64 and complex128 (the latter written
    as float64 pairs and restored from the recorded view)."""
    from reshard.formats.hf_export import export_hf
    from reshard.formats.hf_import import import_hf

    a, b = _complex(torch.complex64), _complex(torch.complex128)
    reshard.save({"a": a, "b": b}, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "hf")
    got = {"a": torch.zeros_like(a), "b": torch.zeros_like(b)}
    import_hf(got, tmp_path / "hf")
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


ROUND_TRIP = [
    torch.float8_e4m3fn, torch.device("cpu"), torch.device("cuda:3"), torch.device("meta"),
    pathlib.Path("/tmp/x/y.bin"), pathlib.PurePosixPath("a/b"), pathlib.PureWindowsPath(r"C:\runs\7"),
    dt.datetime(2026, 12, 1, 8, 48, 31, 123456),
    dt.datetime(2026, 12, 1, 8, 48, tzinfo=dt.UTC),
    dt.datetime(2026, 3, 1, 2, 0, tzinfo=dt.timezone(dt.timedelta(hours=-5, minutes=-30), "RUN")),
    dt.datetime(2026, 11, 1, 1, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("America/New_York")),
    dt.date(1999, 12, 31), dt.time(23, 59, 59, 999999), dt.time(1, 2, tzinfo=dt.UTC),
    dt.timedelta(days=-3, seconds=5, microseconds=7), dt.timedelta(0),
    3 - 4.5j, complex(float("nan"), float("inf")),
    {"nested": [pathlib.Path("p"), (dt.date(2020, 2, 29), torch.int8)]},
    torch.tensor([1 + 2j, -3j], dtype=torch.complex64), torch.tensor([[0.5 - 1j]], dtype=torch.complex128),
]


@pytest.mark.parametrize("value", ROUND_TRIP, ids=lambda v: type(v).__name__)
def test_codec_round_trips_typed(value: Any) -> None:
    raw = codec.encode(value, path="x")
    back = codec.decode(raw)
    assert type(back) is type(value)
    if isinstance(value, torch.Tensor):
        assert back.dtype == value.dtype and torch.equal(back, value)
    elif isinstance(value, complex) and value != value:
        assert repr(back) == repr(value)
    else:
        assert back == value and repr(back) == repr(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        assert back.utcoffset() == value.utcoffset() and back.tzname() == value.tzname()
        assert back.fold == value.fold
    assert b"pickle" not in raw and codec.encode(back, path="x") == raw


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 2


class Opaque:
    pass


class OwnZone(dt.tzinfo):
    def utcoffset(self, d: Any) -> dt.timedelta:
        return dt.timedelta(hours=1)


@pytest.mark.parametrize("value, tname", [
    (Color.RED, "Color"), (Level.HIGH, "Level"), (decimal.Decimal("1.5"), "decimal.Decimal"),
    (fractions.Fraction(1, 3), "fractions.Fraction"), (Opaque(), "Opaque"),
    (dt.datetime(2020, 1, 1, tzinfo=OwnZone()), "OwnZone"),
])
def test_refused_values_name_path_and_type(tmp_path: Path, value: Any, tname: str) -> None:
    """A value outside the encoding is refused before anything is published,
    with its tree path and type in the message."""
    with pytest.raises(Exception) as ei:
        reshard.save({"cfg": {"opts": [1, value]}, "w": torch.ones(2)}, tmp_path / "ck")
    msg = str(ei.value)
    assert "cfg.opts[1]" in msg and tname in msg, msg
    assert reshard.latest(tmp_path) is None and not (tmp_path / "ck" / "manifest.json").exists()


def test_values_round_trip_through_save_and_load(tmp_path: Path) -> None:
    vals = {"dtype": torch.float16, "device": torch.device("cuda", 0), "out": pathlib.Path("runs/a"),
            "started": dt.datetime(2026, 12, 1, 7, tzinfo=dt.UTC), "budget": dt.timedelta(hours=2),
            "day": dt.date(2026, 12, 1)}
    reshard.save({"cfg": vals}, tmp_path / "ck")
    res = reshard.load({"cfg": {k: None for k in vals}}, tmp_path / "ck")
    got = res.values["cfg"]
    assert got == vals and {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in vals.items()}
