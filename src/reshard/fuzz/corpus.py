"""What the hostile inputs of :mod:`reshard.fuzz.cases` are made from: a :class:`Case`
(files, the target state, the expected error), the :class:`Corpus` of valid seeds (a real
``reshard.save`` checkpoint, a DCP directory, a safetensors file), and the mutations every
input shares (hostile values, paths into a JSON tree, byte flips, truncations, extensions).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
    #: read limits the case runs under (``RESHARD_LIMIT_<NAME>``), lowered so a
    #: size bomb past them stays small: ``{"field_bytes": 262144}``
    limits: dict[str, int] = field(default_factory=dict)


def base_state() -> dict[str, Any]:
    """The small state every reshard corpus checkpoint holds: a row-split
    float32 matrix, a ZeRO-style flat-range pair, bf16 and int64 replicas, a
    per-rank object and common values."""
    from ..state.sharding import ShardedObject, ShardedTensor

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
    from ..state.sharding import ShardedObject

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


# The seeds are the same bytes in every run and every worker directory: input
# i is derived from (seed, i) alone, and a byte mutation at an offset must
# meet the same field whatever the clock, the attempt id or the workdir's path
# were when the seed was written (a created_at one digit shorter moved every
# later offset: CI saw one input classified ManifestError in one process and
# IntegrityError in another).
PINNED_ATTEMPT_ID = "20260101T000000-00000000"
PINNED_CREATED_AT = 1767225600.0


def _pin_manifest(path: str) -> None:
    """Rewrite the seed manifest at ``path`` with the pinned attempt id and
    creation time, sealed again (the fields a save takes from the clock and
    a random source)."""
    from ..ondisk.manifest import reseal

    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc["attempt_id"], doc["created_at"] = PINNED_ATTEMPT_ID, PINNED_CREATED_AT
    with open(path, "wb") as f:
        f.write(reseal(json.dumps(doc, separators=(",", ":")).encode()))


def _pin_dcp_metadata(path: str) -> None:
    """Rewrite the seed DCP ``.metadata`` at ``path`` without its
    ``storage_meta`` (the checkpoint's path and a random save id). The file
    is the one DCP just wrote in this process: trusted, so the stdlib
    unpickler reads it (untrusted ones meet the restricted unpickler)."""
    import pickle

    with open(path, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - written just above by DCP itself
    md.storage_meta = None
    with open(path, "wb") as f:
        pickle.dump(md, f)


class Corpus:
    """Valid seed inputs, written once under ``workdir``: a reshard checkpoint
    (block checksums of 16 bytes, so chunks span several blocks), a DCP
    checkpoint of a similar state and a single-file safetensors directory."""

    def __init__(self, workdir: str):
        import safetensors.torch
        import torch.distributed.checkpoint as dcp

        from ..options import SaveOptions
        from ..saving.save import save

        self.workdir = workdir
        seed = os.path.join(workdir, "seed")
        shutil.rmtree(seed, ignore_errors=True)
        os.makedirs(seed)
        rs = os.path.join(seed, "reshard")
        save(base_state(), rs, step=3, options=SaveOptions(checksum_block_bytes=16, durable=False))
        _pin_manifest(os.path.join(rs, MANIFEST))
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
        _pin_dcp_metadata(os.path.join(dd, DCP_META))
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
    from ..ondisk.manifest import reseal

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
