"""Loads from TP-sharded (and ZeRO-flattened) chunks into other boxes and flat
ranges: the strided copies of the "gather" read path, and storage reads
bounded by chunks (not rows), on real files."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard
from reshard import SaveOptions, ShardedTensor
from reshard.faults.inject import FaultStorage
from reshard.state.sharding import flat_range_boxes
from reshard.storage import LocalStorage


def _flat_indices(shape: tuple[int, ...], off: tuple[int, ...], shp: tuple[int, ...]) -> list[int]:
    full = torch.arange(math.prod(shape)).reshape(shape)
    return full[tuple(slice(o, o + s) for o, s in zip(off, shp, strict=True))].reshape(-1).tolist()


@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple), data=st.data())
@settings(max_examples=200, deadline=None)
def test_flat_range_boxes_tile_the_range_in_order(shape: tuple[int, ...], data: st.DataObject) -> None:
    n = math.prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    boxes = flat_range_boxes(shape, a, b)
    got = [i for off, shp in boxes for i in _flat_indices(shape, off, shp)]
    assert got == list(range(a, b))
    assert all(math.prod(s) > 0 for _, s in boxes)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def _tp_zero_chunks(full: torch.Tensor, dim: int, tp: int, cuts: list[int]) -> list[ShardedTensor]:
    """``full`` split in ``tp`` boxes along ``dim`` (TP), each box's flattening
    cut at the fractions ``cuts`` (ZeRO over data parallel ranks)."""
    out = []
    size = full.shape[dim] // tp
    for t in range(tp):
        off = [0] * full.dim()
        off[dim] = t * size
        shp = list(full.shape)
        shp[dim] = size
        box = full.narrow(dim, t * size, size).contiguous()
        n = box.numel()
        edges = sorted({0, n, *(c * n // 100 for c in cuts)})
        for a, b in zip(edges[:-1], edges[1:], strict=True):  # non-empty ranges
            out.append(ShardedTensor("w", box.reshape(-1)[a:b].clone(), global_shape=tuple(full.shape),
                                     global_offset=tuple(off), local_shape=tuple(shp),
                                     flattened_range=slice(a, b)))
    return out


@given(dim=st.integers(0, 2), cuts=st.lists(st.integers(0, 100), max_size=3), data=st.data())
@settings(max_examples=25, deadline=None)
def test_tp_zero_chunks_load_into_any_box_and_flat_range(dim: int, cuts: list[int], data: st.DataObject) -> None:
    """Chunks that are flat ranges of TP boxes (dp2,tp2 moments) loaded into
    a random box (a PP stage's whole tensor, another TP split), whole or one
    flat range of it (ZeRO over another dp), equal the saved elements."""
    gshape = (4, 6, 4)
    full = torch.arange(math.prod(gshape), dtype=torch.float32).reshape(gshape) * 0.5 + 1.0
    off = tuple(data.draw(st.integers(0, g - 1)) for g in gshape)
    shp = tuple(data.draw(st.integers(1, g - o)) for g, o in zip(gshape, off, strict=True))
    ref = full[tuple(slice(o, o + s) for o, s in zip(off, shp, strict=True))].reshape(-1)
    n = ref.numel()
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    flat = data.draw(st.booleans())
    with tempfile.TemporaryDirectory() as d:
        reshard.save({"w": _tp_zero_chunks(full, dim, 2, cuts)}, Path(d) / "ck")
        if flat:
            tgt = ShardedTensor("w", torch.full((b - a,), -1.0), global_shape=gshape, global_offset=off,
                                local_shape=shp, flattened_range=slice(a, b))
            reshard.load({"w": tgt}, Path(d) / "ck")
            assert torch.equal(tgt.data, ref[a:b])
        else:
            # a non-contiguous destination: the box in a transposed tensor
            dst = torch.full(tuple(reversed(shp)), -1.0).permute(*reversed(range(len(shp))))
            tgt = ShardedTensor("w", dst, global_shape=gshape, global_offset=off)
            reshard.load({"w": tgt}, Path(d) / "ck")
            assert torch.equal(dst.reshape(-1), ref)


def test_column_shards_read_into_a_full_tensor_with_reads_bounded_by_chunks(tmp_path: Path) -> None:
    """Column shards (Shard(1)) of a [512, 64] tensor, each also split in two
    flat ranges, loaded whole (a tp1 PP stage) through a counting storage:
    data reads stay at most one per chunk and checksum block, never one per
    row; the values are exact, checksums verified."""
    full = torch.randn(512, 64)
    chunks = _tp_zero_chunks(full, 1, 2, [50])
    cols = [ShardedTensor("c", full[:, k * 32:(k + 1) * 32].clone(), global_shape=(512, 64),
                          global_offset=(0, k * 32)) for k in range(2)]
    block = 16 << 10
    reshard.save({"w": chunks, "c": cols}, tmp_path / "ck", options=SaveOptions(checksum_block_bytes=block))
    m = reshard.inspect(tmp_path / "ck")
    blocks = sum(-(-c.length // block) for te in m.tensors.values() for c in te.chunks)
    n_chunks = sum(len(te.chunks) for te in m.tensors.values())
    assert n_chunks == 6 and blocks < 512  # fewer blocks than rows: a per-row read would show
    fs = FaultStorage(LocalStorage())
    w, c = torch.zeros(512, 64), torch.zeros(512, 64)
    reshard.load({"w": w, "c": c}, str(tmp_path / "ck"), storage=fs)
    assert torch.equal(w, full) and torch.equal(c, full)
    reads = [p for op, p in fs.log if op == "read" and "data-" in p]
    assert 1 <= len(reads) <= n_chunks


def test_restore_smoke_test_of_tp_zero_chunks_checks_their_bytes(tmp_path: Path) -> None:
    """The manager's restore smoke test trial-loads the largest tensor whole
    from TP x ZeRO chunks (the strided gather path): it passes on the saved
    checkpoint and fails, recording nothing wrong as good, once one byte of
    such a chunk is flipped on disk."""
    from reshard.catalog.records import check_and_record

    full = torch.randn(256, 48)
    state = {"w": _tp_zero_chunks(full, 1, 2, [40]), "b": torch.ones(3)}
    reshard.save(state, tmp_path / "step-00000001", options=SaveOptions(checksum_block_bytes=4096))
    st = LocalStorage()
    assert check_and_record(st, str(tmp_path), "step-00000001", smoke_tensors=2, record=False)
    m = reshard.inspect(tmp_path / "step-00000001")
    c = m.tensors["w"].chunks[2]  # the second TP box's first flat range
    f = tmp_path / "step-00000001" / c.file
    raw = bytearray(f.read_bytes())
    raw[c.offset + c.length // 2] ^= 0x40
    f.write_bytes(bytes(raw))
    assert not check_and_record(st, str(tmp_path), "step-00000001", smoke_tensors=2, record=False)
