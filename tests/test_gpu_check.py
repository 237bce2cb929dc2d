"""``benchmarks/gpu_check.py --self-check``: the one-GPU check's CPU-only
mode runs every check that needs no device (mutation right after
``staged`` for bf16, fp32 and a DTensor on a 1-process mesh, default and
overlap mode, the guard; the stall and load floors) and exits 0, within
30 s, so the script the lead runs on a lent GPU is known to work."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_gpu_check_self_check_passes() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--self-check"],
                       capture_output=True, text=True, env=env, timeout=110)
    took = time.perf_counter() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all checks passed" in p.stdout
    for kind in ("bf16", "fp32", "dtensor"):
        assert f"{kind:8s} default True  after-staged True  overlap True  guard-caught-early-mutation True" \
            in p.stdout, p.stdout
    assert "device-wide synchronize calls in async_save: 0" in p.stdout
    print(f"gpu_check --self-check: {took:.1f} s")
