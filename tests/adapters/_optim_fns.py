"""Rank functions for tests/adapters/test_optimizer_restore.py (gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard
from _state_fns import Zero1


def r_zero1_save(path: str) -> dict[str, Any]:
    """ZeRO-1 flat buffers (state named by a layout: fqn None), 2 steps, save."""
    z = Zero1(seed=0)
    z.opt.param_groups[0].update(lr=0.05, weight_decay=0.01, betas=(0.8, 0.95))
    for k in range(2):
        z.step(k)
    reshard.save(z.state(), path, step=2)
    return {"moments": z.moments()}


def r_zero1_load(path: str) -> dict[str, Any]:
    z = Zero1(seed=123)
    z.opt.param_groups[0].update(lr=0.9, weight_decay=0.3, betas=(0.5, 0.5))  # not the saved ones
    reshard.load(z.state(), path)
    g = z.opt.param_groups[0]
    return {"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": tuple(g["betas"]),
            "groups": len(z.opt.param_groups)}


# ----------------------------------------------------------------------------- EP re-layout

D = 2


class Experts(nn.Module):
    """``local`` experts as separate parameters ``experts.{i}.w`` (local index)."""

    def __init__(self, local: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Module() for _ in range(local))
        for m in self.experts:
            m.w = nn.Parameter(torch.zeros(D, D))


def _ep(num: int) -> tuple[Experts, torch.optim.Optimizer, dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = num // world
    m = Experts(local)
    first = rank * local

    def layout(fqn: str, t: torch.Tensor) -> Any:
        i = int(fqn.split(".")[1])  # local index -> global expert name
        return reshard.ShardedTensor(f"experts.{first + i}.w", t, global_shape=(D, D), global_offset=(0, 0))

    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ms = reshard.ModelState(m, layout=layout)
    return m, opt, {"model": ms, "optim": reshard.OptimizerState(ms, opt)}


def r_ep_save(path: str) -> None:
    """One rank, 4 experts; expert 2 never receives a gradient (never routed):
    it has no optimizer state, experts 0, 1 and 3 have."""
    m, opt, state = _ep(4)
    with torch.no_grad():
        for i, e in enumerate(m.experts):
            e.w.fill_(float(i))
    for i, e in enumerate(m.experts):
        if i != 2:
            e.w.grad = torch.full((D, D), float(i + 1))
    opt.step()
    opt.zero_grad(set_to_none=True)
    reshard.save(state, path)


def r_ep_load(path: str) -> dict[str, Any]:
    """EP=2: rank 1 holds global experts 2 and 3 under the local names
    experts.0.w and experts.1.w (experts.0.w is also global expert 0's name)."""
    m, opt, state = _ep(4)
    res = reshard.load(state, path)
    return {"has_state": [bool(opt.state.get(e.w)) for e in m.experts],
            "w": [float(e.w[0, 0]) for e in m.experts],
            "without": res.notes.get("optim.params_without_state", [])}


# ----------------------------------------------------------------------------- Adafactor, TP rows


def _tp_adafactor(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Rows [2r, 2r + 2) of a [4, 3] weight on TP rank r, Adafactor: its
    row_var [2, 1] is a shard of a [4, 1] statistic; its col_var [1, 3] is
    this rank's own (over its rows), declared as element r of a [2, 1, 3] grid."""
    r = dist.get_rank()
    m = nn.Module()
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    m.w = nn.Parameter(full[2 * r:2 * r + 2].clone())

    def model_layout(fqn: str, t: torch.Tensor) -> reshard.ShardedTensor:
        return reshard.ShardedTensor(fqn, t, global_shape=(4, 3), global_offset=(2 * r, 0))

    def optim_layout(fqn: str | None, p: torch.Tensor, key: str, v: torch.Tensor) -> Any:
        if key == "row_var":
            return reshard.ShardedTensor("state.w.row_var", v, global_shape=(4, 1), global_offset=(2 * r, 0))
        if key == "col_var":
            return reshard.ShardedTensor("state.w.col_var", v.unsqueeze(0), global_shape=(2, 1, 3),
                                         global_offset=(r, 0, 0))
        return None  # step: the 0-dim default

    opt = torch.optim.Adafactor([m.w], lr=0.01)
    ms = reshard.ModelState(m, layout=model_layout)
    return m, opt, {"model": ms, "optim": reshard.OptimizerState(ms, opt, layout=optim_layout)}


def _adafactor_step(m: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    opt.zero_grad()
    x = torch.randn(3, generator=torch.Generator().manual_seed(50 + k + dist.get_rank()))
    (m.w * x).sin().sum().backward()
    opt.step()


def r_tp_adafactor_save(path: str) -> dict[str, Any]:
    m, opt, state = _tp_adafactor(0)
    for k in range(2):
        _adafactor_step(m, opt, k)
    reshard.save(state, path)
    _adafactor_step(m, opt, 2)
    return {"w": m.w.detach().clone(), "row_var": opt.state[m.w]["row_var"].clone()}


def r_tp_adafactor_load(path: str) -> dict[str, Any]:
    m, opt, state = _tp_adafactor(9)
    _adafactor_step(m, opt, 7)  # an optimizer whose state exists: filled in place
    reshard.load(state, path)
    _adafactor_step(m, opt, 2)
    return {"w": m.w.detach().clone(), "row_var": opt.state[m.w]["row_var"].clone()}
