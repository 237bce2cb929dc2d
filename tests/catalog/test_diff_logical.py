"""``reshard diff`` compares logical content: the same state saved at DP 1 and
at DP 2 (tensors split otherwise, a per-rank grid of empty leftovers of
another shape), a DCP folder at DP 1 and DP 2, and a DCP folder against its
``convert --from dcp`` are IDENTICAL (exit 0); removed keys are grouped by
subtree with counts, every one in --json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import _diff_fns as fns
import reshard
from reshard.catalog.diff import by_subtree, diff
from reshard.cli import main
from reshard.testing.pool import WorkerPool


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def ckpts(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("diff")
    out = {}
    for dp in (1, 2):
        out[f"r{dp}"] = str(root / f"r{dp}")
        pool.run(dp, fns.r_save, out[f"r{dp}"])
        out[f"d{dp}"] = str(root / f"d{dp}")
        pool.run(dp, fns.r_dcp_save, out[f"d{dp}"])
    return out


@pytest.mark.timeout(180)
def test_same_state_at_dp1_and_dp2_is_identical(ckpts: dict[str, str], tmp_path: Path) -> None:
    m1, m2 = reshard.inspect(ckpts["r1"]), reshard.inspect(ckpts["r2"])
    assert list(m1.objects["data.pending"].global_shape) == [1]
    assert list(m2.objects["data.pending"].global_shape) == [2]
    assert len(m2.tensors["model.0.weight"].chunks) == 2 and len(m1.tensors["model.0.weight"].chunks) == 1
    r = diff(ckpts["r1"], ckpts["r2"])
    assert r.identical, r.to_json()
    assert r.same_by_value + r.same_by_digest == len(m1.tensors)
    # every tensor split otherwise (all but the 0-dim steps) is read and compared by value
    assert r.same_by_value == sum(1 for te in m1.tensors.values() if te.global_shape)
    j = tmp_path / "d.json"
    res = _run("diff", ckpts["r1"], ckpts["r2"], "--json", str(j))
    assert res.exit_code == 0 and res.stdout.strip().endswith("IDENTICAL"), res.stdout
    assert json.loads(j.read_text())["identical"] is True


@pytest.mark.timeout(180)
def test_dcp_folders_and_their_conversion_are_identical(ckpts: dict[str, str], tmp_path: Path) -> None:
    res = _run("diff", ckpts["d1"], ckpts["d2"])
    assert res.exit_code == 0 and res.stdout.strip().endswith("IDENTICAL"), res.stdout
    conv = tmp_path / "conv"
    assert _run("convert", "--from", "dcp", ckpts["d2"], str(conv)).exit_code == 0
    for a, b in ((ckpts["d2"], str(conv)), (str(conv), ckpts["d1"])):
        res = _run("diff", a, b)
        assert res.exit_code == 0 and res.stdout.strip().endswith("IDENTICAL"), res.stdout
    # a DCP folder against reshard's own checkpoint of the same state: the tensors match
    r = diff(ckpts["d1"], ckpts["r2"])
    assert not r.differ and not r.changed and not r.unreadable, r.to_json()
    assert {k for k in r.added} >= {"data.pending", "data.epoch"}


@pytest.mark.timeout(120)
def test_removed_keys_grouped_by_subtree(ckpts: dict[str, str], tmp_path: Path) -> None:
    fns_m, _ = fns._trained()
    only = tmp_path / "model-only"
    reshard.save({"model": reshard.ModelState(fns_m), "step": 2}, only)
    j = tmp_path / "d.json"
    res = _run("diff", ckpts["r1"], str(only), "--json", str(j))
    assert res.exit_code == 1 and "DIFFERENT" in res.stdout
    d = json.loads(j.read_text())
    removed = d["removed"]
    n_state = sum(1 for k in removed if k.startswith("optim.state."))
    assert n_state == 12 and d["removed_by_subtree"]["optim.state"] == n_state  # 4 params x 3 keys
    assert f"  optim.state.* ({n_state} keys)" in res.stdout, res.stdout
    assert "optim.state.0.weight.exp_avg" not in res.stdout  # one line per subtree, not per key
    assert by_subtree(["a.b.c", "a.b.d", "e"]) == {"a.b": 2, "e": 1}


def test_values_and_objects_compared_by_content(tmp_path: Path) -> None:
    """An object grid of equal elements is one value, whatever its grid; a
    value of another content is reported."""
    reshard.save({"x": reshard.ShardedObject("x", [1, 2]), "v": {"a": float("nan"), "b": [1]},
                  "t": torch.arange(3.0)}, tmp_path / "a")
    reshard.save({"x": [1, 2], "v": {"b": [1], "a": float("nan")}, "t": torch.arange(3.0)}, tmp_path / "b")
    r = diff(tmp_path / "a", tmp_path / "b")
    assert r.identical, r.to_json()
    reshard.save({"x": [1, 3], "v": {"b": [1], "a": 0.0}, "t": torch.arange(3.0)}, tmp_path / "c")
    r = diff(tmp_path / "a", tmp_path / "c")
    assert r.values_differ == ("v", "x"), r.to_json()
