"""Tests of the multi-process harness itself (real gloo process groups)."""

from __future__ import annotations

import time

import pytest

import _pool_fns as fns
from reshard.testing.pool import WorkerError, WorkerPool


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_sum_on_every_rank(pool: WorkerPool, world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    assert pool.run(world_size, fns.all_reduce_rank) == [expected] * world_size


def test_results_in_rank_order_with_args_and_kwargs(pool: WorkerPool) -> None:
    out = pool.run(3, fns.identity, 10, offset=1)
    assert [o[:3] for o in out] == [(0, 3, 1), (1, 3, 11), (2, 3, 21)]
    assert len({o[3] for o in out}) == 3  # one process per rank


def test_workers_persist_and_are_single_threaded(pool: WorkerPool) -> None:
    pids = [o[3] for o in pool.run(2, fns.identity, 1)]
    assert [o[3] for o in pool.run(2, fns.identity, 1)] == pids
    assert pool.run(2, fns.num_threads) == [(1, "1")] * 2


def test_failure_on_one_rank_is_reported_quickly_and_pool_recovers(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool, "grace", 1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(2, fns.fail_on_rank_one, timeout=30.0)
    assert time.monotonic() - t0 < 10.0
    err = info.value
    assert set(err.failures) == {1}
    name, msg, tb = err.failures[1]
    assert (name, msg) == ("ValueError", "boom from rank 1")
    assert "fail_on_rank_one" in tb
    assert err.hung == [0]
    assert "rank 1 raised ValueError: boom from rank 1" in str(err)
    assert pool.run(2, fns.all_reduce_rank) == [3.0, 3.0]


def test_assertion_on_all_ranks_keeps_workers(pool: WorkerPool) -> None:
    pids = [o[3] for o in pool.run(2, fns.identity, 1)]
    with pytest.raises(WorkerError) as info:
        pool.run(2, fns.all_assert)
    assert sorted(info.value.failures) == [0, 1]
    assert all(f[0] == "AssertionError" for f in info.value.failures.values())
    assert info.value.hung == []
    assert [o[3] for o in pool.run(2, fns.identity, 1)] == pids


def test_restart_gives_new_processes(pool: WorkerPool) -> None:
    before = [o[3] for o in pool.run(2, fns.identity, 1)]
    pool.restart(2)
    after = [o[3] for o in pool.run(2, fns.identity, 1)]
    assert not set(before) & set(after)
    assert pool.run(2, fns.all_reduce_rank) == [3.0, 3.0]


def test_rejects_local_functions(pool: WorkerPool) -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError):
        pool.run(2, local)


def test_timeout_without_failure_kills_and_restarts_group(pool: WorkerPool) -> None:
    with pytest.raises(WorkerError) as info:
        pool.run(1, fns.sleep_for, 60.0, timeout=0.5)
    assert info.value.hung == [0] and info.value.failures == {}
    assert "did not answer within timeout=0.5s" in str(info.value)
    assert pool.run(1, fns.sleep_for, 0.0) == [0]
