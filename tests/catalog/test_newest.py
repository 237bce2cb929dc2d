"""``reshard.load_latest``: the newest committed checkpoint of a root, its
reader lease held before it is read. The race of ``load(state,
latest(root))`` beside a trainer's retention (the checkpoint ``latest``
named deleted before ``load`` took its lease) is made deterministic: the
deletion (``retire_checkpoint``, retention's own) runs right after the
coordinator chose the checkpoint, or right after its lease was written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import _newest_fns as fns
import reshard
from reshard.catalog import newest
from reshard.commit.leases import ReaderLease
from reshard.commit.protocol import retire_checkpoint
from reshard.storage import resolve
from reshard.testing.pool import WorkerPool

N = 64


def weights(step: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) * 0.5 + step


def save(root: Path, step: int) -> str:
    return reshard.save({"w": weights(step)}, str(root / f"step-{step:08d}"), step=step).path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for step in (1, 2, 3):
        save(tmp_path / "run", step)
    return tmp_path / "run"


def retire(path: Path | str) -> str:
    st, key = resolve(str(path))
    return retire_checkpoint(st, st.parent(key), st.basename(key))


def patch_choice(monkeypatch: pytest.MonkeyPatch, after: Any) -> list[str]:
    """Run ``after(entry)`` each time the coordinator chose a checkpoint
    (before its lease is written); returns the names chosen."""
    real = newest.latest_entry
    chosen: list[str] = []

    def choose(st: Any, key: str, **kw: Any) -> Any:
        best = real(st, key, **kw)
        if best is not None:
            chosen.append(best.name)
            after(best)
        return best

    monkeypatch.setattr(newest, "latest_entry", choose)
    return chosen


def test_loads_the_newest_bit_exact(root: Path) -> None:
    w = torch.zeros(N)
    res = reshard.load_latest({"w": w}, root)
    assert res.path == str(root / "step-00000003") and res.step == 3
    assert torch.equal(w, weights(3))
    assert not [p for p in root.iterdir() if ".lease-" in p.name]  # released


def test_the_documented_pattern_fails_where_load_latest_does_not(root: Path) -> None:
    path = reshard.latest(root)
    assert retire(path) == "deleted"  # retention, between latest() and load()
    with pytest.raises(reshard.CheckpointNotFoundError):
        reshard.load({"w": torch.zeros(N)}, path)


def test_newest_deleted_before_the_lease_loads_the_next_newest(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[str] = []
    chosen = patch_choice(monkeypatch, lambda e: done or done.append(retire(e.path)))
    w = torch.zeros(N)
    res = reshard.load_latest({"w": w}, root)
    assert done == ["deleted"] and chosen == ["step-00000003", "step-00000002"]
    assert res.path == str(root / "step-00000002") and res.step == 2
    assert torch.equal(w, weights(2))
    assert not (root / "step-00000003").exists()


def test_newest_replaced_before_the_lease_loads_the_new_one(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def keep_last_1(e: Any) -> None:  # the trainer commits step 4, its retention deletes the rest
        if e.name == "step-00000003":
            save(root, 4)
            assert [retire(root / f"step-{s:08d}") for s in (1, 2, 3)] == ["deleted"] * 3

    chosen = patch_choice(monkeypatch, keep_last_1)
    w = torch.zeros(N)
    res = reshard.load_latest({"w": w}, root)
    assert chosen == ["step-00000003", "step-00000004"]
    assert res.step == 4 and torch.equal(w, weights(4))


def test_a_deletion_after_the_lease_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    class Retiring(ReaderLease):
        def acquire(self, *, required: bool = False) -> ReaderLease:
            out = super().acquire(required=required)
            seen.append(retire(self.path))  # retention right after the lease was written
            return out

    monkeypatch.setattr(newest, "ReaderLease", Retiring)
    w = torch.zeros(N)
    res = reshard.load_latest({"w": w}, root)
    assert seen == ["in use by 1 reader"]
    assert res.step == 3 and torch.equal(w, weights(3))
    assert retire(root / "step-00000003") == "deleted"  # released with the load


def test_everything_deleted_raises_not_found(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = patch_choice(monkeypatch, lambda e: retire(e.path))
    w = torch.zeros(N)
    with pytest.raises(reshard.CheckpointNotFoundError, match="no committed checkpoint here"):
        reshard.load_latest({"w": w}, root, attempts=5)
    assert len(chosen) == 3 and torch.equal(w, torch.zeros(N))


def test_attempts_bound_the_choices(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = patch_choice(monkeypatch, lambda e: retire(e.path))
    with pytest.raises(reshard.CheckpointNotFoundError, match="2 time"):
        reshard.load_latest({"w": torch.zeros(N)}, root, attempts=2)
    assert chosen == ["step-00000003", "step-00000002"]
    assert (root / "step-00000001").is_dir()
    with pytest.raises(ValueError):
        reshard.load_latest({"w": torch.zeros(N)}, root, attempts=0)


def test_empty_root_raises_not_found(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(reshard.CheckpointNotFoundError):
        reshard.load_latest({"w": torch.zeros(N)}, tmp_path / "empty")


def test_two_ranks_agree_on_the_checkpoint(pool: WorkerPool, root: Path) -> None:
    out = pool.run(2, fns.r_load_latest_newest_deleted, str(root), N, timeout=60)
    assert out[0]["retired"] == ["deleted"] and out[1]["retired"] == []
    for got in out:
        assert got["path"] == str(root / "step-00000002") and got["step"] == 2
        assert torch.equal(torch.tensor(got["w"]), weights(2))


def test_two_ranks_raise_not_found_on_an_empty_root(pool: WorkerPool, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = pool.run(2, fns.r_load_latest_empty, str(tmp_path / "empty"), timeout=60)
    assert all(o.startswith("CheckpointNotFoundError") and "no committed checkpoint" in o for o in out)


def test_an_unsigned_newest_is_refused_with_a_key(root: Path) -> None:
    key = reshard.LoadOptions(hmac_key=b"secret")
    with pytest.raises(reshard.IntegrityError, match="newest checkpoint under"):
        reshard.load_latest({"w": torch.zeros(N)}, root, options=key)
    with pytest.raises(reshard.IntegrityError, match="newest checkpoint under"):
        reshard.latest(root, hmac_key=b"secret")
    signed = reshard.save({"w": weights(4)}, str(root / "step-00000004"), step=4,
                          options=reshard.SaveOptions(hmac_key=b"secret")).path
    w = torch.zeros(N)
    assert reshard.load_latest({"w": w}, root, options=key).path == signed
    assert torch.equal(w, weights(4))


def test_pin_latest_pins_the_next_newest_when_the_newest_went_first(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[str] = []
    patch_choice(monkeypatch, lambda e: done or done.append(retire(e.path)))
    with reshard.pin_latest(root) as lease:
        assert done == ["deleted"] and lease.held
        assert lease.path == str(root / "step-00000002")
        assert retire(lease.path) == "in use by 1 reader"  # retention keeps it while pinned
    assert retire(root / "step-00000002") == "deleted"  # released with the block


def test_pin_latest_with_everything_deleted_raises_not_found(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patch_choice(monkeypatch, lambda e: retire(e.path))
    with pytest.raises(reshard.CheckpointNotFoundError), reshard.pin_latest(root):
        pass
    assert not [p for p in root.iterdir() if ".lease-" in p.name]
