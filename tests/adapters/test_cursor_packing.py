"""DataCursor packing leftovers are never duplicated or lost, at any DP size
(global packing: one list shared by every rank; per-rank packing: each rank's
list, redistributed at a DP change), and a global batch size change continues
from the consumed-sample position. On real gloo ranks (tests/adapters/_cursor_fns.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import _cursor_fns as fns
import reshard
from reshard.testing.pool import WorkerPool

BEFORE, AFTER = 4, 4  # steps before the save, after the resume


def _stream(results: list[dict[str, Any]]) -> list[int]:
    """Every sample trained by every rank, step by step."""
    steps = len(results[0]["trained"])
    return [s for k in range(steps) for r in results for b in r["trained"][k] for s in b]


def _left(results: list[dict[str, Any]]) -> list[int]:
    return [s for r in results for s in r["pending"]]


@pytest.fixture(scope="module")
def saved(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Any]:
    """Checkpoints of both packing styles saved at DP 1 and DP 2 after BEFORE steps."""
    out = {}
    for style in ("rank", "global"):
        for dp in (1, 2):
            path = str(tmp_path_factory.mktemp(f"{style}{dp}") / "ck")
            res = pool.run(dp, fns.r_run, path, style, BEFORE, False)
            assert _left(res), "the packer leaves leftovers at the save"
            out[(style, dp)] = (path, res)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", ["rank", "global"])
@pytest.mark.parametrize(("dp_saved", "dp_resumed"), [(2, 2), (1, 1), (2, 1), (1, 2), (2, 4)])
def test_leftovers_resume_exactly_once(pool: WorkerPool, saved: dict[tuple[str, int], Any], style: str,
                                       dp_saved: int, dp_resumed: int) -> None:
    path, before = saved[(style, dp_saved)]
    on = {"on_dp_change": "redistribute"} if style == "rank" else {}
    after = pool.run(dp_resumed, fns.r_run, path, style, AFTER, True, **on)
    assert all("error" not in r for r in after), after
    if dp_saved == dp_resumed:  # the uninterrupted stream, bin by bin
        whole = pool.run(dp_saved, fns.r_run, None, style, BEFORE + AFTER, False)
        assert [r["trained"][BEFORE:] for r in whole] == [r["trained"] for r in after]
        assert _left(whole) == _left(after)
        return
    # another DP size: every sample drawn is trained or left over exactly once
    got = Counter(_stream(before) + _stream(after) + _left(after))
    assert got == Counter(fns.drawn(BEFORE + AFTER))
    # every sample exactly once per epoch (24 samples, 3 batches of 8: 8 batches = 2 epochs + 2)
    assert set(got) == set(range(fns.LEN)) and max(got.values()) == 3


@pytest.mark.timeout(120)
def test_global_leftovers_saved_per_rank_are_refused_not_doubled(pool: WorkerPool, tmp_path: Path) -> None:
    """Global packing declared as per-rank (the default scope): every rank's
    list is the same, and redistributing them at DP 2 -> 1 would train every
    leftover twice (it did: [33, 37, 20] became [33, 37, 20, 33, 37, 20]). The
    load refuses, naming pending_scope='global'; declared global, it loads."""
    path = str(tmp_path / "ck")
    pool.run(2, fns.r_global_as_rank_save, path, BEFORE)
    (r,) = pool.run(1, fns.r_run, path, "rank", AFTER, True, on_dp_change="redistribute")
    assert "ShardingError" in r["error"] and "pending_scope='global'" in r["error"], r
    (g,) = pool.run(1, fns.r_run, path, "global", AFTER, True)
    assert "error" not in g, g
    ref = pool.run(2, fns.r_run, None, "global", BEFORE, False)
    got = Counter(_stream(ref) + _stream([g]) + g["pending"])
    assert got == Counter(fns.drawn(BEFORE + AFTER))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", ["rank", "global"])
def test_global_batch_change_continues_from_the_consumed_position(pool: WorkerPool, tmp_path: Path,
                                                                  style: str) -> None:
    """Saved with global batch 8 after 4 steps (32 samples: epoch 1, 8 of it
    consumed); resumed with 4 at DP 2 (and 16 for the epoch-end case): the
    default refuses naming the option; with on_batch_change='continue' the
    next batches are order[8:12], order[12:16], ... of epoch 1 -- nothing
    repeated or skipped -- and the note says so."""
    path = str(tmp_path / "ck")
    pool.run(2, fns.r_run, path, style, BEFORE, False)
    refused = pool.run(2, fns.r_run, path, style, 1, True, global_batch=4)
    for r in refused:
        assert "on_batch_change='continue'" in r["error"] and "global_batch_size=8" in r["error"], r
    on = {"on_dp_change": "redistribute"} if style == "rank" else {}
    after = pool.run(2, fns.r_run, path, style, 3, True, global_batch=4, on_batch_change="continue", **on)
    order = reshard.DataCursor(fns.LEN, 8, seed=fns.SEED).epoch_order(1).tolist()
    assert all(r["notes"]["data.batch_change"] == {"global_batch_size": {"saved": 8, "now": 4},
                                                   "resumed_at": {"epoch": 1, "consumed": 8}}
               for r in after)
    # the samples drawn after the resume are the epoch's order from the consumed position
    cur = reshard.DataCursor(fns.LEN, 4, seed=fns.SEED)
    cur.epoch, cur.consumed = 1, 8
    assert [cur.next_global_batch() for _ in range(3)] == [order[8:12], order[12:16], order[16:20]]
    before = pool.run(2, fns.r_run, None, style, BEFORE, False)
    got = Counter(_stream(before) + _stream(after) + _left(after))
    assert got == Counter(fns.drawn(BEFORE) + order[8:20])
    # 16 from the same position: 8 + 16 = 24 fits once, then epoch 2
    big = pool.run(2, fns.r_run, path, style, 2, True, global_batch=16, on_batch_change="continue", **on)
    assert big[0]["notes"]["data.batch_change"]["resumed_at"] == {"epoch": 1, "consumed": 8}


def test_dataset_change_continues_only_at_an_epoch_boundary(tmp_path: Path) -> None:
    c = reshard.DataCursor(24, 8, seed=1)
    for _ in range(3):  # exactly one epoch: the cursor is at (1, 0)
        c.next_global_batch()
    reshard.save({"data": c}, tmp_path / "boundary")
    c.next_global_batch()
    reshard.save({"data": c}, tmp_path / "mid")
    with pytest.raises(reshard.ShardingError, match="on_batch_change='continue'"):
        reshard.load({"data": reshard.DataCursor(32, 8, seed=1)}, tmp_path / "boundary")
    grown = reshard.DataCursor(32, 8, seed=1, on_batch_change="continue")
    res = reshard.load({"data": grown}, tmp_path / "boundary")
    assert res.notes["data.batch_change"]["dataset_len"] == {"saved": 24, "now": 32}
    assert [s for _ in range(4) for s in grown.next_global_batch()] == \
        reshard.DataCursor(32, 8, seed=1).epoch_order(1).tolist()
    with pytest.raises(reshard.ShardingError) as ei:
        reshard.load({"data": reshard.DataCursor(20, 8, seed=1, on_batch_change="continue")},
                     tmp_path / "mid")
    msg = str(ei.value)
    assert "dataset_len=24" in msg and "20" in msg and "epoch 1" in msg and "8 of its 24" in msg, msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", ["rank", "global"])
def test_cursor_saved_by_dcp_restores_strictly(pool: WorkerPool, tmp_path: Path, style: str) -> None:
    """dcp.save({"data": cursor}) on 2 ranks (it pickled a ShardedObject that a
    weights_only load refused, and kept one rank's leftovers); reshard.load
    (strict) restores it at DP 2 as the uninterrupted run, and at DP 1 with
    every sample exactly once."""
    path = str(tmp_path / "dcp")
    before = pool.run(2, fns.r_dcp_save, path, style, BEFORE)
    assert _left(before)
    m = reshard.inspect(path)
    want = {"data.pending"} if style == "global" else {"data.pending.dp0", "data.pending.dp1"}
    assert want <= set(m.values or {}), sorted(m.values or {})
    after = pool.run(2, fns.r_run, path, style, AFTER, True)
    whole = pool.run(2, fns.r_run, None, style, BEFORE + AFTER, False)
    assert [r["trained"][BEFORE:] for r in whole] == [r["trained"] for r in after]
    on = {"on_dp_change": "redistribute"} if style == "rank" else {}
    (one,) = pool.run(1, fns.r_run, path, style, AFTER, True, **on)
    assert "error" not in one, one
    got = Counter(_stream(before) + _stream([one]) + one["pending"])
    assert got == Counter(fns.drawn(BEFORE + AFTER))
    if style == "rank":  # the default rule still refuses a DP change, naming the option
        (r,) = pool.run(1, fns.r_run, path, style, AFTER, True)
        assert "on_dp_change='redistribute'" in r["error"], r


def test_plain_state_dict_round_trips_and_loads_weights_only(tmp_path: Path) -> None:
    """Outside reshard, state_dict() holds plain values (a weights_only
    torch.load reads it), and each rank's own dict restores its own leftovers."""
    import torch

    for rank in range(2):
        c = reshard.DataCursor(24, 8, seed=3, dp_rank=rank, dp_size=2)
        c.next_batch()
        c.pending = [rank * 10 + 1, rank * 10 + 2]
        torch.save(c.state_dict(), tmp_path / f"r{rank}.pt")
        sd = torch.load(tmp_path / f"r{rank}.pt", weights_only=True)
        assert sd["pending"] == {"dp_size": 2, f"dp{rank}": [rank * 10 + 1, rank * 10 + 2]}
        d = reshard.DataCursor(24, 8, seed=0, dp_rank=rank, dp_size=2)
        d.load_state_dict(sd)
        assert (d.pending, d.consumed, d.seed) == (c.pending, 8, 3)


@pytest.mark.timeout(120)
def test_one_global_list_is_not_given_to_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    """Leftovers saved as one global list, loaded per rank at DP 2: every rank
    would train all of them; refused naming pending_scope. Empty, it loads."""
    path = str(tmp_path / "ck")
    pool.run(1, fns.r_run, path, "global", BEFORE, False)
    for r in pool.run(2, fns.r_run, path, "rank", 1, True, on_dp_change="redistribute"):
        assert "pending_scope='global'" in r["error"], r
    empty = str(tmp_path / "empty")
    reshard.save({"data": reshard.DataCursor(fns.LEN, 8, seed=fns.SEED, pending_scope="global")}, empty)
    assert all("error" not in r for r in pool.run(2, fns.r_run, empty, "rank", 1, True))


@pytest.mark.parametrize(("n", "g", "steps", "g2"), [(40, 12, 1, 8), (48, 8, 5, 12), (30, 6, 2, 9)])
def test_batch_change_drops_only_the_new_last_incomplete_batch(tmp_path: Path, n: int, g: int,
                                                               steps: int, g2: int) -> None:
    """After a global batch change mid-epoch, the rest of the epoch's order is
    trained in batches of the new size, each sample once, and what is left
    unread is exactly the epoch's last incomplete batch of the new size
    ((n - consumed) mod g2 samples), as drop-last does in every epoch."""
    c = reshard.DataCursor(n, g, seed=3)
    seen = [s for _ in range(steps) for s in c.next_global_batch()]
    reshard.save({"data": c}, tmp_path / "ck", step=steps)
    c2 = reshard.DataCursor(n, g2, seed=3, on_batch_change="continue")
    reshard.load({"data": c2}, tmp_path / "ck")
    rest: list[int] = []
    while c2.epoch == 0:
        b = c2.next_global_batch()
        assert len(b) == g2
        rest.extend(b)
    ref = reshard.DataCursor(n, 1, seed=3)
    order = [ref.next_global_batch()[0] for _ in range(n)]  # epoch 0's order, sample by sample
    assert seen + rest == order[:len(seen) + len(rest)]
    assert len(set(seen + rest)) == len(seen) + len(rest)
    assert n - len(seen) - len(rest) == (n - len(seen)) % g2
