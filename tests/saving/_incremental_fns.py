"""Rank functions for tests/saving/test_incremental.py (incremental saves on gloo ranks).

The state: a frozen base ``model.base`` (row-sharded over the ranks, 2 MiB of
float32 a rank: a file of its own per chunk), a frozen replicated
``model.emb`` (1.5 MiB, every rank holds it), a trainable row-sharded
``model.lora`` (small: shares the rank's file) and its moment
``optim.lora.exp_avg``; ``step`` changes the trainable part only, unless
``touch`` names a frozen tensor to change in place (no flag says so: only
its bytes).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from reshard import SaveOptions, ShardedTensor
from reshard.manager.manager import CheckpointManager

BASE_ROWS = 1024  # rows of model.base: 1024 x 1024 float32 = 4 MiB (2 MiB a rank at 2 ranks)
COLS = 1024


def full(step: int, world: int = 0, touch: str = "") -> dict[str, torch.Tensor]:
    """The logical tensors of ``step`` (the base fixed unless ``touch``)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(BASE_ROWS, COLS, generator=g)
    emb = torch.randn(384, COLS, generator=g)  # 1.5 MiB
    if touch == "base":
        base[0, :4] += step
    if touch == "emb":
        emb[-1, -4:] += step
    lora = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16) + 1000.0 * step
    return {"base": base, "emb": emb, "lora": lora, "exp_avg": lora * 0.5}


def state(step: int, rank: int, world: int, touch: str = "") -> dict[str, Any]:
    f = full(step, world, touch)

    def rows(name: str, fqn: str | None = None) -> ShardedTensor:
        t = f[name]
        n = t.shape[0] // world
        return ShardedTensor(fqn or name, t[rank * n:(rank + 1) * n].clone(), global_shape=tuple(t.shape),
                             global_offset=(rank * n, 0))

    return {"model": {"base": rows("base"), "emb": f["emb"].clone(), "lora": rows("lora")},
            "optim": {"lora.exp_avg": rows("exp_avg", "lora.exp_avg")},
            "meta": {"step": step}}


def blank(rank: int, world: int) -> dict[str, Any]:
    st = state(0, rank, world)
    for leaf in (st["model"]["base"].data, st["model"]["emb"], st["model"]["lora"].data,
                 st["optim"]["lora.exp_avg"].data):
        leaf.zero_()
    st["meta"] = {"step": -1}
    return st


def check(st: dict[str, Any], step: int, rank: int, world: int, touch: str = "") -> None:
    """``st`` (loaded) equals the state of ``step`` bit for bit."""
    want = state(step, rank, world, touch)
    assert torch.equal(st["model"]["base"].data, want["model"]["base"].data)
    assert torch.equal(st["model"]["emb"], want["model"]["emb"])
    assert torch.equal(st["model"]["lora"].data, want["model"]["lora"].data)
    assert torch.equal(st["optim"]["lora.exp_avg"].data, want["optim"]["lora.exp_avg"].data)


def r_saves(root: str, steps: list[int], *, use_async: bool = False, keep_last: int | None = None,
            touch: dict[int, str] | None = None, restore: bool = False, opts: dict[str, Any] | None = None,
            storage_env: dict[str, str] | None = None) -> dict[str, Any]:
    """A job: a manager (a restart when ``restore``), the saves of ``steps``
    (``touch[step]``: a frozen tensor changed in place before that save), then
    a load of every kept checkpoint at this layout, bit-exact. Returns per
    step the bytes this rank wrote."""
    if storage_env:
        os.environ.update(storage_env)
    rank, world = dist.get_rank(), dist.get_world_size()
    touch = touch or {}
    mgr = CheckpointManager(root, keep_last=keep_last, use_async=use_async, preempt_signals=(),
                            options=SaveOptions(**(opts or {})))
    out: dict[str, Any] = {"written": {}, "restored": None}
    try:
        if restore:
            st = blank(rank, world)
            res = mgr.restore(st)
            out["restored"] = None if res is None else res.step
        for s in steps:
            r = mgr.save(s, state(s, rank, world, touch.get(s, "")))
            if use_async:
                r = r.wait()  # type: ignore[union-attr]
            out["written"][s] = r.bytes_written
        mgr.wait()
    finally:
        mgr.close()
    return out


def r_load(path: str, step: int, touch: str = "", storage_env: dict[str, str] | None = None) -> bool:
    """Load ``path`` at this rank's layout; it must be step ``step``'s state bit for bit."""
    import reshard

    if storage_env:
        os.environ.update(storage_env)
    rank, world = dist.get_rank(), dist.get_world_size()
    st = blank(rank, world)
    res = reshard.load(st, path)
    assert res.values["meta"]["step"] == step, (res.values, step)
    check(st, step, rank, world, touch)
    return True


def r_load_rows(path: str, step: int, saved_world: int, touch: str = "",
                storage_env: dict[str, str] | None = None) -> bool:
    """Load ``path`` saved at ``saved_world`` ranks into this world's row
    split (another layout) and compare with the logical tensors, bit for bit."""
    import reshard

    if storage_env:
        os.environ.update(storage_env)
    rank, world = dist.get_rank(), dist.get_world_size()
    f = full(step, saved_world, touch)
    tgt: dict[str, Any] = {"model": {}, "optim": {}}
    for name, key in (("base", "model"), ("lora", "model"), ("exp_avg", "optim")):
        t = f[name]
        n = t.shape[0] // world
        fqn = "lora.exp_avg" if name == "exp_avg" else name
        tgt[key][fqn] = ShardedTensor(fqn, torch.zeros(n, t.shape[1]), global_shape=tuple(t.shape),
                                      global_offset=(rank * n, 0))
    tgt["model"]["emb"] = torch.zeros_like(f["emb"])
    res = reshard.load(tgt, path, strict=False)
    assert res.values.get("meta", {}).get("step", step) == step
    for name, key in (("base", "model"), ("lora", "model"), ("exp_avg", "optim")):
        fqn = "lora.exp_avg" if name == "exp_avg" else name
        n = f[name].shape[0] // world
        assert torch.equal(tgt[key][fqn].data, f[name][rank * n:(rank + 1) * n]), (path, fqn)
    assert torch.equal(tgt["model"]["emb"], f["emb"])
    return True


def r_plain_saves(root: str) -> dict[str, int]:
    """Plain saves: a first one with incremental=True, a second naming it as
    its parent (linked), a third without incremental (written in full)."""
    import reshard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    r = reshard.save(state(1, rank, world), f"{root}/a", step=1, options=SaveOptions(incremental=True))
    out["a"] = r.bytes_written
    r = reshard.save(state(2, rank, world), f"{root}/b", step=2,
                     options=SaveOptions(incremental=True, parent="a"))
    out["b"] = r.bytes_written
    r = reshard.save(state(3, rank, world), f"{root}/c", step=3, options=SaveOptions(parent="b"))
    out["c"] = r.bytes_written
    return out
