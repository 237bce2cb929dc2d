"""The fault matrix's shared-root cells (issue 28): many hands on one root.

* ``two-jobs``: job A (2 gloo ranks) owns the root; job B (2 ranks, another
  job id) starts beside it, before A's first save or after A saved, A
  saving synchronously or asynchronously, on the local file system and S3.
  Safe: B is refused on every rank before it writes anything (its
  coordinator's error names A), no committed checkpoint of A is lost, every
  listed checkpoint verifies. Live: A's next saves commit; B, restarted once
  A closed, takes the root, resumes A's newest bit-exact and commits.
* ``reader-retention``: a job saves with ``keep_last=1`` while a reader
  process loads ``latest`` over and over. Safe: no load fails once it holds
  its lease (a load that finds its checkpoint already gone before its lease
  held it is refused cleanly, targets untouched), none leaves targets partly
  written, none loads wrong data. Live: every save commits, every checkpoint
  the reader held was deleted once released (keep_last holds at the end).
* ``gc-full-disk``: a real tmpfs at 0 bytes free: ``reshard gc --keep-last 2
  --grace 0`` (a process of its own) frees what retention allows; full again,
  a 2-rank job (keep_last=1) saving there deletes first (writing nothing
  before) and commits.
* ``fifo``: a FIFO or a socket at each path the library opens (a manifest, a
  shard file, HEAD, a verification record, a reader lease, the owner
  record) and as a child of the root: load, latest, ls, gc, verify, inspect
  and a restore each answer within :data:`ANSWER_S` (refused naming it, or
  skipped with one line); then a job's next save commits.
* ``mis-signed``: a job with an HMAC key saves 1 and 2; step 2's manifest is
  edited (step changed, resealed without the key). Safe: a restart with the
  key is refused on every rank naming step 2 (nothing quarantined, nothing
  loaded), ``latest`` raises naming it. Live: the restart of step 1 (named)
  resumes bit-exact and its next save commits, signed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from .model import Cell, CellResult
from .procs import _context, _free_port, _Proc

#: seconds within which every command must answer beside a FIFO (the issue's bound)
ANSWER_S = 2.0
#: loads of the reader in a ``reader-retention`` cell (``RESHARD_FAULTS_READER_LOADS``)
READER_LOADS = int(os.environ.get("RESHARD_FAULTS_READER_LOADS", "60"))
CLASSES = ("two-jobs", "reader-retention", "gc-full-disk", "fifo", "mis-signed")
FIFO_SPOTS = ("manifest", "data", "HEAD", "verified", "lease", "OWNER", "root-child")


def cells(backend: str) -> list[Cell]:
    """The shared-root cells of ``backend`` ("local" or "s3")."""
    out = []
    for order in ("before-first-save", "after-saves"):
        for mode in ("sync", "async"):
            out.append(Cell("two-jobs", "save", mode, order, "second-job", 0, backend))
    out.append(Cell("reader-retention", "load", "sync", "retention", "reader", 0, backend))
    out.append(Cell("mis-signed", "load", "-", "restore", "edited", 0, backend))
    if backend == "local":
        out.append(Cell("gc-full-disk", "gc", "-", "full", "gc", 0, backend))
        for spot in FIFO_SPOTS:
            for kind in ("fifo", "socket"):
                out.append(Cell("fifo", "read", "-", spot, kind, 0, backend))
    return out


#: the quick matrix's shared-root cells (one of each class, local)
QUICK = ("two-jobs/save-sync/after-saves/second-job/rank0", "reader-retention/load-sync/retention/reader/rank0",
         "gc-full-disk/gc--/full/gc/rank0", "fifo/read--/manifest/fifo/rank0",
         "mis-signed/load--/restore/edited/rank0")


# --------------------------------------------------------------------------- rank side


def _state(step: int, rank: int, world: int) -> dict[str, Any]:
    from .ranks import state

    return state(step, rank, world, 4)


def _target(rank: int, world: int) -> dict[str, Any]:
    from .ranks import target

    return target(rank, world, 4)


def _wait_for(path: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def job_main(cell: Cell, rank: int, world: int, port: int, cdir: str, spec: dict[str, Any]) -> None:
    """One rank of a job of a shared-root cell; ``spec["role"]`` says which."""
    from .ranks import Events, finish, init_group, matches, outcome

    role = spec["role"]
    init_group(cell, rank, world, port, spec, cdir)

    from ..manager.manager import CheckpointManager
    from .ranks import rank_backend

    be = rank_backend(spec["backend"])
    st = be.rank_storage()
    root = spec["root"]
    ev = Events(cdir, rank)
    result: dict[str, Any] = {"role": role}
    err: BaseException | None = None
    out = os.path.join(cdir, f"{role}{rank}.json")
    try:
        if role == "A":  # the owner: saves, lets B try, saves again, closes
            mgr = CheckpointManager(root, keep_last=2, use_async=cell.mode == "async", job_id="job-A",
                                    preempt_signals=(), storage=st, on_save_error=ev.hook)
            first = [1, 2] if cell.phase == "after-saves" else []
            for s in first:
                mgr.save(s, _state(s, rank, world))
            mgr.wait()
            _touch(os.path.join(cdir, f"a-ready{rank}"))
            _wait_for(os.path.join(cdir, "b-done"))
            for s in range(len(first) + 1, len(first) + 3):
                mgr.save(s, _state(s, rank, world))
            mgr.wait()
            result["saved"] = len(first) + 2
            result["next_save"] = "committed"
            mgr.close()
        elif role == "B":  # the second job: refused (its coordinator at construction)
            mgr = CheckpointManager(root, keep_last=1, job_id="job-B", preempt_signals=(), storage=st,
                                    timeout_s=5.0)
            mgr.restore(_target(rank, world), allow_fresh_start=True)  # rank 0 never arrives
            mgr.save(90, _state(90, rank, world))
            result["saved"] = True
        elif role == "B2":  # B again, once A closed: takes the root, resumes, saves
            mgr = CheckpointManager(root, keep_last=2, job_id="job-B", preempt_signals=(), storage=st)
            tgt = _target(rank, world)
            res = mgr.restore(tgt)
            step = None if res is None else res.step
            result["restored"] = step
            result["restored_exact"] = step is not None and matches(tgt, int(step), rank, world, 4)
            mgr.save(50, _state(50, rank, world))
            mgr.close()
            result["next_save"] = "committed"
        elif role == "saver":  # reader-retention: keep_last=1 while the reader loads
            mgr = CheckpointManager(root, keep_last=1, preempt_signals=(), storage=st)
            import torch
            import torch.distributed as dist

            s = 0
            while s < 400:
                done = torch.tensor([int(os.path.exists(os.path.join(cdir, "reader-done")))])
                dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops at the same save
                if done.item():
                    break
                s += 1
                mgr.save(s, _state(s, rank, world))
                time.sleep(0.05)
            result["saved"] = s
            mgr.close()
            result["next_save"] = "committed"
        elif role == "restart":  # gc-full-disk / mis-signed: resume and save once
            mgr = CheckpointManager(root, keep_last=spec.get("keep_last"), preempt_signals=(),
                                    storage=st)
            if spec.get("restore", True):
                tgt = _target(rank, world)
                res = mgr.restore(tgt, step=spec.get("step"))
                step = None if res is None else res.step
                result["restored"] = step
                result["restored_exact"] = step is not None and matches(tgt, int(step), rank, world, 4)
            mgr.save(spec["next"], _state(spec["next"], rank, world))
            mgr.close()
            result["next_save"] = "committed"
        elif role == "setup":  # save steps 1..n (keep all), close
            mgr = CheckpointManager(root, preempt_signals=(), storage=st)
            for s in range(1, spec["n"] + 1):
                mgr.save(s, _state(s, rank, world))
            if spec.get("head"):
                mgr.restore(_target(rank, world))
            mgr.close()
        else:
            raise ValueError(role)
    except BaseException as e:  # noqa: BLE001 - judged by the parent
        err = e
        ev.add("raised", f"{type(e).__name__}: {e}")
        if role in ("B2", "saver", "restart"):
            result["next_save"] = f"{type(e).__name__}: {e}"[:300]
    result["outcome"] = outcome(err)
    finish(result, err, out)


def reader_main(root: str, cdir: str, env: dict[str, str], n: int) -> None:
    """The reader of a ``reader-retention`` cell (a plain process): load
    ``latest`` ``n`` times into fresh targets; count what happened."""
    os.environ.update(env)
    import torch

    import reshard

    from ..storage import resolve
    from .ranks import full

    url = root  # the root as a path or URL (_cli_root)
    st, key = resolve(url)
    counts = {"ok": 0, "gone_before_lease": 0, "failed_after_lease": 0, "partial": 0, "wrong": 0,
              "no_checkpoint": 0}
    examples: list[str] = []
    _touch(os.path.join(cdir, "reader-started"))
    for _ in range(n):
        path = reshard.latest(url)  # a URL (or a local path): load resolves it
        if path is None:
            counts["no_checkpoint"] += 1
            time.sleep(0.02)
            continue
        tgt: dict[str, Any] = {"w": torch.zeros(8, 64), "b": torch.zeros(32), "meta": {"step": 0}}
        try:
            res = reshard.load(tgt, path)
        except reshard.CheckpointNotFoundError as e:
            msg = str(e)
            if "no committed checkpoint here" in msg:
                counts["gone_before_lease"] += 1  # deleted before the lease held it: clean, untouched
            else:
                counts["failed_after_lease"] += 1
                examples.append(msg[:300])
            if any(float(t.abs().sum()) for t in (tgt["w"], tgt["b"])):
                counts["partial"] += 1
            continue
        except reshard.CheckpointError as e:
            counts["failed_after_lease"] += 1
            examples.append(f"{type(e).__name__}: {e}"[:300])
            continue
        f = full(int(res.step or 0), 2, 4)
        if torch.equal(tgt["w"], f["w"]) and torch.equal(tgt["b"], f["b"]):
            counts["ok"] += 1
        else:
            counts["wrong"] += 1
    with open(os.path.join(cdir, "reader.json.tmp"), "w") as fh:
        json.dump({"counts": counts, "examples": examples[:5]}, fh)
    os.replace(os.path.join(cdir, "reader.json.tmp"), os.path.join(cdir, "reader.json"))
    _touch(os.path.join(cdir, "reader-done"))


# --------------------------------------------------------------------------- parent side


def _job(cell: Cell, cdir: str, spec: dict[str, Any], role: str, **extra: Any) -> list[Any]:
    port = _free_port()
    sp = {**spec, "role": role, **extra}
    ctx = _context()
    procs = [_Proc(ctx.Process(target=job_main, args=(cell, r, 2, port, cdir, sp), daemon=True))
             for r in range(2)]
    for p in procs:
        p.p.start()
    return procs


def _join(procs: list[Any], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [p for p in procs if p.alive()]
    for p in alive:
        p.kill()
    return not alive


def _outs(cdir: str, role: str) -> dict[int, dict[str, Any]]:
    out = {}
    for r in range(2):
        f = os.path.join(cdir, f"{role}{r}.json")
        if os.path.exists(f):
            with open(f) as fh:
                out[r] = json.load(fh)
    return out


def _names(st: Any, root: str) -> list[str]:
    try:
        return sorted(st.list_dir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _verify_all(res: CellResult, st: Any, root: str) -> list[str]:
    from ..catalog.verify import verify
    from ..commit.listing import committed

    names = []
    for e in committed(st, root):
        rep = verify(e.path, storage=st)
        if not rep.ok:
            res.problems.append(f"{e.name} is listed as committed but does not verify: {rep.problems[:2]}")
        names.append(e.name)
    return names


def _cli_root(be: Any, root: str) -> str:
    from ..storage import get_scheme

    scheme = get_scheme(be.name)
    return root if scheme.bare_paths else scheme.url(root)


def run(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any]) -> None:
    """Run and judge one shared-root cell (``spec``: backend, env, root).
    ``detect_s``: how long the judged operation took (the refusal, the
    reader's loads, gc, the slowest answer beside a FIFO); ``exit_s``: until
    every process of the cell had exited; ``space_back``: no attempt left
    behind under the root once the jobs ended."""
    fn = {"two-jobs": _two_jobs, "reader-retention": _reader_retention, "gc-full-disk": _gc_full_disk,
          "fifo": _fifo, "mis-signed": _mis_signed}[cell.fault_class]
    t0 = time.time()
    fn(cell, res, be, cdir, spec)
    if res.skipped:
        return
    res.exit_s = time.time() - t0
    if cell.fault_class != "gc-full-disk":  # (its tmpfs is gone: judged inside)
        st = be.storage()
        res.bytes_after, res.stray_bytes = be.usage(st, spec["root"])
        if res.bytes_before is None:
            res.bytes_before = res.bytes_after
        left = be.stray(st, spec["root"], None)
        res.left_behind = left
        res.space_back = "yes" if not left else "NO"
        if left:
            res.liveness.append(f"left behind under the root: {left[:5]}")


def _two_jobs(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any]) -> None:
    st, root = be.storage(), spec["root"]
    a = _job(cell, cdir, spec, "A")
    if not all(_wait_for(os.path.join(cdir, f"a-ready{r}"), 180) for r in range(2)):
        res.problems.append("job A never got ready")
        _join(a, 1)
        return
    before = _names(st, root)
    res.bytes_before = be.usage(st, root)[0]
    t0 = time.time()
    b = _job(cell, cdir, spec, "B")
    b_ok = _join(b, 120)
    res.detect_s = time.time() - t0
    after = _names(st, root)
    _touch(os.path.join(cdir, "b-done"))
    a_ok = _join(a, 180)
    outs_b, outs_a = _outs(cdir, "B"), _outs(cdir, "A")
    for r, p in enumerate(b):
        res.ranks[r] = (f"B: {outs_b[r]['type']}: {outs_b[r]['message'][:120]}" if r in outs_b
                        and outs_b[r]["status"] == "error" else f"B: {outs_b.get(r, {}).get('status', f'exit {p.code}')}")
    if not b_ok:
        res.liveness.append("job B hung beside job A")
    if 0 not in outs_b or outs_b[0].get("type") != "RootOwnedError" or "'job-A'" not in outs_b[0].get("message", ""):
        res.problems.append(f"job B's coordinator was not refused naming job A: {outs_b.get(0)}")
    if any(o.get("saved") for o in outs_b.values()):
        res.problems.append("job B saved beside the live owner")
    for r, o in outs_b.items():
        if o["status"] == "ok" or not o.get("checkpoint_error"):
            res.problems.append(f"job B rank {r} did not fail with a CheckpointError: {o}")
    if after != before:
        res.problems.append(f"job B changed the root: {sorted(set(after) ^ set(before))[:5]}")
    if not a_ok or any(o.get("status") != "ok" for o in outs_a.values()) or len(outs_a) != 2:
        res.problems.append(f"job A did not finish its saves: {outs_a}")
    listed = _verify_all(res, st, root)
    n = max((o.get("saved", 0) for o in outs_a.values()), default=0)
    want = {f"step-{s:08d}" for s in range(max(1, n - 1), n + 1)}
    if set(listed) != want:
        res.problems.append(f"job A's checkpoints: {listed}, its retention (keep_last=2) keeps {sorted(want)}")
    res.next_commits = all(o.get("next_save") == "committed" for o in outs_a.values()) and len(outs_a) == 2
    b2 = _job(cell, cdir, spec, "B2")  # A closed: B restarted takes the root
    _join(b2, 180)
    outs = _outs(cdir, "B2")
    if len(outs) != 2 or not all(o.get("next_save") == "committed" and o.get("restored") == n
                                 and o.get("restored_exact") for o in outs.values()):
        res.liveness.append(f"job B restarted after A closed did not resume A's newest and commit: {outs}")
    from ..catalog.verify import latest

    res.latest = latest(root, storage=st)
    res.previous_loads = not res.problems


def _reader_retention(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any]) -> None:
    st, root = be.storage(), spec["root"]
    saver = _job(cell, cdir, spec, "saver")
    deadline = time.monotonic() + 120
    from ..commit.listing import committed

    while not committed(st, root) and time.monotonic() < deadline:
        time.sleep(0.05)
    env = {**os.environ, **be.env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "OMP_NUM_THREADS": "1"}
    code = ("import sys, json; from reshard.faults.shared import reader_main; "
            "reader_main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))")
    res.bytes_before = be.usage(st, root)[0]
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code, _cli_root(be, root), cdir, json.dumps(be.env), str(READER_LOADS)],
                       capture_output=True, text=True, env=env, timeout=900)
    res.notes.append(f"{READER_LOADS} loads in {time.time() - t0:.1f} s")  # (no fault to detect)
    _touch(os.path.join(cdir, "reader-done"))
    ok = _join(saver, 180)
    if r.returncode != 0 or not os.path.exists(os.path.join(cdir, "reader.json")):
        res.problems.append(f"the reader crashed: {r.stderr[-500:]}")
        return
    with open(os.path.join(cdir, "reader.json")) as fh:
        got = json.load(fh)
    c = got["counts"]
    res.notes.append(f"reader: {c}")
    if c["failed_after_lease"] or c["partial"] or c["wrong"]:
        res.problems.append(f"reader failures beside retention: {c}; e.g. {got['examples'][:2]}")
    if c["ok"] < READER_LOADS // 2:
        res.liveness.append(f"the reader loaded only {c['ok']} of {READER_LOADS}")
    outs = _outs(cdir, "saver")
    res.next_commits = ok and len(outs) == 2 and all(o.get("next_save") == "committed" for o in outs.values())
    res.ranks = {r: f"saver: {o.get('status')} ({o.get('saved')} saves)" for r, o in outs.items()}
    listed = _verify_all(res, st, root)
    leases = [n for n in _names(st, root) if ".lease-" in n]
    if len(listed) != 1 or leases:
        res.liveness.append(f"after the reader: {listed} committed, leases left {leases[:3]} "
                            "(keep_last=1 and every lease released)")
    from ..catalog.verify import latest

    res.latest = latest(root, storage=st)
    res.previous_loads = not res.problems


def _gc_full_disk(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any]) -> None:
    from .jobs import mount_tmpfs, umount
    from .ranks import fill

    disk = os.path.join(cdir, "disk")
    why = mount_tmpfs(disk, "6m")
    if why is not None:
        res.skipped = why
        return
    try:
        root = os.path.join(disk, "root")
        spec = {**spec, "root": root, "rows": 2048}
        st = be.storage()
        setup = _job(cell, cdir, spec, "setup", n=4)
        _join(setup, 180)
        fill(disk, leave=0)
        stv = os.statvfs(disk)
        free0 = stv.f_bavail * stv.f_frsize
        res.bytes_before = be.usage(st, root)[0]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "reshard.cli", "gc", root, "--keep-last", "2",
                            "--grace", "0"], capture_output=True, text=True, env=env, timeout=300)
        res.notes.append(f"gc took {time.time() - t0:.1f} s")
        stv = os.statvfs(disk)
        free1 = stv.f_bavail * stv.f_frsize
        res.bytes_after, res.stray_bytes = be.usage(st, root)
        res.notes.append(f"bytes free before gc {free0}, after {free1}")
        res.notes.append(f"gc exit {r.returncode}: " + " | ".join(r.stdout.splitlines()[:4]))
        if r.returncode != 0 or not free1:
            res.problems.append(f"gc at 0 bytes free failed: exit {r.returncode}: {r.stdout[-300:]} {r.stderr[-300:]}")
        listed = _verify_all(res, st, root)
        if listed != ["step-00000003", "step-00000004"]:
            res.problems.append(f"after gc --keep-last 2: {listed}")
        fill(disk, leave=0)  # full again: a job saving there (keep_last=1) frees before it writes
        rs = _job(cell, cdir, spec, "restart", keep_last=1, next=5, restore=False)
        _join(rs, 180)
        outs = _outs(cdir, "restart")
        res.next_commits = len(outs) == 2 and all(o.get("next_save") == "committed" for o in outs.values())
        if not res.next_commits:
            res.liveness.append(f"a job saving on the full disk did not commit: {outs}")
        listed = _verify_all(res, st, root)
        if listed != ["step-00000005"]:
            res.problems.append(f"after the save with keep_last=1: {listed}")
        res.space_back = "yes" if free1 else "NO"
        from ..catalog.verify import latest

        res.latest = latest(root, storage=st)
        res.previous_loads = not res.problems
    finally:
        umount(disk)


def timed_call(fn: Any, limit_s: float = 30.0) -> tuple[float, BaseException | None, Any]:
    """Run ``fn`` on a daemon thread: (seconds, its exception, its result);
    a call still blocked after ``limit_s`` seconds counts as ``limit_s`` (it
    hangs; the thread is left)."""
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["e"] = e

    t = threading.Thread(target=go, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit_s)
    return time.monotonic() - t0, out.get("e"), out.get("r")


def _fifo(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any]) -> None:
    import reshard

    from ..commit.listing import committed, scan
    from ..manager.manager import CheckpointManager

    st, root = be.storage(), spec["root"]
    setup = _job(cell, cdir, spec, "setup", n=2, head=True)
    _join(setup, 180)
    ck = os.path.join(root, "step-00000002")
    data = next(n for n in os.listdir(ck) if n.startswith("data-"))
    target = {"manifest": os.path.join(ck, "manifest.json"), "data": os.path.join(ck, data),
              "HEAD": os.path.join(root, "HEAD"), "verified": os.path.join(root, "step-00000002.verified.json"),
              "lease": os.path.join(root, "step-00000002.lease-1-deadbeef.json"),
              "OWNER": os.path.join(root, "OWNER"), "root-child": os.path.join(root, "a-pipe")}[cell.phase]
    if os.path.lexists(target):
        os.unlink(target)
    keep = None
    if cell.action == "fifo":
        os.mkfifo(target)
    else:
        keep = bind_socket(target)
    res.bytes_before = be.usage(st, root)[0]
    from .ranks import target as tgt

    def load() -> Any:
        t = tgt(0, 1, 8)
        return reshard.load(t, ck, storage=st)

    def gc() -> Any:  # what `reshard gc --keep-last 2 --grace 0` runs (the CLI itself: tests/commit/test_shared_root.py)
        m = CheckpointManager(root, keep_last=2, writer=False, gc_grace_s=0.0, preempt_signals=(), storage=st)
        m.apply_retention(smoke_newer=True)
        return m.gc_abandoned()

    calls = {"load": load, "latest": lambda: reshard.latest(root, storage=st),
             "verify": lambda: reshard.verify(ck, storage=st), "inspect": lambda: reshard.inspect(ck, storage=st),
             "ls": lambda: (scan(st, root), committed(st, root)), "gc": gc}
    slowest = 0.0
    for name, fn in calls.items():
        secs, err, out = timed_call(fn)
        slowest = max(slowest, secs)
        what = "ok" if err is None else f"{type(err).__name__}"
        res.ranks[len(res.ranks)] = f"{name}: {what} in {secs:.2f} s"
        if secs > ANSWER_S:
            res.liveness.append(f"{name} took {secs:.1f} s beside a {cell.action} at {cell.phase}")
        if err is not None and not isinstance(err, reshard.CheckpointError):
            res.problems.append(f"{name} raised {type(err).__name__}, not a CheckpointError: {err}")
    res.detect_s = slowest
    if keep is not None:
        keep.close()
    # the job goes on: its next save commits (beside the FIFO, or once a person removed it)
    if cell.phase in ("manifest", "data"):
        listed = [e.name for e in committed(st, root)]
        if "step-00000002" in listed and cell.phase == "manifest":
            res.problems.append("a checkpoint whose manifest is a FIFO is listed as committed")
    os.unlink(target)
    rs = _job(cell, cdir, spec, "restart", next=3, step=1)
    _join(rs, 180)
    outs = _outs(cdir, "restart")
    res.next_commits = len(outs) == 2 and all(o.get("next_save") == "committed" for o in outs.values())
    if not res.next_commits:
        res.liveness.append(f"the next save did not commit: {outs}")
    res.latest = reshard.latest(root, storage=st)
    res.previous_loads = bool(outs) and all(o.get("restored_exact") for o in outs.values())


def _mis_signed(cell: Cell, res: CellResult, be: Any, cdir: str, spec: dict[str, Any]) -> None:
    from ..catalog.verify import latest
    from ..errors import IntegrityError
    from ..ondisk.manifest import reseal

    key_file = os.path.join(cdir, "key")
    with open(key_file, "w") as kf:
        kf.write("fault-matrix-key\n")
    spec = {**spec, "env": {**spec.get("env", {}), "RESHARD_HMAC_KEY_FILE": key_file}}
    st, root = be.storage(), spec["root"]
    setup = _job(cell, cdir, spec, "setup", n=2)
    _join(setup, 180)
    mp = st.join(st.join(root, "step-00000002"), "manifest.json")
    doc = json.loads(st.read_bytes(mp))
    doc["step"] = 7
    st.write_bytes(mp, reseal(json.dumps(doc).encode()))
    res.bytes_before = be.usage(st, root)[0]
    os.environ["RESHARD_HMAC_KEY_FILE"] = key_file
    try:
        try:
            got = latest(root, storage=st)
            res.problems.append(f"latest returned {got} with a key configured")
        except IntegrityError as e:
            if "step-00000002" not in str(e):
                res.problems.append(f"latest's error does not name step 2: {e}")
        t0 = time.time()
        rs = _job(cell, cdir, spec, "restart", next=3)
        _join(rs, 180)
        res.detect_s = time.time() - t0
        outs = _outs(cdir, "restart")
        for r, o in outs.items():
            res.ranks[r] = f"{o.get('type', o.get('status'))}: {o.get('message', '')[:120]}"
            if o.get("status") == "ok" or "does not verify" not in o.get("message", "") or "step-00000002" not in o.get("message", ""):
                res.problems.append(f"rank {r} of the restart was not refused naming step 2: {o}")
        if any("quarantined" in n for n in _names(st, root)):
            res.problems.append("a checkpoint was quarantined for a signature")
        for f in ("restart0.json", "restart1.json"):
            os.unlink(os.path.join(cdir, f))
        rs = _job(cell, cdir, spec, "restart", next=3, step=1)
        _join(rs, 180)
        outs = _outs(cdir, "restart")
        res.next_commits = len(outs) == 2 and all(o.get("next_save") == "committed" for o in outs.values())
        res.previous_loads = bool(outs) and all(o.get("restored_exact") for o in outs.values())
        if not res.next_commits:
            res.liveness.append(f"the restart of step 1 did not commit: {outs}")
        from ..catalog.verify import inspect

        if "hmac_sha256" not in inspect(st.join(root, "step-00000003"), storage=st).extra:
            res.problems.append("the next save is not signed")
        res.latest = st.join(root, "step-00000003")
    finally:
        os.environ.pop("RESHARD_HMAC_KEY_FILE", None)


def bind_socket(path: str) -> Any:
    """A listening Unix socket at ``path`` (bound at a short temporary path,
    then renamed into place: AF_UNIX paths are short)."""
    import socket
    import tempfile

    short = os.path.join(tempfile.mkdtemp(prefix="rs-"), "s")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(short)
    os.rename(short, path)
    os.rmdir(os.path.dirname(short))
    return s


def cleanup(cdir: str) -> None:
    shutil.rmtree(cdir, ignore_errors=True)
