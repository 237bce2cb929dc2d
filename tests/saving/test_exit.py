"""Process exit with an asynchronous save in flight: exit waits for the
commit; a second Ctrl-C during that wait abandons it without publishing."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import sys, time, torch, reshard
    from reshard.storage import LocalStorage

    class Slow(LocalStorage):
        def open_write(self, path, *, durable=True):
            s = super().open_write(path, durable=durable)
            w = s.write
            def write(data):
                time.sleep(0.4)
                w(data)
            s.write = w if path.endswith("manifest.json") else write
            return s

    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(8)}
    h = reshard.async_save(state, sys.argv[1], step=1, storage=Slow(),
                           options=reshard.SaveOptions(files_per_rank=1))
    print("staged", h.staged.done(), flush=True)
    time.sleep(60)  # the training loop; Ctrl-C ends it
""")


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ck = tmp_path / "ck"
    # SIGINT as a terminal delivers it: a suite started in the background of a
    # non-interactive shell (`cmd &`) passes SIGINT ignored to its children,
    # and Python then installs no KeyboardInterrupt handler at all
    p = subprocess.Popen([sys.executable, str(script), str(ck)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "staged True"
    return p, ck


@pytest.mark.parametrize("interrupts", [1, 2])
def test_exit_waits_for_the_commit_and_a_second_ctrl_c_abandons_it(tmp_path: Path,
                                                                   interrupts: int) -> None:
    p, ck = _start(tmp_path)
    p.send_signal(signal.SIGINT)  # ends the training loop: exit waits for the pending save
    if interrupts == 2:
        time.sleep(0.6)
        p.send_signal(signal.SIGINT)  # abandon it
    p.wait(timeout=60)
    if interrupts == 1:
        assert (ck / "manifest.json").is_file(), p.stderr.read() if p.stderr else ""
    else:
        assert not (ck / "manifest.json").exists()
        assert not ck.exists()  # nothing published; the attempt is ignored by every reader


ENDS_SCRIPT = SCRIPT.replace("files_per_rank=1", "files_per_rank=4").replace(
    "time.sleep(60)  # the training loop; Ctrl-C ends it\n", "")


def test_a_program_ending_without_wait_commits_its_async_save(tmp_path: Path) -> None:
    """The program returns right after ``async_save`` (no wait, no Ctrl-C):
    exit waits for the commit. Regression: the interpreter's thread shutdown
    stopped concurrent.futures' pools before the atexit hook waited, so the
    save's writer/commit pools refused work and nothing was published."""
    script = tmp_path / "job.py"
    script.write_text(ENDS_SCRIPT)
    assert "time.sleep(60)" not in ENDS_SCRIPT and "files_per_rank=4" in ENDS_SCRIPT
    ck = tmp_path / "ck"
    p = subprocess.run([sys.executable, str(script), str(ck)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (ck / "manifest.json").is_file(), p.stderr

    import torch

    import reshard

    tgt = {f"t{i}": torch.zeros(1024) for i in range(8)}
    reshard.load(tgt, str(ck))
    assert all(torch.equal(tgt[f"t{i}"], torch.full((1024,), float(i))) for i in range(8))


FAILS_SCRIPT = textwrap.dedent("""
    import errno, sys, torch, reshard
    from reshard.storage import LocalStorage

    class Full(LocalStorage):  # the disk fills up under the background save's data files
        def open_write(self, path, *, durable=True):
            s = super().open_write(path, durable=durable)
            if not path.endswith("manifest.json"):
                def write(data):
                    raise OSError(errno.ENOSPC, "No space left on device", path)
                s.write = write
            return s

    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(8)}
    h = reshard.async_save(state, sys.argv[1], step=3, storage=Full())
    print("staged", h.staged.done(), flush=True)
    if sys.argv[2] == "wait":
        try:
            h.wait()
        except reshard.CheckpointError as e:
            print("caught", type(e).__name__, flush=True)
""")


@pytest.mark.parametrize("waits", [False, True])
def test_a_failed_save_never_waited_for_is_named_at_exit(tmp_path: Path, waits: bool) -> None:
    """A background save that fails when the program ends without waiting for
    it: exit names it on stderr (path, step, the error) and publishes nothing.
    Regression: the failure was dropped silently (exit 0, no message, no
    checkpoint). A failure the program already caught through wait() is not
    repeated."""
    script = tmp_path / "job.py"
    script.write_text(FAILS_SCRIPT)
    ck = tmp_path / "ck"
    p = subprocess.run([sys.executable, str(script), str(ck), "wait" if waits else "no"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not ck.exists()  # nothing published
    note = [ln for ln in p.stderr.splitlines() if ln.startswith("reshard: the asynchronous save")]
    if waits:
        assert "caught" in p.stdout and note == [], p.stderr
    else:
        assert note == [f"reshard: the asynchronous save of step 3 to {ck} failed and was never waited "
                        f"for (nothing published): {note[0].split('(nothing published): ', 1)[1]}"]
        assert "No space left on device" in note[0], p.stderr
