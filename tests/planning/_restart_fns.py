"""Rank functions for tests/planning/test_plan_restart.py: the save plan rebuilt from
the parent checkpoint after a restart (issue 11 item 3). Also run as a
torchrun script (``python tests/planning/_restart_fns.py ROOT PARENT NAME OUT``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import msgspec
import torch.distributed as dist

import reshard
from reshard.collectives import Counting, TorchCollectives
from reshard.planning.coordination import PLAN_CACHE
from reshard.saving.save import drop_plan_cache

sys.path.insert(0, os.path.dirname(__file__))
from _scale_fns import _check_load, _files, state  # noqa: E402


def _modulo(path: str) -> reshard.Manifest:
    """The manifest without what differs between two saves of one state: attempt, time, parent."""
    m = reshard.inspect(path)
    return msgspec.structs.replace(m, attempt_id="", created_at=0.0, parent=None)


def _save(path: str, parent: str | None, **kw: Any) -> dict[str, Any]:
    c = Counting(TorchCollectives())
    r = reshard.save(state(**kw), path, step=1, group=c, options=reshard.SaveOptions(parent=parent))
    return {"cached": r.timings["cached_plan"], "from_parent": r.timings["plan_from_parent"],
            "recv": c.recv, "calls": dict(c.calls)}


def r_restart(root: str) -> dict[str, Any]:
    """Planned save, then (cache dropped as a restart drops it) saves whose
    parent is the previous checkpoint: unchanged -> reused; one rank's
    structure changed -> re-planned; a torn plan.bin -> re-planned."""
    rank = dist.get_rank()
    PLAN_CACHE.clear()
    p = {n: os.path.join(root, n) for n in ("a", "b", "c", "d", "e")}
    out: dict[str, Any] = {"rank": rank, "a": _save(p["a"], None)}
    drop_plan_cache()
    out["b"] = _save(p["b"], "a")  # unchanged structure, new process state
    dist.barrier()
    if rank == 0:
        out["b_manifest_equal"] = _modulo(p["a"]) == _modulo(p["b"])
        out["b_files_equal"] = _files(p["a"]) == _files(p["b"])
        out["b_verify"] = reshard.verify(p["b"]).ok
    out["b_load"] = _check_load(p["b"])
    drop_plan_cache()
    out["c"] = _save(p["c"], "b", extra=3)  # rank 2 holds a new tensor since b
    dist.barrier()
    if rank == 0:
        mc = reshard.inspect(p["c"])
        out["c_ok"] = ("extra" in mc.tensors and mc.tensors["extra"].global_shape == (3,)
                       and mc.plan is not None and mc.plan.plan_id != reshard.inspect(p["b"]).plan.plan_id
                       and reshard.verify(p["c"]).ok)
    drop_plan_cache()
    out["d"] = _save(p["d"], "c")  # back to b's structure, c's plan: stale -> planned
    dist.barrier()
    if rank == 0:
        out["d_manifest_equal"] = _modulo(p["a"]) == _modulo(p["d"])
        with open(os.path.join(p["d"], "plan.bin"), "r+b") as f:  # a torn plan beside d
            f.seek(40)
            f.write(b"\xff\xff")
    dist.barrier()
    drop_plan_cache()
    out["e"] = _save(p["e"], "d")
    dist.barrier()
    if rank == 0:
        out["e_manifest_equal"] = _modulo(p["a"]) == _modulo(p["e"])
    out["e_load"] = _check_load(p["e"])
    return out


def r_manager_restart(root: str) -> dict[str, Any]:
    """CheckpointManager across a "restart": the restore agrees with counters
    (no all-gather), and the first save after it reuses the plan of the
    checkpoint it resumed from."""
    PLAN_CACHE.clear()
    m1 = reshard.CheckpointManager(root)
    first = m1.save(1, state(), sync=True)
    m1.close()
    drop_plan_cache()
    c = Counting(TorchCollectives())
    m2 = reshard.CheckpointManager(root, group=c)
    target = state(step=0)
    res = m2.restore(target)
    restore_calls, restore_recv = dict(c.calls), c.recv
    again = m2.save(2, state(), sync=True)
    m2.close()
    return {"first": first.timings["cached_plan"], "resumed": res is not None and res.path.endswith("1"),
            "restore_calls": restore_calls, "restore_recv": restore_recv,
            "after_restore": again.timings["cached_plan"], "from_parent": again.timings["plan_from_parent"]}


def main(root: str, parent: str, name: str, out_path: str) -> None:
    """One torchrun run: a save of ``state()`` to ``root/name`` with parent
    ``parent`` ("" for none); each rank appends what it saw to ``out_path``."""
    dist.init_process_group("gloo")
    try:
        res = _save(os.path.join(root, name), parent or None)
        res["rank"] = dist.get_rank()
        dist.barrier()
        with open(f"{out_path}.{dist.get_rank()}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
