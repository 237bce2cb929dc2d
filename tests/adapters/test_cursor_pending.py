"""Per-rank packing leftovers of a DataCursor (issue 10 item 5, case 7): saved
per DP rank, restored at the same DP size, and at another DP size either
refused naming the rule or redistributed by it (none lost or duplicated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import reshard
from reshard.adapters.data import redistribute_pending
from reshard.testing.pool import WorkerPool

SAVED_DP = 4
#: leftovers of saved DP rank r (lists of different lengths, rank 0 empty)
LEFT = {r: [10 * (r + 1) + k for k in range(r)] for r in range(SAVED_DP)}
BATCHES = 3  # global batches drawn before the save


def _cursor(on: str = "raise") -> reshard.DataCursor:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return reshard.DataCursor(16, 8, seed=5, dp_rank=rank, dp_size=world, on_dp_change=on)


def r_pending_save(path: str) -> list[int]:
    cur = _cursor()
    for _ in range(BATCHES):
        cur.next_batch()
    cur.pending = list(LEFT[dist.get_rank()])
    reshard.save({"data": cur}, path, step=BATCHES)
    return cur.pending


def r_pending_load(path: str, on: str) -> Any:
    cur = _cursor(on)
    try:
        res = reshard.load({"data": cur}, path)
    except reshard.CheckpointError as e:
        return type(e).__name__, isinstance(e, reshard.ShardingError), str(e)
    notes = {k: v for k, v in res.notes.items() if "pending" in k}
    return {"pending": cur.pending, "epoch": cur.epoch, "consumed": cur.consumed,
            "next": cur.next_global_batch(), "notes": notes}


def _uninterrupted_next() -> list[int]:
    c = reshard.DataCursor(16, 8, seed=5)
    for _ in range(BATCHES):
        c.next_global_batch()
    return c.next_global_batch()


@pytest.fixture(scope="module")
def ckpt(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("pending") / "ck")
    assert pool.run(SAVED_DP, r_pending_save, path) == [LEFT[r] for r in range(SAVED_DP)]
    return path


def test_leftovers_are_a_per_rank_grid(ckpt: str) -> None:
    m = reshard.inspect(ckpt)
    (key,) = [k for k in m.objects if k.endswith("pending")]
    assert list(m.objects[key].global_shape) == [SAVED_DP]
    assert not any(k.endswith("pending") for k in (m.values or {}))


def test_same_dp_restores_each_ranks_own(pool: WorkerPool, ckpt: str) -> None:
    got = pool.run(SAVED_DP, r_pending_load, ckpt, "raise")
    assert [g["pending"] for g in got] == [LEFT[r] for r in range(SAVED_DP)]
    assert all(g["next"] == _uninterrupted_next() and g["notes"] == {} for g in got)


def test_dp_change_raises_naming_the_rule(pool: WorkerPool, ckpt: str) -> None:
    for rank, r in enumerate(pool.run(2, r_pending_load, ckpt, "raise")):
        assert isinstance(r, tuple), f"rank {rank} did not raise: {r!r}"
        name, is_sharding, msg = r
        assert is_sharding, (name, msg)
        assert "saved by 4 DP ranks" in msg and "dp_size=2" in msg, msg
        assert "on_dp_change='redistribute'" in msg, msg


@pytest.mark.parametrize("world", [2, 8])
def test_dp_change_redistributes_by_the_rule(pool: WorkerPool, ckpt: str, world: int) -> None:
    """Saved at DP=4, loaded at DP=2 and DP=8: the new ranks' leftovers are the
    saved ones in rank order, split contiguously; the global position is
    unchanged."""
    got = pool.run(world, r_pending_load, ckpt, "redistribute")
    flat = [s for r in range(SAVED_DP) for s in LEFT[r]]
    parts = [g["pending"] for g in got]
    assert [s for p in parts for s in p] == flat  # none lost, none duplicated, order kept
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == redistribute_pending([LEFT[r] for r in range(SAVED_DP)], world)
    assert all(g["next"] == _uninterrupted_next() for g in got)
    assert all(list(g["notes"].values()) == [{"from_dp": SAVED_DP, "to_dp": world}] for g in got)


def test_one_process_takes_every_leftover(ckpt: str) -> None:
    cur = _cursor("redistribute")
    reshard.load({"data": cur}, ckpt)
    assert cur.pending == [s for r in range(SAVED_DP) for s in LEFT[r]]


class _OldCursor:
    """The state dict of a DataCursor from before leftovers were per rank."""

    def state_dict(self) -> dict[str, Any]:
        return {"seed": 5, "epoch": 0, "consumed": 8, "global_batch_size": 8, "dataset_len": 16,
                "shuffle": True, "pending": [3, 4]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("not loaded")


def test_rule_and_argument_checks(tmp_path: Path) -> None:
    assert redistribute_pending([[1, 2, 3], [], [4]], 3) == [[1, 2], [3], [4]]
    assert redistribute_pending([[]], 2) == [[], []]
    with pytest.raises(ValueError, match="on_dp_change"):
        reshard.DataCursor(16, 8, on_dp_change="drop")
    # a checkpoint that kept pending as one common list still loads
    reshard.save({"data": _OldCursor()}, tmp_path / "old")
    cur = _cursor()
    reshard.load({"data": cur}, tmp_path / "old")
    assert cur.pending == [3, 4] and cur.consumed == 8
