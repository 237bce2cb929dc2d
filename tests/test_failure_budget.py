"""The failure budget (DESIGN section 1): a fault costs at most the save it
hit. Real processes (gloo ranks), a real tmpfs for ENOSPC (skipped where
``mount`` is not allowed)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from _budget_fns import r_async_enospc_then_next_save
from reshard.testing.pool import WorkerPool


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs root and mount permission; skipped elsewhere)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(120)
def test_failed_async_save_never_costs_the_next(pool: WorkerPool, tmpfs: Path) -> None:
    """A background save that hits ENOSPC is reported at once (one line on
    the coordinator naming step, path and cause; the hook on every rank; the
    handle), and the next maybe_save saves its own step once there is room."""
    root = str(tmpfs / "ckpts")
    outs = pool.run(2, r_async_enospc_then_next_save, root, timeout=100)
    for rank, o in enumerate(outs):
        assert o["err"] == "StorageError"
        assert o["hooked"] == [(2, f"{root}/step-00000002", "StorageError")]
        assert o["step3"] == 3
        assert o["latest"] == f"{root}/step-00000003"
        assert o["warned"] == []  # the hook reported it: no second report
        if rank == 0:
            assert len(o["lines"]) == 1 and "no space left" in o["lines"][0].lower(), o["lines"]
            assert f"{root}/step-00000002" in o["lines"][0]
        else:
            assert o["lines"] == []
