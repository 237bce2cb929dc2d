"""Rank functions for tests/test_failure_budget.py (run inside WorkerPool
workers, imported by name): faults on real processes, then the next save."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard import CheckpointManager, staging


def _state(step: int, n: int = 1 << 16) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.full((world * n,), float(step))[rank * n:(rank + 1) * n].clone()
    return {"w": reshard.ShardedTensor("w", w, global_shape=(world * n,), global_offset=(rank * n,)),
            "step": step}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fill(root: str, leave: int) -> str:
    """Rank 0: a file that leaves ``leave`` bytes free on ``root``'s file system."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    filler = os.path.join(os.path.dirname(root), "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def r_async_enospc_then_next_save(root: str) -> dict[str, Any]:
    """Step 1 commits; step 2's background save hits a real ENOSPC (a full
    tmpfs); the disk is freed; step 3's maybe_save must save step 3."""
    rank = dist.get_rank()
    lines = _Lines()
    logging.getLogger("reshard").addHandler(lines)
    hooked: list[tuple[Any, str, str]] = []
    mgr = CheckpointManager(root, every_steps=1, use_async=True, preempt_signals=(),
                            on_save_error=lambda s, p, e: hooked.append((s, p, type(e).__name__)),
                            options=reshard.SaveOptions(durable=False))
    try:
        mgr.maybe_save(1, _state(1))
        mgr.wait()
        filler = _fill(root, 16 << 10) if rank == 0 else ""
        dist.barrier()
        h = mgr.maybe_save(2, _state(2))
        assert isinstance(h, reshard.SaveHandle)
        err = h.committed.exception(timeout=60)
        failed_lines = [ln for ln in lines.lines if "step 2" in ln and "failed" in ln]
        dist.barrier()
        if rank == 0:
            os.remove(filler)
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h3 = mgr.maybe_save(3, _state(3))
            assert isinstance(h3, reshard.SaveHandle)
            res3 = h3.wait(timeout=60)
        mgr.close()  # the failure went to the hook: close does not raise it again
        return {"err": type(err).__name__ if err else None, "lines": failed_lines, "hooked": hooked,
                "step3": res3.step if res3 else None,
                "warned": [str(w.message) for w in caught if "failed earlier" in str(w.message)],
                "latest": reshard.latest(root)}
    finally:
        logging.getLogger("reshard").removeHandler(lines)
        staging.wait_all()
