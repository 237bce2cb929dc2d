"""The fault matrix's continuation cells that need more than a rank function:
ranks that are plain interpreters (so what their exit does is judged), the
parent's part of a cell (``reshard gc`` beside the saves, torchrun's SIGTERM),
and the small tmpfs a full-disk cell runs on.

Run as ``python -m reshard.faults.jobs JSON`` for one rank of a
``sigkill-exit`` or ``sigterm-unwinding`` cell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from .model import Cell, CellResult
from .ranks import (
    Events,
    init_group,
    mark,
    rank_backend,
    state,
    wait_armed,
    write_outcome,
)

#: how long a rank of the SIGTERM cell sits in its ``finally`` block (a slow cleanup)
UNWIND_S = 30.0


def exit_rank(cell: Cell, rank: int, world: int, port: int, cdir: str, spec: dict[str, Any]) -> None:
    """One rank of a real-exit cell (a plain interpreter).

    ``sigkill-exit``: an asynchronous save of step 2 is handed off, rank 1 is
    SIGKILLed as it writes its shard file, and rank 0 returns from its main:
    the interpreter's exit waits for the pending save, which must fail soon.
    ``sigterm-unwinding``: an asynchronous save of step 2 is in flight (rank
    0's shard file waits for a gate never opened), the training step raises,
    and the ``finally`` block takes its time: the parent's SIGTERM must end
    the process as it would without reshard."""
    init_group(cell, rank, world, port, spec, cdir)
    from ..manager.manager import CheckpointManager
    from .inject import Fault, FaultStorage

    be = rank_backend(spec["backend"])
    root, rows = spec["root"], spec["rows"]
    ev = Events(cdir, rank)
    out = os.path.join(cdir, f"rank{rank}.json")
    st = be.rank_storage()
    if cell.fault_class == "sigkill-exit":
        mgr = CheckpointManager(root, use_async=True, preempt_signals=(), gc_grace_s=0.0, storage=st)
        mgr.save(1, state(1, rank, world, rows), sync=True)
        wait_armed(cdir, rank)
        fs = FaultStorage(st, be.faults_for(cell, rank, cdir, spec),
                          on_fire=lambda op, path, action: mark(cdir, op, path))
        m2 = CheckpointManager(root, use_async=True, preempt_signals=(), gc_grace_s=0.0, storage=fs,
                               on_save_error=ev.hook)
        m2.save(2, state(2, rank, world, rows))
        write_outcome({"handed_off": True}, None, out)
        return  # the interpreter exits with the save pending
    never = os.path.join(cdir, "never")

    def gate(op: str, path: str) -> None:
        deadline = time.monotonic() + UNWIND_S
        while not os.path.exists(never) and time.monotonic() < deadline:
            time.sleep(0.05)

    faults = [Fault(op="open_write", match="data-*", action="call", nth=2, callback=gate)] if rank == 0 else []
    mgr = CheckpointManager(root, every_steps=1, use_async=True, gc_grace_s=0.0, on_save_error=ev.hook,
                            storage=FaultStorage(st, faults))  # SIGTERM: the preemption handler
    mgr.save(1, state(1, rank, world, rows), sync=True)
    wait_armed(cdir, rank)
    mgr.maybe_save(2, state(2, rank, world, rows))
    try:
        raise RuntimeError("the training step failed")
    finally:
        with open(os.path.join(cdir, f"unwinding{rank}"), "w"):
            pass
        time.sleep(UNWIND_S)  # cleanup that takes a while, as the exception propagates


def spawn_exit_rank(cell: Cell, rank: int, world: int, port: int, cdir: str,
                    spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start :func:`exit_rank` in a new interpreter (stderr to ``stderr<r>.txt``)."""
    arg = json.dumps({"cell": asdict(cell), "rank": rank, "world": world, "port": port, "cdir": cdir,
                      "spec": spec})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    err = open(os.path.join(cdir, f"stderr{rank}.txt"), "wb")  # noqa: SIM115 - the child's
    try:
        return subprocess.Popen([sys.executable, "-m", "reshard.faults.jobs", arg],
                                stdout=err, stderr=err, env=env)
    finally:
        err.close()


# --------------------------------------------------------------------------- the parent's part


class Operator:
    """What the parent does while a cell runs: ``reshard gc ROOT --grace 0``
    whenever a save waits in flight (gc-concurrent), torchrun's SIGTERM to
    every rank once they unwind (sigterm-unwinding)."""

    def __init__(self, cell: Cell, cdir: str, root: str, res: CellResult):
        self.cell, self.cdir, self.root, self.res = cell, cdir, root, res
        self.k = 0
        self.gc_runs: list[str] = []
        self.sent = False

    def tick(self, procs: list[Any]) -> None:
        if self.cell.action == "gc":  # gc-concurrent; incremental: with retention, of linked files
            k = self.k + 1
            if os.path.exists(os.path.join(self.cdir, f"inflight{k}")):
                keep = ("--keep-last", "1") if self.cell.fault_class == "incremental" else ()
                self.gc_runs.append(run_gc(self.root, *keep))
                self.k = k
                with open(os.path.join(self.cdir, f"gate{k}"), "w"):
                    pass
        elif self.cell.action == "gc-kill" and not self.gc_runs and os.path.exists(
                os.path.join(self.cdir, "armed")):
            self.gc_runs.append(run_killed_gc(self.root, self.cdir))
            with open(os.path.join(self.cdir, "gc-done"), "w"):
                pass
        elif self.cell.fault_class == "sigterm-unwinding" and not self.sent and all(
                os.path.exists(os.path.join(self.cdir, f"unwinding{r}")) for r in range(len(procs))):
            time.sleep(0.5)  # inside the finally block
            mark(self.cdir, "signal", "SIGTERM")
            for p in procs:
                p.signal(signal.SIGTERM)
            self.sent = True

    def judge(self, procs: list[Any]) -> None:
        """The cell's own checks (problems: unsafe; liveness: not live)."""
        res = self.res
        if self.cell.action == "gc-kill":
            out = " ".join(self.gc_runs)
            if not out.startswith(f"exit {-signal.SIGKILL}"):
                res.problems.append(f"the operator's gc was to be SIGKILLed mid-sweep, it ended: {out[-600:]}")
        if self.cell.action == "gc":
            if len(self.gc_runs) < 2:
                res.problems.append(f"gc ran beside {len(self.gc_runs)} saves, not 2: the cell tested less")
            for out in self.gc_runs:
                res.notes.append(" | ".join(ln for ln in out.splitlines() if "attempt" in ln)[:300])
                if "in progress" not in out:
                    res.problems.append(f"gc --grace 0 beside a save in flight did not keep it: {out[:300]}")
        if self.cell.fault_class == "sigterm-unwinding":
            if not self.sent:
                res.problems.append("the ranks never reached their finally block: no SIGTERM sent")
            for r, p in enumerate(procs):
                err = _tail(os.path.join(self.cdir, f"stderr{r}.txt"))
                if p.code != -signal.SIGTERM:
                    res.liveness.append(f"rank {r} ended with {p.code}, not by the SIGTERM")
                if "will be saved at the next step boundary" in err:
                    res.liveness.append(f"rank {r} took the SIGTERM for a preemption while unwinding")
                lines = [ln for ln in err.splitlines() if ln.startswith("reshard")]
                res.notes += [f"rank {r}: {ln[:200]}" for ln in lines[:2]]
        if self.cell.fault_class == "sigkill-exit":
            err = _tail(os.path.join(self.cdir, "stderr0.txt"))
            res.notes += [f"rank 0: {ln[:200]}" for ln in err.splitlines() if ln.startswith("reshard")][:2]


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-20000:]
    except OSError:
        return ""


def run_gc(root: str, *extra: str) -> str:
    """``reshard gc ROOT --grace 0`` (and ``extra`` options) run as an
    operator would, in a process of its own beside the job's; its exit
    status and output."""
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "gc", root, "--grace", "0", *extra],
                       capture_output=True, text=True, timeout=300)
    return f"exit {r.returncode}: {r.stdout}{r.stderr}"


def run_killed_gc(root: str, cdir: str) -> str:
    """An operator's gc of ``root`` with ``keep_last=1`` in a process of its
    own, SIGKILLed in the middle of deleting step 1 (one of its data files
    gone: a file step 2 links, the first in name order); its exit status."""
    code = ("import sys; from reshard.faults.jobs import killed_gc_main; "
            "killed_gc_main(sys.argv[1], sys.argv[2])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", code, root, cdir], capture_output=True, text=True,
                       timeout=300, env=env)
    return f"exit {r.returncode}: {r.stdout}{r.stderr[-2000:]}"


def killed_gc_main(root: str, cdir: str) -> None:
    """The body of :func:`run_killed_gc`: retention (keep_last=1) through a
    FaultStorage that deletes one data file of the checkpoint being deleted
    and SIGKILLs this process."""
    from ..manager.manager import CheckpointManager
    from ..storage import LocalStorage
    from .inject import Fault, FaultStorage
    from .ranks import mark

    def half(op: str, path: str) -> None:
        names = sorted(n for n in os.listdir(path) if n.startswith("data-")) if os.path.isdir(path) else []
        for n in names[:1]:
            os.unlink(os.path.join(path, n))
        mark(cdir, op, path)
        os.kill(os.getpid(), signal.SIGKILL)

    fs = FaultStorage(LocalStorage(), [Fault(op="delete", match="step-00000001.incomplete-deleting-*",
                                             action="call", callback=half)])
    # as `reshard gc` does: an operator's gc takes no ownership of the root (the job's lease may
    # still be live: a SIGKILLed job's lease expires by itself)
    mgr = CheckpointManager(root, keep_last=1, storage=fs, preempt_signals=(), gc_grace_s=0.0, writer=False)
    mgr.apply_retention(smoke_newer=True)
    mgr.gc_abandoned()


def mount_tmpfs(path: str, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path``; None, or why it cannot (not
    root, mount refused: the cell is skipped)."""
    os.makedirs(path, exist_ok=True)
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "a real full disk needs root to mount a tmpfs"
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount failed: {e}"
    return None if r.returncode == 0 else f"mount -t tmpfs refused: {r.stderr.strip() or r.returncode}"


def umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], check=False, capture_output=True)


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    exit_rank(Cell(**a["cell"]), a["rank"], a["world"], a["port"], a["cdir"], a["spec"])
