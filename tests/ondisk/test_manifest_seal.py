"""The manifest's own checksum (its seal): every byte of a written manifest
is covered, so a changed number (a learning rate, a file size) is refused,
not loaded. Format version 3 writes it at the head of the bytes
(``{"manifest_xxh3_64":"<xxh3_64 of every byte after the head>",...``);
manifests of version 2 (sealed in ``extra["manifest_xxh3_64"]``, the value
read as 16 zeros) and unsealed ones of versions 1 and 2 still load, checked
by their own rule (``tests/support/data/v2_checkpoint`` was written by version 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard
from reshard.errors import IntegrityError, ManifestError
from reshard.ondisk.manifest import (
    SEAL_FEATURE,
    SEAL_HEAD,
    SEAL_KEY,
    decode_manifest,
    encode_manifest,
    encode_sealed,
    reseal,
)
from reshard.ondisk.seal import SEALED_FROM

V2 = Path(__file__).parents[1] / "support" / "data" / "v2_checkpoint"
V2_KEY = b"v2-fixture-key"  # the HMAC key it was signed with


def _v2_doc(doc: dict) -> dict:
    """A version-3 manifest document as version 2 would have written it: no
    head, the seal a key of its extra (16 zeros, to be sealed)."""
    doc = {k: v for k, v in doc.items() if k != SEAL_KEY}
    doc["format_version"] = 2
    doc["extra"] = {**doc["extra"], SEAL_KEY: "0" * 16}
    doc["required_features"] = [*doc["required_features"], SEAL_FEATURE]
    return doc


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
    assert raw.startswith(SEAL_HEAD) and json.loads(raw)["format_version"] == 3
    assert raw[SEALED_FROM - 2:SEALED_FROM] == b'",' and SEALED_FROM == 39
    assert xxhash.xxh3_64_hexdigest(raw[39:]) == json.loads(raw)[SEAL_KEY]  # the rule, from outside
    assert SEAL_KEY not in json.loads(raw)["extra"]
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
    assert raw.startswith(SEAL_HEAD) and "hmac_sha256" in json.loads(raw)["extra"]
    res = reshard.load(_target(), p, options=reshard.LoadOptions(hmac_key=key))
    assert res.values["sched"]["lr"] == 0.001
    (p / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        reshard.load(_target(), p, options=reshard.LoadOptions(hmac_key=key))
    (p / "manifest.json").write_bytes(raw)
    with pytest.raises(IntegrityError, match="HMAC"):
        reshard.load(_target(), p, options=reshard.LoadOptions(hmac_key=b"x" * 32))


def test_unsealed_manifests_of_earlier_versions_still_load(tmp_path: Path) -> None:
    """A manifest of version 2 or 1 written before the seal existed (no key,
    no feature) loads as before; one of version 3 without its head is
    refused (the version says it is sealed)."""
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1)
    m = decode_manifest((p / "manifest.json").read_bytes())
    (p / "manifest.json").write_bytes(encode_manifest(msgspec.structs.replace(m, format_version=2)))
    tgt = _target()
    reshard.load(tgt, p)
    assert torch.equal(tgt["w"], _state()["w"])
    (p / "manifest.json").write_bytes(encode_manifest(m))
    with pytest.raises(IntegrityError, match=r"ck/manifest.json: manifest checksum mismatch.*no seal: a "
                                             r"version-3 manifest begins with \{\"manifest_xxh3_64\""):
        reshard.load(_target(), p)


def test_seal_is_over_bytes_so_unknown_fields_of_a_newer_writer_pass(tmp_path: Path) -> None:
    """A newer writer's manifest with a field this version does not know,
    sealed by the same rule over its own bytes: this reader decodes it (the
    field is dropped) and the seal still matches, because it is checked over
    the bytes read, never over a re-encoding. The version-3 head is written
    here by hand, as the rule in docs/on-disk-format.md says."""
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1)
    doc = json.loads((p / "manifest.json").read_bytes())
    del doc[SEAL_KEY]
    doc["a_field_from_a_newer_version"] = {"x": [1, 2.5]}
    body = json.dumps(doc, indent=1).encode()[1:]  # after the object's "{", any JSON whitespace
    sealed = b'{"manifest_xxh3_64":"' + xxhash.xxh3_64_hexdigest(body).encode() + b'",' + body
    m = decode_manifest(sealed)
    assert m.step == 1
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        decode_manifest(sealed.replace(b"2.5", b"3.5"))  # a field it does not know: still covered
    assert decode_manifest(encode_sealed(m)) == m


def test_version_2_seal_is_over_bytes_so_unknown_fields_pass(tmp_path: Path) -> None:
    """The same under version 2's rule (the value in extra read as 16 zeros)."""
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1)
    doc = _v2_doc(json.loads((p / "manifest.json").read_bytes()))
    doc["a_field_from_a_newer_version"] = {"x": [1, 2.5]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    zero = f'"{SEAL_KEY}":"{"0" * 16}"'.encode()
    sealed = raw.replace(zero, f'"{SEAL_KEY}":"{xxhash.xxh3_64_hexdigest(raw)}"'.encode())
    m = decode_manifest(sealed)
    assert m.step == 1 and m.format_version == 2 and SEAL_KEY not in m.extra
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        decode_manifest(sealed.replace(b"2.5", b"3.5"))
    again = encode_sealed(m)  # a version-2 manifest (a copy of one) is sealed by its own rule
    assert not again.startswith(SEAL_HEAD) and json.loads(again)["extra"][SEAL_KEY] != "0" * 16
    assert decode_manifest(again) == m


_SEALED: dict[str, bytes] = {}


def _sealed_bytes() -> bytes:
    if not _SEALED:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            reshard.save(_state(), Path(d) / "ck", step=3)
            _SEALED["raw"] = (Path(d) / "ck" / "manifest.json").read_bytes()
    return _SEALED["raw"]


@pytest.mark.parametrize("version", [3, 2])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_single_byte_change_is_refused_or_fails_to_decode(version: int, data: st.DataObject) -> None:
    """Version 3 (a save's manifest) and version 2 (tests/support/data/v2_checkpoint):
    a byte flipped anywhere, the seal's head included, never decodes."""
    raw = _sealed_bytes() if version == 3 else (V2 / "manifest.json").read_bytes()
    assert decode_manifest(raw).format_version == version
    i = data.draw(st.integers(0, len(raw) - 1))
    b = data.draw(st.integers(0, 255).filter(lambda v: v != raw[i]))
    bad = raw[:i] + bytes([b]) + raw[i + 1:]
    with pytest.raises(reshard.CheckpointError):
        decode_manifest(bad)


@pytest.mark.parametrize("dumps", [{}, {"indent": 2}, {"ensure_ascii": False, "indent": "\t"}],
                         ids=["spaces", "indent", "tab-indent-utf8"])
def test_a_manifest_sealed_by_another_json_writer_loads(tmp_path: Path, dumps: dict) -> None:
    """A writer that follows the rule of docs/on-disk-format.md with other
    JSON whitespace than ours (json.dumps' ", " and ": ", an indent): the
    head as written there, then its own JSON. It loads, and a changed value
    in it is still refused."""
    p = tmp_path / "ck"
    reshard.save({**_state(), "name": "h\u00e9llo \u65e5\u672c"}, p, step=1)
    doc = json.loads((p / "manifest.json").read_bytes())
    del doc[SEAL_KEY]
    body = json.dumps(doc, **dumps).encode()[1:]
    raw = b'{"manifest_xxh3_64":"' + xxhash.xxh3_64_hexdigest(body).encode() + b'",' + body
    (p / "manifest.json").write_bytes(raw)
    tgt = {**_target(), "name": None}
    res = reshard.load(tgt, p)
    assert res.values["sched"]["lr"] == 0.001 and res.values["name"] == "h\u00e9llo \u65e5\u672c"
    assert torch.equal(tgt["w"], _state()["w"])
    (p / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match=r"ck/manifest.json: manifest checksum mismatch"):
        reshard.load({**_target(), "name": None}, p)


@pytest.mark.parametrize("dumps", [{}, {"indent": 2}, {"ensure_ascii": False, "indent": "\t"}],
                         ids=["spaces", "indent", "tab-indent-utf8"])
def test_a_version_2_manifest_sealed_by_another_json_writer_loads(tmp_path: Path, dumps: dict) -> None:
    """Version 2's rule (xxh3_64 of the bytes as written, the value read as
    16 zeros) with other JSON whitespace than ours: it loads, and a changed
    value in it is still refused."""
    import re

    p = tmp_path / "ck"
    reshard.save({**_state(), "name": "h\u00e9llo \u65e5\u672c"}, p, step=1)
    doc = _v2_doc(json.loads((p / "manifest.json").read_bytes()))
    zeroed = json.dumps(doc, **dumps).encode()
    assert re.search(rb'"manifest_xxh3_64": "0{16}"', zeroed)  # not our compact token
    raw = zeroed.replace(b'"0000000000000000"', f'"{xxhash.xxh3_64_hexdigest(zeroed)}"'.encode())
    (p / "manifest.json").write_bytes(raw)
    tgt = {**_target(), "name": None}
    res = reshard.load(tgt, p)
    assert res.values["sched"]["lr"] == 0.001 and res.values["name"] == "h\u00e9llo \u65e5\u672c"
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


def test_a_user_value_holding_the_seal_text_is_still_sealed(tmp_path: Path) -> None:
    """User metadata holding the exact text of a seal (a copy of a manifest
    document: the head of version 3, the key and 16 zeros of version 2): the
    manifest is sealed, loads with the user's value intact, and a changed
    value is refused; so is a version-2 manifest of it (the placeholder's
    text occurs twice there: the seal is the last occurrence)."""
    nested = {"copied": {SEAL_KEY: "0" * 16}, "head": SEAL_HEAD.decode()}
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1, options=reshard.SaveOptions(extra=nested))
    raw = (p / "manifest.json").read_bytes()
    res = reshard.load(_target(), p)
    assert res.values["sched"]["lr"] == 0.001 and reshard.inspect(p).extra == nested
    (p / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        reshard.load(_target(), p)
    v2 = encode_sealed(msgspec.structs.replace(decode_manifest(raw), format_version=2))
    doc = json.loads(v2)
    assert "manifest-seal" in doc["required_features"] and doc["extra"][SEAL_KEY] != "0" * 16
    assert v2.count(b'"manifest_xxh3_64":"0000000000000000"') == 1  # the user's
    assert decode_manifest(v2).extra == nested
    with pytest.raises(IntegrityError, match="manifest checksum mismatch"):
        decode_manifest(v2.replace(b"0.001", b"0.002"))


def test_a_version_2_checkpoint_loads_and_verifies(tmp_path: Path) -> None:
    """tests/support/data/v2_checkpoint, written and signed by format version 2 (its
    seal in extra): it loads (with its HMAC key too; another key is
    refused), verify passes, a changed value is refused, and a copy keeps
    its version and seal rule."""
    ck = tmp_path / "v2"
    shutil.copytree(V2, ck)
    raw = (ck / "manifest.json").read_bytes()
    doc = json.loads(raw)
    assert doc["format_version"] == 2 and SEAL_KEY in doc["extra"] and not raw.startswith(SEAL_HEAD)
    for opts in (None, reshard.LoadOptions(hmac_key=V2_KEY)):
        tgt = _target()
        res = reshard.load(tgt, ck, options=opts)
        assert torch.equal(tgt["w"], _state()["w"]) and res.values["sched"] == {"lr": 0.001, "last_epoch": 7}
    with pytest.raises(IntegrityError, match="HMAC"):
        reshard.load(_target(), ck, options=reshard.LoadOptions(hmac_key=b"another"))
    assert reshard.verify(ck).ok
    assert reshard.inspect(ck).step == 2 and SEAL_KEY not in reshard.inspect(ck).extra
    from reshard.catalog.copy import copy_checkpoint

    copy_checkpoint(str(ck), str(tmp_path / "copy"), hmac_key=V2_KEY)
    copied = (tmp_path / "copy" / "manifest.json").read_bytes()
    assert json.loads(copied)["format_version"] == 2 and not copied.startswith(SEAL_HEAD)
    tgt = _target()
    reshard.load(tgt, tmp_path / "copy", options=reshard.LoadOptions(hmac_key=V2_KEY))
    assert torch.equal(tgt["w"], _state()["w"])
    (ck / "manifest.json").write_bytes(raw.replace(b"0.001", b"0.002"))
    with pytest.raises(IntegrityError, match=r"v2/manifest.json: manifest checksum mismatch.*extra"):
        reshard.load(_target(), ck)


def test_reseal_keeps_each_version_s_rule(tmp_path: Path) -> None:
    """``reseal`` of an edited document (as tools and the fault matrix write
    one): a version-3 document, dumped with any whitespace, gets the
    canonical head; a version-2 one its extra's seal; a document with no
    seal, or two in version 2's place, is a ValueError."""
    p = tmp_path / "ck"
    reshard.save(_state(), p, step=1)
    doc = json.loads((p / "manifest.json").read_bytes())
    doc["step"] = 9
    raw = reseal(json.dumps(doc).encode())
    assert raw.startswith(SEAL_HEAD) and decode_manifest(raw).step == 9
    assert raw[SEALED_FROM:] == json.dumps(doc).encode().split(b",", 1)[1]  # the rest as it was dumped
    v2 = _v2_doc(doc)
    raw2 = reseal(json.dumps(v2).encode())
    assert decode_manifest(raw2).step == 9 and decode_manifest(raw2).format_version == 2
    del doc[SEAL_KEY]
    with pytest.raises(ValueError, match="must be the first key of a version-3 manifest document"):
        reseal(json.dumps(doc).encode())
    with pytest.raises(ManifestError, match="begins with the seal of format version 3"):
        decode_manifest(reseal(json.dumps({SEAL_KEY: "", **doc, "format_version": 2}).encode()))
