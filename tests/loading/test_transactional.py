"""One checkpoint per save call, transactional loads, unplaceable targets
(issue 9): real files, real gloo ranks (2), rank functions in tests/loading/_txn_fns.py."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from _txn_fns import r_convert_per_rank, r_load_unchanged, r_save, r_save_paths
from reshard.commit.protocol import ATTEMPT_NONCE

DATA0, DATA1 = "data-r00000-0.safetensors", "data-r00001-0.safetensors"


# ----------------------------------------------------------------------------- save


@pytest.mark.parametrize("how", ["per-rank", "cwd"])
def test_ranks_naming_different_checkpoints_all_raise_nothing_published(
        pool: Any, tmp_path: Path, how: str) -> None:
    out = pool.run(2, r_save_paths, how, str(tmp_path))
    for r in out:
        assert r["raised"] is not None, r
        assert r["raised"]["failed_ranks"] == [1]
        msg = r["raised"]["message"]
        assert "every rank must pass the same checkpoint path" in msg
    if how == "per-rank":
        assert f"{tmp_path}/ck-1" in msg and f"{tmp_path}/ck-0" in msg  # both named
        assert os.listdir(tmp_path) == []  # nothing published, no attempt left
    else:
        assert f"{tmp_path}/d1/ck" in msg and f"{tmp_path}/d0/ck" in msg
        assert os.listdir(tmp_path / "d0") == [] and os.listdir(tmp_path / "d1") == []


def test_async_save_with_different_paths_fails_on_every_rank(pool: Any, tmp_path: Path) -> None:
    out = pool.run(2, r_save_paths, "per-rank", str(tmp_path), True)
    for r in out:
        assert r["raised"] is not None and "names checkpoint" in r["raised"]["message"]
    assert os.listdir(tmp_path) == []


def test_same_checkpoint_spelled_relative_and_through_a_symlink(pool: Any, tmp_path: Path) -> None:
    out = pool.run(2, r_save_paths, "spellings", str(tmp_path))
    for r in out:
        assert r["raised"] is None, r
        assert r["loaded"] == r["expected"]
    assert sorted(os.listdir(tmp_path / "real")) == ["ck"]  # one checkpoint, no attempt left
    assert sorted(os.listdir(tmp_path / "real" / "ck")) == [DATA0, DATA1, "manifest.json", "plan.bin"]
    assert reshard.verify(tmp_path / "real" / "ck").ok
    assert ATTEMPT_NONCE not in reshard.inspect(tmp_path / "real" / "ck").files


def test_convert_dcp_with_per_rank_destinations_fails_everywhere(pool: Any, tmp_path: Path) -> None:
    out = pool.run(2, r_convert_per_rank, str(tmp_path))
    for r in out:
        assert r["raised"] is not None and "names checkpoint" in r["raised"]["message"]
    assert sorted(os.listdir(tmp_path)) == ["dcp"]  # nothing published, no attempt left


def test_rank_that_cannot_see_the_coordinators_storage_fails_before_writing(
        pool: Any, tmp_path: Path) -> None:
    # memory:// stores are per process: one spelling, two storages (node-local disks)
    name = f"txn-{os.getpid()}-{tmp_path.name}"
    out = pool.run(2, r_save_paths, "memory", name)
    for r in out:
        assert r["raised"] is not None
        assert r["raised"]["failed_ranks"] == [1]
        assert "rank 1 cannot see the attempt written by the coordinator" in r["raised"]["message"]
        assert "node-local storage?" in r["raised"]["message"]
        assert r["memory_keys"] == []  # rank 0 discarded its attempt; rank 1 wrote nothing


def test_file_short_at_publish_publishes_nothing(pool: Any, tmp_path: Path) -> None:
    out = pool.run(2, r_save_paths, "truncate", str(tmp_path))
    for r in out:
        assert r["raised"] is not None
        assert r["raised"]["type"] == "IntegrityError"
        assert r["raised"]["failed_ranks"] == [0]  # found by the coordinator's stat
        assert f"{DATA1}: " in r["raised"]["message"] and "refusing to publish" in r["raised"]["message"]
    assert os.listdir(tmp_path) == []


def test_single_process_save_leaves_no_nonce(tmp_path: Path) -> None:
    reshard.save({"a": torch.ones(3)}, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == [DATA0, "manifest.json", "plan.bin"]
    reshard.save({"a": torch.ones(3)}, "memory://txn-single/ck")
    from reshard.storage import MemoryStorage

    keys = [k for k in MemoryStorage()._objects if k.startswith("txn-single/")]
    m = reshard.inspect("memory://txn-single/ck")  # no rename: data keys carry the attempt id
    assert list(m.files) == [f"att-{m.attempt_id}.{DATA0}"]
    assert sorted(keys) == [f"txn-single/ck/att-{m.attempt_id}.{DATA0}", "txn-single/ck/manifest.json"]


# ----------------------------------------------------------------------------- load


def _saved(pool: Any, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    pool.run(2, r_save, str(ck))
    assert sorted(os.listdir(ck)) == [DATA0, DATA1, "manifest.json", "plan.bin"]
    return ck


def _all_unchanged(out: list[dict[str, Any]]) -> None:
    for r in out:
        assert r["raised"] is not None, r
        assert r["unchanged"] == {"model.w": True, "model.v": True}, r
        assert r["extra_unchanged"], r  # the "zeros" rule did not run either
        assert "every target is unchanged" in r["raised"]["message"]


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_missing_or_short_file_on_one_rank_changes_no_target_anywhere(
        pool: Any, tmp_path: Path, damage: str) -> None:
    ck = _saved(pool, tmp_path)
    f = ck / DATA1  # only rank 1 needs it; rank 0's own file is intact
    if damage == "missing":
        f.unlink()
    else:
        os.truncate(f, f.stat().st_size - 5)
    out = pool.run(2, r_load_unchanged, str(ck), "plain")
    _all_unchanged(out)
    for r in out:
        assert r["raised"]["type"] == "IntegrityError" and r["raised"]["failed_ranks"] == [1]
        assert ("is missing" if damage == "missing" else "the manifest declares") in r["raised"]["message"]


def test_all_files_are_checked_at_once(tmp_path: Path) -> None:
    # one process loading everything: both problems reported by one error
    ck = tmp_path / "ck"
    st = {f"t{i}": torch.full((64,), float(i)) for i in range(2)}
    reshard.save(st, ck, options=reshard.SaveOptions(files_per_rank=2))
    files = sorted(n for n in os.listdir(ck) if n.endswith(".safetensors"))
    assert len(files) == 2
    (ck / files[0]).unlink()
    os.truncate(ck / files[1], 10)
    tgt = {f"t{i}": torch.zeros(64) for i in range(2)}
    with pytest.raises(reshard.IntegrityError) as ei:
        reshard.load(tgt, ck)
    assert "2 of 2 needed data file(s)" in str(ei.value)
    assert files[0] in str(ei.value) and files[1] in str(ei.value)
    assert all(t.abs().sum().item() == 0 for t in tgt.values())


@pytest.mark.parametrize("how", ["unexpected", "dtype-rank1"])
def test_refused_request_changes_no_target_anywhere(pool: Any, tmp_path: Path, how: str) -> None:
    ck = _saved(pool, tmp_path)
    out = pool.run(2, r_load_unchanged, str(ck), how)
    _all_unchanged(out)
    for r in out:
        assert r["raised"]["type"] == "ShardingError"
        if how == "dtype-rank1":  # one rank's pre-check failed: no rank wrote anything
            assert r["raised"]["failed_ranks"] == [1]
            assert "saved dtype float64, requested float32" in r["raised"]["message"]
        else:
            assert "unexpected (saved but not requested): ['model.v']" in r["raised"]["message"]


def _flip_last_byte(f: Path) -> None:
    """Flip the last byte of the file's last tensor (before its block-digest table)."""
    blocks = reshard.inspect(str(f.parent)).files[f.name].blocks
    data = bytearray(f.read_bytes())
    data[-1 - 8 * blocks] ^= 0x40
    f.write_bytes(bytes(data))


def _written(msg: str, rank: int) -> list[str] | None:
    m = re.search(rf"rank {rank} had already written \d+ target\(s\), which must be reloaded "
                  r"\(they may mix checkpoint and earlier values\): (\[.*?\])", msg)
    if m is not None:
        return list(ast.literal_eval(m.group(1)))
    assert f"rank {rank} had written no target" in msg
    return None


def test_flipped_byte_names_the_targets_already_written(pool: Any, tmp_path: Path) -> None:
    ck = _saved(pool, tmp_path)
    _flip_last_byte(ck / DATA1)  # the last bytes of rank 1's file: model.w (v, float64, comes first)
    out = pool.run(2, r_load_unchanged, str(ck), "plain")
    for rank, r in enumerate(out):
        assert r["raised"]["type"] == "IntegrityError" and r["raised"]["failed_ranks"] == [1]
        assert "checksum mismatch in 'model.w'" in r["raised"]["message"]
        named = _written(r["raised"]["message"], rank)
        assert named is not None
        assert set(r["changed"]) <= set(named), (r["changed"], named)
    assert out[1]["changed"] == ["model.v"]  # written before w's block failed; w untouched
    assert _written(out[1]["raised"]["message"], 1) == ["model.v"]
    assert sorted(out[0]["changed"]) == ["model.v", "model.w"]  # rank 0 finished its part
    # the allow_missing rule runs only once every rank's reads succeeded: model.extra is untouched
    assert set(_written(out[0]["raised"]["message"], 0) or []) == {"model.v", "model.w"}
    assert all(r["extra_unchanged"] for r in out), out


def test_flipped_byte_with_verify_first_changes_no_target(pool: Any, tmp_path: Path) -> None:
    ck = _saved(pool, tmp_path)
    _flip_last_byte(ck / DATA1)
    out = pool.run(2, r_load_unchanged, str(ck), "plain-verify-first")
    _all_unchanged(out)
    for r in out:
        assert r["raised"]["type"] == "IntegrityError"
        assert "checksum mismatch in 'model.w'" in r["raised"]["message"]


def test_verify_first_loads_exactly_and_refuses_unverifiable(tmp_path: Path) -> None:
    src = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(10)}
    reshard.save(src, tmp_path / "ck", options=reshard.SaveOptions(checksum_block_bytes=1024))
    tgt = {"a": torch.zeros(3000), "b": torch.zeros(10, dtype=torch.int64)}
    st = reshard.storage.LocalStorage()
    reshard.load(tgt, tmp_path / "ck", options=reshard.LoadOptions(verify_first=True), storage=st)
    assert torch.equal(tgt["a"], src["a"]) and torch.equal(tgt["b"], src["b"])
    data = 3000 * 4 + 10 * 8
    assert st.bytes_read >= 2 * data  # every needed byte read twice
    reshard.save(src, tmp_path / "nosum", options=reshard.SaveOptions(checksums=False))
    with pytest.raises(reshard.IntegrityError, match="saved without checksums"):
        reshard.load(tgt, tmp_path / "nosum", options=reshard.LoadOptions(verify_first=True))
    with pytest.raises(ValueError, match="verify_first needs checksums"):
        reshard.LoadOptions(verify_first=True, checksums=False)


def test_meta_targets_are_refused_before_reading(pool: Any, tmp_path: Path) -> None:
    ck = _saved(pool, tmp_path)
    out = pool.run(2, r_load_unchanged, str(ck), "meta")
    for rank, r in enumerate(out):
        assert r["raised"]["type"] == "ShardingError"
        msg = r["raised"]["message"]
        assert "'model.w' on device 'meta'" in msg and "materialise with `to_empty()` first" in msg
        # nothing read but the manifest, by the coordinator (it reaches the others by broadcast)
        assert r["bytes_read"] == (r["manifest_bytes"] if rank == 0 else 0)
        assert r["still_meta"]


def test_meta_module_through_model_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = torch.nn.Linear(4, 3)
    reshard.save({"model": reshard.ModelState(src)}, tmp_path / "ck")
    with torch.device("meta"):
        dst = torch.nn.Linear(4, 3)
    with pytest.raises(reshard.ShardingError, match=r"'(model\.)?weight' on device 'meta'.*to_empty\(\)"):
        reshard.load({"model": reshard.ModelState(dst)}, tmp_path / "ck")
    dst.to_empty(device="cpu")
    reshard.load({"model": reshard.ModelState(dst)}, tmp_path / "ck")
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
