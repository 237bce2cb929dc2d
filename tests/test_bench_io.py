"""``reshard bench io``: a smoke run on real gloo ranks (tiny state; the
measurements themselves stay out of CI), the layout syntax and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reshard.bench.models import LayoutSpec, parse_layout
from reshard.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_layout_syntax() -> None:
    assert parse_layout("fsdp") == LayoutSpec("fsdp", None)
    assert parse_layout("fsdp4") == LayoutSpec("fsdp", 4)
    assert parse_layout("dp2") == LayoutSpec("dp", 2)
    assert parse_layout("dp") == LayoutSpec("dp", None)
    assert parse_layout("dp2,tp1") == LayoutSpec("dp", 2)
    assert str(parse_layout("fsdp").on(2)) == "fsdp2"
    with pytest.raises(ValueError, match="tensor and pipeline"):
        parse_layout("dp2,tp2")
    with pytest.raises(ValueError, match="bad layout"):
        parse_layout("zero3")


@pytest.mark.parametrize("args,message", [
    (["--backend", "s3"], "not available yet"),
    (["--backend", "tape"], "one of local, memory, s3"),
    (["--world", "0"], "world sizes from 1 to 8"),
    (["--layout", "dp2,tp2"], "tensor and pipeline"),
])
def test_bad_settings_are_usage_errors(args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, ["bench", "io", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output


@pytest.mark.timeout(300)  # 2 + 1 spawned ranks importing torch, on a shared 2-core machine
def test_bench_io_smoke(tmp_path: Path) -> None:
    """Every phase runs on 2 real gloo ranks (FSDP2), reshards to 1 rank, and
    reports each method with its ratios; the loaded state equals the saved one."""
    out = tmp_path / "io.json"
    png = tmp_path / "io.png"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "synthetic", "--synthetic-mib", "2",
         "--world", "2", "--reshard-to", "fsdp1", "--repeat", "1", "--settle", "0", "--steps", "1",
         "--skip", "dcp-async-process,dcp-threads,torch-save", "--dir", str(tmp_path),
         "--json", str(out), "--plot", str(png), "--no-progress"],
        capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reshard.save" in p.stdout and "x limit" in p.stdout and "targets:" in p.stdout
    doc = json.loads(out.read_text())
    s = doc["summary"]["local/w2"]
    assert s["layout"] == "fsdp2"
    assert set(s["save"]) == {"reshard", "reshard-nocheck", "limit-write", "dcp", "safetensors"}
    assert {"memcpy", "reshard-async", "dcp-async"} <= set(s["async"])
    assert {"limit-read", "reshard", "reshard-nocheck", "dcp", "safetensors", "first-step"} <= set(s["load"])
    assert all(e["fingerprint_ok"] for e in s["load"].values())
    assert all(e["fingerprint_ok"] for e in s["reshard"].values())
    assert any(k.endswith("@fsdp1<-fsdp2") for k in s["reshard"])
    # every rank's bytes add up to the checkpoint's stored tensor bytes
    rs = s["save"]["reshard"]
    assert sum(p["bytes"] for p in rs["per_rank"]) == rs["stored_bytes"] - _manifest_bytes(doc)
    assert set(rs["phases_s"]) == {"stage", "plan", "write", "commit"}
    assert {"manifest", "plan", "read", "place"} == set(s["load"]["reshard"]["phases_s"])
    assert "reshard-async_ratio" in s["train"]
    assert all(r["loadavg"] for r in doc["records"])
    assert all(len(r["rss_after"]) == r.get("target_world", 2) and all(r["rss_after"])
               for r in doc["records"])
    phases = {r["phase"] for r in doc["records"]}
    assert phases == {"setup", "train", "save", "async", "rss", "load", "reshard"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # the scratch directory holds nothing after the run
    assert sorted(x.name for x in tmp_path.iterdir()) == ["io.json", "io.png"]


def _manifest_bytes(doc: dict) -> int:
    rec = [r for r in doc["records"] if r["phase"] == "save" and r["method"] == "reshard"][-1]
    return int(rec["manifest_bytes"]) + int(rec["plan_bytes"])


def test_bench_scale_smoke_beside_io() -> None:
    """`reshard bench scale` on a tiny layout, in the same group as `io`."""
    r = CliRunner().invoke(main, ["bench", "--help"])
    assert r.exit_code == 0 and "io" in r.output and "scale" in r.output
    r = CliRunner().invoke(main, ["bench", "scale", "--tp", "2", "--pp", "2", "--dp", "2", "--model",
                                  "llama-8b", "--only-largest"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "8 ranks" in r.output
