"""Rank functions for tests/adapters/test_rng_timing.py (run inside WorkerPool workers,
imported by name)."""

from __future__ import annotations

from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import reshard

STEPS, SAVE_AT = 6, 3


def _loader() -> DataLoader:
    # the samples come in a fixed order (no sampler draws): only iter()'s own draw matters
    rank = dist.get_rank()
    data = TensorDataset(torch.arange(48, dtype=torch.float32).reshape(24, 2) + 100 * rank)
    return DataLoader(data, batch_size=4)


def _step(batch: Any) -> torch.Tensor:
    return torch.nn.functional.dropout(batch[0], p=0.5)  # draws from the global torch generator


def r_restore_timing(path: str) -> dict[str, bool]:
    """The uninterrupted run saves its RNG streams after step SAVE_AT (mid-epoch:
    its iterator exists); runs resumed from there restore them before or after
    ``iter(loader)``. Returns which resumed runs match the uninterrupted one
    bitwise from the first resumed step."""
    torch.manual_seed(1234 + dist.get_rank())
    it = iter(_loader())
    ref = []
    for i in range(STEPS):
        ref.append(_step(next(it)))
        if i + 1 == SAVE_AT:
            reshard.save({"rng": reshard.RNGState()}, path, step=SAVE_AT,
                         options=reshard.SaveOptions(durable=False))

    def resumed(order: str) -> list[torch.Tensor]:
        torch.manual_seed(99)  # a fresh process: any state
        rng = reshard.RNGState()
        if order == "restore, then iter":
            reshard.load({"rng": rng}, path)
            it = iter(_loader())
        elif order == "iter, then restore":
            it = iter(_loader())
            reshard.load({"rng": rng}, path)
        else:  # "load, iter, restore again": reshard.load first, then restore once the iterator exists
            reshard.load({"rng": rng}, path)
            it = iter(_loader())
            assert rng.loaded is not None
            rng.restore(rng.loaded)
        it = islice(it, SAVE_AT, None)  # the data position (a DataCursor in a real loop)
        return [_step(b) for b in it][:STEPS - SAVE_AT]

    out = {}
    for order in ("restore, then iter", "iter, then restore", "load, iter, restore again"):
        got = resumed(order)
        out[order] = all(torch.equal(a, b) for a, b in zip(got, ref[SAVE_AT:], strict=True))
    return out
