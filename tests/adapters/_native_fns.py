"""Rank functions for tests/adapters/test_torch_native.py (FSDP2 / TP / 2-D meshes on gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import reshard
from reshard.adapters.torch_native import TorchState

D_IN, D_HID = 8, 20  # 20 rows: even over 4 and 2 (TP needs it), uneven over 3 (7,7,6)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, D_IN, generator=g), torch.randn(4, D_IN, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN))


def _parallelize(model: nn.Module, layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (n,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (n,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model[0], mesh=mesh["dp"])
        fully_shard(model[2], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(layout)
    return model


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return ((model(x) - y) ** 2).mean()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    loss = _loss(model, step)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _logical(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": _full(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"s.{names[id(p)]}.{k}"] = _full(v)
    return out


def source(layout: str, path: str, steps: int) -> dict:
    """Train ``steps`` steps, save, then take one more step (uninterrupted run)."""
    model = _parallelize(_model(), layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for s in range(steps):
        _train_step(model, opt, s)
    reshard.save({"train": TorchState(model, opt)}, path, step=steps)
    state = _logical(model, opt)
    next_loss = _train_step(model, opt, steps)
    after = _logical(model, opt)
    return {"state": state, "next_loss": next_loss, "after": after}


def target(layout: str, path: str, steps: int, cpu_offload: bool = False) -> dict:
    """Fresh model and never-stepped optimizer in another layout: load, then the next step."""
    torch.manual_seed(123)  # other initial weights than the source
    model = _parallelize(nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN)),
                         layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.9, weight_decay=0.0)  # restored by name
    res = reshard.load({"train": TorchState(model, opt, cpu_offload=cpu_offload)}, path)
    state = _logical(model, opt)
    lr = opt.param_groups[0]["lr"]
    next_loss = _train_step(model, opt, steps)
    after = _logical(model, opt)
    return {"state": state, "next_loss": next_loss, "after": after, "lr": lr, "step": res.step}
