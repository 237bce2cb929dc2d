"""A training job with two checkpoint tiers, killed by tests/manager/test_tiers.py.

``python _tier_job.py LOCAL REMOTE``: saves steps 1..3 to the local tier,
each copied to the remote tier in the background; waits for the copies of
steps 1 and 2, prints ``saved 3`` once step 3 is committed locally (its copy
is then in flight) and sleeps until killed. The AWS variables come from the
environment."""

from __future__ import annotations

import sys
import time

import torch

from reshard.manager.tiers import TieredCheckpointManager


def state(step: int) -> dict[str, object]:
    return {"w": torch.arange(4096, dtype=torch.float32) * step, "step": step}


def main() -> None:
    tm = TieredCheckpointManager(sys.argv[1], sys.argv[2], local_every=1, remote_every=1,
                                 keep_local=3)
    for step in (1, 2):
        tm.save(step, state(step))
        tm.wait(timeout=60)
    assert all(r.error is None for r in tm.copies), tm.copies
    tm.save(3, state(3))
    print("saved 3", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
