"""Rank functions for tests/test_arrival.py (run inside WorkerPool workers,
imported by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import reshard


def _state() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.arange(8 * world, dtype=torch.float32)[8 * rank:8 * rank + 8].clone()
    return {"w": reshard.ShardedTensor("w", w, global_shape=(8 * world,), global_offset=(8 * rank,)),
            "step": 5}


def r_rank0_only(root: str, bound: float) -> dict[str, Any]:
    """Rank 0 calls save, async_save and load as a rank-0-only plug-in point
    would (arrival_timeout_s=``bound``); rank 1 does something else and
    returns. Rank 0 reports each failure: its class, message, absent ranks and
    seconds."""
    if dist.get_rank() != 0:
        torch.randn(64, 64).matmul(torch.randn(64, 64))  # something else than a checkpoint
        return {}
    out: dict[str, Any] = {}
    sopts = reshard.SaveOptions(durable=False, arrival_timeout_s=bound)
    calls = {
        "save": lambda: reshard.save(_state(), f"{root}/solo", step=5, options=sopts),
        "async_save": lambda: reshard.async_save(_state(), f"{root}/solo-async", step=5, options=sopts).wait(),
        "load": lambda: reshard.load(_state(), f"{root}/together",
                                     options=reshard.LoadOptions(arrival_timeout_s=bound)),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = {"error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = {"type": type(e).__name__, "checkpoint_error": isinstance(e, reshard.CheckpointError),
                         "message": str(e), "absent": list(getattr(e, "absent_ranks", ())),
                         "seconds": time.monotonic() - t0}
    return out


def r_together(root: str, name: str, late_rank: int = -1, late_s: float = 0.0,
               bound: float | None = None) -> dict[str, Any]:
    """Every rank saves, then loads back, ``root/name`` (rank ``late_rank``
    arriving ``late_s`` seconds late at the save); then a collective of the
    training group. Returns what was loaded and the training all-reduce."""
    kw: dict[str, Any] = {} if bound is None else {"arrival_timeout_s": bound}
    if dist.get_rank() == late_rank:
        time.sleep(late_s)
    reshard.save(_state(), f"{root}/{name}", step=5, options=reshard.SaveOptions(durable=False, **kw))
    target = _state()
    target["w"].data.zero_()
    res = reshard.load(target, f"{root}/{name}", options=reshard.LoadOptions(**kw))
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"w": target["w"].data.tolist(), "step": res.values["step"], "sum": float(t.item())}
