"""Rank functions for tests/storage/test_s3.py (run inside WorkerPool workers).

The workers were spawned before the S3 endpoint existed, so every function
takes the endpoint's AWS variables (``env``) and sets them first. Failures
that must happen on every rank are caught and returned as
``(type name, seconds, message)``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import reshard

ROWS, COLS = 192, 1024  # float32: 768 KiB; a shard on 2 ranks spans two 256 KiB parts


def full_weight() -> torch.Tensor:
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.37).sin()


def full_bias() -> torch.Tensor:
    return torch.arange(COLS, dtype=torch.float32) / 7.0


def _rows(rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(ROWS, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def state_for(rank: int, world: int, *, scale: float = 1.0) -> dict[str, Any]:
    """``weight`` row-sharded (uneven for 3 ranks), ``bias`` replicated on every rank."""
    lo, hi = _rows(rank, world)
    w = (full_weight()[lo:hi] * scale).contiguous()
    return {"weight": reshard.ShardedTensor("weight", w, global_shape=(ROWS, COLS),
                                            global_offset=(lo, 0)),
            "bias": full_bias() * scale, "step": 3}


def save_state(env: dict[str, str], url: str, step: int) -> dict[str, Any]:
    os.environ.update(env)
    r, n = dist.get_rank(), dist.get_world_size()
    res = reshard.save(state_for(r, n), url, step=step)
    return {"bytes_written": res.bytes_written, "total": res.total_bytes, "files": res.num_files}


def load_state(env: dict[str, str], url: str) -> bool:
    os.environ.update(env)
    r, n = dist.get_rank(), dist.get_world_size()
    lo, hi = _rows(r, n)
    w = torch.full((hi - lo, COLS), float("nan"))
    b = torch.zeros(COLS)
    state = {"weight": reshard.ShardedTensor("weight", w, global_shape=(ROWS, COLS),
                                             global_offset=(lo, 0)), "bias": b, "step": 0}
    res = reshard.load(state, url)
    return (torch.equal(w, full_weight()[lo:hi]) and torch.equal(b, full_bias())
            and res.values["step"] == 3)


def save_expect_failure(env: dict[str, str], url: str, step: int) -> tuple[str, float, str]:
    os.environ.update(env)
    r, n = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    try:
        reshard.save(state_for(r, n), url, step=step)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return type(e).__name__, time.monotonic() - t0, str(e)
    return "none", time.monotonic() - t0, ""
