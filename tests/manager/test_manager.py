"""CheckpointManager: resume (cases 8 and 19), a process killed between data and
manifest, retention with verify-before-delete, leases, GC, cadence, preemption."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from _async_fns import CorruptingStorage, FailingStorage
from reshard.commit.retention import Candidate, Policy, decide
from reshard.manager.manager import CheckpointManager, young_daly_interval

PY = sys.executable


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Any:
    """A manager installs a SIGTERM handler; give the process its own back."""
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def _mgr(root: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("preempt_signals", ())
    return CheckpointManager(str(root), **kw)


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 3), float(step)), "b": torch.arange(5) + step},
            "meta": {"step": step}}


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)},
            "meta": {"step": -1}}


def _assert_is(state: dict[str, Any], res: reshard.LoadResult, step: int) -> None:
    assert res.step == step
    assert torch.equal(state["model"]["w"], torch.full((4, 3), float(step)))
    assert torch.equal(state["model"]["b"], torch.arange(5) + step)
    assert res.values["meta"] == {"step": step}


def _names(root: Path) -> set[str]:
    """The root's entries, less the owner record of the job saving there (and its lock)."""
    return {p.name for p in root.iterdir() if p.name not in ("OWNER", "OWNER.lock")}


def _steps(root: Path) -> list[int]:
    return sorted(int(n[5:]) for n in _names(root) if n.startswith("step-") and n[5:].isdigit())


# ----------------------------------------------------------------------------- kill (case 8)

KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    from reshard.manager.manager import CheckpointManager
    from reshard.storage import LocalStorage

    root, mode = sys.argv[1], sys.argv[2]

    class KillBeforeManifest(LocalStorage):
        armed = False

        def write_bytes(self, path, data, *, durable=True):
            if self.armed and path.endswith("/manifest.json"):
                os.kill(os.getpid(), signal.SIGKILL)  # data is durable, the manifest never comes
            super().write_bytes(path, data, durable=durable)

    st = KillBeforeManifest()
    mgr = CheckpointManager(root, keep_last=1, every_steps=1, use_async=mode == "async",
                            preempt_signals=(), storage=st)
    state = {"model": {"w": torch.full((4, 3), 1.0), "b": torch.arange(5) + 1}, "meta": {"step": 1}}
    mgr.maybe_save(1, state)
    mgr.wait()
    state["model"]["w"].fill_(2.0)
    state["model"]["b"].add_(1)
    state["meta"]["step"] = 2
    st.armed = True
    r = mgr.maybe_save(2, state)
    if mode == "async":
        r.wait()
    print("not killed")
    sys.exit(3)
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_between_data_and_manifest_keeps_previous(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "ckpts"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([PY, "-c", KILL_SCRIPT, str(root), mode], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    names = _names(root)
    attempts = [n for n in names if n.startswith("step-00000002.incomplete-")
                and not n.endswith(".lease.json")]  # its lease died with it (same host)
    assert len(attempts) == 1, names
    assert any(f.endswith(".safetensors") for f in os.listdir(root / attempts[0]))  # data written
    assert not (root / attempts[0] / "manifest.json").exists()
    assert "step-00000002" not in names
    step1 = root / "step-00000001"
    assert reshard.verify(step1).ok
    assert reshard.latest(root) == str(step1)
    mgr = _mgr(root, keep_last=1)
    assert mgr.latest_step() == 1
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to fall back from
        res = mgr.restore(state)
    assert res is not None
    _assert_is(state, res, 1)
    assert "fallback" not in res.notes
    assert mgr.gc_abandoned(grace_s=0) == attempts
    assert _names(root) == {"step-00000001", "step-00000001.verified.json", "HEAD"}


# ----------------------------------------------------------------------------- case 8 resume


def _incomplete_200(root: Path, how: str) -> None:
    reshard.save(_state(200), root / "step-00000200", step=200)
    if how == "no-manifest":
        (root / "step-00000200" / "manifest.json").unlink()
    else:  # an attempt directory that never published
        os.remove(root / "step-00000200" / "manifest.json")
        os.rename(root / "step-00000200", root / "step-00000200.incomplete-20240101T000000-dead")


@pytest.mark.parametrize("how", ["no-manifest", "attempt"])
def test_incomplete_newest_only(tmp_path: Path, how: str) -> None:
    assert _mgr(tmp_path / "empty").restore(_blank()) is None  # a genuinely fresh start
    root = tmp_path / "ckpts"
    _incomplete_200(root, how)
    mgr = _mgr(root)
    assert reshard.latest(root) is None
    with pytest.raises(reshard.CheckpointNotFoundError, match="abandoned"):
        mgr.restore(_blank())
    state = _blank()
    assert mgr.restore(state, allow_fresh_start=True) is None
    assert state["model"]["w"].eq(0).all()
    # with step 100 committed too: resume from 100
    mgr.save(100, _state(100))
    res = mgr.restore(state)
    assert res is not None
    _assert_is(state, res, 100)


# ----------------------------------------------------------------------------- case 19 torn newest


def _break(root: Path, step: int, how: str) -> None:
    d = root / f"step-{step:08d}"
    f = sorted(d.glob("*.safetensors"))[0]
    if how == "deleted":
        f.unlink()
    else:  # same size, flipped tensor bytes at the end of the file: only checksums tell
        raw = bytearray(f.read_bytes())
        for i in range(1, 9):
            raw[-i] ^= 0xFF
        f.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["deleted", "flipped"])
def test_torn_newest_falls_back(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=None)
    mgr.save(100, _state(100))
    mgr.save(200, _state(200))
    assert _steps(root) == [100, 200]
    _break(root, 200, how)
    state = _blank()
    with pytest.warns(RuntimeWarning, match="step-00000200"):
        res = _mgr(root).restore(state)
    assert res is not None
    _assert_is(state, res, 100)
    fb = res.notes["fallback"]
    assert len(fb) == 1 and "step-00000200" in fb[0]
    # every checkpoint broken: an error, never a fresh start
    _break(root, 100, how)
    with pytest.warns(RuntimeWarning), pytest.raises(reshard.CheckpointError) as ei:
        _mgr(root).restore(_blank())
    assert not isinstance(ei.value, reshard.CheckpointNotFoundError)
    assert "step-00000100" in str(ei.value) and "step-00000200" in str(ei.value)


# ----------------------------------------------------------------------------- retention


def test_retention_policy_with_verified_sidecars(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, every_steps=1, keep_last=2, keep_every=4, keep_best=1)
    for step in range(1, 10):
        r = mgr.maybe_save(step, _state(step), metric=abs(step - 3) + 0.5)  # best: step 3
        assert isinstance(r, reshard.SaveResult)
    # last 2: 8, 9; every 4: 4, 8; best: 3
    assert _steps(root) == [3, 4, 8, 9]
    assert _names(root) == {f"step-{s:08d}" for s in (3, 4, 8, 9)} | {
        f"step-{s:08d}.verified.json" for s in (3, 4, 8, 9)}
    for s in (3, 4, 8, 9):
        assert mgr.is_verified(f"step-{s:08d}")
    d = mgr.apply_retention(dry_run=True)
    assert d.delete == ()
    assert d.keep["step-00000003"].startswith("best")


def test_keep_last_larger_than_count_keeps_all(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=3)
    for step in (1, 2, 3, 4):
        mgr.save(step, _state(step))
        assert _steps(root) == list(range(max(1, step - 2), step + 1))


def test_async_manager_verifies_then_deletes(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, every_steps=1, keep_last=1, use_async=True)
    for step in (1, 2, 3):
        h = mgr.maybe_save(step, _state(step))
        assert isinstance(h, reshard.SaveHandle)
    mgr.wait()
    assert _names(root) == {"step-00000003", "step-00000003.verified.json"}
    state = _blank()
    res = mgr.restore(state)
    assert res is not None
    _assert_is(state, res, 3)


def test_async_manager_failure_reported_once(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    ok = _mgr(root, keep_last=1)
    ok.save(1, _state(1))
    mgr = CheckpointManager(str(root), every_steps=1, keep_last=1, use_async=True,
                            preempt_signals=(), storage=FailingStorage())
    h = mgr.maybe_save(2, _state(2))
    assert isinstance(h, reshard.SaveHandle)
    with pytest.raises(reshard.CheckpointError, match="no space left"):
        mgr.wait()
    mgr.wait()  # reported once: neither wait nor close raises it again
    mgr.close()
    assert _names(root) == {"step-00000001", "step-00000001.verified.json"}
    assert ok.save(3, _state(3)).step == 3  # nor the next save
    assert _steps(root) == [3]


def test_lease_blocks_deletion(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=1)
    mgr.save(1, _state(1))
    with mgr.lease(1) as p:
        assert p == str(root / "step-00000001")
        assert any(".lease-" in n for n in _names(root))
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))
        assert _steps(root) == [1, 3]
        assert mgr.apply_retention().delete == ()
    assert not any(".lease-" in n for n in _names(root))
    mgr.save(4, _state(4))
    assert _steps(root) == [4]
    with mgr.lease(4, ttl_s=-1.0):  # an expired lease holds nothing
        mgr.save(5, _state(5))
        assert _steps(root) == [5]


def test_gc_abandoned(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=1)
    mgr.save(1, _state(1))
    dead = root / "step-00000002.incomplete-20240101T000000-dead"
    dead.mkdir()
    (dead / "data-r00000-0.safetensors").write_bytes(b"x" * 64)
    assert mgr.gc_abandoned() == []  # younger than the default grace
    assert mgr.gc_abandoned(grace_s=0, dry_run=True) == [dead.name]
    assert dead.exists()
    assert mgr.gc_abandoned(grace_s=0) == [dead.name]
    assert not dead.exists()
    assert _steps(root) == [1] and reshard.verify(root / "step-00000001").ok


def test_failed_smoke_test_never_deletes_older_verified(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    st = CorruptingStorage()
    mgr = CheckpointManager(str(root), keep_last=1, preempt_signals=(), storage=st)
    mgr.save(1, _state(1))
    st.bad = {"step-00000002"}
    mgr.save(2, _state(2))  # committed, but its bytes do not match their checksums
    st.bad = set()
    assert reshard.verify(root / "step-00000002", checksums=False).ok
    assert not reshard.verify(root / "step-00000002").ok
    assert mgr.is_verified("step-00000001")
    assert not mgr.is_verified("step-00000002")
    assert (root / "step-00000002.verified.json").exists()
    assert _steps(root) == [1, 2], "the older verified checkpoint was deleted"
    state = _blank()
    with pytest.warns(RuntimeWarning):
        res = mgr.restore(state)
    assert res is not None
    _assert_is(state, res, 1)
    assert [n for n in _names(root) if ".quarantined-" in n and n.startswith("step-00000002")]
    mgr.save(3, _state(3))  # verified; 1 stays: the resume source of this run
    assert _steps(root) == [1, 3]
    res = _mgr(root, keep_last=1).restore(_blank())  # a restart resumes 3: now 1 may go
    assert res is not None and res.step == 3
    _mgr(root, keep_last=1).apply_retention()
    assert _steps(root) == [3]
    # the same through decide() directly
    d = decide([Candidate(name="a", step=1, verified=True),
                Candidate(name="b", step=2, verified=False)], Policy(keep_last=1))
    assert d.delete == () and d.keep["a"] == "newest verified"


RESUMED_THEN_KILLED = textwrap.dedent("""
    import os, sys, torch
    from reshard.manager.manager import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=1, preempt_signals=())
    st = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}, "meta": {"step": -1}}
    assert mgr.restore(st).step == 2
    mgr.save(3, {"model": {"w": torch.full((4, 3), 3.0), "b": torch.arange(5) + 3}, "meta": {"step": 3}})
    pinned = [c.name for c in mgr.candidates() if c.resume_source]
    print("pinned", pinned, flush=True)
    os._exit(0)  # dies without close(): its owner lease stays, unreleased, its process gone
""")


def test_the_resume_source_is_kept_only_while_its_run_lives(tmp_path: Path) -> None:
    """The checkpoint a run resumed from is kept while that run is alive (its
    way back) and not after: the run's close() applies retention once more
    without it (keep_last=1 leaves 1), and once a run that resumed dies,
    neither `reshard gc` nor another manager keeps it for a run that is gone."""
    from click.testing import CliRunner

    from reshard.cli import main

    root = tmp_path / "r"
    first = _mgr(root, keep_last=2)
    first.save(1, _state(1))
    first.save(2, _state(2))
    first.close()
    run = _mgr(root, keep_last=1)
    assert run.restore(_blank()).step == 2
    run.save(3, _state(3))
    run.save(4, _state(4))
    assert [c.name for c in run.candidates() if c.resume_source] == ["step-00000002"]
    assert _steps(root) == [2, 4]  # alive: the resume source stays
    run.close()
    assert _steps(root) == [4]  # closed: keep_last=1 leaves 1
    # a run that resumed and died: nothing pins what it resumed from
    root2 = tmp_path / "d"
    first = _mgr(root2, keep_last=2)
    first.save(1, _state(1))
    first.save(2, _state(2))
    first.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([PY, "-c", RESUMED_THEN_KILLED, str(root2)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and "pinned ['step-00000002']" in out.stdout, out.stderr[-2000:]
    assert _steps(root2) == [2, 3]
    r = CliRunner().invoke(main, ["gc", str(root2), "--keep-last", "1", "--dry-run"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "would delete step-00000002" in r.output and "resume source" not in r.output, r.output


# ----------------------------------------------------------------------------- cadence


def test_every_steps(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, every_steps=3)
    assert [mgr.should_save(s) for s in range(1, 8)] == [False, False, True, False, False, True,
                                                         False]
    assert mgr.maybe_save(4, _state(4)) is None
    assert isinstance(mgr.maybe_save(6, _state(6)), reshard.SaveResult)
    assert _steps(tmp_path) == [6]


def test_every_seconds(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, every_seconds=60.0)
    assert not mgr.should_save(1)
    mgr.last_save_time = time.monotonic() - 61.0
    assert mgr.should_save(1)
    assert isinstance(mgr.maybe_save(1, _state(1)), reshard.SaveResult)
    assert not mgr.should_save(2)  # the save reset the clock
    fast = _mgr(tmp_path / "fast", every_seconds=0.05)
    assert not fast.should_save(1)
    time.sleep(0.06)
    assert fast.should_save(1)


def test_young_daly_interval(tmp_path: Path) -> None:
    assert young_daly_interval(2.0, 100.0) == pytest.approx(20.0)
    for c, m in ((0.5, 3600.0), (12.0, 86400.0), (0.0, 10.0)):
        assert young_daly_interval(c, m) == pytest.approx(math.sqrt(2 * c * m))
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0.0)
    with pytest.raises(ValueError):
        _mgr(tmp_path, interval="auto")  # needs mtbf_s
    mgr = _mgr(tmp_path, interval="auto", mtbf_s=3600.0)
    mgr.costs = [1.0, 3.0]
    assert mgr.current_interval_s() == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))
    mgr.costs = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # the last 5 saves count
    assert mgr.current_interval_s() == pytest.approx(math.sqrt(2 * 1.0 * 3600.0))
    mgr.costs = []
    mgr.save(1, _state(1))  # measures its cost
    assert len(mgr.costs) == 1 and mgr.costs[0] > 0
    iv = math.sqrt(2 * mgr.costs[0] * 3600.0)
    assert mgr.current_interval_s() == pytest.approx(iv)
    mgr.last_save_time = time.monotonic() - iv * 0.5
    assert not mgr.should_save(2)
    mgr.last_save_time = time.monotonic() - iv - 1.0
    assert mgr.should_save(2)


def test_request_preemption_saves_synchronously_and_stops(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, every_steps=100, use_async=True)
    assert mgr.maybe_save(1, _state(1)) is None
    assert not mgr.should_stop
    mgr.request_preemption()
    res = mgr.maybe_save(2, _state(2))
    assert isinstance(res, reshard.SaveResult), "a preemption save must be synchronous"
    assert mgr.should_stop
    assert reshard.verify(tmp_path / "step-00000002").ok and mgr.is_verified("step-00000002")


def test_sigterm_saves_and_stops(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), every_steps=100, use_async=True)  # SIGTERM by default
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    assert not mgr.should_save(1)
    signal.raise_signal(signal.SIGTERM)
    assert mgr.should_save(1)
    res = mgr.maybe_save(1, _state(1))
    assert isinstance(res, reshard.SaveResult) and res.step == 1
    assert mgr.should_stop
    state = _blank()
    r = _mgr(tmp_path).restore(state)
    assert r is not None
    _assert_is(state, r, 1)


def test_retention_keeps_the_target_of_a_link_in_the_root(tmp_path: Path) -> None:
    """An operator's ``best -> step-00000002`` alias pins that checkpoint:
    retention (keep_last=1) keeps it while the link exists, so the link never
    dangles, and deletes it once the link is gone."""
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=1)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    (root / "best").symlink_to("step-00000002")
    for step in (3, 4):
        mgr.save(step, _state(step))
    assert _steps(root) == [2, 4]
    assert (root / "best").resolve().name == "step-00000002"
    assert "link" in mgr.apply_retention(dry_run=True).keep["step-00000002"]
    (root / "best").unlink()
    mgr.save(5, _state(5))
    assert _steps(root) == [5]


def _job(root: Path, job: str) -> CheckpointManager:
    return CheckpointManager(str(root), keep_last=1, job_id=job, preempt_signals=())


def _w(v: float, step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), v), "step": step}


def test_regression_another_job_started_fresh_keeps_the_first_jobs_checkpoints(tmp_path: Path) -> None:
    """Found by a fresh user: job A (keep_last=1) saved step 2 and ended; job
    B (another job id, started fresh: no restore) saved step 1 there, and
    B's retention deleted its own new checkpoint at once (A's step 2 was
    "newer" on the one lineage B had joined), then A's at B's next save; a
    restart of B resumed A's state. Another job now starts a lineage of its
    own: A's checkpoint is never B's to delete, B keeps its newest, and B's
    restart resumes B's saves."""
    root = tmp_path / "shared"
    a = _job(root, "A")
    a.save(2, _w(0.0, 2))
    a.close()
    b = _job(root, "B")
    r = b.save(1, _w(1.0, 1))
    assert _steps(root) == [1, 2] and os.path.isdir(r.path)  # its own first save kept
    b.close()
    b = _job(root, "B")  # B restarting (after a crash, say): its own step 1, not A's step 2
    got = _w(-1.0, 0)
    res = b.restore(got)
    assert res is not None and res.path.endswith("step-00000001") and got["w"][0].item() == 1.0
    b.save(3, _w(3.0, 3))
    b.close()
    assert _steps(root) == [2, 3]  # B's keep_last=1 on B's lineage; A's step 2 untouched
    a = _job(root, "A")  # A again, started without restore: the same job joins the root's lineage
    a.save(4, _w(4.0, 4))
    a.close()
    assert 4 in _steps(root)
