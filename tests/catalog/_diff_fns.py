"""Rank functions for tests/catalog/test_diff_logical.py: one training state saved at
any DP size (reshard, its tensors split by rows over the ranks; or PyTorch
DCP), run inside WorkerPool workers (imported by name)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model and AdamW state on every rank (two steps)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for k in range(2):
        opt.zero_grad()
        m(torch.full((2, 4), float(k + 1))).square().sum().backward()
        opt.step()
    opt.zero_grad()
    return m, opt


def _rows(fqn: str, t: torch.Tensor) -> Any:
    """Each rank declares its block of rows (dim 0) of the (replicated) tensor."""
    rank, world = _rank()
    n = t.shape[0]
    lo, hi = n * rank // world, n * (rank + 1) // world
    return reshard.ShardedTensor(fqn, t[lo:hi], global_shape=tuple(t.shape),
                                 global_offset=(lo,) + (0,) * (t.dim() - 1))


def r_save(path: str) -> None:
    rank, world = _rank()
    m, opt = _trained()
    ms = reshard.ModelState(m, layout=_rows)
    cur = reshard.DataCursor(16, 4, seed=1, dp_rank=rank, dp_size=world)
    cur.next_batch()
    reshard.save({"model": ms, "optim": reshard.OptimizerState(ms, opt), "data": cur, "step": 2}, path,
                 step=2)


def r_dcp_save(path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, opt = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=path)
