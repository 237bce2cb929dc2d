"""Corruption is an error of the right class, never a wrong tensor; discovery of the
latest committed checkpoint; ranged reads read only what they need."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from _manifest_doc import write_manifest_doc
from reshard import LoadOptions, SaveOptions, ShardedObject, ShardedTensor
from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    ShardingError,
)
from reshard.storage import LocalStorage

W = (torch.arange(24, dtype=torch.float32) * 0.5 - 3).reshape(4, 6)


def save_w(path: Path, **kw: Any) -> reshard.Manifest:
    reshard.save({"w": W.clone(), "epoch": 3}, path, **kw)
    return reshard.inspect(path)


def load_w(path: Path, **kw: Any) -> torch.Tensor:
    out = torch.zeros(4, 6)
    reshard.load({"w": out, "epoch": 0}, path, **kw)
    return out


def edit_manifest(path: Path, fn) -> None:
    p = path / "manifest.json"
    d = json.loads(p.read_text())
    fn(d)
    write_manifest_doc(p, d)


def data_file(path: Path, m: reshard.Manifest) -> Path:
    (name,) = m.files
    return path / name


# ----------------------------------------------------------------------------- corruption


def test_clean_checkpoint_loads_and_verifies(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_w(ck)
    assert load_w(ck).tolist() == W.tolist()
    rep = reshard.verify(ck)
    assert rep.ok and rep.problems == ()
    assert rep.bytes_checked == sum(f.size for f in rep.manifest.files.values())


def test_truncated_shard_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    m = save_w(ck)
    f = data_file(ck, m)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 5)
    out = torch.zeros(4, 6)
    with pytest.raises(IntegrityError) as ei:
        reshard.load({"w": out, "epoch": 0}, ck)
    assert f"file is {size - 5} bytes, the manifest declares {size}" in str(ei.value)
    assert out.abs().sum().item() == 0  # nothing half-written into the target
    rep = reshard.verify(ck)
    assert not rep.ok
    assert any(f"{size - 5} bytes, manifest declares {size}" in p for p in rep.problems)
    # even without checksums, a short file is never read as data
    with pytest.raises(IntegrityError, match="manifest declares"):
        load_w(ck, options=LoadOptions(checksums=False))


def test_flipped_byte_in_tensor_data(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    m = save_w(ck)
    (c,) = m.tensors["w"].chunks
    f = data_file(ck, m)
    raw = bytearray(f.read_bytes())
    pos = c.offset + 4 * 9 + 2  # third byte of element 9
    raw[pos] ^= 0x10
    f.write_bytes(bytes(raw))
    out = torch.zeros(4, 6)
    with pytest.raises(IntegrityError) as ei:
        reshard.load({"w": out, "epoch": 0}, ck)
    msg = str(ei.value)
    assert "checksum mismatch in 'w'" in msg and "block 0" in msg
    rep = reshard.verify(ck)
    assert not rep.ok
    assert any("checksum mismatch in tensor 'w'" in p for p in rep.problems)
    assert any("file checksum mismatch" in p for p in rep.problems)
    assert reshard.verify(ck, checksums=False).ok  # structure alone is fine
    # with checksums off the bytes load as they are: exactly the flipped value
    got = load_w(ck, options=LoadOptions(checksums=False))
    want = W.clone().reshape(-1)
    wb = want.view(torch.uint8)
    wb[4 * 9 + 2] ^= 0x10
    assert got.reshape(-1).view(torch.uint8).tolist() == wb.tolist()
    assert got.reshape(-1)[9].item() != W.reshape(-1)[9].item()
    assert torch.equal(torch.cat([got.reshape(-1)[:9], got.reshape(-1)[10:]]),
                       torch.cat([W.reshape(-1)[:9], W.reshape(-1)[10:]]))


def test_flipped_byte_in_unread_block_is_not_needed(tmp_path: Path) -> None:
    """Blocks are verified where they are read: corruption in rows not requested does
    not fail a partial load, and corruption in requested rows does."""
    ck = tmp_path / "ck"
    big = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    reshard.save({"w": big}, ck, options=SaveOptions(checksum_block_bytes=1024))
    m = reshard.inspect(ck)
    (c,) = m.tensors["w"].chunks
    f = ck / c.file
    raw = bytearray(f.read_bytes())
    raw[c.offset + 60 * 64 * 4] ^= 0xFF  # row 60
    f.write_bytes(bytes(raw))
    top = ShardedTensor("w", torch.zeros(16, 64), global_shape=(64, 64), global_offset=(0, 0))
    reshard.load({"w": top}, ck)
    assert top.data.tolist() == big[:16].tolist()
    bottom = ShardedTensor("w", torch.zeros(16, 64), global_shape=(64, 64), global_offset=(48, 0))
    with pytest.raises(IntegrityError, match=r"checksum mismatch in 'w' .*block 15"):
        reshard.load({"w": bottom}, ck)


def test_missing_manifest(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_w(ck)
    (ck / "manifest.json").unlink()
    for call in (lambda: load_w(ck), lambda: reshard.inspect(ck), lambda: reshard.verify(ck),
                 lambda: load_w(tmp_path / "never-existed")):
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint") as ei:
            call()
        assert isinstance(ei.value, FileNotFoundError)
        assert isinstance(ei.value, CheckpointError)


def test_missing_data_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    m = save_w(ck)
    data_file(ck, m).unlink()
    with pytest.raises(IntegrityError, match="data file named by the manifest is missing"):
        load_w(ck)
    rep = reshard.verify(ck)
    assert not rep.ok and any("missing" in p for p in rep.problems)


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden"])
def test_manifest_naming_file_outside(tmp_path: Path, name: str) -> None:
    ck = tmp_path / "ck"
    m = save_w(ck)
    (old,) = m.files
    (tmp_path / "x").write_bytes(data_file(ck, m).read_bytes())

    def redirect(d: dict) -> None:
        d["files"] = {name: d["files"][old]}
        for c in d["tensors"]["w"]["chunks"]:
            c["file"] = name

    edit_manifest(ck, redirect)
    with pytest.raises(ManifestError, match="is not a plain file inside the checkpoint"):
        load_w(ck)
    with pytest.raises(ManifestError):
        reshard.inspect(ck)
    rep = reshard.verify(ck)
    assert not rep.ok and rep.problems[0].startswith("ManifestError")


def test_declared_global_shape_larger_than_files_hold(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_w(ck)
    # (a) a bigger global shape with the same chunk: the chunks cannot fill it
    edit_manifest(ck, lambda d: d["tensors"]["w"].update(global_shape=[8, 6]))
    with pytest.raises(IntegrityError, match=r"chunks hold 24 elements, global_shape \[8, 6\] needs 48"):
        load_w(ck)
    # (b) a bigger chunk too: its declared length no longer matches its shape
    edit_manifest(ck, lambda d: d["tensors"]["w"]["chunks"][0].update(local_shape=[8, 6]))
    with pytest.raises(IntegrityError, match="declared length 96 bytes, but 48 elements of float32 need 192"):
        load_w(ck)
    # (c) and a matching length: it reaches past the end of the file
    edit_manifest(ck, lambda d: d["tensors"]["w"]["chunks"][0].update(length=192))
    with pytest.raises(IntegrityError, match="reach past the declared size"):
        load_w(ck)
    # (d) a file size grown to match: the actual file is shorter than declared
    # (a [4, 6] target is now a shape mismatch; an [8, 6] one reaches the files)
    edit_manifest(ck, lambda d: [f.update(size=f["size"] + 96) for f in d["files"].values()])
    with pytest.raises(ShardingError, match=r"saved global_shape \[8, 6\], requested \[4, 6\]"):
        load_w(ck)
    out = torch.zeros(8, 6)
    with pytest.raises(IntegrityError, match="the manifest declares"):
        reshard.load({"w": out, "epoch": 0}, ck)
    assert out.abs().sum().item() == 0
    rep = reshard.verify(ck)
    assert not rep.ok and any("manifest declares" in p for p in rep.problems)
    # (e) absurd shapes are refused before anything is allocated
    edit_manifest(ck, lambda d: d["tensors"]["w"].update(global_shape=[2**62, 6]))
    with pytest.raises(ManifestError, match="out of range"):
        load_w(ck)


def test_data_file_replaced_by_symlink(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    m = save_w(ck)
    f = data_file(ck, m)
    outside = tmp_path / "outside.safetensors"
    shutil.move(f, outside)
    os.symlink(outside, f)
    out = torch.zeros(4, 6)
    with pytest.raises(ManifestError, match="symbolic link"):
        reshard.load({"w": out, "epoch": 0}, ck)
    assert out.abs().sum().item() == 0
    rep = reshard.verify(ck)
    assert not rep.ok and any("symbolic link" in p for p in rep.problems)


def test_manifest_symlink_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_w(ck)
    shutil.move(ck / "manifest.json", tmp_path / "m.json")
    os.symlink(tmp_path / "m.json", ck / "manifest.json")
    with pytest.raises(ManifestError, match="symbolic link"):
        load_w(ck)


@pytest.mark.parametrize("raw", [b"", b"{not json", b"\x80\x04\x95\x00", b"[]", b'{"format": "reshard"}'])
def test_manifest_not_json_or_not_a_manifest(tmp_path: Path, raw: bytes) -> None:
    ck = tmp_path / "ck"
    save_w(ck)
    (ck / "manifest.json").write_bytes(raw)
    with pytest.raises(ManifestError, match="invalid manifest"):
        load_w(ck)
    rep = reshard.verify(ck)
    assert not rep.ok and rep.problems[0].startswith("ManifestError")


def test_corrupt_value_encoding_is_manifest_error(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_w(ck)
    edit_manifest(ck, lambda d: d["values"].update(epoch={"$tuple": 5}))
    with pytest.raises(ManifestError, match="encoded value"):
        load_w(ck)
    edit_manifest(ck, lambda d: d["values"].update(epoch={"$pickle": "gASV"}))
    with pytest.raises(ManifestError, match=r"unknown tag '\$pickle'"):
        load_w(ck)


def test_incomplete_object_grid_is_manifest_error(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    reshard.save({f"c{r}": ShardedObject("cursor", {"pos": r}, global_shape=(2,), global_offset=(r,))
                  for r in range(2)}, ck)
    edit_manifest(ck, lambda d: d["objects"]["cursor"]["chunks"].pop())
    with pytest.raises(ManifestError, match="object 'cursor': 1 records of 1 distinct elements"):
        reshard.load({"c": ShardedObject("cursor", None, global_shape=(2,), global_offset=(1,))}, ck)


def test_tampered_chunk_offset_is_refused_at_load(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    full = torch.arange(4.0)
    reshard.save({"w": [ShardedTensor("w", full[:2].clone(), global_shape=(4,), global_offset=(0,)),
                        ShardedTensor("w", full[2:].clone(), global_shape=(4,), global_offset=(2,))]}, ck)
    edit_manifest(ck, lambda d: d["tensors"]["w"]["chunks"][1].update(global_offset=[1]))  # overlap + hole
    assert not reshard.verify(ck).ok
    out = torch.full((4,), -1.0)
    with pytest.raises(ShardingError, match="w: overlapping chunks"):
        reshard.load({"w": out}, ck)


# ----------------------------------------------------------------------------- latest


def test_latest_orders_committed_by_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert reshard.latest(root) is None  # no root yet: nothing, not an error
    reshard.save({"w": torch.ones(1)}, root / "step-00000100", step=100)
    reshard.save({"w": torch.ones(1)}, root / "step-00000200", step=200)
    assert reshard.latest(root) == str(root / "step-00000200")
    # an attempt with data but no manifest; and one that wrote its manifest but never renamed
    inc = root / "step-00000300.incomplete-xyz"
    inc.mkdir()
    shutil.copy(root / "step-00000200" / "data-r00000-0.safetensors", inc)
    assert reshard.latest(root) == str(root / "step-00000200")
    shutil.copy(root / "step-00000200" / "manifest.json", inc)
    assert reshard.latest(root) == str(root / "step-00000200")
    # a directory with a committed-looking name but no manifest
    (root / "step-00000999").mkdir()
    (root / "step-00000999" / "data-r00000-0.safetensors").write_bytes(b"\0" * 16)
    assert reshard.latest(root) == str(root / "step-00000200")
    # a directory whose manifest is corrupt
    (root / "step-00001000").mkdir()
    (root / "step-00001000" / "manifest.json").write_text("{broken")
    assert reshard.latest(root) == str(root / "step-00000200")
    # a stray file at the root is not a checkpoint either
    (root / "notes.txt").write_text("hi")
    assert reshard.latest(root) == str(root / "step-00000200")


def test_latest_orders_by_manifest_step_not_name(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(1)}, tmp_path / "b", step=5)
    reshard.save({"w": torch.ones(1)}, tmp_path / "a", step=7)
    assert reshard.latest(tmp_path) == str(tmp_path / "a")
    reshard.save({"w": torch.ones(1)}, tmp_path / "c", step=6)
    assert reshard.latest(tmp_path) == str(tmp_path / "a")


def test_latest_with_only_incomplete_is_none(tmp_path: Path) -> None:
    inc = tmp_path / "step-00000200.incomplete-abc"
    inc.mkdir()
    (inc / "data-r00000-0.safetensors").write_bytes(b"\0" * 8)
    assert reshard.latest(tmp_path) is None


# ----------------------------------------------------------------------------- partial reads


def test_partial_read_reads_about_its_share(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    rows, cols = 1024, 1024  # 4 MiB of float32
    big = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    nbytes = big.numel() * 4
    reshard.save({"w": big}, ck, options=SaveOptions(checksum_block_bytes=64 * 1024))
    storage = LocalStorage()
    q = ShardedTensor("w", torch.zeros(rows // 4, cols), global_shape=(rows, cols), global_offset=(rows // 2, 0))
    res = reshard.load({"w": q}, str(ck), storage=storage)
    assert q.data.tolist() == big[rows // 2: rows // 2 + rows // 4].tolist()
    assert 0.25 * nbytes <= storage.bytes_read <= 0.3 * nbytes
    assert res.bytes_read == storage.bytes_read  # includes the manifest
    # a quarter of the columns needs every row: a contiguous span of the chunk, still
    # far from the whole, and never more than the whole
    storage2 = LocalStorage()
    q2 = ShardedTensor("w", torch.zeros(rows, cols // 4), global_shape=(rows, cols), global_offset=(0, 0))
    reshard.load({"w": q2}, str(ck), storage=storage2)
    assert q2.data.tolist() == big[:, : cols // 4].tolist()
    assert storage2.bytes_read <= nbytes + 64 * 1024


def test_a_directory_named_manifest_json_is_an_invalid_checkpoint(tmp_path: Path) -> None:
    """A directory where the manifest should be (a bad copy, a tool's mkdir)
    is one invalid checkpoint, skipped by ``latest`` (before: a StorageError
    from ``latest(root)`` made the whole root unusable: every restart crashed)."""
    root = tmp_path / "run"
    save_w(root / "step-00000001")
    (root / "step-00000002" / "manifest.json").mkdir(parents=True)
    assert Path(str(reshard.latest(root))).name == "step-00000001"
    with pytest.raises(ManifestError, match=r"step-00000002/manifest.json: is a directory"):
        load_w(root / "step-00000002")
    rep = reshard.verify(root / "step-00000002")
    assert not rep.ok and "is a directory" in rep.problems[0]
