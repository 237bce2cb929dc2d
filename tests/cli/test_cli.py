"""The ``reshard`` command: ls, inspect, verify (in-process), smoke and demo (real gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import reshard
from reshard.cli import human_bytes, main


def _save(path: Path, step: int) -> None:
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {
        "model": {
            "w": reshard.ShardedTensor("w", w, global_shape=(6, 8), global_offset=(0, 0)),
            "tied": reshard.ShardedTensor("tied", w, global_shape=(6, 8), global_offset=(0, 0)),
            "bias": torch.ones(8, dtype=torch.bfloat16),
        },
        "rng": reshard.ShardedObject("rng", {"seed": 7}, global_shape=(1,), global_offset=(0,)),
        "step": step,
        "lr": 0.5,
    }
    reshard.save(state, path, step=step,
                 options=reshard.SaveOptions(mesh={"dp": 1}, schema_version="v2"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    _save(r / "step-00000002", 2)
    _save(r / "step-00000001", 1)
    (r / "step-00000003.incomplete-20240101T000000-abcd").mkdir()
    (r / "broken").mkdir()
    (r / "broken" / "manifest.json").write_text("{not json")
    (r / "notes.txt").write_text("a stray file is not a checkpoint")
    return r


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"


def test_ls_lists_committed_by_step_then_abandoned_and_invalid(root: Path) -> None:
    r = _run("ls", str(root))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "committed (2)" in out
    assert out.index("step-00000001") < out.index("step-00000002")
    assert "abandoned (1" in out and "step-00000003.incomplete-" in out
    assert "invalid (1" in out and "broken" in out and "invalid manifest" in out
    assert "notes.txt" not in out


def test_ls_empty_and_on_a_checkpoint(tmp_path: Path, root: Path) -> None:
    r = _run("ls", str(tmp_path / "nothing"))  # no such root: like inspect and verify, exit 2
    assert r.exit_code == 2 and "no such directory" in r.stderr
    (tmp_path / "empty").mkdir()
    r = _run("ls", str(tmp_path / "empty"))
    assert r.exit_code == 0 and "no committed checkpoint" in r.stdout
    r = _run("ls", str(root / "step-00000001"))
    assert r.exit_code == 0 and "itself a committed checkpoint" in r.stdout


def test_inspect_table_and_json(root: Path) -> None:
    ck = str(root / "step-00000002")
    r = _run("inspect", ck)
    assert r.exit_code == 0, r.output
    out = r.stdout
    for s in ("format reshard v3", "step 2", "schema_version v2", "world_size 1", '"dp": 1',
              "model.w", "float32", "[6,8]", "model.bias", "bfloat16", "rng", "[1]",
              "values (2): lr, step", "model.tied -> model.w"):
        assert s in out, (s, out)
    r = _run("inspect", "--json", ck)
    assert r.exit_code == 0
    m = json.loads(r.stdout)
    assert m["step"] == 2 and m["format"] == "reshard" and "model.w" in m["tensors"]


def test_verify_ok_corrupt_and_missing(root: Path, tmp_path: Path) -> None:
    ck = root / "step-00000002"
    r = _run("verify", str(ck))
    assert r.exit_code == 0 and r.stdout.startswith("OK"), r.output
    data = sorted(p for p in ck.iterdir() if p.name != "manifest.json")[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert _run("verify", "--no-checksums", str(ck)).exit_code == 0
    r = _run("verify", str(ck))
    assert r.exit_code == 1
    assert "FAILED" in r.stdout and "checksum mismatch" in r.stdout
    data.write_bytes(bytes(raw[:-8]))  # shorter than declared: caught without checksums
    r = _run("verify", "--no-checksums", str(ck))
    assert r.exit_code == 1 and "manifest declares" in r.stdout
    r = _run("verify", str(tmp_path / "missing"))
    assert r.exit_code == 2
    assert "no committed checkpoint" in r.stderr and r.stdout == ""
    r = _run("verify", str(root / "broken"))
    assert r.exit_code == 1 and "ManifestError" in r.stdout
    assert _run("inspect", str(tmp_path / "missing")).exit_code == 2


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("reshard")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "reshard.cli"]


def test_smoke_on_real_gloo_ranks(tmp_path: Path) -> None:
    cmd = _cli()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([*cmd, "smoke", "--out", "tmp", "--save-ranks", "2", "--load-ranks", "3",
                        "--rows", "10"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "max abs difference = 0\n" in p.stdout
    assert "SMOKE OK" in p.stdout and "DEMO" not in p.stdout and "verify      : OK" in p.stdout
    assert (tmp_path / "tmp" / "ckpt" / "step-00000001" / "manifest.json").is_file()


def test_demo_small_settings(tmp_path: Path) -> None:
    """The main job end to end with a tiny model: train in (dp2,tp2) with
    checkpoints, SIGKILL a rank mid-save, resume in (tp1,pp2,dp2), parity,
    export, report and plot; exit 0 only when every check passed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([*_cli(), "demo", "--out", "d", "--size", "tiny", "--data", "random",
                        "--steps", "7", "--every", "2", "--kill-at", "4", "--seq-len", "16",
                        "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "DEMO OK" in out
    assert "[ok] rank 1 killed by SIGKILL in the middle of the save of step 4" in out
    assert "[ok] latest() ignores the abandoned attempt" in out and "step-00000002" in out
    assert "[ok] resumed at step 2" in out
    assert "[ok] loss, gradients, updated weights and moments within tolerance" in out
    d = tmp_path / "d"
    assert (d / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (d / "report.txt").read_text().rstrip().endswith("DEMO OK")
    assert (d / "hf" / "model.safetensors").is_file()
    assert any(".incomplete-" in x.name for x in (d / "ckpt").iterdir())


def test_ls_shows_verification_and_retention_and_gc_applies_it(tmp_path: Path) -> None:
    from reshard.manager.manager import CheckpointManager

    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=None, preempt_signals=())
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))}, metric=float(10 - step))
    # an abandoned attempt, old enough to collect
    old = root / "step-00000004.incomplete-x"
    old.mkdir()
    os.utime(old, (0, 0))
    r = _run("ls", str(root), "--keep-last", "1")
    assert r.exit_code == 0, r.output
    lines = {ln.split()[-1]: ln for ln in r.stdout.splitlines() if "step-0000000" in ln}
    assert "verified" in lines["step-00000003"] and "keep: newest verified" in lines["step-00000003"]
    assert "delete" in lines["step-00000001"] and "delete" in lines["step-00000002"]
    assert "step-00000004.incomplete-x" in r.stdout
    r = _run("gc", str(root), "--keep-last", "1", "--dry-run")
    assert r.exit_code == 0 and "would delete step-00000001" in r.stdout
    assert (root / "step-00000001").is_dir()
    r = _run("gc", str(root), "--keep-last", "1", "--keep-best", "1", "--metric-mode", "min",
             "--grace", "60")
    assert r.exit_code == 0, r.output
    # metric 10 - step: the best (min) is step 3, kept anyway; steps 1 and 2 go
    assert "deleted step-00000001" in r.stdout and "deleted step-00000002" in r.stdout
    assert "deleted abandoned attempt step-00000004.incomplete-x" in r.stdout
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000003"]
    assert _run("ls", str(tmp_path / "nope")).exit_code == 2
    # keep-best with "max" keeps the oldest (highest metric) as well
    mgr.save(4, {"w": torch.zeros(4)}, metric=100.0)
    mgr.save(5, {"w": torch.zeros(4)}, metric=0.0)
    r = _run("gc", str(root), "--keep-last", "1", "--keep-best", "1", "--metric-mode", "max")
    assert "deleted step-00000003" in r.stdout and "kept step-00000004 (best 1 by metric)" in r.stdout


def test_advise_young_daly(tmp_path: Path) -> None:
    log = tmp_path / "failures.txt"
    log.write_text("# job failures\n0\n7200\n2024-01-01T04:00:00+00:00\n".replace(
        "2024-01-01T04:00:00+00:00", "14400"))
    r = _run("advise", "--failures", str(log), "--cost-s", "2", "--step-time-s", "1",
             "--every-steps", "1000", "--tokens-per-step", "4096")
    assert r.exit_code == 0, r.output
    # MTBF 7200 s; sqrt(2 * 2 * 7200) = 169.7 s
    assert "MTBF           : 7200 s" in r.stdout
    assert "sqrt(2*C*MTBF)): 170 s = 170 steps" in r.stdout
    assert "current : every 1000 s -> expected loss per failure 500 s = 500.0 steps = 2,048,000 tokens" in r.stdout


@pytest.mark.parametrize("log,args,message", [
    # each was a Python traceback (ZeroDivisionError, ValueError) or a nonsense report
    ("0\n7200\n", ["--step-time-s", "0"], "'--step-time-s': 0.0: a finite number > 0"),
    ("0\n7200\n", ["--step-time-s", "-1"], "'--step-time-s': -1.0: a finite number > 0"),
    ("0\n7200\n", ["--cost-s", "-5"], "'--cost-s': -5.0: a finite number >= 0"),
    ("0\n7200\n", ["--cost-s", "nan"], "'--cost-s': nan: a finite number >= 0"),
    ("0\n7200\n", ["--every-steps", "0"], "'--every-steps': 0 is not in the range x>=1"),
    ("0\n7200\n", ["--restart-s", "inf"], "'--restart-s': inf: a finite number >= 0"),
    ("0\nnot-a-time\n", [], "failures.txt:2: 'not-a-time' is neither seconds since the epoch nor an ISO 8601"),
    ("5\n5\n", [], "the 2 failure times are all the same instant (no MTBF)"),
])
def test_advise_refuses_bad_numbers_in_one_line(tmp_path: Path, log: str, args: list[str], message: str) -> None:
    f = tmp_path / "failures.txt"
    f.write_text(log)
    base = {"--cost-s": "2", "--step-time-s": "1", "--every-steps": "100"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    r = CliRunner().invoke(main, ["advise", "--failures", str(f), *[x for kv in base.items() for x in kv]])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output


def test_advise_bench_takes_a_real_store_and_says_which_run(tmp_path: Path) -> None:
    """A `bench io --json` of --backend local,memory: the cost is the local
    disk's save, not memory://'s (a store in the process, 6.5x faster in the run
    that found it), and the report names the run it took."""
    f = tmp_path / "failures.txt"
    f.write_text("0\n7200\n")
    def run(w: int, t: float) -> dict:
        return {"save": {"reshard": {"median_s": t}}, "local_bytes_per_rank": [1] * w}
    bench = tmp_path / "io.json"
    bench.write_text(json.dumps({"summary": {"local/w1": run(1, 1.113), "memory/w1": run(1, 0.170)}}))
    r = _run("advise", "--failures", str(f), "--bench", str(bench), "--step-time-s", "1", "--every-steps", "100")
    assert r.exit_code == 0, r.output
    assert f"checkpoint cost: 1.113 s (foreground; reshard.save median of local/w1 in {bench})" in r.stdout
    bench.write_text(json.dumps({"summary": {"local/w1": run(1, 1.0), "s3/w2": run(2, 2.5),
                                             "memory/w1": run(1, 0.1)}}))
    r = _run("advise", "--failures", str(f), "--bench", str(bench), "--step-time-s", "1", "--every-steps", "100")
    assert "checkpoint cost: 2.500 s (foreground; reshard.save median of s3/w2" in r.stdout, r.output


def _statuses(root: Path) -> dict[str, str]:
    """``reshard ls ROOT`` (no HMAC key): checkpoint name -> its status column."""
    r = _run("ls", str(root))
    assert r.exit_code == 0, r.output
    rows = [ln.split() for ln in r.stdout.splitlines()
            if ln.split() and ln.split()[-1].startswith("step-")]
    return {row[-1]: next(w for w in row if w in ("verified", "unverified", "failed", "torn"))
            for row in rows}


def test_a_key_not_the_writers_records_no_verdict(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``reshard verify`` and ``verify_checkpoint`` with an HMAC key that is
    not the writer's (an unsigned checkpoint, or one signed with another key)
    fail, but write no "failed" record: afterwards ``reshard ls`` shows the
    checkpoints as before. A real corruption is still recorded as failed,
    whatever the key. Before: the key mismatch was recorded as the
    checkpoints' verdict, and ls showed good checkpoints as failed."""
    from reshard.manager.manager import CheckpointManager

    monkeypatch.delenv("RESHARD_HMAC_KEY_FILE", raising=False)
    monkeypatch.delenv("RESHARD_HMAC_KEY", raising=False)
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=None, preempt_signals=())
    mgr.save(1, {"w": torch.full((4,), 1.0)})
    assert mgr.verify_checkpoint(1)
    reshard.save({"w": torch.full((4,), 2.0)}, root / "step-00000002", step=2)  # unverified
    monkeypatch.setenv("RESHARD_HMAC_KEY", "writer-key")
    reshard.save({"w": torch.ones(4)}, root / "step-00000003", step=3)  # signed
    monkeypatch.delenv("RESHARD_HMAC_KEY")
    before = _statuses(root)
    assert before == {"step-00000001": "verified", "step-00000002": "unverified",
                      "step-00000003": "unverified"}
    rec1 = (root / "step-00000001.verified.json").read_bytes()

    monkeypatch.setenv("RESHARD_HMAC_KEY", "another-key")
    for name, why in (("step-00000001", "not signed"), ("step-00000002", "not signed"),
                      ("step-00000003", "does not match")):
        r = _run("verify", str(root / name))
        assert r.exit_code == 1 and "FAILED" in r.stdout and why in r.stdout, r.output
        assert not mgr.verify_checkpoint(name)
        assert not mgr.verify_checkpoint(name, how="checksums")
    monkeypatch.delenv("RESHARD_HMAC_KEY")
    assert _statuses(root) == before
    assert (root / "step-00000001.verified.json").read_bytes() == rec1
    assert not (root / "step-00000002.verified.json").exists()
    assert not (root / "step-00000003.verified.json").exists()
    assert reshard.latest(root) == str(root / "step-00000003")

    # a real corruption is recorded as failed, with or without a key (and
    # only the corruption, not the key's mismatch, is its recorded problem)
    data = next((root / "step-00000002").glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    monkeypatch.setenv("RESHARD_HMAC_KEY", "another-key")
    r = _run("verify", str(root / "step-00000002"))
    assert r.exit_code == 1 and "checksum mismatch" in r.stdout, r.output
    monkeypatch.delenv("RESHARD_HMAC_KEY")
    rec = json.loads((root / "step-00000002.verified.json").read_text())
    assert rec["ok"] is False and rec["problems"]
    assert all("HMAC" not in p and "signed" not in p for p in rec["problems"])
    assert _statuses(root) == {**before, "step-00000002": "failed"}
    (root / "step-00000002.verified.json").unlink()
    monkeypatch.setenv("RESHARD_HMAC_KEY", "another-key")
    assert not mgr.verify_checkpoint(2, how="checksums")
    monkeypatch.delenv("RESHARD_HMAC_KEY")
    assert _statuses(root)["step-00000002"] == "failed"
    mgr.close()


def test_ls_words_head_deleted_by_retention_as_information(tmp_path: Path) -> None:
    """HEAD's checkpoint deleted by ``keep_last=1`` retention once the resumed
    run committed newer ones is information in ``reshard ls``, not a problem;
    HEAD naming a checkpoint gone with nothing newer, or quarantined, is
    still flagged."""
    import shutil

    from reshard.commit.protocol import quarantine
    from reshard.manager.manager import CheckpointManager
    from reshard.storage import resolve

    root = tmp_path / "run"
    first = CheckpointManager(root, keep_last=3, preempt_signals=())
    for s in (1, 2, 3):
        first.save(s, {"w": torch.full((4,), float(s))})
    first.close()
    again = CheckpointManager(root, keep_last=1, preempt_signals=())
    res = again.restore({"w": torch.zeros(4)})
    assert res is not None and res.step == 3
    again.save(4, {"w": torch.full((4,), 4.0)})
    again.close()
    assert not (root / "step-00000003").exists() and reshard.latest(root) == str(root / "step-00000004")
    r = _run("ls", str(root))
    assert r.exit_code == 0, r.output
    assert "HEAD: resumed from step-00000003 (since deleted" in r.stdout
    assert "not committed here" not in r.stdout

    # the resume source gone with nothing newer of its lineage: a problem
    other = tmp_path / "other"
    a = CheckpointManager(other, keep_last=None, preempt_signals=())
    a.save(1, {"w": torch.ones(4)})
    a.save(2, {"w": torch.ones(4)})
    a.close()
    b = CheckpointManager(other, keep_last=None, preempt_signals=())
    assert b.restore({"w": torch.zeros(4)}) is not None
    b.close()
    st, key = resolve(str(other))
    quarantine(st, key, "step-00000002", reason="unloadable in a test", attempt_id=None)
    r = _run("ls", str(other))
    assert "HEAD names step-00000002, which is quarantined" in r.stdout, r.output
    for p in other.iterdir():
        if ".quarantined" in p.name:
            (p.rename(other / "gone") if p.is_dir() else p.unlink())
    shutil.rmtree(other / "gone")
    r = _run("ls", str(other))
    assert "HEAD names step-00000002, which is not committed here" in r.stdout, r.output
    assert "since deleted" not in r.stdout
