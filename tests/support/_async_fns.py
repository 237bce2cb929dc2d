"""Storages with injected faults and rank functions for tests/saving/test_async.py and
tests/manager/test_manager.py (rank functions run inside WorkerPool workers, imported by name)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import reshard
from _state_fns import zero_dim_state  # one definition, shared with the training-state tests
from reshard.errors import StorageError
from reshard.storage import LocalStorage, WriteStream

# ----------------------------------------------------------------------------- storages


class SlowStorage(LocalStorage):
    """Opening a data file sleeps ``delay`` seconds first (manifests are
    written at full speed), so a save stays in flight for a while."""

    def __init__(self, delay: float = 0.2):
        super().__init__()
        self.delay = delay

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        if not path.endswith(".json"):
            time.sleep(self.delay)
        return super().open_write(path, durable=durable)


class GatedStorage(LocalStorage):
    """Opening a data file (``.safetensors``) waits until ``gate`` is set (at
    most 30 s), so a save stays in flight exactly as long as a test wants;
    the root's records (manifests, OWNER, leases) are not held back."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        if path.endswith(".safetensors"):
            self.gate.wait(30)
        return super().open_write(path, durable=durable)


class FailingStorage(LocalStorage):
    """Opening any data file fails like a full disk."""

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        if path.endswith(".safetensors"):
            raise StorageError(f"write {path!r}: no space left on device (injected)")
        return super().open_write(path, durable=durable)


class _FlipWrite(WriteStream):
    def __init__(self, inner: WriteStream):
        self.inner = inner

    def write(self, data: bytes | memoryview) -> None:
        b = bytearray(data)
        for i in range(len(b)):
            b[i] ^= 0xFF
        self.inner.write(bytes(b))

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class CorruptingStorage(LocalStorage):
    """Data files of checkpoints whose path contains one of ``bad`` are written
    with every byte inverted (same sizes: only checksums can tell)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: set[str] = set()

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        inner = super().open_write(path, durable=durable)
        if path.endswith(".safetensors") and any(b in path for b in self.bad):
            return _FlipWrite(inner)
        return inner


# ----------------------------------------------------------------------------- rank functions

ROWS, COLS = 4, 6  # global shape of the sharded tensor "w" (rows split over ranks)


def sharded_state(rank: int, world: int) -> dict[str, Any]:
    """Rank's rows of ``w`` (value = global element index) and a replicated ``b``."""
    per = ROWS // world
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)[rank * per:(rank + 1) * per]
    return {"model": {"w": reshard.ShardedTensor("w", w.clone(), global_shape=(ROWS, COLS),
                                                 global_offset=(rank * per, 0)),
                      "b": torch.arange(3, dtype=torch.int64)},
            "step": 0}


def r_async_mutation(root: str, delay: float) -> dict[str, Any]:
    """Three async saves, each followed at once by an in-place change of every
    tensor, while the writes are held back by a slow storage. Returns, per step,
    whether ``staged`` was done on return and the full expected tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = sharded_state(rank, world)
    w, b = state["model"]["w"].data, state["model"]["b"]
    storage = SlowStorage(delay)
    opts = reshard.SaveOptions(max_pending=3, durable=False)
    handles, staged, expected = [], [], {}
    for step in (1, 2, 3):
        parts = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(parts, w.contiguous())
        expected[step] = {"model.w": torch.cat(parts), "model.b": b.clone()}
        h = reshard.async_save(state, f"{root}/step-{step}", step=step, options=opts, storage=storage)
        staged.append(h.staged.done())
        w.mul_(-2.0).add_(step)  # in place, after async_save returned
        b.add_(10 * step)
        handles.append(h)
    results = [h.wait() for h in handles]
    return {"staged": staged, "expected": expected,
            "steps": [r.step for r in results], "pending_done": [h.done() for h in handles]}




def r_zero_dim_async_save(path: str) -> tuple[bool, int | None]:
    state = zero_dim_state(True)
    h = reshard.async_save(state, path, step=3)
    staged = h.staged.done()
    for t in state["optim"].values():  # mutate after staging: must not reach the file
        t.zero_()
    res = h.wait()
    return staged, None if res is None else res.step


def r_zero_dim_load(path: str) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    state = zero_dim_state(False)
    reshard.load(state, path)
    return {k: (str(t.dtype), tuple(t.shape), t.item()) for k, t in state["optim"].items()}


class NiceRecordingStorage(LocalStorage):
    """Records the nice value of the thread that opens each data file (Linux:
    per thread), so a test sees the priority the background writer ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.nice: list[int] = []

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        if path.endswith(".safetensors"):
            self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().open_write(path, durable=durable)
