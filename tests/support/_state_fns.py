"""Rank functions for tests/adapters/test_training_state_dist.py (run inside WorkerPool workers).

Each function runs on every rank of the default gloo group, saves or loads with
``reshard`` and returns plain data (lists, tensors) for the test to compare.
Failures that must happen on every rank are caught and returned as
``(type name, is ShardingError, message)`` so the test can assert each rank's.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import reshard
from reshard.adapters.layouts import flat_param_shards
from reshard.adapters.rng import derive_seed
from reshard.testing.tp_model import Config, Reference, TPBlock


def _rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _caught(e: BaseException) -> tuple[str, bool, str]:
    return type(e).__name__, isinstance(e, reshard.ShardingError), str(e)


# ----------------------------------------------------------------------------- case 5: 0-dim


def zero_dim_state(fill: bool) -> dict[str, Any]:
    if fill:
        f, b, i = torch.tensor(3.5), torch.tensor(True), torch.tensor(7, dtype=torch.int64)
    else:
        f, b, i = torch.tensor(0.0), torch.tensor(False), torch.tensor(0, dtype=torch.int64)
    return {"optim": {"step_f32": f, "step_bool": b, "step_i64": i}}


def r_zero_dim_save(path: str) -> None:
    reshard.save(zero_dim_state(True), path, step=3)


def r_zero_dim_load(path: str) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    state = zero_dim_state(False)
    reshard.load(state, path)
    return {k: (str(t.dtype), tuple(t.shape), t.item()) for k, t in state["optim"].items()}


# ----------------------------------------------------------------------------- case 6: ZeRO flat

#: two parameters laid out back to back in a flat buffer (17 elements of data)
FLAT_PARAMS = (("p1", (2, 5)), ("p2", (7,)))
FLAT_N = 17
PAD = -999.0  # padding value at save: never data
SENTINEL = -7.0  # padding value of load targets: must stay untouched


def flat_moments() -> dict[str, torch.Tensor]:
    """The logical moments: distinct, exactly representable values."""
    return {"exp_avg": torch.arange(1, FLAT_N + 1, dtype=torch.float32) * 0.5,
            "exp_avg_sq": torch.arange(1, FLAT_N + 1, dtype=torch.float32) * 0.25 + 100}


def _padded(world: int) -> int:
    return -(-FLAT_N // world) * world


def _flat_names(key: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"optim.state.{n}.{key}", s) for n, s in FLAT_PARAMS]


def r_flat_save(path: str) -> list[torch.Tensor]:
    rank, world = _rank()
    total = _padded(world)
    per = total // world
    state: dict[str, Any] = {}
    locals_ = []
    for key, full in flat_moments().items():
        buf = torch.full((total,), PAD)
        buf[:FLAT_N] = full
        local = buf[rank * per:(rank + 1) * per].clone()
        locals_.append(local)
        state[key] = flat_param_shards(_flat_names(key), local, rank * per)
    reshard.save(state, path)
    return locals_


def r_flat_load(path: str) -> dict[str, torch.Tensor]:
    """Load into this rank's flat range of a buffer padded to a multiple of the world size."""
    rank, world = _rank()
    per = _padded(world) // world
    out, state = {}, {}
    for key in flat_moments():
        local = torch.full((per,), SENTINEL)
        out[key] = local
        state[key] = flat_param_shards(_flat_names(key), local, rank * per)
    reshard.load(state, path)
    return out


def r_flat_load_full(path: str) -> dict[str, torch.Tensor]:
    """Load the flat-saved moments into whole, box-shaped tensors."""
    state = {f"optim.state.{n}.{k}": torch.full(s, SENTINEL)
             for k in flat_moments() for n, s in FLAT_PARAMS}
    tree = {f"t{i}": reshard.ShardedTensor(name, t, global_shape=t.shape, global_offset=(0,) * t.dim())
            for i, (name, t) in enumerate(state.items())}
    reshard.load(tree, path)
    return state


# ----------------------------------------------------------------------------- ZeRO-1 with OptimizerState


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p1 = nn.Parameter(torch.zeros(2, 5))
        self.p2 = nn.Parameter(torch.zeros(7))


def _zero1_grads(model: Two, step: int) -> torch.Tensor:
    """Deterministic full flat gradient (what a DP all-reduce would give)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return torch.sin(flat * (step + 1)) + 0.1 * torch.arange(FLAT_N, dtype=torch.float32)


class Zero1:
    """ZeRO-1 on the default group: replicated model, each rank's AdamW owns a flat
    shard parameter (its range of the parameters' flat buffer, padded to a multiple
    of the world size)."""

    def __init__(self, seed: int | None):
        self.rank, self.world = _rank()
        self.model = Two()
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
        self.per = _padded(self.world) // self.world
        self.start = self.rank * self.per
        self.flat = nn.Parameter(self._slice(self._flat_params()))
        self.opt = torch.optim.AdamW([self.flat], lr=0.05, weight_decay=0.01)
        ms = reshard.ModelState(self.model)
        self.ostate = reshard.OptimizerState(ms, self.opt, layout=self.layout)

    def _flat_params(self) -> torch.Tensor:
        buf = torch.zeros(self.per * self.world)
        buf[:FLAT_N] = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        return buf

    def _slice(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.start:self.start + self.per].clone()

    def layout(self, fqn: str | None, p: torch.Tensor, key: str, v: torch.Tensor) -> Any:
        assert fqn is None and p is self.flat
        if v.dim() == 0:  # "step": the same on every rank
            return reshard.ShardedTensor(f"state.zero1.{key}", v, global_shape=(),
                                         global_offset=(), replica_id=self.rank)
        # named relative to the OptimizerState (saved under "optim": optim.state.<fqn>.<key>)
        return flat_param_shards([(f"state.{n}.{key}", s) for n, s in FLAT_PARAMS], v, self.start)

    def state(self) -> dict[str, Any]:
        return {"model": reshard.ModelState(self.model), "optim": self.ostate}

    def sync_master(self) -> None:
        """After loading the (replicated) model: the master shard is its flat range."""
        with torch.no_grad():
            self.flat.copy_(self._slice(self._flat_params()))

    def step(self, k: int) -> None:
        self.flat.grad = self._slice(torch.cat([_zero1_grads(self.model, k),
                                                torch.zeros(self.per * self.world - FLAT_N)]))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        parts = [torch.empty(self.per) for _ in range(self.world)]
        dist.all_gather(parts, self.flat.detach().clone())
        full = torch.cat(parts)[:FLAT_N]
        with torch.no_grad():
            a = 0
            for p in self.model.parameters():
                p.copy_(full[a:a + p.numel()].reshape(p.shape))
                a += p.numel()

    def moments(self) -> dict[str, torch.Tensor]:
        st = self.opt.state[self.flat]
        return {k: v.clone() for k, v in st.items()}

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def r_zero1_save(path: str, steps: int, extra: int) -> dict[str, Any]:
    """``steps`` ZeRO-1 steps, save, then ``extra`` more (the uninterrupted run)."""
    z = Zero1(seed=0)
    for k in range(steps):
        z.step(k)
    reshard.save(z.state(), path, step=steps)
    saved = z.moments()
    for k in range(steps, steps + extra):
        z.step(k)
    return {"moments": saved, "params": z.params(), "start": z.start}


def r_zero1_resume(path: str, steps: int, extra: int) -> dict[str, Any]:
    z = Zero1(seed=123)
    res = reshard.load(z.state(), path)
    z.sync_master()
    loaded = z.moments()
    for k in range(steps, steps + extra):
        z.step(k)
    return {"moments": loaded, "params": z.params(), "start": z.start, "notes": res.notes}


# ----------------------------------------------------------------------------- case 7: per-rank cursors


def r_cursor_grid_save(path: str) -> None:
    rank, world = _rank()
    ob = reshard.ShardedObject("data.cursor", {rank: 10 + rank}, global_shape=(world,), global_offset=(rank,))
    reshard.save({"cursor": ob}, path)


def r_cursor_grid_load(path: str) -> Any:
    rank, world = _rank()
    ob = reshard.ShardedObject("data.cursor", {}, global_shape=(world,), global_offset=(rank,))
    try:
        res = reshard.load({"cursor": ob}, path)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return _caught(e)
    return res.values["data.cursor"]


# ----------------------------------------------------------------------------- case 11: DataCursor


def r_cursor_save(path: str, global_batch: int, batches: int) -> list[list[int]]:
    rank, world = _rank()
    cur = reshard.DataCursor(10, global_batch, seed=3, dp_rank=rank, dp_size=world)
    seen = [cur.next_batch() for _ in range(batches)]
    reshard.save({"data": cur}, path)
    return seen


def r_cursor_resume(path: str, global_batch: int, n: int) -> list[list[int]]:
    rank, world = _rank()
    cur = reshard.DataCursor(10, global_batch, seed=99, dp_rank=rank, dp_size=world)
    reshard.load({"data": cur}, path)
    return [cur.next_batch() for _ in range(n)]


# ----------------------------------------------------------------------------- case 16: TP 2 -> 1

H = 3


class LNCol(nn.Module):
    """A LayerNorm weight [H] (replicated over TP) and a column-parallel weight."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H, elementwise_affine=True, bias=False)
        self.col = nn.Linear(H, rows, bias=False)


def _tp16_init() -> tuple[torch.Tensor, torch.Tensor]:
    ln = torch.tensor([1.0, 0.5, -2.0])
    w = torch.arange(2 * H * H, dtype=torch.float32).reshape(2 * H, H) / 8 - 1
    return ln, w


def _tp16_grads(m: LNCol, step: int, rows: slice) -> None:
    """Deterministic grads: the replicated weight's equal on every rank (as after an
    all-reduce), the column-parallel weight's a function of the global row index."""
    full = torch.arange(2 * H * H, dtype=torch.float32).reshape(2 * H, H)
    m.ln.weight.grad = torch.cos(torch.arange(H, dtype=torch.float32) + step)
    m.col.weight.grad = torch.sin(full[rows] * 0.37 + step)


def r_tp16_save(path: str, steps: int) -> dict[str, Any]:
    rank, world = _rank()
    m = LNCol(H)
    ln, w = _tp16_init()
    rows = slice(rank * H, (rank + 1) * H)
    with torch.no_grad():
        m.ln.weight.copy_(ln)
        m.col.weight.copy_(w[rows])
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01)

    def layout(fqn: str, t: torch.Tensor) -> Any:
        if fqn == "col.weight":
            return reshard.ShardedTensor(fqn, t, global_shape=(2 * H, H), global_offset=(rank * H, 0))
        return None

    for k in range(steps):
        _tp16_grads(m, k, rows)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ms = reshard.ModelState(m, layout=layout)
    reshard.save({"model": ms, "optim": reshard.OptimizerState(ms, opt)}, path, step=steps)
    out = {"ln": m.ln.weight.detach().clone(), "col": m.col.weight.detach().clone(),
           "state": {n: {k: v.clone() for k, v in opt.state[p].items()}
                     for n, p in m.named_parameters()}}
    _tp16_grads(m, steps, rows)
    opt.step()
    out["next_col"] = m.col.weight.detach().clone()
    out["next_ln"] = m.ln.weight.detach().clone()
    return out


def r_tp16_load(path: str, steps: int) -> dict[str, Any]:
    m = LNCol(2 * H)  # TP=1: the full model, other random weights
    opt = torch.optim.AdamW(m.parameters(), lr=0.7, weight_decay=0.5)
    ms = reshard.ModelState(m)
    res = reshard.load({"model": ms, "optim": reshard.OptimizerState(ms, opt)}, path)
    out = {"ln": m.ln.weight.detach().clone(), "col": m.col.weight.detach().clone(),
           "state": {n: {k: v.clone() for k, v in opt.state[p].items()}
                     for n, p in m.named_parameters()},
           "lr": [g["lr"] for g in opt.param_groups], "step": res.step,
           "chunks": {n: len(e.chunks) for n, e in res.manifest.tensors.items()}}
    _tp16_grads(m, steps, slice(0, 2 * H))
    opt.step()
    out["next_col"] = m.col.weight.detach().clone()
    out["next_ln"] = m.ln.weight.detach().clone()
    return out


# ----------------------------------------------------------------------------- fused-QKV TP block

CFG = Config()


def reference() -> Reference:
    return Reference(CFG, generator=torch.Generator().manual_seed(0))


def block_input() -> torch.Tensor:
    return torch.randn(5, CFG.hidden, generator=torch.Generator().manual_seed(7))


def _canonical_grads() -> dict[str, torch.Tensor]:
    """Deterministic gradients of the canonical tensors."""
    return {k: torch.sin(torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape) * 0.3 + i)
            for i, (k, v) in enumerate(reference().state_dict().items())}


def _boxes(m: TPBlock, name: str, t: torch.Tensor) -> list[tuple[str, tuple[slice, ...], torch.Tensor]]:
    """(canonical fqn, box in it, view of ``t``) for each layout view of parameter ``name``."""
    views = m.layout(name, t)
    out = []
    for st in [views] if isinstance(views, reshard.ShardedTensor) else views:
        box = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.local_shape, strict=True))
        out.append((st.fqn, box, st.data))
    return out


def _block_state(m: TPBlock, opt: torch.optim.Optimizer) -> dict[str, Any]:
    ms = reshard.ModelState(m, layout=m.layout)
    return {"model": ms, "optim": reshard.OptimizerState(ms, opt)}


def _canonical_moments(m: TPBlock, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's moments as (canonical fqn, box as (start, stop) pairs, values)."""
    out: dict[str, Any] = {"exp_avg": [], "exp_avg_sq": [], "step": set()}
    for name, p in m.named_parameters():
        st = opt.state[p]
        out["step"].add(float(st["step"]))
        for key in ("exp_avg", "exp_avg_sq"):
            for fqn, box, data in _boxes(m, name, st[key]):
                out[key].append((fqn, [(b.start, b.stop) for b in box], data.clone()))
    return out


def r_tp_block_save(path: str) -> dict[str, Any]:
    """Save a TP block built from the reference with AdamW moments of one step
    (lr 0: the weights stay the reference's)."""
    rank, world = _rank()
    m = TPBlock.from_reference(reference(), tp_rank=rank, tp_size=world)
    opt = torch.optim.AdamW(m.parameters(), lr=0.0)
    grads = _canonical_grads()
    for name, p in m.named_parameters():
        p.grad = torch.empty_like(p)
        for fqn, box, data in _boxes(m, name, p.grad):
            data.copy_(grads[fqn][box])
    opt.step()
    opt.zero_grad(set_to_none=True)
    reshard.save(_block_state(m, opt), path, step=1)
    with torch.no_grad():
        return {"out": m(block_input()), "moments": _canonical_moments(m, opt)}


def r_tp_block_load(path: str) -> dict[str, Any]:
    """Load into a freshly initialised TP block and a fresh AdamW; forward output,
    exact weight check against the reference, canonical moments."""
    rank, world = _rank()
    m = TPBlock(CFG, tp_rank=rank, tp_size=world, generator=torch.Generator().manual_seed(50 + rank))
    opt = torch.optim.AdamW(m.parameters(), lr=0.3)
    reshard.load(_block_state(m, opt), path)
    full = reference().state_dict()
    mismatched = []
    for name, p in m.named_parameters():
        for fqn, box, data in _boxes(m, name, p.data):
            if not torch.equal(data, full[fqn][box]):
                mismatched.append((name, fqn))
    with torch.no_grad():
        y = m(block_input())
    return {"out": y, "mismatched": mismatched, "moments": _canonical_moments(m, opt),
            "lr": [g["lr"] for g in opt.param_groups]}


def r_reference_load(path: str) -> dict[str, Any]:
    """Load the TP checkpoint into the plain unsharded model (canonical names) and
    a fresh AdamW, strictly: every saved name (moments and per-parameter
    hyperparameters) is canonical, named after the fused views."""
    ref = Reference(CFG, generator=torch.Generator().manual_seed(999))
    opt = torch.optim.AdamW(ref.parameters(), lr=0.3)
    ms = reshard.ModelState(ref)
    res = reshard.load({"model": ms, "optim": reshard.OptimizerState(ms, opt)}, path)
    want = reference().state_dict()
    with torch.no_grad():
        y = ref(block_input())
    moments = {key: {n: opt.state[p][key].clone() for n, p in ref.named_parameters()}
               for key in ("exp_avg", "exp_avg_sq", "step")}
    return {"equal": {k: torch.equal(v, want[k]) for k, v in ref.state_dict().items()}, "out": y,
            "moments": moments, "missing": res.missing, "unexpected": res.unexpected,
            "lr": [g["lr"] for g in opt.param_groups]}


def r_reference_forward() -> torch.Tensor:
    with torch.no_grad():
        return reference()(block_input())


# ----------------------------------------------------------------------------- EP: experts [E, d, d]

D = 3


class Experts(nn.Module):
    def __init__(self, local: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(local, D, D))


def _ep_state(num_experts: int, fill: bool) -> tuple[Experts, torch.optim.Optimizer, dict[str, Any]]:
    rank, world = _rank()
    if num_experts % world:
        raise ValueError("experts must divide over EP")
    local = num_experts // world
    m = Experts(local)
    first = rank * local
    if fill:
        e = torch.arange(first, first + local, dtype=torch.float32).reshape(-1, 1, 1)
        with torch.no_grad():
            m.w.copy_(e * 10 + torch.arange(D * D, dtype=torch.float32).reshape(D, D) / 4)
    else:
        with torch.no_grad():
            m.w.copy_(torch.randn(m.w.shape, generator=torch.Generator().manual_seed(77 + rank)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)

    def layout(fqn: str, t: torch.Tensor) -> Any:
        # global expert indices along the leading axis
        return reshard.ShardedTensor("moe.experts.w", t, global_shape=(num_experts, D, D),
                                     global_offset=(first, 0, 0))

    ms = reshard.ModelState(m, layout=layout)
    return m, opt, {"model": ms, "optim": reshard.OptimizerState(ms, opt)}


def r_ep_save(path: str) -> dict[str, torch.Tensor]:
    m, opt, state = _ep_state(4, True)
    for k in range(2):
        m.w.grad = torch.cos(m.w.detach() * (k + 1))
        opt.step()
        opt.zero_grad(set_to_none=True)
    reshard.save(state, path, step=2)
    st = opt.state[m.w]
    return {"w": m.w.detach().clone(), "exp_avg": st["exp_avg"].clone(),
            "exp_avg_sq": st["exp_avg_sq"].clone(), "step": st["step"].clone()}


def r_ep_load(path: str, num_experts: int) -> Any:
    m, opt, state = _ep_state(num_experts, False)
    try:
        reshard.load(state, path)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return _caught(e)
    st = opt.state[m.w]
    return {"w": m.w.detach().clone(), "exp_avg": st["exp_avg"].clone(),
            "exp_avg_sq": st["exp_avg_sq"].clone(), "step": st["step"].clone()}


# ----------------------------------------------------------------------------- RNG per rank


def _draw() -> dict[str, Any]:
    """A dropout mask and one draw of each global generator."""
    mask = torch.nn.functional.dropout(torch.ones(32), p=0.5, training=True) > 0
    return {"mask": mask, "py": random.random(), "np": float(np.random.random())}


def r_rng_same_layout(path: str) -> dict[str, Any]:
    rank, _ = _rank()
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    _draw()  # advance the streams a little
    reshard.save({"rng": reshard.RNGState(base_seed=42)}, path, step=5)
    first = _draw()
    rng = reshard.RNGState(base_seed=42)
    res = reshard.load({"rng": rng}, path)
    again = _draw()
    return {"first": first, "again": again, "rederived": rng.rederived, "notes": res.notes}


def r_rng_other_layout(path: str) -> dict[str, Any]:
    rank, _ = _rank()
    torch.manual_seed(555)  # the same on every rank: re-derivation must make them distinct
    random.seed(555)
    np.random.seed(555)
    rng = reshard.RNGState(base_seed=42)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = reshard.load({"rng": rng}, path)
    drawn = _draw()
    torch.manual_seed(derive_seed(42, 5, {"rank": rank}))
    expected_mask = _draw()["mask"]
    return {"warnings": [(w.category.__name__, str(w.message)) for w in caught], "draw": drawn,
            "expected_mask": expected_mask, "rederived": rng.rederived, "notes": res.notes}


# ----------------------------------------------------------------------------- common values differ


def r_values_differ(path: str) -> list[Any]:
    """A plain int ``step`` that differs across ranks: at the root of the tree, and
    inside a plain dict (a container of plain values is one value, named by its path)."""
    rank, _ = _rank()
    out = []
    for i, state in enumerate([{"step": 5 + rank, "lr": 0.1, "w": torch.ones(2)},
                               {"train": {"step": 5 + rank, "lr": 0.1}, "w": torch.ones(2)}]):
        try:
            reshard.save(state, f"{path}-{i}")
            out.append(None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append(_caught(e))
    return out
