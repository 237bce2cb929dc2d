"""The one structural validation of a decoded manifest, shared by
:func:`reshard.verify` (which lists every problem), :func:`reshard.load`
(the coordinator refuses a checkpoint with any, before a target is written)
and :func:`reshard.inspect` (which refuses it too): the three agree on what
they accept.

Beyond what decoding already checks (:func:`reshard.ondisk.manifest.validate_manifest`:
types, ranges, dtypes, names, byte ranges inside their files, each tensor's
element count): every tensor's chunks tile its global shape exactly (no
chunk recorded twice, no overlap, no hole: a zero-size chunk counts too),
every common value decodes, and the declared world size fits what the
files hold (a data file of rank ``r`` needs ``world_size > r``; the save
plan kept beside the checkpoint holds one record per rank, so it bounds
``world_size`` from above).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import CheckpointError
from ..ondisk import codec
from ..ondisk.manifest import Manifest
from .plan_store import _ENTRY, _HEAD
from .planner import check_entry_coverage

#: a data file's rank, in a name as the planner makes it (possibly after an attempt prefix)
_RANK = re.compile(r"(?:^|\.)data-r(\d{5,})-\d+\.safetensors$")

#: problems listed at most (a hostile manifest can hold millions)
MAX_PROBLEMS = 100


def structure_problems(m: Manifest, *, where: str = "manifest.json") -> list[str]:
    """Every structural problem of ``m`` found without reading data (empty:
    none), one line each, at most :data:`MAX_PROBLEMS`."""
    out: list[str] = []

    def add(msg: str) -> bool:
        out.append(msg)
        return len(out) >= MAX_PROBLEMS

    for fqn, te in m.tensors.items():
        seen: set[tuple[Any, ...]] = set()
        dup = None
        for c in te.chunks:
            k = (tuple(c.global_offset), tuple(c.local_shape), c.flattened_range)
            if k in seen:
                dup = c
                break
            seen.add(k)
        if dup is not None:
            if add(f"tensor {fqn!r}: chunk at {list(dup.global_offset)} shape {list(dup.local_shape)} "
                   f"recorded more than once ({len(te.chunks)} chunks for {len(seen) + 1}+ distinct)"):
                return out
            continue
        try:
            check_entry_coverage(fqn, te)
        except CheckpointError as e:
            if add(f"coverage: {e}"):
                return out
    for vk, enc in (m.values or {}).items():
        try:
            codec.from_json(enc)
        except CheckpointError as e:
            if add(f"value {vk!r}: {e}"):
                return out
    ranks = [int(r.group(1)) for r in map(_RANK.search, m.files) if r is not None]
    if ranks and max(ranks) >= m.world_size:
        add(f"{where}: world_size {m.world_size}, but data file(s) of rank {max(ranks)} are listed "
            "(a file's rank must be below the world size)")
    if m.plan is not None:
        need = _HEAD.size + _ENTRY.size * m.world_size
        if m.plan.size < need:
            add(f"{where}: world_size {m.world_size} cannot be: the save plan {m.plan.file!r} holds "
                f"{m.plan.size} bytes, and a plan of {m.world_size} ranks needs at least {need} "
                "(one record per rank)")
    return out
