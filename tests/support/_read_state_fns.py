"""Rank functions for tests/loading/test_read_state.py (run inside WorkerPool workers,
imported by name)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import reshard


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    return m


def r_save_training_state(path: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Every rank saves one training state at ``path`` (step 3): a model and its
    AdamW moments (replicated), an LR scheduler, this rank's RNG streams, a
    row-sharded tensor (rank r holds rows [4r, 4r + 4)), a flat ZeRO shard
    (rank r holds elements [10r, 10r + 10) of a 4 x 5 tensor), and plain
    values. Returns what a reader must find: the full tensors, the values,
    and each rank's RNG state."""
    if env:
        os.environ.update(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for _ in range(3):
        m(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.manual_seed(100 + rank)  # a stream of its own on each rank
    rows = torch.arange(world * 4 * 3, dtype=torch.float32).reshape(world * 4, 3)
    flat = torch.arange(20, dtype=torch.float64).reshape(4, 5)
    state = {
        "model": reshard.ModelState(m), "optim": reshard.OptimizerState(m, opt), "sched": sched,
        "rng": reshard.RNGState(),
        "emb": reshard.ShardedTensor("emb", rows[4 * rank:4 * rank + 4].clone(), global_shape=(world * 4, 3),
                                     global_offset=(4 * rank, 0)),
        "zero": reshard.ShardedTensor("zero", flat.reshape(-1)[10 * rank:10 * rank + 10].clone(),
                                      global_shape=(4, 5), global_offset=(0, 0), local_shape=(4, 5),
                                      flattened_range=slice(10 * rank, 10 * rank + 10)),
        "step": 3, "cfg": {"name": "tiny", "dims": (6, 8, 6)},
    }
    reshard.save(state, path, step=3, options=reshard.SaveOptions(durable=False))
    return {"model": {k: v.detach().clone() for k, v in m.state_dict().items()},
            "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in m.named_parameters()},
            "sched": sched.state_dict(), "emb": rows, "zero": flat, "torch_rng": torch.get_rng_state()}


def r_read_on_rank0_only(path: str) -> Any:
    """Rank 0 reads the checkpoint with read_state (a rank-0-only plug-in
    point) while rank 1 does something else; both return."""
    if dist.get_rank() != 0:
        return None
    out = reshard.read_state(path, keys=["model", "step"])
    return {"keys": sorted(out), "model": sorted(out["model"]), "step": out["step"]}
