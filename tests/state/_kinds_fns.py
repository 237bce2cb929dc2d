"""A toy tensor subclass, two handlers for it, and the rank functions of
tests/state/test_kinds.py (run inside WorkerPool workers).

``Int8Rows`` is what a weight-only int8 quantization makes of a float matrix
(torchao's ``Int8Tensor`` holds the same: int8 rows and one scale per row),
as a wrapper subclass (``torch.Tensor._make_wrapper_subclass``): its own
storage holds nothing, so saving that storage would save nothing real. It may
be a block of rows ``[row0, row0 + rows)`` of a matrix of ``total`` rows (a
row-sharded weight), so that a handler can describe it as chunks and load it
into another split.

Handlers (registered by the tests themselves, never at import):

* :class:`RowsHandler` saves the int8 rows and the scales as chunks of two
  tensors ``<key>.qdata`` and ``<key>.scale`` (its own memory: filled in place
  at load, into any other split of the rows);
* :class:`FloatHandler` saves the dequantized float matrix at the leaf's own
  key (what any reader, or a plain float target, can load) and requantizes it
  into the target after the reads (``Tree.restore``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard.state import kinds
from reshard.state.sharding import ShardedTensor


class Int8Rows(torch.Tensor):
    """Float32 matrix rows ``[row0, row0 + qdata.shape[0])`` of a matrix of
    ``total`` rows, held as int8 ``qdata`` and a float32 ``scale`` per row."""

    qdata: torch.Tensor
    scale: torch.Tensor
    row0: int
    total: int

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, *, row0: int = 0,
                total: int | None = None) -> Int8Rows:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32,  # type: ignore[attr-defined,no-any-return]
                                                   device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, *, row0: int = 0,
                 total: int | None = None) -> None:
        self.qdata, self.scale = qdata, scale
        self.row0 = row0
        self.total = qdata.shape[0] if total is None else total

    def dequantize(self) -> torch.Tensor:
        return self.qdata.float() * self.scale[:, None]

    def requantize_(self, f: torch.Tensor) -> None:
        """Quantize float rows ``f`` into this tensor's own memory."""
        q, s = quantize(f)
        self.qdata.copy_(q)
        self.scale.copy_(s)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Int8Rows(rows {self.row0}:{self.row0 + self.qdata.shape[0]} of {self.total})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:  # state_dict() detaches: the same memory
            x = args[0]
            return Int8Rows(x.qdata, x.scale, row0=x.row0, total=x.total)
        kwargs = kwargs or {}
        plain = torch.utils._pytree.tree_map_only(Int8Rows, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain[0], **plain[1])


def quantize(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(qdata, scale)`` with ``|qdata| <= 127``."""
    scale = f.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(f / scale[:, None]).to(torch.int8), scale.to(torch.float32)


def int8_rows(f: torch.Tensor, row0: int = 0, rows: int | None = None) -> Int8Rows:
    """Rows ``[row0, row0 + rows)`` of float matrix ``f``, quantized."""
    rows = f.shape[0] - row0 if rows is None else rows
    q, s = quantize(f)
    return Int8Rows(q[row0:row0 + rows].clone(), s[row0:row0 + rows].clone(), row0=row0, total=f.shape[0])


def empty_rows(total: int, cols: int, row0: int = 0, rows: int | None = None) -> Int8Rows:
    """A target: rows ``[row0, row0 + rows)`` of a ``total x cols`` Int8Rows, zero."""
    rows = total - row0 if rows is None else rows
    return Int8Rows(torch.zeros(rows, cols, dtype=torch.int8), torch.zeros(rows), row0=row0, total=total)


class RowsHandler:
    """An ``Int8Rows`` as two tensors, ``qdata`` and ``scale``, chunked by rows."""

    name = "Int8Rows (int8 rows and their scales)"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Int8Rows, at: kinds.Where) -> kinds.Form:
        cols = x.qdata.shape[1]
        return kinds.Tree({
            "qdata": ShardedTensor("qdata", x.qdata, global_shape=(x.total, cols), global_offset=(x.row0, 0)),
            "scale": ShardedTensor("scale", x.scale, global_shape=(x.total,), global_offset=(x.row0,)),
        })

    load = save  # the chunks are the target's own memory: filled in place


class FloatHandler:
    """An ``Int8Rows`` (whole) as its dequantized float matrix, at its own key."""

    name = "Int8Rows (as float32)"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Int8Rows, at: kinds.Where) -> kinds.Form:
        return kinds.Tree(x.dequantize())

    def load(self, x: Int8Rows, at: kinds.Where) -> kinds.Form:
        return kinds.Tree(torch.empty(tuple(x.shape)), restore=x.requantize_)


# ----------------------------------------------------------------------------- rank functions


def save_rows(path: str, seed: int, total: int, cols: int) -> list[int]:
    """Save an even row split of one quantized matrix over the group, with
    :class:`RowsHandler` registered; returns this rank's rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    f = torch.randn(total, cols, generator=torch.Generator().manual_seed(seed))
    per = total // world
    kinds.register(Int8Rows, RowsHandler())
    try:
        reshard.save({"w": int8_rows(f, rank * per, per), "step": 3}, path)
    finally:
        kinds.unregister(Int8Rows)
    return [rank * per, per]


def load_rows(path: str, total: int, cols: int, splits: list[int]) -> dict[str, Any]:
    """Load into rows ``splits[rank]`` long (another split than the save's),
    with :class:`RowsHandler` registered; returns the rows loaded."""
    rank = dist.get_rank()
    row0, rows = sum(splits[:rank]), splits[rank]
    target = empty_rows(total, cols, row0, rows)
    state = {"w": target, "step": 0}
    kinds.register(Int8Rows, RowsHandler())
    try:
        res = reshard.load(state, path)
    finally:
        kinds.unregister(Int8Rows)
    return {"row0": row0, "qdata": target.qdata, "scale": target.scale, "step": res.values["step"]}


def save_one_rank_subclass(path: str) -> tuple[str, bool, str]:
    """Rank 1 alone holds a tensor subclass no handler takes: every rank's save
    must fail before any file is written."""
    rank = dist.get_rank()
    w: torch.Tensor = torch.ones(4, 4)
    if rank == 1:
        w = int8_rows(torch.ones(4, 4))
    try:
        reshard.save({"w": w}, path)
    except Exception as e:  # noqa: BLE001 - returned for the test to compare
        return type(e).__name__, isinstance(e, reshard.CheckpointError), str(e)
    return "", False, "saved"
