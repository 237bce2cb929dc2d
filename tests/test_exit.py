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
    p = subprocess.Popen([sys.executable, str(script), str(ck)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
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
