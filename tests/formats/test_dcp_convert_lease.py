"""convert_dcp holds its reader lease as every reader does
(:func:`reshard.commit.leases.reader_lease`): written, then confirmed before
the source is read, so a deletion of the source in flight is waited for and
the conversion never reads a folder that is being deleted."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest
import torch

from reshard.commit.leases import DELETING, LEASE
from reshard.commit.protocol import finish_interrupted
from reshard.errors import CheckpointNotFoundError
from reshard.faults.inject import Fault, FaultStorage
from reshard.formats.dcp_convert import convert_dcp
from reshard.storage import LocalStorage


def _small_dcp(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "n": torch.tensor(5)},
                 checkpoint_id=str(path), no_dist=True)


def test_convert_waits_for_a_deletion_in_flight_and_refuses_the_deleted_source(tmp_path: Path) -> None:
    """gc finishes an interrupted deletion of the source (its
    ``<name>.deleting-*.json`` record beside it; gc does not look at reader
    leases then) while the conversion starts: the conversion's lease is
    written, the deletion completes, and the conversion refuses with
    CheckpointNotFoundError naming the source, having read no byte of it and
    written nothing at the destination. (A lease taken by hand, without
    ``confirm()``, read the folder's ``.metadata`` at once, while it was
    being deleted.)"""
    root = tmp_path / "root"
    src = root / "step-1"
    _small_dcp(src)
    (root / f"step-1{DELETING}0badf00d.json").write_text("{}")  # an interrupted deletion's record
    started = threading.Event()
    deleted = threading.Event()

    def gc_finishes() -> None:  # gc, in another process: waits for the source's first read, or 1 s
        started.wait(1.0)
        finish_interrupted(LocalStorage(), str(root), os.listdir(root))
        deleted.set()

    deleter = threading.Thread(target=gc_finishes, daemon=True)

    def lease_written(op: str, path: str) -> None:
        deleter.start()

    def source_read(op: str, path: str) -> None:
        started.set()
        deleted.wait(5.0)  # the reader goes on once the deletion is done: a half-deleted folder

    fs = FaultStorage(LocalStorage(), [
        Fault(op="write_bytes", match=f"step-1{LEASE}*", action="call", callback=lease_written),
        *(Fault(op="read", match=m, action="call", times=0, callback=source_read)
          for m in (".metadata", "*.distcp"))])
    dst = tmp_path / "out"
    with pytest.raises(CheckpointNotFoundError, match=str(src)):
        convert_dcp(str(src), str(dst), src_storage=fs)
    deleter.join(5.0)
    assert deleted.is_set() and not src.exists()
    reads = [p for op, p in fs.log if op == "read"]
    assert reads == [], f"the source was read while it was being deleted: {reads}"
    assert not dst.exists() or not os.listdir(dst)
    assert not [n for n in os.listdir(root) if LEASE in n]  # the lease was released


def test_convert_holds_a_lease_that_retention_respects(tmp_path: Path) -> None:
    """While the conversion reads the source, a reader lease on it is live
    (retention and gc report it in use); afterwards it is gone."""
    from reshard.commit.leases import live_readers

    root = tmp_path / "root"
    src = root / "step-1"
    _small_dcp(src)
    seen: list[dict[str, int]] = []

    def look(op: str, path: str) -> None:
        seen.append(live_readers(LocalStorage(), str(root), {"step-1"}))

    fs = FaultStorage(LocalStorage(), [Fault(op="read", match="*.distcp", action="call", callback=look)])
    res = convert_dcp(str(src), str(tmp_path / "out"), src_storage=fs)
    assert res.manifest is not None and set(res.manifest.tensors) == {"w", "n"}
    assert seen == [{"step-1": 1}]
    assert live_readers(LocalStorage(), str(root), {"step-1"}) == {}
