"""The fault matrix: every fault x phase x mode, run on real gloo ranks.

Each :class:`Cell` starts ``world`` real processes (``multiprocessing``
forkserver with torch preloaded, a fresh gloo group per cell) that first commit
a good checkpoint (step 1) through a :class:`~reshard.CheckpointManager`, then
meet the fault while saving (sync or async) or loading step 2:

* storage errors (``ENOSPC``, ``EIO``, ``EDQUOT``, a timeout) at a phase of one
  rank, silent corruption after a write (truncate, flip a byte);
* process faults: SIGKILL of one rank at each phase of a save (stage, plan,
  mid-data, after data before the manifest, before / after the publishing
  rename, before / in the middle of retention deletes), SIGKILL of one rank
  during a load, a rank that never arrives (stalled past the group timeout);
* integrity faults on a committed checkpoint: truncated or bit-flipped shard
  file, missing / truncated / corrupted manifest, a manifest or a shard file
  from another attempt, a missing file, an extra file.

The faults come from :class:`reshard.testing.faults.FaultStorage` (a call of a
phase, see ``PHASES``) or, for the stage phase, from a Stateful whose
``state_dict`` kills its process; nothing in the library is hooked.

A cell is **safe** when: every surviving rank raised a
:class:`~reshard.errors.CheckpointError` (where the fault must fail the
operation), and, where a rank was killed or stalled, each survivor's error
names that rank as lost; every checkpoint listed as committed verifies with checksums (or,
for a checkpoint corrupted after its commit, every rank's load of it was
refused); ``latest`` is the newest checkpoint that verifies; the previous
committed checkpoint (the newest, for retention cells) loads bit-exact; and
after the job ended, ``gc`` leaves no stray attempt. A checkpoint corrupted
after its commit (integrity cells) must be skipped by ``latest`` or refused by
every rank's load.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

PG_TIMEOUT_S = 6.0
WORLD = 2


@dataclass(frozen=True)
class Cell:
    """One fault at one phase.

    Attributes:
        fault_class: "storage-error", "silent-corruption", "sigkill-save",
            "sigkill-load", "lost-rank", "integrity".
        op: "save" or "load" (the operation that meets the fault), or
            "integrity" (corruption of committed step 2, then load latest).
        mode: "sync" / "async" (saves) or "-".
        phase: the phase (a ``faults.PHASES`` name, "stage", "plan",
            "publish-after", "retention-mid") or the integrity fault.
        action: FaultStorage action ("enospc", "kill", "delay", ...) or "-".
        rank: the rank that meets the fault.
        backend: "local" (or "s3").
    """

    fault_class: str
    op: str
    mode: str
    phase: str
    action: str
    rank: int
    backend: str = "local"

    @property
    def name(self) -> str:
        return f"{self.fault_class}/{self.op}-{self.mode}/{self.phase}/{self.action}/rank{self.rank}"


@dataclass
class CellResult:
    """What a cell did and whether it was safe (see the module docstring)."""

    cell: Cell
    ranks: dict[int, str] = field(default_factory=dict)
    latest: str | None = None
    previous_loads: bool = False
    left_behind: list[str] = field(default_factory=list)
    after_gc: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: whether the next save after the fault committed on every rank (None:
    #: not tried: a rank was killed or stalled, or the cell loads)
    next_commits: bool | None = None

    @property
    def safe(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"cell": self.cell.name, **asdict(self.cell), "safe": self.safe,
                "ranks": {str(k): v for k, v in self.ranks.items()}, "latest": self.latest,
                "previous_loads_bit_exact": self.previous_loads, "left_behind": self.left_behind,
                "after_gc": self.after_gc, "problems": self.problems,
                "next_save_commits": self.next_commits, "seconds": round(self.seconds, 2)}


INTEGRITY = ("truncated-shard", "flipped-shard", "missing-manifest", "truncated-manifest",
             "corrupted-manifest", "other-attempt-manifest", "other-attempt-shard",
             "missing-file", "extra-file")


def cells(*, quick: bool = False, backend: str = "local") -> list[Cell]:
    """Every cell of the matrix (``quick``: the first cell of each fault class,
    and the few of ``_QUICK_EXTRA``); ``backend``: "local", "s3" (the rows of
    :mod:`reshard.testing.fault_matrix_s3`) or both, comma-separated."""
    if "," in backend:
        return [c for b in backend.split(",") for c in cells(quick=quick, backend=b.strip())]
    if backend == "s3":
        from .fault_matrix_s3 import cells as s3_cells

        return s3_cells(quick=quick)
    if backend != "local":
        raise ValueError(f"unknown fault-matrix backend {backend!r} (local, s3)")
    out: list[Cell] = []
    for mode in ("sync", "async"):
        for action in ("enospc", "eio", "edquot", "timeout"):
            for phase, rank in (("data", 1), ("data-durable", 1), ("manifest", 0), ("publish", 0)):
                out.append(Cell("storage-error", "save", mode, phase, action, rank, backend))
        for action in ("truncate", "flip"):
            out.append(Cell("silent-corruption", "save", mode, "data-durable", action, 1, backend))
        for phase, rank in (("stage", 1), ("plan", 0), ("data", 1), ("data", 0), ("manifest", 0),
                            ("publish", 0), ("publish-after", 0), ("retention", 0),
                            ("retention-mid", 0)):
            out.append(Cell("sigkill-save", "save", mode, phase, "kill", rank, backend))
        out.append(Cell("lost-rank", "save", mode, "data", "delay", 1, backend))
    out.append(Cell("sigkill-load", "load", "-", "read", "kill", 1, backend))
    out.append(Cell("lost-rank", "load", "-", "read", "delay", 1, backend))
    out.append(Cell("storage-error", "load", "-", "read", "eio", 1, backend))
    for kind in INTEGRITY:
        out.append(Cell("integrity", "integrity", "-", kind, "-", 0, backend))
    if quick:
        seen: set[str] = set()
        q = []
        for c in out:
            if c.fault_class not in seen or c.name.split("/", 1)[1] in _QUICK_EXTRA:
                seen.add(c.fault_class)
                q.append(c)
        return q
    return out


#: besides the first cell of each fault class, the quick matrix runs these
#: (an async kill, the coordinator killed, an interrupted retention, a rank
#: lost by an async save, a broken manifest)
_QUICK_EXTRA = ("save-async/data/kill/rank1", "save-sync/plan/kill/rank0",
                "save-sync/retention-mid/kill/rank0", "save-async/data/delay/rank1",
                "integrity--/missing-manifest/-/rank0")


# --------------------------------------------------------------------------- rank side


def _state(step: int, rank: int, world: int, *, kill: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s state of step ``step``: its row shard of ``w``, the
    replicated ``b`` and a common value (and, for the stage cell, a killer)."""
    from ..sharding import ShardedTensor

    full = _full(step, world)
    rows = full["w"].shape[0] // world
    st: dict[str, Any] = {
        "w": ShardedTensor("w", full["w"][rank * rows:(rank + 1) * rows].clone(),
                           global_shape=tuple(full["w"].shape), global_offset=(rank * rows, 0)),
        "b": full["b"].clone(), "meta": {"step": step},
    }
    if kill:
        st["killer"] = _KillOnStateDict()
    return st


def _full(step: int, world: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(4 * world, 64, generator=g), "b": torch.randn(32, generator=g)}


def _target_w(rank: int, world: int) -> Any:
    import torch

    from ..sharding import ShardedTensor

    return ShardedTensor("w", torch.zeros(4, 64), global_shape=(4 * world, 64),
                         global_offset=(rank * 4, 0))


class _KillOnStateDict:
    """A Stateful whose ``state_dict`` (called while the save stages) kills its process."""

    def state_dict(self) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGKILL)
        return {}  # pragma: no cover

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover
        pass


def _faults_for(cell: Cell, rank: int) -> list[Any]:
    from .faults import Fault

    if rank != cell.rank or cell.op == "integrity" or cell.phase == "stage":
        return []
    ph = cell.phase
    if ph == "plan":  # the coordinator checks the target before the plan is gathered
        return [Fault(op="exists", match="manifest.json", action="kill")]
    if ph == "publish-after":
        return [Fault(op="publish", action="kill", after=True)]
    # Retention deletes step 1's verification record first, renames the
    # checkpoint out of the committed namespace (``.incomplete-deleting-<id>``),
    # then deletes that tree: "retention" kills at the rename (the record is
    # gone, the checkpoint still listed), "retention-mid" inside the tree's
    # delete (one data file gone). A pattern as loose as "step-*" would fire at
    # the record's delete and test neither.
    if ph == "retention-mid":
        def half_delete(op: str, path: str) -> None:  # a kill in the middle of a recursive delete
            names = sorted(os.listdir(path)) if os.path.isdir(path) else []
            for n in [n for n in names if n.startswith("data-")][:1]:
                os.unlink(os.path.join(path, n))
            os.kill(os.getpid(), signal.SIGKILL)

        return [Fault(op="delete", match="step-00000001.incomplete-deleting-*", action="call",
                      callback=half_delete)]
    if ph == "retention":
        return [Fault(op="rename", match="step-00000001", action="kill")]
    if cell.action == "delay":
        return [Fault(op=ph, action="delay", delay_s=PG_TIMEOUT_S * 20)]  # never arrives
    if ph == "data" and cell.action == "kill":  # mid-data: after the first write of a shard file
        return [Fault(op="data", action="kill", after=True)]
    return [Fault(op=ph, action=cell.action)]


def _outcome(err: BaseException | None) -> dict[str, Any]:
    from ..errors import CheckpointError

    if err is None:
        return {"status": "ok"}
    return {"status": "error", "type": type(err).__name__, "message": str(err)[:2000],
            "checkpoint_error": isinstance(err, CheckpointError),
            "traceback": "".join(traceback.format_exception(err))[-3000:]}


def _rank_main(cell: Cell, rank: int, world: int, port: int, cdir: str) -> None:
    """One rank of a cell (runs in a child process)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from ..manager import CheckpointManager
    from ..storage import LocalStorage
    from .faults import FaultStorage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    root = os.path.join(cdir, "root")
    out = os.path.join(cdir, f"rank{rank}.json")
    result: dict[str, Any] = {}
    keep_last = 1 if cell.phase.startswith("retention") else None
    mgr = CheckpointManager(root, keep_last=keep_last, use_async=cell.mode == "async",
                            preempt_signals=(), gc_grace_s=0.0)
    mgr.save(1, _state(1, rank, world), sync=True)
    if cell.op == "integrity":
        mgr.save(2, _state(2, rank, world), sync=True)
        import reshard

        other = os.path.join(cdir, "other")
        reshard.save(_state(3, rank, world), other, step=2)  # same layout, another attempt
        dist.barrier()
        if rank == 0:
            _corrupt(cell.phase, mgr.path_for(2), other)
        dist.barrier()
    else:
        dist.barrier()
    fs = FaultStorage(LocalStorage(), _faults_for(cell, rank))
    err: BaseException | None = None
    m2: CheckpointManager | None = None
    try:
        if cell.op == "save":
            m2 = CheckpointManager(root, keep_last=keep_last, use_async=cell.mode == "async",
                                   preempt_signals=(), gc_grace_s=0.0, storage=fs)
            m2.save(2, _state(2, rank, world, kill=cell.phase == "stage" and rank == cell.rank))
            m2.wait()
            if cell.fault_class == "silent-corruption":  # committed: every rank must refuse it
                import reshard

                tgt = {"w": _target_w(rank, world), "b": torch.zeros(32), "meta": {"step": 0}}
                try:
                    reshard.load(tgt, mgr.path_for(2))
                    result["post_load"] = {"status": "ok"}
                except BaseException as e:  # noqa: BLE001
                    result["post_load"] = _outcome(e)
        else:
            import reshard

            path = reshard.latest(root) if cell.op == "integrity" else mgr.path_for(1)
            result["loaded"] = path
            assert path is not None, "no committed checkpoint to load"
            rows = 4
            tgt = {"w": _target_w(rank, world), "b": torch.zeros(32), "meta": {"step": 0}}
            reshard.load(tgt, path, storage=fs)
            step = 1 if path == mgr.path_for(1) else 2
            if not torch.equal(tgt["b"], _full(step, world)["b"]) or not torch.equal(
                    tgt["w"].data, _full(step, world)["w"][rank * rows:(rank + 1) * rows]):
                result["wrong_data"] = True
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        err = e
    if m2 is not None and cell.action not in ("kill", "delay"):
        # liveness: the fault (fired once) has cleared; the next save must commit
        try:
            m2.save(3, _state(3, rank, world))
            m2.wait()
            result["next_save"] = "committed"
        except BaseException as e:  # noqa: BLE001 - judged by the parent
            result["next_save"] = f"{type(e).__name__}: {e}"[:300]
    _finish_rank(result, err, out)



def _finish_rank(result: dict[str, Any], err: BaseException | None, out: str) -> None:
    """Write a rank's outcome to ``out`` (atomically: the parent reads only
    whole files), leave the group (broken after a lost rank) and end the
    process without running exit handlers."""
    import torch.distributed as dist

    result.update(_outcome(err))
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group after a lost rank
        pass
    os._exit(0)

def _corrupt(kind: str, ckpt: str, other: str) -> None:
    data = sorted(n for n in os.listdir(ckpt) if n.startswith("data-"))
    man = os.path.join(ckpt, "manifest.json")
    f0 = os.path.join(ckpt, data[0])
    if kind == "truncated-shard":
        os.truncate(f0, os.path.getsize(f0) - 7)
    elif kind == "flipped-shard":
        with open(f0, "r+b") as f:
            f.seek(os.path.getsize(f0) - 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    elif kind == "missing-manifest":
        os.unlink(man)
    elif kind == "truncated-manifest":
        os.truncate(man, os.path.getsize(man) // 2)
    elif kind == "corrupted-manifest":
        with open(man, "r+b") as f:
            f.seek(10)
            f.write(b"\x00garbage\xff")
    elif kind == "other-attempt-manifest":
        shutil.copyfile(os.path.join(other, "manifest.json"), man)
    elif kind == "other-attempt-shard":
        shutil.copyfile(os.path.join(other, data[0]), f0)
    elif kind == "missing-file":
        os.unlink(f0)
    elif kind == "extra-file":
        with open(os.path.join(ckpt, "data-r99999-0.safetensors"), "wb") as f:
            f.write(b"junk")
    else:
        raise ValueError(kind)


# --------------------------------------------------------------------------- parent side


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
                                     "reshard.testing.fault_matrix"])
    return _CTX


def run_cell(cell: Cell, workdir: str, *, world: int = WORLD) -> CellResult:
    """Run one cell in ``workdir/<n>`` and judge it."""
    t0 = time.perf_counter()
    cdir = os.path.join(workdir, cell.name.replace("/", "_"))
    shutil.rmtree(cdir, ignore_errors=True)
    os.makedirs(cdir)
    ctx = _context()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(cell, r, world, port, cdir), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    hang = cell.action == "delay"
    deadline = time.monotonic() + PG_TIMEOUT_S * 6 + 30
    res = CellResult(cell)
    while time.monotonic() < deadline:
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if not alive:
            break
        if hang and alive == [cell.rank] and all(
                os.path.exists(os.path.join(cdir, f"rank{r}.json")) for r in range(world)
                if r != cell.rank):
            break  # every other rank has given up on the stalled one: the job ends
        time.sleep(0.05)
    stop_ranks(cell, res, procs, hang)
    outs = rank_outcomes(res, procs, cdir)
    _judge(cell, res, outs, procs, os.path.join(cdir, "root"), world)
    res.seconds = time.perf_counter() - t0
    return res


def stop_ranks(cell: Cell, res: CellResult, procs: list[Any], hang: bool) -> None:
    """End the job: kill the rank processes still alive (a hang, unless it is
    the cell's stalled rank) and join every one."""
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            res.ranks[r] = "hung (killed when the job ended)"
            if not (hang and r == cell.rank):
                res.problems.append(f"rank {r} hung")
        else:
            p.join()


def rank_outcomes(res: CellResult, procs: list[Any], cdir: str) -> dict[int, dict[str, Any]]:
    """Each rank's outcome file (``rank<r>.json``, written by :func:`_finish_rank`);
    ``res.ranks`` says per rank: ok, the error, or killed with its exit code."""
    outs: dict[int, dict[str, Any]] = {}
    for r, p in enumerate(procs):
        f = os.path.join(cdir, f"rank{r}.json")
        if os.path.exists(f):
            with open(f) as fh:
                outs[r] = json.load(fh)
            o = outs[r]
            res.ranks[r] = "ok" if o["status"] == "ok" else f"{o['type']}: {o['message'][:160]}"
        elif r not in res.ranks:
            res.ranks[r] = f"killed (exit {p.exitcode})"
    return outs


_LOST = re.compile(r"\branks? ([\d,-]+)(?: \(global [\d,-]+\))?(?: \(the coordinator\))? (?:was|were) lost")


def named_lost(message: str) -> set[int]:
    """The group ranks an error message names as lost ("rank 1 was lost",
    "ranks 0-2,5 were lost", as :mod:`reshard.collectives` words it)."""
    out: set[int] = set()
    for m in _LOST.finditer(message):
        for part in m[1].split(","):
            if not part:
                continue
            a, _, b = part.partition("-")
            if a.isdigit() and (not b or b.isdigit()):
                out.update(range(int(a), int(b or a) + 1))
    return out


def _judge(cell: Cell, res: CellResult, outs: dict[int, dict[str, Any]], procs: list[Any],
           root: str, world: int) -> None:
    import torch

    import reshard

    from ..commit import committed
    from ..manager import CheckpointManager
    from ..storage import LocalStorage
    from ..verify import verify

    p1, p2 = os.path.join(root, "step-00000001"), os.path.join(root, "step-00000002")
    killed = cell.action == "kill"
    for r, p in enumerate(procs):
        o = outs.get(r)
        if o is None:
            if not ((killed or cell.action == "delay") and r == cell.rank):
                res.problems.append(f"rank {r} died without an outcome (exit {p.exitcode})")
            continue
        if o.get("wrong_data"):
            res.problems.append(f"rank {r} loaded wrong data without an error")
        if o["status"] == "error" and not o["checkpoint_error"]:
            res.problems.append(f"rank {r} raised {o['type']}, not a CheckpointError: "
                                f"{o['message'][:200]}")
    if cell.action in ("kill", "delay") and cell.rank in outs:
        res.problems.append(f"rank {cell.rank} was to be {'killed' if killed else 'stalled'} at "
                            f"{cell.phase} but finished: the fault never fired")
    must_fail = cell.fault_class in ("storage-error", "sigkill-save", "sigkill-load", "lost-rank")
    if cell.phase in ("publish-after", "retention", "retention-mid"):
        must_fail = False  # step 2 is committed: a survivor may see success or the lost rank
    if must_fail:
        for r, o in outs.items():
            if o["status"] == "ok":
                res.problems.append(f"rank {r} reported success although the {cell.op} met "
                                    f"{cell.action} at {cell.phase}")
    if cell.action in ("kill", "delay"):  # every survivor's error names the lost rank
        for r, o in outs.items():
            if r != cell.rank and o["status"] == "error" and cell.rank not in named_lost(o["message"]):
                res.problems.append(f"rank {r}'s error does not name the lost rank {cell.rank}: "
                                    f"{o['message'][:300]}")
    nexts = {r: o["next_save"] for r, o in outs.items() if "next_save" in o}
    if nexts:
        res.next_commits = len(nexts) == world and all(v == "committed" for v in nexts.values())
        if not res.next_commits:
            res.problems.append(f"the next save after the fault did not commit: {nexts}")
    st = LocalStorage()
    listed = [e.path for e in committed(st, root)]
    res.latest = reshard.latest(root)
    good: list[str] = []
    for path in listed:
        rep = verify(path)
        if rep.ok:
            good.append(path)
        elif cell.op == "integrity" and path == p2 and outs and (res.latest != p2 or all(
                o["status"] == "error" and o["checkpoint_error"] for o in outs.values())):
            pass  # corrupted after its commit; latest skips it, or every rank's load refused it
        elif cell.action == "flip" and path == p2 and len(outs) == world and all(
                o.get("post_load", {}).get("checkpoint_error") for o in outs.values()):
            pass  # bit rot after a durable write: committed, and every rank's load refuses it
        else:
            res.problems.append(f"{os.path.basename(path)} is listed as committed but does not "
                                f"verify: {rep.problems[:2]}")
    newest_good = good[-1] if good else None
    if cell.action == "flip" and res.latest == p2 and p2 not in good:
        pass  # refused on load on every rank (above); the good one is kept
    elif cell.op != "integrity" and res.latest != newest_good:
        res.problems.append(f"latest is {res.latest}, the newest good checkpoint is {newest_good}")
    if cell.op == "integrity" and res.latest not in (p1, p2):
        res.problems.append(f"latest is {res.latest}")
    must_load = p2 if cell.phase.startswith("retention") else p1
    step = 2 if must_load == p2 else 1
    full = _full(step, world)
    tgt: dict[str, Any] = {"w": torch.zeros_like(full["w"]), "b": torch.zeros_like(full["b"]), "meta": {"step": 0}}
    try:
        reshard.load(tgt, must_load)
        res.previous_loads = all(torch.equal(tgt[k], full[k]) for k in ("w", "b"))
    except Exception as e:  # noqa: BLE001
        res.problems.append(f"{os.path.basename(must_load)} no longer loads: {type(e).__name__}: {e}")
    if not res.previous_loads and not any("no longer loads" in p for p in res.problems):
        res.problems.append(f"{os.path.basename(must_load)} loads, but not bit-exact")
    stray = [n for n in sorted(os.listdir(root)) if ".incomplete-" in n or ".retired-" in n]
    res.left_behind = stray
    CheckpointManager(root, preempt_signals=()).gc_abandoned(grace_s=0.0)
    res.after_gc = [n for n in sorted(os.listdir(root)) if ".incomplete-" in n or ".retired-" in n]
    if res.after_gc:
        res.problems.append(f"gc left {res.after_gc}")


def run_matrix(chosen: list[Cell], *, workdir: str, progress: Any = None) -> list[CellResult]:
    """Run ``chosen`` cells one after another (``progress(result)`` after
    each); the S3 cells on one moto server started for them."""
    os.makedirs(workdir, exist_ok=True)
    out = []
    for c in chosen:
        if c.backend != "local":
            continue
        r = run_cell(c, workdir)
        out.append(r)
        if progress is not None:
            progress(r)
    s3 = [c for c in chosen if c.backend == "s3"]
    if s3:
        from .fault_matrix_s3 import run_matrix as run_s3

        out += run_s3(s3, workdir=os.path.join(workdir, "s3"), progress=progress)
    return out
