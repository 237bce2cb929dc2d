"""Smaller boundary items: a PyTorch DCP directory is described as what it is
(its own file count, no checksums, its saved step); a symbolic link inside a
root is not a second checkpoint (ls, latest, restore and gc agree)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from click.testing import CliRunner

import reshard
from reshard.cli import main


def _dcp(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "step": 5},
                 checkpoint_id=str(path), no_dist=True)


def test_dcp_inspect_and_verify_report_what_dcp_wrote(tmp_path: Path) -> None:
    ck = tmp_path / "dcp"
    _dcp(ck)
    ndata = len([n for n in os.listdir(ck) if n.endswith(".distcp")])
    assert reshard.inspect(ck).step == 5
    r = CliRunner().invoke(main, ["inspect", str(ck)])
    assert r.exit_code == 0, r.output
    head = r.output.splitlines()[2:4]
    assert "step 5" in head[0], head
    assert f"{ndata} file{'' if ndata == 1 else 's'}," in head[1] and "no checksums" in head[1], head
    assert "xxh3" not in head[1]
    out = tmp_path / "v.json"
    r = CliRunner().invoke(main, ["verify", str(ck), "--json", str(out)])
    assert r.exit_code == 0 and "no checksums" in r.output and "checksummed" not in r.output, r.output
    assert json.loads(out.read_text())["checksums"] is False
    # a native checkpoint: checksums, as before
    reshard.save({"w": torch.ones(2)}, tmp_path / "native", step=1)
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "native"), "--json", str(out)])
    assert r.exit_code == 0 and "checksummed" in r.output
    assert json.loads(out.read_text())["checksums"] is True


def test_a_link_inside_a_root_is_not_a_second_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mgr = reshard.CheckpointManager(root, every_steps=1, keep_last=1, preempt_signals=())
    for step in (1, 2):
        mgr.save(step, {"x": torch.full((4,), float(step))}, sync=True)
    os.symlink(root / "step-00000002", root / "best")
    os.symlink(tmp_path / "elsewhere", root / "dangling")
    assert reshard.latest(root) == str(root / "step-00000002")
    names = [e.name for e in mgr.candidates()]
    assert "best" not in names and "dangling" not in names
    r = CliRunner().invoke(main, ["ls", str(root)])
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.output.splitlines() if ln.rstrip().endswith(("step-00000002", "best"))]
    assert len(rows) == 1 and rows[0].rstrip().endswith("step-00000002"), r.output
    assert "link best ignored" in r.output and "link dangling ignored" in r.output
    x = torch.zeros(4)
    res = reshard.CheckpointManager(root, preempt_signals=()).restore({"x": x})
    assert res is not None and res.path == str(root / "step-00000002") and torch.equal(x, torch.full((4,), 2.0))
    r = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1", "--grace", "0"])
    assert r.exit_code == 0 and "best" not in r.output, r.output
    assert os.path.islink(root / "best") and (root / "step-00000002" / "manifest.json").is_file()
    # the link's own path still loads (resolved once, to its target)
    y = torch.zeros(4)
    reshard.load({"x": y}, root / "best")
    assert torch.equal(y, torch.full((4,), 2.0))
