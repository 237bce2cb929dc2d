"""async_save's staging copy threads: every byte staged before the call
returns (the caller's later writes never reach the checkpoint), for tensors
copied in slices, whole non-contiguous ones, and small ones on the caller's
thread; the thread count is validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.saving import staging


def test_staging_threads_copy_every_tensor_before_returning(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(9 << 20, generator=g),  # 36 MiB: three 16 MiB slices
             "strided": torch.randn(1024, 512, generator=g).t(),  # 2 MiB, not contiguous
             "small": torch.randn(100, generator=g), "step": 3}
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    h = reshard.async_save(state, tmp_path / "c", step=1, options=reshard.SaveOptions(staging_threads=3))
    assert h.staged.done()
    for k in ("big", "strided", "small"):
        state[k].fill_(-1.0)  # the caller may mutate once async_save returned
    h.wait()
    got = {"big": torch.zeros(9 << 20), "strided": torch.zeros(512, 1024), "small": torch.zeros(100), "step": 0}
    reshard.load(got, tmp_path / "c")
    for k in ("big", "strided", "small"):
        assert torch.equal(got[k], want[k]), k
    saver = staging.SAVERS["default"]
    assert saver.stager._copiers is not None and saver.stager._copiers._max_workers == 3
    # the next save reuses the pool's buffers: nothing new is allocated
    before = saver.pool.allocated_bytes
    reshard.async_save(want, tmp_path / "d", step=2, options=reshard.SaveOptions(staging_threads=3)).wait()
    assert saver.pool.allocated_bytes == before


def test_staging_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"SaveOptions.staging_threads must be an int >= 1"):
        reshard.SaveOptions(staging_threads=0)


@pytest.mark.parametrize("kw", [{"every_steps": 0}, {"every_steps": 2.5}, {"keep_last": -1},
                                {"keep_every": 0}, {"keep_best": -1}, {"every_seconds": 0},
                                {"timeout_s": 0}, {"every_steps": True}])
def test_manager_refuses_bad_settings_naming_them(tmp_path: Any, kw: dict[str, Any]) -> None:
    """A cadence or retention setting that cannot work (every_steps=0 used to
    be taken and never save) is a ValueError naming the manager's argument."""


    (name,) = kw
    with pytest.raises(ValueError, match=rf"CheckpointManager\({name}=\.\.\.\)"):
        reshard.CheckpointManager(str(tmp_path), **kw)


@pytest.mark.parametrize("bad", [0, 2.5, "4", True])
def test_staging_threads_must_be_a_positive_int(bad: Any) -> None:


    with pytest.raises(ValueError, match="SaveOptions.staging_threads must be an int >= 1"):
        reshard.SaveOptions(staging_threads=bad)
