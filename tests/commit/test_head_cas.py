"""The root ``HEAD`` record is replaced by compare-and-swap on stores without
rename: S3 ``If-Match`` on the ETag read (``If-None-Match: *`` when absent)
against moto's real server, and the same contract on ``memory://``; local
roots keep the atomic rename (last writer wins)."""

from __future__ import annotations

import os

import pytest
import torch

import reshard
from reshard.commit.listing import read_head, read_head_tagged, write_head
from reshard.errors import CheckpointError
from reshard.manager import resume
from reshard.ondisk.committed import HEAD_NAME
from reshard.storage import resolve


def _root(kind: str, request: pytest.FixtureRequest, tmp_path) -> str:
    if kind == "s3":
        return request.getfixturevalue("s3e").url("head")
    if kind == "memory":
        return f"memory://head-{os.urandom(4).hex()}"
    return str(tmp_path / "root")


def _rec(name: str) -> dict:
    return {"name": name, "id": f"id-{name}", "time": 1.0, "attempt_id": f"att-{name}", "step": 1}


@pytest.mark.parametrize("kind", ["s3", "memory"])
def test_stale_head_write_is_refused_and_names_the_winner(kind, request, tmp_path) -> None:
    st, root = resolve(_root(kind, request, tmp_path))
    assert read_head_tagged(st, root) == (None, None)
    write_head(st, root, _rec("a"), expect=None)           # If-None-Match: * on no HEAD
    rec, tag_a = read_head_tagged(st, root)
    assert rec == _rec("a") and tag_a is not None
    with pytest.raises(CheckpointError, match="'a'.*'id-a'"):  # a second creator loses
        write_head(st, root, _rec("x"), expect=None)
    write_head(st, root, _rec("b"), expect=tag_a)          # If-Match on the tag read: wins
    rec, tag_b = read_head_tagged(st, root)
    assert rec == _rec("b") and tag_b != tag_a
    # a writer that read HEAD before b's swap loses, names b, and changes nothing
    with pytest.raises(CheckpointError, match=r"another writer replaced HEAD.*'b'.*'id-b'.*'c' was not"):
        write_head(st, root, _rec("c"), expect=tag_a)
    assert read_head(st, root) == _rec("b")
    st.delete_tree(st.join(root, HEAD_NAME))               # removed meanwhile: also a lost race
    with pytest.raises(CheckpointError, match="absent"):
        write_head(st, root, _rec("d"), expect=tag_b)
    write_head(st, root, _rec("e"))                        # default: re-read just before the swap
    assert read_head(st, root) == _rec("e")


def test_local_root_keeps_rename_last_writer_wins(tmp_path) -> None:
    st, root = resolve(str(tmp_path / "root"))
    st.makedirs(root)
    assert read_head_tagged(st, root) == (None, None)
    write_head(st, root, _rec("a"), expect=None)
    write_head(st, root, _rec("b"), expect=None)  # rename: no compare, atomic replace
    assert read_head(st, root) == _rec("b")


def test_restore_that_loses_the_head_race_raises(s3e, monkeypatch) -> None:
    """Two jobs resume one S3 root: the other job's HEAD lands between this
    restore's listing and its HEAD write; this restore raises, the other's
    HEAD stays."""
    root = s3e.url("race")
    mgr = reshard.CheckpointManager(root)
    mgr.save(1, {"w": torch.arange(8.0)})
    mgr.close()
    st, key = resolve(root)
    real = resume._write_head

    def other_job_first(m, *args):  # the other job's real conditional put, then ours
        write_head(st, key, _rec("other-job"))
        return real(m, *args)

    monkeypatch.setattr(resume, "_write_head", other_job_first)
    w = torch.zeros(8)
    with pytest.raises(CheckpointError, match="another writer replaced HEAD.*'other-job'"):
        reshard.CheckpointManager(root).restore({"w": w})
    assert read_head(st, key) == _rec("other-job")
    monkeypatch.setattr(resume, "_write_head", real)
    res = reshard.CheckpointManager(root).restore({"w": w})  # alone now: re-reads HEAD, wins
    assert res is not None and torch.equal(w, torch.arange(8.0))
    assert read_head(st, key)["name"] == "step-00000001"
