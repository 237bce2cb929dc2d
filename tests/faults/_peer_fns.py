"""Rank functions for tests/faults/test_peer_faults.py (run inside WorkerPool
workers, imported by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard import collectives
from reshard.saving import staging


def r_default_timeout(root: str) -> dict[str, Any]:
    """Sync and async saves and a load with default options, then a save with
    timeout_s=45: the timeouts of the checkpoint groups they ran on, the
    training group's, and how many such groups were made (one per timeout)."""
    rank, world, n = dist.get_rank(), dist.get_world_size(), 256
    w = torch.arange(world * n, dtype=torch.float32)[rank * n:(rank + 1) * n].clone()
    state = {"w": reshard.ShardedTensor("w", w, global_shape=(world * n,), global_offset=(rank * n,))}
    opts = reshard.SaveOptions(durable=False)
    before = len(collectives._TIMED_GROUPS)
    for step in (1, 2):
        reshard.save(state, f"{root}/sync-{step}", step=step, options=opts)
        reshard.async_save(state, f"{root}/async-{step}", step=step, options=opts).wait()
        reshard.load(state, f"{root}/sync-{step}")
    reshard.save(state, f"{root}/explicit", step=3, options=reshard.SaveOptions(durable=False, timeout_s=45))
    timed = [collectives.group_timeout_s(pg) for (g, _), pg in collectives._TIMED_GROUPS.items()
             if g == "default"]
    saver = staging.SAVERS["default"]
    return {"timed": timed, "training": collectives.group_timeout_s(None), "new_groups": len(collectives._TIMED_GROUPS) - before,
            "async": {k: collectives.group_timeout_s(c.group)  # type: ignore[attr-defined]
                      for k, c in saver.timed.items()}}
