"""Persistent multi-process ``torch.distributed`` (gloo) workers for the test suite.

Who calls what:

* ``tests/conftest.py`` creates one :class:`WorkerPool` per pytest session (fixture ``pool``).
* Tests call ``pool.run(world_size, fn, *args, **kwargs)``; ``fn`` is a module-level function
  (usually in a rank helper ``tests/<package>/_*_fns.py`` beside the tests that use it) that
  runs once on every rank of an already initialised default gloo process group of exactly
  ``world_size`` ranks. Workers import it by its module name with the parent's ``sys.path``
  (under pytest: ``tests``, ``tests/support`` and the folder of every collected test file).
* :func:`_worker_main` is the entry point of each spawned worker process; it is called only by
  :mod:`multiprocessing`. Nothing else in this module should be called from inside a worker.

Workers are started lazily per world size and kept alive between tasks, so each test pays the
``import torch`` + ``init_process_group`` cost only once per session and world size.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["WorkerError", "WorkerPool"]

MAX_WORLD_SIZE = 16
Failure = tuple[str, str, str]  # (exception type name, message, traceback text)


class WorkerError(AssertionError):
    """A task failed on at least one rank, or some ranks did not answer in time.

    ``failures`` maps rank -> (type name, message, traceback) for ranks that raised (or died);
    ``hung`` lists ranks that did not answer (their world-size group was killed).
    """

    def __init__(self, message: str, failures: dict[int, Failure], hung: list[int]) -> None:
        super().__init__(message)
        self.failures = failures
        self.hung = hung


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(rank: int, conn: Connection, cfg: tuple[int, int, list[str], int, float]) -> None:
    """Worker process body: init the gloo group, then serve tasks from ``conn`` until told to stop.

    ``cfg`` is (world_size, port, parent's sys.path, parent pid, process-group timeout seconds).
    """
    world_size, port, parent_path, parent_pid, pg_timeout = cfg
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # parent dumps stacks of hung ranks
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=pg_timeout),
        )
        conn.send(("ready", None))
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        task_id, module, qualname, args, kwargs = msg
        try:
            fn: Any = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            reply: tuple[str, int, Any] = ("ok", task_id, fn(*args, **kwargs))
            conn.send(reply)
        except BaseException as e:  # noqa: B036 - report everything (pytest.fail, SystemExit...)
            conn.send(("err", task_id, (type(e).__name__, str(e), traceback.format_exc())))


@dataclass
class _Group:
    procs: list[BaseProcess]
    conns: list[Connection]
    next_task: int = 0
    last_used: float = field(default_factory=time.monotonic)


class WorkerPool:
    """Per-world-size groups of persistent gloo worker processes (spawn context).

    ``pg_timeout`` is the gloo collective timeout inside workers; ``grace`` is how long the other
    ranks may take to answer once one rank has failed before they are declared hung and their
    group is killed; at most ``max_groups`` world sizes are kept alive (least recently used
    groups are closed first); with ``dump_hung`` the stacks of hung ranks are printed to
    stderr before they are killed.
    """

    def __init__(self, pg_timeout: float = 30.0, grace: float = 10.0, max_groups: int = 4,
                 dump_hung: bool = True) -> None:
        self.pg_timeout = pg_timeout
        self.grace = grace
        self.dump_hung = dump_hung
        self.max_groups = max_groups
        self._ctx = mp.get_context("spawn")
        self._groups: dict[int, _Group] = {}
        atexit.register(self.close)

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self, world_size: int) -> _Group:
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
        while len(self._groups) >= self.max_groups:
            self._kill(min(self._groups, key=lambda n: self._groups[n].last_used))
        error = ""
        for _attempt in range(3):  # the free port can be stolen between probing and binding
            group = self._spawn(world_size, _free_port())
            error = self._await_ready(group)
            if not error:
                self._groups[world_size] = group
                return group
            self._terminate(group, hung=[])
        raise RuntimeError(f"could not start {world_size} gloo workers:\n{error}")

    def _spawn(self, world_size: int, port: int) -> _Group:
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        cfg = (world_size, port, list(sys.path), os.getpid(), self.pg_timeout)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited at exec time, before torch is loaded
        try:
            for rank in range(world_size):
                parent_end, child_end = self._ctx.Pipe()
                p = self._ctx.Process(
                    target=_worker_main,
                    daemon=True,
                    name=f"reshard-w{world_size}r{rank}",
                    args=(rank, child_end, cfg),
                )
                p.start()
                child_end.close()
                procs.append(p)
                conns.append(parent_end)
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        return _Group(procs, conns)

    def _await_ready(self, group: _Group) -> str:
        deadline = time.monotonic() + self.pg_timeout + 60.0
        for rank, conn in enumerate(group.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return f"rank {rank} did not finish init_process_group in time"
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError):
                group.procs[rank].join(timeout=1.0)
                return f"rank {rank} died during start (exit code {group.procs[rank].exitcode})"
            if kind != "ready":
                return f"rank {rank}: {detail}"
        return ""

    def _terminate(self, group: _Group, hung: list[int]) -> None:
        for rank in hung if self.dump_hung else ():  # faulthandler in the worker prints all thread stacks to stderr
            pid = group.procs[rank].pid
            if group.procs[rank].is_alive() and pid is not None:
                os.kill(pid, signal.SIGUSR1)
        if hung:
            time.sleep(0.2)
        for p in group.procs:
            if p.is_alive():
                p.kill()
        for p in group.procs:
            p.join(timeout=5.0)
        for c in group.conns:
            c.close()

    def _kill(self, world_size: int, hung: list[int] | None = None) -> None:
        group = self._groups.pop(world_size, None)
        if group is not None:
            self._terminate(group, hung or [])

    def restart(self, world_size: int) -> None:
        """Kill the workers of ``world_size`` (if any) and start fresh ones now."""
        self._kill(world_size)
        self._start(world_size)

    def close(self) -> None:
        """Kill every worker (they hold no state worth a clean shutdown); safe to call twice."""
        for n in list(self._groups):
            self._kill(n)
        atexit.unregister(self.close)

    # -- tasks -----------------------------------------------------------------------------
    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank of ``world_size``; results in rank order.

        Raises :class:`WorkerError` if any rank raised, died, or did not answer in time.
        """
        module, qualname = fn.__module__, fn.__qualname__
        if module == "__main__" or "<locals>" in qualname:
            raise ValueError(f"{qualname} must be a module-level function in an importable module")
        group = self._groups.get(world_size) or self._start(world_size)
        group.last_used = time.monotonic()
        task_id = group.next_task = group.next_task + 1
        for conn in group.conns:
            conn.send((task_id, module, qualname, args, kwargs))

        results: dict[int, Any] = {}
        failures: dict[int, Failure] = {}
        pending = dict(enumerate(group.conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                break
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    kind, tid, payload = pending[rank].recv()
                except (EOFError, OSError):
                    group.procs[rank].join(timeout=1.0)
                    code = group.procs[rank].exitcode
                    kind, tid, payload = "err", task_id, ("WorkerDied", f"exit code {code}", "")
                if tid != task_id:
                    continue  # stale answer; cannot normally happen
                del pending[rank]
                if kind == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = payload
                    deadline = min(deadline, time.monotonic() + self.grace)

        if not failures and not pending:
            return [results[r] for r in range(world_size)]
        hung = sorted(pending)
        died = any(f[0] == "WorkerDied" for f in failures.values())
        if hung or died:
            self._kill(world_size, hung)
        lines = [f"{qualname} failed on world_size={world_size}:"]
        for rank, (name, msg, tb) in sorted(failures.items()):
            lines.append(f"--- rank {rank} raised {name}: {msg}\n{tb}")
        if hung:
            why = "after the first failure" if failures else f"within timeout={timeout}s"
            lines.append(
                f"--- ranks {hung} did not answer {why}; workers killed (stacks on stderr)"
            )
        raise WorkerError("\n".join(lines), failures, hung)
