"""Collective misuse fails fast and clearly (issue 27 points 3 and 5): a save,
async_save or load called on rank 0 only (as Lightning's CheckpointIO is)
fails there within the arrival bound with a CheckpointError naming the rank
that did not arrive and the phase, never a raw DistStoreError and never the
checkpoint timeout; the ranks stay usable; ranks a little late still meet."""

from __future__ import annotations

from pathlib import Path

from _arrival_fns import r_rank0_only, r_together
from reshard.testing.pool import WorkerPool

BOUND = 2.0


def test_a_rank0_only_call_fails_fast_and_the_ranks_stay_usable(pool: WorkerPool, tmp_path: Path) -> None:
    root = str(tmp_path)
    first = pool.run(2, r_together, root, "together", timeout=60)  # a checkpoint for the load below
    assert first[0]["step"] == 5
    got = pool.run(2, r_rank0_only, root, BOUND, timeout=60)[0]
    assert set(got) == {"save", "async_save", "load"}
    for name, r in got.items():
        assert r.get("checkpoint_error"), (name, r)
        assert r["type"] == "CheckpointError", (name, r)  # not torch's DistStoreError
        assert BOUND <= r["seconds"] < BOUND + 8, (name, r["seconds"])  # not timeout_s (600 s)
        assert r["absent"] == [1], (name, r)
        msg = r["message"]
        assert "rank 1 of the 2 ranks of the group did not arrive" in msg, msg
        assert "phase arrival" in msg and "SingleProcess()" in msg, msg
    assert got["save"]["message"].startswith(f"save of step 5 at {root}/solo:")
    assert got["load"]["message"].startswith(f"load of {root}/together:")
    # both ranks go on: a save and a load together, and a collective of the training group
    after = pool.run(2, r_together, root, "after", timeout=60)
    assert [a["sum"] for a in after] == [2.0, 2.0]
    assert after[0]["w"] == [float(i) for i in range(8)] and after[1]["w"] == [float(i) for i in range(8, 16)]


def test_a_rank_late_within_the_bound_still_meets(pool: WorkerPool, tmp_path: Path) -> None:
    out = pool.run(2, r_together, str(tmp_path), "late", 1, 1.0, 4.0, timeout=60)
    assert [o["step"] for o in out] == [5, 5]


def test_a_manager_save_or_restore_on_rank0_only_fails_fast(pool: WorkerPool, tmp_path: Path) -> None:
    """CheckpointManager.save and .restore run collectives of their own before
    reshard.save / load (the lineage, the name, the listing): they check in
    first too, so called on rank 0 alone they fail within the arrival bound
    naming rank 1, not after the manager's 30 s timeout."""
    from _arrival_fns import r_manager_rank0_only

    got = pool.run(2, r_manager_rank0_only, str(tmp_path / "m"), BOUND, timeout=120)[0]
    assert set(got) == {"save", "restore"}
    for name, r in got.items():
        assert r.get("type") == "CheckpointError", (name, r)
        assert BOUND <= r["seconds"] < BOUND + 8, (name, r["seconds"])
        assert r["absent"] == [1], (name, r)
        assert "rank 1 of the 2 ranks of the group did not arrive" in r["message"], r["message"]
    assert got["save"]["message"].startswith(f"CheckpointManager.save of step 3 under {tmp_path / 'm'}:")
    assert got["restore"]["message"].startswith(f"CheckpointManager.restore of {tmp_path / 'm'}:")
    after = pool.run(2, r_together, str(tmp_path), "after-manager", timeout=60)
    assert [a["sum"] for a in after] == [2.0, 2.0]


def test_a_process_that_makes_its_default_group_again_saves_and_loads(pool: WorkerPool,
                                                                     tmp_path: Path) -> None:
    """reshard keeps per-process state made from the default group (checkpoint
    groups, background savers, broken-group marks, counts): a process that
    destroys its default group and initialises a new one saves, saves in the
    background, and saves and restores with a manager again, with nothing
    reset by hand."""
    from _arrival_fns import r_after_a_new_default_group

    got = pool.run(2, r_after_a_new_default_group, str(tmp_path), timeout=120)
    assert got == [{"before": [4, 2], "after": [4, 2]}] * 2


def test_a_store_host_stopped_in_group_creation_fails_within_the_timeout(pool: WorkerPool) -> None:
    """Found by the fault matrix (``sigstop-load/load--/manifest/stop/rank0/timeout3s``,
    now and then under load): every rank arrived, then rank 0, which hosts
    the job's store, stopped while rank 1 was still making the checkpoint
    group. Rank 1 waited on the store for its own timeout (the training
    group's, 30 s here), past the checkpoint's 3 s, and raised torch's raw
    DistStoreError. Now a CheckpointError in phase group within the bound."""
    from _arrival_fns import r_store_host_stops_in_group_creation

    try:
        got = pool.run(2, r_store_host_stops_in_group_creation, 3.0, timeout=90)
    finally:
        pool.restart(2)  # the two ranks made different numbers of groups: a fresh pair for the next test
    r1 = got[1]
    assert r1["type"] == "CheckpointError", r1
    assert "load of x: the checkpoint group was not made within 8 s (its timeout 3 s + 5 s) (phase group" in r1["message"], r1
    assert r1["seconds"] < 3.0 + 5 + 4, r1  # not the store's 30 s
    assert got[0]["type"] == "CheckpointError", got[0]  # rank 0, woken, fails the same way
