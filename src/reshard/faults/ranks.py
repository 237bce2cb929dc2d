"""The rank side of the fault matrix: what each of a cell's processes does.

Every rank joins a fresh gloo group, commits step 1 through a
:class:`~reshard.CheckpointManager`, waits until the parent has armed the
fault (and measured the disk), meets the fault saving or loading step 2, and,
where it can go on, saves the next step. It leaves ``rank<r>.json`` (its
outcome) and ``events<r>.jsonl`` (when it raised, got the error hook, or
logged a warning: wall-clock seconds); the faulted rank leaves ``fault.json``
(when the fault fired) just before it dies or stops. A restarted job
(:func:`restart_main`) resumes a root whose job lost a rank and saves once.
The backend (``spec["backend"]``) gives the store, the fault points and the
corruptions: :mod:`reshard.faults.local`, :mod:`reshard.faults.matrix_s3`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from .model import LONG_PG_TIMEOUT_S, PG_TIMEOUT_S, Cell, steps


def rank_backend(name: str) -> Any:
    """The module of backend ``name`` (its rank-side functions): the fault kit
    its storage scheme registered (:attr:`reshard.storage.Scheme.fault_kit`).

    Raises:
        ValueError: no such backend, or it has no fault kit."""
    from ..storage import get_scheme

    kit = get_scheme(name).fault_kit
    if kit is None:
        raise ValueError(f"storage backend {name!r} has no fault kit: the fault matrix does not run on it")
    return importlib.import_module(kit)


# --------------------------------------------------------------------------- state


#: rows of the frozen ``base`` per rank in the cells that save references
#: (:func:`set_frozen`; 0: no base): 32 KiB a rank, above :data:`OWN_FILE_BYTES`
#: (a file of its own, linked by every save after the first), while ``w``
#: and ``b`` stay below it (written every save, in the rank's file)
BASE_ROWS = 128
#: ``SaveOptions.own_file_bytes`` of those cells
OWN_FILE_BYTES = 16 << 10
_FROZEN = {"rows": 0}


def frozen_cell(cell: Cell) -> bool:
    """The cells whose state holds a frozen ``base`` (incremental saves link it)."""
    return cell.fault_class == "incremental" or cell.phase == "shared-shard"


def set_frozen(cell: Cell) -> None:
    """Give this process's states a frozen ``base`` when ``cell`` needs one
    (every process of a cell, and the judge, call it first)."""
    _FROZEN["rows"] = BASE_ROWS if frozen_cell(cell) else 0


def save_options(cell: Cell) -> Any:
    """The ``SaveOptions`` of a cell's managers (None: the defaults)."""
    from ..options import SaveOptions

    return SaveOptions(own_file_bytes=OWN_FILE_BYTES) if frozen_cell(cell) else None


def full(step: int, world: int, rows: int) -> dict[str, Any]:
    """The global state of ``step``: ``w`` (``rows`` rows per rank) and ``b``,
    and in the cells that save references a ``base`` that no step changes."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    out = {"w": torch.randn(rows * world, 64, generator=g), "b": torch.randn(32, generator=g)}
    if _FROZEN["rows"]:
        out["base"] = torch.randn(_FROZEN["rows"] * world, 64, generator=torch.Generator().manual_seed(7))
    return out


def state(step: int, rank: int, world: int, rows: int, *, hook: Any = None) -> dict[str, Any]:
    """Rank ``rank``'s state of ``step``: its row shard of ``w``, the
    replicated ``b``, a common value (and a Stateful ``hook`` whose
    ``state_dict`` runs while the save stages)."""
    from ..state.sharding import ShardedTensor

    f = full(step, world, rows)
    st: dict[str, Any] = {
        "w": ShardedTensor("w", f["w"][rank * rows:(rank + 1) * rows].clone(),
                           global_shape=tuple(f["w"].shape), global_offset=(rank * rows, 0)),
        "b": f["b"].clone(), "meta": {"step": step}}
    if "base" in f:
        n = _FROZEN["rows"]
        st["base"] = ShardedTensor("base", f["base"][rank * n:(rank + 1) * n].clone(),
                                   global_shape=tuple(f["base"].shape), global_offset=(rank * n, 0))
    if hook is not None:
        st["hook"] = hook
    return st


def target(rank: int, world: int, rows: int) -> dict[str, Any]:
    import torch

    from ..state.sharding import ShardedTensor

    out = {"w": ShardedTensor("w", torch.zeros(rows, 64), global_shape=(rows * world, 64),
                              global_offset=(rank * rows, 0)),
           "b": torch.zeros(32), "meta": {"step": 0}}
    n = _FROZEN["rows"]
    if n:
        out["base"] = ShardedTensor("base", torch.zeros(n, 64), global_shape=(n * world, 64),
                                    global_offset=(rank * n, 0))
    return out


def matches(tgt: dict[str, Any], step: int, rank: int, world: int, rows: int) -> bool:
    import torch

    f = full(step, world, rows)
    n = _FROZEN["rows"]
    return bool(torch.equal(tgt["b"], f["b"]) and torch.equal(
        tgt["w"].data, f["w"][rank * rows:(rank + 1) * rows]) and (
        "base" not in f or torch.equal(tgt["base"].data, f["base"][rank * n:(rank + 1) * n])))


class SignalOnStateDict:
    """A Stateful whose ``state_dict`` (called while the save stages) marks
    the fault and sends ``sig`` to its own process."""

    def __init__(self, cdir: str, sig: int):
        self.cdir, self.sig = cdir, sig

    def state_dict(self) -> dict[str, Any]:
        mark(self.cdir, "stage", "state_dict")
        os.kill(os.getpid(), self.sig)
        return {}

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover
        pass


# --------------------------------------------------------------------------- what the ranks record


def mark(cdir: str, op: str, path: str) -> None:
    """Record the moment a fault fires (``fault.json``; the first one counts)."""
    f = os.path.join(cdir, "fault.json")
    if not os.path.exists(f):
        with open(f + f".{os.getpid()}", "w") as fh:
            json.dump({"t": time.time(), "op": op, "path": path}, fh)
        os.replace(f + f".{os.getpid()}", f)


class Events(logging.Handler):
    """Appends this rank's events to ``events<r>.jsonl``: warnings of the
    ``reshard`` logger, the error hook, raises."""

    def __init__(self, cdir: str, rank: int):
        super().__init__(logging.WARNING)
        self.hooked: list[BaseException] = []
        self.path = os.path.join(cdir, f"events{rank}.jsonl")
        self._lock = threading.Lock()
        logging.getLogger("reshard").addHandler(self)

    def add(self, kind: str, msg: str) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps({"t": time.time(), "kind": kind, "msg": msg[:500]}) + "\n")
            f.flush()

    def emit(self, record: logging.LogRecord) -> None:
        self.add("log", record.getMessage())

    def hook(self, step: Any, path: str, exc: BaseException) -> None:
        """``CheckpointManager(on_save_error=)``."""
        self.add("hook", f"step {step}: {type(exc).__name__}: {exc}")
        self.hooked.append(exc)


def read_events(cdir: str, rank: int) -> list[dict[str, Any]]:
    p = os.path.join(cdir, f"events{rank}.jsonl")
    if not os.path.exists(p):
        return []
    with open(p) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def outcome(err: BaseException | None) -> dict[str, Any]:
    from ..errors import CheckpointError

    if err is None:
        return {"status": "ok"}
    return {"status": "error", "type": type(err).__name__, "message": str(err)[:2000],
            "checkpoint_error": isinstance(err, CheckpointError),
            "traceback": "".join(traceback.format_exception(err))[-3000:]}


def write_outcome(result: dict[str, Any], err: BaseException | None, out: str) -> None:
    """``out`` atomically (the parent reads only whole files)."""
    result.update(outcome(err))
    result["t_done"] = time.time()
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)


def finish(result: dict[str, Any], err: BaseException | None, out: str) -> None:
    """Write the outcome, leave the group (broken after a lost rank) and end
    the process without exit handlers (a forkserver child)."""
    import torch.distributed as dist

    write_outcome(result, err, out)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group after a lost rank
        pass
    os._exit(0)


def init_group(cell: Cell, rank: int, world: int, port: int, spec: dict[str, Any],
               cdir: str | None = None) -> None:
    """Join the cell's gloo group (and, with ``cdir``, dump every thread's
    stack to ``stacks<r>.txt`` on SIGUSR1: the runner asks a hung rank where
    it hangs before it kills it)."""
    if cdir is not None:
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=open(os.path.join(cdir, f"stacks{rank}.txt"), "w"),  # noqa: SIM115
                              all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(spec.get("env", {}))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a checkpoint timeout must bound the cell alone; gc beside a save holds
    # it for as long as the operator's command runs
    long = cell.timeout_s is not None or cell.fault_class == "gc-concurrent" or cell.action == "gc"
    t = LONG_PG_TIMEOUT_S if long else PG_TIMEOUT_S
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=t))


def wait_armed(cdir: str, rank: int) -> None:
    """Tell the parent this rank is ready; wait until it armed the fault."""
    import torch.distributed as dist

    dist.barrier()
    with open(os.path.join(cdir, f"ready{rank}"), "w"):
        pass
    while not os.path.exists(os.path.join(cdir, "armed")):
        time.sleep(0.02)
    dist.barrier()


# --------------------------------------------------------------------------- one rank of a cell


def rank_main(cell: Cell, rank: int, world: int, port: int, cdir: str, spec: dict[str, Any]) -> None:
    """One rank of a cell (runs in a child process); ``spec``: ``backend``,
    ``root``, ``rows``, ``env``, ``disk`` (the tmpfs, where the cell has one)."""
    init_group(cell, rank, world, port, spec, cdir)
    set_frozen(cell)
    import torch.distributed as dist

    import reshard

    from ..manager.manager import CheckpointManager
    from .inject import FaultStorage

    be = rank_backend(spec["backend"])
    root, rows = spec["root"], spec["rows"]
    prev, op_step, nxt = steps(cell)
    ev = Events(cdir, rank)
    out = os.path.join(cdir, f"rank{rank}.json")
    result: dict[str, Any] = {}
    st = be.rank_storage()
    keep_last = 1 if cell.phase.startswith("retention") else None
    kw: dict[str, Any] = dict(use_async=cell.mode == "async", preempt_signals=(), gc_grace_s=0.0,
                              options=save_options(cell))
    mgr = CheckpointManager(root, keep_last=keep_last, storage=st, **kw)
    for s in range(1, prev + 1):
        mgr.save(s, state(s, rank, world, rows), sync=True)
    if cell.op == "gc":  # step 2 links step 1's base; then the operator's gc is killed mid-sweep
        mgr.save(2, state(2, rank, world, rows), sync=True)
    if cell.op == "integrity":
        mgr.save(2, state(2, rank, world, rows), sync=True)
        other = be.other_path(st, root)
        reshard.save(state(3, rank, world, rows), other, step=2, storage=st)  # same layout, another attempt
        dist.barrier()
        if rank == 0:
            be.corrupt(st, cell.phase, mgr.path_for(2), other)
    dist.barrier()
    if rank == 0 and cell.fault_class == "full-disk":
        fill(spec["disk"], leave=600 << 10)  # three checkpoints and a ballast: 600 KiB free
    if rank == 0 and cell.fault_class == "enospc-clears" and cell.phase == "plan":
        fill(spec["disk"], leave=1 << 10)  # full before the save: refused up front
    wait_armed(cdir, rank)
    faults = be.faults_for(cell, rank, cdir, spec)
    fs = FaultStorage(st, faults, on_fire=lambda op, path, action: mark(cdir, op, path))
    err: BaseException | None = None
    m2: CheckpointManager | None = None
    if cell.fault_class == "full-disk":
        keep_last = 1  # the restart on a disk full of checkpoints it no longer keeps
    try:
        if cell.op == "gc":
            while not os.path.exists(os.path.join(cdir, "gc-done")):  # the operator's gc ran (killed)
                time.sleep(0.05)
            dist.barrier()
        elif cell.op == "save":
            m2 = CheckpointManager(root, keep_last=keep_last, storage=fs, on_save_error=ev.hook,
                                   timeout_s=cell.timeout_s, **kw)
            if frozen_cell(cell):  # the same job going on: its next save's parent is the last one
                m2._parent = m2._last_committed = mgr._last_committed
            sig = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}.get(cell.action)
            hook = SignalOnStateDict(cdir, sig) if cell.phase == "stage" and rank == cell.rank and sig else None
            h = m2.save(op_step, state(op_step, rank, world, rows, hook=hook))
            m2.wait()
            fut = getattr(h, "committed", None)  # an asynchronous save's handle carries its failure
            if fut is not None and fut.exception() is not None:
                raise fut.exception()
            if cell.fault_class == "silent-corruption":  # committed: every rank must refuse it
                tgt = target(rank, world, rows)
                try:
                    reshard.load(tgt, mgr.path_for(2), storage=st)
                    result["post_load"] = {"status": "ok"}
                except BaseException as e:  # noqa: BLE001
                    result["post_load"] = outcome(e)
        else:
            path = reshard.latest(root, storage=st) if cell.op == "integrity" else mgr.path_for(1)
            result["loaded"] = path
            assert path is not None, "no committed checkpoint to load"
            tgt = target(rank, world, rows)
            opts = reshard.LoadOptions(timeout_s=cell.timeout_s)
            reshard.load(tgt, path, storage=fs, options=opts)
            if not matches(tgt, 2 if path == mgr.path_for(2) else 1, rank, world, rows):
                result["wrong_data"] = True
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        err = e
        ev.add("raised", f"{type(e).__name__}: {e}")
    if not cell.process_fault:
        # liveness: the fault (fired once) has cleared; the next save must commit
        if cell.fault_class == "enospc-clears":
            dist.barrier()
            if rank == 0:
                os.unlink(os.path.join(spec["disk"], "filler"))
            dist.barrier()
        nm = m2 or mgr
        try:
            nm.save(nxt, state(nxt, rank, world, rows))
            nm.wait()
            result["next_save"] = "committed"
        except BaseException as e:  # noqa: BLE001 - judged by the parent
            result["next_save"] = f"{type(e).__name__}: {e}"[:300]
    finish(result, err, out)


def fill(disk: str, leave: int) -> None:
    """Write ``disk/filler`` until ``leave`` bytes are free on ``disk`` (or
    the disk is full)."""
    stv = os.statvfs(disk)
    todo = max(0, stv.f_bavail * stv.f_frsize - leave)
    with open(os.path.join(disk, "filler"), "ab") as f:
        try:
            while todo > 0:
                n = min(todo, 1 << 20)
                f.write(b"\0" * n)
                todo -= n
            f.flush()
        except OSError:  # full: as full as it gets
            pass


def restart_main(cell: Cell, rank: int, world: int, port: int, cdir: str, spec: dict[str, Any]) -> None:
    """A restarted job on the cell's root: restore the newest checkpoint
    (bit-exact), save the next step, report ``restart<r>.json``."""
    init_group(cell, rank, world, port, {**spec, "env": spec.get("env", {})})
    set_frozen(cell)
    from ..manager.manager import CheckpointManager

    be = rank_backend(spec["backend"])
    root, rows = spec["root"], spec["rows"]
    _, op_step, nxt = steps(cell)
    result: dict[str, Any] = {}
    err: BaseException | None = None
    try:
        keep_last = 1 if cell.phase.startswith("retention") else None
        mgr = CheckpointManager(root, keep_last=keep_last, preempt_signals=(), gc_grace_s=0.0,
                                storage=be.rank_storage(), options=save_options(cell))
        tgt = target(rank, world, rows)
        res = mgr.restore(tgt)
        step = res.step if res is not None else None
        result["restored"] = step
        result["restored_exact"] = step is not None and matches(tgt, int(step), rank, world, rows)
        mgr.save(nxt, state(nxt, rank, world, rows))
        mgr.close()
        result["next_save"] = "committed"
    except BaseException as e:  # noqa: BLE001 - judged by the parent
        err = e
        result["next_save"] = f"{type(e).__name__}: {e}"[:300]
    finish(result, err, os.path.join(cdir, f"restart{rank}.json"))


def faults_for(cell: Cell, rank: int, cdir: str, spec: dict[str, Any], spots: dict[str, tuple[str, str]],
               half_delete: Any) -> list[Any]:
    """The FaultStorage faults of ``rank`` in ``cell``; ``spots``: the
    backend's ``(op, match)`` of each phase, ``half_delete``: its callback
    that deletes part of a checkpoint and kills the process."""
    from .inject import Fault
    from .model import PG_TIMEOUT_S as _PG

    if rank != cell.rank or cell.op in ("integrity", "gc") or cell.phase == "stage" or cell.fault_class in (
            "s3-http", "truncated-body", "full-disk") or (cell.fault_class == "enospc-clears"
                                                         and cell.phase == "plan"):
        return []
    ph, a = cell.phase, cell.action
    if cell.action == "gc":  # every data file waits for the parent's gc run (gc-concurrent, incremental)
        return [Fault(op="open_write", match=spots["data"][1], action="call", times=0,
                      callback=_gated(cdir))]
    if cell.fault_class == "enospc-clears":  # the disk fills as the first shard file is written
        disk = spec["disk"]
        return [Fault(op=spots["data"][0], match=spots["data"][1], action="call",
                      callback=lambda op, path: fill(disk, leave=0))]
    if ph == "plan":  # the coordinator checks the target before the plan is gathered
        return [Fault(op="exists", match="manifest.json", action=a)]
    op, match = spots["manifest-read" if (cell.op, ph) == ("load", "manifest") else ph]
    if ph == "retention-mid":
        return [Fault(op=op, match=match, action="call", callback=half_delete)]
    if a == "delay":
        return [Fault(op=op, match=match, action="delay", delay_s=_PG * 20)]  # never arrives
    after = ph in ("publish-after", "lease") or (ph == "data" and a in ("kill", "stop"))  # mid-data
    return [Fault(op=op, match=match, action=a, after=after)]


def _gated(cdir: str) -> Any:
    """A callback that announces the k-th call (``inflight<k>``) and waits
    (at most 60 s) for the parent's ``gate<k>``."""
    n = [0]

    def wait(op: str, path: str) -> None:
        n[0] += 1
        k = n[0]
        with open(os.path.join(cdir, f"inflight{k}"), "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(cdir, f"gate{k}")) and time.monotonic() < deadline:
            time.sleep(0.02)

    return wait
