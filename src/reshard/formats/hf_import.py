"""Import a Hugging Face safetensors directory as the initial weights of a
(sharded) model: a reshard manifest is built from the safetensors headers
(absolute byte ranges), so each rank reads only the bytes it needs.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from ..collectives import Tries, timed_collectives
from ..errors import CheckpointNotFoundError, ManifestError, ShardingError
from ..loading.load import LoadResult, load
from ..ondisk.limits import default_limits, too_large
from ..ondisk.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
    check_file_name,
    validate_manifest,
)
from ..options import LoadOptions
from ..state.sharding import (
    VIEW_METADATA_PREFIX,
    dtype_from_safetensors,
    safetensors_view,
)
from ..storage import Storage, resolve
from ..storage.local import LocalStorage
from .hf_export import MAX_HEADER_BYTES, MAX_INDEX_BYTES
from .hf_store import INDEX_NAME, SINGLE_NAME
from .hf_write import TIED_KEY

# ----------------------------------------------------------------------------- hub snapshots


class _SnapshotStorage(LocalStorage):
    """The local file system, with the files of one Hugging Face directory
    ``key`` replaced by their resolved paths: ``join(key, name)`` is the real
    file behind the hub cache's ``snapshots/<rev>/name -> ../../blobs/<sha>``
    link, so the reader (which refuses symbolic links) opens the blob itself.
    Built only by :func:`_snapshot_files`, after every target was checked;
    bytes read and written are counted here and on the ``base`` store too."""

    def __init__(self, base: LocalStorage, key: str, real: Mapping[str, str]):
        super().__init__()
        self._base, self._key, self._real = base, key, dict(real)

    def _count_read(self, n: int) -> None:
        super()._count_read(n)
        self._base._count_read(n)

    def _count_write(self, n: int) -> None:
        super()._count_write(n)
        self._base._count_write(n)

    def join(self, *parts: str) -> str:  # type: ignore[override]
        if len(parts) == 2 and parts[0] == self._key and parts[1] in self._real:
            return self._real[parts[1]]
        return LocalStorage.join(*parts)


def _allowed_roots(key: str) -> list[str]:
    """Where a file of the directory ``key`` may resolve to: the directory
    itself and, for a hub cache snapshot (``<repo>/snapshots/<rev>``), the
    cache repo folder ``<repo>`` (``models--org--name``, holding ``blobs/``)."""
    real = os.path.realpath(key)
    roots = [real]
    snaps = os.path.dirname(real)
    if os.path.basename(snaps) == "snapshots":
        roots.append(os.path.dirname(snaps))
    return roots


def _real_file(path: str, roots: Sequence[str]) -> str:
    """The resolved path of ``path``, checked: a regular file (never a FIFO,
    device or directory) inside one of ``roots``.

    Raises:
        ManifestError: it resolves outside ``roots``, or to no regular file.
    """
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise ManifestError(f"{path}: resolves to {real}, outside {' and '.join(roots)} (refused)")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (or a dangling link to {real})") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot stat {real}: {e}") from None
    if not stat.S_ISREG(mode):
        raise ManifestError(f"{path}: resolves to {real}, which is not a regular file (refused)")
    return real


def _snapshot_files(st: Storage, key: str, names: Sequence[str]) -> Storage:
    """``st`` with the (existing) files ``names`` of the local directory
    ``key`` resolved and checked by :func:`_real_file` (a hub cache snapshot
    holds symbolic links into ``../../blobs``); any other store unchanged."""
    if isinstance(st, _SnapshotStorage):
        base, real = st._base, dict(st._real)
    elif type(st) is LocalStorage:
        base, real = st, {}
    else:
        return st
    roots = _allowed_roots(key)
    for n in names:
        p = LocalStorage.join(key, n)
        if os.path.lexists(p):
            real[n] = _real_file(p, roots)
    return _SnapshotStorage(base, key, real)


# ----------------------------------------------------------------------------- import


def _read_json(st: Storage, path: str, cap: int) -> Any:
    if st.is_link(path):
        raise ManifestError(f"{path}: is a symbolic link (refused)")
    size = st.size(path)
    if size > cap:
        raise ManifestError(f"{path}: {size} bytes, more than the {cap} allowed")
    try:
        return json.loads(st.read_bytes(path, 0, size))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"{path}: not valid JSON: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _file_tensors(st: Storage, path: str, name: str, shown: str | None = None,
                  limits: Any = None) -> tuple[int, dict[str, TensorEntry], Any]:
    """``(file size, tensors, __metadata__)`` from one safetensors header at
    ``path`` (``shown``, the path as the directory spells it, in errors)."""
    where_file = shown or path
    if st.is_link(path):
        raise ManifestError(f"{where_file}: is a symbolic link (refused)")
    try:
        size = st.size(path)
    except FileNotFoundError:
        raise ManifestError(f"{where_file}: named by the index but missing") from None
    if size < 8:
        raise ManifestError(f"{where_file}: {size} bytes, too short for a safetensors file")
    (hlen,) = struct.unpack("<Q", st.read_bytes(path, 0, 8))
    if 8 + hlen > size:
        raise ManifestError(f"{where_file}: header length {hlen} is impossible for a file of {size} bytes")
    cap = min(MAX_HEADER_BYTES, (limits or default_limits()).header_bytes)
    if hlen > cap:  # refused before a byte of it is read or parsed
        raise ManifestError(too_large(where_file, "the safetensors header", hlen, cap, "header_bytes"))
    try:
        header = json.loads(st.read_bytes(path, 8, hlen))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"{where_file}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ManifestError(f"{where_file}: safetensors header is not a JSON object")
    base = 8 + hlen
    out: dict[str, TensorEntry] = {}
    meta = header.pop("__metadata__", None)
    for tname, info in header.items():
        where = f"{where_file}: tensor {tname!r}"
        if not isinstance(info, dict):
            raise ManifestError(f"{where}: entry is not an object")
        code, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(code, str) or not isinstance(shape, list) or not all(
                _is_int(d) and d >= 0 for d in shape):
            raise ManifestError(f"{where}: bad dtype or shape ({code!r}, {shape!r})")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise ManifestError(f"{where}: bad data_offsets {offs!r}")
        view = meta.get(VIEW_METADATA_PREFIX + tname) if isinstance(meta, dict) else None
        try:
            if view is not None:  # complex128 stored as float64 pairs
                dt, shp = safetensors_view(str(view), code, shape)
            else:
                dt, shp = dtype_from_safetensors(code), tuple(shape)
        except ShardingError as e:
            raise ManifestError(f"{where}: {e}") from None
        out[tname] = TensorEntry(dtype=dt, global_shape=shp, chunks=(
            Chunk(global_offset=(0,) * len(shp), local_shape=shp, file=name,
                  offset=base + offs[0], length=offs[1] - offs[0]),))
    # as the safetensors format requires: the tensors' byte ranges tile the data
    # area exactly (no overlap, no gap), so no two names can alias the same bytes
    pos = 0
    for tname, te in sorted(out.items(), key=lambda kv: (kv[1].chunks[0].offset, kv[1].chunks[0].length)):
        c = te.chunks[0]
        if c.offset - base != pos:
            what = "overlaps the previous tensor" if c.offset - base < pos else "leaves a gap before it"
            raise ManifestError(f"{where_file}: tensor {tname!r}: data_offsets start at {c.offset - base}, "
                                f"expected {pos} ({what})")
        pos += c.length
    return size, out, meta


def _tied(tied: Any, tensors: Mapping[str, TensorEntry], *, where: str) -> dict[str, str]:
    """The recorded ties ``{alias: target}``: each target a tensor of the
    directory, each alias not one (the tied copy an export left out)."""
    if tied is None:
        return {}
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in tied.items()):
        raise ManifestError(f"{where}: {TIED_KEY!r} is not a mapping of tensor name -> tensor name")
    for alias, target in tied.items():
        if target not in tensors:
            raise ManifestError(f"{where}: {TIED_KEY!r} ties {alias!r} to {target!r}, which is not here")
        if alias in tensors:
            raise ManifestError(f"{where}: {TIED_KEY!r} ties {alias!r}, which is also stored")
    return dict(sorted(tied.items()))


#: the output embedding transformers ties to the input embedding
#: (``tie_word_embeddings``), and the names the input embedding goes by
OUTPUT_EMBEDDING = "lm_head.weight"
_INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight",
                     "embed_in.weight", "shared.weight")


#: endings of transformers class names that have output embeddings (an LM head) to tie
_HEAD_CLASSES = ("LMHeadModel", "ForCausalLM", "ForMaskedLM", "ForConditionalGeneration",
                 "ForPreTraining", "WithLMHead", "ForSeq2SeqLM")


def config_ties(st: Storage, key: str, tensors: Mapping[str, TensorEntry]) -> dict[str, str]:
    """The tie ``save_pretrained`` left out, from the directory's
    ``config.json``: with ``tie_word_embeddings`` true (transformers'
    default when the key is absent) and no ``lm_head.weight`` stored, the
    output embedding is the input embedding (the one stored tensor whose
    name ends in ``embed_tokens.weight``, ``wte.weight``,
    ``word_embeddings.weight``...): ``{"lm_head.weight": <it>}``. Nothing
    without a config.json, with ``tie_word_embeddings`` false, with
    ``lm_head.weight`` stored, or without exactly one such tensor; nothing
    either when ``architectures`` names only classes without an LM head
    (``BertModel``: a base model has no output embedding to tie, as in
    transformers, whose tie follows the class).

    Raises:
        ManifestError: a config.json that is not a JSON object."""
    if OUTPUT_EMBEDDING in tensors:
        return {}
    st = _snapshot_files(st, key, ["config.json"])  # a hub cache snapshot's link, resolved and checked
    path = st.join(key, "config.json")
    if not st.exists(path):
        return {}
    cfg = _read_json(st, path, 16 << 20)
    if not isinstance(cfg, dict):
        raise ManifestError(f"{path}: a JSON object expected")
    tie = cfg.get("tie_word_embeddings", True)
    text = cfg.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        tie = text["tie_word_embeddings"]
    if tie is not True:
        return {}
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and not any(
            isinstance(a, str) and a.endswith(_HEAD_CLASSES) for a in archs):
        return {}  # a base model (BertModel): transformers ties only a class with an LM head
    cands = [n for n in tensors if n.endswith(_INPUT_EMBEDDINGS) and len(tensors[n].global_shape) == 2]
    return {OUTPUT_EMBEDDING: cands[0]} if len(cands) == 1 else {}


def hf_manifest(hf_dir: str | os.PathLike[str], *, storage: Storage | None = None,
                limits: Any = None) -> tuple[Storage, str, Manifest]:
    """A reshard Manifest describing the Hugging Face safetensors directory
    ``hf_dir`` (``model.safetensors``, or ``model.safetensors.index.json`` and
    the shards it names): one chunk per tensor with its absolute byte range,
    no checksums, file sizes from the store; tied weights an export recorded
    (``"tied_weights"`` in the index metadata or the file's ``__metadata__``)
    become ``manifest.aliases``, so a load fills the tied copy from its
    target. Returns ``(storage, key, manifest)``; for a local directory the
    storage maps ``join(key, name)`` to each file's checked, resolved path
    (a hub cache snapshot's files are links to ``../../blobs/<sha>``).

    Raises:
        CheckpointNotFoundError: neither file is there.
        ManifestError: a file name outside the directory; a file (or
            symbolic link, as in a hub cache snapshot) that resolves outside
            the directory and its cache repo folder, or to no regular file; a
            malformed header or index, an unsupported dtype, a tensor in two
            files, an index naming a tensor its file lacks.
        IntegrityError: a byte range past the end of its file, a length that
            disagrees with shape and dtype.
    """
    st, key = resolve(hf_dir, storage)
    st = _snapshot_files(st, key, [INDEX_NAME, SINGLE_NAME])
    ipath = st.join(key, INDEX_NAME)
    wmap: dict[str, str] | None = None
    tied: Any = None
    if st.exists(ipath):
        idx = _read_json(st, ipath, min(MAX_INDEX_BYTES, (limits or default_limits()).index_bytes))
        imeta = idx.get("metadata") if isinstance(idx, dict) else None
        tied = imeta.get(TIED_KEY) if isinstance(imeta, dict) else None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ManifestError(f"{ipath}: no weight_map of tensor name -> file name")
        wmap = wm
        names = sorted(set(wm.values()))
    elif st.exists(st.join(key, SINGLE_NAME)):
        names = [SINGLE_NAME]
    else:
        raise CheckpointNotFoundError(f"{key}: no {SINGLE_NAME} or {INDEX_NAME} here")
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, FileEntry] = {}
    metadata: dict[str, Any] = {}
    for name in names:
        check_file_name(name, where=ipath if wmap is not None else key)
    st = _snapshot_files(st, key, names)
    for name in names:
        size, ents, meta = _file_tensors(st, st.join(key, name), name, Storage.join(key, name), limits)
        files[name] = FileEntry(size=size)
        if isinstance(meta, dict):
            metadata[name] = meta
        for t, te in ents.items():
            if t in tensors:
                raise ManifestError(f"{key}: tensor {t!r} is in {tensors[t].chunks[0].file} and {name}")
            tensors[t] = te
    if wmap is not None:
        for t, f in wmap.items():
            if t not in tensors or tensors[t].chunks[0].file != f:
                raise ManifestError(f"{ipath}: maps {t!r} to {f}, which does not hold it")
    if tied is None and wmap is None and isinstance(metadata.get(SINGLE_NAME, {}).get(TIED_KEY), str):
        try:
            tied = json.loads(metadata[SINGLE_NAME][TIED_KEY])
        except json.JSONDecodeError as e:
            raise ManifestError(f"{key}/{SINGLE_NAME}: __metadata__ {TIED_KEY!r} is not JSON: {e}") from None
    aliases = _tied(tied, tensors, where=ipath if wmap is not None else f"{key}/{SINGLE_NAME}")
    if not aliases:
        aliases = config_ties(st, key, tensors)
    mtime = st.modified_time(st.join(key, names[0])) or 0.0
    m = Manifest(attempt_id="huggingface", created_at=mtime, world_size=1,
                 checksum_block_bytes=1 << 20, tensors=dict(sorted(tensors.items())), files=files,
                 aliases=aliases, extra={"source": "huggingface", "safetensors_metadata": metadata})
    validate_manifest(m, where=key)
    return st, key, m


def find_subtree(state: Mapping[str, Any], m: Manifest, *, where: str = "") -> str:
    """Where the model whose Hugging Face names ``m`` lists sits in the target
    ``state``, as :func:`~reshard.formats.hf_export.export_hf` finds the model
    of a checkpoint: ``""`` when the names are keys of ``state`` as they are;
    else the one model subtree of ``state`` (a ``ModelState``, TorchState's
    ``model``, a plain mapping of tensors; optimizer state, RNG and data cursor
    are not models, see :func:`~reshard.formats.hf_export.model_candidates`)
    under which they are keys.

    Raises:
        ShardingError: none or several subtrees hold the names: the error names
            the candidates and ``subtree=``.
    """
    from ..adapters.model import ModelState
    from ..state.tree import flatten
    from .hf_export import model_candidates

    leaves = flatten(state, module_adapter=ModelState)
    keys = {t.fqn for t in leaves.tensors} | set(leaves.plain) | set(leaves.dtensors)
    names = set(m.tensors) | set(m.aliases)
    if not names or keys & names:
        return ""

    class _Saved:  # what model_candidates reads of a manifest
        adapters = leaves.adapters
        tensors = dict.fromkeys(keys)
        aliases: dict[str, str] = {}

    cands, _ = model_candidates(_Saved)  # type: ignore[arg-type]
    hits = [c for c in cands if c and any(f"{c}.{n}" in keys for n in names)]
    if len(hits) == 1:
        return hits[0]
    shown = ", ".join(repr(c) for c in (hits or cands)) or "none"
    raise ShardingError(
        f"import_hf {where}: cannot tell where the model sits in the target state "
        f"({'several model subtrees hold its names' if hits else 'no model subtree holds its names'}: "
        f"{shown}; saved e.g. {sorted(names)[:3]}, the state holds e.g. {sorted(keys)[:3]}); pass "
        "subtree= (the tree path of the model, e.g. subtree='model'), or transforms=[Rename(...)]")


def import_hf(
    state: Mapping[str, Any],
    hf_dir: str | os.PathLike[str],
    *,
    group: Any = None,
    strict: bool = True,
    allow_missing: Sequence[Any] = (),
    transforms: Sequence[Any] = (),
    options: LoadOptions | None = None,
    storage: Storage | None = None,
    subtree: str | None = None,
) -> LoadResult:
    """Fill the tensors of ``state`` (ShardedTensors, DTensors, plain tensors,
    as for :func:`reshard.load`) from the Hugging Face directory ``hf_dir``.

    Every rank of ``group`` reads the safetensors headers, then
    :func:`reshard.load` reads only the byte ranges of its own shards (a
    row-sharded request reads its rows; a column-sharded one reads the
    contiguous span that holds its columns). Arguments as for ``load``; use
    ``transforms=[Rename(...)]`` to map Hugging Face names to the model's,
    ``Cast`` to load into another dtype. ``subtree``: where the model sits
    in ``state`` (``"model"`` for ``{"model": ModelState(m)}``): the
    directory's names (the model's own parameter names, as
    :func:`~reshard.formats.hf_export.export_hf` writes them) are read as
    ``subtree.<name>``; None (the default, without a ``Rename`` transform):
    found as the export found it (:func:`find_subtree`), so importing into the
    state tree an export came from needs no argument; ``""``: the names as
    they are. Tied weights the export recorded are restored: the
    tied copy is filled from its target (the same tensor again when the
    target model ties them). Hugging Face files carry no checksums: the
    bytes are read as they are.

    Raises:
        As :func:`hf_manifest` and :func:`reshard.load`; every failure is
        raised on every rank of ``group``.
    """
    coll = timed_collectives(group, None)  # gloo, whatever the training backend
    auto = subtree is None and not any(type(t).__name__ == "Rename" for t in transforms)
    if coll.world_size == 1:
        st, key, m = hf_manifest(hf_dir, storage=storage, limits=getattr(options, "limits", None))
        if auto:
            subtree = find_subtree(state, m, where=key)
    else:
        tries = Tries()
        with tries:  # every rank must learn of a failure
            st, key, m = hf_manifest(hf_dir, storage=storage, limits=getattr(options, "limits", None))
            if auto:
                subtree = find_subtree(state, m, where=key)
        tries.agree(coll, f"import_hf {os.fspath(hf_dir)}")
    if subtree:
        from ..transforms import Rename

        transforms = [Rename(r"^", subtree.rstrip(".") + "."), *transforms]
    return load(state, key, group=group, strict=strict, allow_missing=allow_missing,
                transforms=transforms, options=options, storage=st, manifest=m)
