"""Hostile inputs for :mod:`reshard.testing.fuzz`, derived from small valid ones.

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
import os
import pickle
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: file contents of a case: bytes, or ("symlink", target) / ("dir",)
FileSpec = bytes | tuple[str, ...]

MANIFEST = "manifest.json"
DCP_META = ".metadata"
HF_FILE = "model.safetensors"


@dataclass(frozen=True)
class Case:
    """One hostile input.

    Attributes:
        kind: "reshard" (a reshard checkpoint), "dcp" or "hf".
        desc: what was mutated (for reports and regression tests).
        files: file name -> contents of the checkpoint directory.
        data_only: only shard-file bytes changed (the manifest is the valid
            one), so a successful load must return the saved values exactly.
        family: the mutation's family without its random details (e.g.
            "manifest field set", "crafted pickle"): what ``reshard fuzz``
            totals time by.
    """

    kind: str
    desc: str
    files: dict[str, FileSpec]
    data_only: bool = False
    family: str = ""


# --------------------------------------------------------------------------- corpus


def base_state() -> dict[str, Any]:
    """The small state every reshard corpus checkpoint holds: a row-split
    float32 matrix, a ZeRO-style flat-range pair, bf16 and int64 replicas, a
    per-rank object and common values."""
    from ..sharding import ShardedObject, ShardedTensor

    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    z = torch.arange(8, dtype=torch.float64) / 3
    return {
        "w": [ShardedTensor("w", w[:2].clone(), global_shape=(4, 6), global_offset=(0, 0)),
              ShardedTensor("w", w[2:].clone(), global_shape=(4, 6), global_offset=(2, 0))],
        "z": [ShardedTensor("z", z[:3].clone(), global_shape=(2, 4), global_offset=(0, 0),
                            local_shape=(2, 4), flattened_range=slice(0, 3)),
              ShardedTensor("z", z[3:].clone(), global_shape=(2, 4), global_offset=(0, 0),
                            local_shape=(2, 4), flattened_range=slice(3, 8))],
        "b": torch.arange(5, dtype=torch.float32).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int64).reshape(3, 2),
        "rng": ShardedObject("rng", {"seed": 7, "state": [1, 2, 3]}, global_shape=(1,),
                             global_offset=(0,)),
        "meta": {"lr": 0.1, "name": "run", "t": (1, 2)},
    }


def target_state() -> dict[str, Any]:
    """A fresh target for loading the reshard corpus checkpoint (zeros)."""
    from ..sharding import ShardedObject

    return {"w": torch.zeros(4, 6), "z": torch.zeros(2, 4, dtype=torch.float64),
            "b": torch.zeros(5, dtype=torch.bfloat16), "i": torch.zeros(3, 2, dtype=torch.int64),
            "rng": ShardedObject("rng", None, global_shape=(1,), global_offset=(0,)),
            "meta": {"lr": 0.0, "name": "", "t": (0, 0)}}


def _expected() -> dict[str, torch.Tensor]:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {"w": w, "z": (torch.arange(8, dtype=torch.float64) / 3).reshape(2, 4),
            "b": torch.arange(5, dtype=torch.float32).to(torch.bfloat16),
            "i": torch.arange(6, dtype=torch.int64).reshape(3, 2)}


def _read_dir(d: str) -> dict[str, bytes]:
    out = {}
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            out[n] = f.read()
    return out


class Corpus:
    """Valid seed inputs, written once under ``workdir``: a reshard checkpoint
    (block checksums of 16 bytes, so chunks span several blocks), a DCP
    checkpoint of a similar state and a single-file safetensors directory."""

    def __init__(self, workdir: str):
        import safetensors.torch
        import torch.distributed.checkpoint as dcp

        from ..options import SaveOptions
        from ..save import save

        self.workdir = workdir
        seed = os.path.join(workdir, "seed")
        shutil.rmtree(seed, ignore_errors=True)
        os.makedirs(seed)
        rs = os.path.join(seed, "reshard")
        save(base_state(), rs, step=3, options=SaveOptions(checksum_block_bytes=16, durable=False))
        self.reshard = _read_dir(rs)
        self.manifest: dict[str, Any] = json.loads(self.reshard[MANIFEST])
        self.data_files = sorted(n for n in self.reshard if n != MANIFEST)
        dd = os.path.join(seed, "dcp")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
                      "b": torch.arange(5, dtype=torch.float32).to(torch.bfloat16), "n": 3},
                     checkpoint_id=dd, no_dist=True)
        self.dcp = _read_dir(dd)
        hd = os.path.join(seed, "hf")
        os.makedirs(hd)
        safetensors.torch.save_file({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
                                     "b": torch.arange(5, dtype=torch.float32).to(torch.bfloat16)},
                                    os.path.join(hd, HF_FILE))
        self.hf = _read_dir(hd)
        raw = self.hf[HF_FILE]
        (hlen,) = struct.unpack("<Q", raw[:8])
        self.hf_header_bytes = raw[8:8 + hlen]
        self.hf_header: dict[str, Any] = json.loads(self.hf_header_bytes)
        # every field's path, listed once (a fresh copy has the same ones)
        self.manifest_paths = list(_paths(self.manifest))
        self.hf_header_paths = list(_paths(self.hf_header))
        self.hf_data = raw[8 + hlen:]
        self.case_dir = os.path.join(workdir, "case")
        self.root_dir = os.path.join(workdir, "root")

    def fresh_manifest(self) -> dict[str, Any]:
        """A new copy of the seed manifest's dict (decoded again: faster than
        ``copy.deepcopy``)."""
        out: dict[str, Any] = json.loads(self.reshard[MANIFEST])
        return out


# --------------------------------------------------------------------------- hostile values

_HUGE = 2**60


def _deep(n: int) -> Any:
    """``n`` nested lists; past 100 levels a placeholder that :func:`_dumps`
    expands into the text (the stdlib encoder would recurse)."""
    if n > 30:
        return f"__DEEP_{n}__"
    x: Any = 0
    for _ in range(n):
        x = [x]
    return x


def _dumps(obj: Any, *, ensure_ascii: bool = True) -> bytes:
    """JSON text of ``obj`` with deep-nesting placeholders expanded."""
    import re

    text = json.dumps(obj, ensure_ascii=ensure_ascii)
    text = re.sub(r'"__DEEP_(\d+)__"', lambda mt: "[" * int(mt[1]) + "0" + "]" * int(mt[1]), text)
    return text.encode()


def _sealed(raw: bytes) -> bytes:
    """A mutated manifest document sealed again over its bytes, as a hostile
    writer (who can recompute it) would: the mutation reaches the validator,
    not only the seal; raw byte mutations of a sealed manifest (bit rot) meet
    the seal. Unchanged when the mutation removed or duplicated the seal."""
    from ..manifest import reseal

    try:
        return reseal(raw)
    except ValueError:
        return raw


def hostile_value(rng: random.Random) -> Any:
    """A JSON value chosen to break a parser or validator."""
    choices: list[Callable[[], Any]] = [
        lambda: _HUGE, lambda: -1, lambda: -(2**63), lambda: 2**64, lambda: 2**200, lambda: 0,
        lambda: rng.randint(-10, 100), lambda: 1.5, lambda: float("1e308"), lambda: True,
        lambda: None, lambda: "", lambda: "..", lambda: "../x", lambda: "/etc/passwd",
        lambda: "a\x00b", lambda: "é☃\U0001d11e", lambda: "x" * rng.choice([300, 70_000]),
        lambda: [], lambda: {}, lambda: [_HUGE, _HUGE], lambda: [-1, 2], lambda: [1, "a"],
        lambda: {"a": _deep(3)}, lambda: _deep(rng.choice([50, 400, 900, 5000])), lambda: [[]] * 3,
        lambda: "float8_e4m3", lambda: "complex64", lambda: "object", lambda: "int4",
        lambda: {"__class__": "os.system"}, lambda: list(range(40)),
    ]
    return rng.choice(choices)()


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


def _delete(obj: Any, path: tuple[Any, ...]) -> Any:
    if not path:
        return obj
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    del cur[path[-1]]
    return obj


def _bytes_mutation(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    n = len(raw)
    op = rng.randrange(7)
    if op == 0 or n == 0:
        k = rng.randrange(n + 1)
        return f"truncated to {k} bytes", raw[:k]
    if op == 1:
        i = rng.randrange(n)
        b = bytearray(raw)
        b[i] ^= 1 << rng.randrange(8)
        return f"bit flip at byte {i}", bytes(b)
    if op == 2:
        i = rng.randrange(n)
        ins = rng.choice([b"\x00", b"\xff\xfe", b"{", b"[" * 3000, rng.randbytes(rng.randrange(1, 64))])
        return f"{len(ins)} bytes inserted at {i}", raw[:i] + ins + raw[i:]
    if op == 3:
        i = rng.randrange(n)
        j = min(n, i + rng.randrange(1, 64))
        return f"bytes [{i}, {j}) randomized", raw[:i] + rng.randbytes(j - i) + raw[j:]
    if op == 4:
        return "extended by junk", raw + rng.randbytes(rng.randrange(1, 4096))
    if op == 5:
        return "emptied", b""
    i = rng.randrange(n)
    return f"byte {i} set to 0xff", raw[:i] + b"\xff" + raw[i + 1:]


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


def _reshard_case(rng: random.Random, c: Corpus) -> Case:
    files: dict[str, FileSpec] = dict(c.reshard)
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
