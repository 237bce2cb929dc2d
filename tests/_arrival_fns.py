"""Rank functions for tests/test_collectives_arrival.py (run inside WorkerPool workers,
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


def r_manager_rank0_only(root: str, bound: float) -> dict[str, Any]:
    """Rank 0 calls CheckpointManager.save and .restore alone (as a rank-0-only
    plug-in point would); rank 1 does something else. Rank 0 reports each
    failure: its class, message, absent ranks and seconds."""
    if dist.get_rank() != 0:
        torch.randn(64, 64).matmul(torch.randn(64, 64))
        return {}
    out: dict[str, Any] = {}
    mgr = reshard.CheckpointManager(root, preempt_signals=(), timeout_s=30.0,
                                    options=reshard.SaveOptions(durable=False, arrival_timeout_s=bound))
    calls = {"save": lambda: mgr.save(3, _state()),
             "restore": lambda: mgr.restore(_state(), options=reshard.LoadOptions(arrival_timeout_s=bound))}
    try:
        for name, call in calls.items():
            t0 = time.monotonic()
            try:
                call()
                out[name] = {"error": None}
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[name] = {"type": type(e).__name__, "message": str(e),
                             "absent": list(getattr(e, "absent_ranks", ())),
                             "seconds": time.monotonic() - t0}
    finally:
        mgr.close()
    return out


def r_after_a_new_default_group(root: str) -> dict[str, Any]:
    """A save, an async save and a manager save and restore; then the default
    process group is destroyed and made again (tests/_pool_fns.new_default_group)
    and the same calls run again in this process. Returns the steps loaded."""
    from _pool_fns import new_default_group

    out: dict[str, Any] = {}
    for turn in ("before", "after"):
        if turn == "after":
            new_default_group()
        reshard.save(_state(), f"{root}/{turn}-sync", step=1, options=reshard.SaveOptions(durable=False))
        reshard.async_save(_state(), f"{root}/{turn}-async", step=2,
                           options=reshard.SaveOptions(durable=False)).wait()
        mgr = reshard.CheckpointManager(f"{root}/{turn}-mgr", preempt_signals=(),
                                        options=reshard.SaveOptions(durable=False))
        mgr.save(4, _state())
        got = mgr.restore(_state())
        mgr.close()
        loaded = reshard.load(_state(), f"{root}/{turn}-async")
        out[turn] = [got.step if got is not None else None, loaded.step]
    return out


def r_store_host_stops_in_group_creation(timeout_s: float) -> dict[str, Any]:
    """Both ranks arrive for a load with a ``timeout_s`` checkpoint timeout;
    then rank 0 (the host of the job's TCP store) stops (SIGSTOP) where it
    would make the checkpoint group. Rank 1, making its part of the group,
    must fail within the bound with a CheckpointError (it waited for the
    store's own timeout before), then wakes rank 0 (SIGCONT)."""
    import os
    import signal

    from reshard.collectives import Arrival, timed_collectives
    from reshard.errors import CheckpointError

    rank = dist.get_rank()
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    real = dist.new_group
    store = dist.distributed_c10d._get_default_store()
    key = f"test-stop/{pids[0]}"
    if rank == 0:
        def stop_here(*a: Any, **k: Any) -> Any:
            store.wait([key])  # rank 1 is past its arrival, making its part of the group
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError("woken by rank 1 after it gave up")
        dist.new_group = stop_here
    else:
        def mark_then_make(*a: Any, **k: Any) -> Any:
            store.set(key, "1")
            return real(*a, **k)
        dist.new_group = mark_then_make
    t0 = time.monotonic()
    try:
        timed_collectives(None, timeout_s, arrival=Arrival(kind="load", what="load of x", timeout_s=30.0))
        out: dict[str, Any] = {"type": None}
    except CheckpointError as e:
        out = {"type": type(e).__name__, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - reported to the test (torch's DistStoreError before)
        out = {"type": type(e).__name__, "message": str(e)}
    finally:
        dist.new_group = real
        if rank == 1:  # wake rank 0 once it is stopped (state T), not before
            for _ in range(200):
                with open(f"/proc/{pids[0]}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        break
                time.sleep(0.05)
            os.kill(pids[0], signal.SIGCONT)
    out["seconds"] = time.monotonic() - t0
    return out
