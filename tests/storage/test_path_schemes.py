"""Paths as given: every result path (``SaveResult``, ``SaveHandle``,
``LoadResult``, ``latest``, the manager's saves and restores, the CLI's
output) keeps the scheme the caller used, so it resolves back to the same
store; ``file://`` and ``~`` are accepted wherever a path is."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reshard
from reshard.cli import main
from reshard.formats.hf_export import export_hf


def _state(v: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 3), v)}, "step": 1}


def _roundtrip(url: str, root: str) -> None:
    """Every result path under ``url`` (a checkpoint) and ``root`` (a
    manager's root) is a URL of the caller's scheme, and loads."""
    res = reshard.save(_state(), url, step=1)
    assert res.path == url
    assert reshard.verify(res.path).ok
    tgt = {"model": {"w": torch.zeros(4, 3)}, "step": 0}
    assert reshard.load(tgt, res.path).path == url and torch.equal(tgt["model"]["w"], torch.ones(4, 3))
    h = reshard.async_save(_state(2.0), url + "-async", step=2)
    assert h.path == url + "-async"
    done = h.wait()
    assert done is not None and done.path == url + "-async" and reshard.verify(done.path).ok
    mgr = reshard.CheckpointManager(root, every_steps=1, keep_last=3)
    saved = mgr.save(5, _state(5.0), sync=True)
    assert saved.path == f"{root}/step-00000005"
    assert reshard.latest(root) == saved.path
    got = mgr.restore(tgt)
    assert got is not None and got.path == saved.path and torch.equal(tgt["model"]["w"], torch.full((4, 3), 5.0))
    mgr.close()
    r = CliRunner().invoke(main, ["ls", root])
    assert r.exit_code == 0 and f"under {root}:" in r.output, r.output
    r = CliRunner().invoke(main, ["inspect", url])
    assert r.exit_code == 0 and r.output.splitlines()[0] == url, r.output
    r = CliRunner().invoke(main, ["verify", res.path])
    assert r.exit_code == 0 and r.output.startswith(f"OK {url} "), r.output


def test_memory_paths_keep_their_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a result path without its scheme would name ./paths/...
    _roundtrip("memory://paths/ck", "memory://paths/root")
    assert not (tmp_path / "paths").exists()


@pytest.mark.timeout(120)
def test_s3_paths_keep_their_scheme(s3e: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _roundtrip(s3e.url("paths-ck"), s3e.url("paths-root"))
    assert os.listdir(tmp_path) == []


def test_file_urls_and_home_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _roundtrip(f"file://{tmp_path}/ck", f"file://{tmp_path}/root")
    assert (tmp_path / "ck" / "manifest.json").is_file() and (tmp_path / "root").is_dir()
    # an export into a file:// URL writes there (not into ./file:/...), from a file:// checkpoint
    r = CliRunner().invoke(main, ["export", f"file://{tmp_path}/ck", f"file://{tmp_path}/hf"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hf" / "model.safetensors").is_file() and os.listdir(cwd) == []
    # ~ is the home directory, for the API and for the CLI (a quoted ~ the shell left alone)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    res = reshard.save(_state(3.0), "~/ck", step=3)
    assert res.path == str(tmp_path / "home" / "ck") and (tmp_path / "home" / "ck" / "manifest.json").is_file()
    cfg = tmp_path / "home" / "config.json"
    cfg.write_text(json.dumps({"model_type": "toy"}))
    out = export_hf("~/ck", "~/hf", copy_files=["~/config.json"])
    assert out.out_dir == str(tmp_path / "home" / "hf") and (tmp_path / "home" / "hf" / "config.json").is_file()
    r = CliRunner().invoke(main, ["verify", "~/ck"])
    assert r.exit_code == 0 and str(tmp_path / "home" / "ck") in r.output, r.output
    assert os.listdir(cwd) == []
