"""Replicas read once: a chunk range several ranks need is read from storage
by one of them and handed to the others (real gloo ranks, real files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import _read_once_fns as fns
import reshard
from reshard.planning.dryrun import parse_target_layout, plan_layout
from reshard.testing.pool import WorkerPool

pytestmark = pytest.mark.timeout(120)


def test_dp_replicas_are_read_once_and_values_are_exact(pool: WorkerPool, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    pool.run(4, fns.r_save, ck)
    total = fns.total_bytes()
    on = pool.run(4, fns.r_load_same, ck, True)
    assert all(r["exact"] for r in on), on
    assert sum(r["chunk_bytes"] for r in on) == total  # the unique bytes, each read once
    assert all(r["received"] > 0 for r in on), on  # readers balanced over both replicas
    assert sum(r["received"] for r in on) == sum(r["sent"] for r in on) == total
    assert all(r["note"] is None for r in on)
    # the dry run (reshard plan) predicts what each rank read
    lp = plan_layout(reshard.inspect(ck), parse_target_layout("tp2,dp2"), read_once_min_bytes=0)
    assert [r.read_bytes for r in lp.ranks] == [r["chunk_bytes"] for r in on]
    # by default ranges under read_once_min_bytes (the small tensors) are read by every rank
    dflt = pool.run(4, fns.r_load_default_threshold, ck)
    assert all(r["exact"] for r in dflt)
    small = sum(r * c * 4 for n, (r, c) in fns.SHAPES.items() if n.startswith("small"))
    assert sum(r["chunk_bytes"] for r in dflt) == total + small
    lp = plan_layout(reshard.inspect(ck), parse_target_layout("tp2,dp2"))
    assert [r.read_bytes for r in lp.ranks] == [r["chunk_bytes"] for r in dflt]
    off = pool.run(4, fns.r_load_same, ck, False)
    assert all(r["exact"] for r in off), off
    assert sum(r["chunk_bytes"] for r in off) == 2 * total  # every DP replica reads its own
    assert all(r["received"] == 0 for r in off)
    # destinations that are not one contiguous region: received through a buffer, then placed
    tr = pool.run(4, fns.r_load_same, ck, True, True)
    assert all(r["exact"] for r in tr), tr
    assert sum(r["chunk_bytes"] for r in tr) == total


def test_whole_tensors_on_every_rank_read_once_balanced(pool: WorkerPool, tmp_path: Path) -> None:
    """Saved TP2 x DP2, loaded whole on each of 4 ranks: each chunk is needed by 4
    ranks, read by one; every rank reads about a quarter."""
    ck = str(tmp_path / "ck")
    pool.run(4, fns.r_save, ck)
    total = fns.total_bytes()
    on = pool.run(4, fns.r_load_whole, ck, True)
    assert all(r["exact"] for r in on), on
    assert sum(r["chunk_bytes"] for r in on) == total
    biggest = max(r * c * 4 for r, c in fns.SHAPES.values()) // 2  # one TP chunk
    assert max(r["chunk_bytes"] for r in on) <= total / 4 + biggest, on
    assert all(r["received"] == 4 * total // 4 - r["chunk_bytes"] for r in on), on
    lp = plan_layout(reshard.inspect(ck), parse_target_layout("dp4"), read_once_min_bytes=0)
    assert [r.read_bytes for r in lp.ranks] == [r["chunk_bytes"] for r in on]
    off = pool.run(4, fns.r_load_whole, ck, False)
    assert all(r["exact"] for r in off)
    assert sum(r["chunk_bytes"] for r in off) == 4 * total


def test_failed_transport_falls_back_to_reading_from_storage(pool: WorkerPool, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    pool.run(4, fns.r_save, ck)
    out = pool.run(4, fns.r_load_transport_fails, ck)
    assert all(r["exact"] for r in out), out
    assert all("injected" in r["note"]["fallback"] for r in out), out
    assert sum(r["chunk_bytes"] for r in out) == 2 * fns.total_bytes()
    assert all(r["received"] == 0 for r in out)


def test_corrupt_block_read_for_others_fails_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    pool.run(4, fns.r_save, str(ck))
    data = sorted(p for p in os.listdir(ck) if p.endswith(".safetensors"))
    f = ck / data[0]
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 0xFF  # inside the last tensor's bytes
    f.write_bytes(bytes(raw))
    out = pool.run(4, fns.r_load_corrupt, str(ck))
    assert all("checksum mismatch" in r for r in out), out
