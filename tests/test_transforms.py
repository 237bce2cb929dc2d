"""Schema transforms at load (Rename, Reset, Cast, Transpose, Split, Merge,
ResizeVocab) and layout helpers (fused / interleaved QKV views, vocab-parallel
padding, flat ZeRO shards), single process on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import reshard
from reshard import ModelState, OptimizerState, ShardedTensor, ShardingError
from reshard.adapters.layouts import (
    flat_param_shards,
    fused_views,
    interleaved_qkv_views,
    vocab_padding,
    vocab_parallel_view,
)
from reshard.transforms import Cast, Merge, Rename, Reset, ResizeVocab, Split, Transpose


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- Rename


def test_rename_tensors_values_and_aliases(tmp_path: Path) -> None:
    w, b = _rand(2, 3), _rand(3, seed=1)
    tied = _rand(4, seed=2)
    ckpt = tmp_path / "r"
    reshard.save({"enc": {"w": w, "b": b, "t1": tied, "t2": tied, "n": 3}}, ckpt)
    m = reshard.inspect(ckpt)
    assert m.aliases == {"enc.t2": "enc.t1"}

    tgt = {"dec": {"w": torch.zeros(2, 3), "b": torch.zeros(3), "t1": torch.zeros(4),
                   "t2": torch.zeros(4), "n": 0}}
    with pytest.raises(ShardingError, match="no requested key matches"):
        reshard.load(tgt, ckpt, strict=False)
    res = reshard.load(tgt, ckpt, transforms=[Rename(r"^enc\.", "dec.")])
    assert res.missing == () and res.unexpected == ()
    assert torch.equal(tgt["dec"]["w"], w) and torch.equal(tgt["dec"]["b"], b)
    assert torch.equal(tgt["dec"]["t1"], tied) and torch.equal(tgt["dec"]["t2"], tied)
    assert res.values["dec.n"] == 3


def test_rename_collision_is_an_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "rc"
    reshard.save({"a1": torch.ones(1), "a2": torch.ones(1)}, ckpt)
    with pytest.raises(ShardingError, match="two saved keys map to 'a'"):
        reshard.load({"a": torch.zeros(1)}, ckpt, transforms=[Rename(r"\d$", "")])


# ----------------------------------------------------------------------------- Reset


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.keep = nn.Parameter(_rand(2, 3, seed=3))
        self.new = nn.Parameter(_rand(4, seed=4))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    (model.keep.sum() * 2 + (model.new ** 2).sum()).backward()
    opt.step()
    opt.zero_grad()


def test_reset_optimizer_state_of_chosen_params(tmp_path: Path) -> None:
    src = Two()
    opt = torch.optim.AdamW(src.parameters(), lr=0.1)
    _step(src, opt)
    _step(src, opt)
    ref_keep = {k: v.clone() for k, v in opt.state[src.keep].items()}
    ckpt = tmp_path / "reset"
    reshard.save({"model": ModelState(src), "optim": OptimizerState(src, opt)}, ckpt)

    # into a live optimizer that has stepped (different moments): reset zero-fills
    dst = Two()
    dopt = torch.optim.AdamW(dst.parameters(), lr=0.1)
    for _ in range(3):
        _step(dst, dopt)
    res = reshard.load({"model": ModelState(dst), "optim": OptimizerState(dst, dopt)}, ckpt,
                       transforms=[Reset("optim.state.new.*")])
    st_new = dopt.state[dst.new]
    assert torch.equal(st_new["exp_avg"], torch.zeros(4))
    assert torch.equal(st_new["exp_avg_sq"], torch.zeros(4))
    assert st_new["step"].item() == 0.0
    assert set(res.initialized) == {"optim.state.new.exp_avg", "optim.state.new.exp_avg_sq",
                                    "optim.state.new.step"}
    for k, v in ref_keep.items():
        assert torch.equal(dopt.state[dst.keep][k], v), k
    assert torch.equal(dst.new, src.new)  # the parameter itself is loaded

    # into a fresh optimizer: the reset parameter simply has no state
    fresh_model = Two()
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.3)
    res = reshard.load({"model": ModelState(fresh_model), "optim": OptimizerState(fresh_model, fresh)},
                       ckpt, transforms=[Reset("optim.state.new.*")])
    assert res.notes["optim.params_without_state"] == ["new"]
    assert not fresh.state.get(fresh_model.new)
    assert torch.equal(fresh.state[fresh_model.keep]["exp_avg"], ref_keep["exp_avg"])
    assert fresh.param_groups[0]["lr"] == 0.1


# ----------------------------------------------------------------------------- Cast


def test_cast_is_explicit_and_scoped(tmp_path: Path) -> None:
    w = _rand(4, 3) * 100
    h = _rand(2, seed=1).bfloat16()
    ckpt = tmp_path / "cast"
    reshard.save({"w": w, "h": h}, ckpt)
    tgt = {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "h": torch.zeros(2)}
    with pytest.raises(ShardingError, match="saved dtype float32, requested bfloat16"):
        reshard.load(tgt, ckpt, transforms=[Cast("h")])  # w is not covered
    with pytest.raises(ShardingError, match="bfloat16"):  # only into float16
        reshard.load(tgt, ckpt, transforms=[Cast("*", torch.float16)])
    assert torch.count_nonzero(tgt["w"].float()) == 0 and torch.count_nonzero(tgt["h"]) == 0

    reshard.load(tgt, ckpt, transforms=[Cast("w", torch.bfloat16), Cast("h")])
    assert torch.equal(tgt["w"], w.bfloat16())
    assert torch.equal(tgt["h"], h.float())  # bf16 -> fp32 is exact


# ----------------------------------------------------------------------------- Transpose


def test_transpose_full_and_box(tmp_path: Path) -> None:
    saved = torch.arange(12.0).reshape(3, 4)  # Conv1D-style [in, out]
    ckpt = tmp_path / "tr"
    reshard.save({"w": saved}, ckpt)
    full = {"w": torch.zeros(4, 3)}
    with pytest.raises(ShardingError, match=r"\[3, 4\]"):
        reshard.load(full, ckpt)
    reshard.load(full, ckpt, transforms=[Transpose("w")])
    assert torch.equal(full["w"], saved.T)

    box = torch.zeros(2, 2)
    part = ShardedTensor("w", box, global_shape=(4, 3), global_offset=(1, 1))
    reshard.load({"w": part}, ckpt, transforms=[Transpose("w")])
    assert torch.equal(box, saved.T[1:3, 1:3])


# ----------------------------------------------------------------------------- Split / Merge


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rand(4, 3, seed=10), _rand(2, 3, seed=11), _rand(2, 3, seed=12)


def test_split_fused_qkv_into_targets(tmp_path: Path) -> None:
    q, k, v = _qkv()
    ckpt = tmp_path / "split"
    reshard.save({"qkv": torch.cat([q, k, v])}, ckpt)
    split = Split("qkv", ("q", "k", "v"), (4, 2, 2))
    tgt = {"q": torch.zeros(4, 3), "k": torch.zeros(2, 3), "v": torch.zeros(2, 3)}
    res = reshard.load(tgt, ckpt, transforms=[split])
    assert res.missing == () and res.unexpected == ()
    assert torch.equal(tgt["q"], q) and torch.equal(tgt["k"], k) and torch.equal(tgt["v"], v)

    # a sharded target: the second row of k (a TP=2 rank's box)
    kbox = torch.zeros(1, 3)
    reshard.load({"k": ShardedTensor("k", kbox, global_shape=(2, 3), global_offset=(1, 0))},
                 ckpt, transforms=[split])
    assert torch.equal(kbox, k[1:2])

    bad = {"q": torch.zeros(3, 3), "k": torch.zeros(2, 3), "v": torch.zeros(2, 3)}
    with pytest.raises(ShardingError, match="split part 0"):
        reshard.load(bad, ckpt, transforms=[split])


def test_split_along_dim1(tmp_path: Path) -> None:
    gate, up = _rand(3, 2, seed=5), _rand(3, 4, seed=6)
    ckpt = tmp_path / "split1"
    reshard.save({"gate_up": torch.cat([gate, up], dim=1)}, ckpt)
    tgt = {"gate": torch.zeros(3, 2), "up": torch.zeros(3, 4)}
    reshard.load(tgt, ckpt, transforms=[Split("gate_up", ("gate", "up"), (2, 4), dim=1)])
    assert torch.equal(tgt["gate"], gate) and torch.equal(tgt["up"], up)


def test_merge_parts_into_fused_target(tmp_path: Path) -> None:
    q, k, v = _qkv()
    ckpt = tmp_path / "merge"
    reshard.save({"q": q, "k": k, "v": v}, ckpt)
    merge = Merge(("q", "k", "v"), "qkv", (4, 2, 2))
    fused = torch.zeros(8, 3)
    res = reshard.load({"qkv": fused}, ckpt, transforms=[merge])
    assert res.missing == () and res.unexpected == ()
    ref = torch.cat([q, k, v])
    assert torch.equal(fused, ref)

    # a box of the fused target straddling q and k
    box = torch.zeros(3, 3)
    reshard.load({"qkv": ShardedTensor("qkv", box, global_shape=(8, 3), global_offset=(3, 0))},
                 ckpt, transforms=[merge])
    assert torch.equal(box, ref[3:6])

    with pytest.raises(ShardingError, match="add up to"):
        reshard.load({"qkv": torch.zeros(9, 3)}, ckpt, transforms=[merge])


# ----------------------------------------------------------------------------- ResizeVocab


def test_resize_vocab_grow_and_shrink(tmp_path: Path) -> None:
    emb = _rand(5, 3, seed=7)
    ckpt = tmp_path / "vocab"
    reshard.save({"emb": emb}, ckpt)

    with pytest.raises(ShardingError, match=r"\[5, 3\]"):
        reshard.load({"emb": torch.zeros(7, 3)}, ckpt)

    grown = {"emb": torch.full((7, 3), 9.0)}
    reshard.load(grown, ckpt, transforms=[ResizeVocab("emb")])
    assert torch.equal(grown["emb"][:5], emb)
    assert torch.equal(grown["emb"][5:], torch.zeros(2, 3))

    mean = {"emb": torch.full((7, 3), 9.0)}
    reshard.load(mean, ckpt, transforms=[ResizeVocab("emb", fill="mean")])
    assert torch.equal(mean["emb"][:5], emb)
    torch.testing.assert_close(mean["emb"][5:], emb.mean(0, keepdim=True).expand(2, 3))

    shrunk = {"emb": torch.zeros(3, 3)}
    reshard.load(shrunk, ckpt, transforms=[ResizeVocab("emb")])
    assert torch.equal(shrunk["emb"], emb[:3])

    # a grown target's last TP shard: one saved row, then new rows
    box = torch.full((3, 3), 9.0)
    reshard.load({"emb": ShardedTensor("emb", box, global_shape=(7, 3), global_offset=(4, 0))},
                 ckpt, transforms=[ResizeVocab("emb", fill=-1.0)])
    assert torch.equal(box[0], emb[4]) and torch.equal(box[1:], torch.full((2, 3), -1.0))

    with pytest.raises(ShardingError, match="changes dim 0 only"):
        reshard.load({"emb": torch.zeros(7, 4)}, ckpt, transforms=[ResizeVocab("emb")])


# ----------------------------------------------------------------------------- fused_views


def _packed(parts: list[torch.Tensor], tp_rank: int, tp_size: int) -> torch.Tensor:
    """A column-parallel fused buffer [part0_r; part1_r; ...] built by hand."""
    out = []
    for p in parts:
        n = p.shape[0] // tp_size
        out.append(p[tp_rank * n:(tp_rank + 1) * n])
    return torch.cat(out)


def test_fused_views_tp2_to_full_and_tp4(tmp_path: Path) -> None:
    q, k, v = _rand(8, 3, seed=20), _rand(4, 3, seed=21), _rand(4, 3, seed=22)
    gate, up = _rand(8, 3, seed=23), _rand(8, 3, seed=24)
    names, sizes = ("q", "k", "v"), (8, 4, 4)
    state = {}
    for r in range(2):  # two TP ranks' buffers, saved by one process
        attn = _packed([q, k, v], r, 2)
        mlp = _packed([gate, up], r, 2)
        state[f"attn{r}"] = fused_views(attn, names, sizes, tp_rank=r, tp_size=2)
        state[f"mlp{r}"] = fused_views(mlp, ("gate", "up"), (8, 8), tp_rank=r, tp_size=2)
    ckpt = tmp_path / "fused"
    reshard.save(state, ckpt, options=reshard.SaveOptions(mesh={"tp": 2}))
    m = reshard.inspect(ckpt)
    assert set(m.tensors) == {"q", "k", "v", "gate", "up"}
    assert list(m.tensors["k"].global_shape) == [4, 3]
    assert len(m.tensors["q"].chunks) == 2

    full = {"q": torch.zeros(8, 3), "k": torch.zeros(4, 3), "v": torch.zeros(4, 3),
            "gate": torch.zeros(8, 3), "up": torch.zeros(8, 3)}
    res = reshard.load(full, ckpt)
    assert res.missing == () and res.unexpected == ()
    for name, ref in zip(("q", "k", "v", "gate", "up"), (q, k, v, gate, up)):
        assert torch.equal(full[name], ref), name

    bufs = [torch.zeros(4, 3) for _ in range(4)]
    mlps = [torch.zeros(4, 3) for _ in range(4)]
    tgt = {}
    for r in range(4):
        tgt[f"attn{r}"] = fused_views(bufs[r], names, sizes, tp_rank=r, tp_size=4)
        tgt[f"mlp{r}"] = fused_views(mlps[r], ("gate", "up"), (8, 8), tp_rank=r, tp_size=4)
    reshard.load(tgt, ckpt)
    for r in range(4):
        assert torch.equal(bufs[r], _packed([q, k, v], r, 4))
        assert torch.equal(mlps[r], _packed([gate, up], r, 4))


def test_fused_views_checks_the_buffer() -> None:
    with pytest.raises(ShardingError, match="do not split evenly"):
        fused_views(torch.zeros(4, 3), ("q", "k"), (5, 3), tp_rank=0, tp_size=2)
    with pytest.raises(ShardingError, match="parts hold"):
        fused_views(torch.zeros(5, 3), ("q", "k"), (4, 4), tp_rank=0, tp_size=2)


# ----------------------------------------------------------------------------- interleaved QKV


def _megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, heads: int, groups: int,
              hd: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Megatron's fused QKV of one TP rank: per local query group, its query
    heads, then its key head, then its value head."""
    hpg = heads // groups
    local = groups // tp_size
    rows = []
    for j in range(local):
        g = tp_rank * local + j
        rows += [q[g * hpg * hd:(g + 1) * hpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return torch.cat(rows)


def test_interleaved_qkv_views_are_canonical(tmp_path: Path) -> None:
    heads, groups, hd, hidden = 8, 4, 2, 3
    q, k, v = _rand(heads * hd, hidden, seed=30), _rand(groups * hd, hidden, seed=31), _rand(
        groups * hd, hidden, seed=32)
    kw = {"num_heads": heads, "num_query_groups": groups, "head_dim": hd}
    state = {}
    for r in range(2):
        buf = _megatron(q, k, v, heads=heads, groups=groups, hd=hd, tp_rank=r, tp_size=2)
        assert buf.shape == (16, hidden)
        state[f"tp{r}"] = interleaved_qkv_views(buf, ("q", "k", "v"), tp_rank=r, tp_size=2, **kw)
    ckpt = tmp_path / "ileave"
    reshard.save(state, ckpt)
    m = reshard.inspect(ckpt)
    assert {n: list(e.global_shape) for n, e in m.tensors.items()} == {
        "q": [16, 3], "k": [8, 3], "v": [8, 3]}

    full = {"q": torch.zeros(16, 3), "k": torch.zeros(8, 3), "v": torch.zeros(8, 3)}
    reshard.load(full, ckpt)
    assert torch.equal(full["q"], q) and torch.equal(full["k"], k) and torch.equal(full["v"], v)

    # into TP=4 interleaved buffers and into a plain [q; k; v] packing
    bufs = [torch.zeros(8, hidden) for _ in range(4)]
    reshard.load({f"tp{r}": interleaved_qkv_views(bufs[r], ("q", "k", "v"), tp_rank=r, tp_size=4,
                                                  **kw) for r in range(4)}, ckpt)
    for r in range(4):
        assert torch.equal(bufs[r], _megatron(q, k, v, heads=heads, groups=groups, hd=hd,
                                              tp_rank=r, tp_size=4))
    packed = torch.zeros(32, hidden)
    reshard.load({"p": fused_views(packed, ("q", "k", "v"), (16, 8, 8), tp_rank=0, tp_size=1)},
                 ckpt)
    assert torch.equal(packed, torch.cat([q, k, v]))


# ----------------------------------------------------------------------------- vocab padding


def _vocab_bufs(emb: torch.Tensor, padded: int, tp: int, pad_value: float) -> list[torch.Tensor]:
    full = torch.cat([emb, torch.full((padded - emb.shape[0], emb.shape[1]), pad_value)])
    rows = padded // tp
    return [full[r * rows:(r + 1) * rows].clone() for r in range(tp)]


def test_vocab_parallel_padding_is_not_data(tmp_path: Path) -> None:
    emb = _rand(10, 2, seed=40)
    bufs = _vocab_bufs(emb, 12, 4, pad_value=99.0)
    assert torch.equal(vocab_padding(bufs[3], vocab_size=10, tp_rank=3), torch.full((2, 2), 99.0))
    state = {f"tp{r}": vocab_parallel_view(bufs[r], "emb", vocab_size=10, tp_rank=r, tp_size=4)
             for r in range(4)}
    assert state["tp3"].local_shape == (1, 2) and state["tp3"].global_offset == (9, 0)
    ckpt = tmp_path / "vocab"
    reshard.save(state, ckpt)
    m = reshard.inspect(ckpt)
    assert list(m.tensors["emb"].global_shape) == [10, 2]
    assert sum(c.local_shape[0] for c in m.tensors["emb"].chunks) == 10

    full = {"emb": torch.zeros(10, 2)}
    reshard.load(full, ckpt)
    assert torch.equal(full["emb"], emb)

    # TP=3, padded to 12: 4 rows per rank, the last holds 2 logical rows + 2 padding
    new = [torch.full((4, 2), -5.0) for _ in range(3)]
    reshard.load({f"tp{r}": vocab_parallel_view(new[r], "emb", vocab_size=10, tp_rank=r,
                                                tp_size=3) for r in range(3)}, ckpt)
    assert torch.equal(torch.cat(new)[:10], emb)
    assert torch.equal(new[2][2:], torch.full((2, 2), -5.0))
    assert torch.equal(vocab_padding(new[2], vocab_size=10, tp_rank=2), torch.full((2, 2), -5.0))


def test_vocab_parallel_rank_without_logical_rows(tmp_path: Path) -> None:
    emb = _rand(10, 2, seed=41)
    # TP=8 padded to 16: 2 rows per rank; ranks 5..7 hold only padding
    bufs = _vocab_bufs(emb, 16, 8, pad_value=99.0)
    views = [vocab_parallel_view(bufs[r], "emb", vocab_size=10, tp_rank=r, tp_size=8)
             for r in range(8)]
    assert views[6].local_shape == (0, 2)
    ckpt = tmp_path / "vocab8"
    # ranks 5..7 hold the same empty chunk at [10, 0]; one process saves it once
    reshard.save({f"tp{r}": views[r] for r in range(6)}, ckpt)
    full = {"emb": torch.zeros(10, 2)}
    reshard.load(full, ckpt)
    assert torch.equal(full["emb"], emb)
    new = [torch.full((2, 2), -5.0) for _ in range(8)]
    reshard.load({f"tp{r}": vocab_parallel_view(new[r], "emb", vocab_size=10, tp_rank=r,
                                                tp_size=8) for r in range(8)}, ckpt)
    assert torch.equal(torch.cat(new)[:10], emb)
    assert torch.equal(torch.cat(new)[10:], torch.full((6, 2), -5.0))


# ----------------------------------------------------------------------------- flat ZeRO shards


PARAMS = [("optim.state.a.exp_avg", (2, 5)), ("optim.state.b.exp_avg", (7,))]


def _flat_ranges(flat: torch.Tensor, n: int) -> dict[str, list[ShardedTensor]]:
    per = flat.numel() // n
    return {f"r{i}": flat_param_shards(PARAMS, flat[i * per:(i + 1) * per], i * per)
            for i in range(n)}


def test_flat_param_shards_case6(tmp_path: Path) -> None:
    a, b = _rand(2, 5, seed=50), _rand(7, seed=51)
    logical = torch.cat([a.flatten(), b])  # 17 elements
    flat = torch.cat([logical, torch.tensor([1234.0])])  # padded to 18 = 6 ranks x 3
    state = _flat_ranges(flat, 6)
    assert [s.flat_bounds for s in state["r3"]] == [(9, 10), (0, 2)]
    assert [s.flat_bounds for s in state["r5"]] == [(5, 7)]  # the padding element is not data
    ckpt = tmp_path / "zero"
    reshard.save(state, ckpt)
    m = reshard.inspect(ckpt)
    assert list(m.tensors["optim.state.a.exp_avg"].global_shape) == [2, 5]
    assert list(m.tensors["optim.state.b.exp_avg"].global_shape) == [7]

    per_param = {"optim": {"state": {"a": {"exp_avg": torch.zeros(2, 5)},
                                     "b": {"exp_avg": torch.zeros(7)}}}}
    res = reshard.load(per_param, ckpt)
    assert res.missing == () and res.unexpected == ()
    assert torch.equal(per_param["optim"]["state"]["a"]["exp_avg"], a)
    assert torch.equal(per_param["optim"]["state"]["b"]["exp_avg"], b)

    for n, padded in ((4, 20), (3, 18)):
        dst = torch.full((padded,), -7.0)
        reshard.load(_flat_ranges(dst, n), ckpt)
        assert torch.equal(dst[:17], logical), n
        assert torch.equal(dst[17:], torch.full((padded - 17,), -7.0)), n


def test_regression_geometric_transforms_read_through_an_alias(tmp_path: Path) -> None:
    """A tied tensor is saved once and its other names are aliases. A Split or
    Merge naming an alias as its source, or a Transpose / ResizeVocab of a
    target whose saved name is an alias, failed with a bare KeyError (the
    piece kept the alias name, the dtype check looked it up): each reads the
    aliased tensor now, as a plain read of the alias does."""
    qkv = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ckpt = tmp_path / "alias"
    emb = qkv.T.contiguous()
    reshard.save({"qkv": qkv, "tied": qkv, "emb": emb, "emb2": emb}, ckpt)
    m = reshard.inspect(ckpt)
    assert m.aliases == {"tied": "qkv", "emb2": "emb"}
    parts = {"q": torch.zeros(2, 4), "k": torch.zeros(2, 4), "v": torch.zeros(2, 4)}
    res = reshard.load(parts, ckpt, strict=False,
                       transforms=[Split("tied", ["q", "k", "v"], dim=0, sizes=[2, 2, 2])])
    assert res.missing == () and "qkv" not in res.unexpected, res  # read through its alias
    assert torch.equal(torch.cat([parts["q"], parts["k"], parts["v"]]), qkv)
    whole = {"w": torch.zeros(12, 4)}
    res = reshard.load(whole, ckpt, strict=False, transforms=[Merge(["tied", "qkv"], "w", dim=0, sizes=[6, 6])])
    assert res.missing == (), res
    assert torch.equal(whole["w"], torch.cat([qkv, qkv]))
    t = {"emb2": torch.zeros(6, 4)}
    reshard.load(t, ckpt, strict=False, transforms=[Transpose("emb2", dims=(0, 1))])
    assert torch.equal(t["emb2"], qkv)
    r = {"tied": torch.zeros(8, 4)}
    reshard.load(r, ckpt, strict=False, transforms=[ResizeVocab("tied", dim=0, fill=0.0)])
    assert torch.equal(r["tied"][:6], qkv) and not r["tied"][6:].any()
