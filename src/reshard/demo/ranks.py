"""Rank functions of ``reshard demo``: a save on N gloo ranks and a load on M.

They run inside :class:`reshard.testing.pool.WorkerPool` workers (imported by
name there), on an initialised default gloo group. Every element of the
synthetic state encodes its global index, so a load into any layout can be
checked bit-exactly without comparing against a copy of the saved state.

State (``rows`` is the demo's ``--rows``):

* ``model.row_w``: ``[rows, 64]`` float32, element ``(i, j)`` = ``i * 64 + j``;
* ``model.col_w``: ``[64, rows]`` float32, element ``(i, j)`` = ``ROW_BASE + i * rows + j``;
* ``model.norm``: ``[64]`` float32, element ``j`` = ``NORM_BASE + j`` (replicated);
* ``step``: the plain value ``1``.

float32 holds every integer below 2**24 exactly, hence ``MAX_ROWS``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import reshard

WIDTH = 64
MAX_ROWS = (1 << 24) // (2 * WIDTH) - 1


def splits(n: int, parts: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``parts`` nearly equal pieces of ``n`` (first ones longer)."""
    q, r = divmod(n, parts)
    out, off = [], 0
    for i in range(parts):
        k = q + (1 if i < r else 0)
        out.append((off, k))
        off += k
    return out


def expected(name: str, rows: int) -> torch.Tensor:
    """The full logical tensor ``name`` of the demo state."""
    if name == "model.row_w":
        return torch.arange(rows * WIDTH, dtype=torch.float32).reshape(rows, WIDTH)
    if name == "model.col_w":
        return (rows * WIDTH + torch.arange(WIDTH * rows, dtype=torch.float32)).reshape(WIDTH, rows)
    if name == "model.norm":
        return 2 * rows * WIDTH + torch.arange(WIDTH, dtype=torch.float32)
    raise KeyError(name)


def save_layout(rows: int, world: int) -> str:
    r = "/".join(str(k) for _, k in splits(rows, world))
    return (f"row_w [{rows},{WIDTH}] dim0 split {r}; col_w [{WIDTH},{rows}] dim1 split {r}; "
            f"norm [{WIDTH}] replicated x{world}; step value")


def load_layout(rows: int, world: int) -> str:
    c = "/".join(str(k) for _, k in splits(WIDTH, world))
    f = "/".join(str(k) for _, k in splits(WIDTH * rows, world))
    return (f"row_w dim1 split {c}; col_w flat (ZeRO-style) split {f}; "
            f"norm whole on every rank; step value")


def _timed(fn: Any) -> tuple[Any, float]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t0


def save_rank(path: str, rows: int) -> dict[str, Any]:
    """Build this rank's shards of the demo state and save them at step 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    off, n = splits(rows, world)[rank]
    model: dict[str, Any] = {"norm": expected("model.norm", rows).clone()}
    if n:
        model["row_w"] = reshard.ShardedTensor(
            "row_w", expected("model.row_w", rows)[off:off + n].clone(),
            global_shape=(rows, WIDTH), global_offset=(off, 0))
        model["col_w"] = reshard.ShardedTensor(
            "col_w", expected("model.col_w", rows)[:, off:off + n].contiguous(),
            global_shape=(WIDTH, rows), global_offset=(0, off))
    state = {"model": model, "step": 1}
    opts = reshard.SaveOptions(overwrite=True, mesh={"dp": world}, extra={"demo": True})
    res, secs = _timed(lambda: reshard.save(state, path, step=1, options=opts))
    return {"seconds": secs, "bytes_written": res.bytes_written, "total_bytes": res.total_bytes,
            "num_files": res.num_files}


def load_rank(path: str, rows: int) -> dict[str, Any]:
    """Load the demo state into another layout and check every element."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sentinel = float("nan")
    coff, cn = splits(WIDTH, world)[rank]
    foff, fn = splits(WIDTH * rows, world)[rank]
    targets: dict[str, torch.Tensor] = {"model.norm": torch.full((WIDTH,), sentinel)}
    model: dict[str, Any] = {"norm": targets["model.norm"]}
    if cn:
        targets["model.row_w"] = torch.full((rows, cn), sentinel)
        model["row_w"] = reshard.ShardedTensor(
            "row_w", targets["model.row_w"], global_shape=(rows, WIDTH), global_offset=(0, coff))
    if fn:
        targets["model.col_w"] = torch.full((fn,), sentinel)
        model["col_w"] = reshard.ShardedTensor(
            "col_w", targets["model.col_w"], global_shape=(WIDTH, rows),
            global_offset=(0, 0), local_shape=(WIDTH, rows), flattened_range=slice(foff, foff + fn))
    state = {"model": model, "step": 0}
    res, secs = _timed(lambda: reshard.load(state, path))
    want = {
        "model.norm": expected("model.norm", rows),
        "model.row_w": expected("model.row_w", rows)[:, coff:coff + cn],
        "model.col_w": expected("model.col_w", rows).reshape(-1)[foff:foff + fn],
    }
    max_diff = 0.0
    mismatched = 0
    elements = 0
    for name, got in targets.items():
        w = want[name]
        same = got.view(torch.int32) == w.contiguous().view(torch.int32)
        mismatched += int((~same).sum())
        elements += got.numel()
        if got.numel():
            d = (got.double() - w.double()).abs()
            max_diff = max(max_diff, float("inf") if d.isnan().any() else float(d.max()))
    step = res.values.get("step")
    return {"seconds": secs, "bytes_read": res.bytes_read, "elements": elements,
            "mismatched": mismatched, "max_abs_diff": max_diff, "step": step}
