"""``reshard plan CKPT --layout L``: a dry run of a load into another layout
(real checkpoint files; the CLI in process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reshard
from _manifest_doc import write_manifest_doc
from reshard import ShardedTensor
from reshard.cli import main
from reshard.planning.dryrun import parse_target_layout, plan_layout


def _tp2(state: dict[str, Any], name: str, rows: int, cols: int, dim: int) -> None:
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    views = []
    for i, p in enumerate(full.chunk(2, dim)):
        off = [0, 0]
        off[dim] = i * p.shape[dim]
        views.append(ShardedTensor(name, p.clone(), global_shape=(rows, cols), global_offset=tuple(off)))
    state[name] = views


def _saved(tmp_path: Path) -> Path:
    """A 4-layer model saved TP2 (one process holding both shards)."""
    state: dict[str, Any] = {}
    _tp2(state, "model.embed.weight", 64, 32, 0)
    for layer in range(4):
        _tp2(state, f"model.layers.{layer}.attn.q.weight", 32, 32, 0)
        _tp2(state, f"model.layers.{layer}.attn.o.weight", 32, 32, 1)
        state[f"model.layers.{layer}.norm.weight"] = torch.ones(32)
    state["model.final_norm.weight"] = torch.ones(32)
    ck = tmp_path / "ck"
    reshard.save(state, ck)
    return ck


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_plan_reports_each_rank_of_a_tp_pp_dp_layout(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    out = tmp_path / "plan.json"
    r = _run("plan", str(ck), "--layout", "dp2,tp2,pp2", "--read-rate", "100", "--read-once-min-bytes", "0",
             "--json", str(out))
    assert r.exit_code == 0, r.output
    assert "into tp2,pp2,dp2 (8 ranks): covered" in r.output
    doc = json.loads(out.read_text())
    assert doc["covered"] and doc["world"] == 8 and len(doc["ranks"]) == 8
    # stage 0: embedding rows of one TP rank + layers 0-1 (q rows, o columns: half each; norm whole)
    layer = 16 * 32 * 4 + 32 * 16 * 4 + 32 * 4
    stage0, stage1 = 32 * 32 * 4 + 2 * layer, 2 * layer + 32 * 4
    for rk in doc["ranks"]:
        assert rk["needed_bytes"] == (stage0 if rk["coords"]["pp"] == 0 else stage1), rk
        assert rk["read_bytes_alone"] == rk["needed_bytes"]  # whole saved chunks, one block each
    # replicas read once: every saved chunk is read by exactly one rank
    m = reshard.inspect(str(ck))
    saved = sum(c.length for e in m.tensors.values() for c in e.chunks)
    assert sum(rk["read_bytes"] for rk in doc["ranks"]) == doc["total_read_bytes"] == saved
    big = doc["ranks"][doc["largest_rank"]]
    assert big["read_bytes"] == max(rk["read_bytes"] for rk in doc["ranks"])
    assert doc["est_seconds"] == pytest.approx(big["read_bytes"] / 100e6)
    assert not doc["read_rate_measured"] and big["files"] == sorted(m.files)


def test_plan_measures_the_store_and_takes_a_world_size_as_fsdp(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    out = tmp_path / "plan.json"
    r = _run("plan", str(ck), "--layout", "4", "--json", str(out))
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["layout"] == "fsdp4" and doc["world"] == 4
    assert doc["read_rate_measured"] and doc["read_rate_sample_bytes"] > 0 and doc["read_rate_bytes_per_s"] > 0
    m = reshard.inspect(str(ck))
    # dim 0 cut in 4: each rank needs a quarter of every tensor's rows
    total = sum(c.length for e in m.tensors.values() for c in e.chunks)
    assert [rk["needed_bytes"] for rk in doc["ranks"]] == [total // 4] * 4


def test_plan_agrees_with_layout_requests_of_a_grid() -> None:
    lay = parse_target_layout("tp4 pp1 dp3")
    assert (lay.kind, lay.tp, lay.pp, lay.dp, lay.world) == ("grid", 4, 1, 3, 12)
    assert lay.coords(5) == {"pp": 0, "dp": 1, "tp": 1}
    with pytest.raises(ValueError, match="expected e.g."):
        parse_target_layout("tp2,tp4")


def test_plan_refuses_an_uncoverable_layout_naming_the_first_missing_region(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    p = ck / "manifest.json"
    doc = json.loads(p.read_bytes())
    chunks = doc["tensors"]["model.layers.2.attn.o.weight"]["chunks"]
    chunks[1]["global_offset"] = [0, 8]  # columns 8..24 twice, 24..32 held by no chunk
    write_manifest_doc(p, doc)
    from reshard.ondisk.manifest import decode_manifest

    m = decode_manifest(p.read_bytes())  # parsed, before the structure check that inspect and plan make
    with pytest.raises(reshard.CoverageError) as e:
        plan_layout(m, parse_target_layout("tp2,pp2"), read_once_min_bytes=0)
    msg = str(e.value)
    assert ("no saved chunk holds 'model.layers.2.attn.o.weight' at offset [0, 24] shape [32, 8]" in msg
            and "needed by rank 3" in msg), msg
    # the command refuses the checkpoint itself first, as load and verify do (its chunks overlap)
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", str(ck), "--layout", "tp2,pp2", "--read-rate", "1",
                                  "--json", str(out)])
    assert r.exit_code == 2, r.output
    assert "load and verify refuse too" in r.output and "overlapping chunks" in r.output, r.output
    with pytest.raises(reshard.CheckpointError):  # the load refuses it as well
        tgt = {k: torch.zeros(v.global_shape) for k, v in reshard.inspect(str(ck)).tensors.items()}
        reshard.load(tgt, ck)


def test_plan_usage_errors(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    r = CliRunner().invoke(main, ["plan", str(ck), "--layout", "tq2"])
    assert r.exit_code == 2 and "expected e.g. 'tp2,pp2,dp2'" in r.output
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "nope"), "--layout", "2"])
    assert r.exit_code == 2


def test_dry_run_of_plain_dp_reads_each_chunk_once(tmp_path: Path) -> None:
    m = reshard.inspect(str(_saved(tmp_path)))
    lp = plan_layout(m, parse_target_layout("dp3"), read_once_min_bytes=0)
    assert all(r.needed_bytes == lp.ranks[0].needed_bytes for r in lp.ranks)
    assert sum(r.read_bytes for r in lp.ranks) == lp.total_read_bytes == lp.ranks[0].needed_bytes


def test_dry_run_small_ranges_are_read_by_every_rank_by_default(tmp_path: Path) -> None:
    m = reshard.inspect(str(_saved(tmp_path)))
    lp = plan_layout(m, parse_target_layout("dp3"))  # every chunk here is under 64 KiB
    assert all(r.read_bytes == r.needed_bytes and r.received == 0 for r in lp.ranks)
