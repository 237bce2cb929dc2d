"""Rank functions for tests/state/test_naming.py (gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def r_save_state_dict(path: str) -> list[str]:
    """The first line of every DCP tutorial: ``{"model": model.state_dict()}``."""
    m = net(0)
    reshard.save({"model": m.state_dict()}, path)
    return sorted(m.state_dict())


def r_load_state_dict(path: str) -> dict[str, Any]:
    m = net(1 + dist.get_rank())  # other weights than the saved ones on every rank
    sd = m.state_dict()
    res = reshard.load({"model": sd}, path)
    ref = net(0).state_dict()
    return {"equal": all(torch.equal(m.state_dict()[k], ref[k]) for k in ref),
            "missing": res.missing, "unexpected": res.unexpected}


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()


def r_ddp_save(path: str) -> dict[str, Any]:
    """DDP-wrapped model and its optimizer (names ``module.*`` in torch) saved."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(net(0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.02, weight_decay=0.1)
    _train(ddp, opt, 2)
    assert all(k.startswith("module.") for k in ddp.state_dict())
    reshard.save({"model": reshard.ModelState(ddp), "optim": reshard.OptimizerState(ddp, opt),
                  "module_leaf": ddp}, path)
    inner = ddp.module
    return {"params": {n: p.detach().clone() for n, p in inner.named_parameters()},
            "moments": {n: opt.state[p]["exp_avg"].clone() for n, p in inner.named_parameters()}}


def r_fsdp1_save(path: str) -> dict[str, Any]:
    """FSDP1 (one rank: NO_SHARD, use_orig_params): ``named_parameters()``
    says ``_fsdp_wrapped_module.*``; the saved names are the plain model's."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    f = FSDP(net(0), use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(f.parameters(), lr=0.03)
    _train(f, opt, 2)
    wrapped = [n for n, _ in f.named_parameters()]
    reshard.save({"model": reshard.ModelState(f), "optim": reshard.OptimizerState(f, opt)}, path)
    inner = f.module
    return {"wrapped": wrapped,
            "params": {n: p.detach().clone() for n, p in inner.named_parameters()},
            "moments": {n: opt.state[p]["exp_avg"].clone() for n, p in inner.named_parameters()}}
