"""Lineage (parent links, HEAD), verification records bound to what they
verified, re-verification before deletion (``reshard gc``), quarantine, and
``latest`` skipping torn checkpoints. Real files; single process."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

import reshard
from _manifest_doc import sealed_json, write_manifest_doc
from reshard.cli import main
from reshard.commit.lineage import Head, lineage_of, resume_order
from reshard.commit.listing import Entry, committed, read_head, scan
from reshard.errors import StorageError
from reshard.manager.manager import CheckpointManager
from reshard.ondisk.committed import QUARANTINE_MARK
from reshard.ondisk.manifest import Manifest, decode_manifest, encode_manifest
from reshard.storage import LocalStorage, MemoryStorage, clear_memory_storage


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Any:
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def _mgr(root: Path | str, **kw: Any) -> CheckpointManager:
    kw.setdefault("preempt_signals", ())
    return CheckpointManager(str(root), **kw)


def _state(step: int, salt: int = 0) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 3), float(step + salt)), "b": torch.arange(5) + step},
            "meta": {"step": step, "salt": salt}}


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)},
            "meta": {"step": -1, "salt": -1}}


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _flip(d: Path) -> None:
    f = sorted(d.glob("*.safetensors"))[0]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))


# ----------------------------------------------------------------------------- lineage (pure)


def _entry(name: str, step: int, t: float, parent: str | None = None,
           lineage: str | None = None) -> Entry:
    m = Manifest(attempt_id=f"a-{name}", created_at=t, world_size=1, checksum_block_bytes=1,
                 step=step, parent=parent, lineage=lineage)
    return Entry(path=f"/r/{name}", name=name, manifest=m, abandoned=False)


def test_lineage_rollback_deleted_links_and_repeated_resume() -> None:
    a100 = _entry("s100", 100, 1.0)
    a150 = _entry("s150", 150, 2.0, parent="s100", lineage="run1")
    # no HEAD: everything is current, newest step first
    lin = lineage_of([a100, a150], None)
    assert lin.current == {"s100", "s150"}
    assert [e.name for e in resume_order([a100, a150], lin)] == ["s150", "s100"]
    # rollback to 100 (HEAD at t=3): 150 is a child of 100 but from before HEAD: another lineage
    head = Head(name="s100", id="run2", time=3.0, attempt_id="a-s100", step=100)
    lin = lineage_of([a100, a150], head)
    assert lin.source == "s100" and lin.current == {"s100"} and lin.branch("s150") == "other"
    assert [e.name for e in resume_order([a100, a150], lin)] == ["s100", "s150"]
    # the run saves 110, 120, 130; retention deleted 110 and 120: 130 is still a descendant
    b130 = _entry("s130", 130, 6.0, parent="s120", lineage="run2")
    # a plain save told its parent (no lineage id), after HEAD: a descendant through 130
    c140 = _entry("s140", 140, 7.0, parent="s130")
    es = [a100, a150, b130, c140]
    lin = lineage_of(es, head)
    assert lin.descendants == {"s130", "s140"} and lin.current == {"s100", "s130", "s140"}
    assert [e.name for e in resume_order(es, lin)] == ["s140", "s130", "s100", "s150"]
    # restoring 100 a second time: what the first resume from 100 saved is not current
    again = Head(name="s100", id="run3", time=8.0, attempt_id="a-s100", step=100)
    assert lineage_of(es, again).current == {"s100"}
    # HEAD names a checkpoint whose name now holds another one: not the source
    other = Head(name="s100", id="run4", time=9.0, attempt_id="someone-else", step=100)
    assert lineage_of(es, other).source is None


@given(st.lists(st.tuples(st.sampled_from(["save", "save", "save", "restart", "rollback", "delete"]),
                          st.integers(0, 40)), max_size=40))
def test_latest_is_the_newest_save_since_head(events: list[tuple[str, int]]) -> None:
    """Random saves, restarts (resume the latest), rollbacks (resume any
    existing checkpoint) and deletions (never of the resume source): the
    first of the resume order is always the newest save since HEAD was
    written, else HEAD's checkpoint, else (no HEAD) the newest by step."""
    entries: dict[str, Entry] = {}
    head: Head | None = None
    since: list[str] = []  # saved since HEAD was written
    step, clock, parent = 0, 0.0, None
    for i, (ev, k) in enumerate(events):
        clock += 1.0
        if ev == "save":
            step += 1 + k % 3
            name = f"n{i}"
            entries[name] = _entry(name, step, clock, parent=parent,
                                   lineage=head.id if head else None)
            parent = name
            since.append(name)
        elif entries and ev in ("restart", "rollback"):
            order = resume_order(list(entries.values()), lineage_of(list(entries.values()), head))
            to = order[0] if ev == "restart" else sorted(entries.values(), key=lambda e: e.name)[
                k % len(entries)]
            assert to.manifest is not None and to.manifest.step is not None
            head = Head(name=to.name, id=f"h{i}", time=clock, attempt_id=to.manifest.attempt_id,
                        step=to.manifest.step)
            since, parent, step = [], to.name, to.manifest.step
        elif entries and ev == "delete":
            victim = sorted(entries)[k % len(entries)]
            if head is None or victim != head.name:
                del entries[victim]
                since = [n for n in since if n != victim]
        if not entries:
            continue
        es = list(entries.values())
        first = resume_order(es, lineage_of(es, head))[0].name
        if since:
            want = max(since, key=lambda n: (entries[n].step, entries[n].manifest.created_at))  # type: ignore[union-attr]
        elif head is not None:
            want = str(head.name)
        else:
            want = max(es, key=lambda e: (e.step, e.manifest.created_at)).name  # type: ignore[union-attr]
        assert first == want, (events[: i + 1], first, want)


def test_old_manifest_decodes_without_lineage(tmp_path: Path) -> None:
    reshard.save(_state(1), tmp_path / "c", step=1)
    raw = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    assert raw["parent"] is None and raw["lineage"] is None  # plain save: None unless told
    del raw["parent"], raw["lineage"]
    m = decode_manifest(sealed_json(raw))
    assert m.parent is None and m.lineage is None
    reshard.save(_state(2), tmp_path / "d", step=2, options=reshard.SaveOptions(parent="c"))
    assert reshard.inspect(tmp_path / "d").parent == "c"
    assert msgspec.json.decode(encode_manifest(m))["step"] == 1


# ----------------------------------------------------------------------------- latest skips torn


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_latest_skips_torn_and_ls_flags_it(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ckpts"
    for s in (100, 200):
        reshard.save(_state(s), root / f"step-{s:08d}", step=s)
    assert reshard.latest(root) == str(root / "step-00000200")
    f = sorted((root / "step-00000200").glob("*.safetensors"))[0]
    if how == "deleted":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[:-3])
    assert reshard.latest(root) == str(root / "step-00000100")
    r = _run("ls", str(root))
    row = next(ln for ln in r.stdout.splitlines() if ln.rstrip().endswith("step-00000200"))
    assert " torn " in row and f"torn step-00000200: {f}" in r.stdout
    # with a HEAD whose lineage's newest is torn, latest falls back along the lineage
    mgr = _mgr(root)
    res = mgr.restore(_blank(), step=100)
    assert res is not None and read_head(LocalStorage(), str(root))["name"] == "step-00000100"
    assert reshard.latest(root) == str(root / "step-00000100")
    (root / "step-00000100" / sorted(p.name for p in (root / "step-00000100").iterdir()
                                     if p.suffix == ".safetensors")[0]).unlink()
    assert reshard.latest(root) is None  # nothing complete is left


# ----------------------------------------------------------------------------- verification records


def test_stale_verification_record_not_trusted(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=1)
    mgr.save(1, _state(1))
    mgr2 = _mgr(root, keep_last=None)
    assert mgr.is_verified("step-00000001")
    rec = json.loads((root / "step-00000001.verified.json").read_text())
    assert rec["ok"] and rec["how"] == "smoke" and len(rec["manifest_xxh3"]) == 16
    assert set(rec["files"]) == set(reshard.inspect(root / "step-00000001").files)
    # a file of another size: the record no longer describes the checkpoint
    f = sorted((root / "step-00000001").glob("*.safetensors"))[0]
    raw = f.read_bytes()
    f.write_bytes(raw + b"\0")
    assert not mgr.is_verified("step-00000001")
    f.write_bytes(raw)
    assert mgr.is_verified("step-00000001")
    # the checkpoint replaced by another one (another manifest), the old record left in place
    mgr2.save(2, _state(2))
    reshard.save(_state(7), root / "step-00000002", step=2,
                 options=reshard.SaveOptions(overwrite=True))
    assert (root / "step-00000002.verified.json").exists()
    assert not mgr.is_verified("step-00000002")
    # so retention does not delete the older verified checkpoint on its strength
    assert mgr.apply_retention().delete == ()
    assert (root / "step-00000001").is_dir()
    # a record of the old, unbound format is not trusted either
    (root / "step-00000001.verified.json").write_text(json.dumps({"ok": True, "time": 0}))
    assert not mgr.is_verified("step-00000001")


def test_gc_reverifies_the_checkpoint_it_keeps(tmp_path: Path) -> None:
    """A damaged newest checkpoint (a flipped byte, its stale record kept) and
    ``gc --keep-last 1``: the intact older checkpoint remains and loads."""
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=None)
    for s in (1, 2):
        mgr.save(s, _state(s))
    _flip(root / "step-00000002")
    assert mgr.is_verified("step-00000002")  # same sizes, same manifest: the record still matches
    before = sorted(p.name for p in root.iterdir())
    # opting out of checksums: the structure check passes, so step 1 would go (dry run: nothing does)
    r = _run("gc", str(root), "--keep-last", "1", "--no-checksums", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "verified again (structure and sizes) step-00000002: passed" in r.stdout
    assert "would delete step-00000001" in r.stdout
    r = _run("gc", str(root), "--keep-last", "1", "--dry-run")
    assert r.exit_code == 1, r.output  # a failed re-verification is reported by the exit status
    assert "verified again with checksums step-00000002: FAILED" in r.stdout
    assert "would delete" not in r.stdout and "nothing to delete" in r.stdout
    assert sorted(p.name for p in root.iterdir()) == before  # a dry run changes nothing
    r = _run("gc", str(root), "--keep-last", "1")
    assert r.exit_code == 1, r.output
    assert "verified again with checksums step-00000002: FAILED" in r.stdout
    assert "deleted step-" not in r.stdout and "kept step-00000001 (newest verified)" in r.stdout
    assert not mgr.is_verified("step-00000002")  # the failure is recorded
    state = _blank()
    res = reshard.load(state, root / "step-00000001")
    assert res.step == 1 and torch.equal(state["model"]["w"], torch.full((4, 3), 1.0))
    # `reshard verify` reports the damage and renames nothing
    r = _run("verify", str(root / "step-00000002"))
    assert r.exit_code == 1 and "checksum mismatch" in r.stdout
    assert (root / "step-00000002").is_dir() and not any(".quarantined" in p.name
                                                          for p in root.iterdir())


def test_manager_reverifies_before_deleting_last_older(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root, keep_last=1)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert mgr.last_plan is not None
    assert mgr.last_plan.checks == (("step-00000002", "verified again with checksums", True),)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000002"]


# ----------------------------------------------------------------------------- quarantine


class _FlakyStat(LocalStorage):
    """``size`` of the data files of one checkpoint fails like a broken mount."""

    bad = "step-00000002"

    def size(self, path: str) -> int:
        if f"/{self.bad}/" in path and path.endswith(".safetensors"):
            raise StorageError(f"stat {path!r}: input/output error (injected)")
        return super().size(path)


def test_restore_never_quarantines_on_storage_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    before = sorted(p.name for p in root.iterdir())
    flaky = CheckpointManager(str(root), preempt_signals=(), storage=_FlakyStat())
    with pytest.raises(StorageError, match="input/output error"):
        flaky.restore(_blank())
    assert sorted(p.name for p in root.iterdir()) == before  # no quarantine, no HEAD
    res = _mgr(root).restore(_blank())  # the store is back: the newest loads
    assert res is not None and res.step == 2


def test_quarantine_marker_on_a_store_without_rename() -> None:
    clear_memory_storage()
    st = MemoryStorage()
    root = "runs/q"
    mgr = CheckpointManager(root, storage=st, keep_last=None, preempt_signals=())
    mgr.save(100, _state(100))
    mgr.save(150, _state(150))
    key = next(k for k in st._objects  # no rename: data keys carry the attempt id
               if k.startswith(f"{root}/step-00000150/att-") and ".data-r" in k)
    st._objects[key] = st._objects[key][:-1] + bytes([st._objects[key][-1] ^ 0xFF])
    state = _blank()
    with pytest.warns(RuntimeWarning, match="quarantined as step-00000150"):
        res = CheckpointManager(root, storage=st, keep_last=1, preempt_signals=()).restore(state)
    assert res is not None and res.step == 100
    assert f"{root}/step-00000150{QUARANTINE_MARK}" in st._objects  # marked, not deleted
    q = [e for e in scan(st, root) if e.quarantined]
    assert [e.name for e in q] == ["step-00000150"] and "checksum mismatch" in (q[0].problem or "")
    assert [e.name for e in committed(st, root)] == ["step-00000100"]
    assert reshard.latest(root, storage=st) == f"{root}/step-00000100"
    # the next save of step 150 proceeds, and the next restart resumes it
    again = CheckpointManager(root, storage=st, keep_last=1, preempt_signals=())
    again.restore(_blank())
    assert again.save(150, _state(150, salt=5)).path == f"{root}/step-00000150.1"
    state = _blank()
    res = CheckpointManager(root, storage=st, keep_last=1, preempt_signals=()).restore(state)
    assert res is not None and res.path == f"{root}/step-00000150.1"
    assert res.values["meta"] == {"step": 150, "salt": 5}
    assert f"{root}/step-00000150/manifest.json" in st._objects  # still there, quarantined
    clear_memory_storage()


def test_resume_then_save_the_same_step_and_head_record(tmp_path: Path) -> None:
    """A loop that saves the step it resumed at gets a suffixed name, not an
    error; HEAD is a complete JSON record written through a temporary file."""
    root = tmp_path / "ckpts"
    _mgr(root).save(100, _state(100))
    mgr = _mgr(root, keep_last=1)
    assert mgr.restore(_blank()) is not None
    head = json.loads((root / "HEAD").read_text())
    assert head["name"] == "step-00000100" and head["step"] == 100 and head["id"]
    assert not any(".tmp-" in p.name for p in root.iterdir())
    r = mgr.save(100, _state(100, salt=1))
    assert Path(r.path).name == "step-00000100.1"
    assert reshard.inspect(r.path).parent == "step-00000100"
    assert reshard.inspect(r.path).lineage == head["id"]
    assert reshard.latest(root) == str(root / "step-00000100.1")
    state = _blank()
    res = _mgr(root).restore(state)
    assert res is not None and res.values["meta"] == {"step": 100, "salt": 1}
    assert json.loads((root / "HEAD").read_text())["name"] == "step-00000100.1"
    # by name: the other checkpoint of step 100 (restore(step=100) prefers the current lineage)
    res = _mgr(root).restore(state, step=100)
    assert res is not None and res.path == str(root / "step-00000100.1")
    res = _mgr(root).restore(state, name="step-00000100")
    assert res is not None and res.values["meta"] == {"step": 100, "salt": 0}
    with pytest.raises(reshard.CheckpointNotFoundError, match="step-00000999"):
        _mgr(root).restore(state, name="step-00000999")


def test_restore_quarantines_a_checkpoint_with_a_damaged_manifest(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _mgr(root)
    for s in (100, 150, 200):
        mgr.save(s, _state(s))
    mf = root / "step-00000150" / "manifest.json"
    mf.write_bytes(mf.read_bytes()[:-20])  # torn manifest: ManifestError
    newer = root / "step-00000200" / "manifest.json"  # written by a newer reader: left alone
    write_manifest_doc(newer, {**json.loads(newer.read_text()), "format_version": 99})
    state = _blank()
    with pytest.warns(RuntimeWarning, match="invalid manifest.*quarantined as step-00000150"):
        res = _mgr(root).restore(state)
    assert res is not None and res.step == 100
    assert any("step-00000150" in f for f in res.notes["fallback"])
    assert (root / "step-00000200").is_dir()
    r = _run("ls", str(root))
    quarantined = r.stdout.partition("quarantined (1")[2]
    assert "step-00000150.quarantined-" in quarantined and "invalid (1" in r.stdout
    assert "step-00000200: " in r.stdout.partition("invalid (1")[2]
    assert _mgr(root).save(150, _state(150)).path == str(root / "step-00000150.1")


def test_evaluation_restore_with_record_head_false_never_rolls_training_back(tmp_path: Path) -> None:
    """Found by a fresh-user review: an evaluation calling restore(step=100) on a
    live training root rewrote HEAD, so the training run's next restart went back
    to 100. With record_head=False the root's lineage is untouched."""
    root = tmp_path / "ckpts"
    train = _mgr(root)
    assert train.restore(_blank(), allow_fresh_start=True) is None
    train.save(100, _state(100))
    train.save(150, _state(150))
    before = (root / "HEAD").read_bytes() if (root / "HEAD").exists() else None
    state = _blank()
    res = _mgr(root).restore(state, step=100, record_head=False)  # the evaluation
    assert res is not None and res.values["meta"] == {"step": 100, "salt": 0}
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 100.0))
    after = (root / "HEAD").read_bytes() if (root / "HEAD").exists() else None
    assert after == before
    train.save(200, _state(200))
    assert reshard.latest(root) == str(root / "step-00000200")
    res = _mgr(root).restore(_blank())  # the training run's restart
    assert res is not None and res.path == str(root / "step-00000200")
    # the default (record_head=True) is a rollback: the next save continues from 100
    _mgr(root).restore(_blank(), step=100)
    assert json.loads((root / "HEAD").read_text())["name"] == "step-00000100"
