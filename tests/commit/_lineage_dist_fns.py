"""Rank functions for tests/commit/test_lineage_dist.py (run inside WorkerPool
workers, imported by name): workflows walked the way users walk them (per-rank
working directories, two runs sharing a root, ...). Real files, gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard.storage import LocalStorage


def _error(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e),
            "failed_ranks": sorted(getattr(e, "failures", {}))}


def r_load_relative_per_cwd(dirs: list[str], rel: str) -> dict[str, Any]:
    """Each rank loads the relative path ``rel`` from its own working
    directory ``dirs[rank]``; report what it raised and whether its target
    is unchanged."""
    rank = dist.get_rank()
    old = os.getcwd()
    os.chdir(dirs[rank])
    target = torch.full((4,), -7.0)
    out: dict[str, Any] = {"raised": None}
    try:
        reshard.load({"w": target}, rel)
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    finally:
        os.chdir(old)
    out["w"] = target.tolist()
    return out


def _listing(root: str) -> list[str]:
    """The root's entries, less the owner record of the job saving there (and its lock)."""
    return sorted(n for n in os.listdir(root) if n not in ("OWNER", "OWNER.lock"))


def _rows(value: float) -> dict[str, Any]:
    """This rank's row of a (2, 3) tensor filled with ``value``."""
    rank = dist.get_rank()
    return {"w": reshard.ShardedTensor("w", torch.full((1, 3), value), global_shape=(2, 3),
                                       global_offset=(rank, 0))}


def r_two_runs_share_a_root(root: str) -> dict[str, Any]:
    """Run A starts fresh and saves steps 1, 2; run B (a requeued job while A
    still runs) resumes step 2 and saves 3; A saves 3 and 4. Returns what is
    under the root after each save and what B's newest checkpoint holds."""
    seen: dict[str, Any] = {}
    a = reshard.CheckpointManager(root, keep_last=1, preempt_signals=())
    a.restore(_rows(0.0), allow_fresh_start=True)
    a.save(1, _rows(1.0))
    a.save(2, _rows(2.0))
    b = reshard.CheckpointManager(root, keep_last=1, preempt_signals=())
    b.restore(_rows(0.0))
    b.save(3, _rows(30.0))
    b_path = b.path_for(3)
    for step in (3, 4):
        a.save(step, _rows(float(step)))
        dist.barrier()
        seen[f"after A {step}"] = sorted(os.listdir(root))
    got = _rows(-1.0)
    reshard.load(got, b_path)
    seen["b_newest"] = os.path.basename(b_path)
    seen["b_value"] = got["w"].data.flatten().tolist()
    return seen


def r_resume_with_manager_then_plain_saves(root: str) -> dict[str, Any]:
    """Steps 3 and 6 saved by a manager; a later run resumes with a manager
    (HEAD written) and saves 9 and 12 with plain ``reshard.save``; then
    ``latest`` and a fresh manager's restore."""
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    for step in (3, 6):
        mgr.save(step, _rows(float(step)))
    again = reshard.CheckpointManager(root, preempt_signals=())
    again.restore(_rows(0.0))
    for step in (9, 12):
        reshard.save(_rows(float(step)), again.path_for(step), step=step)
    got = _rows(-1.0)
    res = reshard.CheckpointManager(root, preempt_signals=()).restore(got)
    assert res is not None
    return {"latest": os.path.basename(str(reshard.latest(root))),
            "restored": os.path.basename(res.path), "value": got["w"].data.flatten().tolist()}


def r_evaluation_restore_does_not_stop_retention(root: str) -> list[str]:
    """A run saves 1, 2 (keep_last=1); an evaluation resumes with a manager
    (HEAD written, no saves); the run saves 3: its retention still applies."""
    a = reshard.CheckpointManager(root, keep_last=1, preempt_signals=())
    a.restore(_rows(0.0), allow_fresh_start=True)
    a.save(1, _rows(1.0))
    a.save(2, _rows(2.0))
    reshard.CheckpointManager(root, preempt_signals=()).restore(_rows(0.0))
    a.save(3, _rows(3.0))
    dist.barrier()
    return sorted(n for n in os.listdir(root) if n.startswith("step-") and "." not in n[5:])


def r_restore_with_a_wrong_hmac_key(root: str) -> dict[str, Any]:
    """Steps 3, 6 signed with one key; a restart restores with another key
    (a typo, a rotated secret), then with the right one."""
    opts = reshard.SaveOptions(hmac_key=b"right")
    mgr = reshard.CheckpointManager(root, options=opts, preempt_signals=())
    for step in (3, 6):
        mgr.save(step, _rows(float(step)))
    out: dict[str, Any] = {"raised": None}
    try:
        reshard.CheckpointManager(root, preempt_signals=()).restore(
            _rows(0.0), options=reshard.LoadOptions(hmac_key=b"wrong"))
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    dist.barrier()
    out["after"] = sorted(os.listdir(root))
    got = _rows(-1.0)
    res = reshard.CheckpointManager(root, preempt_signals=()).restore(
        got, options=reshard.LoadOptions(hmac_key=b"right"))
    out["restored"] = None if res is None else os.path.basename(res.path)
    out["value"] = got["w"].data.flatten().tolist()
    return out


class _SavesWhileLoaded:
    """A Stateful whose ``load_state_dict`` lets the training run commit its
    next checkpoint: the commit lands while an evaluation's restore is
    loading (after its listing, before its HEAD)."""

    def __init__(self, run: Any, step: int):
        self.run, self.step = run, step

    def state_dict(self) -> dict[str, Any]:
        return {"n": 0}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.run.save(self.step, _rows(float(self.step)))


def r_commit_during_an_evaluation_restore(root: str) -> dict[str, Any]:
    run = reshard.CheckpointManager(root, preempt_signals=())
    for step in (1, 2):
        run.save(step, _rows(float(step)))
    evaluation = reshard.CheckpointManager(root, preempt_signals=())
    res = evaluation.restore({**_rows(0.0), "hook": _SavesWhileLoaded(run, 3)},
                             allow_missing=["hook.*"])
    assert res is not None
    return {"evaluated": os.path.basename(res.path),
            "latest": os.path.basename(str(reshard.latest(root)))}


def r_save_rows(root: str) -> None:
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    for step in (1, 2):
        mgr.save(step, _rows(float(step)))


def r_restore_from_cwd(dirs: list[str], rel: str) -> dict[str, Any]:
    """Restore the relative root ``rel`` from this rank's working directory."""
    old = os.getcwd()
    os.chdir(dirs[dist.get_rank()])
    out: dict[str, Any] = {"raised": None, "restored": None}
    try:
        res = reshard.CheckpointManager(rel, preempt_signals=()).restore(_rows(0.0))
        out["restored"] = None if res is None else os.path.basename(res.path)
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    finally:
        os.chdir(old)
    return out


class NodeLocal(LocalStorage):
    """The local file system as a node with its own disk sees it: every path
    under ``shared`` is read from the same path under ``local`` instead (a
    node-local copy under the one spelling every rank uses). Real files."""

    def __init__(self, shared: str, local: str):
        super().__init__()
        self.shared, self.local = shared, local

    def _m(self, path: str) -> str:
        return self.local + path[len(self.shared):] if path.startswith(self.shared) else path

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        super().read_into(self._m(path), offset, buf)

    def size(self, path: str) -> int:
        return super().size(self._m(path))

    def exists(self, path: str) -> bool:
        return super().exists(self._m(path))

    def is_link(self, path: str) -> bool:
        return super().is_link(self._m(path))

    def list_dir(self, path: str) -> list[str]:
        return super().list_dir(self._m(path))

    def modified_time(self, path: str) -> float | None:
        return super().modified_time(self._m(path))


def r_restore_node_local(shared: str, local: str) -> dict[str, Any]:
    """Restore ``shared``; rank 1 sees it through its node-local copy ``local``."""
    st = NodeLocal(shared, local) if dist.get_rank() == 1 else LocalStorage()
    out: dict[str, Any] = {"raised": None, "restored": None}
    try:
        res = reshard.CheckpointManager(shared, storage=st, preempt_signals=()).restore(_rows(0.0))
        out["restored"] = None if res is None else os.path.basename(res.path)
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    return out


def r_housekeeping_fails_after_commit(root: str) -> dict[str, Any]:
    """A manager (keep_last=1) whose post-commit housekeeping fails on the
    coordinator: the verification record's write meets ENOSPC at step 1 (the
    save filled the disk), then retention's deletes meet EIO at step 2; step
    3 runs without faults. Returns, per save, what was raised and what is
    under the root, and the warnings logged."""
    import logging

    from reshard.faults.inject import Fault, FaultStorage

    st = FaultStorage(LocalStorage(), [Fault(op="write_bytes", action="enospc",
                                             match="*.verified.json*", times=0)])
    mgr = reshard.CheckpointManager(root, keep_last=1, storage=st, preempt_signals=())
    warned: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    handler = _Keep()
    logging.getLogger("reshard").addHandler(handler)
    out: dict[str, Any] = {}
    try:
        for step in (1, 2, 3):
            if step == 2:
                st.faults[:] = [Fault(op="delete", action="eio", match="step-*", times=0)]
            elif step == 3:
                st.faults.clear()
            raised = None
            try:
                mgr.save(step, _rows(float(step)))
            except reshard.CheckpointError as e:
                raised = _error(e)
            # the ranks are still in step: each learns what the others raised
            flags = torch.tensor([int(raised is not None)])
            dist.all_reduce(flags)
            out[f"raised {step}"] = raised
            out[f"ranks raised {step}"] = int(flags)
            dist.barrier()
            out[f"after {step}"] = _listing(root)
            # every rank has listed before any goes on: rank 0's load below takes a reader lease
            # (CI saw it in rank 1's listing of step 3, on a loaded machine)
            dist.barrier()
            if raised is not None:
                break
    finally:
        logging.getLogger("reshard").removeHandler(handler)
    got = _rows(-1.0)
    reshard.load(got, reshard.latest(root))
    out["latest"] = os.path.basename(str(reshard.latest(root)))
    out["value"] = got["w"].data.flatten().tolist()
    out["warned"] = warned
    return out
