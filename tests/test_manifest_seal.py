"""The manifest's own checksum (``extra["manifest_xxh3_64"]``): every byte of
a written manifest is covered, so a changed number (a learning rate, a file
size) is refused, not loaded; unsealed manifests of earlier versions load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard
from reshard.errors import IntegrityError
from reshard.ondisk.manifest import SEAL_KEY, decode_manifest, encode_manifest, encode_sealed


def _state() -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "sched": {"lr": 0.001, "last_epoch": 7}}


def _target() -> dict:
    return {"w": torch.zeros(3, 4), "sched": {"lr": None, "last_epoch": None}}


def test_a_changed_value_in_the_manifest_is_refused_everywhere(tmp_path: Path) -> None:
    root = tmp_path / "run"
    reshard.save(_state(), root / "step-00000001", step=1)
    reshard.save(_state(), root / "step-00000002", step=2)
    mf = root / "step-00000002" / "manifest.json"
    raw = mf.read_bytes()
    assert json.loads(raw)["extra"][SEAL_KEY] != "0" * 16
    tgt = _target()
    res = reshard.load(tgt, root / "step-00000002")
    assert res.values["sched"]["lr"] == 0.001 and torch.equal(tgt["w"], _state()["w"])
    mf.write_bytes(raw.replace(b"0.001", b"0.002"))  # same length, still valid JSON
    tgt = _target()
    with pytest.raises(IntegrityError, match=r"step-00000002/manifest.json: manifest checksum mismatch"):
        reshard.load(tgt, root / "step-00000002")
    assert torch.equal(tgt["w"], torch.zeros(3, 4))  # nothing loaded
    rep = reshard.verify(root / "step-00000002")
    assert not rep.ok and "manifest checksum mismatch" in rep.problems[0]
    assert Path(str(reshard.latest(root))).name == "step-00000001"  # the good one before it


def test_sealed_and_signed(tmp_path: Path) -> None:
    """With an HMAC key the signature covers everything but the seal, the seal
    covers the signed bytes: both checked, in either order of damage."""
    key = b"k" * 32
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1, options=reshard.SaveOptions(hmac_key=key))
    raw = (p / "manifest.json").read_bytes()
    extra = json.loads(raw)["extra"]
    assert SEAL_KEY in extra and "hmac_sha256" in extra
    res = reshard.load(_target(), p, options=reshard.LoadOptions(hmac_key=key))
    assert res.values["sched"]["lr"] == 0.001
    (p / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        reshard.load(_target(), p, options=reshard.LoadOptions(hmac_key=key))
    (p / "manifest.json").write_bytes(raw)
    with pytest.raises(IntegrityError, match="HMAC"):
        reshard.load(_target(), p, options=reshard.LoadOptions(hmac_key=b"x" * 32))


def test_unsealed_manifests_still_load(tmp_path: Path) -> None:
    """A manifest written before the seal existed (no key) loads as before."""
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1)
    m = decode_manifest((p / "manifest.json").read_bytes())
    unsealed = encode_manifest(__import__("msgspec").structs.replace(
        m, extra={k: v for k, v in m.extra.items() if k != SEAL_KEY}))
    (p / "manifest.json").write_bytes(unsealed)
    tgt = _target()
    reshard.load(tgt, p)
    assert torch.equal(tgt["w"], _state()["w"])


def test_seal_is_over_bytes_so_unknown_fields_of_a_newer_writer_pass(tmp_path: Path) -> None:
    """A newer writer's manifest with a field this version does not know,
    sealed by the same rule over its own bytes: this reader decodes it (the
    field is dropped) and the seal still matches, because it is checked over
    the bytes read, never over a re-encoding."""
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1)
    doc = json.loads((p / "manifest.json").read_bytes())
    doc["a_field_from_a_newer_version"] = {"x": [1, 2.5]}
    doc["extra"][SEAL_KEY] = "0" * 16
    raw = json.dumps(doc, separators=(",", ":")).encode()
    import xxhash

    zero = f'"{SEAL_KEY}":"{"0" * 16}"'.encode()
    sealed = raw.replace(zero, f'"{SEAL_KEY}":"{xxhash.xxh3_64_hexdigest(raw)}"'.encode())
    m = decode_manifest(sealed)
    assert m.step == 1
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        decode_manifest(sealed.replace(b"2.5", b"3.5"))  # a field it does not know: still covered
    assert decode_manifest(encode_sealed(m)).step == 1


_SEALED: dict[str, bytes] = {}


def _sealed_bytes() -> bytes:
    if not _SEALED:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            reshard.save(_state(), Path(d) / "ck", step=3)
            _SEALED["raw"] = (Path(d) / "ck" / "manifest.json").read_bytes()
    return _SEALED["raw"]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_single_byte_change_is_refused_or_fails_to_decode(data: st.DataObject) -> None:
    raw = _sealed_bytes()
    i = data.draw(st.integers(0, len(raw) - 1))
    b = data.draw(st.integers(0, 255).filter(lambda v: v != raw[i]))
    bad = raw[:i] + bytes([b]) + raw[i + 1:]
    with pytest.raises(reshard.CheckpointError):
        decode_manifest(bad)


@pytest.mark.parametrize("dumps", [{}, {"indent": 2}, {"ensure_ascii": False, "indent": "\t"}],
                         ids=["spaces", "indent", "tab-indent-utf8"])
def test_a_manifest_sealed_by_another_json_writer_loads(tmp_path: Path, dumps: dict) -> None:
    """A writer that follows the rule of the README (xxh3_64 of the bytes as
    written, the value read as 16 zeros) with other JSON whitespace than
    ours (json.dumps' ", " and ": ", an indent): it loads, and a changed
    value in it is still refused. The reader looked for the compact
    ``"key":"value"`` only and refused every such manifest as bit rot."""
    import re

    import xxhash

    p = tmp_path / "ck"
    reshard.save({**_state(), "name": "h\u00e9llo \u65e5\u672c"}, p, step=1)
    doc = json.loads((p / "manifest.json").read_bytes())
    doc["extra"][SEAL_KEY] = "0" * 16
    zeroed = json.dumps(doc, **dumps).encode()
    assert re.search(rb'"manifest_xxh3_64": "0{16}"', zeroed)  # not our compact token
    raw = zeroed.replace(b'"0000000000000000"', f'"{xxhash.xxh3_64_hexdigest(zeroed)}"'.encode())
    (p / "manifest.json").write_bytes(raw)
    tgt = {**_target(), "name": None}
    res = reshard.load(tgt, p)
    assert res.values["sched"]["lr"] == 0.001 and res.values["name"] == "h\u00e9llo \u65e5\u672c"
    assert torch.equal(tgt["w"], _state()["w"])
    (p / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match=r"ck/manifest.json: manifest checksum mismatch"):
        reshard.load({**_target(), "name": None}, p)


def test_the_seal_key_in_user_extra_is_refused_not_dropped(tmp_path: Path) -> None:
    """``SaveOptions(extra={"manifest_xxh3_64": ...})``: a ValueError naming
    the key; it was silently replaced by the seal and dropped at load. The
    key nested deeper is the user's own and round-trips."""
    with pytest.raises(ValueError, match=r"extra\['manifest_xxh3_64'\] is reserved"):
        reshard.SaveOptions(extra={SEAL_KEY: "mine"})
    nested = {"k": {SEAL_KEY: "abc"}}
    reshard.save(_state(), tmp_path / "ck", step=1, options=reshard.SaveOptions(extra=nested))
    assert reshard.inspect(tmp_path / "ck").extra == nested


def test_restore_of_a_step_whose_manifest_is_damaged_is_not_not_found(tmp_path: Path) -> None:
    """``restore(step=2)`` (or ``name=``) when step 2's manifest fails its
    seal: set aside, and a CheckpointError naming the file, not
    CheckpointNotFoundError ("no committed checkpoint of step 2"), which a
    caller may take for a fresh start; a step never saved stays not-found."""
    import warnings

    root = tmp_path / "run"
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    for s in (1, 2, 3):
        mgr.save(s, _state())
    mgr.wait()
    for which, kw in (("step-00000002", {"step": 2}), ("step-00000003", {"name": "step-00000003"})):
        mf = root / which / "manifest.json"
        mf.write_bytes(mf.read_bytes().replace(b"0.001", b"0.002"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(reshard.CheckpointError) as ei:
                reshard.CheckpointManager(root, preempt_signals=()).restore(_target(), **kw)
        assert not isinstance(ei.value, reshard.CheckpointNotFoundError)
        assert f"{which}/manifest.json: manifest checksum mismatch" in str(ei.value)
        assert not (root / which).exists()  # set aside, never deleted
    with pytest.raises(reshard.CheckpointNotFoundError, match="no committed checkpoint of step 9"):
        reshard.CheckpointManager(root, preempt_signals=()).restore(_target(), step=9)
    tgt = _target()
    assert reshard.CheckpointManager(root, preempt_signals=()).restore(tgt).step == 1


def test_a_user_value_holding_the_placeholder_text_is_still_sealed(tmp_path: Path) -> None:
    """User metadata holding the exact text of the seal's key and 16 zeros
    (e.g. a copy of a manifest document's extra): the manifest is still
    sealed (it was written unsealed, so any change to it loaded silently),
    loads with the user's value intact, and a changed value is refused."""
    nested = {"copied": {SEAL_KEY: "0" * 16}}
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1, options=reshard.SaveOptions(extra=nested))
    raw = (p / "manifest.json").read_bytes()
    doc = json.loads(raw)
    assert "manifest-seal" in doc["required_features"] and doc["extra"][SEAL_KEY] != "0" * 16
    assert raw.count(b'"manifest_xxh3_64":"0000000000000000"') == 1  # the user's
    res = reshard.load(_target(), p)
    assert res.values["sched"]["lr"] == 0.001 and reshard.inspect(p).extra == nested
    (p / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        reshard.load(_target(), p)
