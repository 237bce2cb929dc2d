"""Import from a Hugging Face hub cache snapshot: ``models--org--name/
snapshots/<rev>/<file>`` are symbolic links to ``../../blobs/<sha>``, as
``huggingface_hub.snapshot_download`` lays them out. Import resolves each one
(a regular file inside the cache repo folder or the directory); a link out of
it, to a FIFO or to a directory is refused naming the file; native reshard
checkpoints keep refusing symbolic links."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard.errors import CheckpointError
from reshard.formats.hf_export import INDEX_NAME
from reshard.formats.hf_import import import_hf


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}


def _hub_snapshot(root: Path, *, sharded: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """A cache repo folder with every file a blob and the snapshot entries
    relative symbolic links to them (as huggingface_hub writes them)."""
    repo = root / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    want = _tensors(0)
    tmp = root / "build"
    tmp.mkdir()
    if sharded:
        save_file({"a.weight": want["a.weight"]}, str(tmp / "model-00001-of-00002.safetensors"))
        save_file({"b.bias": want["b.bias"]}, str(tmp / "model-00002-of-00002.safetensors"))
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"}}))
    else:
        save_file(want, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text("{}")
    for f in sorted(tmp.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        os.replace(f, blobs / sha)
        os.symlink(f"../../blobs/{sha}", snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snap, want


def _targets() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(5)}


@pytest.mark.parametrize("sharded", [False, True])
def test_import_from_a_hub_cache_snapshot(tmp_path: Path, sharded: bool) -> None:
    snap, want = _hub_snapshot(tmp_path, sharded=sharded)
    assert all(p.is_symlink() for p in snap.iterdir())
    got = _targets()
    import_hf(got, snap)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_convert_cli_from_a_hub_cache_snapshot(tmp_path: Path) -> None:
    snap, want = _hub_snapshot(tmp_path, sharded=True)
    src = str(Path(reshard.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-m", "reshard.cli", "convert", "--from", "hf", str(snap), str(out)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert reshard.verify(str(out)).ok
    got = _targets()
    reshard.load(got, str(out), strict=False)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _hostile(tmp_path: Path, make: Callable[[Path], None]) -> tuple[Path, str]:
    snap, _ = _hub_snapshot(tmp_path, sharded=True)
    name = "model-00002-of-00002.safetensors"
    (snap / name).unlink()
    make(snap / name)
    return snap, name


def _fifo(p: Path) -> None:
    # the FIFO is a blob of the repo: the target is inside, but no regular file
    blob = p.parent.parent.parent / "blobs" / "fifo"
    os.mkfifo(blob)
    os.symlink("../../blobs/fifo", p)


def _outside_repo(p: Path) -> None:
    other = p.parent.parent.parent.parent / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    save_file(_tensors(1), str(other / "sha"))
    os.symlink(str(other / "sha"), p)


@pytest.mark.parametrize("make", [
    pytest.param(lambda p: os.symlink("/etc/passwd", p), id="etc-passwd"),
    pytest.param(_outside_repo, id="outside-the-repo"),
    pytest.param(_fifo, id="fifo"),
    pytest.param(lambda p: os.symlink("../../blobs", p), id="directory"),
    pytest.param(lambda p: os.symlink("../../blobs/none", p), id="dangling"),
])
def test_hostile_snapshot_links_are_refused_naming_the_file(tmp_path: Path, make: Callable[[Path], None]) -> None:
    snap, name = _hostile(tmp_path, make)
    got = _targets()
    with pytest.raises(CheckpointError, match=name):
        import_hf(got, snap)
    assert torch.count_nonzero(got["a.weight"]) == 0  # nothing was loaded


def test_a_plain_directory_may_link_inside_itself_only(tmp_path: Path) -> None:
    d = tmp_path / "plain"
    (d / "store").mkdir(parents=True)
    save_file(_tensors(0), str(d / "store" / "x"))
    os.symlink("store/x", d / "model.safetensors")
    got = _targets()
    import_hf(got, d)
    assert torch.equal(got["b.bias"], _tensors(0)["b.bias"])
    (d / "model.safetensors").unlink()
    save_file(_tensors(0), str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), d / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        import_hf(_targets(), d)


def test_native_checkpoints_still_refuse_symbolic_links(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    reshard.save({"w": torch.arange(6.0)}, str(ck))
    (name,) = json.loads((ck / "manifest.json").read_text())["files"]
    data = ck / name
    real = tmp_path / "moved"
    os.replace(data, real)
    os.symlink(str(real), data)
    with pytest.raises(CheckpointError, match="symbolic link"):
        reshard.load({"w": torch.zeros(6)}, str(ck))
