"""Incremental checkpoints (issue 30 points 1-3) on real gloo ranks: unchanged
chunks are written once (decided by their bytes' xxh3_128, never by a flag);
every checkpoint stays a checkpoint (loads on its own, in another layout,
after a hand copy, through ``reshard copy`` and on S3); retention and gc never
delete a byte a kept checkpoint names, deleting needs no free space, and
``reshard ls`` / ``reshard gc --dry-run`` say what is shared and what would be
freed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reshard
from _incremental_fns import r_load, r_load_rows, r_plain_saves, r_saves
from reshard.cli import main

N = 2
MiB = 1 << 20


def _ckpts(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / "manifest.json").exists())


def _data(ckpt: Path) -> dict[str, os.stat_result]:
    return {p.name: p.stat() for p in ckpt.iterdir() if p.name.endswith(".safetensors")}


def _stored(root: Path) -> int:
    """Bytes the root's checkpoints hold on disk, each inode once."""
    seen: dict[tuple[int, int], int] = {}
    for c in _ckpts(root):
        for s in _data(c).values():
            seen[(s.st_dev, s.st_ino)] = s.st_size
    return sum(seen.values())


def _base_files(ckpt: Path) -> dict[str, str]:
    """fqn -> the file of its own each chunk of model.base / model.emb has."""
    m = reshard.inspect(str(ckpt))
    return {f"{fqn}@{c.global_offset[0]}": c.file for fqn, te in m.tensors.items()
            if fqn in ("model.base", "model.emb") for c in te.chunks}


#: an asynchronous save staging under a budget far below its state (its chunks
#: staged piece by piece while written), in the overlap mode: the chunk digest
#: that decides a link comes from the staging run, not from a staged copy
_BUDGET = {"staging_budget_bytes": 256 << 10, "overlap_staging": True}


@pytest.mark.parametrize("use_async,opts", [(False, None), (True, None), (True, _BUDGET)],
                         ids=["sync", "async", "async-budget"])
@pytest.mark.timeout(180)
def test_unchanged_chunks_are_written_once(pool: Any, tmp_path: Path, use_async: bool,
                                           opts: dict[str, Any] | None) -> None:
    """Point 1: a managed save (incremental by default) writes only the chunks
    whose bytes changed: after the first save each rank writes its small
    trainable file only; the base's files are hard links of the first save's
    (one inode), each chunk's xxh3_128 is in the manifest and each linked
    file names the attempt that wrote it. A frozen tensor changed in place
    (no flag says so) is written again at once; every checkpoint loads bit
    for bit, here and resharded onto one rank."""
    root = tmp_path / "ckpts"
    outs = pool.run(N, r_saves, str(root), [1, 2, 3, 4], use_async=use_async, touch={4: "base"},
                    opts=opts, timeout=150.0)
    for o in outs:
        w = o["written"]
        assert w[1] > 2 * MiB, w  # the first save writes everything
        assert w[2] < 64 << 10 and w[3] < 64 << 10, w  # then the trainable file only
    # step 4 changed model.base's first row: rank 0's chunk is written again, rank 1's is linked
    assert outs[0]["written"][4] > 2 * MiB > outs[1]["written"][4]
    c1, c2, c3, c4 = _ckpts(root)
    files1, files3, files4 = _base_files(c1), _base_files(c3), _base_files(c4)
    assert files1 == files3 == files4  # each chunk keeps its file name (its own file)
    d1, d3, d4 = _data(c1), _data(c3), _data(c4)
    for key, name in files1.items():
        assert d3[name].st_ino == d1[name].st_ino, key  # linked, not written
        assert (d4[name].st_ino == d1[name].st_ino) == (key != "model.base@0"), key
    m1, m3, m4 = (reshard.inspect(str(c)) for c in (c1, c3, c4))
    for c in m3.tensors["model.base"].chunks:
        assert len(c.content) == 32 and c.content == next(
            x.content for x in m1.tensors["model.base"].chunks if x.global_offset == c.global_offset)
    assert {m3.files[n].origin for n in files1.values()} == {m1.attempt_id}  # who wrote the bytes
    assert m4.files[files1["model.base@0"]].origin == ""
    assert m4.files[files1["model.base@512"]].origin == m1.attempt_id
    assert all(not fe.origin for fe in m1.files.values())
    for step, c in ((1, c1), (3, c3)):
        assert all(pool.run(N, r_load, str(c), step, timeout=60.0))
        assert all(pool.run(1, r_load_rows, str(c), step, N, timeout=60.0))
    assert all(pool.run(N, r_load, str(c4), 4, "base", timeout=60.0))
    for c in (c1, c2, c3, c4):
        rep = reshard.verify(str(c))
        assert rep.ok, rep.problems


@pytest.mark.timeout(180)
def test_layout_changes_and_plain_saves(pool: Any, tmp_path: Path) -> None:
    """Point 1: the first save after a change of the chunk boxes (2 ranks ->
    1: ``model.base`` is one chunk now) writes that tensor in full, while the
    replicated ``model.emb`` (same box, another writer) is still linked; a
    plain ``save`` opts in with ``incremental=True`` and the parent it names,
    and one without the option writes everything."""
    root = tmp_path / "ckpts"
    pool.run(N, r_saves, str(root), [1], timeout=120.0)
    out = pool.run(1, r_saves, str(root), [2], restore=True, timeout=120.0)[0]
    assert out["restored"] == 1
    c1, c2 = _ckpts(root)
    f1, f2 = _base_files(c1), _base_files(c2)
    d1, d2 = _data(c1), _data(c2)
    assert d2[f2["model.emb@0"]].st_ino == d1[f1["model.emb@0"]].st_ino
    assert f2["model.base@0"] not in d1  # a new box: a new file, written
    assert out["written"][2] >= 4 * MiB
    assert all(pool.run(1, r_load_rows, str(c2), 2, N, timeout=60.0))
    plain = tmp_path / "plain"
    outs = pool.run(N, r_plain_saves, str(plain), timeout=120.0)
    for o in outs:
        assert o["a"] > 2 * MiB and o["b"] < 64 << 10 and o["c"] > 2 * MiB, o
    a, b, c = _data(plain / "a"), _data(plain / "b"), _data(plain / "c")
    shared = {n for n in a if n in b and a[n].st_ino == b[n].st_ino}
    assert len(shared) == N + 1  # N base chunks and the replicated emb
    assert not any(n in a and a[n].st_ino == s.st_ino for n, s in c.items())
    assert all(pool.run(N, r_load, str(plain / "b"), 2, timeout=60.0))


@pytest.mark.timeout(240)
def test_incremental_checkpoints_stay_checkpoints(pool: Any, tmp_path: Path) -> None:
    """Point 2: every checkpoint is complete in its own directory: a hand copy
    (``cp -r``) loads on its own in another layout and verifies; deleting an
    older checkpoint by hand (``rm -rf``) costs the newer ones nothing;
    ``reshard copy`` writes a checkpoint of its own (no shared inode) after
    checking every byte, and refuses a corrupted one naming the file;
    ``inspect``, ``diff``, ``plan`` and ``ls`` work on them as on any."""
    root = tmp_path / "ckpts"
    pool.run(N, r_saves, str(root), [1, 2, 3], timeout=150.0)
    c1, c2, c3 = _ckpts(root)
    hand = tmp_path / "elsewhere" / "step-3"
    shutil.copytree(c3, hand)  # cp -r
    shutil.rmtree(c1)  # rm -rf of the checkpoint that wrote the base, by hand
    assert reshard.verify(str(hand)).ok
    assert reshard.verify(str(c2)).ok and reshard.verify(str(c3)).ok
    assert all(pool.run(1, r_load_rows, str(hand), 3, N, timeout=60.0))
    assert all(pool.run(N, r_load, str(c2), 2, timeout=60.0))
    runner = CliRunner()
    dst = tmp_path / "copied" / "x"
    r = runner.invoke(main, ["copy", str(c3), str(dst)])
    assert r.exit_code == 0, r.output
    ino3 = {s.st_ino for s in _data(c3).values()}
    assert not ino3 & {s.st_ino for s in _data(dst).values()}
    assert reshard.verify(str(dst)).ok
    assert all(pool.run(N, r_load, str(dst), 3, timeout=60.0))
    assert all(not fe.origin for fe in reshard.inspect(str(dst)).files.values())
    for cmd in (["inspect", str(c3)], ["diff", str(c2), str(c3)], ["plan", str(c3), "--layout", "dp4", "--read-rate", "100"],
                ["export", str(c3), str(tmp_path / "hf"), "--subtree", "model"]):
        r = runner.invoke(main, cmd)
        assert r.exit_code in (0, 1), (cmd, r.output)
        assert "Error" not in r.output, (cmd, r.output)
        if cmd[0] == "inspect":
            assert "unchanged since an earlier checkpoint, linked" in r.output, r.output
    from safetensors.torch import load_file

    exported = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    from _incremental_fns import full

    assert exported.keys() >= {"base", "emb", "lora"} and torch.equal(exported["base"], full(3)["base"])
    # a corrupted byte of a shared file: every checkpoint naming it fails verify; copy refuses it
    name = _base_files(c3)["model.base@512"]
    with open(c3 / name, "r+b") as f:
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0x40]))
    for c in (c2, c3):
        rep = reshard.verify(str(c))
        assert not rep.ok and any(name in p for p in rep.problems), rep.problems
    r = runner.invoke(main, ["copy", str(c3), str(tmp_path / "copied" / "y")])
    assert r.exit_code == 1 and name in r.output, r.output
    assert not (tmp_path / "copied" / "y").exists()
    assert [p.name for p in (tmp_path / "copied").iterdir()] == ["x"]


@pytest.mark.timeout(240)
def test_retention_keeps_every_named_byte(pool: Any, tmp_path: Path) -> None:
    """Point 3: with keep_last=2 over 6 saves the root holds the base once;
    every kept checkpoint verifies and loads bit for bit (here and on one
    rank); ``reshard ls`` shows each checkpoint's size and own bytes and what
    the root stores; ``reshard gc --dry-run`` says it would free only the
    bytes no kept checkpoint names, and gc frees exactly those."""
    root = tmp_path / "ckpts"
    pool.run(N, r_saves, str(root), [1, 2, 3, 4, 5, 6], keep_last=2, timeout=180.0)
    kept = _ckpts(root)
    assert [c.name for c in kept] == ["step-00000005", "step-00000006"]
    logical = sum(reshard.inspect(str(c)).total_bytes for c in kept)
    base = 4 * MiB + int(1.5 * MiB)
    assert base < _stored(root) < base + (512 << 10) < logical  # the base once, not twice
    for step, c in ((5, kept[0]), (6, kept[1])):
        assert reshard.verify(str(c)).ok
        assert all(pool.run(N, r_load, str(c), step, timeout=60.0))
        assert all(pool.run(1, r_load_rows, str(c), step, N, timeout=60.0))
    runner = CliRunner()
    r = runner.invoke(main, ["ls", str(root)])
    assert r.exit_code == 0, r.output
    assert " own " in r.output and "stored" in r.output, r.output
    row = next(ln for ln in r.output.splitlines() if "step-00000006" in ln and "verified" in ln)
    assert "5.5 MiB" in row and "KiB" in row, row  # logical size, and the few KiB it alone holds
    r = runner.invoke(main, ["gc", str(root), "--keep-last", "1", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "would delete step-00000005" in r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("would free"))
    assert "KiB" in line and "of 5.5 MiB" in line, line
    before = _stored(root)
    r = runner.invoke(main, ["gc", str(root), "--keep-last", "1"])
    assert r.exit_code == 0, r.output
    assert [c.name for c in _ckpts(root)] == ["step-00000006"]
    assert before - _stored(root) < 512 << 10
    assert all(pool.run(N, r_load, str(root / "step-00000006"), 6, timeout=60.0))


@pytest.fixture
def tmpfs(mount_tmpfs: Callable[[str], Path]) -> Path:
    """A 10 MiB tmpfs (needs root and mount permission; skipped elsewhere)."""
    return mount_tmpfs("10m")


@pytest.mark.timeout(180)
def test_saves_fit_where_only_the_changes_fit(pool: Any, tmpfs: Path) -> None:
    """Point 3: on a 10 MiB disk a 5.5 MiB state is saved 8 times with
    keep_last=3 (three full copies would need 16.5 MiB): the save's own
    space check counts the bytes it will link as needing no room, retention
    deletes without needing any, and every kept checkpoint loads."""
    root = tmpfs / "ckpts"
    pool.run(N, r_saves, str(root), list(range(1, 9)), keep_last=3, timeout=150.0)
    kept = _ckpts(root)
    assert [c.name for c in kept] == [f"step-0000000{s}" for s in (6, 7, 8)]
    for step, c in zip((6, 7, 8), kept, strict=True):
        assert all(pool.run(N, r_load, str(c), step, timeout=60.0))


@pytest.mark.timeout(240)
def test_incremental_on_s3(pool: Any, s3e: Any, tmp_path: Path) -> None:
    """Point 2 on S3 (moto): unchanged chunks are copied inside the store
    (CopyObject), not uploaded; each checkpoint holds all its objects, so a
    copy of one prefix (``aws s3 sync``) loads on its own and retention's
    deletions cost the kept ones nothing; ``reshard copy`` brings one back
    to a local root, every byte checked."""
    import boto3

    url = s3e.url("inc")
    env = dict(s3e.env)
    outs = pool.run(N, r_saves, url, [1, 2, 3], keep_last=2, storage_env=env, timeout=180.0)
    for o in outs:
        assert o["written"][1] > 2 * MiB and o["written"][3] < 64 << 10, o["written"]
    bucket, prefix = url[len("s3://"):].split("/", 1)
    c = boto3.client("s3", endpoint_url=s3e.server.url, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]]
    steps = sorted({k.split("/")[1] for k in keys if k.endswith("manifest.json")})
    assert steps == ["step-00000002", "step-00000003"]
    for k in keys:  # aws s3 sync s3://.../step-00000003 s3://.../elsewhere
        if k.startswith(f"{prefix}/step-00000003/"):
            c.copy_object(Bucket=bucket, Key=k.replace(f"{prefix}/step-00000003/", "synced/x/"),
                          CopySource={"Bucket": bucket, "Key": k})
    synced = f"s3://{bucket}/synced/x"
    assert reshard.verify(synced).ok
    assert all(pool.run(N, r_load, synced, 3, storage_env=env, timeout=60.0))
    assert all(pool.run(1, r_load_rows, f"{url}/step-00000002", 2, N, storage_env=env, timeout=60.0))
    local = tmp_path / "back" / "step-3"
    r = CliRunner().invoke(main, ["copy", f"{url}/step-00000003", str(local)])
    assert r.exit_code == 0, r.output
    assert all(pool.run(N, r_load, str(local), 3, timeout=60.0))


@pytest.mark.timeout(120)
def test_s3rver_copies_inside_the_store(s3r: Any) -> None:
    """s3rver implements CopyObject (objects up to the copy limit are copied
    inside the store) but not UploadPartCopy: a larger object is not linked
    (False), and the save writes it instead."""
    from reshard.storage import resolve

    st, key = resolve(s3r.url("copy"))
    data = os.urandom(300 << 10)
    st.write_bytes(st.join(key, "a"), data)
    assert st.link_file(st.join(key, "a"), st.join(key, "b"))
    assert st.read_bytes(st.join(key, "b")) == data
    os.environ["RESHARD_S3_COPY_MAX_BYTES"] = str(100 << 10)
    try:
        ok = st.link_file(st.join(key, "a"), st.join(key, "c"))
    finally:
        del os.environ["RESHARD_S3_COPY_MAX_BYTES"]
    assert not ok and not st.exists(st.join(key, "c"))
    assert not st.link_file(st.join(key, "gone"), st.join(key, "d"))


def test_moto_copies_in_parts(s3e: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """moto implements UploadPartCopy: an object above the copy limit is
    copied in parts inside the store."""
    from reshard.storage import resolve

    st, key = resolve(s3e.url("parts"))
    data = os.urandom(300 << 10)
    st.write_bytes(st.join(key, "a"), data)
    monkeypatch.setenv("RESHARD_S3_COPY_MAX_BYTES", str(100 << 10))
    assert st.link_file(st.join(key, "a"), st.join(key, "b"))
    assert st.read_bytes(st.join(key, "b")) == data


def test_cli_copy_help_and_bad_source(tmp_path: Path) -> None:
    """``reshard copy`` of something that is not a checkpoint exits 2 in one line."""
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "copy", str(tmp_path / "none"),
                        str(tmp_path / "dst")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(tmp_path / "none") in r.stderr and "no committed checkpoint" in r.stderr, r.stderr
    assert not (tmp_path / "dst").exists()


def test_copy_keeps_a_signature(tmp_path: Path) -> None:
    """``reshard copy`` of a signed checkpoint checks the signature with the
    key given (``--hmac-key-file``) and signs the copy with it; without the
    key it refuses, never dropping the signature."""
    key = b"k" * 32
    src = str(tmp_path / "signed")
    reshard.save({"w": torch.arange(6.0)}, src, options=reshard.SaveOptions(hmac_key=key))
    kf = tmp_path / "key"
    kf.write_bytes(key)
    runner = CliRunner()
    r = runner.invoke(main, ["copy", src, str(tmp_path / "nokey")])
    assert r.exit_code == 1 and "signed" in r.output and not (tmp_path / "nokey").exists(), r.output
    r = runner.invoke(main, ["copy", "--hmac-key-file", str(kf), src, str(tmp_path / "copy")])
    assert r.exit_code == 0, r.output
    tgt = {"w": torch.zeros(6)}
    reshard.load(tgt, str(tmp_path / "copy"), options=reshard.LoadOptions(hmac_key=key))
    assert torch.equal(tgt["w"], torch.arange(6.0))
    with pytest.raises(reshard.CheckpointError):
        reshard.load({"w": torch.zeros(6)}, str(tmp_path / "copy"), options=reshard.LoadOptions(hmac_key=b"x" * 32))
