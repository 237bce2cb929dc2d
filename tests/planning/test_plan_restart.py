"""The save plan rebuilt from the parent checkpoint after a restart (issue 11
item 3), on 4 gloo ranks of the worker pool (the cache dropped as a restart
drops it) and across two real torchrun runs of 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _restart_fns as fns
import reshard
from reshard.testing.pool import WorkerPool

ROOT = Path(__file__).resolve().parents[2]


def test_plan_reused_after_restart_and_replanned_on_change(pool: WorkerPool, tmp_path: Path) -> None:
    out = pool.run(4, fns.r_restart, str(tmp_path), timeout=150)
    head = out[0]
    assert head["b_manifest_equal"] and head["b_files_equal"] and head["b_verify"], head
    assert head["c_ok"] and head["d_manifest_equal"] and head["e_manifest_equal"], head
    for o in out:
        assert o["a"]["cached"] == 0.0 and o["a"]["calls"].get("scatter", 0) == 1, o
        # unchanged after the "restart": no planning round (no plan gather, no scatter)
        assert o["b"]["cached"] == 1.0 and o["b"]["from_parent"] == 1.0, o
        assert o["b"]["calls"].get("scatter", 0) == 0 and o["b"]["calls"].get("gather", 0) == 1, o
        for k in ("c", "d", "e"):  # a changed structure, a stale plan, a torn plan: planned
            assert o[k]["cached"] == 0.0 and o[k]["calls"].get("scatter", 0) == 1, (k, o)
        assert o["b_load"] and o["e_load"], o
    assert max(o["b"]["recv"] for o in out[1:]) <= 1024, [o["b"]["recv"] for o in out]


def test_manager_restore_agrees_by_counters_then_reuses_the_plan(pool: WorkerPool, tmp_path: Path) -> None:
    out = pool.run(4, fns.r_manager_restart, str(tmp_path), timeout=120)
    for o in out:
        assert o["first"] == 0.0 and o["resumed"], o
        assert "all_gather" not in o["restore_calls"], o
        assert o["after_restore"] == 1.0 and o["from_parent"] == 1.0, o


@pytest.mark.timeout(300)
def test_plan_reused_across_real_torchrun_restart(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    torchrun = Path(sys.executable).parent / "torchrun"

    def run(parent: str, name: str) -> list[dict]:
        res = str(tmp_path / f"{name}.json")
        cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone", str(ROOT / "tests" / "planning" / "_restart_fns.py"),
               str(tmp_path), parent, name, res]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        assert p.returncode == 0, p.stderr[-4000:]
        return [json.loads(Path(f"{res}.{r}").read_text()) for r in range(2)]

    first = run("", "a")
    second = run("a", "b")  # new processes: the plan comes from a's plan.bin
    assert [o["cached"] for o in first] == [0.0, 0.0]
    assert [o["cached"] for o in second] == [1.0, 1.0] and [o["from_parent"] for o in second] == [1.0, 1.0]
    assert all(o["calls"].get("scatter", 0) == 0 for o in second)
    ma, mb = reshard.inspect(str(tmp_path / "a")), reshard.inspect(str(tmp_path / "b"))
    assert (ma.tensors, ma.objects, ma.files, ma.values, ma.plan) == (mb.tensors, mb.objects, mb.files,
                                                                      mb.values, mb.plan)
