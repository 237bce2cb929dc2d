"""CUDA paths of the asynchronous save: device-to-host copies into pinned
staging buffers on a side stream, synchronised before ``staged``. Skipped
without a CUDA device (the project passes without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from reshard.saving.staging import BufferPool

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_async_save_of_cuda_tensors_snapshots_before_staged(tmp_path: Path) -> None:
    dev = torch.device("cuda", 0)
    w = torch.arange(1 << 20, dtype=torch.float32, device=dev)
    b = torch.ones(17, dtype=torch.bfloat16, device=dev)
    want_w, want_b = w.cpu(), b.cpu()
    h = reshard.async_save({"w": w, "b": b}, tmp_path / "c", step=1)
    assert h.staged.done()
    w.add_(1)  # the training step overwrites the device tensors right away
    b.mul_(3)
    torch.cuda.synchronize()
    h.wait()
    got_w, got_b = torch.zeros(1 << 20), torch.zeros(17, dtype=torch.bfloat16)
    reshard.load({"w": got_w, "b": got_b}, tmp_path / "c")
    assert torch.equal(got_w, want_w) and torch.equal(got_b, want_b)


@cuda
def test_load_into_cuda_targets(tmp_path: Path) -> None:
    src = torch.randn(33, 7)
    reshard.save({"w": src}, tmp_path / "c")
    dst = torch.zeros(33, 7, device="cuda")
    reshard.load({"w": dst}, tmp_path / "c")
    assert torch.equal(dst.cpu(), src)


@cuda
def test_buffer_pool_pins_host_memory() -> None:
    pool = BufferPool(pin=True)
    buf = pool.take(4096)
    assert buf.is_pinned()
    pool.give_back([buf])
    assert pool.take(4096) is buf and pool.allocated_bytes == 4096
