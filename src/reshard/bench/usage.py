"""Resource counters of ``reshard bench io`` (rank side): CPU seconds and
page faults of a block of code, and the RSS growth over many consecutive
asynchronous saves.

* :class:`Usage`: ``with Usage() as u: ...`` then ``u.cpu_s`` (the process's
  CPU seconds, every thread), ``u.thread_cpu_s`` (the calling thread's),
  ``u.minflt`` / ``u.majflt`` (page faults of the process: the staging copy
  threads fault the pages they write). A staging into reused buffers faults
  no page; a first save into fresh ones faults each page once.
* :func:`rss_growth`: ``N`` consecutive ``reshard.async_save`` calls of a
  small state built in the run's layout (each committed before the next),
  the process's resident bytes after each: whatever a save leaves behind
  (buffers re-allocated, plans or records cached per save) grows it.
"""

from __future__ import annotations

import gc
import resource
import time
from types import TracebackType
from typing import Any


def _faults() -> tuple[int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_majflt


class Usage:
    """CPU seconds (process and calling thread) and the process's page
    faults over a ``with`` block; see the module docstring."""

    cpu_s = thread_cpu_s = 0.0
    minflt = majflt = 0

    def __enter__(self) -> Usage:
        self._cpu, self._thr = time.process_time(), time.thread_time()
        self._flt = _faults()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        mi, ma = _faults()
        self.minflt, self.majflt = mi - self._flt[0], ma - self._flt[1]
        self.cpu_s = time.process_time() - self._cpu
        self.thread_cpu_s = time.thread_time() - self._thr

    @property
    def others_cpu_s(self) -> float:
        """CPU seconds of the process's other threads (a background save's)."""
        return max(0.0, self.cpu_s - self.thread_cpu_s)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def rss_growth(layout: str, saves: int, path: str, state_mib: float = 4.0) -> dict[str, Any]:
    """``saves`` consecutive asynchronous saves (each waited for, its
    checkpoint deleted) of a small synthetic state (``state_mib`` MiB of
    parameters, 64 KiB tensors, with its AdamW moments) in ``layout``; the
    resident bytes of this process after each save (the first one fills the
    staging pool). Its workload is freed before this returns; the bench's own
    workload stays as it was."""
    import torch.distributed as dist

    import reshard

    from .models import build, parse_layout
    from .ranks_base import drop

    spec = parse_layout(layout).on(dist.get_world_size())
    if spec.kind == "grid":  # the trainer's state is large to build; the same code path saves it
        spec = parse_layout("fsdp").on(dist.get_world_size())
    w = build("synthetic", spec, synthetic_mib=state_mib, synthetic_width=128)
    state = w.reshard_state()
    after: list[int] = []
    t0 = time.perf_counter()
    try:
        for i in range(saves):
            p = f"{path}-{i % 2}"
            reshard.async_save(state, p, step=i + 1).wait()
            after.append(_rss())
            drop(p)
    finally:
        from ..saving import staging

        staging.wait_all()
        del state, w
        for saver in staging.SAVERS.values():  # the small state's staging buffers
            saver.pool.trim()
        gc.collect()
    return {"rank": dist.get_rank(), "rss_after": after, "seconds": time.perf_counter() - t0,
            "state_bytes": int(3 * state_mib * (1 << 20))}
