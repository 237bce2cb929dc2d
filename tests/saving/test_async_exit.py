"""Interpreter exit with an asynchronous save in flight: the process ends with
rc 0, the save committed complete (``reshard.saving.staging._at_exit`` waits for it
and joins every background save thread), and no background thread frees a
tensor during finalisation (which used to end the process with SIGABRT,
"terminate called without an active exception": a thread that takes the GIL
back after finalisation began is ended by pthread_exit inside libtorch's
noexcept deallocator)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import reshard

# many small tensors: the background thread used to free each staged view
# after the commit woke the exiting caller (each free releases the GIL), so
# the race with finalisation was lost in most runs (5 of 6 measured)
_SCRIPT = """
import sys, torch, reshard
state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
state["step"] = 1
reshard.async_save(state, sys.argv[1], step=1)
if len(sys.argv) > 2:
    reshard.async_save(state, sys.argv[2], step=2)   # a second one queued behind it
"""


def _run(tmp_path: Path, *paths: Path) -> subprocess.CompletedProcess[str]:
    src = str(Path(reshard.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _SCRIPT, *map(str, paths)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_exit_right_after_async_save_commits_and_ends_cleanly(tmp_path: Path) -> None:
    for i in range(4):
        ck = tmp_path / f"ck{i}"
        p = _run(tmp_path, ck)
        assert p.returncode == 0, f"run {i}: rc {p.returncode}\n{p.stdout}{p.stderr}"
        assert "terminate called" not in p.stderr, p.stderr
        rep = reshard.verify(str(ck))
        assert rep.ok, rep.problems


def test_exit_with_two_queued_async_saves_commits_both(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    p = _run(tmp_path, a, b)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout}{p.stderr}"
    for ck, step in ((a, 1), (b, 2)):
        rep = reshard.verify(str(ck))
        assert rep.ok, rep.problems
        assert reshard.load({}, str(ck), strict=False).step == step
