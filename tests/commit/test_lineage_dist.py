"""Workflows walked the way users walk them (issue 9, review): real files,
real gloo ranks (2), rank functions in tests/commit/_lineage_dist_fns.py."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

import reshard
from _lineage_dist_fns import (
    r_commit_during_an_evaluation_restore,
    r_evaluation_restore_does_not_stop_retention,
    r_housekeeping_fails_after_commit,
    r_load_relative_per_cwd,
    r_restore_from_cwd,
    r_restore_node_local,
    r_restore_with_a_wrong_hmac_key,
    r_resume_with_manager_then_plain_saves,
    r_save_rows,
    r_two_runs_share_a_root,
)
from reshard.collectives import SingleProcess
from reshard.commit.lineage import Head, lineage_of, resume_order
from reshard.commit.listing import Entry
from reshard.ondisk.manifest import Manifest


def _save_one(path: Path, value: float, step: int) -> None:
    reshard.save({"w": torch.full((4,), value)}, path, step=step, group=SingleProcess())


def _listing(root: Path) -> list[str]:
    """The root's entries, less the owner record of the job saving there (and its lock)."""
    return sorted(n for n in os.listdir(root) if n not in ("OWNER", "OWNER.lock"))


def test_ranks_loading_different_checkpoints_all_raise_targets_unchanged(
        pool: Any, tmp_path: Path) -> None:
    """A relative path under a different working directory per rank (or
    per-rank paths, or ``latest`` evaluated per rank during a publish) names
    two checkpoints: every rank raises, naming both, and loads nothing
    (before: each rank silently loaded its own, a mixed state)."""
    for d, v in (("a", 1.0), ("b", 2.0)):
        (tmp_path / d).mkdir()
        _save_one(tmp_path / d / "ck", v, step=int(v))
    out = pool.run(2, r_load_relative_per_cwd, [str(tmp_path / "a"), str(tmp_path / "b")], "ck")
    for r in out:
        assert r["raised"] is not None, r
        msg = r["raised"]["message"]
        assert "every rank must name the same checkpoint" in msg
        assert f"{tmp_path}/a/ck" in msg and f"{tmp_path}/b/ck" in msg
        assert r["w"] == [-7.0] * 4  # unchanged


def test_ranks_loading_the_same_checkpoint_through_two_spellings_succeed(
        pool: Any, tmp_path: Path) -> None:
    """The same checkpoint, reached from two working directories (one through
    a symbolic link), loads on both ranks."""
    (tmp_path / "real").mkdir()
    _save_one(tmp_path / "real" / "ck", 3.0, step=3)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    out = pool.run(2, r_load_relative_per_cwd, [str(tmp_path / "real"), str(tmp_path / "link")], "ck")
    for r in out:
        assert r["raised"] is None, r
        assert r["w"] == [3.0] * 4


def test_a_stale_run_sharing_the_root_deletes_nothing(pool: Any, tmp_path: Path) -> None:
    """Two runs on one root (a requeued job while the old one still runs):
    the run whose HEAD was replaced by the other's resume applies no
    retention, so it never deletes the current run's newest checkpoint
    (before: run A's keep_last=1 deleted run B's step 3 right after B saved it)."""
    root = tmp_path / "ck"
    out = pool.run(2, r_two_runs_share_a_root, str(root))
    for r in out:
        assert r["b_newest"] == "step-00000003"
        for step in (3, 4):
            assert "step-00000003" in r[f"after A {step}"], r
        assert r["b_value"] == [30.0] * 3
    # a HEAD written by a reader that never saves does not stop the run's retention
    out = pool.run(2, r_evaluation_restore_does_not_stop_retention, str(tmp_path / "ev"))
    assert out[0] == ["step-00000002", "step-00000003"]  # 2: the HEAD's (resume source)


def test_plain_saves_after_a_managed_resume_are_the_newest(pool: Any, tmp_path: Path) -> None:
    """A run resumed by the manager (HEAD written) that saves with plain
    ``reshard.save`` (no parent, no lineage recorded): those checkpoints are
    the current lineage's newest; ``latest`` and the next restore take them
    (before: both went back to HEAD's step 6, silently dropping steps 7-12)."""
    out = pool.run(2, r_resume_with_manager_then_plain_saves, str(tmp_path / "ck"))
    for r in out:
        assert r["latest"] == "step-00000012" and r["restored"] == "step-00000012", r
        assert r["value"] == [12.0] * 3


def test_lineage_plain_save_after_head_descends_but_not_one_before() -> None:
    def entry(name: str, step: int, t: float, parent: str | None = None,
              lineage: str | None = None) -> Entry:
        m = Manifest(attempt_id=f"a-{name}", created_at=t, world_size=1, checksum_block_bytes=1,
                     step=step, parent=parent, lineage=lineage)
        return Entry(path=f"/r/{name}", name=name, manifest=m, abandoned=False)

    es = [entry("s100", 100, 1.0), entry("s150", 150, 2.0),  # plain saves before the rollback
          entry("s110", 110, 4.0),  # a plain save after it
          entry("s160", 160, 5.0, lineage="other-run")]  # another run's, no parent
    head = Head(name="s100", id="run2", time=3.0, attempt_id="a-s100", step=100)
    lin = lineage_of(es, head)
    assert lin.descendants == {"s110"} and lin.current == {"s100", "s110"}
    assert [e.name for e in resume_order(es, lin)][:2] == ["s110", "s100"]


def test_restore_with_a_wrong_hmac_key_quarantines_nothing(pool: Any, tmp_path: Path) -> None:
    """A wrong HMAC key is the reader's fault, not the checkpoints': every
    rank raises naming the key, nothing is quarantined, and the right key
    then resumes the newest (before: every checkpoint of the root was
    quarantined, and the next restart found none)."""
    root = tmp_path / "ck"
    out = pool.run(2, r_restore_with_a_wrong_hmac_key, str(root))
    for r in out:
        assert r["raised"] is not None and r["raised"]["type"] == "IntegrityError", r
        assert "HMAC key given does not verify" in r["raised"]["message"]
        assert not any("quarantined" in n for n in r["after"]), r["after"]
        assert r["restored"] == "step-00000006" and r["value"] == [6.0] * 3


_KILLED_IN_RETENTION = r"""
import os, shutil, signal, sys, torch, reshard
root = sys.argv[1]
mgr = reshard.CheckpointManager(root, keep_last=1, preempt_signals=())
mgr.save(1, {"w": torch.full((4,), 1.0)})
def killed_rmtree(path, *a, **k):  # the process dies in the middle of deleting a checkpoint
    data = sorted(n for n in os.listdir(path) if n.startswith("data-"))
    os.unlink(os.path.join(path, data[0]))
    os.kill(os.getpid(), signal.SIGKILL)
shutil.rmtree = killed_rmtree
mgr.save(2, {"w": torch.full((4,), 2.0)})
"""


def test_retention_killed_mid_deletion_leaves_no_torn_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while retention deletes step 1: step 1 is no longer listed as
    a committed checkpoint (not even a torn one), the newest loads, and the
    next gc finishes the deletion (before: a torn step 1 stayed listed as
    committed and a restore quarantined it for ever)."""
    import subprocess
    import sys

    root = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-c", _KILLED_IN_RETENTION, str(root)], timeout=120)
    assert p.returncode == -9
    from reshard.commit.listing import committed, scan
    from reshard.storage import LocalStorage

    st = LocalStorage()
    assert [e.name for e in committed(st, str(root))] == ["step-00000002"]
    left = [e.name for e in scan(st, str(root)) if e.abandoned]
    assert len(left) == 1 and left[0].startswith("step-00000001.incomplete-deleting-"), left
    assert reshard.latest(root) == str(root / "step-00000002")
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    assert mgr.gc_abandoned(grace_s=0) == left
    assert _listing(root) == ["step-00000002", "step-00000002.verified.json"]


def test_a_checkpoint_committed_while_a_restore_loads_is_a_descendant(
        pool: Any, tmp_path: Path) -> None:
    """An evaluation resumes step 2 with a manager while the training run
    commits step 3 (a child of 2) during that load: step 3 stays the newest
    of the lineage (before: HEAD's time, taken after the load, made step 3
    an abandoned branch, and the run's next restart went back to step 2)."""
    for r in pool.run(2, r_commit_during_an_evaluation_restore, str(tmp_path / "ck")):
        assert r == {"evaluated": "step-00000002", "latest": "step-00000003"}, r


def test_a_rank_seeing_a_partial_copy_quarantines_nothing(pool: Any, tmp_path: Path) -> None:
    """Rank 1 resumes from a node-local copy of the root that lacks its data
    files: every rank raises saying rank 1 does not see rank 0's storage, and
    nothing is quarantined (before: every intact checkpoint of the shared
    root was quarantined, and the next restart found none). A byte flipped
    in the shared copy, found by rank 1 alone, is still quarantined."""
    import shutil

    n0, n1 = tmp_path / "n0", tmp_path / "n1"
    n0.mkdir()
    pool.run(2, r_save_rows, str(n0 / "ck"))
    shutil.copytree(n0 / "ck", n1 / "ck")
    for step in ("step-00000001", "step-00000002"):
        os.unlink(n1 / "ck" / step / "data-r00001-0.safetensors")
    for r in pool.run(2, r_restore_from_cwd, [str(n0), str(n1)], "ck"):  # another spelling
        assert r["raised"] is not None, r
        assert "every rank must name the same checkpoint" in r["raised"]["message"]
    for r in pool.run(2, r_restore_node_local, str(n0 / "ck"), str(n1 / "ck")):  # the same one
        assert r["raised"] is not None, r
        msg = r["raised"]["message"]
        assert "rank 1: IntegrityError" in msg and "do not see the same storage as rank 0" in msg, msg
        # the summary names the rank that failed, not every rank that raised the agreed error
        assert "on rank(s) 1)" in msg and "0-1" not in msg, msg
    assert not any("quarantined" in n for n in os.listdir(n0 / "ck"))
    # real damage that only rank 1 reads (its rows of step 2): quarantined, step 1 resumed
    f = n0 / "ck" / "step-00000002" / "data-r00001-0.safetensors"
    b = bytearray(f.read_bytes())
    b[-1] ^= 0xFF
    f.write_bytes(bytes(b))
    for r in pool.run(2, r_restore_from_cwd, [str(n0), str(n0)], "ck"):
        assert r["raised"] is None and r["restored"] == "step-00000001", r
    assert any(n.startswith("step-00000002.quarantined-") for n in os.listdir(n0 / "ck"))


def test_gc_removes_a_record_temporary_left_by_a_kill(tmp_path: Path) -> None:
    """A SIGKILL between writing ``HEAD.tmp-*`` and its rename leaves the
    temporary: gc deletes it once older than the grace period (before: left
    for ever), never the records themselves."""
    import subprocess
    import sys

    root = tmp_path / "ck"
    script = r"""
import os, signal, sys, torch, reshard
root = sys.argv[1]
reshard.CheckpointManager(root, preempt_signals=()).save(1, {"w": torch.zeros(2)})
from reshard.storage.local import LocalStorage
real = LocalStorage.rename_dir
def killed(self, src, dst):
    if os.path.basename(dst) == "HEAD":
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, src, dst)
LocalStorage.rename_dir = killed
reshard.CheckpointManager(root, preempt_signals=()).restore({"w": torch.zeros(2)})
"""
    p = subprocess.run([sys.executable, "-c", script, str(root)], timeout=120)
    assert p.returncode == -9
    tmp = [n for n in os.listdir(root) if n.startswith("HEAD.tmp-")]
    assert len(tmp) == 1 and "HEAD" not in os.listdir(root)
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    assert mgr.gc_abandoned() == []  # younger than the grace period: kept
    assert mgr.gc_abandoned(grace_s=0) == []  # younger than a minute: may be a live writer's
    old = time.time() - 120
    os.utime(root / tmp[0], (old, old))
    assert mgr.gc_abandoned(grace_s=0) == tmp
    assert _listing(root) == ["step-00000001", "step-00000001.verified.json"]


def test_housekeeping_failing_after_a_commit_raises_on_no_rank(pool: Any, tmp_path: Path) -> None:
    """The coordinator's housekeeping after a commit (verification record,
    retention deletes, gc) meets a full disk or an I/O error: the save did
    commit, so no rank raises (before: the coordinator alone raised the
    StorageError while the other ranks returned, and they met again in
    mismatched collectives, reported as "a rank was lost"); the failure is
    logged, nothing is deleted that retention would keep, and the next
    save's housekeeping catches up."""
    root = tmp_path / "ck"
    out = pool.run(2, r_housekeeping_fails_after_commit, str(root))
    for r in out:
        for step in (1, 2, 3):
            assert r[f"raised {step}"] is None and r[f"ranks raised {step}"] == 0, r
        assert r["after 1"] == ["step-00000001"], r          # committed, no record written
        # its deletion failed: kept, or already out of the committed namespace (never torn)
        assert "step-00000001" in r["after 2"] or any(
            n.startswith("step-00000001.incomplete-deleting-") for n in r["after 2"]), r
        assert r["after 3"] == ["step-00000003", "step-00000003.verified.json"], r
        assert r["latest"] == "step-00000003" and r["value"] == [3.0] * 3, r
    warned = " | ".join(out[0]["warned"])
    assert "step-00000001" in warned and "no space left on device" in warned, warned
    assert "step-00000002" in warned or "retention" in warned, warned
