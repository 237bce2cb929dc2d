"""The staging buffer pool: slabs of host memory, reused across saves, never
more of them than the staging budget holds.

A slab is ``slab_bytes`` of host memory (pinned where CUDA is available, so
device-to-host copies into it run asynchronously); the budget
(``SaveOptions.staging_budget_bytes``) allows ``budget // slab_bytes`` of
them. Staged chunks are packed into slabs piece by piece
(:mod:`reshard.saving.staging_run`); a slab goes back to the pool once every
piece in it has been written, and the next piece, of this save or a later
one, reuses it. The pool allocates a slab the first time one is needed
beyond those it has (or ahead of time: :meth:`SlabPool.prewarm`) and keeps
it: a training job's saves fault no new page after the first.

Slab size: the largest power of two at most ``budget / 8`` and at most 64
MiB, at least 8 KiB (powers of two: CUDA's pinned allocator rounds every
request up to one). So a budget of 64 KiB has eight slabs of 8 KiB, one of
8 GiB 128 slabs of 64 MiB.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

#: the largest slab (bytes)
MAX_SLAB_BYTES = 64 << 20
#: the smallest slab (bytes)
MIN_SLAB_BYTES = 8 << 10


def slab_bytes_for(budget: int) -> int:
    """The slab size of a pool with ``budget`` bytes (see the module docstring)."""
    want = max(MIN_SLAB_BYTES, min(MAX_SLAB_BYTES, budget // 8))
    return 1 << (want.bit_length() - 1)


class Slab:
    """One slab: ``buf`` (uint8, ``nbytes``) and how many staged pieces in it
    are still unwritten (``refs``; the stager's bookkeeping, under the
    pool's lock)."""

    __slots__ = ("buf", "nbytes", "refs", "open")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.nbytes = buf.numel()
        self.refs = 0
        self.open = False  # still the current slab of a run (more pieces may go in)


class SlabPool:
    """Slabs of host memory under a byte budget (see the module docstring).

    Thread safe: ``cond`` (a Condition) guards it; :meth:`acquire` waits on
    it for a slab to come back, and the stager signals it when it returns
    one or is closed.

    Attributes:
        pin: slabs are pinned host memory (CUDA available and asked for).
        budget: bytes the pool may hold (slabs handed out and free ones).
        slab_bytes: the size of every slab.
        allocated_bytes: bytes of every slab the pool holds now.
        slabs_allocated: how many slabs the pool has ever allocated (a save
            that reuses the pool allocates none).
        pinned_bytes: of those, pinned.
        in_use_bytes: bytes of the slabs handed out now.
        peak_in_use_bytes: the most ``in_use_bytes`` since :meth:`reset_peak`.
    """

    def __init__(self, *, pin: bool = False):
        self.pin = pin and torch.cuda.is_available()
        self.cond = threading.Condition()
        self.budget = 0
        self.slab_bytes = 0
        self._free: list[Slab] = []
        self._held = 0  # bytes of the slabs held (free and in use)
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.slabs_allocated = 0
        self.on_alloc: Callable[[], None] | None = None  # called after a new slab (peak RSS sampling)

    # -- settings
    def configure(self, budget: int) -> None:
        """Use ``budget`` bytes from now on: a new slab size drops the free
        slabs of the old one (slabs in use are dropped when they come back),
        and a smaller budget drops free slabs beyond it."""
        with self.cond:
            size = slab_bytes_for(budget)
            if size != self.slab_bytes:
                self._held -= sum(f.nbytes for f in self._free)
                self._free.clear()
                self.slab_bytes = size
            self.budget = budget
            while self._free and self._held > budget:
                self._held -= self._free.pop().nbytes

    @property
    def max_slabs(self) -> int:
        return max(1, self.budget // self.slab_bytes) if self.slab_bytes else 0

    @property
    def allocated_bytes(self) -> int:
        return self._held

    @property
    def pinned_bytes(self) -> int:
        return self.allocated_bytes if self.pin else 0

    def reset_peak(self) -> None:
        with self.cond:
            self.peak_in_use_bytes = self.in_use_bytes

    # -- slabs
    def _new(self) -> Slab:
        """A new slab, every page of it resident (pageable memory is written
        in full here: see the module docstring)."""
        buf = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
        if not self.pin:
            buf.fill_(0)
        self._held += self.slab_bytes
        self.slabs_allocated += 1
        return Slab(buf)

    def try_acquire(self) -> Slab | None:
        """A free (or new, within the budget) slab, or None without waiting.
        Call with ``cond`` held."""
        if self._free:
            s = self._free.pop()
        elif self._held + self.slab_bytes <= max(self.budget, self.slab_bytes):
            s = self._new()
            if self.on_alloc is not None:
                self.on_alloc()
        else:
            return None
        s.refs, s.open = 0, True
        self.in_use_bytes += s.nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return s

    def acquire(self, stop: Callable[[], bool]) -> Slab | None:
        """A slab, waiting for one to come back while none is free and the
        budget allows no new one; None once ``stop()`` (checked on every
        wake-up) is true. Call with ``cond`` held."""
        while True:
            if stop():
                return None
            s = self.try_acquire()
            if s is not None:
                return s
            self.cond.wait(1.0)

    def release(self, s: Slab) -> None:
        """Give ``s`` back (its pieces are written). Call with ``cond`` held."""
        self.in_use_bytes -= s.nbytes
        s.open = False
        if s.nbytes != self.slab_bytes or self._held > max(self.budget, self.slab_bytes):
            self._held -= s.nbytes  # an old size, or beyond a smaller budget: freed
        else:
            self._free.append(s)
        self.cond.notify_all()

    def trim(self) -> int:
        """Free the slabs not in use now (the next save allocates again);
        returns the bytes the pool still holds."""
        with self.cond:
            self._held -= sum(f.nbytes for f in self._free)
            self._free.clear()
            return self._held

    def prewarm(self, nbytes: int) -> int:
        """Allocate (and fault in) slabs until the pool holds ``nbytes`` (at
        most the budget), so the first save faults no page; returns the
        bytes the pool holds."""
        with self.cond:
            want = min(nbytes, self.budget)
            while self._held < want and self._held + self.slab_bytes <= self.budget:
                self._free.append(self._new())
            return self.allocated_bytes
