"""Rank functions for tests/manager/test_manager_dist.py (CheckpointManager used
collectively on gloo ranks). Each call builds a new manager: a restart."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from reshard import ShardedTensor
from reshard.manager.manager import CheckpointManager

ROWS = 3  # rows of the row-sharded weight per rank


def state(step: int, run: int) -> dict[str, Any]:
    """This rank's part of the state of ``step`` saved by run ``run``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(ROWS * world * 4, dtype=torch.float32).reshape(ROWS * world, 4)
    full = full + 1000.0 * step + 100000.0 * run
    return {"w": ShardedTensor("w", full[rank * ROWS:(rank + 1) * ROWS].clone(),
                               global_shape=tuple(full.shape), global_offset=(rank * ROWS, 0)),
            "b": torch.full((5,), float(step * 10 + run)),
            "meta": {"step": step, "run": run}}


def blank() -> dict[str, Any]:
    st = state(0, 0)
    st["w"].data.zero_()
    st["b"].zero_()
    st["meta"] = {"step": -1, "run": -1}
    return st


def _mgr(root: str, keep_last: int | None, use_async: bool) -> CheckpointManager:
    return CheckpointManager(root, keep_last=keep_last, use_async=use_async, preempt_signals=())


def r_run(root: str, *, restore: bool | int = True, saves: list[tuple[int, int]] = (),  # type: ignore[assignment]
          keep_last: int | None = None, use_async: bool = False) -> dict[str, Any]:
    """One run of a job: a new manager; optionally restore (True: the
    automatic resume; an int: that step), check the restored state is exactly
    what its manifest says was saved, then save ``(step, run)`` pairs.
    Returns what this rank saw."""
    mgr = _mgr(root, keep_last, use_async)
    out: dict[str, Any] = {"restored": None, "fallback": [], "warnings": [], "saved": []}
    try:
        if restore is not False:
            st = blank()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = mgr.restore(st, step=None if restore is True else int(restore))
            out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            if res is not None:
                meta = res.values["meta"]
                want = state(meta["step"], meta["run"])
                assert res.step == meta["step"]
                assert torch.equal(st["w"].data, want["w"].data), "restored weights differ"
                assert torch.equal(st["b"], want["b"]), "restored bias differs"
                out["restored"] = (os.path.basename(res.path), meta["step"], meta["run"])
                out["fallback"] = list(res.notes.get("fallback", []))
        for step, run in saves:
            r = mgr.save(step, state(step, run))
            out["saved"].append(os.path.basename(r.path))
            if use_async:
                mgr.wait()  # the background save committed, was verified, retention ran
        # what retention keeps for this run while it is alive: the checkpoint it resumed from
        out["pinned"] = [c.name for c in mgr.candidates() if c.resume_source]
    finally:
        mgr.close()
    out["latest_step"] = mgr.latest_step()
    return out
