"""How much host memory an asynchronous save may stage into, per rank, and
what the process's resident memory did while it saved.

The budget (``SaveOptions.staging_budget_bytes``) bounds the staging buffers
of one process group's saves on this rank, pinned memory included. Its
default is a fixed share of the node's memory divided among the node's local
ranks (:func:`default_staging_budget`): the node's memory is its physical
memory or, when lower, the memory limit of the cgroup the process runs in
(a container's limit), both fixed for the life of the job. It is never a
reading of free memory, which the neighbours on the node change from one
save to the next (a budget that moved with them would make one save's memory
and stall differ from the next for reasons outside the job).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("reshard.saving.staging")

#: the share of the node's memory that staging may use, divided among the
#: node's local ranks (a quarter: the rest stays for the training process
#: itself, the data loaders, the page cache the writes go through and the
#: node's other tenants)
NODE_SHARE = 0.25

#: the smallest budget accepted (bytes): eight slabs of 8 KiB
MIN_BUDGET_BYTES = 64 << 10

_logged: set[tuple[int, int, int]] = set()


def node_memory_bytes() -> tuple[int, str]:
    """The node's memory in bytes and where the figure comes from: the
    physical memory (``sysconf``), or the memory limit of this process's
    cgroup when that is lower (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``)."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        what = "physical memory"
    except (ValueError, OSError, AttributeError):
        import psutil

        phys, what = int(psutil.virtual_memory().total), "physical memory"
    limit = _cgroup_limit()
    if limit is not None and 0 < limit < phys:
        return limit, "the cgroup's memory limit"
    return phys, what


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes (None: none, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for ln in lines:
        parts = ln.split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, path = parts
        if hier == "0" and ctrls == "":  # cgroup v2
            cand = [f"/sys/fs/cgroup{path}/memory.max", "/sys/fs/cgroup/memory.max"]
        elif "memory" in ctrls.split(","):  # cgroup v1
            cand = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                    "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        else:
            continue
        for p in cand:
            try:
                with open(p, encoding="utf-8") as f:
                    raw = f.read().strip()
            except OSError:
                continue
            if raw and raw != "max" and raw.isdigit():
                v = int(raw)
                return v if v < (1 << 60) else None  # v1's "no limit" is a huge number
    return None


def local_ranks() -> tuple[int, str]:
    """How many ranks of the job share this node, and where that comes from:
    ``LOCAL_WORLD_SIZE`` (torchrun, TorchX, Lightning), else
    ``SLURM_NTASKS_PER_NODE`` (its first figure), else 1."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = os.environ.get(var, "")
        head = raw.split("(")[0].split(",")[0].strip()
        if head.isdigit() and int(head) > 0:
            return int(head), var
    return 1, "no LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE: 1"


def default_staging_budget() -> int:
    """The default staging budget of one rank, in bytes:
    ``NODE_SHARE`` (a quarter) of :func:`node_memory_bytes` divided by
    :func:`local_ranks`, at least :data:`MIN_BUDGET_BYTES`. Logged (INFO,
    logger ``reshard.saving.staging``) the first time each value is used."""
    mem, what = node_memory_bytes()
    n, src = local_ranks()
    budget = max(MIN_BUDGET_BYTES, int(mem * NODE_SHARE) // n)
    key = (budget, mem, n)
    if key not in _logged:
        _logged.add(key)
        log.info("reshard: staging budget %.2f GiB per rank: %d%% of the node's %.1f GiB (%s) "
                 "divided among %d local rank(s) (%s); SaveOptions.staging_budget_bytes sets another",
                 budget / 2**30, round(NODE_SHARE * 100), mem / 2**30, what, n, src)
    return budget


def staging_budget(option: int | None) -> int:
    """``SaveOptions.staging_budget_bytes`` as bytes (None: the default)."""
    return default_staging_budget() if option is None else int(option)


# ----------------------------------------------------------------------------- resident memory


def rss_bytes() -> int:
    """This process's resident memory now, in bytes (``/proc/self/statm`` on
    Linux: a few microseconds; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    _PAGE = 4096


class PeakRss:
    """The peak of this process's resident memory while a save runs: sampled
    every ``interval_s`` by one daemon thread (and at :meth:`sample` calls,
    which the stager makes whenever it takes new memory), without touching
    the kernel's high-water mark (``VmHWM``, which the program may watch
    itself). ``start()`` ... ``stop()`` -> peak bytes."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakRss:
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, name="reshard-rss", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        r = rss_bytes()
        if r > self.peak:
            self.peak = r

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.sample()
        return self.peak
