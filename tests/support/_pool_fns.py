"""Rank functions for tests/testing/test_pool.py; run inside WorkerPool workers (imported by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def all_reduce_rank() -> float:
    """Each rank contributes rank + 1; returns the all-reduced sum seen by this rank."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


def identity(scale: int, *, offset: int = 0) -> tuple[int, int, int, int]:
    """Returns (rank, world_size, rank * scale + offset, pid)."""
    rank = dist.get_rank()
    return rank, dist.get_world_size(), rank * scale + offset, os.getpid()


def fail_on_rank_one() -> None:
    """Rank 1 raises at once while every other rank waits in a barrier that never completes."""
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()


def all_assert() -> None:
    """Every rank fails an assertion; no rank is left hanging."""
    assert dist.get_rank() < 0, f"rank {dist.get_rank()} is not negative"


def num_threads() -> tuple[int, str | None]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def sleep_for(seconds: float) -> int:
    time.sleep(seconds)
    return dist.get_rank()


def new_default_group() -> int:
    """Make this worker group look like a restarted job: the default process
    group destroyed and made again (a new store on a new port), as a process
    that re-initialises torch.distributed does. Nothing of reshard is reset
    here: reshard notices the new default group itself. Returns the port."""
    import socket
    from datetime import timedelta

    port = 0
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    box = [port]
    dist.broadcast_object_list(box, src=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{box[0]}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    return int(box[0])
