"""Loads into CUDA targets through pinned bounce buffers on a stream.

A chunk range whose CUDA destination is one contiguous region is read
segment by segment (whole checksum blocks, 4 MiB) into a pinned host buffer,
verified there, and copied to the device with a non-blocking host-to-device
copy on the device's load stream; a CUDA event marks when the buffer may be
reused, so the reader thread reads the next segment into a second buffer
while the first one's copy runs. At the end of the load, the caller's
current stream waits for the load streams (no device-wide synchronize), and
the host waits for the last events before the buffers go back to the pool.

Who calls what: :class:`reshard.loading.reading.Reader` on its reader
threads (:meth:`Bounce.copy_into`) and, once every read is done, on the
caller's thread (:meth:`Bounce.finish`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

#: bytes of one bounce buffer (a multiple of the checksum block is used)
BOUNCE_BYTES = 4 << 20

_POOL: list[torch.Tensor] = []  # pinned buffers kept for the next load
_POOL_LOCK = threading.Lock()
_STREAMS: dict[int, Any] = {}  # one load stream per CUDA device, made once


def load_stream(device: torch.device) -> Any:
    """The load stream of CUDA ``device`` (made on first use, then reused)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _POOL_LOCK:
        s = _STREAMS.get(idx)
        if s is None:
            s = _STREAMS[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
    return s


def _take(n: int) -> torch.Tensor:
    with _POOL_LOCK:
        for i, b in enumerate(_POOL):
            if b.numel() >= n:
                return _POOL.pop(i)
    return torch.empty(max(n, BOUNCE_BYTES), dtype=torch.uint8, pin_memory=True)


class _Slot:
    __slots__ = ("buf", "event")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.event: Any = None


class Bounce:
    """The bounce buffers of one load: two per reader thread, taken from a
    process-wide pool of pinned buffers and given back by :meth:`finish`."""

    def __init__(self, seg_bytes: int, devices: set[torch.device]):
        """Made on the caller's thread: each device's load stream first waits
        for the caller's current stream there (the targets may be written by
        kernels the caller queued)."""
        self.seg = seg_bytes
        self._local = threading.local()
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._devices = {d.index if d.index is not None else torch.cuda.current_device() for d in devices}
        for idx in self._devices:
            dev = torch.device("cuda", idx)
            load_stream(dev).wait_stream(torch.cuda.current_stream(dev))

    def _next(self) -> _Slot:
        """This thread's next buffer, once the copy that last used it ran."""
        pair = getattr(self._local, "pair", None)
        if pair is None:
            pair = self._local.pair = [_Slot(_take(self.seg)), _Slot(_take(self.seg))]
            self._local.k = 0
            with self._lock:
                self._slots.extend(pair)
        self._local.k ^= 1
        slot: _Slot = pair[self._local.k]
        if slot.event is not None:
            slot.event.synchronize()  # a host wait on this buffer's last copy only
            slot.event = None
        return slot

    def buffer(self) -> torch.Tensor:
        """A pinned buffer of at least ``seg`` bytes to read the next segment
        into (this thread's other buffer may still be copying)."""
        slot = self._next()
        self._local.cur = slot
        return slot.buf

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (a part of the buffer :meth:`buffer` gave this
        thread) into CUDA ``dst`` on the device's load stream."""
        slot: _Slot = self._local.cur
        stream = load_stream(dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        slot.event = ev

    def finish(self) -> None:
        """Every copy queued: the caller's streams wait for the load streams,
        the host for the last copies; the buffers go back to the pool."""
        for idx in self._devices:
            dev = torch.device("cuda", idx)
            torch.cuda.current_stream(dev).wait_stream(load_stream(dev))
        for s in self._slots:
            if s.event is not None:
                s.event.synchronize()
        with _POOL_LOCK:
            _POOL.extend(s.buf for s in self._slots)
        self._slots = []
