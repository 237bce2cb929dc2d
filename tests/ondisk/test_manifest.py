"""Manifest schema, codec and validation (reshard.ondisk.manifest)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from reshard.errors import IntegrityError, ManifestError
from reshard.ondisk.manifest import (
    FORMAT_VERSION,
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
    decode_manifest,
    encode_manifest,
    encode_sealed,
)

FILE = "data-r00000-0.safetensors"


def base() -> dict[str, Any]:
    """A small valid manifest: w float32 [2,3] in one chunk of 24 bytes at offset 8 of a
    32-byte file, checksummed in blocks of 16 bytes (two digests); one object; one alias."""
    return {
        "format": "reshard",
        "format_version": 1,
        "attempt_id": "20260101T000000-abcd",
        "created_at": 1700000000.5,
        "world_size": 2,
        "checksum_block_bytes": 16,
        "step": 7,
        "tensors": {
            "w": {
                "dtype": "float32",
                "global_shape": [2, 3],
                "chunks": [
                    {"global_offset": [0, 0], "local_shape": [2, 3], "file": FILE, "offset": 8,
                     "length": 24, "checksums": ["00000000000000aa", "00000000000000bb"]},
                ],
            }
        },
        "objects": {
            "rng": {"global_shape": [2], "chunks": [
                {"global_offset": [0], "file": FILE, "offset": 0, "length": 4},
                {"global_offset": [1], "file": FILE, "offset": 4, "length": 4},
            ]}
        },
        "values": {"lr": 0.5},
        "aliases": {"head.w": "w"},
        "files": {FILE: {"size": 32, "checksum": "1234"}},
    }


def dec(d: Any) -> Manifest:
    return decode_manifest(json.dumps(d).encode(), where="ck/manifest.json")


def test_valid_manifest_decodes() -> None:
    m = dec(base())
    assert m.format_version == 1 and FORMAT_VERSION == 3  # a version-1 manifest still decodes
    assert m.step == 7 and m.world_size == 2
    te = m.tensors["w"]
    assert te.dtype == "float32" and te.global_shape == (2, 3)
    (c,) = te.chunks
    assert (c.global_offset, c.local_shape, c.file, c.offset, c.length) == ((0, 0), (2, 3), FILE, 8, 24)
    assert c.flattened_range is None and c.numel == 6
    assert m.objects["rng"].global_shape == (2,)
    assert m.aliases == {"head.w": "w"}
    assert m.files[FILE] == FileEntry(size=32, checksum="1234")
    assert m.total_bytes == 32
    # encode -> decode is the identity
    assert decode_manifest(encode_manifest(m)) == m


def test_unknown_optional_fields_are_tolerated() -> None:
    d = base()
    d["future_top_level"] = {"anything": [1, 2]}
    d["tensors"]["w"]["layout_hint"] = "row"
    d["tensors"]["w"]["chunks"][0]["compression"] = None
    d["files"][FILE]["mtime"] = 5
    d["objects"]["rng"]["codec"] = "v2"
    assert dec(d) == dec(base())


def test_unknown_required_feature_is_refused() -> None:
    d = base()
    d["required_features"] = ["zstd-chunks"]
    with pytest.raises(ManifestError, match=r"unknown feature.*zstd-chunks") as ei:
        dec(d)
    assert "ck/manifest.json" in str(ei.value)


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 99, 0, -1])
def test_format_version_out_of_range_is_refused(version: int) -> None:
    d = base()
    d["format_version"] = version
    with pytest.raises(ManifestError, match=f"format_version {version} is not supported"):
        dec(d)


def test_other_format_is_refused() -> None:
    d = base()
    d["format"] = "torch-dcp"
    with pytest.raises(ManifestError, match="format is 'torch-dcp'"):
        dec(d)


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "..", ".", "", "manifest.json",
                                  "a\\b", "x\x00y", "/etc/passwd"])
def test_bad_file_names_are_refused(name: str) -> None:
    # in the file table
    d = base()
    d["files"][name] = {"size": 0}
    with pytest.raises(ManifestError, match="is not a plain file inside the checkpoint"):
        dec(d)
    # and as a chunk's file (not listed in the table)
    d = base()
    d["tensors"]["w"]["chunks"][0]["file"] = name
    with pytest.raises(ManifestError):
        dec(d)


def test_chunk_naming_unlisted_file_is_refused() -> None:
    d = base()
    d["tensors"]["w"]["chunks"][0]["file"] = "data-r00001-0.safetensors"
    with pytest.raises(ManifestError, match="does not list"):
        dec(d)


@pytest.mark.parametrize("dtype", ["complex32", "object", "float128", "F32", ""])
def test_dtype_not_on_allow_list(dtype: str) -> None:
    d = base()
    d["tensors"]["w"]["dtype"] = dtype
    with pytest.raises(ManifestError, match=f"dtype '{dtype}' is not on the allow-list"):
        dec(d)


def test_chunk_past_file_end_is_integrity_error() -> None:
    d = base()
    d["tensors"]["w"]["chunks"][0]["offset"] = 9  # [9, 33) in a 32-byte file
    with pytest.raises(IntegrityError, match=r"bytes \[9, 33\) reach past the declared size 32"):
        dec(d)
    d = base()
    d["files"][FILE]["size"] = 31
    with pytest.raises(IntegrityError, match="reach past"):
        dec(d)
    d = base()
    d["objects"]["rng"]["chunks"][1]["length"] = 40
    with pytest.raises(IntegrityError, match="reach past"):
        dec(d)


def test_negative_offset_is_integrity_error() -> None:
    d = base()
    d["objects"]["rng"]["chunks"][0]["offset"] = -4
    with pytest.raises(IntegrityError):
        dec(d)


def test_chunk_length_inconsistent_with_shape() -> None:
    d = base()
    d["tensors"]["w"]["chunks"][0]["length"] = 20
    with pytest.raises(IntegrityError, match="declared length 20 bytes, but 6 elements of float32 need 24"):
        dec(d)
    d = base()
    d["tensors"]["w"]["dtype"] = "float64"  # 6 x 8 = 48 bytes, 24 declared
    with pytest.raises(IntegrityError, match="need 48"):
        dec(d)


def test_global_shape_larger_than_chunks_is_integrity_error() -> None:
    d = base()
    d["tensors"]["w"]["global_shape"] = [4, 3]
    with pytest.raises(IntegrityError, match=r"chunks hold 6 elements, global_shape \[4, 3\] needs 12"):
        dec(d)


def test_huge_or_negative_shape_is_refused() -> None:
    d = base()
    d["tensors"]["w"]["global_shape"] = [2**60, 3]
    with pytest.raises(ManifestError, match="out of range"):
        dec(d)
    d = base()
    d["tensors"]["w"]["global_shape"] = [-2, 3]
    with pytest.raises(ManifestError, match="out of range"):
        dec(d)


def test_chunk_box_outside_global_shape() -> None:
    d = base()
    d["tensors"]["w"]["chunks"][0]["global_offset"] = [1, 0]
    with pytest.raises(ManifestError, match="lies outside global_shape"):
        dec(d)
    d = base()
    d["tensors"]["w"]["chunks"][0]["global_offset"] = [0, 0, 0]
    with pytest.raises(ManifestError, match="rank differs"):
        dec(d)


def test_flattened_range_outside_box() -> None:
    d = base()
    c = d["tensors"]["w"]["chunks"][0]
    c["flattened_range"] = [2, 8]  # 6 elements = 24 bytes, but the box has 6 elements
    with pytest.raises(ManifestError, match="flattened_range 2:8 outside its box"):
        dec(d)
    c["flattened_range"] = [0, 6]
    assert dec(d).tensors["w"].chunks[0].flattened_range == (0, 6)


def test_checksum_count_must_match_blocks() -> None:
    d = base()
    d["tensors"]["w"]["chunks"][0]["checksums"] = ["00000000000000aa"]
    with pytest.raises(ManifestError, match="1 checksums for 24 bytes in blocks of 16"):
        dec(d)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(checksum_block_bytes=0), "checksum_block_bytes must be positive"),
        (lambda d: d.update(checksum_algorithm="md5"), "unknown checksum_algorithm 'md5'"),
        (lambda d: d["files"][FILE].update(size=-1), "negative size"),
        (lambda d: d["objects"]["rng"]["chunks"][1].update(global_offset=[2]), "outside its grid"),
        (lambda d: d.update(aliases={"head.w": "nope"}), "unknown tensor 'nope'"),
        (lambda d: d["objects"]["rng"]["chunks"].pop(), r"object 'rng': 1 records of 1 distinct elements "
                                                         r"for a grid \[2\] of 2"),
        (lambda d: d["objects"]["rng"]["chunks"][1].update(global_offset=[0]), "2 records of 1 distinct"),
        (lambda d: d.update(values=[1, 2]), "values must be an object, got list"),
        (lambda d: d.update(world_size="two"), "invalid manifest"),
        (lambda d: d.pop("attempt_id"), "invalid manifest"),
        (lambda d: d["tensors"]["w"].pop("chunks"), "invalid manifest"),
    ],
)
def test_schema_violations(mutate, needle: str) -> None:
    d = base()
    mutate(d)
    with pytest.raises(ManifestError, match=needle):
        dec(d)


@pytest.mark.parametrize("raw", [b"", b"not json", b"\x80\x04K\x01.", b"[1, 2]", b"null",
                                 b'{"format": "reshard"'])
def test_not_a_manifest(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="invalid manifest"):
        decode_manifest(raw)


def test_base_is_not_mutated_by_helpers() -> None:
    a = base()
    b = copy.deepcopy(a)
    dec(a)
    assert a == b


def test_100k_chunks_decode_and_validate() -> None:
    n = 100_000
    isz = 2
    header = 8
    chunks = tuple(
        Chunk(global_offset=(i // 100, i % 100), local_shape=(1, 1), file=f"data-r{i % 8:05d}-0.safetensors",
              offset=header + (i // 8) * isz, length=isz, checksums=(f"{i:016x}",))
        for i in range(n)
    )
    files = {f"data-r{r:05d}-0.safetensors": FileEntry(size=header + (n // 8) * isz) for r in range(8)}
    m = Manifest(attempt_id="x", created_at=0.0, world_size=8, checksum_block_bytes=1 << 20,
                 tensors={"emb": TensorEntry(dtype="bfloat16", global_shape=(1000, 100), chunks=chunks)},
                 files=files)
    raw = encode_sealed(m)
    out = decode_manifest(raw)
    assert out == m
    got = out.tensors["emb"].chunks
    assert len(got) == n
    assert got[12345] == Chunk(global_offset=(123, 45), local_shape=(1, 1), file="data-r00001-0.safetensors",
                               offset=header + (12345 // 8) * 2, length=2, checksums=(f"{12345:016x}",))
    # one bad chunk among 100k is still found
    bad = list(chunks)
    bad[99_999] = Chunk(global_offset=(999, 99), local_shape=(1, 1), file="data-r00007-0.safetensors",
                        offset=header + (n // 8) * isz, length=2, checksums=("0" * 16,))
    m2 = Manifest(attempt_id="x", created_at=0.0, world_size=8, checksum_block_bytes=1 << 20,
                  tensors={"emb": TensorEntry(dtype="bfloat16", global_shape=(1000, 100), chunks=tuple(bad))},
                  files=files)
    with pytest.raises(IntegrityError, match=r"chunk at \[999, 99\]"):
        decode_manifest(encode_sealed(m2))


@pytest.mark.parametrize("ws", [0, -1, 2**40])
def test_world_size_outside_any_job_is_refused(ws: int) -> None:
    m = base()
    m["world_size"] = ws
    with pytest.raises(ManifestError, match=rf"world_size {ws} is outside \[1, 16777216\]"):
        dec(m)


@pytest.mark.parametrize("alias", ["w", "rng"])
def test_alias_that_is_also_a_saved_name_is_refused(alias: str) -> None:
    """An alias may not shadow a saved tensor or object: which of the two a
    load would fill is not defined."""
    m = base()
    m["aliases"] = {alias: "w"}
    with pytest.raises(ManifestError, match=f"alias '{alias}' is also the name of a saved"):
        dec(m)
