"""The manifest: versioned JSON schema, codec and validation.

``manifest.json`` is the only proof that a checkpoint was committed. It is
plain JSON (never pickle), decoded into frozen ``msgspec.Struct`` records and
validated before any of it is used. Unknown optional fields are tolerated;
unknown entries of ``required_features`` are refused.

Units: shapes and offsets in elements (row-major, half-open); ``offset`` and
``length`` of a chunk in bytes from the start of its file; ``size`` of a file
in bytes. ``checksums`` of a chunk hold one ``xxh3_64`` hex digest per block of
``checksum_block_bytes`` bytes of the chunk's data (the last block may be
shorter), so a reader can verify exactly the blocks it reads. At scale a chunk
holds instead one ``digest``, the root of its block digests, and
``block_index``, where they start in its file's block table (the file's last
``8 * blocks`` bytes; see :mod:`reshard.ondisk.shardfile`): the manifest then holds
one digest per chunk, not one per MiB.

Incremental saves (:mod:`reshard.saving.incremental`) add ``content`` to a
chunk: the xxh3_128 (hex, 32 digits) of its bytes, the digest a later save
compares to decide that the chunk is unchanged; and ``origin`` to a data file
that repeats, byte for byte, a file of an earlier checkpoint of the lineage
(linked on a local file system, copied inside the store on S3): the identity
(``attempt_id``) of the checkpoint whose save first wrote those bytes. The
file itself is in this checkpoint: a reader never follows ``origin``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from ..errors import CoverageError, IntegrityError, ManifestError
from ..state.geometry import DTYPE_NAMES, itemsize, numel
from .seal import (
    SEAL_FEATURE,
    SEAL_HEAD,
    SEAL_KEY,
    head_seal,
    head_seal_matches,
    placeholder,
    seal,
    seal_token,
    v2_seal_matches,
)
from .seal import reseal as reseal  # its public path stays here

FORMAT = "reshard"
#: 3: the manifest's own checksum at the head of its bytes, over the bytes
#: after it (:mod:`reshard.ondisk.seal`); 2 sealed it in ``extra`` (still
#: read, and written for a copy of a version-2 checkpoint).
FORMAT_VERSION = 3
#: the first version whose seal is the head of the bytes
SEALED_BY_HEAD = 3
#: the first version whose keys are tree paths (DESIGN.md section 2): 1 named a
#: ShardedTensor/ShardedObject by its own fqn, without its container's path:
#: :func:`reshard.load` migrates those names (``LoadResult.notes``).
PATH_KEYS_VERSION = 2
MANIFEST_NAME = "manifest.json"
#: largest ``world_size`` a manifest may declare (2**24 ranks, far above any
#: job; a larger one is a corrupt or hostile manifest, not a cluster)
MAX_WORLD_SIZE = 1 << 24
KNOWN_FEATURES: frozenset[str] = frozenset({SEAL_FEATURE})
# A declared dimension above this is refused before anything is allocated.
MAX_DIM = 2**48
_CONTENT_RE = re.compile(r"^[0-9a-f]{32}$")
_ATTEMPT_RE = re.compile(r"^[0-9A-Za-z_-]{1,128}$")
# The leaf records below hold only ints, strs and tuples of them (no reference
# cycles), so they opt out of the cyclic GC: decoding a 100k-chunk manifest is
# then 3-10x faster (the GC no longer rescans the growing heap during decode).


class Chunk(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False, omit_defaults=True):
    """One saved piece of a tensor: a box (and optional flat range) in one file."""

    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    checksums: tuple[str, ...] = ()
    flattened_range: tuple[int, int] | None = None
    digest: str = ""
    block_index: int = -1
    #: xxh3_128 (hex) of the chunk's bytes (incremental saves; "" otherwise)
    content: str = ""

    @property
    def numel(self) -> int:
        fr = self.flattened_range
        return numel(self.local_shape) if fr is None else fr[1] - fr[0]


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False):
    dtype: str
    global_shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


class ObjectChunk(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False, omit_defaults=True):
    """One element of an object grid, encoded with :mod:`reshard.ondisk.codec`."""

    global_offset: tuple[int, ...]
    file: str
    offset: int
    length: int
    checksums: tuple[str, ...] = ()
    digest: str = ""
    block_index: int = -1


class ObjectEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False):
    global_shape: tuple[int, ...]
    chunks: tuple[ObjectChunk, ...]


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False, omit_defaults=True):
    """A data file: ``size`` in bytes, whole-file ``checksum``, and ``blocks``:
    the entries of its block table (the last ``8 * blocks`` bytes of the file;
    0: no table, the chunks then carry their block digests themselves).
    ``origin``: the ``attempt_id`` of the earlier checkpoint whose save wrote
    this file's bytes, when this checkpoint's save linked (or copied inside
    the store) that file instead of writing it ("": written by this save).
    Provenance only: the file is in this checkpoint like any other."""

    size: int
    checksum: str = ""
    blocks: int = 0
    origin: str = ""


class PlanIndex(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False):
    """The save plan kept beside the checkpoint (``file``, a sibling of the
    manifest, ``size`` bytes, xxh3-64 ``checksum`` in hex) and its ``plan_id``:
    what the first save after a restart reuses (:mod:`reshard.planning.plan_store`).
    Not needed to load."""

    file: str
    size: int
    checksum: str
    plan_id: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A committed checkpoint's description.

    Attributes:
        format / format_version: the storage format ("reshard", 3).
        required_features: features a reader must understand to load this.
        schema_version: the user's model/training schema version (opaque str).
        step: training step recorded by ``save(..., step=N)``.
        attempt_id: the save attempt that produced this checkpoint.
        created_at: commit time, seconds since the epoch.
        world_size: ranks of the save; ``mesh``: the save-time device mesh, if given.
        tensors: fqn -> dtype, global_shape and the chunks of its primaries.
        objects: key -> object grid shape and its elements.
        values: common state (replicated plain values) in the codec's encoding.
        aliases: fqn -> fqn of the tensor it shares storage with (tied weights).
        files: file name -> size (bytes) and whole-file checksum.
        extra: free-form, JSON only (user metadata).
        parent: name of the checkpoint this one continues from (a sibling
            under the same root), as ``SaveOptions.parent`` gave it; None when
            unknown (a fresh run, or a plain ``save`` not told). Optional:
            manifests written before lineage existed decode with None.
        lineage: id of the root's ``HEAD`` record (the resume) that the
            saving run continued from (``CheckpointManager`` sets it); None
            outside a manager's lineage. See :mod:`reshard.commit.lineage`.
        plan: the save plan kept beside the checkpoint (:class:`PlanIndex`);
            None in manifests written before it existed or by other writers.
        adapters: what saved each subtree, tree path -> kind: a reshard
            adapter's class name (``"ModelState"``, ``"TorchState"``,
            ``"OptimizerState"``, ``"RNGState"``, ``"DataCursor"``),
            ``"Stateful:<module>.<qualname>"`` for another Stateful,
            ``"optimizer"`` for a mapping shaped as ``Optimizer.state_dict()``
            (``state`` and ``param_groups``; nothing below it is recorded),
            ``"tensors"`` for a plain mapping that holds tensors itself (a
            ``model.state_dict()``). Export finds the model from it. Empty in
            manifests written before it existed, by other writers, or for a
            tree of more than 4096 such subtrees.
    """

    attempt_id: str
    created_at: float
    world_size: int
    checksum_block_bytes: int
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    required_features: tuple[str, ...] = ()
    checksum_algorithm: str = "xxh3_64"
    schema_version: str | None = None
    step: int | None = None
    mesh: dict[str, Any] | None = None
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    values: Any = None
    aliases: dict[str, str] = {}
    files: dict[str, FileEntry] = {}
    extra: dict[str, Any] = {}
    parent: str | None = None
    lineage: str | None = None
    plan: PlanIndex | None = None
    adapters: dict[str, str] = {}

    @property
    def total_bytes(self) -> int:
        """Bytes of all data files."""
        return sum(f.size for f in self.files.values())


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Manifest)


def encode_manifest(m: Manifest) -> bytes:
    return _ENCODER.encode(m)


def _unsealed(m: Manifest) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``m``'s extra and required features without a version-2 seal."""
    return ({k: v for k, v in m.extra.items() if k != SEAL_KEY},
            tuple(f for f in m.required_features if f != SEAL_FEATURE))


def encode_sealed(m: Manifest) -> bytes:
    """The manifest's bytes as published, with its own checksum: every byte
    is covered (a changed number in ``values``, a file size, a chunk
    offset), which the block and file checksums cannot do for the manifest
    itself. The checksum is over the bytes, not over a re-encoding, so it is
    checked whatever fields the reader knows.

    From format version 3 (:data:`SEALED_BY_HEAD`), the bytes begin with
    ``{"manifest_xxh3_64":"<xxh3_64>",`` and the checksum covers every byte
    after that (:mod:`reshard.ondisk.seal`). A manifest of an earlier version
    (a copy of an old checkpoint keeps its version) is sealed by the rule of
    version 2 (:func:`_encode_sealed_v2`)."""
    if m.format_version < SEALED_BY_HEAD:
        return _encode_sealed_v2(m)
    extra, feats = _unsealed(m)
    raw = encode_manifest(msgspec.structs.replace(m, extra=extra, required_features=feats))
    return seal(raw[1:])  # the object's members after its "{": the seal is its first member


def _encode_sealed_v2(m: Manifest) -> bytes:
    """Version 2's seal: ``extra[SEAL_KEY]`` (the last key of the top-level
    ``extra``) the xxh3_64 of the bytes with that value read as 16 zeros,
    and ``SEAL_FEATURE`` among ``required_features``. A user value holding
    the exact text of the key and 16 zeros leaves the seal's own occurrence
    the last one; written without a seal only if that ever failed to hold
    (checked by decoding)."""
    extra, feats = _unsealed(m)
    raw = encode_manifest(msgspec.structs.replace(
        m, extra={**extra, SEAL_KEY: "0" * 16}, required_features=(*feats, SEAL_FEATURE)))
    zero = placeholder()
    digest = xxhash.xxh3_64_hexdigest(raw)
    token = seal_token(digest)
    if raw.count(zero) == 1:
        return raw.replace(zero, token)
    # a user value holds the placeholder's text too: the seal is the last key of the top-level
    # extra (what follows extra holds no user keys), so its occurrence is the last one; checked
    at = raw.rfind(zero)
    out = raw[:at] + token + raw[at + len(zero):]
    if _DECODER.decode(out).extra.get(SEAL_KEY) == digest:
        return out
    return encode_manifest(msgspec.structs.replace(m, extra=extra, required_features=feats))


def check_seal(raw: bytes, m: Manifest, *, where: str) -> Manifest:
    """Check the manifest's own checksum (:func:`encode_sealed`) and return
    ``m`` without a version-2 seal (``extra`` and ``required_features`` as
    the writer was given them). The rule is the one of the bytes' version: a
    manifest that begins with the seal's head is checked by version 3's (and
    must be of version 3 or later), one of version 3 or later must begin with
    it; an earlier one is checked by version 2's rule, over ``raw`` with the
    one occurrence of ``extra[SEAL_KEY]`` and its value read as 16 zeros,
    whatever JSON whitespace the writer put around the colon. A manifest
    written before seals existed (neither the feature nor the key) passes
    unchanged.

    Raises:
        IntegrityError: the bytes changed after they were written (the
            checksum differs, or it is gone where the version or the
            feature says there is one).
        ManifestError: the seal's head on a manifest of version 1 or 2.
    """
    if not 1 <= m.format_version <= FORMAT_VERSION:
        return m  # a version this reader does not know: refused by validate_manifest, naming it
    head = head_seal(raw)
    if head is not None:
        if not head_seal_matches(raw):
            raise IntegrityError(_mismatch(where, f"the head's {SEAL_KEY!r} = {head!r}"))
        if m.format_version < SEALED_BY_HEAD:
            raise ManifestError(f"{where}: format_version {m.format_version} begins with the seal of "
                                f"format version {SEALED_BY_HEAD}: not a manifest reshard writes")
        return m
    if m.format_version >= SEALED_BY_HEAD:
        raise IntegrityError(_mismatch(where, f"no seal: a version-{m.format_version} manifest begins "
                                              f"with {SEAL_HEAD.decode()}"))
    got = m.extra.get(SEAL_KEY)
    sealed = SEAL_FEATURE in m.required_features
    if got is None and not sealed:
        return m
    if not sealed or not isinstance(got, str) or not v2_seal_matches(raw, got):
        raise IntegrityError(_mismatch(where, f"extra[{SEAL_KEY!r}] = {got!r}"))
    extra, feats = _unsealed(m)
    return msgspec.structs.replace(m, extra=extra, required_features=feats)


def _mismatch(where: str, what: str) -> str:
    return (f"{where}: manifest checksum mismatch: its bytes changed after it was written "
            f"(bit rot, a torn copy or an edit; {what}); nothing was loaded")


def check_file_name(name: str, *, where: str) -> None:
    """Refuse names that are not plain file names inside the checkpoint."""
    if (
        not name
        or name in (".", "..", MANIFEST_NAME)
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name.startswith(".")
    ):
        raise ManifestError(f"{where}: file name {name!r} is not a plain file inside the checkpoint")


class _Outline(msgspec.Struct, forbid_unknown_fields=False):
    """What the outline pass of :func:`check_limits` looks at: views of the
    free-form fields (``msgspec.Raw``: nothing decoded) and the names."""

    tensors: dict[str, msgspec.Raw] = {}
    objects: dict[str, msgspec.Raw] = {}
    files: dict[str, msgspec.Raw] = {}
    values: msgspec.Raw = msgspec.Raw()
    extra: msgspec.Raw = msgspec.Raw()
    mesh: msgspec.Raw = msgspec.Raw()
    adapters: msgspec.Raw = msgspec.Raw()
    aliases: msgspec.Raw = msgspec.Raw()
    attempt_id: msgspec.Raw = msgspec.Raw()
    parent: msgspec.Raw = msgspec.Raw()
    lineage: msgspec.Raw = msgspec.Raw()
    schema_version: msgspec.Raw = msgspec.Raw()


_OUTLINE = msgspec.json.Decoder(_Outline)


def check_limits(raw: bytes, limits: Any = None, *, where: str = MANIFEST_NAME) -> None:
    """Refuse manifest bytes that exceed ``limits``
    (:class:`~reshard.ondisk.limits.ReadLimits`; None: the defaults) before
    they are decoded: the whole size, then (above
    :data:`~reshard.ondisk.limits.OUTLINE_MIN_BYTES`) the free-form fields
    together and every name, from an outline pass that decodes nothing.

    Raises:
        ManifestError: a limit is exceeded (naming the field, its size and the limit).
    """
    from .limits import OUTLINE_MIN_BYTES, default_limits, too_large

    lim = limits if limits is not None else default_limits()
    if len(raw) > lim.manifest_bytes:
        raise ManifestError(too_large(where, "the manifest", len(raw), lim.manifest_bytes,
                                      "manifest_bytes"))
    if len(raw) <= min(OUTLINE_MIN_BYTES, lim.name_bytes):  # no field or name can be too large
        return
    try:
        o = _OUTLINE.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ManifestError(f"{where}: invalid manifest: {e}") from None
    except RecursionError:
        raise ManifestError(f"{where}: invalid manifest: nested too deeply") from None
    free = {k: len(getattr(o, k)) for k in ("extra", "values", "mesh", "adapters", "aliases")}
    if sum(free.values()) > lim.field_bytes:
        big = max(free, key=lambda k: free[k])
        raise ManifestError(too_large(where, f"its free-form fields (extra, values, mesh, adapters, "
                                      f"aliases; the largest: {big}, {free[big]} bytes)",
                                      sum(free.values()), lim.field_bytes, "field_bytes"))
    for k in ("attempt_id", "parent", "lineage", "schema_version"):
        v = getattr(o, k)
        if len(v) > lim.name_bytes:
            raise ManifestError(too_large(where, f"its {k}", len(v), lim.name_bytes, "name_bytes"))
    for what, d in (("tensor", o.tensors), ("object", o.objects), ("file", o.files)):
        for n in d:
            if len(n) > lim.name_bytes // 4:  # chars: at most 4 bytes each; encode only the long ones
                size = len(n.encode("utf-8", "surrogatepass"))
                if size > lim.name_bytes:
                    raise ManifestError(too_large(where, f"a {what} name ({n[:40]!r}...)", size,
                                                  lim.name_bytes, "name_bytes"))


def decode_manifest(raw: bytes, *, where: str = MANIFEST_NAME, limits: Any = None) -> Manifest:
    """Parse and validate manifest bytes (first :func:`check_limits` against
    ``limits``, :class:`~reshard.ondisk.limits.ReadLimits`; None: the defaults).

    Raises:
        ManifestError: larger than a limit; not JSON, fails the schema,
            unsupported format or version, unknown required feature, bad
            dtype/shape, a file name outside the checkpoint, or a chunk naming
            an undeclared file.
        IntegrityError: the manifest's own checksum does not match its bytes
            (:func:`check_seal`); a chunk's declared byte length disagrees
            with its shape and dtype, or reaches past the declared size of
            its file.
    """
    check_limits(raw, limits, where=where)
    try:
        m = _DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ManifestError(f"{where}: invalid manifest: {e}") from None
    except RecursionError:  # JSON nested deeper than the interpreter's recursion limit
        raise ManifestError(f"{where}: invalid manifest: nested too deeply") from None
    m = check_seal(raw, m, where=where)
    validate_manifest(m, where=where)
    return m


def validate_manifest(m: Manifest, *, where: str = MANIFEST_NAME) -> None:
    """Check a decoded manifest's meaning, in this order: the header
    (:func:`_check_header`), the files (:func:`_check_files`), every tensor
    (:func:`_check_tensor`), every object grid (:func:`_check_object`), the
    values and the aliases (:func:`_check_names`). The first failure is raised.

    Raises:
        ManifestError: unsupported format, version, feature or checksum
            algorithm; a world size, shape, offset, dtype, file name,
            checksum count or block-table range out of bounds; an object
            grid not covered exactly once; values not an object; an alias
            to an unknown tensor or shadowing a saved name.
        IntegrityError: a chunk's declared byte length disagrees with its
            shape and dtype, or its range reaches past its file's declared size.
        CoverageError: a tensor's chunks do not hold exactly its elements.
    """
    _check_header(m, where)
    files = _check_files(m, where)
    for fqn, te in m.tensors.items():
        _check_tensor(fqn, te, files)
    for key, oe in m.objects.items():
        _check_object(key, oe, files)
    _check_names(m, where)


def _check_header(m: Manifest, where: str) -> None:
    """Format, version, required features, checksum algorithm and block size,
    world size (ManifestError on the first that this reader cannot take)."""
    if m.format != FORMAT:
        raise ManifestError(f"{where}: format is {m.format!r}, expected {FORMAT!r}")
    if m.format_version > FORMAT_VERSION or m.format_version < 1:
        raise ManifestError(
            f"{where}: format_version {m.format_version} is not supported (this reader: {FORMAT_VERSION})"
        )
    unknown = set(m.required_features) - KNOWN_FEATURES
    if unknown:
        raise ManifestError(f"{where}: requires unknown feature(s) {sorted(unknown)}")
    if m.checksum_algorithm != "xxh3_64":
        raise ManifestError(f"{where}: unknown checksum_algorithm {m.checksum_algorithm!r}")
    if m.checksum_block_bytes <= 0:
        raise ManifestError(f"{where}: checksum_block_bytes must be positive")
    if not 1 <= m.world_size <= MAX_WORLD_SIZE:
        raise ManifestError(f"{where}: world_size {m.world_size} is outside [1, {MAX_WORLD_SIZE}]")


@dataclass(frozen=True)
class _Files:
    """The checked file table of a manifest, for :meth:`check_range`.

    Attributes:
        where: the manifest's name in messages.
        block: ``checksum_block_bytes`` (bytes, positive).
        sizes: file name -> declared size (bytes).
        tables: file name -> entries of its block table (0: none).
    """

    where: str
    block: int
    sizes: Mapping[str, int]
    tables: Mapping[str, int]

    def check_range(self, key: str, file: str, offset: int, length: int, checksums: tuple[str, ...],
                    c: Chunk | ObjectChunk) -> None:
        """Bytes ``[offset, offset + length)`` of ``file`` as record ``key``
        declares them: a listed file, inside its size, one checksum per block
        (or a digest whose blocks lie in the file's block table).

        Raises:
            ManifestError: an unlisted or unsafe file name, a wrong checksum
                count, blocks outside the block table.
            IntegrityError: the range reaches past the file's declared size.
        """
        where, block = self.where, self.block
        size = self.sizes.get(file)
        if size is None:
            check_file_name(file, where=f"{where}: {key}")
            raise ManifestError(f"{where}: {key}: names file {file!r} that the manifest does not list")
        if offset < 0 or length < 0 or offset + length > size:
            raise IntegrityError(
                f"{where}: {key}: bytes [{offset}, {offset + length}) reach past the declared "
                f"size {size} of file {file!r}"
            )
        if checksums and len(checksums) != -(-length // block):
            raise ManifestError(
                f"{where}: {key}: {len(checksums)} checksums for {length} bytes in blocks of {block}"
            )
        tables = self.tables
        if c.digest and not checksums and (
                c.block_index < 0 or c.block_index + -(-length // block) > tables[file]
                or offset + length > size - 8 * tables[file]):
            raise ManifestError(f"{where}: {key}: blocks from {c.block_index} are not in the block table "
                                f"of file {file!r} ({tables[file]} entries)")


def _check_files(m: Manifest, where: str) -> _Files:
    """Every file entry: a plain name, a non-negative size, a block table
    that fits, an attempt-id origin (ManifestError otherwise)."""
    sizes: dict[str, int] = {}
    tables: dict[str, int] = {}
    for name, fe in m.files.items():
        check_file_name(name, where=where)
        if fe.size < 0:
            raise ManifestError(f"{where}: file {name!r} has negative size")
        if fe.blocks < 0 or 8 * fe.blocks > fe.size:
            raise ManifestError(f"{where}: file {name!r}: block table of {fe.blocks} entries does not fit "
                                f"its {fe.size} bytes")
        if fe.origin and not _ATTEMPT_RE.match(fe.origin):
            raise ManifestError(f"{where}: file {name!r}: origin {fe.origin[:80]!r} is not an attempt id")
        sizes[name] = fe.size
        tables[name] = fe.blocks
    return _Files(where=where, block=m.checksum_block_bytes, sizes=sizes, tables=tables)


def _check_tensor(fqn: str, te: TensorEntry, files: _Files) -> None:
    """One tensor: an allow-listed dtype, a shape in range, every chunk's box
    inside it with a byte length matching its elements and a range inside
    its file, and the chunks' elements adding up to the shape's.

    Raises:
        ManifestError, IntegrityError, CoverageError: as :func:`validate_manifest`.
    """
    where = files.where
    if te.dtype not in DTYPE_NAMES:
        raise ManifestError(f"{where}: tensor {fqn!r}: dtype {te.dtype!r} is not on the allow-list")
    gshape = te.global_shape
    if any(d < 0 or d > MAX_DIM for d in gshape):
        raise ManifestError(f"{where}: tensor {fqn!r}: global_shape {list(gshape)} out of range")
    isz = itemsize(te.dtype)
    volume = 0
    for c in te.chunks:
        key = f"tensor {fqn!r} chunk at {list(c.global_offset)}"
        if len(c.global_offset) != len(gshape) or len(c.local_shape) != len(gshape):
            raise ManifestError(f"{where}: {key}: rank differs from global_shape {list(gshape)}")
        for o, s, g in zip(c.global_offset, c.local_shape, gshape, strict=True):
            if o < 0 or s < 0 or o + s > g:
                raise ManifestError(
                    f"{where}: {key}: box {list(c.local_shape)} lies outside global_shape {list(gshape)}"
                )
        n = c.numel
        if c.flattened_range is not None:
            a, b = c.flattened_range
            if not 0 <= a <= b <= numel(c.local_shape):
                raise ManifestError(f"{where}: {key}: flattened_range {a}:{b} outside its box")
        if c.length != n * isz:
            raise IntegrityError(
                f"{where}: {key}: declared length {c.length} bytes, but {n} elements of "
                f"{te.dtype} need {n * isz}"
            )
        files.check_range(key, c.file, c.offset, c.length, c.checksums, c)
        if c.content and not _CONTENT_RE.match(c.content):
            raise ManifestError(f"{where}: {key}: content digest {c.content[:80]!r} is not 32 hex digits")
        volume += n
    if volume != numel(gshape):
        raise CoverageError(
            f"{where}: tensor {fqn!r}: chunks hold {volume} elements, global_shape "
            f"{list(gshape)} needs {numel(gshape)}"
        )


def _check_object(key: str, oe: ObjectEntry, files: _Files) -> None:
    """One object grid: every element inside the grid with a range inside its
    file, each element recorded exactly once (ManifestError, IntegrityError)."""
    where = files.where
    for oc in oe.chunks:
        if len(oc.global_offset) != len(oe.global_shape) or any(
            o < 0 or o >= g for o, g in zip(oc.global_offset, oe.global_shape, strict=True)
        ):
            raise ManifestError(f"{where}: object {key!r}: element {list(oc.global_offset)} "
                                f"outside its grid {list(oe.global_shape)}")
        files.check_range(f"object {key!r} element {list(oc.global_offset)}", oc.file, oc.offset,
                          oc.length, oc.checksums, oc)
    distinct = {tuple(oc.global_offset) for oc in oe.chunks}
    if len(distinct) != len(oe.chunks) or len(distinct) != numel(oe.global_shape):
        raise ManifestError(f"{where}: object {key!r}: {len(oe.chunks)} records of {len(distinct)} "
                            f"distinct elements for a grid {list(oe.global_shape)} of "
                            f"{numel(oe.global_shape)}")


def _check_names(m: Manifest, where: str) -> None:
    """``values`` an object (or absent); every alias names a saved tensor and
    is not itself a saved name (ManifestError otherwise)."""
    if m.values is not None and not isinstance(m.values, dict):
        raise ManifestError(f"{where}: values must be an object, got {type(m.values).__name__}")
    for alias, target in m.aliases.items():
        if target not in m.tensors:
            raise ManifestError(f"{where}: alias {alias!r} points to unknown tensor {target!r}")
        if alias in m.tensors or alias in m.objects:  # one name, two meanings: which would load?
            raise ManifestError(f"{where}: alias {alias!r} is also the name of a saved "
                                f"{'tensor' if alias in m.tensors else 'object'}")
