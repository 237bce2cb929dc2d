"""Size limits on what a reader parses, checked before it is parsed
(:class:`ReadLimits`; ``LoadOptions(limits=...)`` changes them for a load).

A checkpoint is untrusted input: a manifest, a safetensors header, a DCP
``.metadata``, an encoded value or a small record could be made of any size,
and a parser's memory grows with what it parses (a JSON dict of ``"k":0``
entries costs 15-20 bytes of Python objects per byte of text). Every such
input is therefore checked against a limit *before* a byte of it is parsed:
its declared or stored size first (a stat or a length prefix), then, for a
manifest larger than a name may be, the size of each free-form field and of
each name from a cheap outline pass (``msgspec.Raw`` views, nothing
decoded) before the full decode.

The defaults are derived from real checkpoints (see ``docs/faults.md``,
"Bounded cost for hostile files", for the measurements and the peak memory
and time per MiB they bound):

* ``manifest_bytes`` 64 MiB: the largest manifest measured, the simulated
  Llama-3 405B at 16,384 ranks (TP 8, PP 16, DP 128, Megatron's flat
  distributed optimizer), is 17.2 MB (75,716 chunks); 64 MiB is 3.7 times it.
* ``field_bytes`` 16 MiB: ``extra``, ``values``, ``mesh``, ``adapters`` and
  ``aliases`` together (real ones: a few KiB; 4096 adapters entries ~200 KiB).
* ``name_bytes`` 64 KiB: one name (a tensor, object, value or alias key, a
  file name, an attempt id, a parent or lineage; real ones are under 300 bytes).
* ``header_bytes`` 16 MiB: one safetensors header (a 94k-tensor MoE saved as
  one unsharded file needs ~11 MB at ~120 bytes a tensor; sharded files are
  under 1 MiB each; the safetensors format itself caps headers at 100 MB).
* ``index_bytes`` 64 MiB: a ``model.safetensors.index.json``.
* ``dcp_metadata_bytes`` 1 GiB: a PyTorch DCP ``.metadata`` (a pickle that
  repeats every chunk's full record: far larger than a reshard manifest of
  the same checkpoint; the previous fixed cap, kept).
* ``value_bytes`` 64 MiB: one encoded object element read from a shard file
  (real ones: RNG states, data cursors: KiBs).
* ``record_bytes`` 1 MiB: a small JSON record beside a checkpoint (HEAD,
  owner, leases, verification records: under 4 KiB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

#: manifests larger than this (or than ``name_bytes``, if smaller) get the
#: outline pass (field and name sizes) before the full decode
OUTLINE_MIN_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ReadLimits:
    """The largest inputs a reader parses (all in bytes; see the module
    docstring for where each default comes from). Every limit is checked
    before the input is parsed; an input above one is refused with a
    :class:`~reshard.errors.ManifestError` naming the file, the field, its
    size and the limit (and this option).

    Attributes:
        manifest_bytes: ``manifest.json``.
        field_bytes: the free-form fields of a manifest together
            (``extra``, ``values``, ``mesh``, ``adapters``, ``aliases``).
        name_bytes: one name in a manifest (tensor, object, value, alias,
            file; attempt id, parent, lineage, schema version).
        header_bytes: one safetensors header (the u64 length prefix).
        index_bytes: a Hugging Face ``model.safetensors.index.json``.
        dcp_metadata_bytes: a PyTorch DCP ``.metadata``.
        value_bytes: one encoded object element read from a shard file.
        record_bytes: one small JSON record beside a checkpoint.
    """

    manifest_bytes: int = 64 << 20
    field_bytes: int = 16 << 20
    name_bytes: int = 64 << 10
    header_bytes: int = 16 << 20
    index_bytes: int = 64 << 20
    dcp_metadata_bytes: int = 1 << 30
    value_bytes: int = 64 << 20
    record_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ReadLimits.{f.name} must be a positive int (bytes), got {v!r}")


def default_limits() -> ReadLimits:
    """The limits of a reader given none: :class:`ReadLimits`' defaults, each
    raised or lowered by an environment variable ``RESHARD_LIMIT_<NAME>``
    (e.g. ``RESHARD_LIMIT_MANIFEST_BYTES=268435456``) for the tools that take
    no ``LoadOptions`` (``reshard ls``, ``gc``, ``latest``)."""
    env = {f.name: os.environ.get(f"RESHARD_LIMIT_{f.name.upper()}") for f in fields(ReadLimits)}
    given = {k: int(v) for k, v in env.items() if v}
    return ReadLimits(**given) if given else _DEFAULT


_DEFAULT = ReadLimits()


def too_large(where: str, what: str, size: int, limit: int, option: str) -> str:
    """The one-line refusal of an input above its limit."""
    return (f"{where}: {what} is {size} bytes, more than the {limit} a reader parses "
            f"(LoadOptions(limits=ReadLimits({option}=...)) or RESHARD_LIMIT_{option.upper()} "
            "raises it); refused before parsing")
