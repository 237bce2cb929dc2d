"""Rank functions for tests/faults/test_fault_costs_one_save.py (run inside WorkerPool
workers, imported by name): faults on real processes, then the next save."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard import CheckpointManager
from reshard.saving import staging
from reshard.storage import LocalStorage, WriteStream


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
        failed_lines = [ln for ln in lines.lines if ln.startswith("asynchronous save of step 2")]
        dist.barrier()
        attempts_left = [n for n in os.listdir(root) if ".incomplete-" in n]
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
                "step3": res3.step if res3 else None, "attempts_left": attempts_left,
                "warned": [str(w.message) for w in caught if "failed earlier" in str(w.message)],
                "latest": reshard.latest(root)}
    finally:
        logging.getLogger("reshard").removeHandler(lines)
        staging.wait_all()


class FileGatedStorage(LocalStorage):
    """Opening a data file waits (at most 60 s) until the file ``gate``
    exists, so the test's parent process can act while a save is in flight."""

    gate = ""

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        if path.endswith(".safetensors"):
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().open_write(path, durable=durable)


def r_gated_saves(root: str, gates: list[str]) -> list[str]:
    """One manager save per gate, each held before its data files until the
    gate exists; returns "committed <path>" or the error of each."""
    st = FileGatedStorage()
    mgr = CheckpointManager(root, preempt_signals=(), storage=st,
                            options=reshard.SaveOptions(durable=False))
    out = []
    for i, gate in enumerate(gates):
        st.gate = gate
        try:
            out.append(f"committed {mgr.save(i + 1, _state(i + 1)).path}")
        except Exception as e:  # noqa: BLE001 - the test checks what is raised
            out.append(f"{type(e).__name__}: {e}")
    return out


def _on_disk(root: str) -> tuple[int, int]:
    """(committed checkpoints, attempts) under ``root``."""
    names = os.listdir(root)
    done = sum(1 for n in names if n.startswith("step-") and "." not in n)
    return done, sum(1 for n in names if ".incomplete-" in n and not n.endswith(".json"))


def r_full_disk(root: str, phase: str) -> dict[str, Any]:
    """``fill``: three checkpoints, no retention (1 MiB each on 2 ranks).
    ``restart``: a new run with keep_last=1 on that full disk saves (retention
    frees first), then async saves with keep_last=1 never hold more than one
    committed checkpoint plus the one being written; then a state that
    cannot fit fails up front naming needed and free bytes."""
    n = 1 << 17  # 512 KiB of float32 per rank
    opts = reshard.SaveOptions(durable=False)
    if phase == "fill":
        mgr = CheckpointManager(root, preempt_signals=(), options=opts)
        for s in (1, 2, 3):
            mgr.save(s, _state(s, n))
        mgr.close()
        return {"latest": reshard.latest(root)}
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, keep_last=1, preempt_signals=(), options=opts)
    try:
        out["sync"] = mgr.save(4, _state(4, n)).step
    except Exception as e:  # noqa: BLE001 - the test checks it
        out["sync"] = f"{type(e).__name__}: {e}"
    out["after_sync"] = _on_disk(root)
    mgr.close()
    mgr = CheckpointManager(root, keep_last=1, use_async=True, every_steps=1, preempt_signals=(),
                            options=opts)
    seen = []
    for s in (5, 6, 7, 8):
        mgr.maybe_save(s, _state(s, n))
        seen.append(_on_disk(root))
    mgr.close()
    out["async_seen"] = seen
    out["latest"] = reshard.latest(root)
    big = _state(9, 4 * n)  # 4 MiB: never fits
    try:
        reshard.save(big, os.path.join(root, "too-big"), step=9, options=opts)
        out["big"] = "saved"
    except reshard.CheckpointError as e:
        out["big"] = str(e)
    out["after_big"] = sorted(os.listdir(root))
    return out
