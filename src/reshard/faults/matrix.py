"""The fault matrix: every fault x phase x mode, run on real gloo ranks, on a
backend given as a parameter (the local file system; S3: moto's server or
s3rver behind a fault proxy, :mod:`reshard.faults.matrix_s3`).

Each :class:`Cell` starts ``world`` real processes (``multiprocessing``
forkserver with torch preloaded, a fresh gloo group per cell; plain
interpreters where the cell judges what the exit does) that commit a good
checkpoint (step 1) through a :class:`~reshard.CheckpointManager`, then meet
the fault while saving (sync or async) or loading step 2 (rank side:
:mod:`reshard.faults.ranks`), then go on:

* storage errors (``ENOSPC``, ``EIO``, ``EDQUOT``, a timeout) at a phase of one
  rank, silent corruption after a write (truncate, flip a byte);
* process faults: SIGKILL of one rank at each phase of a save and during a
  load, a rank that never arrives (stalled past the group timeout), a rank
  SIGSTOPped in each collective phase of a save and a load (with and
  without a checkpoint ``timeout_s``), a rank killed under an asynchronous
  save that the survivor's exit waits for, SIGTERM while unwinding;
* the continuation: a real full disk (tmpfs) that clears before the next
  save, a disk full of checkpoints retention may free, ``reshard gc --grace
  0`` beside the saves;
* integrity faults on a committed checkpoint: truncated or bit-flipped shard
  file, missing / truncated / corrupted manifest, a manifest or a shard file
  from another attempt, a missing file, an extra file;
* many hands on one root (:mod:`reshard.faults.shared`): two jobs on one
  root (both orders, sync and async, local and S3), a reader beside
  retention, ``gc`` at 0 bytes free, a FIFO or socket at each opened path, a
  mis-signed checkpoint with a key configured.

A cell is **safe** when: every surviving rank raised a
:class:`~reshard.errors.CheckpointError` (where the fault must fail the
operation), and, where a rank was killed or stalled, each survivor's error
names that rank as lost; every checkpoint listed as committed verifies with
checksums (or, for a checkpoint corrupted after its commit, every rank's
load of it was refused); ``latest`` is the newest checkpoint that verifies;
the previous committed checkpoint (the newest, for retention cells) loads
bit-exact; and after the job ended, ``gc`` leaves no stray attempt.

A cell is **live** when the next save after the fault commits on every rank
(in the same processes, or where a rank was lost, in a restarted job that
resumes bit-exact); every survivor saw the fault within
:func:`~reshard.faults.model.detect_bound_s` (a dead or hung peer:
its collective bound, twice, plus slack); every process exited within
``AFTER_DETECTION_S`` (5 s) of the later of its detection and its own work;
and the failed attempt's space came back (at once when the coordinator
lived, else by the restarted job's housekeeping).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any
from unittest import mock

from .model import (
    AFTER_DETECTION_S,
    PG_TIMEOUT_S,
    WORLD,
    Cell,
    CellResult,
    detect_bound_s,
    must_commit,
    must_fail,
    named_lost,
    steps,
)
from .procs import _context, _free_port, _Proc

__all__ = ["Cell", "CellResult", "PG_TIMEOUT_S", "WORLD", "cells", "named_lost", "run_cell", "run_matrix"]


def cells(*, quick: bool = False, backend: str = "local") -> list[Cell]:
    """Every cell of the matrix (``quick``: the first cell of each fault class,
    and the few of ``_QUICK_EXTRA``); ``backend``: "local", "s3" or both,
    comma-separated."""
    if "," in backend:
        return [c for b in backend.split(",") for c in cells(quick=quick, backend=b.strip())]
    from .ranks import rank_backend

    try:
        kit = rank_backend(backend)
    except ValueError:
        raise ValueError(f"unknown fault-matrix backend {backend!r} ({', '.join(fault_backends())})") from None
    return list(kit.matrix_cells(quick=quick))


def fault_backends() -> list[str]:
    """The backends the fault matrix runs on: those whose storage scheme
    registered a fault kit (:attr:`reshard.storage.Scheme.fault_kit`)."""
    from ..storage import schemes

    return [s.backend for s in schemes() if s.fault_kit is not None]


def _start(cell: Cell, target: Any, cdir: str, spec: dict[str, Any], world: int) -> list[_Proc]:
    port = _free_port()
    if cell.real_exit and target is None:
        from .jobs import spawn_exit_rank

        procs = [_Proc(spawn_exit_rank(cell, r, world, port, cdir, spec)) for r in range(world)]
    else:
        from .ranks import rank_main

        ctx = _context()
        procs = [_Proc(ctx.Process(target=target or rank_main, args=(cell, r, world, port, cdir, spec),
                                   daemon=True)) for r in range(world)]
        for p in procs:
            p.p.start()
    return procs


# --------------------------------------------------------------------------- one cell


def run_cell(cell: Cell, workdir: str, *, world: int = WORLD, backend: Any = None) -> CellResult:
    """Run one cell in ``workdir/<name>`` on ``backend`` (default: a local
    one; an S3 cell needs the :class:`~reshard.faults.matrix_s3.S3Backend`
    of its matrix run) and judge it."""
    from .local import TMPFS, LocalBackend
    from .ranks import set_frozen

    set_frozen(cell)  # the judge's states are the cell's (with a frozen base where it saves references)
    be = backend or LocalBackend()
    t0 = time.perf_counter()
    res = CellResult(cell)
    cdir = os.path.join(workdir, cell.name.replace("/", "_"))
    shutil.rmtree(cdir, ignore_errors=True)
    os.makedirs(cdir)
    spec: dict[str, Any] = {"backend": be.name, "env": dict(be.env), "rows": be.rows(cell)}
    disk = os.path.join(cdir, "disk")
    if cell.on_tmpfs:
        from .jobs import mount_tmpfs

        why = mount_tmpfs(disk, TMPFS)
        if why is not None:
            res.skipped = why
            return res
        spec["disk"] = disk
    spec["root"] = root = be.root(cdir, cell)
    if be.name == "local":
        os.makedirs(root, exist_ok=True)
    try:
        with mock.patch.dict(os.environ, be.env):  # the judge talks to the same store
            from .shared import CLASSES, run

            if cell.fault_class in CLASSES:  # many hands on one root: jobs, readers, a person
                run(cell, res, be, cdir, spec)
            else:
                _run(cell, res, be, cdir, spec, world)
    except Exception as e:  # noqa: BLE001 - a judge that cannot look is an unsafe cell
        res.problems.append(f"judging failed: {type(e).__name__}: {e}")
    finally:
        if cell.on_tmpfs:
            from .jobs import umount

            umount(disk)
    res.seconds = time.perf_counter() - t0
    return res


def _run(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any], world: int) -> None:
    from .jobs import Operator

    root = spec["root"]
    st = be.storage()
    be.disarm()
    procs = _start(cell, None, cdir, spec, world)
    op = Operator(cell, cdir, root, res)
    victims = {cell.rank} if cell.action in ("kill", "delay", "stop") else set()
    if cell.fault_class == "sigterm-unwinding":
        victims = set(range(world))
    deadline = time.monotonic() + PG_TIMEOUT_S * 6 + 60
    armed, rules, t_armed = False, [], 0.0
    while time.monotonic() < deadline:
        if not armed and all(os.path.exists(os.path.join(cdir, f"ready{r}")) for r in range(world)):
            res.bytes_before = be.usage(st, root)[0]
            rules = be.arm(cell, root)
            t_armed = time.time()
            with open(os.path.join(cdir, "armed"), "w"):
                pass
            armed = True
        op.tick(procs)
        for p in procs:
            if p.exited_at is None and not p.alive():
                p.exited_at = time.time()
        alive = [r for r, p in enumerate(procs) if p.exited_at is None]
        if not alive:
            break
        if cell.action in ("delay", "stop") and alive == [cell.rank]:
            break  # every other rank has given up on the stalled one: the job ends
        time.sleep(0.05)
    _stop(cell, res, procs)
    be.disarm()  # the judge talks to the store without faults
    outs = _outcomes(res, procs, cdir, "rank")
    if not armed:
        res.problems.append("the ranks never reached the fault (step 1 failed?)")
    elif rules and not any(f.fired for f in rules):
        res.problems.append("the proxy's fault never fired (the cell tested nothing)")
    t_fault = _fault_time(cdir, t_armed)
    res.bytes_after, res.stray_bytes = be.usage(st, root)
    res.left_behind = be.stray(st, root, res)  # what the faulted job left (before any restart)
    _judge_safe(cell, res, outs, procs, be, st, root, cdir, world, victims)
    op.judge(procs)
    _judge_timing(cell, res, outs, procs, cdir, world, victims, t_fault)
    if cell.process_fault:  # the job lost a rank: a restarted job must go on
        rp = _start(cell, _restart_target(), cdir, spec, world)
        for p in rp:
            p.join(PG_TIMEOUT_S * 6 + 30)
        _stop(cell, res, rp, what="restarted job's rank")
        routs = _outcomes(None, rp, cdir, "restart")
        _judge_next(res, routs, world, "the restarted job's save")
        for r, o in routs.items():
            if o.get("restored_exact") is False:
                res.liveness.append(f"the restarted job's rank {r} restored step {o.get('restored')} "
                                    "but not bit-exact")
    else:
        _judge_next(res, outs, world, "the next save after the fault")
    stray_after = be.usage(st, root)[1]
    res.space_back = "yes" if not res.stray_bytes else "restart" if cell.process_fault and not stray_after else "NO"
    if res.space_back == "NO" and not res.skipped:
        res.liveness.append(f"{res.stray_bytes} bytes of the failed attempt are still on disk after the "
                            f"job went on ({stray_after} after the restart)")
    be.before_gc(st, root)
    from ..manager.manager import CheckpointManager

    CheckpointManager(root, storage=st, preempt_signals=(), writer=False).gc_abandoned(grace_s=0.0)
    res.after_gc = be.after_gc(st, root)
    if res.after_gc:
        res.problems.append(f"gc left {res.after_gc[:6]}")


def _restart_target() -> Any:
    from .ranks import restart_main

    return restart_main


def _stop(cell: Cell, res: CellResult, procs: list[_Proc], what: str = "rank") -> None:
    """End the job: kill the processes still alive (a hang: not live, unless
    it is the cell's stalled or stopped rank) and join every one."""
    hung = [p for p in procs if p.alive()]
    for p in hung:  # where do they hang (stacks<r>.txt)?
        p.signal(signal.SIGUSR1)
    if hung:
        time.sleep(0.5)
    for r, p in enumerate(procs):
        if p.alive():
            p.kill()
            p.hung = True
            if what == "rank":
                res.ranks[r] = "hung (killed when the job ended)"
            if not (what == "rank" and cell.action in ("delay", "stop") and r == cell.rank):
                res.liveness.append(f"{what} {r} hung (killed when the cell's time was up)")
        else:
            p.join()


def _outcomes(res: CellResult | None, procs: list[_Proc], cdir: str, kind: str) -> dict[int, dict[str, Any]]:
    """Each rank's outcome file (``<kind><r>.json``); ``res.ranks`` says per
    rank: ok, the error, or killed with its exit code."""
    import json

    outs: dict[int, dict[str, Any]] = {}
    for r, p in enumerate(procs):
        f = os.path.join(cdir, f"{kind}{r}.json")
        if os.path.exists(f):
            with open(f) as fh:
                outs[r] = o = json.load(fh)
            if res is not None:
                res.ranks[r] = "ok" if o["status"] == "ok" else f"{o['type']}: {o['message'][:160]}"
        elif res is not None and r not in res.ranks:
            res.ranks[r] = f"killed (exit {p.code})"
    return outs


def _fault_time(cdir: str, t_armed: float) -> float:
    import json

    try:
        with open(os.path.join(cdir, "fault.json")) as f:
            return float(json.load(f)["t"])
    except (OSError, ValueError, KeyError):
        return t_armed  # a fault of the proxy or of the checkpoint itself: from the arming on


# --------------------------------------------------------------------------- judging


def _judge_safe(cell: Cell, res: CellResult, outs: dict[int, dict[str, Any]], procs: list[_Proc],
                be: Any, st: Any, root: str, cdir: str, world: int, victims: set[int]) -> None:
    import torch

    import reshard

    from ..catalog.verify import verify
    from ..commit.protocol import committed
    from .ranks import full

    prev, op_step, nxt = steps(cell)
    p2 = st.join(root, f"step-{op_step:08d}")
    for r, p in enumerate(procs):
        o = outs.get(r)
        if o is None:
            if r not in victims and not p.hung:
                res.problems.append(f"rank {r} died without an outcome (exit {p.code})")
            continue
        if o.get("wrong_data"):
            res.problems.append(f"rank {r} loaded wrong data without an error")
        if o["status"] == "error" and not o["checkpoint_error"]:
            res.problems.append(f"rank {r} raised {o['type']}, not a CheckpointError: {o['message'][:200]}")
    if cell.action in ("kill", "delay", "stop") and (
            (cell.rank in outs and not outs[cell.rank].get("handed_off"))
            or not os.path.exists(os.path.join(cdir, "fault.json"))):
        res.problems.append(f"rank {cell.rank} was to be {cell.action}ed at {cell.phase} but finished: "
                            "the fault never fired")
    if must_fail(cell):
        for r, o in outs.items():
            if o["status"] == "ok":
                res.problems.append(f"rank {r} reported success although the {cell.op} met "
                                    f"{cell.action} at {cell.phase}")
    if must_commit(cell) and any(o["status"] != "ok" for o in outs.values()):
        res.problems.append(f"the save beside {cell.fault_class} failed: "
                            f"{[o.get('message', '')[:200] for o in outs.values() if o['status'] != 'ok']}")
    if cell.action in ("kill", "delay", "stop"):  # every survivor's error names the lost rank
        for r, o in outs.items():
            if r != cell.rank and o["status"] == "error" and cell.rank not in named_lost(o["message"]):
                res.problems.append(f"rank {r}'s error does not name the lost rank {cell.rank}: "
                                    f"{o['message'][:300]}")
    listed = [e.path for e in committed(st, root)]
    res.latest = reshard.latest(root, storage=st)
    good: list[str] = []
    rotten = _rotten_names(cell, st, root, listed)
    for path in listed:
        rep = verify(path, storage=st)
        if path in rotten:  # the file corrupted after its commit: every checkpoint naming it
            if rep.ok or not any(rotten[path] in p for p in rep.problems):  # must fail, naming it
                res.problems.append(f"{st.basename(path)} names the corrupted file {rotten[path]} but its "
                                    f"verify {'passed' if rep.ok else 'did not name it: ' + str(rep.problems[:2])}")
            for r, o in outs.items():
                if o["status"] != "error" or rotten[path] not in o.get("message", ""):
                    res.problems.append(f"rank {r}'s load of latest did not fail naming {rotten[path]}: "
                                        f"{o.get('message', 'ok')[:200]}")
            continue
        if rep.ok:
            good.append(path)
        elif cell.op == "integrity" and path == p2 and outs and (res.latest != p2 or all(
                o["status"] == "error" and o["checkpoint_error"] for o in outs.values())):
            pass  # corrupted after its commit; latest skips it, or every rank's load refused it
        elif cell.action == "flip" and path == p2 and len(outs) == world and all(
                o.get("post_load", {}).get("checkpoint_error") for o in outs.values()):
            pass  # bit rot after a durable write: committed, and every rank's load refuses it
        else:
            res.problems.append(f"{st.basename(path)} is listed as committed but does not verify: "
                                f"{rep.problems[:2]}")
    newest_good = good[-1] if good else None
    if cell.op == "integrity":
        if res.latest not in (st.join(root, "step-00000001"), p2, st.join(root, f"step-{nxt:08d}")):
            res.problems.append(f"latest is {res.latest}")
    elif not (cell.action == "flip" and res.latest == p2 and p2 not in good) and res.latest != newest_good:
        res.problems.append(f"latest is {res.latest}, the newest good checkpoint is {newest_good}")
    if cell.fault_class == "full-disk" or cell.phase == "shared-shard":
        step = nxt  # the restart with keep_last=1 kept its newest only; the only one not rotten
    elif cell.phase.startswith("retention") or must_commit(cell) or cell.op == "gc":
        step = op_step
    else:
        step = prev
    must_load = st.join(root, f"step-{step:08d}")
    f = full(step, world, be.rows(cell))
    tgt: dict[str, Any] = {k: torch.zeros_like(v) for k, v in f.items()}
    tgt["meta"] = {"step": 0}
    try:
        reshard.load(tgt, must_load, storage=st)
        res.previous_loads = all(torch.equal(tgt[k], f[k]) for k in f)
        if not res.previous_loads:
            res.problems.append(f"{st.basename(must_load)} loads, but not bit-exact")
    except Exception as e:  # noqa: BLE001
        res.problems.append(f"{st.basename(must_load)} no longer loads: {type(e).__name__}: {e}")


def _rotten_names(cell: Cell, st: Any, root: str, listed: list[str]) -> dict[str, str]:
    """The ``shared-shard`` cell: the committed checkpoints naming the
    corrupted file (a data file of step 2 that other checkpoints link:
    every name of one inode) -> that file's name; empty in other cells."""
    if cell.phase != "shared-shard":
        return {}
    p2 = st.join(root, "step-00000002")
    ident: set[Any] = set()
    for n in os.listdir(p2) if os.path.isdir(p2) else []:
        s = os.stat(os.path.join(p2, n))
        if n.startswith("data-c") and s.st_nlink > 1:
            ident.add((s.st_dev, s.st_ino, n))
    out: dict[str, str] = {}
    bad = sorted(ident, key=lambda t: t[2])[:1]  # the one local.corrupt flipped
    for path in listed:
        for n in os.listdir(path):
            s = os.stat(os.path.join(path, n))
            if any((s.st_dev, s.st_ino) == (d, i) for d, i, _ in bad):
                out[path] = n
    return out


def _names_fault(msg: str, cell: Cell) -> bool:
    import re

    return "fail" in msg or bool(re.search(rf"\branks? \[?{cell.rank}\b", msg))


def _judge_timing(cell: Cell, res: CellResult, outs: dict[int, dict[str, Any]], procs: list[_Proc],
                  cdir: str, world: int, victims: set[int], t_fault: float) -> None:
    """Detection and exit, in seconds after the fault, against their bounds."""
    from .ranks import read_events

    survivors = [r for r in range(world) if r not in victims]
    seen: list[float] = []
    for r in survivors:
        ts = [e["t"] for e in read_events(cdir, r) if e["t"] >= t_fault - 0.5 and (
            e["kind"] in ("raised", "hook") or (e["kind"] == "log" and _names_fault(e["msg"], cell)))]
        if ts:
            seen.append(min(ts) - t_fault)
    if survivors and len(seen) == len(survivors):
        res.detect_s = max(0.0, max(seen))
    exits = [p.exited_at for r, p in enumerate(procs) if r not in victims or cell.real_exit]
    if exits and all(t is not None for t in exits):
        res.exit_s = max(0.0, max(t for t in exits if t is not None) - t_fault)
    detect_needed = must_fail(cell) or cell.fault_class == "sigkill-exit"
    if detect_needed and res.detect_s is None:
        res.liveness.append("a surviving rank never saw the fault (no raise, error hook or warning)")
    if res.detect_s is not None and res.detect_s > detect_bound_s(cell):
        res.liveness.append(f"the fault was seen after {res.detect_s:.1f} s (bound {detect_bound_s(cell):.0f} s)")
    done = [float(o["t_done"]) - t_fault for r, o in outs.items() if "t_done" in o and r not in victims]
    start = max([res.detect_s or 0.0, *done]) if cell.fault_class != "sigterm-unwinding" else 0.0
    if res.exit_s is None:
        res.liveness.append("a process did not exit by itself")
    elif res.exit_s > start + AFTER_DETECTION_S:
        res.liveness.append(f"the processes exited {res.exit_s:.1f} s after the fault, "
                            f"{res.exit_s - start:.1f} s after they had seen it and done their work "
                            f"(bound {AFTER_DETECTION_S:.0f} s)")


def _judge_next(res: CellResult, outs: dict[int, dict[str, Any]], world: int, what: str) -> None:
    nexts = {r: o.get("next_save", "not tried") for r, o in outs.items()}
    res.next_commits = len(nexts) == world and all(v == "committed" for v in nexts.values())
    if not res.next_commits:
        res.liveness.append(f"{what} did not commit: {nexts}")


# --------------------------------------------------------------------------- the matrix


def run_matrix(chosen: list[Cell], *, workdir: str, progress: Any = None,
               s3_server: str = "moto") -> list[CellResult]:
    """Run ``chosen`` cells one after another (``progress(result)`` after
    each), backend by backend: the S3 cells on one S3 server started for
    them (moto's, or ``s3_server="s3rver"``)."""
    os.makedirs(workdir, exist_ok=True)
    out = []
    from .ranks import rank_backend

    for name in dict.fromkeys(c.backend for c in chosen):
        be: Any = rank_backend(name).open_backend(s3_server)
        try:
            for c in chosen:
                if c.backend == name:
                    r = run_cell(c, os.path.join(workdir, name), backend=be)
                    out.append(r)
                    if progress is not None:
                        progress(r)
        finally:
            be.close()
    return out
