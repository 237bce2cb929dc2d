"""One commit strategy per store (reshard.commit.strategy): chosen once by the
store's capabilities, answering what the pipelines used to ask them; and no
module outside storage/ and the strategy reads ``atomic_rename`` again."""

from __future__ import annotations

import pathlib
import re

import pytest

from reshard.commit.strategy import MarkerCommit, RenameCommit, strategy_for, write_record
from reshard.faults.inject import FaultStorage
from reshard.ondisk.committed import read_record
from reshard.storage import Capabilities, resolve

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "reshard"


def test_a_store_gets_its_strategy_by_its_capabilities_once(tmp_path) -> None:
    local, _ = resolve(str(tmp_path))
    mem, _ = resolve("memory://strategy-choice/root")
    assert isinstance(strategy_for(local), RenameCommit)
    got = strategy_for(mem)
    assert isinstance(got, MarkerCommit) and got.swaps_head  # memory:// has conditional puts
    assert strategy_for(local) is strategy_for(local)  # one object per kind of store, not per call
    assert strategy_for(FaultStorage(local)) is strategy_for(local)  # a wrapper keeps its store's

    class NoCas(type(mem)):  # type: ignore[misc]
        capabilities = Capabilities(atomic_rename=False, listing=True, ranged_reads=True,
                                    durable_sync=False, conditional_put=False)

    plain = strategy_for(NoCas())
    assert isinstance(plain, MarkerCommit) and not plain.swaps_head


def test_the_two_strategies_answer_the_attempt_questions_apart(tmp_path) -> None:
    local, root = resolve(str(tmp_path))
    mem, mroot = resolve("memory://strategy-attempt/root")
    r, m = strategy_for(local), strategy_for(mem)
    path = local.join(root, "step-00000001")
    assert r.attempt_path(local, path, "20250101T000000-ab") == path + ".incomplete-20250101T000000-ab"
    assert m.attempt_path(mem, "step-00000001", "x1") == "step-00000001"
    assert r.data_name("x1", "data-r00000-0.safetensors") == "data-r00000-0.safetensors"
    assert m.data_name("x1", "data-r00000-0.safetensors") == "att-x1.data-r00000-0.safetensors"
    assert r.nonce_key(local, "a", "x1").endswith("/attempt-nonce.json")
    assert m.nonce_key(mem, "a", "x1").endswith("att-x1.attempt-nonce.json")
    assert (r.shares_prefix, r.keeps_plan) == (False, True)
    assert (m.shares_prefix, m.keeps_plan) == (True, False)
    with pytest.raises(ValueError, match="must not contain"):
        m.data_name("a.b", "data")


def test_the_published_manifest_names_the_files_as_the_strategy_wrote_them(tmp_path) -> None:
    import torch

    from reshard import save
    from reshard.ondisk.committed import read_manifest

    local, root = resolve(str(tmp_path))
    save({"w": torch.arange(6.0), "opt": {"lr": [0.1, 0.2]}}, str(tmp_path / "ck"))
    m = read_manifest(local, local.join(root, "ck"))
    assert m.files and any(te.chunks for te in m.tensors.values())
    r, mk = strategy_for(local), strategy_for(resolve("memory://name-files/root")[0])
    assert r.name_files(m, "x1") is m  # an attempt's own directory keeps the plain names
    named = mk.name_files(m, "x1")
    assert sorted(named.files) == sorted(f"att-x1.{n}" for n in m.files)
    assert list(named.files.values()) == [m.files[n] for n in m.files]
    chunks = [c for te in named.tensors.values() for c in te.chunks]
    chunks += [c for oe in named.objects.values() for c in oe.chunks]
    assert chunks and all(c.file.startswith("att-x1.") and c.file[len("att-x1."):] in m.files for c in chunks)
    # the memory store's save publishes exactly the names its attempt wrote
    save({"w": torch.arange(6.0)}, "memory://name-files/saved/ck")
    mem, key = resolve("memory://name-files/saved/ck")
    got = read_manifest(mem, key)
    assert got.files and all(n.startswith(f"att-{got.attempt_id}.") for n in got.files)
    assert all(mem.exists(mem.join(key, n)) for n in got.files)


def test_records_are_written_by_rename_or_by_put_as_the_strategy_says(tmp_path) -> None:
    local, root = resolve(str(tmp_path))
    spy = FaultStorage(local)
    write_record(spy, local.join(root, "HEAD"), {"name": "step-1"})
    calls = [op for op, _ in spy.log]
    assert "rename" in calls and read_record(local, local.join(root, "HEAD")) == {"name": "step-1"}
    mem, mroot = resolve("memory://strategy-record/root")
    mspy = FaultStorage(mem)
    write_record(mspy, mem.join(mroot, "HEAD"), {"name": "step-2"})
    assert "rename" not in [op for op, _ in mspy.log] and mspy.log
    assert read_record(mem, mem.join(mroot, "HEAD")) == {"name": "step-2"}


def test_no_module_outside_storage_and_the_strategy_reads_atomic_rename() -> None:
    allowed = {SRC / "commit" / "strategy.py",
               SRC / "testing" / "storage_conformance.py",  # tests the storage itself
               SRC / "ondisk" / "dcp.py"}  # declares a read-only store's capabilities
    found = []
    for p in sorted(SRC.rglob("*.py")):
        if (SRC / "storage") in p.parents or p in allowed:
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"atomic_rename|capabilities\.(conditional_put)", line):
                found.append(f"{p.relative_to(SRC)}:{i}: {line.strip()}")
    assert not found, "ask reshard.commit.strategy.strategy_for(storage) instead:\n" + "\n".join(found)
