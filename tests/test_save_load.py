"""Single-process save -> load round trips on real files."""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import reshard
from reshard import LoadOptions, SaveOptions, ShardedObject, ShardedTensor
from reshard.errors import CheckpointError, IntegrityError, ShardingError
from reshard.state.sharding import DTYPE_NAMES, torch_dtype
from reshard.storage import MemoryStorage

FAST = SaveOptions(durable=False)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose bytes are random (NaN payloads, subnormals, ... included)."""
    n = int(np.prod(shape)) if shape else 1
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen(seed)).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen(seed))
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


def blocks(gshape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Grid blocks (offset, shape) from the cut points of each dimension."""
    per_dim = []
    for g, cs in zip(gshape, cuts):
        b = [0, *cs, g]
        per_dim.append(list(zip(b[:-1], b[1:])))
    return [(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
            for cell in itertools.product(*per_dim)]


def shard(fqn: str, full: torch.Tensor, off: tuple[int, ...], shape: tuple[int, ...]) -> ShardedTensor:
    sl = tuple(slice(o, o + s) for o, s in zip(off, shape))
    return ShardedTensor(fqn, full[sl].clone(), global_shape=tuple(full.shape), global_offset=off)


def targets(fqn: str, gshape: tuple[int, ...], cuts: list[list[int]], dtype=torch.int64) -> list[ShardedTensor]:
    return [ShardedTensor(fqn, torch.full(shape, -1, dtype=dtype), global_shape=gshape, global_offset=off)
            for off, shape in blocks(gshape, cuts)]


def assemble(sts: list[ShardedTensor]) -> torch.Tensor:
    out = torch.full(sts[0].global_shape, -7, dtype=sts[0].data.dtype)
    for s in sts:
        out[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))] = s.data
    return out


# ----------------------------------------------------------------------------- dtypes, shapes


@pytest.mark.parametrize("name", sorted(DTYPE_NAMES))
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, name: str) -> None:
    dtype = torch_dtype(name)
    whole = random_bits((3, 5), dtype, seed=len(name))
    flat = random_bits((13,), dtype, seed=7)
    state = {
        "plain": whole,
        "sh": [ShardedTensor("sh", flat[0:5].clone(), global_shape=(13,), global_offset=(0,)),
               ShardedTensor("sh", flat[5:13].clone(), global_shape=(13,), global_offset=(5,))],
    }
    reshard.save(state, tmp_path / "ck", options=FAST)
    m = reshard.inspect(tmp_path / "ck")
    assert m.tensors["plain"].dtype == name and m.tensors["sh"].dtype == name
    out_plain = torch.zeros((3, 5), dtype=dtype)
    out_sh = [ShardedTensor("sh", torch.zeros(n, dtype=dtype), global_shape=(13,), global_offset=(o,))
              for o, n in ((0, 7), (7, 6))]
    res = reshard.load({"plain": out_plain, "x": out_sh}, tmp_path / "ck")
    assert res.missing == () and res.unexpected == ()
    assert_bit_equal(out_plain, whole)
    assert_bit_equal(torch.cat([s.data for s in out_sh]), flat)


def test_zero_dim_tensors(tmp_path: Path) -> None:
    state = {"opt": {"step_f": torch.tensor(12.5), "flag": torch.tensor(True),
                     "step_i": torch.tensor(-(2**40), dtype=torch.int64)},
             "st": ShardedTensor("sharded_step", torch.tensor(7, dtype=torch.int32), global_shape=(),
                                 global_offset=())}
    reshard.save(state, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    assert m.tensors["opt.step_f"].global_shape == ()
    out = {"opt": {"step_f": torch.tensor(0.0), "flag": torch.tensor(False),
                   "step_i": torch.tensor(0, dtype=torch.int64)},
           "x": ShardedTensor("sharded_step", torch.tensor(0, dtype=torch.int32), global_shape=(),
                              global_offset=())}
    reshard.load(out, tmp_path / "ck")
    for key, want in (("step_f", state["opt"]["step_f"]), ("flag", state["opt"]["flag"]),
                      ("step_i", state["opt"]["step_i"])):
        got = out["opt"][key]
        assert got.dim() == 0 and got.dtype == want.dtype and got.item() == want.item()
    assert out["x"].data.dim() == 0 and out["x"].data.item() == 7


def test_empty_tensors(tmp_path: Path) -> None:
    state = {"a": torch.zeros(0), "b": torch.ones(3, 0, dtype=torch.int16),
             "c": torch.ones(0, 4, 2, dtype=torch.bfloat16), "d": torch.arange(3.0),
             "e": [ShardedTensor("e", torch.zeros(0, 2), global_shape=(0, 2), global_offset=(0, 0)),
                   ShardedTensor("e", torch.zeros(0, 0), global_shape=(0, 2), global_offset=(0, 2))]}
    reshard.save(state, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    assert m.tensors["b"].global_shape == (3, 0)
    assert m.tensors["e"].global_shape == (0, 2)
    out = {"a": torch.full((0,), 5.0), "b": torch.zeros(3, 0, dtype=torch.int16),
           "c": torch.zeros(0, 4, 2, dtype=torch.bfloat16), "d": torch.zeros(3),
           "e": ShardedTensor("e", torch.zeros(0, 2), global_shape=(0, 2), global_offset=(0, 0))}
    reshard.load(out, tmp_path / "ck")
    assert out["b"].shape == (3, 0) and out["c"].shape == (0, 4, 2)
    assert out["d"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("load_cuts", [[], [3], [1], [2, 4], [0], [6], [1, 2, 3, 4, 5]])
def test_one_rank_holds_several_chunks_including_empty(tmp_path: Path, load_cuts: list[int]) -> None:
    full = torch.tensor([10, 11, 12, 13, 14, 15], dtype=torch.int64)
    buf = full.clone()
    state = {"w": [ShardedTensor("w", buf[o:o + n], global_shape=(6,), global_offset=(o,))
                   for o, n in ((0, 2), (2, 2), (4, 2), (6, 0))]}
    reshard.save(state, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    assert [(c.global_offset, c.local_shape) for c in m.tensors["w"].chunks] == [
        ((0,), (2,)), ((2,), (2,)), ((4,), (2,)), ((6,), (0,))]
    # whole
    whole = torch.zeros(6, dtype=torch.int64)
    reshard.load({"w": whole}, tmp_path / "ck")
    assert whole.tolist() == full.tolist()
    # another split (cuts may produce empty pieces at the ends)
    tg = targets("w", (6,), [load_cuts])
    reshard.load({"w": tg}, tmp_path / "ck")
    assert assemble(tg).tolist() == full.tolist()


LAYOUTS_2D = {
    "whole": [[], []],
    "rows": [[2], []],
    "cols": [[], [3]],
    "grid": [[2], [3]],
    "uneven": [[1, 2], [2, 4]],
    "singles": [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]],
}


@pytest.mark.parametrize("save_layout", sorted(LAYOUTS_2D))
def test_2d_block_reshard(tmp_path: Path, save_layout: str) -> None:
    gshape = (5, 7)
    full = torch.arange(35).reshape(gshape)
    state = {"w": [shard("w", full, off, shp) for off, shp in blocks(gshape, LAYOUTS_2D[save_layout])]}
    reshard.save(state, tmp_path / "ck", options=FAST)
    assert len(reshard.inspect(tmp_path / "ck").tensors["w"].chunks) == len(state["w"])
    for load_layout, cuts in LAYOUTS_2D.items():
        tg = targets("w", gshape, cuts)
        reshard.load({"w": tg}, tmp_path / "ck")
        for t in tg:
            want = full[tuple(slice(o, o + n) for o, n in zip(t.global_offset, t.local_shape))]
            assert t.data.tolist() == want.tolist(), (save_layout, load_layout, t.global_offset)
    # an odd sub-box spanning several saved chunks, and a plain "whole tensor" target
    sub = ShardedTensor("w", torch.zeros(3, 4, dtype=torch.int64), global_shape=gshape, global_offset=(1, 2))
    plain = torch.zeros(gshape, dtype=torch.int64)
    reshard.load({"a": sub, "w": plain}, tmp_path / "ck")
    assert sub.data.tolist() == full[1:4, 2:6].tolist()
    assert plain.tolist() == full.tolist()


def test_load_into_non_contiguous_destination(tmp_path: Path) -> None:
    full = torch.arange(24).reshape(4, 6)
    reshard.save({"w": [shard("w", full, (0, 0), (2, 6)), shard("w", full, (2, 0), (2, 6))]}, tmp_path / "ck")
    dst = torch.zeros(6, 4, dtype=torch.int64).t()  # [4, 6] view, not contiguous
    reshard.load({"w": dst}, tmp_path / "ck")
    assert dst.tolist() == full.tolist()


# ----------------------------------------------------------------------------- flattened (ZeRO)


def _zero_state(nranks: int, buffer: torch.Tensor, params: dict[str, tuple[int, ...]]) -> list[ShardedTensor]:
    """ZeRO style: params flat in one buffer (padded to a multiple of nranks), split into
    nranks equal ranges; each param's part of each range is a ShardedTensor with
    flattened_range on the param's full box."""
    total = sum(int(np.prod(s)) for s in params.values())
    padded = -(-total // nranks) * nranks
    assert buffer.numel() >= padded
    per = padded // nranks
    out = []
    for r in range(nranks):
        a, b = r * per, (r + 1) * per
        start = 0
        for fqn, shape in params.items():
            n = int(np.prod(shape))
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                out.append(ShardedTensor(fqn, buffer[lo:hi], global_shape=shape, global_offset=(0,) * len(shape),
                                         local_shape=shape, flattened_range=slice(lo - start, hi - start)))
            start += n
    return out


PARAMS = {"p1": (2, 5), "p2": (7,)}


def test_zero_flat_shards_reshard(tmp_path: Path) -> None:
    buf = torch.full((18,), float("nan"))  # padding is NaN: it must never be read as data
    buf[:17] = torch.arange(17, dtype=torch.float32) * 1.5 + 0.25
    saved = _zero_state(6, buf, PARAMS)
    assert len(saved) == 7  # range [9, 12) holds the end of p1 and the start of p2
    reshard.save({"opt": saved}, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    assert [c.flattened_range for c in m.tensors["p1"].chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [c.flattened_range for c in m.tensors["p2"].chunks] == [(0, 2), (2, 5), (5, 7)]
    # no padding bytes are saved: 17 float32 elements of data
    assert sum(c.length for te in m.tensors.values() for c in te.chunks) == 17 * 4
    # per parameter, whole
    p1, p2 = torch.zeros(2, 5), torch.zeros(7)
    reshard.load({"p1": p1, "p2": p2}, tmp_path / "ck")
    assert p1.reshape(-1).tolist() == buf[:10].tolist()
    assert p2.tolist() == buf[10:17].tolist()
    # as 4 and as 3 flat splits
    for n in (4, 3):
        sentinel = -9.0
        new = torch.full((-(-17 // n) * n,), sentinel)
        tg = _zero_state(n, new, PARAMS)
        res = reshard.load({"opt": tg}, tmp_path / "ck")
        assert res.missing == ()
        assert new[:17].tolist() == buf[:17].tolist()
        assert (new[17:] == sentinel).all()  # padding untouched
    # a box request from flattened chunks: row 1 of p1, and a 2-D flat request
    row = ShardedTensor("p1", torch.zeros(1, 5), global_shape=(2, 5), global_offset=(1, 0))
    col = ShardedTensor("p1", torch.zeros(2, 2), global_shape=(2, 5), global_offset=(0, 2))
    part = ShardedTensor("p1", torch.zeros(3), global_shape=(2, 5), global_offset=(0, 1), local_shape=(2, 3),
                         flattened_range=slice(2, 5))
    reshard.load({"r": row, "c": col, "q": part}, tmp_path / "ck", strict=False)
    ref = buf[:10].reshape(2, 5)
    assert row.data.tolist() == ref[1:2].tolist()
    assert col.data.tolist() == ref[:, 2:4].tolist()
    assert part.data.tolist() == ref[:, 1:4].reshape(-1)[2:5].tolist()


def test_box_save_flat_load(tmp_path: Path) -> None:
    full = torch.arange(24).reshape(4, 6)
    reshard.save({"w": [shard("w", full, off, shp) for off, shp in blocks((4, 6), [[2], [3]])]},
                 tmp_path / "ck")
    pieces = [ShardedTensor("w", torch.full((b - a,), -1), global_shape=(4, 6), global_offset=(0, 0),
                            local_shape=(4, 6), flattened_range=slice(a, b))
              for a, b in ((0, 7), (7, 8), (8, 24))]
    sub = ShardedTensor("w", torch.full((7,), -1), global_shape=(4, 6), global_offset=(1, 1), local_shape=(2, 5),
                        flattened_range=slice(2, 9))
    reshard.load({"w": pieces, "s": sub}, tmp_path / "ck")
    assert torch.cat([p.data for p in pieces]).tolist() == list(range(24))
    assert sub.data.tolist() == full[1:3, 1:6].reshape(-1)[2:9].tolist()


# ----------------------------------------------------------------------------- strictness


def test_missing_key_strict(tmp_path: Path) -> None:
    reshard.save({"model": {"w": torch.ones(2)}}, tmp_path / "ck")
    target = {"model": {"w": torch.zeros(2)}, "opt": {"m": torch.full((2,), 3.0)}}
    with pytest.raises(ShardingError, match=r"missing from the checkpoint: \['opt\.m'\]"):
        reshard.load(target, tmp_path / "ck")
    res = reshard.load(target, tmp_path / "ck", allow_missing=["opt.*"])
    assert res.missing == ("opt.m",)
    assert res.initialized == ()
    assert target["opt"]["m"].tolist() == [3.0, 3.0]  # untouched
    assert target["model"]["w"].tolist() == [1.0, 1.0]
    res = reshard.load(target, tmp_path / "ck", allow_missing=[("opt.*", "zeros")])
    assert res.missing == ("opt.m",) and res.initialized == ("opt.m",)
    assert target["opt"]["m"].tolist() == [0.0, 0.0]


def test_unexpected_key_strict(tmp_path: Path) -> None:
    reshard.save({"model": {"w": torch.ones(2), "b": torch.ones(1)}, "epoch": 3}, tmp_path / "ck")
    with pytest.raises(ShardingError, match=r"unexpected \(saved but not requested\): \['epoch', 'model\.b'\]"):
        reshard.load({"model": {"w": torch.zeros(2)}}, tmp_path / "ck")
    w = torch.zeros(2)
    res = reshard.load({"model": {"w": w}}, tmp_path / "ck", strict=False)
    assert res.unexpected == ("epoch", "model.b")
    assert w.tolist() == [1.0, 1.0]


def test_non_strict_load_matching_nothing_is_an_error(tmp_path: Path) -> None:
    """Case 13: every saved key has an extra ``model.`` prefix."""
    reshard.save({"model": {"w": torch.ones(2, 2), "b": torch.ones(2)}}, tmp_path / "ck")
    w, b = torch.zeros(2, 2), torch.zeros(2)
    with pytest.raises(ShardingError, match="no requested key matches") as ei:
        reshard.load({"w": w, "b": b}, tmp_path / "ck", strict=False)
    assert "model.w" in str(ei.value) or "model.b" in str(ei.value)
    assert w.sum().item() == 0.0 and b.sum().item() == 0.0


def test_silent_casts_and_reshapes_are_refused(tmp_path: Path) -> None:
    """Case 4: w [4,3] float32 (random x 100) into bfloat16, and into [4,2]."""
    w = torch.randn(4, 3, generator=gen(0)) * 100
    reshard.save({"w": w}, tmp_path / "ck")
    t = torch.zeros(4, 3, dtype=torch.bfloat16)
    with pytest.raises(ShardingError) as ei:
        reshard.load({"w": t}, tmp_path / "ck")
    msg = str(ei.value)
    assert "w: saved dtype float32, requested bfloat16" in msg
    assert t.abs().sum().item() == 0
    t2 = torch.zeros(4, 2)
    with pytest.raises(ShardingError) as ei:
        reshard.load({"w": t2}, tmp_path / "ck")
    assert "w: saved global_shape [4, 3], requested [4, 2]" in str(ei.value)
    assert t2.abs().sum().item() == 0
    # a sharded request with the wrong global shape, too
    t3 = ShardedTensor("w", torch.zeros(2, 3), global_shape=(5, 3), global_offset=(0, 0))
    with pytest.raises(ShardingError, match=r"saved global_shape \[4, 3\], requested \[5, 3\]"):
        reshard.load({"w": t3}, tmp_path / "ck")


def test_dotted_keys_are_tree_paths_and_collisions_name_both(tmp_path: Path) -> None:
    """DESIGN section 2: keys may contain '.', and a key is the tree path joined
    with '.'; two leaves of one key are refused, naming both tree paths."""
    reshard.save({"m": {"a.b": torch.ones(1)}}, tmp_path / "ck")
    assert set(reshard.inspect(tmp_path / "ck").tensors) == {"m.a.b"}
    for target in ({"m.a.b": torch.zeros(1)}, {"m": {"a": {"b": torch.zeros(1)}}}):
        reshard.load(target, tmp_path / "ck")
    with pytest.raises(ShardingError, match=r"'m\.a\.b' is given by two leaves: "
                                            r"state\['m'\]\['a\.b'\] and state\['m'\]\['a'\]\['b'\]"):
        reshard.save({"m": {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}}, tmp_path / "ck2")
    assert os.listdir(tmp_path) == ["ck"]
    with pytest.raises(ShardingError, match="given by two leaves"):  # '1' and 1
        reshard.save({"m": {"1": torch.ones(1), 1: torch.ones(1)}}, tmp_path / "ck3")


def test_sharded_tensor_fqn_takes_the_place_of_its_key(tmp_path: Path) -> None:
    st = ShardedTensor("decoder.layers.0.w", torch.arange(4.0), global_shape=(4,), global_offset=(0,))
    reshard.save({"anything": {"nested": st}}, tmp_path / "ck")
    assert set(reshard.inspect(tmp_path / "ck").tensors) == {"anything.decoder.layers.0.w"}
    out = ShardedTensor("decoder.layers.0.w", torch.zeros(4), global_shape=(4,), global_offset=(0,))
    reshard.load({"anything": {"views": [out]}}, tmp_path / "ck")
    assert out.data.tolist() == [0.0, 1.0, 2.0, 3.0]
    # at the root, a flat dict of ShardedTensors under their own dotted fqns
    flat = {n: ShardedTensor(n, torch.full((2,), float(i)), global_shape=(2,), global_offset=(0,))
            for i, n in enumerate(("mlp.gate", "mlp.up"))}
    reshard.save(flat, tmp_path / "flat")
    assert set(reshard.inspect(tmp_path / "flat").tensors) == {"mlp.gate", "mlp.up"}


# ----------------------------------------------------------------------------- values, objects, Stateful


class Holder:
    """A Stateful object recording what load_state_dict received."""

    def __init__(self, w: torch.Tensor, meta: dict[str, Any]):
        self.w, self.meta, self.received = w, meta, None

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "meta": self.meta, "epoch": self.meta.get("epoch", 0)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.received = sd


VALUES = {
    "epoch": 11,
    "lr": 3e-4,
    "betas": (0.9, 0.999),
    "milestones": collections.Counter({30: 1, 80: 2}),
    "per_layer": {0: "a", 1: "b"},
    "best": float("-inf"),
    "blob": b"\x00\x01",
}


def test_plain_values_round_trip(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(1), "cfg": VALUES, "n": 5, "name": "run-1"}, tmp_path / "ck", step=9)
    res = reshard.load({"w": torch.zeros(1), "cfg": {}, "n": 0, "name": ""}, tmp_path / "ck")
    assert res.step == 9
    assert res.values["n"] == 5 and res.values["name"] == "run-1"
    cfg = res.values["cfg"]
    assert cfg == VALUES
    assert type(cfg["betas"]) is tuple and type(cfg["milestones"]) is collections.Counter
    assert list(cfg["per_layer"]) == [0, 1]


def test_values_reach_stateful_load_state_dict(tmp_path: Path) -> None:
    src = Holder(torch.arange(3.0), {"epoch": 4, "lr": 0.5, "ms": collections.Counter({2: 1})})
    reshard.save({"sched": src, "rng": ShardedObject("rng", {"seed": 17})}, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    assert set(m.tensors) == {"sched.w"}
    assert set(m.values) == {"sched.meta", "sched.epoch"}
    assert set(m.objects) == {"rng"}
    dst = Holder(torch.zeros(3), {"epoch": 0})
    res = reshard.load({"sched": dst, "rng": ShardedObject("rng", None)}, tmp_path / "ck")
    assert dst.received is not None
    assert dst.received["w"] is dst.w  # filled in place, same tensor handed back
    assert dst.w.tolist() == [0.0, 1.0, 2.0]
    assert dst.received["meta"] == {"epoch": 4, "lr": 0.5, "ms": collections.Counter({2: 1})}
    assert type(dst.received["meta"]["ms"]) is collections.Counter
    assert dst.received["epoch"] == 4
    assert res.values["rng"] == {"seed": 17}


def test_values_that_cannot_be_encoded_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ShardingError, match=r"cfg\.fn"):
        reshard.save({"cfg": {"fn": object()}}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_object_grid_of_another_shape_is_refused(tmp_path: Path) -> None:
    state = {"cur": [ShardedObject("cursor", {"pos": 10 + r}, global_shape=(4,), global_offset=(r,))
                     for r in range(4)]}
    reshard.save({"c": state["cur"][0], "d": state["cur"][1], "e": state["cur"][2], "f": state["cur"][3]},
                 tmp_path / "ck")
    res = reshard.load({"c": ShardedObject("cursor", None, global_shape=(4,), global_offset=(2,))},
                       tmp_path / "ck")
    assert res.values["cursor"] == {"pos": 12}
    with pytest.raises(ShardingError, match=r"saved as a grid of shape \[4\], requested in a grid of shape \[2\]"):
        reshard.load({"c": ShardedObject("cursor", None, global_shape=(2,), global_offset=(0,))}, tmp_path / "ck")


# ----------------------------------------------------------------------------- paths, overwrite


def test_save_refuses_existing_checkpoint_unless_overwrite(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    reshard.save({"w": torch.ones(2), "v": 1}, ck, step=1)
    first = reshard.inspect(ck)
    with pytest.raises(CheckpointError, match="already there") as ei:
        reshard.save({"w": torch.full((2,), 2.0), "v": 2}, ck, step=2)
    assert "overwrite" in str(ei.value)
    assert reshard.inspect(ck) == first  # untouched
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the refused attempt left nothing behind
    reshard.save({"w": torch.full((3,), 2.0), "v": 2}, ck, step=2, options=SaveOptions(overwrite=True))
    second = reshard.inspect(ck)
    assert second.step == 2 and second.attempt_id != first.attempt_id
    w = torch.zeros(3)
    res = reshard.load({"w": w, "v": 0}, ck)
    assert w.tolist() == [2.0, 2.0, 2.0] and res.values["v"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # old one retired and removed
    assert sorted(os.listdir(ck)) == ["data-r00000-0.safetensors", "manifest.json", "plan.bin"]


def test_save_creates_parent_directories(tmp_path: Path) -> None:
    ck = tmp_path / "a" / "b" / "c" / "step-00000001"
    res = reshard.save({"w": torch.ones(2)}, ck, step=1)
    assert res.path == str(ck) and res.step == 1
    assert (ck / "manifest.json").is_file()
    assert os.listdir(ck.parent) == ["step-00000001"]  # no attempt directory left over
    w = torch.zeros(2)
    reshard.load({"w": w}, f"file://{ck}")
    assert w.tolist() == [1.0, 1.0]


def test_save_and_load_leave_global_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = (torch.get_rng_state().clone(), random.getstate(), np.random.get_state())
    state = {"w": torch.arange(10.0), "sh": ShardedTensor("s", torch.ones(3), global_shape=(3,), global_offset=(0,)),
             "rng": ShardedObject("rng", {"x": 1}), "v": {"a": (1, 2)}}
    reshard.save(state, tmp_path / "ck", step=1)
    reshard.save(state, tmp_path / "ck", step=2, options=SaveOptions(overwrite=True))
    reshard.load({"w": torch.zeros(10), "sh": ShardedTensor("s", torch.zeros(3), global_shape=(3,),
                                                             global_offset=(0,)),
                  "rng": ShardedObject("rng", None), "v": None}, tmp_path / "ck")
    reshard.latest(tmp_path)
    reshard.verify(tmp_path / "ck")
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    assert torch.equal(before[0], after[0])
    assert hash(before[1]) == hash(after[1]), "Python's global random state changed"
    assert before[2][0] == after[2][0] and np.array_equal(before[2][1], after[2][1])
    assert before[2][2:] == after[2][2:]
    # and the generators still produce the same next numbers as a fresh seeding would
    x = (torch.rand(2).tolist(), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    assert x == (torch.rand(2).tolist(), random.random(), np.random.rand())


def test_memory_url_round_trip() -> None:
    url = "memory://test-save-load/ck-1"
    store = MemoryStorage()
    store.delete_tree("test-save-load")
    try:
        full = torch.arange(12).reshape(3, 4)
        reshard.save({"w": [shard("w", full, (0, 0), (1, 4)), shard("w", full, (1, 0), (2, 4))], "v": (1, "x")},
                     url, step=3)
        assert "test-save-load/ck-1/manifest.json" in store._objects
        assert reshard.inspect(url).step == 3
        tg = targets("w", (3, 4), [[], [2]])
        res = reshard.load({"w": tg, "v": None}, url)
        assert assemble(tg).tolist() == full.tolist()
        assert res.values["v"] == (1, "x")
        assert reshard.verify(url).ok
        assert reshard.latest("memory://test-save-load") == url  # a URL root gives a URL
        with pytest.raises(CheckpointError, match="already there"):
            reshard.save({"w": full}, url)
        with pytest.raises(CheckpointError, match="overwrite is refused"):
            reshard.save({"w": full}, url, options=SaveOptions(overwrite=True))
    finally:
        store.delete_tree("test-save-load")


def test_shard_files_open_with_safetensors(tmp_path: Path) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    flat = torch.arange(6, dtype=torch.int16)
    bf = random_bits((5,), torch.bfloat16, 3)
    state = {"w": full, "b": bf, "flag": torch.tensor(True),
             "s": [shard("s", full, (0, 0), (4, 3)), shard("s", full, (0, 3), (4, 3))],
             "z": [ShardedTensor("z", flat[0:4], global_shape=(2, 3), global_offset=(0, 0), local_shape=(2, 3),
                                 flattened_range=slice(0, 4)),
                   ShardedTensor("z", flat[4:6], global_shape=(2, 3), global_offset=(0, 0), local_shape=(2, 3),
                                 flattened_range=slice(4, 6))]}
    reshard.save(state, tmp_path / "ck", options=SaveOptions(files_per_rank=2))
    m = reshard.inspect(tmp_path / "ck")
    files = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name not in ("manifest.json", "plan.bin"))
    assert files == sorted(m.files) == ["data-r00000-0.safetensors", "data-r00000-1.safetensors"]
    found: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(tmp_path / "ck" / name), framework="pt") as f:
            assert f.metadata() == {"format": "reshard"}
            for k in f.keys():
                if k == "__reshard__/blocks":  # the 8-byte digest of every block, last in the file
                    assert f.get_tensor(k).numel() == 8 * m.files[name].blocks > 0
                    continue
                found[k] = f.get_tensor(k)
    assert sorted(found) == ["b@0", "flag", "s@0,0", "s@0,3", "w@0,0", "z@0,0#0:4", "z@0,0#4:6"]
    assert_bit_equal(found["w@0,0"], full)
    assert_bit_equal(found["b@0"], bf)
    assert_bit_equal(found["flag"], torch.tensor(True))
    assert_bit_equal(found["s@0,3"], full[:, 3:])
    assert_bit_equal(found["z@0,0#4:6"], flat[4:6])
    # the manifest's absolute byte ranges point at the same bytes
    for fqn, te in m.tensors.items():
        for c in te.chunks:
            raw = (tmp_path / "ck" / c.file).read_bytes()[c.offset:c.offset + c.length]
            key = fqn + ("@" + ",".join(map(str, c.global_offset)) if c.global_offset else "")
            if c.flattened_range:
                key += "#{}:{}".format(*c.flattened_range)
            assert raw == bytes(bits(found[key]))


def test_manifest_is_plain_json(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(2), "v": {1: (2, 3)}}, tmp_path / "ck", step=5,
                 options=SaveOptions(schema_version="v3", mesh={"dp": 1}, extra={"note": "x"}))
    d = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert d["format"] == "reshard" and d["format_version"] == 3
    assert d["step"] == 5 and d["schema_version"] == "v3" and d["mesh"] == {"dp": 1}
    assert next(iter(d)) == "manifest_xxh3_64"  # the manifest's own checksum first (test_manifest_seal)
    seal = d.pop("manifest_xxh3_64")
    assert d["extra"] == {"note": "x"} and len(seal) == 16 and d["required_features"] == []
    assert reshard.inspect(tmp_path / "ck").extra == {"note": "x"}  # as the user gave it
    assert d["tensors"]["w"]["dtype"] == "float32" and d["tensors"]["w"]["global_shape"] == [2]
    # a load expecting another schema version is refused
    with pytest.raises(ShardingError, match="schema_version 'v3' differs from the expected 'v4'"):
        reshard.load({"w": torch.zeros(2), "v": None}, tmp_path / "ck", options=LoadOptions(schema_version="v4"))


def test_tied_weights_stored_once(tmp_path: Path) -> None:
    emb = torch.arange(6.0).reshape(3, 2)
    reshard.save({"emb": {"weight": emb}, "head": {"weight": emb}}, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    assert set(m.tensors) == {"emb.weight"} and m.aliases == {"head.weight": "emb.weight"}
    a, b = torch.zeros(3, 2), torch.zeros(3, 2)
    reshard.load({"emb": {"weight": a}, "head": {"weight": b}}, tmp_path / "ck")
    assert a.tolist() == emb.tolist() and b.tolist() == emb.tolist()
    # equal values but distinct tensors are two tensors
    reshard.save({"emb": {"weight": emb}, "head": {"weight": emb.clone()}}, tmp_path / "ck2")
    assert set(reshard.inspect(tmp_path / "ck2").tensors) == {"emb.weight", "head.weight"}


def test_checksums_off_with_replica_ids_plans(tmp_path: Path) -> None:
    """checksums=False must not make a replicated chunk's holders disagree (one computes
    a digest, the other not): the planner compares digests of all holders."""
    from reshard.planning.planner import LocalPlan, plan_save
    from reshard.saving.save import collect

    opts = SaveOptions(checksums=False)
    plans = []
    for rank in (0, 1):
        st = ShardedTensor("w", torch.arange(4.0), global_shape=(4,), global_offset=(0,), replica_id=rank)
        snap = collect({"w": st}, rank, opts)
        plans.append(LocalPlan(rank=rank, tensors=tuple(t for t, _, _ in snap.tensors)))
    assert plans[0].tensors[0].digest == plans[1].tensors[0].digest
    sp = plan_save(plans)
    assert sum(len(w) for w in sp.writes.values()) == 1
    # and a single-process save with checksums off loads back (nothing to verify)
    reshard.save({"w": torch.arange(4.0)}, tmp_path / "ck", options=opts)
    assert reshard.inspect(tmp_path / "ck").tensors["w"].chunks[0].checksums == ()
    w = torch.zeros(4)
    reshard.load({"w": w}, tmp_path / "ck")
    assert w.tolist() == [0.0, 1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- random reshard, end to end


@st.composite
def flat_layouts(draw, gshape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None]]:
    """A random grid partition of gshape; some boxes split into flattened ranges."""
    cuts = [sorted(draw(st.sets(st.integers(1, g - 1), max_size=2))) if g > 1 else [] for g in gshape]
    out = []
    for off, shp in blocks(gshape, cuts):
        n = int(np.prod(shp))
        if n >= 2 and draw(st.booleans()):
            cs = sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=2)))
            b = [0, *cs, n]
            out.extend((off, shp, (a, z)) for a, z in zip(b[:-1], b[1:]))
        else:
            out.append((off, shp, None))
    return out


def _sts(fqn: str, full: torch.Tensor, layout, fill: int | None) -> list[ShardedTensor]:
    out = []
    for off, shp, fr in layout:
        box = full[tuple(slice(o, o + s) for o, s in zip(off, shp))].reshape(-1)
        if fr is None:
            data = box.reshape(shp).clone() if fill is None else torch.full(shp, fill, dtype=full.dtype)
            out.append(ShardedTensor(fqn, data, global_shape=tuple(full.shape), global_offset=off))
        else:
            data = box[fr[0]:fr[1]].clone() if fill is None else torch.full((fr[1] - fr[0],), fill, dtype=full.dtype)
            out.append(ShardedTensor(fqn, data, global_shape=tuple(full.shape), global_offset=off, local_shape=shp,
                                     flattened_range=slice(*fr)))
    return out


@settings(max_examples=25, deadline=None)
@given(st.data(), st.booleans(), st.sampled_from([1, 4]))
def test_random_reshard_end_to_end(data, direct: bool, threads: int) -> None:
    ndim = data.draw(st.integers(1, 3))
    gshape = tuple(data.draw(st.integers(0, 6)) for _ in range(ndim))
    full = torch.arange(int(np.prod(gshape)), dtype=torch.int32).reshape(gshape)
    saved = _sts("w", full, data.draw(flat_layouts(gshape)), None)
    wanted = _sts("w", full, data.draw(flat_layouts(gshape)), -1)
    opts = LoadOptions(direct_read_min_bytes=0 if direct else 1 << 20, threads=threads,
                       checksums=data.draw(st.booleans()))
    block = data.draw(st.sampled_from([4, 12, 1 << 20]))
    with tempfile.TemporaryDirectory() as d:
        reshard.save({"w": saved}, os.path.join(d, "ck"), options=SaveOptions(durable=False,
                                                                               checksum_block_bytes=block))
        reshard.load({"w": wanted}, os.path.join(d, "ck"), options=opts)
    for t in wanted:
        box = full[tuple(slice(o, o + s) for o, s in zip(t.global_offset, t.local_shape))]
        want = box.reshape(-1)[t.flattened_range].tolist() if t.flattened_range else box.tolist()
        assert t.data.tolist() == want, (t.global_offset, t.local_shape, t.flattened_range)


@pytest.mark.parametrize("direct", [False, True])
def test_single_element_views_with_odd_strides(tmp_path: Path, direct: bool) -> None:
    """A 1-element view (e.g. ``x[1:2, 2]``) counts as contiguous with any stride: saving
    it, encoding it in a value, and reading straight into one must all work."""
    src = torch.arange(12.0).reshape(4, 3)[1:2, 2]
    assert src.stride() == (3,)
    reshard.save({"w": src}, tmp_path / "ck")
    base = torch.zeros(4, 3)
    dst = base[0:1, 0]
    reshard.load({"w": dst}, tmp_path / "ck",
                 options=LoadOptions(direct_read_min_bytes=0 if direct else 1 << 20))
    assert base.tolist() == [[5.0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert reshard.ondisk.codec.decode(reshard.ondisk.codec.encode({"t": src}))["t"].tolist() == [5.0]


@pytest.mark.parametrize("flip", [None, 800, 4000, 7500])
def test_partial_chunk_read_straight_into_the_target(tmp_path: Path, flip: int | None) -> None:
    """Rows inside one saved chunk whose bytes start and end inside checksum
    blocks (what a 2 -> 4 reshard asks for) are read straight into the target:
    the blocks they cover whole are verified in place, the partial first and
    last blocks through a scratch block; a flipped byte in any of them is
    found, and only the blocks needed are read."""
    full = torch.arange(64 * 37, dtype=torch.float32).reshape(64, 37)  # rows of 148 bytes
    ck = tmp_path / "ck"
    reshard.save({"w": full}, ck, options=SaveOptions(durable=False, checksum_block_bytes=1024))
    (c,) = reshard.inspect(ck).tensors["w"].chunks
    if flip is not None:  # chunk bytes: 800 in block 0, 4000 in block 3, 7500 in block 7
        f = ck / c.file
        raw = bytearray(f.read_bytes())
        raw[c.offset + flip] ^= 0x40
        f.write_bytes(bytes(raw))
    # rows 5..49: chunk bytes [740, 7400), blocks 0 (partial) .. 7 (partial)
    dst = ShardedTensor("w", torch.zeros(45, 37), global_shape=(64, 37), global_offset=(5, 0))
    opts = LoadOptions(direct_read_min_bytes=0, threads=1)
    if flip is None:
        res = reshard.load({"w": [dst]}, ck, options=opts)
        assert torch.equal(dst.data, full[5:50])
        table = 8 * 10  # the chunk's 10 block digests (8 bytes each)
        assert res.bytes_read - (ck / "manifest.json").stat().st_size - table == 8 * 1024  # blocks 0..7
        return
    with pytest.raises(IntegrityError, match=rf"checksum mismatch in 'w' .*block {flip // 1024}\b") as ei:
        reshard.load({"w": [dst]}, ck, options=opts)
    assert "had already written 1 target(s)" in str(ei.value)
    if flip == 7500:  # the last block is checked last: every whole block is already in place
        assert torch.equal(dst.data[2:43], full[7:48])


class _Counters:
    """A trainer's counters (TorchTitan's TrainState shape): whatever it holds."""

    def __init__(self, step: Any, note: Any = "x") -> None:
        self.step, self.note = step, note

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "note": self.note}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.note = sd["step"], sd["note"]


def test_a_counter_saved_as_a_tensor_or_an_int_round_trips_into_the_other_kind(tmp_path: Path) -> None:
    """A leaf saved as a tensor and loaded where the template holds a number
    (train_state.step = torch.tensor(5) saved by one trainer version, an int in
    the next) comes back as the tensor saved, never left as the template had
    it; a number saved loads into a one-element tensor template; anything else
    into a tensor is refused naming the key, before any target is written."""
    reshard.save({"ts": _Counters(torch.tensor(5, dtype=torch.int32))}, tmp_path / "t", step=5)
    got = _Counters(0)
    reshard.load({"ts": got}, tmp_path / "t")
    assert isinstance(got.step, torch.Tensor) and got.step.dtype == torch.int32 and got.step.item() == 5
    reshard.save({"ts": _Counters(7)}, tmp_path / "i", step=7)
    into = _Counters(torch.tensor(0))
    reshard.load({"ts": into}, tmp_path / "i")
    assert isinstance(into.step, torch.Tensor) and into.step.item() == 7
    bad = _Counters(torch.tensor(0), torch.zeros(2))
    with pytest.raises(ShardingError, match=r"ts\.note: saved as a value \(str\), requested as a tensor"):
        reshard.load({"ts": bad}, tmp_path / "i")
    assert bad.step.item() == 0  # unchanged
