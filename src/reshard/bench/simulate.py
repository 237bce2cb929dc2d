"""Run the real save / load coordination of N ranks in one process.

The protocols of :mod:`reshard.planning.coordination` and :mod:`reshard.planning.coordination_load`
are generators of collective requests; :class:`SimWorld` advances N of them in
lockstep, performs each collective in memory, and counts the bytes each rank
sends and receives (payloads plus the 8-byte length headers, as
:class:`reshard.collectives.Counting` does for real collectives) and the CPU
seconds each rank spends in its own steps (``time.process_time_ns``: the
process is single-threaded, so this is the rank's own work even on a shared
machine).

Work a rank does that stands in for something else (the simulated data
write) is left out with :meth:`SimWorld.uncounted`, measured by the same
clock inside the step that runs it, so the difference is never negative: a
duration is never a wall-clock figure subtracted from a CPU-clock one.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..collectives_base import Request, _reduce


@dataclass
class SimStats:
    """Per-rank counters of one :meth:`SimWorld.run`: bytes sent / received,
    CPU nanoseconds spent in the rank's own steps (``cpu_ns``) and the part of
    them spent in :meth:`SimWorld.uncounted` blocks (``excluded_ns``, nested
    in ``cpu_ns`` and measured by the same clock, so ``excluded_ns[r] <=
    cpu_ns[r]``)."""

    sent: list[int]
    recv: list[int]
    cpu_ns: list[int]
    excluded_ns: list[int]
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> list[float]:
        """Each rank's counted CPU seconds (its steps less its uncounted blocks; >= 0)."""
        return [(c - x) / 1e9 for c, x in zip(self.cpu_ns, self.excluded_ns, strict=True)]

    def max_other(self, what: str) -> float:
        vals = getattr(self, what)[1:]
        return max(vals) if vals else 0


class SimWorld:
    """N simulated ranks; rank 0 is the coordinator."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._current: int | None = None  # the rank whose step runs now
        self._excluded: list[int] = [0] * world_size

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave the CPU time of the block out of the running rank's seconds.

        Only inside a rank's step (a callback its protocol calls); the block's
        interval nests in the step's, on the same clock.

        Raises:
            RuntimeError: outside a step of :meth:`run`.
        """
        r = self._current
        if r is None:
            raise RuntimeError("SimWorld.uncounted() outside a rank's step")
        t0 = time.process_time_ns()
        try:
            yield
        finally:
            self._excluded[r] += time.process_time_ns() - t0

    def run(self, gens: Sequence[Generator[Request, Any, Any]]) -> tuple[list[Any], SimStats]:
        """Advance every rank's protocol to completion in lockstep.

        Returns each rank's return value (or the exception it raised) and the
        counters. Raises AssertionError when ranks issue different collectives
        (a protocol bug)."""
        n = self.world_size
        assert len(gens) == n
        self._excluded = [0] * n
        stats = SimStats(sent=[0] * n, recv=[0] * n, cpu_ns=[0] * n, excluded_ns=self._excluded)
        results: list[Any] = [None] * n
        done = [False] * n
        reqs: list[Request | None] = [None] * n
        sends: list[Any] = [None] * n

        def step(r: int, value: Any, first: bool) -> None:
            self._current = r
            t0 = time.process_time_ns()
            try:
                reqs[r] = next(gens[r]) if first else gens[r].send(value)
            except StopIteration as stop:
                results[r], done[r] = stop.value, True
            except Exception as e:  # noqa: BLE001 - agreed errors end a rank's protocol
                results[r], done[r] = e, True
            finally:
                stats.cpu_ns[r] += time.process_time_ns() - t0
                self._current = None

        for r in range(n):
            step(r, None, True)
        while not all(done):
            if any(done):
                raise AssertionError(f"ranks finished at different steps: {[r for r in range(n) if done[r]][:8]}")
            ops = {q[0] for q in reqs if q is not None}
            if len(ops) != 1:
                raise AssertionError(f"ranks issued different collectives: {sorted(ops)}")
            op = ops.pop()
            stats.calls[op] = stats.calls.get(op, 0) + 1
            rq: list[Request] = [q for q in reqs if q is not None]
            if op == "all_reduce_ints":
                red = _reduce([q[1] for q in rq], rq[0][2] if len(rq[0]) > 2 else "sum")
                for r in range(n):
                    stats.sent[r] += 8 * len(red)
                    stats.recv[r] += 8 * len(red)
                    sends[r] = list(red)
            elif op == "gather_bytes":
                data = [bytes(q[1]) for q in rq]
                for r in range(1, n):
                    stats.sent[r] += len(data[r]) + 8
                    stats.recv[0] += len(data[r]) + 8
                    sends[r] = None
                sends[0] = data
            elif op == "scatter_bytes":
                parts = rq[0][1]
                assert parts is not None and len(parts) == n
                for r in range(n):
                    if r:
                        stats.sent[0] += len(parts[r]) + 8
                        stats.recv[r] += len(parts[r]) + 8
                    sends[r] = bytes(parts[r])
            elif op == "broadcast_bytes":
                data0 = bytes(rq[0][1] or b"")
                for r in range(n):
                    if r:
                        stats.sent[0] += len(data0) + 8
                        stats.recv[r] += len(data0) + 8
                    sends[r] = data0
            else:
                raise AssertionError(f"unknown collective {op!r}")
            for r in range(n):
                step(r, sends[r], False)
        return results, stats
