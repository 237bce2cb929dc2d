"""Size bombs: hostile checkpoints whose cost grows with a field the reader
parses, for ``benchmarks/bench_hostile.py`` (the issue's inputs at full
size: a 200 MiB tensor name, a 500 MiB value string, 3M extra keys, a
1M-entry safetensors header) and, scaled down, for the fuzzer and the tests
(:func:`bomb_manifest`). Each is derived from a small valid checkpoint
(:func:`base_checkpoint`) and resealed, so only its size is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any

#: the fields :func:`bomb_manifest` can inflate, and how
FIELDS = ("tensor-name", "value-string", "extra-keys", "file-name", "attempt-id", "dtype-string",
          "checksums-list", "zero-chunks", "aliases", "mesh", "adapters", "lineage", "empty-tensors")


def base_checkpoint(d: str) -> dict[str, Any]:
    """Save a small valid checkpoint at ``d`` (``w`` 4x6 float32, a value)
    and return its manifest as a dict."""
    import torch

    from ..saving.save import save

    if os.path.exists(d):
        shutil.rmtree(d)
    save({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "meta": {"lr": 0.5}}, d, step=1)
    with open(os.path.join(d, "manifest.json"), "rb") as f:
        return dict(json.loads(f.read()))


def _sealed(doc: dict[str, Any]) -> bytes:
    from ..ondisk.manifest import reseal

    return reseal(json.dumps(doc, separators=(",", ":")).encode())


def bomb_manifest(doc: dict[str, Any], field: str, size: int, *, exact: bool = False) -> bytes:
    """The manifest ``doc`` with ``field`` (see :data:`FIELDS`) grown until the
    manifest is about ``size`` bytes (never more, for a field of many
    entries, unless ``exact``: then the count of entries is the one ``size``
    implies, e.g. ``13 * N`` for N extra keys), every other part consistent,
    resealed."""
    raw = _bomb(doc, field, size)
    if field in _COUNTED and len(raw) > size and not exact:  # entries cost more than guessed: scale down once
        base = len(_sealed(json.loads(json.dumps(doc))))
        raw = _bomb(doc, field, max(1, int(size * (size - base) / max(1, len(raw) - base)) - 4096))
    return raw


#: fields grown by a count of entries (their size per entry is a guess)
_COUNTED = ("extra-keys", "checksums-list", "zero-chunks", "aliases", "mesh", "adapters", "empty-tensors")


def _bomb(doc: dict[str, Any], field: str, size: int) -> bytes:
    m = json.loads(json.dumps(doc))
    (fqn, te), = [(k, v) for k, v in m["tensors"].items()][:1]
    if field == "tensor-name":
        big = "w" * size
        m["tensors"] = {big: te}
    elif field == "value-string":
        m["values"] = {**(m.get("values") or {}), "meta.note": "x" * size}
    elif field == "extra-keys":
        n = max(1, size // 13)
        m["extra"] = {**m.get("extra", {}), **{f"k{i:08d}": 0 for i in range(n)}}
    elif field == "file-name":
        old = te["chunks"][0]["file"]
        new = "f" * size
        m["files"] = {new if k == old else k: v for k, v in m["files"].items()}
        for c in te["chunks"]:
            c["file"] = new
    elif field == "attempt-id":
        m["attempt_id"] = "a" * size
    elif field == "dtype-string":
        te["dtype"] = "float32" + " " * size
    elif field == "checksums-list":
        te["chunks"][0]["checksums"] = ["0" * 16] * max(1, size // 19)
    elif field == "zero-chunks":  # chunk count the files cannot hold: empty boxes over and over
        c0 = dict(te["chunks"][0])
        zero = {**c0, "local_shape": [0] * len(c0["local_shape"]), "length": 0, "checksums": []}
        zero.pop("digest", None)
        zero.pop("block_index", None)
        te["chunks"] = [*te["chunks"], *[zero] * max(1, size // 120)]
    elif field == "aliases":
        m["aliases"] = {f"a{i:08d}": fqn for i in range(max(1, size // 20))}
    elif field == "mesh":
        m["mesh"] = {"dp": [0] * max(1, size // 2)}
    elif field == "adapters":
        m["adapters"] = {f"p{i:08d}": "tensors" for i in range(max(1, size // 22))}
    elif field == "lineage":
        m["lineage"] = "l" * size
    elif field == "empty-tensors":  # the most structure per byte: valid 0-element tensors
        f0 = te["chunks"][0]["file"]
        one = {"dtype": "float32", "global_shape": [0], "chunks": [
            {"global_offset": [0], "local_shape": [0], "file": f0, "offset": 0, "length": 0}]}
        m["tensors"].update({f"e{i:09d}": one for i in range(max(1, size // 125))})
    else:
        raise ValueError(f"unknown field {field!r} (one of {FIELDS})")
    return _sealed(m)


def write_bomb(d: str, base: dict[str, Any], files: dict[str, bytes], field: str, size: int, *,
               exact: bool = False) -> None:
    """A checkpoint directory ``d``: the base's data files and a bombed manifest."""
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    for name, raw in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(raw)
    raw = bomb_manifest(base, field, size, exact=exact)
    with open(os.path.join(d, "manifest.json"), "wb") as f:
        f.write(raw)


def hf_header_bomb(d: str, entries: int) -> int:
    """A Hugging Face directory ``d`` whose ``model.safetensors`` header lists
    ``entries`` one-element tensors (valid, tiling the data); returns the
    header's bytes."""
    os.makedirs(d, exist_ok=True)
    h = {f"model.layers.{i}.mlp.experts.{i % 256}.weight": {"dtype": "F32", "shape": [1],
                                                          "data_offsets": [4 * i, 4 * i + 4]}
         for i in range(entries)}
    raw = json.dumps(h, separators=(",", ":")).encode()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(b"\0" * (4 * entries))
    return len(raw)
