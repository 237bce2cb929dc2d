"""Rank functions for tests/adapters/test_cursor_packing.py: a sequence packer over a
DataCursor, per rank or global, saved and resumed at any DP size (run inside
WorkerPool workers, imported by name)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import reshard

LEN, GLOBAL_BATCH, SEED = 24, 8, 7
#: capacity of all the bins of one step together (in units of sample length)
STEP_CAPACITY = 22


def length(i: int) -> int:
    """The length of sample ``i`` (1..5)."""
    return 1 + (i * 7) % 5


def _pack(pending: list[int], cap: int) -> list[int]:
    """One bin: samples from the front of ``pending`` while they fit (at least one)."""
    out, used = [], 0
    while pending and (not out or used + length(pending[0]) <= cap):
        used += length(pending[0])
        out.append(pending.pop(0))
    return out


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def cursor(style: str, *, global_batch: int = GLOBAL_BATCH, dataset_len: int = LEN,
           **kw: Any) -> reshard.DataCursor:
    rank, world = _rank()
    scope = "global" if style == "global" else "rank"
    return reshard.DataCursor(dataset_len, global_batch, seed=SEED, dp_rank=rank, dp_size=world,
                              pending_scope=scope, **kw)


def step(cur: reshard.DataCursor, style: str) -> list[list[int]]:
    """One training step; returns the bins trained this step by this rank
    (global packing: every rank computes all bins and trains bin ``rank``;
    returned as all bins on rank 0 only, so that each bin is counted once)."""
    rank, world = _rank()
    if style == "global":
        cur.pending.extend(cur.next_global_batch())
        bins = [_pack(cur.pending, STEP_CAPACITY // world) for _ in range(world)]
        return bins if rank == 0 else []
    cur.pending.extend(cur.next_batch())
    return [_pack(cur.pending, STEP_CAPACITY // world)]


def r_run(path: str | None, style: str, steps: int, resume: bool, **kw: Any) -> dict[str, Any]:
    """Resume from ``path`` (when ``resume``), run ``steps`` steps, save to
    ``path`` (when not resuming). Returns the bins trained and the leftovers
    (global packing: on rank 0 only)."""
    cur = cursor(style, **kw)
    notes: dict[str, Any] = {}
    if resume:
        assert path is not None
        try:
            notes = dict(reshard.load({"data": cur}, path).notes)
        except reshard.CheckpointError as e:
            return {"error": f"{type(e).__name__}: {e}"}
    trained = [step(cur, style) for _ in range(steps)]
    if path is not None and not resume:
        reshard.save({"data": cur}, path, step=steps)
    rank, _ = _rank()
    left = cur.pending if style == "rank" or rank == 0 else []
    return {"trained": trained, "pending": list(left), "notes": notes}


def drawn(steps: int, global_batch: int = GLOBAL_BATCH) -> list[int]:
    """Every sample the cursor hands out over ``steps`` global batches."""
    c = reshard.DataCursor(LEN, global_batch, seed=SEED)
    return [s for _ in range(steps) for s in c.next_global_batch()]


def r_global_as_rank_save(path: str, steps: int) -> None:
    """Global packing under the default pending_scope='rank' (the mistake a
    user makes): every rank's leftovers are the same list."""
    rank, world = _rank()
    cur = reshard.DataCursor(LEN, GLOBAL_BATCH, seed=SEED, dp_rank=rank, dp_size=world)
    for _ in range(steps):
        step(cur, "global")
    reshard.save({"data": cur}, path, step=steps)


def r_dcp_save(path: str, style: str, steps: int) -> dict[str, Any]:
    """As :func:`r_run`, saved with ``torch.distributed.checkpoint.save``."""
    import torch.distributed.checkpoint as dcp

    cur = cursor(style)
    trained = [step(cur, style) for _ in range(steps)]
    dcp.save({"data": cur}, checkpoint_id=path)
    rank, _ = _rank()
    left = cur.pending if style == "rank" or rank == 0 else []
    return {"trained": trained, "pending": list(left), "notes": {}}
