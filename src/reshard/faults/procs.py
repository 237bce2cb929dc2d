"""The processes of a fault-matrix cell: a free port for its group, the
forkserver context its ranks start from, and :class:`_Proc`, one rank process
(a forkserver child or a plain interpreter) as the runner and the shared-root
cells handle it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "reshard",
                                     "reshard.faults.ranks"])
    return _CTX


class _Proc:
    """A rank process: a forkserver child or a plain interpreter (Popen)."""

    def __init__(self, p: Any):
        self.p = p
        self.popen = not hasattr(p, "is_alive")
        self.exited_at: float | None = None
        self.hung = False  # killed by the runner when the cell's time was up

    def alive(self) -> bool:
        return self.p.poll() is None if self.popen else bool(self.p.is_alive())

    @property
    def code(self) -> int | None:
        return self.p.returncode if self.popen else self.p.exitcode

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.join(5)

    def join(self, timeout: float | None = None) -> None:
        if self.popen:
            try:
                self.p.wait(timeout)
            except Exception:  # noqa: BLE001 - still running: the caller decides
                pass
        else:
            self.p.join(timeout)
