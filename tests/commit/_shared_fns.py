"""Rank functions for tests/commit/test_shared_root.py: jobs and readers on gloo
ranks of the session pool, beside other processes on the same root."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard import ShardedTensor

ROWS = 4
#: managers kept open between pool tasks (a job that goes on running): root -> manager
OPEN: dict[str, Any] = {}


def full(step: int, world: int) -> torch.Tensor:
    return torch.arange(ROWS * world * 8, dtype=torch.float32).reshape(ROWS * world, 8) + 1000.0 * step


def whole_state(step: int, world: int = 2) -> dict[str, Any]:
    """The state of ``step`` as one process saves it (a job beside the pool's readers)."""
    return {"w": full(step, world), "b": torch.full((3,), float(step)), "meta": {"step": step},
            "slow": SlowStateful("", 0.0)}


def state(step: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    f = full(step, world)
    return {"w": ShardedTensor("w", f[rank * ROWS:(rank + 1) * ROWS].clone(),
                               global_shape=tuple(f.shape), global_offset=(rank * ROWS, 0)),
            "b": torch.full((3,), float(step)), "meta": {"step": step}}


def _env(env: dict[str, str] | None) -> None:
    if env:
        os.environ.update(env)


def r_open_job(root: str, steps: list[int], *, keep_last: int | None = None, job_id: str | None = None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Job A: a manager kept open after this task (the job goes on), saving ``steps``."""
    _env(env)
    mgr = reshard.CheckpointManager(root, keep_last=keep_last, job_id=job_id, preempt_signals=())
    OPEN[root] = mgr
    for s in steps:
        mgr.save(s, state(s))
    return {"pid": os.getpid(), "job": mgr.job_id}


def r_save_more(root: str, steps: list[int], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Job A saves again (its manager still open); its error, if any."""
    _env(env)
    mgr = OPEN[root]
    try:
        for s in steps:
            mgr.save(s, state(s))
    except reshard.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def r_close(root: str, env: dict[str, str] | None = None) -> None:
    _env(env)
    mgr = OPEN.pop(root, None)
    if mgr is not None:
        mgr.close()


class SlowStateful:
    """A Stateful whose ``load_state_dict`` (the load's last phase, the
    reader lease still held) records the root's lease files and sleeps."""

    def __init__(self, root: str, sleep_s: float, mark: str | None = None):
        self.root, self.sleep_s, self.mark = root, sleep_s, mark
        self.leases: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}

    def load_state_dict(self, sd: Any) -> None:
        if dist.get_rank() == 0:
            self.leases = sorted(n for n in os.listdir(self.root) if ".lease-" in n)
            if self.mark:
                with open(self.mark, "w"):
                    pass
        time.sleep(self.sleep_s)


def r_load_slowly(path: str, sleep_s: float, mark: str | None = None) -> dict[str, Any]:
    """A reader: load ``path`` into fresh targets while its last phase
    sleeps; what rank 0 saw of the lease files during the load."""
    slow = SlowStateful(os.path.dirname(path), sleep_s, mark)
    tgt = {**state(0), "slow": slow}
    tgt["w"].data.zero_()
    res = reshard.load(tgt, path)
    ok = torch.equal(tgt["w"].data, state(res.step)["w"].data)
    return {"leases": slow.leases, "exact": ok, "step": res.step}
