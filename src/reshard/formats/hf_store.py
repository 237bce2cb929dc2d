"""Hugging Face export to an object store (``s3://``, ``memory://``).

:func:`reshard.formats.hf_export.export_hf` hands its planned shards here when
``out_dir`` is such a URL. Each shard streams into the store
(:meth:`Storage.open_write`: a multipart upload on S3, so at most
``READ_BLOCK_BYTES`` of tensor data plus the upload's in-flight parts are
in memory), is validated by reading its header and data back with ranged
reads, and the index is written last. An object becomes visible only when
its upload completes, so a reader never sees a partial shard.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash

from ..collectives import SingleProcess
from ..errors import ManifestError
from ..ondisk.manifest import Manifest
from ..options import LoadOptions
from ..state.sharding import safetensors_code
from ..storage import Storage

#: the file names of a Hugging Face safetensors directory (one file, or shards and an index)
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RX = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_VALIDATE_BLOCK = 4 << 20


def write_shards(st: Storage, key: str, m: Manifest, out_st: Storage, out: str,
                 files: Sequence[str], shards: Sequence[list[Any]], *, opts: LoadOptions,
                 validate: bool, overwrite: bool, copies: Sequence[str],
                 index: Any, tied: Mapping[str, str] | None = None,
                 payload: Callable[[str], bytes | None] | None = None,
                 ) -> tuple[int, dict[str, str], list[str]]:
    """Write ``shards`` as ``files`` under ``out`` of ``out_st``; then the
    copied files (``payload(path)``: the bytes to write instead of the file's
    own, or None) and (``index(weight_map)`` -> bytes or None) the index.
    ``tied`` (alias -> target, the tied weights left out) is recorded in every
    shard's ``__metadata__``, as the local export does.

    Returns ``(bytes written, weight map, names copied)``.

    Raises:
        FileExistsError: model files already there and not ``overwrite``.
        ManifestError: a shard reads back differently from what was written.
    """
    try:
        present = out_st.list_dir(out)
    except (FileNotFoundError, NotADirectoryError):
        present = []
    stale = [n for n in present if n in (SINGLE_NAME, INDEX_NAME) or _SHARD_RX.match(n)]
    if stale and not overwrite:
        raise FileExistsError(f"{out}: already holds model files {stale[:3]} (pass overwrite=True)")
    out_st.makedirs(out)
    one = SingleProcess()
    written = 0
    weight_map: dict[str, str] = {}
    for fname, shard in zip(files, shards, strict=True):
        written += _write_shard(st, key, m, out_st, out_st.join(out, fname), shard, opts, one,
                                validate, tied)
        for it in shard:
            weight_map[it.out] = fname
    for name in stale:
        if name not in files and name != INDEX_NAME:
            out_st.delete_tree(out_st.join(out, name))
    copied = []
    for c in copies:
        body = payload(c) if payload is not None else None
        if body is not None:
            out_st.write_bytes(out_st.join(out, os.path.basename(c)), body)
            copied.append(os.path.basename(c))
            continue
        with open(c, "rb") as f:
            s = out_st.open_write(out_st.join(out, os.path.basename(c)))
            try:
                while chunk := f.read(_VALIDATE_BLOCK):
                    s.write(chunk)
            except BaseException:
                s.abort()
                raise
            s.close()
        copied.append(os.path.basename(c))
    body = index(weight_map)
    if body is not None:
        out_st.write_bytes(out_st.join(out, INDEX_NAME), body)
    elif INDEX_NAME in stale:
        out_st.delete_tree(out_st.join(out, INDEX_NAME))
    return written, weight_map, copied


def _write_shard(st: Storage, key: str, m: Manifest, out_st: Storage, path: str,
                 shard: list[Any], opts: LoadOptions, one: SingleProcess, validate: bool,
                 tied: Mapping[str, str] | None = None) -> int:
    from .hf_write import _header, _stream_items

    prefix, order = _header(shard, tied)
    s = out_st.open_write(path)
    try:
        s.write(prefix)
        total, digests = _stream_items(st, key, m, order, opts, one, s.write)
        total += len(prefix)
    except BaseException:
        s.abort()
        raise
    s.close()
    if validate:
        _validate(out_st, path, order, digests)
    return total


def _validate(out_st: Storage, path: str, order: list[Any], digests: Mapping[str, str]) -> None:
    """Read the shard back: the header lists exactly the names, dtypes and
    shapes written, the data offsets tile the data, and each tensor's bytes
    hash to what was written (ranged reads of ``_VALIDATE_BLOCK`` bytes)."""
    (hlen,) = struct.unpack("<Q", out_st.read_bytes(path, 0, 8))
    header = json.loads(out_st.read_bytes(path, 8, hlen))
    header.pop("__metadata__", None)
    want = {it.out: it for it in order}
    if set(header) != set(want):
        raise ManifestError(f"{path}: the header lists {sorted(set(header) ^ set(want))[:5]} "
                            "unexpectedly")
    size = out_st.size(path)
    for name, it in want.items():
        e = header[name]
        if e["dtype"] != safetensors_code(it.dtype) or tuple(e["shape"]) != tuple(it.shape):
            raise ManifestError(f"{path}: {name}: reads back as {e['dtype']} {e['shape']}, written "
                                f"as {safetensors_code(it.dtype)} {list(it.shape)}")
        lo, hi = e["data_offsets"]
        if hi - lo != it.nbytes or 8 + hlen + hi > size:
            raise ManifestError(f"{path}: {name}: data_offsets {[lo, hi]} do not hold "
                                f"{it.nbytes} bytes in a {size}-byte object")
        h = xxhash.xxh3_64()
        for a in range(lo, hi, _VALIDATE_BLOCK):
            h.update(out_st.read_bytes(path, 8 + hlen + a, min(_VALIDATE_BLOCK, hi - a)))
        if h.hexdigest() != digests[name]:
            raise ManifestError(f"{path}: {name}: the bytes read back differ from those written")
