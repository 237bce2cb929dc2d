"""Rank functions for tests/loading/test_read_once.py (4 gloo ranks, TP2 x DP2)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard import LoadOptions, ShardedTensor
from reshard.collectives import TorchCollectives
from reshard.errors import CheckpointError
from reshard.loading.load import READ_ONCE

#: (rows, cols) of each saved tensor: two above direct_read_min_bytes per TP shard
#: (read straight into the destination), two small ones (coalesced spans)
SHAPES = {"big0": (1024, 512), "big1": (2048, 256), "small0": (64, 16), "small1": (8, 4)}


def full(name: str) -> torch.Tensor:
    rows, cols = SHAPES[name]
    seed = sum(map(ord, name))
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.25 + seed)


def total_bytes() -> int:
    return sum(r * c * 4 for r, c in SHAPES.values())


def _tp2_dp2(fill: bool, transposed: bool = False) -> dict[str, Any]:
    """Rows split over tp = rank % 2; the two dp = rank // 2 hold replicas.
    ``transposed``: destinations are column-major views (no direct read)."""
    rank = dist.get_rank()
    tp, dp = rank % 2, rank // 2
    out: dict[str, Any] = {}
    for name, (rows, cols) in SHAPES.items():
        h = rows // 2
        if fill:
            data = full(name)[tp * h:(tp + 1) * h].clone()
        elif transposed:
            data = torch.full((cols, h), -1.0).t()
        else:
            data = torch.full((h, cols), -1.0)
        out[name] = ShardedTensor(name, data, global_shape=(rows, cols), global_offset=(tp * h, 0),
                                  replica_id=dp)
    return out


def r_save(path: str) -> None:
    reshard.save(_tp2_dp2(True), path)


def _result(res: reshard.LoadResult, state: dict[str, Any], expect: dict[str, torch.Tensor]) -> dict[str, Any]:
    exact = all(torch.equal(state[k].data if isinstance(state[k], ShardedTensor) else state[k], v)
                for k, v in expect.items())
    return {"exact": exact, "chunk_bytes": res.chunk_bytes_read, "received": res.bytes_received,
            "sent": res.bytes_sent, "note": res.notes.get(READ_ONCE)}


def r_load_same(path: str, read_once: bool, transposed: bool = False) -> dict[str, Any]:
    """Into the saved layout (TP2 x DP2)."""
    tgt = _tp2_dp2(False, transposed)
    res = reshard.load(tgt, path, options=LoadOptions(read_once=read_once, read_once_min_bytes=0))
    return _result(res, tgt, {k: v.data for k, v in _tp2_dp2(True).items()})


def r_load_whole(path: str, read_once: bool) -> dict[str, Any]:
    """Every rank loads every tensor whole (a plain, replicated tensor)."""
    tgt = {name: torch.full(shape, -1.0) for name, shape in SHAPES.items()}
    res = reshard.load(tgt, path, options=LoadOptions(read_once=read_once, read_once_min_bytes=0))
    return _result(res, tgt, {name: full(name) for name in SHAPES})


def r_load_transport_fails(path: str) -> dict[str, Any]:
    """The point-to-point transfer raises on every rank (as a lost peer
    would): every rank reads from storage itself."""
    orig = TorchCollectives.exchange

    def broken(self: TorchCollectives, sends: Any, recvs: Any) -> None:
        raise CheckpointError(f"exchange over the group failed on rank {self.rank} (injected)")

    TorchCollectives.exchange = broken  # type: ignore[method-assign]
    try:
        return r_load_same(path, True)
    finally:
        TorchCollectives.exchange = orig  # type: ignore[method-assign]


def r_load_default_threshold(path: str) -> dict[str, Any]:
    """The default read_once_min_bytes: ranges under it are read by every rank."""
    tgt = _tp2_dp2(False)
    res = reshard.load(tgt, path, options=LoadOptions(read_once=True))
    return _result(res, tgt, {k: v.data for k, v in _tp2_dp2(True).items()})


def r_load_corrupt(path: str) -> str:
    """A corrupt block: the rank that reads it fails, and every rank raises."""
    try:
        reshard.load(_tp2_dp2(False), path, options=LoadOptions(read_once=True, read_once_min_bytes=0))
    except CheckpointError as e:
        return type(e).__name__ + ": " + str(e)
    return "no error"
