"""Rank functions for tests/ondisk/test_dcp.py (run inside WorkerPool workers).

``r_fsdp2_dcp_save`` trains a tiny FSDP2 MLP one AdamW step on a 1-D CPU mesh
and saves it with ``torch.distributed.checkpoint``; it returns the full
tensors (``full_tensor()``) and the param groups as the expected values.
``r_load_rows`` loads a checkpoint (DCP or reshard) with ``reshard.load`` into
ShardedTensors that split dim 0 of every tensor over the ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard


def _mlp() -> nn.Module:
    m = nn.Sequential()
    m.add_module("fc1", nn.Linear(8, 10))  # 10 rows over 4 ranks: 3, 3, 3, 1
    m.add_module("act", nn.ReLU())
    m.add_module("fc2", nn.Linear(10, 3))  # 3 rows over 4 ranks: 1, 1, 1, 0 (an empty shard)
    return m


def r_fsdp2_dcp_save(path: str) -> dict[str, Any] | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    mesh = init_device_mesh("cpu", (world,))
    for sub in (model.fc1, model.fc2):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1 + rank))
    model(x).square().sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.save(state, checkpoint_id=path)
    expected: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, DTensor):
            expected[prefix] = x.full_tensor().clone()  # collective: every rank
        elif isinstance(x, torch.Tensor):
            expected[prefix] = x.detach().clone()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", {"model": msd, "optim": {"state": osd["state"]}})
    if rank != 0:
        return None
    return {"tensors": expected, "param_groups": osd["param_groups"]}


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def r_load_rows(path: str, shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Any]:
    """Load every tensor of ``shapes`` (fqn -> (global shape, dtype name)),
    dim 0 split over the ranks (0-dim tensors whole), plus the param groups;
    returns this rank's pieces and the load's values."""
    from reshard.state.sharding import torch_dtype

    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {}
    pieces: dict[str, tuple[int, int, torch.Tensor]] = {}
    for i, (fqn, (shape, dt)) in enumerate(sorted(shapes.items())):
        if not shape:
            t = torch.full((), float("nan")).to(torch_dtype(dt))
            state[f"t{i}"] = reshard.ShardedTensor(fqn, t, global_shape=(), global_offset=())
            pieces[fqn] = (0, 0, t)
            continue
        a, b = _rows(shape[0], rank, world)
        t = torch.full((b - a, *shape[1:]), float("nan")).to(torch_dtype(dt))
        state[f"t{i}"] = reshard.ShardedTensor(fqn, t, global_shape=tuple(shape),
                                               global_offset=(a,) + (0,) * (len(shape) - 1))
        pieces[fqn] = (a, b, t)
    # at the root, a ShardedTensor's fqn is its key; keys may contain '.', so
    # "optim.param_groups" names the DCP value of that path
    res = reshard.load({**state, "optim.param_groups": None}, path)
    return {"pieces": pieces, "values": res.values, "bytes_read": res.bytes_read,
            "seconds": res.duration_s}


def r_convert(src: str, dst: str) -> dict[str, Any]:
    """convert_dcp on every rank of the default group (files shared out)."""
    from reshard.formats.dcp_convert import convert_dcp

    res = convert_dcp(src, dst, file_bytes=200)
    return {"bytes_written": res.bytes_written, "num_files": res.num_files,
            "has_manifest": res.manifest is not None}
