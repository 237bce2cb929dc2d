"""Peak resident memory of a block of code, for benchmarks and tests.

Two measurements of the same thing: a psutil thread sampling RSS every half
millisecond, and the kernel's high-water mark (``VmHWM``), reset through
``/proc/self/clear_refs`` before the block (Linux; None elsewhere). Page cache
is not counted by either.
"""

from __future__ import annotations

import gc
import threading
import time
from types import TracebackType

import psutil


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.before``, ``m.sampled_extra`` and
    ``m.hwm_extra`` (bytes above the RSS before the block; ``hwm_extra`` None
    where VmHWM cannot be reset)."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.before = 0
        self.peak = 0
        self.sampled_extra = 0
        self.hwm_extra: int | None = None

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self._proc = psutil.Process()
        try:  # reset the kernel's RSS high-water mark (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm_ok = True
        except OSError:
            self._hwm_ok = False
        self.before = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.sampled_extra = self.peak - self.before
        hwm = _status_kib("VmHWM") if self._hwm_ok else None
        self.hwm_extra = None if hwm is None else hwm * 1024 - self.before
