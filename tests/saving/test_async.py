"""async_save: snapshot immutability, 0-dim tensors (case 5), flat memory over
repeated saves (case 14), max_pending / if_busy, background errors."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import reshard
from _async_fns import (
    FailingStorage,
    GatedStorage,
    NiceRecordingStorage,
    r_async_mutation,
    r_zero_dim_async_save,
    r_zero_dim_load,
    zero_dim_state,
)
from reshard.saving import staging


@pytest.fixture(autouse=True)
def _drain_async() -> Any:
    """No test leaves a save in flight or an unreported error behind."""
    yield
    staging.wait_all()
    try:
        staging.raise_pending_error()
    except reshard.CheckpointError:
        pass


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 33, generator=g)
    return {
        "model": {"w": torch.randn(17, 5, generator=g), "ids": torch.arange(11, dtype=torch.int64),
                  "mask": torch.rand(9, generator=g) > 0.5, "h": torch.randn(6, generator=g).half()},
        "sharded": reshard.ShardedTensor("sharded", big, global_shape=(64, 33), global_offset=(0, 0)),
        "step": torch.tensor(0, dtype=torch.int64),
    }


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    m = state["model"]
    return {"model.w": m["w"], "model.ids": m["ids"], "model.mask": m["mask"], "model.h": m["h"],
            "sharded": state["sharded"].data, "step": state["step"]}


def _targets(like: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in like["model"].items()},
            "sharded": torch.zeros(64, 33), "step": torch.tensor(-1, dtype=torch.int64)}


def _mutate(state: dict[str, Any], step: int) -> None:
    m = state["model"]
    m["w"].mul_(-3.0).add_(step)
    m["ids"].add_(100 * step)
    m["mask"][step].logical_not_()
    m["h"].add_(1.0)
    state["sharded"].data.mul_(2.0).sub_(step)
    state["step"].fill_(step + 1)


def test_snapshot_survives_in_place_mutation(tmp_path: Path) -> None:
    state = _state()
    storage = GatedStorage()  # no byte is written before the mutations below
    opts = reshard.SaveOptions(max_pending=3, durable=False)
    expected, handles = {}, {}
    for step in (1, 2, 3):
        h = reshard.async_save(state, tmp_path / f"s{step}", step=step, options=opts, storage=storage)
        assert h.staged.done(), "staged must be done when async_save returns (CPU tensors)"
        assert not h.done(), "the gated storage keeps the save in flight"
        expected[step] = {k: v.clone() for k, v in _tensors(state).items()}
        _mutate(state, step)
        handles[step] = h
    storage.gate.set()
    for step, h in handles.items():
        res = h.wait(timeout=30)
        assert res is not None and res.step == step
        assert h.done() and h.committed.done()
    loaded = {}
    for step in (1, 2, 3):
        tgt = _targets(state)
        res = reshard.load(tgt, tmp_path / f"s{step}")
        assert res.step == step
        got = _tensors({**tgt, "sharded": reshard.ShardedTensor(
            "sharded", tgt["sharded"], global_shape=(64, 33), global_offset=(0, 0))})
        for k, want in expected[step].items():
            assert got[k].dtype == want.dtype
            assert torch.equal(got[k], want), f"step {step}: {k} is not the state at request time"
        loaded[step] = got
    for a, b in ((1, 2), (2, 3), (1, 3)):
        for k in loaded[a]:
            assert not torch.equal(loaded[a][k], loaded[b][k]), f"{k}: steps {a} and {b} equal"


def test_snapshot_survives_mutation_on_two_ranks(pool: Any, tmp_path: Path) -> None:
    out = pool.run(2, r_async_mutation, str(tmp_path), 0.2)
    assert out[0]["expected"].keys() == {1, 2, 3}
    for r in out:
        assert r["staged"] == [True, True, True]
        assert r["steps"] == [1, 2, 3]
        assert r["pending_done"] == [True, True, True]
    for k in ("model.w", "model.b"):  # replicated b and gathered w agree across ranks
        for step in (1, 2, 3):
            assert torch.equal(out[0]["expected"][step][k], out[1]["expected"][step][k])
    loaded = {}
    for step in (1, 2, 3):
        tgt = {"model": {"w": torch.zeros(4, 6), "b": torch.zeros(3, dtype=torch.int64)}, "step": -1}
        res = reshard.load(tgt, tmp_path / f"step-{step}")
        assert res.step == step and res.values["step"] == 0
        exp = out[0]["expected"][step]
        assert torch.equal(tgt["model"]["w"], exp["model.w"])
        assert torch.equal(tgt["model"]["b"], exp["model.b"])
        loaded[step] = tgt["model"]
    assert not torch.equal(loaded[1]["w"], loaded[2]["w"])
    assert not torch.equal(loaded[2]["w"], loaded[3]["w"])
    assert not torch.equal(loaded[1]["b"], loaded[3]["b"])


def test_zero_dim_async_on_two_ranks_loads_on_one_and_four(pool: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "zd")
    assert pool.run(2, r_zero_dim_async_save, path) == [(True, 3), (True, 3)]
    want = {"step_f32": ("torch.float32", (), 3.5), "step_bool": ("torch.bool", (), True),
            "step_i64": ("torch.int64", (), 7)}
    state = zero_dim_state(False)
    reshard.load(state, path)  # one rank: this process
    got1 = {k: (str(t.dtype), tuple(t.shape), t.item()) for k, t in state["optim"].items()}
    assert got1 == want
    for k, v in got1.items():
        assert type(v[2]) is type(want[k][2])
    assert pool.run(4, r_zero_dim_load, path) == [want] * 4


def _rss() -> int:
    gc.collect()
    return psutil.Process(os.getpid()).memory_info().rss


def test_repeated_async_saves_keep_memory_flat(tmp_path: Path) -> None:
    """Case 14: 20 async saves of the same ~64 MiB state."""
    state = {f"t{i}": torch.randn(4 << 20) for i in range(4)}  # 4 x 16 MiB float32
    pool_ = staging._saver(None).pool
    opts = reshard.SaveOptions(durable=False)
    rss: list[int] = []
    allocated: list[int] = []
    h = None
    for i in range(20):
        h = reshard.async_save(state, tmp_path / f"c{i}", step=i, options=opts)
        assert h.staged.done()
        allocated.append(pool_.allocated_bytes)
        if i >= 2:  # c{i-1} committed before c{i} was staged (max_pending=1)
            reshard.saving.staging.raise_pending_error()
            assert reshard.verify(tmp_path / f"c{i - 1}", checksums=False).ok
            shutil.rmtree(tmp_path / f"c{i - 2}")
        rss.append(_rss())
    assert h is not None and h.wait(timeout=60).step == 19
    assert len(allocated) == 20 and allocated[0] >= 64 << 20
    assert allocated[-1] == allocated[0], f"staging pool grew: {allocated}"
    growth = max(rss[2:]) - rss[1]
    assert growth < 32 << 20, f"RSS grew by {growth / 2**20:.1f} MiB from save 2 to 20: {rss}"
    t = {k: torch.empty_like(v) for k, v in state.items()}
    reshard.load(t, tmp_path / "c19")
    assert all(torch.equal(t[k], state[k]) for k in state)


def test_max_pending_one_blocks_until_first_committed(tmp_path: Path) -> None:
    state = _state()
    gated = GatedStorage()
    h1 = reshard.async_save(state, tmp_path / "a", step=1, storage=gated,
                            options=reshard.SaveOptions(max_pending=1, durable=False))
    assert not h1.done()
    opener = threading.Timer(0.3, gated.gate.set)
    opener.start()
    h2 = reshard.async_save(state, tmp_path / "b", step=2, storage=gated,
                            options=reshard.SaveOptions(max_pending=1, durable=False))
    opener.join()
    assert h1.done() and h1.exception() is None, "second async_save returned before the first committed"
    assert reshard.inspect(tmp_path / "a").step == 1
    assert h2.stall_s >= 0.2  # the caller was blocked for the first save
    assert h2.wait(timeout=30).step == 2


def test_if_busy_skip_skips_with_warning(tmp_path: Path) -> None:
    state = _state()
    gated = GatedStorage()
    h1 = reshard.async_save(state, tmp_path / "a", step=1, storage=gated,
                            options=reshard.SaveOptions(durable=False))
    assert not h1.done()
    with pytest.warns(RuntimeWarning, match="skipped"):
        h2 = reshard.async_save(state, tmp_path / "b", step=2, storage=gated,
                                options=reshard.SaveOptions(if_busy="skip", durable=False))
    assert h2.skipped and h2.done() and h2.wait() is None
    assert not h1.done(), "a skipped request must not wait for the one in flight"
    gated.gate.set()
    assert h1.wait(timeout=30).step == 1
    assert not (tmp_path / "b").exists()
    assert not any("b" == p.name.split(".")[0] for p in tmp_path.iterdir())
    assert reshard.latest(tmp_path) == str(tmp_path / "a")
    # no longer busy: the next request with if_busy="skip" saves
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h3 = reshard.async_save(state, tmp_path / "c", step=3, storage=gated,
                                options=reshard.SaveOptions(if_busy="skip", durable=False))
    assert not h3.skipped and h3.wait(timeout=30).step == 3


def _nothing_published(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["ok"], sorted(root.iterdir())


def test_background_error_surfaces_on_wait(tmp_path: Path) -> None:
    state = _state()
    reshard.save(state, tmp_path / "ok", step=0)
    h = reshard.async_save(state, tmp_path / "bad", step=1, storage=FailingStorage())
    assert h.staged.done()
    with pytest.raises(reshard.CheckpointError, match="no space left"):
        h.wait(timeout=30)
    assert isinstance(h.exception(), reshard.CheckpointError)
    _nothing_published(tmp_path)
    assert reshard.latest(tmp_path) == str(tmp_path / "ok")
    # the error was reported by wait(): the next saves do not raise it again
    reshard.save(state, tmp_path / "next", step=2)
    assert reshard.async_save(state, tmp_path / "next2", step=3).wait(timeout=30).step == 3


@pytest.mark.parametrize("then", ["save", "async_save"])
def test_unconsumed_background_error_never_costs_the_next_call(tmp_path: Path, then: str) -> None:
    """An earlier failure nobody waited for is surfaced once, as a warning,
    by the next call, which saves its own step."""
    state = _state()
    reshard.save(state, tmp_path / "ok", step=0)
    h = reshard.async_save(state, tmp_path / "bad", step=1, storage=FailingStorage())
    assert isinstance(h.committed.exception(timeout=30), reshard.CheckpointError)  # not consumed
    call = reshard.save if then == "save" else reshard.async_save
    with pytest.warns(RuntimeWarning, match="step 1 .* failed earlier .*no space left.* step 2 goes ahead"):
        out = call(state, tmp_path / "next", step=2)
    if then == "async_save":
        out = out.wait(timeout=30)
    assert out.step == 2 and reshard.verify(tmp_path / "next").ok
    with warnings.catch_warnings():  # surfaced once
        warnings.simplefilter("error")
        out = call(state, tmp_path / "next2", step=3)
        if then == "async_save":
            out = out.wait(timeout=30)
    assert reshard.latest(tmp_path) == str(tmp_path / "next2")


def test_staging_pool_does_not_grow_when_sizes_change(tmp_path) -> None:
    """A state whose tensor sizes change between saves does not grow the
    pool: its slabs do not depend on the tensors' sizes, and every save
    reuses those of the first (within its staging budget)."""
    import reshard
    from reshard.saving.staging import _saver, wait_all

    opts = reshard.SaveOptions(staging_budget_bytes=1 << 20)
    reshard.async_save({"w": torch.zeros(60_000)}, tmp_path / "first", step=0, options=opts).wait()
    wait_all()
    pool = _saver(None).pool
    first = pool.allocated_bytes
    for i in range(6):
        h = reshard.async_save({"w": torch.zeros(1000 + 9000 * i)}, tmp_path / f"c{i}", step=i + 1,
                               options=opts)
        h.wait()
    wait_all()
    assert 0 < pool.allocated_bytes == first <= 1 << 20


@pytest.mark.skipif(not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"),
                    reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("files", [1, 2])
def test_background_writer_runs_at_lower_priority(tmp_path: Path, files: int) -> None:
    """The background save (and the writer threads it starts) runs
    ``background_nice`` above the caller's nice value; the caller's own
    priority is left as it was; ``background_nice=0`` keeps the caller's."""
    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, me)
    state = _state()
    rec = NiceRecordingStorage()
    opts = reshard.SaveOptions(durable=False, files_per_rank=files, background_nice=5)
    reshard.async_save(state, tmp_path / "a", step=1, storage=rec, options=opts).wait(timeout=60)
    assert rec.nice == [min(19, before + 5)] * files
    assert os.getpriority(os.PRIO_PROCESS, me) == before
    rec.nice.clear()
    reshard.async_save(state, tmp_path / "b", step=2, storage=rec,
                       options=reshard.SaveOptions(durable=False, background_nice=0)).wait(timeout=60)
    assert rec.nice == [before]
    t = _targets(state)
    reshard.load(t, tmp_path / "a")
    assert all(torch.equal(a, b) for a, b in zip(_tensors(t).values(), _tensors(state).values(), strict=True))
    with pytest.raises(ValueError, match="background_nice"):
        reshard.SaveOptions(background_nice=-1)
