"""Two checkpoint tiers: local disk and S3 (moto behind the fault proxy)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

import reshard
from reshard.manager.tiers import TieredCheckpointManager, copy_checkpoint
from reshard.testing.s3proxy import Fault

HERE = os.path.dirname(__file__)


def _target() -> tuple[dict[str, object], torch.Tensor]:
    w = torch.zeros(4096)
    return {"w": w, "step": 0}, w


def test_kill_before_remote_copy_restores_local_then_remote(s3e, tmp_path) -> None:
    local, remote = str(tmp_path / "local"), s3e.url("tiers")
    # hold every request of the step-3 copy: the job is killed while it is in flight
    s3e.proxy.add(Fault(method="PUT", path="step-00000003/att-", action="delay", delay_s=5.0))
    job = subprocess.Popen([sys.executable, os.path.join(HERE, "_tier_job.py"), local, remote],
                           stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert line.strip() == "saved 3", line
    finally:
        job.kill()
        job.wait()
    s3e.proxy.clear()
    assert reshard.latest(remote) == remote + "/step-00000002"  # step 3 never reached it
    tm = TieredCheckpointManager(local, remote, local_every=1, remote_every=1)
    state, w = _target()
    res = tm.restore(state)
    assert res is not None and res.step == 3 and res.notes["tier"] == "local"
    assert torch.equal(w, torch.arange(4096.0) * 3) and res.values["step"] == 3
    assert reshard.verify(os.path.join(local, "step-00000003")).ok
    shutil.rmtree(local)
    tm = TieredCheckpointManager(local, remote, local_every=1, remote_every=1)
    state, w = _target()
    res = tm.restore(state)
    assert res is not None and res.step == 2 and res.notes["tier"] == "remote"
    assert torch.equal(w, torch.arange(4096.0) * 2) and res.values["step"] == 2
    assert reshard.verify(remote + "/step-00000002").ok


def test_copy_refuses_a_corrupt_source_and_reports_bandwidth(s3e, tmp_path) -> None:
    local, remote = str(tmp_path / "local"), s3e.url("tiers")
    tm = TieredCheckpointManager(local, remote, local_every=1, remote_every=2, keep_remote=1)
    for step in (1, 2, 3, 4):
        tm.save(step, {"w": torch.arange(8192.0) + step})
    reps = tm.wait(timeout=60)
    assert [r.step for r in reps] == [2, 4] and all(r.error is None for r in reps)
    assert all(r.bytes > 8192 * 4 and r.bandwidth_mb_s > 0 for r in reps)
    # the remote tier's own retention (keep_remote=1, once step 4 verified) removed step 2
    assert reshard.latest(remote) == remote + "/step-00000004"
    assert not reshard.storage.resolve(remote + "/step-00000002")[0].exists(
        reshard.storage.resolve(remote + "/step-00000002")[1])
    tm.close()
    # flip one byte of a local data file: the copy refuses it and publishes nothing
    src = os.path.join(local, "step-00000003")
    name = next(n for n in os.listdir(src) if n.endswith(".safetensors"))
    with open(os.path.join(src, name), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    st_local, k_local = reshard.storage.resolve(src)
    st_remote, k_remote = reshard.storage.resolve(remote + "/step-00000003")
    try:
        copy_checkpoint(st_local, k_local, st_remote, k_remote, step=3)
        raise AssertionError("a corrupt checkpoint was copied")
    except reshard.IntegrityError as e:
        assert "checksum mismatch" in str(e)
    assert not st_remote.exists(k_remote)


def test_copy_report_counts_the_manifest_as_written(tmp_path) -> None:
    """CopyReport.bytes is the data and manifest bytes the target holds: the
    manifest counted as published (sealed); it counted an unsealed encoding,
    short of the file written."""
    from reshard.storage import resolve

    src = tmp_path / "src"
    reshard.save({"w": torch.arange(64.0), "lr": 0.5}, src, step=3)
    st_src, k_src = resolve(str(src), None)
    st_dst, k_dst = resolve(str(tmp_path / "dst"), None)
    rep = copy_checkpoint(st_src, k_src, st_dst, k_dst, step=3)
    m = reshard.inspect(tmp_path / "dst")
    on_disk = sum((tmp_path / "dst" / n).stat().st_size for n in m.files)
    assert rep.bytes == on_disk + (tmp_path / "dst" / "manifest.json").stat().st_size
