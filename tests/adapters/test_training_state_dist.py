"""Training state (optimizer, data cursor, RNG, TP/EP model layouts) saved and
loaded on real gloo ranks with another world size.

Rank functions live in ``tests/support/_state_fns.py``; world sizes stay <= 4 and
tensors tiny. Covered: case 5 (0-dim optimizer steps, 2 -> 1 and 4 ranks),
case 6 (ZeRO flat shards 4 -> 2/3 ranks, padding never data; ZeRO-1 with an
OptimizerState layout, DP 4 -> 2 with next-step parity), case 7 (per-rank
cursor grid refused at another DP), case 11 (DataCursor across DP sizes),
case 16 (TP 2 -> 1 with replicated and column-parallel weights and their AdamW
moments), a fused-QKV TP block (2 -> 1 and 4, forward equals the unsharded
reference), MoE experts EP 2 -> 4/1 (and a changed expert count refused),
per-rank RNG streams (same layout restored, other layout re-derived with a
warning) and common values that differ across ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _state_fns as fns
import reshard
from reshard.testing.pool import WorkerPool


def _same_on_all(results: list[Any]) -> Any:
    for r in results[1:]:
        assert r == results[0]
    return results[0]


def _raised_everywhere(results: list[Any], *needles: str) -> None:
    for rank, r in enumerate(results):
        assert isinstance(r, tuple), f"rank {rank} did not raise: {r!r}"
        name, is_sharding, msg = r
        assert is_sharding, f"rank {rank} raised {name}, not ShardingError: {msg}"
        for n in needles:
            assert n in msg, f"rank {rank}: {n!r} not in {msg!r}"


# ----------------------------------------------------------------------------- case 5


@pytest.mark.parametrize("load_world", [1, 4])
def test_zero_dim_steps_2_to_n(pool: WorkerPool, tmp_path, load_world: int) -> None:
    path = str(tmp_path / "ck")
    pool.run(2, fns.r_zero_dim_save, path)
    m = reshard.inspect(path)
    for name in ("optim.step_f32", "optim.step_bool", "optim.step_i64"):
        e = m.tensors[name]
        assert tuple(e.global_shape) == () and len(e.chunks) == 1  # one copy, not one per rank
    got = pool.run(load_world, fns.r_zero_dim_load, path)
    want = {"step_f32": ("torch.float32", (), 3.5), "step_bool": ("torch.bool", (), True),
            "step_i64": ("torch.int64", (), 7)}
    for r in got:
        assert r == want
        assert type(r["step_bool"][2]) is bool and type(r["step_i64"][2]) is int


# ----------------------------------------------------------------------------- case 6


def test_flat_zero_shards_4_to_2_and_3(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    saved = pool.run(4, fns.r_flat_save, path)
    # the saved ranks really held the padded buffer (20 = 4 x 5, padding PAD)
    full_saved = torch.cat([s[0] for s in saved])
    assert full_saved.shape == (20,) and bool((full_saved[17:] == fns.PAD).all())
    m = reshard.inspect(path)
    assert set(m.tensors) == {f"optim.state.{p}.{k}" for p in ("p1", "p2") for k in ("exp_avg", "exp_avg_sq")}
    assert tuple(m.tensors["optim.state.p1.exp_avg"].global_shape) == (2, 5)
    assert tuple(m.tensors["optim.state.p2.exp_avg"].global_shape) == (7,)
    want = fns.flat_moments()
    for world in (2, 3):
        got = pool.run(world, fns.r_flat_load, path)
        per = -(-fns.FLAT_N // world)
        for key, full in want.items():
            buf = torch.cat([g[key] for g in got])
            assert buf.shape == (per * world,)
            # per parameter, the logical moments equal the saved ones exactly
            assert torch.equal(buf[:10].reshape(2, 5), full[:10].reshape(2, 5))
            assert torch.equal(buf[10:17], full[10:17])
            # padding is not data: the target's padding elements are untouched
            assert bool((buf[17:] == fns.SENTINEL).all())
    full = pool.run(1, fns.r_flat_load_full, path)[0]
    for key, t in want.items():
        assert torch.equal(full[f"optim.state.p1.{key}"], t[:10].reshape(2, 5))
        assert torch.equal(full[f"optim.state.p2.{key}"], t[10:])


def test_zero1_optimizer_state_layout_dp4_to_dp2(pool: WorkerPool, tmp_path) -> None:
    """Real ZeRO-1: each rank's AdamW owns a flat shard parameter; the
    OptimizerState layout names its moments by parameter. DP=4 -> DP=2."""
    path = str(tmp_path / "ck")
    steps, extra = 2, 1
    before = pool.run(4, fns.r_zero1_save, path, steps, extra)
    after = pool.run(2, fns.r_zero1_resume, path, steps, extra)
    for key in ("exp_avg", "exp_avg_sq"):
        saved = torch.cat([b["moments"][key] for b in before])[:fns.FLAT_N]
        loaded = torch.cat([a["moments"][key] for a in after])
        assert loaded.shape == (18,)
        assert torch.equal(loaded[:fns.FLAT_N], saved)
        assert torch.equal(loaded[fns.FLAT_N:], torch.zeros(1))  # created state, padding untouched
    for a in after:
        step = a["moments"]["step"]
        assert step.dim() == 0 and step.dtype == before[0]["moments"]["step"].dtype
        assert step.item() == steps
    # next-step parity with the uninterrupted DP=4 run (elementwise AdamW)
    for got, want in zip(after[0]["params"], before[0]["params"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- case 7


def test_per_rank_cursor_grid_refused_at_other_dp(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    pool.run(4, fns.r_cursor_grid_save, path)
    assert pool.run(4, fns.r_cursor_grid_load, path) == [{r: 10 + r} for r in range(4)]
    got = pool.run(2, fns.r_cursor_grid_load, path)
    _raised_everywhere(got, "data.cursor", "[4]", "[2]")


# ----------------------------------------------------------------------------- case 11


def _global_sequence(global_batch: int, n: int) -> list[list[int]]:
    cur = reshard.DataCursor(10, global_batch, seed=3)
    return [cur.next_global_batch() for _ in range(n)]


@pytest.mark.parametrize(
    ("global_batch", "saved_batches", "resume_worlds"),
    [
        (2, 7, (1,)),  # epoch 0 (5 batches) + 2 batches of epoch 1, mid-epoch
        (4, 3, (1, 4)),  # epoch 0 (2 batches) + 1 batch of epoch 1, mid-epoch
        (4, 4, (1, 4)),  # 2 batches of epoch 1: exactly at the end of epoch 1
    ],
)
def test_data_cursor_resume_across_dp(pool: WorkerPool, tmp_path, global_batch: int,
                                      saved_batches: int, resume_worlds: tuple[int, ...]) -> None:
    path = str(tmp_path / "ck")
    n = 6
    ref = _global_sequence(global_batch, saved_batches + n)
    before = pool.run(2, fns.r_cursor_save, path, global_batch, saved_batches)
    for k in range(saved_batches):
        assert before[0][k] + before[1][k] == ref[k]
    for world in resume_worlds:
        after = pool.run(world, fns.r_cursor_resume, path, global_batch, n)
        resumed = [sum((after[r][k] for r in range(world)), []) for k in range(n)]
        assert resumed == ref[saved_batches:]


# ----------------------------------------------------------------------------- case 16


def test_tp2_to_tp1_replicated_and_column_parallel(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    steps = 2
    tp = pool.run(2, fns.r_tp16_save, path, steps)
    (one,) = pool.run(1, fns.r_tp16_load, path, steps)
    # the replicated tensor (and its moments) appear once, at [H]
    assert torch.equal(tp[0]["ln"], tp[1]["ln"])
    assert one["chunks"]["model.ln.weight"] == 1
    assert one["chunks"]["optim.state.ln.weight.exp_avg"] == 1
    assert one["chunks"]["optim.state.ln.weight.exp_avg_sq"] == 1
    assert one["chunks"]["model.col.weight"] == 2
    assert one["chunks"]["optim.state.col.weight.exp_avg"] == 2
    assert one["ln"].shape == (fns.H,) and torch.equal(one["ln"], tp[0]["ln"])
    # the column-parallel weight is [2H, H] in TP-rank row order
    assert one["col"].shape == (2 * fns.H, fns.H)
    assert torch.equal(one["col"], torch.cat([tp[0]["col"], tp[1]["col"]]))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(one["state"]["ln.weight"][key], tp[0]["state"]["ln.weight"][key])
        assert torch.equal(one["state"]["col.weight"][key],
                           torch.cat([tp[0]["state"]["col.weight"][key], tp[1]["state"]["col.weight"][key]]))
    for name in ("ln.weight", "col.weight"):
        s = one["state"][name]["step"]
        assert s.dim() == 0 and s.item() == steps
    assert one["lr"] == [0.1] and one["step"] == steps
    # next step after the layout change matches the TP=2 run
    torch.testing.assert_close(one["next_col"], torch.cat([tp[0]["next_col"], tp[1]["next_col"]]),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one["next_ln"], tp[0]["next_ln"], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- fused QKV TP block


def _assemble(parts: list[tuple[str, list[tuple[int, int]], torch.Tensor]],
              shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Canonical tensors from (fqn, box, values) parts; every element covered exactly once."""
    full = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
    hits = {k: torch.zeros(s, dtype=torch.int64) for k, s in shapes.items()}
    for fqn, box, data in parts:
        sl = tuple(slice(a, b) for a, b in box)
        full[fqn][sl] = data
        hits[fqn][sl] += 1
    for k, h in hits.items():
        assert bool((h == 1).all()), k
    return full


def test_fused_qkv_tp_block_2_to_1_and_4(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    (ref_out,) = pool.run(1, fns.r_reference_forward)
    saved = pool.run(2, fns.r_tp_block_save, path)
    for s in saved:  # the TP=2 forward itself agrees with the reference
        torch.testing.assert_close(s["out"], ref_out, rtol=0, atol=1e-5)
    m = reshard.inspect(path)
    canonical = {"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
                 "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"}
    shapes = {k: tuple(m.tensors[f"model.{k}"].global_shape) for k in canonical}
    assert set(k[len("model."):] for k in m.tensors if not k.startswith("optim.")) == canonical
    assert shapes["attn.q.weight"] == (8, 8) and shapes["attn.o.weight"] == (8, 8)
    # optimizer moments are named after the canonical views, not the fused buffer
    for k in canonical:
        assert f"optim.state.{k}.exp_avg" in m.tensors and f"optim.state.{k}.exp_avg_sq" in m.tensors
    assert not any("qkv" in k or "gate_up" in k for k in m.tensors)
    want = {key: _assemble([p for s in saved for p in s["moments"][key]], shapes)
            for key in ("exp_avg", "exp_avg_sq")}
    for world in (1, 4):
        got = pool.run(world, fns.r_tp_block_load, path)
        for rank, g in enumerate(got):
            assert g["mismatched"] == [], f"TP={world} rank {rank}"
            torch.testing.assert_close(g["out"], ref_out, rtol=0, atol=1e-5)
            assert g["moments"]["step"] == {1.0} and g["lr"] == [0.0]
        for key in ("exp_avg", "exp_avg_sq"):
            loaded = _assemble([p for g in got for p in g["moments"][key]], shapes)
            for k in canonical:
                assert torch.equal(loaded[k], want[key][k]), (world, key, k)
    (plain,) = pool.run(1, fns.r_reference_load, path)
    assert plain["equal"] and all(plain["equal"].values()), plain["equal"]
    assert torch.equal(plain["out"], ref_out)
    for key in ("exp_avg", "exp_avg_sq"):
        for k in canonical:
            assert torch.equal(plain["moments"][key][k], want[key][k]), (key, k)
    assert all(float(v) == 1.0 for v in plain["moments"]["step"].values())
    # a strict load: hyperparameters follow the fused -> unfused change by name too
    assert plain["missing"] == () and plain["unexpected"] == ()
    assert plain["lr"] == [0.0]


# ----------------------------------------------------------------------------- EP


def test_moe_experts_ep2_to_ep4_and_ep1(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    saved = pool.run(2, fns.r_ep_save, path)
    full = {k: torch.cat([s[k] for s in saved]) for k in ("w", "exp_avg", "exp_avg_sq")}
    assert full["w"].shape == (4, fns.D, fns.D)
    # global expert index e sits at row e: saved values were built from e
    assert torch.equal((full["w"][:, 0, 0] / 10).round(), torch.arange(4.0))
    m = reshard.inspect(path)
    assert tuple(m.tensors["model.moe.experts.w"].global_shape) == (4, fns.D, fns.D)
    assert tuple(m.tensors["optim.state.moe.experts.w.exp_avg"].global_shape) == (4, fns.D, fns.D)
    for world in (4, 1):
        got = pool.run(world, fns.r_ep_load, path, 4)
        per = 4 // world
        for rank, g in enumerate(got):
            rows = slice(rank * per, (rank + 1) * per)
            for k in ("w", "exp_avg", "exp_avg_sq"):
                assert torch.equal(g[k], full[k][rows]), (world, rank, k)
            assert g["step"].item() == 2 and g["step"].dim() == 0
    # a model with 6 experts: the number of experts changed -> refused on every rank
    got = pool.run(2, fns.r_ep_load, path, 6)
    _raised_everywhere(got, "moe.experts.w", "[4, 3, 3]", "[6, 3, 3]")


# ----------------------------------------------------------------------------- RNG


def test_rng_streams_per_rank(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    same = pool.run(2, fns.r_rng_same_layout, path)
    for r in same:
        assert not r["rederived"] and "rng.rederived" not in r["notes"]
        assert torch.equal(r["again"]["mask"], r["first"]["mask"])
        assert (r["again"]["py"], r["again"]["np"]) == (r["first"]["py"], r["first"]["np"])
    assert not torch.equal(same[0]["first"]["mask"], same[1]["first"]["mask"])
    assert reshard.inspect(path).step == 5
    runs = [pool.run(3, fns.r_rng_other_layout, path) for _ in range(2)]
    for res in runs:
        for rank, r in enumerate(res):
            assert r["rederived"] and r["notes"].get("rng.rederived") is True
            warns = [m for c, m in r["warnings"] if c == "RuntimeWarning"]
            assert len(warns) == 1 and "re-deriving" in warns[0] and "[2]" in warns[0], r["warnings"]
            # re-seeded deterministically from (base_seed, step, coords)
            assert torch.equal(r["draw"]["mask"], r["expected_mask"]), rank
        masks = [r["draw"]["mask"] for r in res]
        for a in range(3):
            for b in range(a + 1, 3):
                assert not torch.equal(masks[a], masks[b])
        # no stream of a saved rank is reused
        for m in masks:
            assert not any(torch.equal(m, s["first"]["mask"]) for s in same)
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a["draw"]["mask"], b["draw"]["mask"])
        assert (a["draw"]["py"], a["draw"]["np"]) == (b["draw"]["py"], b["draw"]["np"])


# ----------------------------------------------------------------------------- common values


def test_common_values_differing_across_ranks(pool: WorkerPool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    got = pool.run(2, fns.r_values_differ, path)
    _raised_everywhere([g[0] for g in got], "['step']")
    _raised_everywhere([g[1] for g in got], "['train']")
    for g in got:
        assert "lr" not in g[0][2]
    # nothing was published
    assert reshard.latest(str(tmp_path)) is None
    for i in range(2):
        with pytest.raises(reshard.CheckpointNotFoundError):
            reshard.inspect(f"{path}-{i}")
