"""Hostile inputs for :mod:`reshard.fuzz.runner`, derived from small valid ones.

:class:`Corpus` writes one valid example of each untrusted input (a real
``reshard.save`` checkpoint, a ``torch.distributed.checkpoint`` directory and a
``safetensors`` file); :func:`generate` derives one hostile :class:`Case` from
it with a :class:`random.Random` (reproducible from its seed): manifests
mutated field by field (shapes of 2^60 elements, negative offsets,
overlapping chunks, ranges past the end of a file, dtypes outside the
allow-list, names with ``..``, absolute paths, NUL bytes, unicode, huge
strings, deep nesting, wrong types, removed and unknown fields), shard files
truncated / flipped / extended / replaced by links or directories, DCP
``.metadata`` pickles of torch's records with hostile fields, crafted pickles
(forbidden globals, huge declared lengths, deep nesting), and safetensors
headers with hostile fields and length prefixes.
"""

from __future__ import annotations

import json
import pickle
import random
import struct
from typing import Any

import torch

from .corpus import (
    DCP_META,
    HF_FILE,
    MANIFEST,
    Case,
    Corpus,
    FileSpec,
    _bytes_mutation,
    _deep,
    _delete,
    _dumps,
    _sealed,
    _set,
    hostile_value,
)

# --------------------------------------------------------------------------- reshard cases


def _chunk_paths(m: dict[str, Any]) -> list[tuple[str, int]]:
    return [(fqn, i) for fqn, te in m["tensors"].items() for i in range(len(te["chunks"]))]


#: the families of :func:`_semantic`'s mutations, by op
SEMANTIC_FAMILIES = (
    "2^60 elements", "negative offset", "overlapping chunks", "range past the file end",
    "dtype outside the allow-list", "hostile file name", "length disagrees", "checksums replaced",
    "global_shape replaced", "flattened_range replaced", "file size replaced",
    "checksum_block_bytes replaced", "unknown required feature", "values replaced",
    "object chunk field replaced", "aliases replaced")


def _semantic(rng: random.Random, m: dict[str, Any], c: Corpus) -> tuple[str, str]:
    """Apply one meaning-aware mutation of the manifest dict; returns its
    family and description."""
    op = rng.randrange(16)
    return SEMANTIC_FAMILIES[op], _semantic_op(op, rng, m, c)


def _semantic_op(op: int, rng: random.Random, m: dict[str, Any], c: Corpus) -> str:
    fqn, ci = rng.choice(_chunk_paths(m))
    te = m["tensors"][fqn]
    ch = te["chunks"][ci]
    f0 = c.data_files[0]
    if op == 0:  # 2^60 elements, declared consistently (shape, chunk box, byte length)
        te["global_shape"] = [2**30, 2**30]
        te["chunks"] = [{**ch, "global_offset": [0, 0], "local_shape": [2**30, 2**30],
                         "length": 2**60 * 4, "checksums": []}]
        te["dtype"] = "float32"
        return f"{fqn}: 2^60-element tensor declared consistently"
    if op == 1:
        ch["offset"] = rng.choice([-1, -(2**40), -ch["length"]])
        return f"{fqn}[{ci}]: negative offset"
    if op == 2:  # overlapping chunks
        if len(te["chunks"]) > 1:
            other = te["chunks"][(ci + 1) % len(te["chunks"])]
            ch["global_offset"] = list(other["global_offset"])
            if "flattened_range" in other:
                ch["flattened_range"] = list(other["flattened_range"])
            return f"{fqn}[{ci}]: overlaps another chunk"
        ch["global_offset"] = [1] * len(ch["global_offset"])
        return f"{fqn}[{ci}]: box shifted out of place"
    if op == 3:
        size = m["files"][ch["file"]]["size"]
        ch["offset"] = size - rng.randrange(0, max(1, ch["length"]))
        return f"{fqn}[{ci}]: byte range past the end of its file"
    if op == 4:
        te["dtype"] = rng.choice(["complex64", "object", "float8_e4m3", "str", "int4", "", "FLOAT32"])
        return f"{fqn}: dtype outside the allow-list"
    if op == 5:  # a hostile file name, consistently in files{} and the chunk
        bad = rng.choice(["../x", "..", "/etc/passwd", "a/b", "a\\b", "a\x00b", ".hidden",
                          "é☃\U0001d11e", "x" * 5000, MANIFEST, ".", " "])
        m["files"][bad] = m["files"].pop(ch["file"], {"size": 0})
        for te2 in m["tensors"].values():
            for c2 in te2["chunks"]:
                if c2["file"] == ch["file"]:
                    c2["file"] = bad
        return f"file renamed to {bad[:40]!r}"
    if op == 6:
        ch["length"] = ch["length"] + rng.choice([-1, 1, 4, -4, 2**62])
        return f"{fqn}[{ci}]: length disagrees with shape"
    if op == 7:
        ch["checksums"] = rng.choice([[], ["0" * 16] * len(ch.get("checksums", [1])),
                                      list(reversed(ch.get("checksums", []))), ["zz"] * 9999])
        return f"{fqn}[{ci}]: checksums replaced"
    if op == 8:
        te["global_shape"] = [rng.choice([0, 1, 2**49, 2**63, -1]) for _ in te["global_shape"]]
        return f"{fqn}: global_shape replaced"
    if op == 9:
        if "flattened_range" in ch:
            ch["flattened_range"] = rng.choice([[5, 2], [-1, 3], [0, 2**60], [0], [0, 1, 2]])
        else:
            ch["flattened_range"] = [0, 1]
        return f"{fqn}[{ci}]: flattened_range replaced"
    if op == 10:
        m["files"][f0]["size"] = rng.choice([0, -1, 2**62, m["files"][f0]["size"] + 1])
        return "declared file size replaced"
    if op == 11:
        m["checksum_block_bytes"] = rng.choice([0, -1, 1, 2**62, 3])
        return "checksum_block_bytes replaced"
    if op == 12:
        m["required_features"] = rng.choice([["time-travel"], [""], [1]])
        return "unknown required feature"
    if op == 13:  # the values are decoded by the codec: hostile encodings
        m["values"] = {"meta.lr": rng.choice([{"__t": "bogus"}, {"t": "tuple", "v": _deep(40)},
                                              hostile_value(rng), [[{}]], {"$": None}])}
        return "common values replaced"
    if op == 14:
        obj = next(iter(m["objects"].values()))
        oc = obj["chunks"][0]
        key = rng.choice(["offset", "length", "global_offset", "file"])
        oc[key] = hostile_value(rng)
        return f"object chunk {key} replaced"
    m["aliases"] = {rng.choice(["w", "x", ""]): rng.choice(["nope", "w", "b"])}
    return "aliases replaced"


#: lowered read limits the size bombs run under (so one past a limit stays a few MiB)
BOMB_LIMITS = {"name_bytes": 16 << 10, "field_bytes": 256 << 10, "manifest_bytes": 1 << 20,
               "header_bytes": 256 << 10, "dcp_metadata_bytes": 256 << 10}


def _bomb_case(rng: random.Random, c: Corpus) -> Case:
    """A size bomb in one parsed field of the manifest (every field of
    :data:`reshard.fuzz.hostile.FIELDS`), sized from half to three times
    the limit that governs it (lowered: :data:`BOMB_LIMITS`): below it, it
    must parse in bounded time and memory; past it, be refused before
    parsing."""
    from .hostile import FIELDS, bomb_manifest

    fld = rng.choice(FIELDS)
    limit = {"tensor-name": "name_bytes", "file-name": "name_bytes", "attempt-id": "name_bytes",
             "lineage": "name_bytes", "dtype-string": "name_bytes", "empty-tensors": "manifest_bytes",
             "zero-chunks": "manifest_bytes", "checksums-list": "manifest_bytes"}.get(fld, "field_bytes")
    size = int(BOMB_LIMITS[limit] * rng.choice([0.5, 0.9, 1.1, 2.0, 3.0]))
    files: dict[str, FileSpec] = dict(c.reshard)
    files[MANIFEST] = bomb_manifest(c.fresh_manifest(), fld, size)
    return Case("reshard", f"size bomb: {fld} of {size} bytes ({limit} {BOMB_LIMITS[limit]})", files,
                family=f"size bomb: {fld}", limits=dict(BOMB_LIMITS))


def _reshard_case(rng: random.Random, c: Corpus) -> Case:
    files: dict[str, FileSpec] = dict(c.reshard)
    if rng.random() < 0.05:
        return _bomb_case(rng, c)
    op = rng.randrange(10)
    if op <= 2:  # one field set to a hostile value
        m = c.fresh_manifest()
        paths = c.manifest_paths
        p = rng.choice(paths[1:])
        v = hostile_value(rng)
        _set(m, p, v)
        files[MANIFEST] = _sealed(_dumps(m))
        return Case("reshard", f"manifest field {list(p)} = {repr(v)[:60]}", files,
                    family="manifest field set")
    if op == 3:  # a field removed, or an unknown one added
        m = c.fresh_manifest()
        paths = c.manifest_paths
        p = rng.choice(paths[1:])
        if rng.random() < 0.7:
            _delete(m, p)
            desc, fam = f"manifest field {list(p)} removed", "manifest field removed"
        else:
            parent = p[:-1]
            cur = m
            for q in parent:
                cur = cur[q]
            if isinstance(cur, dict):
                cur["unknown_" + str(rng.randrange(9))] = hostile_value(rng)
            desc, fam = f"unknown field added under {list(parent)}", "manifest field added"
        files[MANIFEST] = _sealed(_dumps(m))
        return Case("reshard", desc, files, family=fam)
    if op <= 5:  # meaning-aware
        m = c.fresh_manifest()
        fam, desc = _semantic(rng, m, c)
        files[MANIFEST] = _sealed(_dumps(m, ensure_ascii=rng.random() < 0.5))
        return Case("reshard", desc, files, family=f"manifest {fam}")
    if op == 6:  # raw manifest bytes
        desc, raw = _bytes_mutation(rng, c.reshard[MANIFEST])
        files[MANIFEST] = raw
        return Case("reshard", f"manifest {desc}", files, family="manifest bytes")
    if op == 7:  # raw shard-file bytes, manifest intact
        name = rng.choice(c.data_files)
        desc, raw = _bytes_mutation(rng, c.reshard[name])
        files[name] = raw
        return Case("reshard", f"{name} {desc}", files, data_only=True,
                    family="shard-file bytes")
    if op == 8:  # file-system shapes: links, directories, missing files
        name = rng.choice([*c.data_files, MANIFEST])
        kind = rng.randrange(4)
        if kind == 0:
            files[name] = ("symlink", "/etc/hostname" if rng.random() < 0.5 else "../" + name)
            return Case("reshard", f"{name} is a symbolic link", files, family="symbolic link")
        if kind == 1:
            files[name] = ("dir",)
            return Case("reshard", f"{name} is a directory", files, family="directory")
        if kind == 2:
            del files[name]
            return Case("reshard", f"{name} missing", files, family="missing file")
        files["extra.bin"] = rng.randbytes(32)
        return Case("reshard", "an extra file in the checkpoint", files, data_only=True,
                    family="extra file")
    # a JSON document of the wrong shape altogether
    doc = rng.choice([[], 0, "manifest", None, _deep(rng.choice([100, 20000])),
                      {"format": "reshard"}, {"a" * 100_000: 1}])
    files[MANIFEST] = _dumps(doc)
    return Case("reshard", f"manifest is {repr(doc)[:40]}", files, family="manifest of another shape")


# --------------------------------------------------------------------------- DCP cases


def _dcp_metadata(rng: random.Random) -> bytes:
    """A pickle of torch's own DCP records with one hostile field."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    size: Any = [4, 6]
    offsets: Any = [0, 0]
    sizes: Any = [4, 6]
    rel, off, length = "__0_0.distcp", 0, 96
    dtype = torch.float32
    op = rng.randrange(10)
    v = hostile_value(rng)
    if op == 0:
        size = [2**30, 2**30]
        sizes = [2**30, 2**30]
        length = 2**62
    elif op == 1:
        offsets = [-1, 0] if rng.random() < 0.5 else [v, 0]
    elif op == 2:
        rel = rng.choice(["../x", "/etc/passwd", "a/../../b", "", "a\x00b", ".metadata"])
    elif op == 3:
        off, length = rng.choice([(-5, 10), (10**9, 96), (0, 2**62), (0, -1)])
    elif op == 4:
        dtype = rng.choice([torch.complex64, torch.bool, torch.float8_e4m3fn, torch.quint8])
    elif op == 5:
        sizes = [5, 6]
    elif op == 6:
        size = v if isinstance(v, list) else [v, 6]
    elif op == 7:
        rel = v
    props = TensorProperties(dtype=dtype)
    # records with any contents, as a crafted pickle can hold (not only torch.Size)
    chunk: Any = ChunkStorageMetadata(offsets=torch.Size(offsets) if all(type(x) is int and x >= 0
                                                                   for x in offsets) else offsets,
                                 sizes=torch.Size(sizes))
    tsm = TensorStorageMetadata(properties=props,
                                size=torch.Size(size) if isinstance(size, list) and all(
                                    type(x) is int and x >= 0 for x in size) else size,
                                chunks=[chunk])
    sdm: dict[str, Any] = {"w": tsm}
    index = MetadataIndex("w", [0, 0], 0)
    idx_off: Any = tuple(offsets)
    try:
        hash(idx_off)
    except TypeError:
        idx_off = ("unhashable",)
    object.__setattr__(index, "offset", idx_off)  # records with any contents, as a pickle can hold
    storage: dict[Any, Any] = {index: _StorageInfo(relative_path=rel, offset=off, length=length)}
    if op == 8:
        sdm["n"] = BytesStorageMetadata()
        storage[MetadataIndex("n")] = _StorageInfo(relative_path="__0_0.distcp", offset=96,
                                                   length=rng.choice([10, 0, 10**6]))
    if op == 9:
        sdm = {"w": v}
    md = Metadata(state_dict_metadata=sdm, storage_data=storage)
    return pickle.dumps(md, protocol=rng.choice([2, 4, 5]))


_EVIL_PICKLES = [
    b"cos\nsystem\n(S'echo pwned'\ntR.",
    b"cbuiltins\neval\n(S'1+1'\ntR.",
    b"ctorch._utils\n_rebuild_tensor\n(tR.",
    b"cbuiltins\ngetattr\n(cbuiltins\nobject\nS'__subclasses__'\ntR.",
    b"(" * 100_000 + b".",
    b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\x7f.",   # frame of 2^63 bytes
    b"X\xff\xff\xff\x7f",                                  # BINUNICODE of 2 GiB declared
    b"\x80\x02]q\x00(K\x01h\x00e.",                        # a list containing itself
    b"P0\n.",                                              # persistent id
    b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}b.",
]


def _deep_metadata_pickle(depth: int, field: str = "state_dict_metadata") -> bytes:
    """A DCP ``Metadata`` pickle whose ``field`` holds ``{"w": <lists nested depth deep>}``,
    built from opcodes (the pickler itself would recurse)."""
    name = field.encode()
    deep = b"]" * depth + b"a" * (depth - 1)
    return (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}"
            + b"X" + struct.pack("<I", len(name)) + name + b"}X\x01\x00\x00\x00w" + deep
            + b"ssb.")


def _dcp_case(rng: random.Random, c: Corpus) -> Case:
    files: dict[str, FileSpec] = dict(c.dcp)
    if rng.random() < 0.05:  # a size bomb: the .metadata grown past its (lowered) limit, or just under
        size = int(BOMB_LIMITS["dcp_metadata_bytes"] * rng.choice([0.5, 0.9, 1.1, 2.0]))
        files[DCP_META] = c.dcp[DCP_META] + b"\0" * max(0, size - len(c.dcp[DCP_META]))
        return Case("dcp", f"size bomb: .metadata of {size} bytes", files,
                    family="size bomb: .metadata", limits=dict(BOMB_LIMITS))
    op = rng.randrange(5)
    if op <= 1:
        files[DCP_META] = _dcp_metadata(rng)
        return Case("dcp", "hostile DCP records", files, family="hostile records")
    if op == 2:
        desc, raw = _bytes_mutation(rng, c.dcp[DCP_META])
        files[DCP_META] = raw
        return Case("dcp", f".metadata {desc}", files, family=".metadata bytes")
    if op == 3 and rng.random() < 0.3:
        depth = rng.choice([50, 900, 5000, 100_000])
        fld = rng.choice(["state_dict_metadata", "storage_data", "planner_data"])
        files[DCP_META] = _deep_metadata_pickle(depth, fld)
        return Case("dcp", f".metadata {fld} nested {depth} deep", files,
                    family=".metadata nested deep")
    if op == 3:
        evil = rng.choice(_EVIL_PICKLES)
        files[DCP_META] = evil
        return Case("dcp", f".metadata is a crafted pickle {evil[:30]!r}", files,
                    family="crafted pickle")
    data = [n for n in c.dcp if n != DCP_META]
    name = rng.choice(data)
    desc, raw = _bytes_mutation(rng, c.dcp[name])
    files[name] = raw
    return Case("dcp", f"{name} {desc}", files, family=".distcp bytes")


# --------------------------------------------------------------------------- HF cases


def _hf_file(header: Any, data: bytes, *, hlen: int | None = None) -> bytes:
    h = _dumps(header) if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


def _hf_case(rng: random.Random, c: Corpus) -> Case:
    h = json.loads(c.hf_header_bytes)
    data = c.hf_data
    if rng.random() < 0.05:  # a size bomb: many valid entries, half to three times the header limit
        n = int(BOMB_LIMITS["header_bytes"] * rng.choice([0.5, 0.9, 1.1, 2.0, 3.0]) / 98)
        big = {f"model.layers.{i}.mlp.experts.{i % 256}.weight": {
            "dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
        return Case("hf", f"size bomb: a header of {n} entries", {HF_FILE: _hf_file(big, b"\0" * (4 * n))},
                    family="size bomb: header entries", limits=dict(BOMB_LIMITS))
    op = rng.randrange(8)
    names = [k for k in h if k != "__metadata__"]
    t = rng.choice(names)
    if op == 0:
        p = rng.choice(c.hf_header_paths[1:])
        v = hostile_value(rng)
        _set(h, p, v)
        return Case("hf", f"header field {list(p)} = {repr(v)[:60]}", {HF_FILE: _hf_file(h, data)},
                    family="header field set")
    if op == 1:
        h[t]["shape"] = [2**30, 2**30]
        h[t]["data_offsets"] = [0, 2**62]
        return Case("hf", f"{t}: 2^60 elements declared", {HF_FILE: _hf_file(h, data)},
                    family="2^60 elements")
    if op == 2:
        h[t]["data_offsets"] = rng.choice([[-8, 8], [0, len(data) + 8], [8, 4], [0, 0], [0]])
        return Case("hf", f"{t}: data_offsets replaced", {HF_FILE: _hf_file(h, data)},
                    family="data_offsets replaced")
    if op == 3:
        other = rng.choice(names)
        h[t]["data_offsets"] = list(h[other]["data_offsets"])
        return Case("hf", f"{t}: overlaps {other}", {HF_FILE: _hf_file(h, data)},
                    family="overlapping tensors")
    if op == 4:
        hlen = rng.choice([0, 2**64 - 1, 2**40, len(json.dumps(h)) + 5, 7])
        return Case("hf", f"header length prefix {hlen}", {HF_FILE: _hf_file(h, data, hlen=hlen)},
                    family="header length prefix")
    if op == 5:
        h[t]["dtype"] = rng.choice(["C64", "F8_E4M3", "Q4", "", "BOOL", "U16"])
        return Case("hf", f"{t}: dtype replaced", {HF_FILE: _hf_file(h, data)},
                    family="dtype replaced")
    if op == 6:  # an index naming hostile files
        bad = rng.choice(["../model.safetensors", "/etc/passwd", "a\x00b", "missing.safetensors",
                          "model.safetensors.index.json"])
        idx = {"weight_map": {t: bad}}
        return Case("hf", f"index maps {t} to {bad!r}",
                    {"model.safetensors.index.json": json.dumps(idx).encode(),
                     HF_FILE: _hf_file(h, data)}, family="hostile index")
    desc, raw = _bytes_mutation(rng, c.hf[HF_FILE])
    return Case("hf", f"safetensors file {desc}", {HF_FILE: raw}, family="file bytes")


def generate(rng: random.Random, corpus: Corpus) -> Case:
    """One hostile input (reshard checkpoints 60%, DCP 20%, HF 20%)."""
    r = rng.random()
    if r < 0.6:
        return _reshard_case(rng, corpus)
    if r < 0.8:
        return _dcp_case(rng, corpus)
    return _hf_case(rng, corpus)
