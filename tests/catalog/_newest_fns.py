"""Rank functions for tests/catalog/test_newest.py (2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch

import reshard
from reshard.catalog import newest
from reshard.commit.protocol import retire_checkpoint


def r_load_latest_newest_deleted(root: str, numel: int) -> dict[str, Any]:
    """Every rank calls ``load_latest``; on rank 0 the newest checkpoint is
    retired (as retention does) right after it was chosen, before its lease."""
    real = newest.latest_entry
    retired: list[str] = []

    def choose_then_retire(st: Any, key: str, **kw: Any) -> Any:
        best = real(st, key, **kw)
        if best is not None and not retired:
            retired.append(retire_checkpoint(st, key, best.name))
        return best

    newest.latest_entry = choose_then_retire  # only rank 0 chooses
    try:
        w = torch.zeros(numel)
        res = reshard.load_latest({"w": w}, root)
    finally:
        newest.latest_entry = real
    return {"path": res.path, "step": res.step, "w": w.tolist(), "retired": retired}


def r_load_latest_empty(root: str) -> str:
    """Every rank calls ``load_latest`` on a root with nothing committed."""
    try:
        reshard.load_latest({"w": torch.zeros(4)}, root)
    except reshard.CheckpointNotFoundError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"
