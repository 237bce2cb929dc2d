"""CUDA paths of staging and loading (DESIGN.md section 2; issue 29 point 3):
device-to-host copies into pinned slabs on one side stream per device made
once, ``staged`` on CUDA events (never a device-wide synchronize), the
sources' memory held for the side stream (``record_stream``), the overlap
mode's guard on device tensors, and loads into CUDA targets through pinned
bounce buffers on a load stream. Skipped without a CUDA device (the project
passes without one); ``benchmarks/gpu_check.py`` measures the same paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.saving.staging_pool import SlabPool

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def no_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device-wide synchronize anywhere in reshard fails the test."""
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.cuda.synchronize() was called")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


@cuda
def test_default_mode_orders_the_callers_stream_after_the_copies(tmp_path: Path, no_device_sync: None) -> None:
    from reshard.saving.staging import _saver

    dev = torch.device("cuda", 0)
    w = torch.arange(1 << 22, dtype=torch.float32, device=dev)
    b = torch.ones(17, dtype=torch.bfloat16, device=dev)
    want_w, want_b = w.cpu(), b.cpu()
    h = reshard.async_save({"w": w, "b": b}, tmp_path / "c", step=1)
    w.add_(1)  # queued on the current stream, which waits for the side stream's copies
    b.mul_(3)
    h.wait()
    stream = _saver(None).stager.stream(dev)
    h2 = reshard.async_save({"w": w}, tmp_path / "d", step=2)
    h2.wait()
    assert _saver(None).stager.stream(dev) is stream  # one side stream per device, made once
    assert _saver(None).pool.pin and _saver(None).pool.pinned_bytes > 0
    got_w, got_b = torch.zeros(1 << 22), torch.zeros(17, dtype=torch.bfloat16)
    reshard.load({"w": got_w, "b": got_b}, tmp_path / "c")
    assert torch.equal(got_w, want_w) and torch.equal(got_b, want_b)


@cuda
def test_a_source_freed_right_after_async_save_is_not_reused_mid_copy(tmp_path: Path) -> None:
    """record_stream: the caller drops its tensor at once and allocates new
    ones of the same size; the allocator must not hand out the source's
    memory while the side stream still copies it."""
    dev = torch.device("cuda", 0)
    opts = reshard.SaveOptions(staging_budget_bytes=64 << 20)
    w = torch.randn(8 << 20, device=dev)  # 32 MiB
    want = w.cpu()
    h = reshard.async_save({"w": w}, tmp_path / "c", step=1, options=opts)
    del w
    junk = [torch.full((8 << 20,), 7.0, device=dev) for _ in range(4)]
    h.wait()
    del junk
    got = torch.zeros(8 << 20)
    reshard.load({"w": got}, tmp_path / "c")
    assert torch.equal(got, want)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlap_mode_on_cuda_guard_and_wait(tmp_path: Path, dtype: torch.dtype) -> None:
    dev = torch.device("cuda", 0)
    opts = reshard.SaveOptions(overlap_staging=True, staging_budget_bytes=1 << 20)
    w = torch.randn(1 << 21, device=dev).to(dtype)  # larger than the budget: staged in pieces
    want = w.cpu()
    h = reshard.async_save({"w": w}, tmp_path / "ok", step=1, options=opts)
    reshard.wait_for_staging(timeout=60)
    w.add_(1)  # after the wait: the checkpoint holds the state at the call
    h.wait()
    got = torch.zeros(1 << 21, dtype=dtype)
    reshard.load({"w": got}, tmp_path / "ok")
    assert torch.equal(got, want)
    h = reshard.async_save({"w": w}, tmp_path / "early", step=2, options=opts)
    w.mul_(2)  # too early: the guard fails the save
    with pytest.raises(reshard.CheckpointError, match="'w' was modified before it was staged"):
        h.wait()
    assert not (tmp_path / "early").exists()


@cuda
def test_load_into_cuda_targets_through_pinned_bounce_buffers(tmp_path: Path, no_device_sync: None) -> None:
    from reshard.loading import bounce

    src = torch.randn(3000, 700)  # 8.4 MB: several bounce segments
    small = torch.randn(33, 7)
    reshard.save({"w": src, "s": small}, tmp_path / "c")
    dst = torch.zeros(3000, 700, device="cuda")
    dsmall = torch.zeros(33, 7, device="cuda")
    reshard.load({"w": dst, "s": dsmall}, tmp_path / "c")
    assert torch.equal(dst.cpu(), src) and torch.equal(dsmall.cpu(), small)
    assert bounce._POOL and all(b.is_pinned() for b in bounce._POOL)
    assert bounce.load_stream(torch.device("cuda", 0)) is bounce.load_stream(torch.device("cuda", 0))


@cuda
def test_slab_pool_pins_host_memory() -> None:
    pool = SlabPool(pin=True)
    pool.configure(1 << 20)
    with pool.cond:
        s = pool.try_acquire()
        assert s is not None and s.buf.is_pinned()
        pool.release(s)
    assert pool.pinned_bytes == pool.allocated_bytes > 0
