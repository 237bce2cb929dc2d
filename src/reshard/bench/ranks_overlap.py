"""Rank side of ``reshard bench io``'s overlap phase: a real training loop
(forward, backward, AdamW) that checkpoints every K steps, once per method.

Each checkpoint starts at a step boundary (after ``optimizer.step()``); the
loop then runs the next step's forward and backward and, right before that
step's ``optimizer.step()``, waits for whatever the method needs before the
state may change (TorchTitan's zero-overhead checkpointing does the same):

* ``none``: no checkpoint (the baseline step time);
* ``reshard-async``: ``reshard.async_save`` in the default mode (every byte
  staged when it returns);
* ``reshard-overlap``: ``SaveOptions(overlap_staging=True)``; the loop calls
  ``reshard.wait_for_staging()`` before ``optimizer.step()``;
* ``reshard-overlap-split``: the same with the training thread on one core
  and the save's threads on another (where the machine has a core per rank
  to spare): the step time when the save's CPU does not come from the step;
* ``dcp-async``: DCP's ``async_save`` (thread mode: it stages before it
  returns);
* ``dcp-async-process``: DCP's process mode with its ``DefaultStager``; the
  loop waits for its staging future before ``optimizer.step()``;
* ``tc-async``: torch_checkpointing's async save; the loop waits for its
  staging future before ``optimizer.step()``.

A new checkpoint first waits for the previous one to be written (one in
flight, as ``max_pending=1``): that wait counts as stall. The **visible
stall** of a checkpoint is every second the loop is blocked by it: the call,
the wait before ``optimizer.step()``, the wait for the previous one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch.distributed as dist

import reshard

from ..testing.memory import PeakRSS
from .ranks_base import _nbytes, _rank, _w, drop
from .usage import Usage

OVERLAP_METHODS = ("reshard-async", "reshard-overlap", "reshard-overlap-split", "dcp-async",
                   "dcp-async-process", "tc-async")
#: name prefixes of the threads an asynchronous reshard save runs on
SAVE_THREADS = ("reshard-async-save", "reshard-stage", "reshard-write", "reshard-hash", "reshard-lease",
                "reshard-staged", "reshard-rss")


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def split_cores(world: int) -> tuple[int, int] | None:
    """(the training thread's core, the save's core) of this rank when the
    machine has two cores per rank, else None."""
    cores = _cores()
    if len(cores) < 2 * world:
        return None
    r = _rank()
    return cores[2 * r], cores[2 * r + 1]


def _pin_save_threads(core: int) -> None:
    for th in threading.enumerate():
        if th.name.startswith(SAVE_THREADS) and th.native_id is not None:
            try:
                os.sched_setaffinity(th.native_id, {core})
            except OSError:
                pass


class _Checkpoints:
    """One method's checkpoints in the loop (see the module docstring)."""

    def __init__(self, method: str, base: str, budget: int | None, split: tuple[int, int] | None):
        self.method, self.base, self.budget, self.split = method, base, budget, split
        self.prev: Any = None  # the in-flight save's completion
        self.staged: Any = None  # what to wait for before optimizer.step()
        self.stalls: list[float] = []
        self.paths: list[str] = []
        self.n = 0

    def _finish_prev(self) -> float:
        t0 = time.perf_counter()
        if self.prev is not None:
            p = self.prev
            if isinstance(p, reshard.SaveHandle):
                p.wait()
            else:
                getattr(p, "upload_completion", p).result()
            self.prev = None
        return time.perf_counter() - t0

    def start(self) -> None:
        """At a step boundary: wait for the previous save, start this one."""
        w = _w()
        waited = self._finish_prev()
        p = f"{self.base}-{self.method}-{self.n}"
        self.n += 1
        self.paths.append(p)
        t0 = time.perf_counter()
        m = self.method
        if m.startswith("reshard"):
            opts = reshard.SaveOptions(overlap_staging=m != "reshard-async", staging_budget_bytes=self.budget)
            h = reshard.async_save(w.reshard_state(), p, step=self.n, options=opts)
            self.prev = h
            self.staged = h.staged if m != "reshard-async" else None
            if self.split is not None:
                _pin_save_threads(self.split[1])
        elif m == "tc-async":
            from .ranks_tc import _tc_async_saver, _tc_checkpoint

            staged, written = _tc_async_saver().save(p, _tc_checkpoint(w.dcp_state()))
            self.prev, self.staged = written, staged
        else:
            from .ranks import start_async

            _, f = start_async(m, p)
            self.prev = f
            self.staged = getattr(f, "staging_completion", None)
        self.stalls.append(waited + time.perf_counter() - t0)

    def before_update(self) -> None:
        """Right before optimizer.step(): wait until the state may change."""
        if self.staged is None:
            return
        t0 = time.perf_counter()
        if self.method.startswith("reshard"):
            reshard.wait_for_staging()
        else:
            self.staged.result()
        self.staged = None
        self.stalls[-1] += time.perf_counter() - t0

    def close(self) -> None:
        self._finish_prev()
        for p in self.paths:
            drop(p)


def probe_k(base: str, max_k: int = 12) -> dict[str, Any]:
    """The smallest K whose K steps outlast one overlapped reshard save's
    background persist here: steps run until the save is committed on every
    rank; K is their count (at least 1, at most ``max_k``). Also the step
    time with no save."""
    from .ranks import _all_done

    w = _w()
    w.step()
    t0 = time.perf_counter()
    w.step()
    step_s = time.perf_counter() - t0
    dist.barrier()
    h = reshard.async_save(w.reshard_state(), f"{base}-probe", step=1,
                           options=reshard.SaveOptions(overlap_staging=True))
    steps = 0
    t0 = time.perf_counter()
    while True:
        w.step(before_update=reshard.wait_for_staging)
        steps += 1
        if _all_done(h) or steps >= max_k:
            break
    persist_s = time.perf_counter() - t0
    h.wait()
    drop(f"{base}-probe")
    return {"rank": _rank(), "k": max(1, steps), "step_s": step_s, "persist_s": persist_s}


#: the fewest steps a loop runs (a mean over fewer is one step's noise)
MIN_STEPS = 6


def loop(method: str, base: str, k: int, cycles: int, budget: int | None = None) -> dict[str, Any]:
    """``k * cycles`` training steps (at least :data:`MIN_STEPS`: more
    cycles when ``k`` is small) checkpointing every ``k`` steps with
    ``method`` (``"none"``: no checkpoint): per step its time, per
    checkpoint its visible stall, the loop's CPU seconds (every thread), its
    peak extra RSS, the save's CPU beyond the steps'."""
    cycles = max(cycles, -(-MIN_STEPS // k))
    w = _w()
    split = split_cores(dist.get_world_size()) if method == "reshard-overlap-split" else None
    res: dict[str, Any] = {"rank": _rank(), "method": method, "k": k, "state_bytes": _nbytes(w.tensors())}
    if method == "reshard-overlap-split" and split is None:
        res["skipped"] = f"{len(_cores())} cores for {dist.get_world_size()} rank(s): no core to give the save"
        return res
    ck = None if method == "none" else _Checkpoints(method, base, budget, split)
    old_aff = set(_cores())
    if split is not None:
        os.sched_setaffinity(0, {split[0]})  # this (the training) thread
    w.step()
    dist.barrier()
    steps: list[float] = []
    try:
        # RSS sampled every 20 ms (the kernel's high-water mark catches what falls
        # between samples): a finer sampler costs the step measurable CPU over a loop
        with Usage() as u, PeakRSS(interval_s=0.02) as mem:
            t_loop = time.perf_counter()
            for i in range(k * cycles):
                t0 = time.perf_counter()
                w.step(before_update=None if ck is None else ck.before_update)
                if ck is not None and (i + 1) % k == 0:
                    ck.start()
                steps.append(time.perf_counter() - t0)
            loop_s = time.perf_counter() - t_loop
            if ck is not None:
                ck.close()  # the last save written (its time is not a step's)
    finally:
        if split is not None:
            os.sched_setaffinity(0, old_aff)
            for th in threading.enumerate():
                if th.native_id is not None:
                    try:
                        os.sched_setaffinity(th.native_id, old_aff)
                    except OSError:
                        pass
    dist.barrier()
    res.update(steps_s=steps, loop_s=loop_s, cpu_s=u.cpu_s, thread_cpu_s=u.thread_cpu_s,
               stalls_s=ck.stalls if ck else [], peak_extra_rss=max(mem.sampled_extra, mem.hwm_extra or 0))
    return res


def budget_rss(base: str) -> dict[str, Any]:
    """Peak extra RSS of one asynchronous save (default mode, then overlap
    mode) of the state with a staging budget of a quarter of this rank's
    state (the state is four times the budget), its slabs freed first."""
    from ..saving import staging

    w = _w()
    state_bytes = _nbytes(w.tensors())
    budget = max(64 << 10, state_bytes // 4)
    out: dict[str, Any] = {"rank": _rank(), "state_bytes": state_bytes, "budget": budget}
    for mode in ("default", "overlap"):
        staging.wait_all()
        for saver in staging.SAVERS.values():
            saver.pool.trim()
        p = f"{base}-budget-{mode}"
        opts = reshard.SaveOptions(staging_budget_bytes=budget, overlap_staging=mode == "overlap")
        dist.barrier()
        with PeakRSS(interval_s=0.005) as mem:
            h = reshard.async_save(w.reshard_state(), p, step=1, options=opts)
            reshard.wait_for_staging()
            res = h.wait()
        assert res is not None
        out[mode] = {"extra": max(mem.sampled_extra, mem.hwm_extra or 0), "staging_peak": res.staging_peak_bytes,
                     "peak_rss": res.peak_rss_bytes, "stall_s": h.stall_s + h.staging_wait_s}
        drop(p)
    for saver in staging.SAVERS.values():
        saver.pool.trim()
    return out
