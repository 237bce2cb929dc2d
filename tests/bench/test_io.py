"""``reshard bench io``: smoke runs on real gloo ranks (tiny states; the
measurements themselves stay out of CI): FSDP2 on local disk with the peers,
and the demo trainer's TP -> PP reshard on a loopback S3 endpoint (moto); the
layout syntax, the state digest and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import reshard
from reshard.bench.digest import chunk_sum, combine
from reshard.bench.models import LayoutSpec, parse_layout
from reshard.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_layout_syntax() -> None:
    assert parse_layout("fsdp") == LayoutSpec("fsdp", None)
    assert parse_layout("fsdp4") == LayoutSpec("fsdp", 4)
    assert parse_layout("dp2") == LayoutSpec("dp", 2)
    assert parse_layout("dp") == LayoutSpec("dp", None)
    assert parse_layout("dp2,tp1") == LayoutSpec("dp", 2)
    assert str(parse_layout("fsdp").on(2)) == "fsdp2"
    # the demo's syntax with TP/PP: the demo trainer's (pp, dp, tp) grid
    g = parse_layout("dp2,tp2")
    assert g == LayoutSpec("grid", 4, tp=2, pp=1) and g.dp == 2 and str(g) == "pp1,dp2,tp2"
    assert parse_layout("tp1,pp2,dp2") == LayoutSpec("grid", 4, tp=1, pp=2)
    assert str(parse_layout("tp1,pp2,dp2")) == "pp2,dp2,tp1"
    with pytest.raises(ValueError, match="needs 4 ranks"):
        g.on(2)
    with pytest.raises(ValueError, match="bad layout"):
        parse_layout("zero3")
    with pytest.raises(ValueError, match="bad layout"):
        parse_layout("tp0,dp2")
    for zero in ("fsdp0", "dp0"):  # was the run's own world size, silently
        with pytest.raises(ValueError, match="a degree is at least 1"):
            parse_layout(zero)


def test_digest_is_layout_independent_and_bit_exact() -> None:
    """The same tensor cut into boxes, or into flat ranges of a box, gives
    the same digest; one bit flipped or two elements swapped changes it."""
    import torch

    t = torch.randn(6, 10)

    def dig(parts: list[tuple]) -> str:
        return combine([{f"w|{i}": (chunk_sum(*p), 0) for i, p in enumerate(parts)}])["digest"]

    whole = dig([(t, (6, 10), (0, 0), (6, 10))])
    cols = dig([(t[:, :4], (6, 10), (0, 0), (6, 4)), (t[:, 4:], (6, 10), (0, 4), (6, 6))])
    f = t.reshape(-1)
    flat = dig([(f[:17], (6, 10), (0, 0), (6, 10), 0), (f[17:], (6, 10), (0, 0), (6, 10), 17)])
    assert whole == cols == flat
    bad = t.clone()
    bad.view(torch.int32)[3, 3] ^= 1  # the lowest mantissa bit
    assert dig([(bad, (6, 10), (0, 0), (6, 10))]) != whole
    sw = t.clone()
    sw[0, 0], sw[0, 1] = t[0, 1], t[0, 0]
    assert dig([(sw, (6, 10), (0, 0), (6, 10))]) != whole
    # replicas: one copy counted; replicas that differ are named
    r = combine([{"w|a": (5, 4)}, {"w|a": (5, 4)}])
    assert r["bytes"] == 4 and r["replicas_differ"] == []
    assert combine([{"w|a": (5, 4)}, {"w|a": (6, 4)}])["replicas_differ"] == ["w|a"]


@pytest.mark.parametrize("args,message", [
    (["--backend", "tape"], "one of local, memory, s3"),
    (["--world", "0"], "world sizes from 1 to 8"),
    (["--layout", "dp2,tp2"], "tensor/pipeline layouts run the demo's trainer"),
    (["--model", "llama-tiny", "--layout", "dp2,tp2", "--world", "2"], "runs on 4 ranks"),
    (["--model", "llama-tiny", "--layout", "fsdp", "--reshard-to", "tp2"], "different keys"),
    (["--backend", "memory", "--world", "1,2"], "memory:// lives in one process"),
    # every rank is a process of this machine: a layout's world is capped like --world's
    (["--model", "llama-tiny", "--world", "1", "--reshard-to", "fsdp0"], "a degree is at least 1"),
    (["--model", "llama-tiny", "--world", "1", "--reshard-to", "fsdp64"], "64 ranks; the runs take 1 to 8"),
    (["--model", "llama-tiny", "--layout", "tp8,pp8,dp8"], "512 ranks; the runs take 1 to 8"),
    # a state that cannot fit (a rank of --synthetic-mib 100000 was OOM-killed on the shared machine)
    (["--synthetic-mib", "1e7", "--world", "1"], "the run needs about 173015.4 GB of memory"),
    (["--dir", "/nonexistent-reshard-dir/sub"], "'/nonexistent-reshard-dir/sub' does not exist"),
    # nothing to load into the other layout: was measured as nothing at all, exit 0
    (["--model", "llama-tiny", "--world", "1", "--reshard-to", "fsdp2", "--skip", "save"], "save skipped"),
    (["--model", "llama-tiny", "--world", "1", "--reshard-to", "fsdp2", "--skip", "load"], "load skipped"),
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
         "--overlap-k", "2", "--overlap-cycles", "2",
         "--skip", "dcp-async-process,dcp-threads,torch-save,tc,tc+sync,tc-async", "--dir", str(tmp_path),
         "--rss-saves", "3", "--json", str(out), "--plot", str(png), "--no-progress"],
        capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reshard.save" in p.stdout and "x limit" in p.stdout and "targets (" in p.stdout
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
    # the targets: each measured one with its ratio, goal and verdict; the figures beside it
    got = {e["target"]: e for e in s["targets"]}
    assert {"stall_vs_memcpy", "save_vs_limit", "save_vs_dcp", "load_vs_limit", "load_nocheck_vs_limit",
            "load_vs_dcp", "step_slowdown", "save_rss", "load_rss", "async_rss_growth"} <= set(got)
    assert all(e["verdict"] in ("met", "MISSED", "reported") and e["detail"] for e in got.values())
    assert got["load_vs_limit"]["goal"] == 0.6 and got["step_slowdown"]["verdict"] == "reported"
    assert "s/GB" in got["step_slowdown"]["detail"] and "page faults" in got["stall_vs_memcpy"]["detail"]
    assert s["rss"]["async-growth"]["saves"] == 3 and len(s["rss"]["async-growth"]["rss_after_per_rank"]) == 2
    assert len(s["async"]["reshard-async"]["minflt_per_repeat"]) == 1
    assert s["train"]["reshard-async_cpu"]["save_cpu_s"] >= 0 and s["load"]["reshard"]["cpu_s"] > 0
    assert "targets (ratios of the minimum of 1 repeat(s); load average" in p.stdout
    assert all(r["loadavg"] for r in doc["records"])
    assert all(len(r["rss_after"]) == r.get("target_world", 2) and all(r["rss_after"])
               for r in doc["records"])
    phases = {r["phase"] for r in doc["records"]}
    assert phases == {"setup", "train", "overlap", "save", "async", "rss", "load", "reshard"}
    # the overlap phase: the loop without checkpoints and with each method, every K steps
    om = s["overlap"]["methods"]
    assert {"none", "reshard-async", "reshard-overlap", "dcp-async"} <= set(om)
    assert all(e["k"] == 2 and e["steps"] == 6 for e in om.values())  # at least 6 steps: 3 cycles of K=2
    assert all(e["saves"] == 3 and e["stall_mean_s"] > 0 for m, e in om.items() if m != "none")
    assert om["none"]["ratio"] == 1.0 and om["reshard-overlap"]["save_cpu_per_ckpt_s"] >= 0
    b = s["overlap"]["budget_rss"]
    assert b["budget"] * 4 <= b["state_bytes"] + 4 and 0 < b["default"]["staging_peak"] <= b["budget"]
    assert {"overlap_step", "overlap_stall_vs_dcp", "budget_rss"} <= set(got)
    assert "training loop, checkpoint every K=2 steps" in p.stdout and "four times the staging budget" in p.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # the scratch directory holds nothing after the run
    assert sorted(x.name for x in tmp_path.iterdir()) == ["io.json", "io.png"]
    # `reshard advise --bench` takes the median reshard save time of this file as the cost
    log = tmp_path / "failures.txt"
    log.write_text("0\n7200\n")
    r = CliRunner().invoke(main, ["advise", "--failures", str(log), "--bench", str(out),
                                  "--step-time-s", "1", "--every-steps", "100"])
    assert r.exit_code == 0, r.output
    assert f"checkpoint cost: {rs['median_s']:.3f} s" in r.output, r.output


@pytest.mark.timeout(300)
def test_bench_io_smoke_s3_tp_to_pp(tmp_path: Path) -> None:
    """The demo trainer's state (llama-tiny) in TP 2 on 2 gloo ranks, saved to
    and loaded from moto's S3 server on 127.0.0.1 (started by the bench), and
    resharded into PP 2: every load bit-exact to the saved state; the limits
    are raw boto3 calls on the same endpoint."""
    out = tmp_path / "io.json"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in [k for k in env if k.startswith(("AWS_", "RESHARD_S3_"))]:
        # the bench starts its own endpoint, with S3's own smallest part (5 MiB): the session
        # endpoint's settings (256 KiB parts, set by the tests' s3 fixture) are not for it
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "llama-tiny", "--layout", "tp2",
         "--reshard-to", "pp2", "--backend", "s3", "--repeat", "1", "--settle", "0", "--steps", "1",
         "--skip", "reshard-nocheck,rss,train,async", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**env, "RESHARD_PROGRESS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "boto3 PUT" in p.stdout and "no S3 writer" in p.stdout
    assert "bench io" in p.stderr and "phase" in p.stderr  # the progress bar (asked for: not a terminal)
    doc = json.loads(out.read_text())
    s = doc["summary"]["s3/w2"]
    assert s["layout"] == "pp1,dp1,tp2"
    assert set(s["save"]) == {"reshard", "limit-write"}
    assert s["async"] == {}  # skipped here (the FSDP smoke runs them)
    assert {"limit-read", "reshard", "first-step"} == set(s["load"])
    assert s["load"]["reshard"]["fingerprint_ok"]
    (key,) = [k for k in s["reshard"] if k.startswith("reshard@")]
    assert key == "reshard@pp2,dp1,tp1<-pp1,dp1,tp2" and s["reshard"][key]["fingerprint_ok"]
    rs = s["save"]["reshard"]
    assert rs["files"] >= 2 and rs["stored_bytes"] >= s["logical_bytes"]
    assert sum(p["bytes"] for p in s["save"]["limit-write"]["per_rank"]) == sum(
        p["bytes"] for p in rs["per_rank"])  # the limit uploads the bytes reshard wrote
    assert set(rs["phases_s"]) == {"stage", "plan", "write", "commit"}


def test_cold_save_and_manager_restore_on_ranks(pool, tmp_path: Path) -> None:
    """--cold's rank side on 2 gloo ranks: the first save and a
    CheckpointManager.save of the demo trainer's state in TP 2, then
    CheckpointManager.restore into PP 2 checked against the saved digest
    (and a wrong digest is reported as a differing state)."""
    from reshard.bench import ranks

    info = pool.run(2, ranks.setup, "llama-tiny", "tp2", 0.0, 8)
    fp = info[0]["fingerprint"]
    assert info[0]["layout"] == "pp1,dp1,tp2" and not info[0]["peers"] and fp == info[1]["fingerprint"]
    out = pool.run(2, ranks.cold_save, str(tmp_path / "first"), str(tmp_path / "mgr"))
    assert all(o["total_s"][0] > 0 and o["manager_total_s"][0] > 0 for o in out)
    assert out[0]["manager_verify_s"] > 0 and out[1]["manager_verify_s"] is None
    assert reshard.latest(tmp_path / "mgr") is not None
    pool.run(2, ranks.setup, "llama-tiny", "pp2", 0.0, 8)
    got = pool.run(2, ranks.cold_restore, str(tmp_path / "mgr"), fp)
    assert all(g["found"] and g["fingerprint_ok"] for g in got), got
    assert not pool.run(2, ranks.cold_restore, str(tmp_path / "mgr"), "0" * 16)[0]["fingerprint_ok"]
    pool.run(2, ranks.release)


def test_demo_report_beside_the_bench() -> None:
    """The demo's figures are read from its report and set beside the bench's
    for the same layouts, with the ratio and the reason beyond 2x."""
    from reshard.bench import report

    text = ("reshard demo: bert (full), layout A (pp1,dp2,tp2) -> layout B (pp2,dp2,tp1), 16 steps\n"
            "  save: 261.0 MiB in 4 files, 4.00 s (65 MiB/s)\n  save: 261.0 MiB in 4 files, 5.00 s (52 MiB/s)\n"
            "layout B (pp2,dp2,tp1): restored step 8 from /x/step-00000008 in 3.00 s, 484.9 MiB read by 4 ranks\n")
    d = report.parse_demo_report(text)
    assert d["layout_a"] == "pp1,dp2,tp2" and d["restore"] == {"s": 3.0, "mib": 484.9, "ranks": 4}
    s = {"layout": "pp1,dp2,tp2", "save": {"reshard": {"median_s": 1.5, "stored_bytes": 261 << 20}},
         "reshard": {"reshard@pp2,dp2,tp1<-pp1,dp2,tp2": {"median_s": 2.0}},
         "cold": {"first-save": {"s": 4.0}, "manager-save": {"s": 1.0}}}
    cmp = report.demo_compare({"summary": {"local/w4": s}}, d)
    assert cmp["save_ratio"] == pytest.approx(3.0) and cmp["restore_ratio"] == pytest.approx(1.5)
    assert cmp["save_ratio_cold"] == pytest.approx(1.125)
    assert not cmp["within_2x"] and "CheckpointManager" in cmp["why"]
    assert "demo/bench x3.00" in "\n".join(report.demo_lines(cmp))
    assert cmp["same_state"]
    # the bench of another model (llama-tiny, 10 MiB) beside the bert demo: said, not judged as "within 2x"
    s["save"]["reshard"]["stored_bytes"] = 10 << 20
    s["save"]["reshard"]["median_s"] = 3.0  # demo/bench 1.5: "within 2x", of two different states
    cmp = report.demo_compare({"summary": {"local/w4": s}}, d)
    assert cmp["same_state"] is False and cmp["why"].startswith("not the same state: the demo saved 261.0 MiB")
    assert "within 2x: yes (of different states)" in "\n".join(report.demo_lines(cmp))
    with pytest.raises(ValueError, match="not a `reshard demo` report"):
        report.parse_demo_report("hello")


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
    assert "8 ranks; loaded into tp1,pp1,dp8" in r.output  # the default load layout, said
    # more pipeline stages than the model has layers: refused (stages without a layer were simulated)
    for args in (["--pp", "200"], ["--pp", "2", "--reshard-to", "tp1,pp64,dp1"]):
        r = CliRunner().invoke(main, ["bench", "scale", "--tp", "2", "--dp", "1", "--model", "llama-8b",
                                      "--only-largest", *args])
        assert r.exit_code == 2 and "more stages than layers" in r.output, r.output


def _gone(pids: set[int], within_s: float = 15.0) -> bool:
    """Every process of ``pids`` ended (or is a zombie) within ``within_s``:
    multiprocessing's resource tracker, for one, ends shortly after the
    process that started it."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    return all(p.status() == psutil.STATUS_ZOMBIE for p in alive if p.is_running())


@pytest.mark.timeout(120)
def test_a_phase_past_timeout_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A phase that runs past --timeout (here the ranks' setup, which imports
    torch) ends the run with exit 1 and one line naming the phase and the
    timeout, not a Python traceback; the scratch directory is removed and no
    rank process is left."""
    import psutil

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "llama-tiny", "--world", "1",
         "--repeat", "1", "--timeout", "0.2", "--dir", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    children: set[int] = set()
    while p.poll() is None:  # the ranks this run starts, to check none outlives it
        try:
            children |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        except psutil.Error:
            pass
    out, err = p.communicate(timeout=100)
    assert p.returncode == 1, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("reshard: bench io: w1 local: setup (setup, 1 ranks) failed: "), err
    assert "did not answer within --timeout 0.2 s" in last
    assert "Traceback (most recent call last)" not in err
    assert list(tmp_path.iterdir()) == []
    assert children and _gone(children)


@pytest.mark.timeout(120)
def test_s3_endpoint_bucket_is_removed_and_an_unreachable_one_is_named(monkeypatch) -> None:
    """`--s3-endpoint URL`: the bucket the run creates there is deleted at the
    end (its objects were, the bucket was left behind on every run); an
    endpoint that does not answer is one line naming it, exit 2."""
    import boto3

    from reshard.bench.objstore import Endpoint
    from reshard.testing.s3server import S3Server

    with S3Server() as srv:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        ep = Endpoint(srv.url)
        c = boto3.client("s3", endpoint_url=srv.url)
        assert ep.bucket in {b["Name"] for b in c.list_buckets()["Buckets"]}
        c.put_object(Bucket=ep.bucket, Key="x/manifest.json", Body=b"{}")
        c.create_multipart_upload(Bucket=ep.bucket, Key="x/att-1.data")  # as a Ctrl-C'd save leaves it
        ep.close()
        assert ep.bucket not in {b["Name"] for b in c.list_buckets()["Buckets"]}
    monkeypatch.setenv("RESHARD_S3_DEADLINE_S", "1")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "llama-tiny",
                        "--world", "1", "--backend", "s3", "--s3-endpoint", "http://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("reshard: bench io: S3 endpoint http://127.0.0.1:1: cannot create the bucket")
    assert "Traceback" not in p.stderr


def _load_record(method: str, ranks: int, *, ok: bool = True, target: str | None = None) -> dict:
    """A load record as Runner.record writes it (one call per rank, timed once)."""
    rec = {"phase": "reshard" if target else "load", "method": method, "world": 2, "backend": "local",
           "loadavg": [1.0], "per_rank": [
               {"rank": r, "own_s": [0.1], "total_s": [0.1 * ranks], "fingerprint_ok": ok,
                "timings": [{"manifest": 0.01, "plan": 0.01, "read": 0.05 * ranks, "place": 0.01}]}
               for r in range(ranks)]}
    if target:
        rec.update(target=target, target_world=ranks)
    return rec


def test_a_differing_state_is_named_and_each_reshard_panel_plots_its_own_target(tmp_path: Path) -> None:
    """A load whose state differs from the saved one is named by
    state_mismatches (the command exits 1 on it; the table only said STATE
    DIFFERS and the exit was 0); the plot's "load into T" panel takes T's own
    per-rank timings (with two --reshard-to it titled the first target and
    drew the last one's ranks)."""
    from reshard.bench import report

    setup = {"phase": "setup", "method": "build", "world": 2, "backend": "local", "loadavg": [1.0],
             "logical_bytes": 1e6, "layout": "fsdp2",
             "per_rank": [{"local_bytes": 5e5, "tensors": 3, "params": 10} for _ in range(2)]}
    records = [setup, _load_record("reshard", 2), _load_record("reshard", 1, target="fsdp1<-fsdp2"),
               _load_record("reshard", 4, target="fsdp4<-fsdp2", ok=False)]
    doc = {"summary": report.summarise(records, {}), "records": records}
    assert report.state_mismatches(doc) == ["local/w2 reshard reshard@fsdp4<-fsdp2"]
    records[-1] = _load_record("reshard", 4, target="fsdp4<-fsdp2")
    doc = {"summary": report.summarise(records, {}), "records": records}
    assert report.state_mismatches(doc) == []
    assert len(report._load_timings(doc, "local/w2", "reshard", "fsdp1<-fsdp2")) == 1
    assert len(report._load_timings(doc, "local/w2", "reshard", "fsdp4<-fsdp2")) == 4
    assert len(report._load_timings(doc, "local/w2")) == 2


@pytest.mark.timeout(180)
def test_sigterm_mid_run_removes_the_scratch_checkpoints_and_the_ranks(tmp_path: Path) -> None:
    """`kill PID` (a scheduler's SIGTERM) in the middle of the saves: the run
    ends as after Ctrl-C, exit 143, with its scratch checkpoints and rank
    processes removed. Regression: SIGTERM's default action ended the main
    process at once, leaving every scratch checkpoint behind (1.4 GB for a
    64 MiB synthetic model)."""
    import signal
    import time

    import psutil

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "synthetic", "--synthetic-mib", "4",
         "--world", "1", "--repeat", "3", "--settle", "0.3", "--skip", "train,rss,async",
         "--dir", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    children: set[int] = set()
    deadline = time.monotonic() + 150
    while p.poll() is None and time.monotonic() < deadline:
        try:
            children |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        except psutil.Error:
            pass
        try:  # a save's files are there (wherever the scratch store puts them)
            if any(d.is_dir() and any(d.iterdir()) for d in tmp_path.rglob("w1-save-*")):
                break
        except OSError:  # a directory removed while walked
            pass
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before its first save was seen"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-2000:])
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))[:5]
    assert children and _gone(children)


def test_world_sizes_given_twice_run_once() -> None:
    """`--world 1,2,1`: each size once (a size given twice ran twice and its
    records were merged into one summary, medians over both runs)."""
    from reshard.cli.bench import _ints

    assert _ints("1,2,1,2") == [1, 2]



def test_memory_backend_figures_say_what_they_measure() -> None:
    """memory:// keeps the checkpoints in the rank's memory: the report says
    its RSS targets measure the store, and its save is not fsync'd (the
    table's header said "save (fsync)" and the async RSS target read "NO")."""
    from reshard.bench.io import _notes

    notes = _notes({"layout": "fsdp", "backends": ["local", "memory"], "s3_endpoint": None})
    assert any(n.startswith("memory://: the store keeps every checkpoint in the rank's own memory")
               and "nothing is fsync'd" in n for n in notes)
    assert not any(n.startswith("memory://") for n in _notes({"layout": "fsdp", "backends": ["local"],
                                                               "s3_endpoint": None}))


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    """Ctrl-C, then again and again while the run cleans up (the ranks, the
    S3 endpoint it started): nothing left in --dir (a second Ctrl-C cut the
    cleanup short, leaving the scratch folder)."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "llama-tiny", "--world", "2",
         "--repeat", "1", "--dir", str(tmp_path), "--backend", "s3", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal starts it
    deadline = time.monotonic() + 60
    while not list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(2.0)  # moto's server is up, the ranks are starting: the cleanup stops both
    p.send_signal(signal.SIGINT)
    for _ in range(20):  # again and again while it cleans up
        time.sleep(0.05)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    # 130, or killed by one of the later SIGINTs after "reshard: interrupted"
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, err[-2000:])
    assert "reshard: interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path: Path) -> None:
    """Was found only after the whole run, when the plot was drawn."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec: not installed
    r = CliRunner().invoke(main, ["bench", "io", "--model", "llama-tiny", "--world", "1",
                                  "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.output, r.output
    assert "reshard bench io:" not in r.output  # no run
    r = CliRunner().invoke(main, ["bench", "scale", "--model", "llama-8b", "--plot", str(tmp_path / "s.png")])
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.output, r.output



@pytest.mark.timeout(300)
def test_bench_io_torch_checkpointing_peer_wiring(tmp_path: Path) -> None:
    """torch_checkpointing as a peer on 1 rank at a tiny size (no timing checked):
    its sync save (alone and with os.sync()), async save and load are measured,
    the load gives back the saved state bit for bit, O_DIRECT is tried first
    and what was used is reported, and the table has its column."""
    pytest.importorskip("torch_checkpointing")
    out = tmp_path / "io.json"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-m", "reshard.cli", "bench", "io", "--model", "synthetic", "--synthetic-mib", "1",
         "--world", "1", "--repeat", "1", "--settle", "0", "--steps", "1",
         "--skip", "train,rss,dcp,dcp-async,dcp-async-process,dcp-threads,torch-save,torch-load,safetensors,"
                   "reshard-nocheck", "--dir", str(tmp_path), "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "x TC" in p.stdout and "torch_checkpointing save+os.sync()" in p.stdout, p.stdout
    doc = json.loads(out.read_text())
    s = doc["summary"]["local/w1"]
    assert {"tc", "tc+sync"} <= set(s["save"]) and "tc-async" in s["async"] and "tc" in s["load"]
    assert s["load"]["tc"]["fingerprint_ok"]
    assert s["async"]["tc-async"]["stall"]["median_s"] > 0 and "background" in s["async"]["tc-async"]
    assert {"save_vs_tc", "stall_vs_tc", "load_vs_tc"} <= set(s["ratios"])
    io = doc["meta"]["torch_checkpointing"]["io_by_world"]["1"]
    assert isinstance(io["direct_io"], bool) and (io["direct_io"] or io["error"])
    assert any("torch_checkpointing (w1)" in n for n in doc["notes"])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["io.json"]


def test_bench_io_without_torch_checkpointing_notes_it(monkeypatch) -> None:
    from reshard.bench import io, ranks

    monkeypatch.setattr(ranks, "tc_available", lambda: False)

    class Fake:
        cfg = {"skip": set()}
        notes: list[str] = []
        tc_io: dict = {}

    assert io.Runner.tc_ready(Fake(), 1, "unused") is False  # type: ignore[arg-type]
    assert Fake.notes and "torch_checkpointing not installed" in Fake.notes[0]
    Fake.cfg = {"skip": {"tc", "tc+sync", "tc-async"}}
    Fake.notes = []
    assert io.Runner.tc_ready(Fake(), 1, "unused") is False and not Fake.notes  # type: ignore[arg-type]


def test_targets_verdicts_and_bounds() -> None:
    """targets.evaluate on a hand-made summary: speed ratios at least, time
    and memory ratios at most their goal, the 1-rank load goal stricter than
    the 2-rank one, and a missed target names the measured figures."""
    from reshard.bench import targets

    def st(x: float) -> dict:
        return {"min_s": x, "median_s": x, "seconds": [x]}

    s = {"async": {"memcpy": {"stall": st(0.10), "cpu_s": 0.10, "minflt": 0},
                   "reshard-async": {"stall": st(0.12), "cpu_s": 0.11, "minflt": 0}},
         "save": {"reshard": {**st(1.0), "phases_s": {"stage": 0.1, "plan": 0.0, "write": 0.8, "commit": 0.1}},
                  "limit-write": st(0.85), "dcp": st(2.0)},
         "load": {"reshard": {**st(0.5), "phases_s": {"manifest": 0.05, "plan": 0.05, "read": 0.35,
                                                       "place": 0.05}},
                  "limit-read": st(0.35)},
         "rss": {"save": {"extra_per_rank": [[10 << 20]]}, "load": {"extra_per_rank": [[200 << 20]]},
                 "async-growth": {"saves": 100, "growth": 0.004, "growth_bytes": 1 << 20, "rss_first": 400 << 20,
                                  "seconds": 20.0}},
         "local_bytes_per_rank": [1 << 30], "world": 1, "cpus": 2}
    got = {e["target"]: e for e in targets.evaluate(s, 1)}
    assert got["stall_vs_memcpy"]["verdict"] == "MISSED" and "beyond the copy" in got["stall_vs_memcpy"]["bound"]
    assert got["save_vs_limit"]["verdict"] == "MISSED" and got["save_vs_dcp"]["verdict"] == "met"
    assert got["save_vs_dcp"]["bound"] is None
    assert got["load_vs_limit"]["measured"] == 0.7 and got["load_vs_limit"]["verdict"] == "MISSED"
    assert got["load_vs_limit"]["goal"] == 0.75 and got["save_vs_limit"]["goal"] == 0.9  # issue 29's goals
    assert "read phase 0.350 s" in got["load_vs_limit"]["bound"]
    assert targets.evaluate(s, 2)[[e["target"] for e in targets.evaluate(s, 2)].index("load_vs_limit")][
        "verdict"] == "met"  # 0.6 at 2 ranks
    assert got["save_rss"]["verdict"] == "met" and got["load_rss"]["verdict"] == "MISSED"
    assert got["async_rss_growth"]["verdict"] == "met"
    assert "stall_vs_tc" not in got  # not measured: left out
    assert targets.fmt(got["async_rss_growth"]) == "0.4% (<= 1.0%: met)"
    # the overlap phase: the loop's step against the loop without checkpoints, the visible
    # stall against torch_checkpointing's and DCP's better mode, a state 4x its budget
    def ov(step: float, stall: float, saves: int = 2) -> dict:
        return {"k": 3, "step_mean_s": step, "stall_mean_s": stall, "saves": saves, "cpu_s": 1.0}

    s["overlap"] = {"methods": {"none": {**ov(1.0, 0.0, 0), "ratio": 1.0},
                                "reshard-overlap": {**ov(1.2, 0.05), "ratio": 1.2, "save_cpu_per_ckpt_s": 0.5},
                                "tc-async": {**ov(1.3, 0.5), "ratio": 1.3},
                                "dcp-async": {**ov(1.3, 0.04), "ratio": 1.3},
                                "dcp-async-process": {**ov(1.3, 0.4), "ratio": 1.3}},
                    "budget_rss": {"budget": 256 << 20, "state_bytes": 1 << 30, "extra": 300 << 20,
                                   "default": {"staging_peak": 256 << 20}, "overlap": {"staging_peak": 200 << 20}}}
    got = {e["target"]: e for e in targets.evaluate(s, 1)}
    assert got["overlap_step"]["verdict"] == "MISSED" and "K=3" in got["overlap_step"]["bound"]
    assert "not measured" in got["overlap_step"]["bound"]  # no split figure without the split run
    assert got["overlap_stall_vs_tc"]["measured"] == pytest.approx(0.1) and got["overlap_stall_vs_tc"]["verdict"] == "met"
    assert got["overlap_stall_vs_dcp"]["measured"] == pytest.approx(1.25)  # against DCP's better mode
    assert got["overlap_stall_vs_dcp"]["verdict"] == "MISSED"
    assert got["budget_rss"]["verdict"] == "met" and "goal 320 MiB" in got["budget_rss"]["detail"]
