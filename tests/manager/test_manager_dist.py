"""CheckpointManager used collectively on 2 gloo ranks, across restarts (each
``pool.run`` builds new managers): a torn checkpoint is quarantined and the
next save of its step proceeds under a suffixed name, without a crash loop;
a deliberate rollback keeps the resume source while the run lives and the
new lineage, and resumes on the current lineage; the abandoned branch and the current lineage both
keep their step-150 checkpoints, under distinct names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import reshard
from _manager_fns import r_run
from reshard.cli import main

N = 2


def _names(root: Path) -> set[str]:
    """The root's entries, less the owner record of the job saving there (and its lock)."""
    return {p.name for p in root.iterdir() if p.name not in ("OWNER", "OWNER.lock")}


def _ckpts(root: Path) -> set[str]:
    return {n for n in _names(root) if (root / n / "manifest.json").exists() and ".quarantined-" not in n}


def _run(pool: Any, root: Path, **kw: Any) -> dict[str, Any]:
    outs = pool.run(N, r_run, str(root), timeout=120.0, **kw)
    assert all(o == outs[0] for o in outs[1:]), f"ranks disagree: {outs}"
    return outs[0]


def _break(d: Path, how: str) -> None:
    f = sorted(d.glob("*.safetensors"))[-1]
    if how == "deleted":
        f.unlink()
    else:  # same size, flipped tensor bytes: only checksums tell (keep the stale verified record)
        raw = bytearray(f.read_bytes())
        for i in range(1, 5):
            raw[-i] ^= 0xFF
        f.write_bytes(bytes(raw))


@pytest.mark.parametrize(("mode", "how"), [("sync", "flipped"), ("async", "deleted")])
def test_restore_past_torn_then_save_that_step_no_loop(pool: Any, tmp_path: Path, mode: str,
                                                       how: str) -> None:
    root = tmp_path / "ckpts"
    use_async = mode == "async"
    first = _run(pool, root, restore=False, saves=[(100, 1), (150, 1)], use_async=use_async)
    assert first["saved"] == ["step-00000100", "step-00000150"]
    _break(root / "step-00000150", how)
    # restart 1: 150 is unloadable -> quarantined on every rank's word, fall back to 100,
    # then the save of step 150 proceeds under a suffixed name
    second = _run(pool, root, saves=[(150, 2)], keep_last=1, use_async=use_async)
    assert second["restored"] == ("step-00000100", 100, 1)
    assert len(second["fallback"]) == 1 and "step-00000150" in second["fallback"][0]
    assert any("quarantined as step-00000150.quarantined-" in w for w in second["warnings"])
    assert second["saved"] == ["step-00000150.1"]
    quarantined = [n for n in _names(root) if n.startswith("step-00000150.quarantined-")
                   and not n.endswith(".json")]
    assert len(quarantined) == 1, _names(root)
    assert "step-00000150" not in _names(root) and "step-00000150.verified.json" not in _names(root)
    assert reshard.latest(root) == str(root / "step-00000150.1")
    # restart 2: resumes the new 150 (run 2's state), no fall back, and the next save works
    third = _run(pool, root, saves=[(160, 3)], keep_last=1, use_async=use_async)
    assert third["restored"] == ("step-00000150.1", 150, 2)
    assert third["fallback"] == [] and third["warnings"] == []
    assert third["saved"] == ["step-00000160"]
    # the resume source (150.1) was kept while the run lived; its close released it and
    # retention kept the newest (keep_last=1); the quarantined one is never deleted
    assert third["pinned"] == ["step-00000150.1"]
    assert _ckpts(root) == {"step-00000160"}
    assert (root / quarantined[0]).is_dir()
    r = CliRunner().invoke(main, ["ls", str(root)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    committed_part, _, rest = r.stdout.partition("quarantined (1")
    assert quarantined[0] not in committed_part and quarantined[0] in rest
    assert "committed (1)" in committed_part
    r = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1", "--grace", "0"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and f"kept {quarantined[0]} (quarantined" in r.stdout, r.output
    assert (root / quarantined[0]).is_dir()


def test_rollback_keeps_resume_source_and_new_lineage(pool: Any, tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _run(pool, root, restore=False, saves=[(100, 1), (150, 1)])
    # a loss spike at 150: restore 100 on purpose, save 110 with keep_last=1
    back = _run(pool, root, restore=100, saves=[(110, 2)], keep_last=1)
    assert back["restored"] == ("step-00000100", 100, 1) and back["fallback"] == []
    assert back["saved"] == ["step-00000110"]
    # 100 (the resume source) is kept while the run lives (its way back) and released when it
    # closes; 150, the abandoned branch, is kept until the current lineage has a newer verified
    # checkpoint
    assert back["pinned"] == ["step-00000100"]
    assert _ckpts(root) == {"step-00000110", "step-00000150"}
    assert reshard.latest(root) == str(root / "step-00000110")
    assert back["latest_step"] == 110
    # the new lineage reaches step 150 again: a distinct name, both kept, latest on this lineage
    again = _run(pool, root, restore=True, saves=[(150, 3)], keep_last=2)
    assert again["restored"] == ("step-00000110", 110, 2)
    assert again["saved"] == ["step-00000150.1"]
    assert {"step-00000150", "step-00000150.1"} <= _ckpts(root)
    assert reshard.latest(root) == str(root / "step-00000150.1")
    assert reshard.inspect(root / "step-00000150.1").parent == "step-00000110"
    assert reshard.inspect(root / "step-00000150").parent == "step-00000100"
    r = CliRunner().invoke(main, ["ls", str(root)], catch_exceptions=False)
    lines = {ln.split()[-1]: ln for ln in r.stdout.splitlines() if " step-0000" in ln}
    assert "other" in lines["step-00000150"] and "current" in lines["step-00000150.1"]
    assert "HEAD" in lines["step-00000110"] and "step-00000110" in lines["step-00000150.1"]
    # restart: resumes the current lineage's 150 (run 3), not the abandoned one; a run's
    # retention deletes its own lineage only: the abandoned branch stays until collected
    last = _run(pool, root, restore=True, saves=[(160, 4)], keep_last=1)
    assert last["restored"] == ("step-00000150.1", 150, 3)
    assert _ckpts(root) == {"step-00000150", "step-00000160"}  # 110 and 150.1: released at close
    # collected explicitly: once the lineage has a verified checkpoint past it
    r = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1", "--grace", "0",
                                  "--collect-other-lineages"], catch_exceptions=False)
    assert r.exit_code == 0 and "deleted step-00000150\n" in r.stdout, r.output
    assert _ckpts(root) == {"step-00000160"}
