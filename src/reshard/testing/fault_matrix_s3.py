"""The S3 rows of the fault matrix: the same faults, on a real S3 endpoint.

One moto server (``reshard.testing.s3server``) runs per matrix run on
127.0.0.1, behind the fault-injecting HTTP proxy
(``reshard.testing.s3proxy``); every cell gets its own prefix in one bucket
and two real gloo ranks talking to the proxy. As in
:mod:`reshard.testing.fault_matrix` each cell commits step 1 through a
:class:`~reshard.CheckpointManager`, then meets its fault saving (sync or
async) or loading:

* ``storage-error``: ``ENOSPC`` / ``EIO`` / a timeout from
  :class:`~reshard.testing.faults.FaultStorage` around the S3 store, at a
  data write, at the completion of a data object's upload, at the
  conditional put of the manifest; and a read error during a load;
* ``s3-http`` (from the proxy, so the client meets real HTTP answers): a
  persistent 500 on a part upload, 503 SlowDown on the manifest put, a
  connection reset on every data PUT, a LIST answering 500; the transient
  variants (a few 503s, two resets) must be retried into a commit, and a
  GET body cut off mid-stream during a load;
* ``truncated-body``: the proxy forwards only half of a request body (a data
  object, the manifest): the save must fail rather than publish it;
* ``sigkill-save`` at each phase (stage, plan, right after the lease,
  mid-data on either rank, with a multipart upload open, before the
  manifest's put, after it, before and in the middle of retention deletes),
  ``sigkill-load``, ``lost-rank`` (save and load);
* ``integrity``: committed objects truncated, bit-flipped, missing, extra,
  the manifest missing, truncated, corrupted or from another attempt, a data
  object from another attempt.

Judged as locally (see :mod:`reshard.testing.fault_matrix`: every survivor
of a killed or stalled rank names it as lost), with the S3
form of "no stray attempt": once the job has ended, the killed job's lease
has expired (``RESHARD_LEASE_TTL_S`` is a few seconds here) and ``gc`` ran,
no key of an attempt that no manifest names, no lease and no open
multipart upload is left; and before ``gc``, every such attempt is listed
as abandoned by :func:`reshard.commit.scan` (what ``reshard ls`` shows). A
committed checkpoint whose manifest was broken after its commit is no
attempt: it is listed as invalid and kept for a person, as locally.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import timedelta
from typing import Any

from .fault_matrix import (
    INTEGRITY,
    PG_TIMEOUT_S,
    WORLD,
    Cell,
    CellResult,
    _context,
    _finish_rank,
    _free_port,
    _KillOnStateDict,
    named_lost,
    rank_outcomes,
    stop_ranks,
)

BUCKET = "reshard-faults"
ROWS = 48  # rows of ``w`` per rank: 12 KiB of float32, two 8 KiB parts
COLS = 64
PART_BYTES = 8 << 10
LEASE_TTL_S = 3.0
DEADLINE_S = 2.0

#: proxy cells: action -> (fault class, must the operation fail)
_HTTP = {"http500": True, "slowdown": True, "reset": True, "list500": True, "lost-answer": False,
         "slowdown-transient": False, "reset-transient": False}


def cells(*, quick: bool = False) -> list[Cell]:
    """Every S3 cell (``quick``: one per fault class: its first, or ``_QUICK``'s)."""
    b = "s3"
    out: list[Cell] = []
    for mode in ("sync", "async"):
        for action in ("enospc", "eio", "timeout"):
            for phase, rank in (("data", 1), ("data-durable", 1), ("manifest", 0)):
                out.append(Cell("storage-error", "save", mode, phase, action, rank, b))
        for action in _HTTP:
            phase = {"slowdown": "manifest", "list500": "plan", "lost-answer": "publish"}.get(action, "data")
            out.append(Cell("s3-http", "save", mode, phase, action, 0 if phase != "data" else 1, b))
        for phase, rank in (("data", 1), ("manifest", 0)):
            out.append(Cell("truncated-body", "save", mode, phase, "truncate_body", rank, b))
        for phase, rank in (("stage", 1), ("plan", 0), ("lease", 0), ("data", 1), ("data", 0),
                            ("data-durable", 1), ("manifest", 0), ("publish-after", 0),
                            ("retention", 0), ("retention-mid", 0)):
            out.append(Cell("sigkill-save", "save", mode, phase, "kill", rank, b))
        out.append(Cell("lost-rank", "save", mode, "data", "delay", 1, b))
    out.append(Cell("sigkill-load", "load", "-", "read", "kill", 1, b))
    out.append(Cell("lost-rank", "load", "-", "read", "delay", 1, b))
    out.append(Cell("storage-error", "load", "-", "read", "eio", 1, b))
    out.append(Cell("s3-http", "load", "-", "read", "reset_mid", 1, b))
    out.append(Cell("s3-http", "load", "-", "read", "reset_mid-transient", 1, b))
    for kind in INTEGRITY:
        out.append(Cell("integrity", "integrity", "-", kind, "-", 0, b))
    if quick:
        q: dict[str, Cell] = {}
        for c in out:
            if c.fault_class not in q or c.name == _QUICK.get(c.fault_class):
                q[c.fault_class] = c
        return list(q.values())
    return out


#: the quick matrix's cell of a class where it is not the class's first: a kill
#: with a multipart upload open (the one fault that leaves an upload to abort)
_QUICK = {"sigkill-save": "sigkill-save/save-sync/data-durable/kill/rank1"}


def _must_fail(cell: Cell) -> bool:
    if cell.fault_class in ("storage-error", "sigkill-load", "lost-rank", "truncated-body"):
        return True
    if cell.fault_class == "sigkill-save":
        return cell.phase not in ("publish-after", "retention", "retention-mid")
    if cell.fault_class == "s3-http":
        return _HTTP.get(cell.action, not cell.action.endswith("-transient"))
    return False


def _must_commit(cell: Cell) -> bool:
    """A transient fault: retried, every rank succeeds, step 2 is committed."""
    return cell.fault_class == "s3-http" and cell.op == "save" and cell.action.endswith("-transient")


# --------------------------------------------------------------------------- rank side


def _full(step: int, world: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(2000 + step)
    return {"w": torch.randn(ROWS * world, COLS, generator=g), "b": torch.randn(32, generator=g)}


def _state(step: int, rank: int, world: int, *, kill: bool = False) -> dict[str, Any]:
    from ..sharding import ShardedTensor

    full = _full(step, world)
    st: dict[str, Any] = {
        "w": ShardedTensor("w", full["w"][rank * ROWS:(rank + 1) * ROWS].clone(),
                           global_shape=tuple(full["w"].shape), global_offset=(rank * ROWS, 0)),
        "b": full["b"].clone(), "meta": {"step": step}}
    if kill:
        st["killer"] = _KillOnStateDict()
    return st


def _target(rank: int, world: int) -> dict[str, Any]:
    import torch

    from ..sharding import ShardedTensor

    return {"w": ShardedTensor("w", torch.zeros(ROWS, COLS), global_shape=(ROWS * world, COLS),
                               global_offset=(rank * ROWS, 0)),
            "b": torch.zeros(32), "meta": {"step": 0}}


_DATA = "att-*.data-*"


def _faults_for(cell: Cell, rank: int) -> list[Any]:
    """FaultStorage faults of ``rank`` (proxy faults are armed by the parent)."""
    from .faults import Fault

    if (rank != cell.rank or cell.op == "integrity" or cell.phase == "stage"
            or cell.fault_class in ("s3-http", "truncated-body")):
        return []
    ph, a = cell.phase, cell.action
    if ph == "read":
        if a == "delay":
            return [Fault(op="read", match=_DATA, action="delay", delay_s=PG_TIMEOUT_S * 20)]
        return [Fault(op="read", match=_DATA, action=a)]
    if ph == "plan":  # the coordinator checks the target before the plan is gathered
        return [Fault(op="exists", match="manifest.json", action="kill")]
    if ph == "lease":  # the lease is written: the attempt exists, no data yet
        return [Fault(op="write_bytes", match="att-*.lease.json", action="kill", after=True)]
    if ph == "publish-after":
        return [Fault(op="put_if_absent", match="manifest.json", action="kill", after=True)]
    if ph == "retention":  # before the first delete of step 1 (its manifest goes first)
        return [Fault(op="delete", match="manifest.json", action="kill")]
    if ph == "retention-mid":  # step 1's manifest deleted, then one of its data objects
        def half_delete(op: str, path: str) -> None:
            from ..storage.s3 import S3Storage

            inner = S3Storage()
            data = sorted(k for k in inner._keys(path.rstrip("/") + "/") if ".data-" in k)[:1]
            inner.delete_keys(data)
            os.kill(os.getpid(), signal.SIGKILL)

        # "step-????????": the checkpoint's prefix, not its verification record (deleted first)
        return [Fault(op="delete", match="step-????????", action="call", callback=half_delete)]
    if a == "delay":
        return [Fault(op="write", match=_DATA, action="delay", delay_s=PG_TIMEOUT_S * 20)]
    if ph == "data" and a == "kill":  # mid-data: after the first write of a shard object
        return [Fault(op="write", match=_DATA, action="kill", after=True)]
    if ph == "data":
        return [Fault(op="write", match=_DATA, action=a)]
    if ph == "data-durable":  # before the object's upload completes (a multipart upload is open)
        return [Fault(op="fsync", match=_DATA, action=a)]
    if ph == "manifest":
        return [Fault(op="put_if_absent", match="manifest.json", action=a)]
    raise ValueError(f"no S3 fault for {cell.name}")


def _rank_main(cell: Cell, rank: int, world: int, port: int, cdir: str, env: dict[str, str],
               root: str) -> None:
    """One rank of a cell (a child process); ``root``: ``bucket/prefix``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import reshard

    from ..manager import CheckpointManager
    from ..storage.s3 import S3Storage
    from .faults import FaultStorage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    out = os.path.join(cdir, f"rank{rank}.json")
    result: dict[str, Any] = {}
    st = S3Storage()
    keep_last = 1 if cell.phase.startswith("retention") else None
    mgr = CheckpointManager(root, keep_last=keep_last, use_async=cell.mode == "async",
                            preempt_signals=(), gc_grace_s=0.0, storage=st)
    mgr.save(1, _state(1, rank, world), sync=True)
    if cell.op == "integrity":
        mgr.save(2, _state(2, rank, world), sync=True)
        other = st.join(root + "-other", "step-00000002")
        reshard.save(_state(3, rank, world), other, step=2, storage=st)  # same layout, another attempt
        dist.barrier()
        if rank == 0:
            _corrupt(st, cell.phase, mgr.path_for(2), other)
        dist.barrier()
    else:
        dist.barrier()
    with open(os.path.join(cdir, f"ready{rank}"), "w"):
        pass  # the parent arms the proxy's faults once every rank is here
    while not os.path.exists(os.path.join(cdir, "armed")):
        time.sleep(0.02)
    dist.barrier()
    fs = FaultStorage(st, _faults_for(cell, rank))
    err: BaseException | None = None
    try:
        if cell.op == "save":
            m2 = CheckpointManager(root, keep_last=keep_last, use_async=cell.mode == "async",
                                   preempt_signals=(), gc_grace_s=0.0, storage=fs)
            m2.save(2, _state(2, rank, world, kill=cell.phase == "stage" and rank == cell.rank))
            m2.wait()
        else:
            path = reshard.latest(root, storage=st) if cell.op == "integrity" else mgr.path_for(1)
            result["loaded"] = path
            assert path is not None, "no committed checkpoint to load"
            tgt = _target(rank, world)
            reshard.load(tgt, path, storage=fs)
            step = 2 if path == mgr.path_for(2) else 1
            full = _full(step, world)
            if not torch.equal(tgt["b"], full["b"]) or not torch.equal(
                    tgt["w"].data, full["w"][rank * ROWS:(rank + 1) * ROWS]):
                result["wrong_data"] = True
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        err = e
    _finish_rank(result, err, out)


def _corrupt(st: Any, kind: str, ckpt: str, other: str) -> None:
    """Corrupt the committed checkpoint ``ckpt`` (keys) the way ``kind`` says."""
    names = st.list_dir(ckpt)
    data = sorted(n for n in names if ".data-" in n)
    man = st.join(ckpt, "manifest.json")
    f0 = st.join(ckpt, data[0])
    if kind in ("truncated-shard", "flipped-shard", "truncated-manifest", "corrupted-manifest"):
        target = f0 if kind.endswith("shard") else man
        raw = bytearray(st.read_bytes(target))
        if kind == "truncated-shard":
            raw = raw[:-7]
        elif kind == "flipped-shard":
            raw[-5] ^= 0x10
        elif kind == "truncated-manifest":
            raw = raw[: len(raw) // 2]
        else:
            raw[10:19] = b"\x00garbage\xff"
        st.write_bytes(target, bytes(raw))
    elif kind == "missing-manifest":
        st.delete_keys([man])
    elif kind == "other-attempt-manifest":
        st.write_bytes(man, st.read_bytes(st.join(other, "manifest.json")))
    elif kind == "other-attempt-shard":
        od = sorted(n for n in st.list_dir(other) if ".data-" in n)
        st.write_bytes(f0, st.read_bytes(st.join(other, od[0])))
    elif kind == "missing-file":
        st.delete_keys([f0])
    elif kind == "extra-file":  # what a stray attempt's object looks like
        st.write_bytes(st.join(ckpt, "att-20990101T000000-0badc0de.data-r00099-0.safetensors"), b"junk")
    else:
        raise ValueError(kind)


# --------------------------------------------------------------------------- parent side


class Endpoint:
    """An S3 server on 127.0.0.1 behind the fault proxy, one bucket, one
    prefix per cell (shared by the cells of one matrix run): moto's, or
    s3rver's (``server="s3rver"``; it ignores conditional requests, so the
    cells, each one writer, run with ``RESHARD_S3_TRUST_CONDITIONAL=1``: the
    refusal itself is tested on its own)."""

    def __init__(self, server: str = "moto") -> None:
        from .s3proxy import FaultProxy
        from .s3server import S3rverServer, S3Server

        if server not in ("moto", "s3rver"):
            raise ValueError(f"unknown S3 server {server!r} (moto, s3rver)")
        self.name = server
        self.server: Any = S3Server(min_part_bytes=4 << 10) if server == "moto" else S3rverServer()
        self.proxy = FaultProxy(self.server.url)
        self.server.create_bucket(BUCKET)
        self.env = {**self.server.env(self.proxy.url), "RESHARD_S3_PART_BYTES": str(PART_BYTES),
                    "RESHARD_S3_RANGE_BYTES": str(PART_BYTES), "RESHARD_S3_DEADLINE_S": str(DEADLINE_S),
                    "RESHARD_LEASE_TTL_S": str(LEASE_TTL_S)}
        if server == "s3rver":
            self.env["RESHARD_S3_TRUST_CONDITIONAL"] = "1"
        self.n = 0

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


def _proxy_faults(cell: Cell, root: str) -> list[Any]:
    """The proxy's rules of a cell (paths are ``/bucket/key``)."""
    from .s3proxy import Fault

    step2 = re.escape(f"/{root}/step-00000002/")
    data_r = rf"{step2}att-[^/]*\.data-r0000{cell.rank}-"
    step1_r = re.escape(f"/{root}/step-00000001/") + rf"att-[^/]*\.data-r0000{cell.rank}-"
    a = cell.action
    if cell.fault_class == "truncated-body":
        path = data_r if cell.phase == "data" else step2 + "manifest\\.json"
        return [Fault(method="PUT", path=path, action="truncate_body")]
    if cell.fault_class != "s3-http":
        return []
    if a == "http500":
        return [Fault(method="PUT", path=data_r, query="partNumber=2", status=500, code="InternalError")]
    if a == "slowdown":
        return [Fault(method="PUT", path=step2 + "manifest\\.json", status=503, code="SlowDown")]
    if a == "reset":
        return [Fault(method="PUT", path=data_r, action="reset")]
    if a == "list500":  # every LIST of the root while the save of step 2 chooses its name
        return [Fault(method="GET", path=re.escape(f"/{BUCKET}") + "/?$",
                      query="list-type=2.*" + re.escape(root.split("/", 1)[1].replace("/", "%2F")),
                      status=500, code="InternalError")]
    if a == "lost-answer":  # the manifest lands, the answer is lost, and it cannot be read back
        return [Fault(method="PUT", path=step2 + "manifest\\.json", action="reset_after"),
                Fault(method="GET", path=step2 + "manifest\\.json", status=500, code="InternalError")]
    if a == "slowdown-transient":
        return [Fault(method="PUT", path=step2, status=503, code="SlowDown", times=3)]
    if a == "reset-transient":
        return [Fault(method="PUT", path=data_r, action="reset", times=2)]
    if a == "reset_mid":  # every ranged GET of rank 1's object cut off mid-body
        return [Fault(method="GET", path=step1_r, query="^$", action="reset_mid")]
    if a == "reset_mid-transient":
        return [Fault(method="GET", path=step1_r, query="^$", action="reset_mid", times=2)]
    raise ValueError(f"no proxy fault for {cell.name}")


def run_cell(cell: Cell, workdir: str, ep: Endpoint, *, world: int = WORLD) -> CellResult:
    """Run one S3 cell (rank outcomes in ``workdir``, objects under a fresh
    prefix of ``ep``'s bucket) and judge it."""
    t0 = time.perf_counter()
    ep.n += 1
    cdir = os.path.join(workdir, cell.name.replace("/", "_"))
    os.makedirs(cdir, exist_ok=True)
    for n in os.listdir(cdir):
        os.unlink(os.path.join(cdir, n))
    root = f"{BUCKET}/cells/{ep.n:03d}-{re.sub('[^A-Za-z0-9]+', '-', cell.name)}"
    ep.proxy.clear()
    ep.proxy.reset_stats()
    ctx = _context()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(cell, r, world, port, cdir, ep.env, root), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    hang = cell.action == "delay"
    deadline = time.monotonic() + PG_TIMEOUT_S * 6 + 60
    res = CellResult(cell)
    armed = False
    rules = _proxy_faults(cell, root)
    while time.monotonic() < deadline:
        if not armed and all(os.path.exists(os.path.join(cdir, f"ready{r}")) for r in range(world)):
            for f in rules:
                ep.proxy.add(f)
            with open(os.path.join(cdir, "armed"), "w"):
                pass
            armed = True
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if not alive:
            break
        if hang and alive == [cell.rank] and all(
                os.path.exists(os.path.join(cdir, f"rank{r}.json")) for r in range(world) if r != cell.rank):
            break  # every other rank has given up on the stalled one: the job ends
        time.sleep(0.05)
    stop_ranks(cell, res, procs, hang)
    ep.proxy.clear()  # the judge talks to the store without faults
    outs = rank_outcomes(res, procs, cdir)
    if not armed:
        res.problems.append("the ranks never reached the fault (step 1 failed?)")
    elif rules and not any(f.fired for f in rules):
        res.problems.append("the proxy's fault never fired (the cell tested nothing)")
    old = {k: os.environ.get(k) for k in ep.env}
    os.environ.update(ep.env)
    try:
        _judge(cell, res, outs, procs, root, world)
    except Exception as e:  # noqa: BLE001 - a judge that cannot look is an unsafe cell
        res.problems.append(f"judging failed: {type(e).__name__}: {e}")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res.seconds = time.perf_counter() - t0
    return res


def _stray(st: Any, root: str) -> tuple[list[str], list[str], list[str]]:
    """``(attempts no manifest names, their keys, open uploads)`` below ``root``
    (``<checkpoint>/<attempt id>`` names; keys and uploads as ``<checkpoint>/<name>``)."""
    from ..attempts import LEASE_SUFFIX, attempt_of
    from ..commit import read_manifest
    from ..errors import CheckpointError, CheckpointNotFoundError

    ids: list[str] = []
    keys: list[str] = []
    uploads: list[str] = []
    try:
        children = st.list_dir(root)
    except FileNotFoundError:
        return ids, keys, uploads
    for child in children:
        path = st.join(root, child)
        try:
            names = st.list_dir(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            m = read_manifest(st, path)
            used = {m.attempt_id} | {a for a in map(attempt_of, m.files) if a}
        except CheckpointNotFoundError:
            used = set()
        except CheckpointError:
            continue  # a committed checkpoint whose manifest broke: invalid, kept for a person
        for n in names:
            a = attempt_of(n)
            if a is not None and (a not in used or n.endswith(LEASE_SUFFIX)):
                keys.append(f"{child}/{n}")
                if a not in used and f"{child}/{a}" not in ids:
                    ids.append(f"{child}/{a}")
        uploads += [f"{child}/{st.basename(k)}" for k, _, _ in st.list_uploads(path + "/")]
    return ids, keys, uploads


def _wait_leases(st: Any, root: str) -> None:
    """Sleep until every lease below ``root`` has expired (a killed job's
    lease lapses after ``LEASE_TTL_S``; none is renewed once the job ended)."""
    from ..attempts import LEASE_SUFFIX

    latest = 0.0
    for child in st.list_dir(root) if st.exists(root) else ():
        try:
            names = st.list_dir(st.join(root, child))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            if n.endswith(LEASE_SUFFIX):
                try:
                    latest = max(latest, float(json.loads(st.read_bytes(st.join(root, child, n)))["expires"]))
                except (FileNotFoundError, ValueError, KeyError):
                    pass
    wait = min(latest - time.time(), LEASE_TTL_S + 1.0)
    if wait > 0:
        time.sleep(wait + 0.1)


def _judge(cell: Cell, res: CellResult, outs: dict[int, dict[str, Any]], procs: list[Any],
           root: str, world: int) -> None:
    import torch

    import reshard

    from ..commit import committed, scan
    from ..manager import CheckpointManager
    from ..storage.s3 import S3Storage
    from ..verify import verify

    st = S3Storage()
    p1, p2 = st.join(root, "step-00000001"), st.join(root, "step-00000002")
    for r, p in enumerate(procs):
        o = outs.get(r)
        if o is None:
            if not (cell.action in ("kill", "delay") and r == cell.rank):
                res.problems.append(f"rank {r} died without an outcome (exit {p.exitcode})")
            continue
        if o.get("wrong_data"):
            res.problems.append(f"rank {r} loaded wrong data without an error")
        if o["status"] == "error" and not o["checkpoint_error"]:
            res.problems.append(f"rank {r} raised {o['type']}, not a CheckpointError: {o['message'][:200]}")
    if _must_fail(cell):
        for r, o in outs.items():
            if o["status"] == "ok":
                res.problems.append(f"rank {r} reported success although the {cell.op} met "
                                    f"{cell.action} at {cell.phase}")
    if cell.action in ("kill", "delay"):  # every survivor's error names the lost rank
        for r, o in outs.items():
            if r != cell.rank and o["status"] == "error" and cell.rank not in named_lost(o["message"]):
                res.problems.append(f"rank {r}'s error does not name the lost rank {cell.rank}: "
                                    f"{o['message'][:300]}")
    listed = [e.path for e in committed(st, root)]
    res.latest = reshard.latest(root, storage=st)
    good = []
    for path in listed:
        rep = verify(path, storage=st)
        if rep.ok:
            good.append(path)
        elif cell.op == "integrity" and path == p2 and outs and (res.latest != p2 or all(
                o["status"] == "error" and o["checkpoint_error"] for o in outs.values())):
            pass  # corrupted after its commit; latest skips it, or every rank's load refused it
        else:
            res.problems.append(f"{st.basename(path)} is listed as committed but does not verify: "
                                f"{rep.problems[:2]}")
    newest_good = good[-1] if good else None
    if cell.op != "integrity" and res.latest != newest_good:
        res.problems.append(f"latest is {res.latest}, the newest good checkpoint is {newest_good}")
    if cell.op == "integrity" and res.latest not in (p1, p2):
        res.problems.append(f"latest is {res.latest}")
    if _must_commit(cell) and (res.latest != p2 or any(o["status"] != "ok" for o in outs.values())):
        res.problems.append(f"a transient {cell.action} was not retried into a commit "
                            f"(latest {res.latest})")
    must_load = p2 if cell.phase.startswith("retention") or _must_commit(cell) else p1
    full = _full(2 if must_load == p2 else 1, world)
    tgt: dict[str, Any] = {"w": torch.zeros_like(full["w"]), "b": torch.zeros_like(full["b"]),
                           "meta": {"step": 0}}
    try:
        reshard.load(tgt, must_load, storage=st)
        res.previous_loads = all(torch.equal(tgt[k], full[k]) for k in ("w", "b"))
        if not res.previous_loads:
            res.problems.append(f"{st.basename(must_load)} loads, but not bit-exact")
    except Exception as e:  # noqa: BLE001
        res.problems.append(f"{st.basename(must_load)} no longer loads: {type(e).__name__}: {e}")
    ids, keys, uploads = _stray(st, root)
    res.left_behind = ids + [f"upload {u}" for u in uploads]
    listed_abandoned = {e.name for e in scan(st, root) if e.abandoned}
    unlisted = [a for a in ids if a not in listed_abandoned]
    if unlisted:
        res.problems.append(f"attempts left behind but not listed as abandoned (reshard ls): {unlisted}")
    _wait_leases(st, root)
    CheckpointManager(root, storage=st, preempt_signals=()).gc_abandoned(grace_s=0.0)
    ids, keys, uploads = _stray(st, root)
    res.after_gc = keys + [f"upload {u}" for u in uploads]
    if res.after_gc:
        res.problems.append(f"gc left {res.after_gc[:6]}")


def run_matrix(chosen: list[Cell], *, workdir: str, progress: Any = None,
               server: str = "moto") -> list[CellResult]:
    """Run the S3 cells of ``chosen`` on one S3 server started here (moto's,
    or ``"s3rver"``)."""
    os.makedirs(workdir, exist_ok=True)
    ep = Endpoint(server)
    out = []
    try:
        for c in chosen:
            r = run_cell(c, workdir, ep)
            out.append(r)
            if progress is not None:
                progress(r)
    finally:
        ep.close()
    return out
