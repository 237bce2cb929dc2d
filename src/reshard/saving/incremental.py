"""Incremental saves: a chunk whose bytes equal its parent checkpoint's is
linked, not written (docs/design.md, "Incremental checkpoints").

How a save decides, and who does what (``SaveOptions.incremental``):

* planning: every tensor chunk of at least ``SaveOptions.own_file_bytes``
  gets a data file of its own, named after the chunk
  (:func:`reshard.planning.planner.chunk_file_name`), in the first save of a
  lineage already, so an unchanged chunk's file repeats whole in every later
  save; smaller chunks share the writer's files and are always written;
* staging: the background hashing of the staged copy
  (:func:`reshard.saving.save.finish_digests`) computes each such chunk's
  xxh3_128 (:func:`reshard.ondisk.shardfile.content_digest`), off the
  training loop's critical path for an asynchronous save;
* the coordinator names the parent it links from in the attempt's
  :class:`~reshard.planning.coordination_save.Attempt` (:func:`link_source`: its location and attempt id, O(1) bytes);
* persist (every writing rank, per file of one chunk): the parent's file of
  the same name is linked when it is byte for byte the file this save would
  write: its size and its header (which records each item's content digest)
  are compared, nothing else of it is read
  (:func:`reshard.ondisk.shardfile.link_shard_file`). Anything else (no such
  file, another content, a store that cannot link, the parent deleted
  meanwhile) writes the file from the staged bytes as a full save does;
* the coordinator records, per linked file, the attempt id whose save first
  wrote its bytes (``FileEntry.origin``, :func:`origin_of`).

A link is a hard link on a local file system (the bytes are on disk once,
whatever number of checkpoints name them; each checkpoint directory is
complete: ``cp -r`` of it is a checkpoint), a shared object in
``memory://``, and a copy inside the store on S3 (``CopyObject`` /
``UploadPartCopy``: no byte leaves the client, the store keeps a copy per
checkpoint). So every checkpoint stays self-contained: readers, retention
and gc need nothing of this module.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..commit import attempts
from ..commit.strategy import strategy_for
from ..errors import CheckpointError
from ..ondisk.committed import read_manifest
from ..ondisk.manifest import Manifest
from ..planning.coordination import Layout
from ..planning.coordination_save import LinkSource
from ..planning.plan_store import parent_path
from ..storage import Storage

#: prefix of the file names of chunks that have a file of their own
CHUNK_FILE_PREFIX = "data-c"

#: the coordinator's recent manifests (canonical checkpoint location ->
#: manifest): a managed save's parent is the previous save, whose manifest the
#: coordinator built; after a restart it is read from storage once
_RECENT: OrderedDict[str, Manifest] = OrderedDict()
_RECENT_MAX = 2
_LOCK = threading.Lock()


def remember(st: Storage, target: str, m: Manifest) -> None:
    """Coordinator, after publishing ``m`` at ``target``: keep it for the
    next save that names it as its parent."""
    with _LOCK:
        _RECENT[f"{id(st)}:{target}"] = m
        _RECENT.move_to_end(f"{id(st)}:{target}")
        while len(_RECENT) > _RECENT_MAX:
            _RECENT.popitem(last=False)


def plain_name(name: str) -> str:
    """A data file's name as the plan gave it (without the ``att-<id>.``
    prefix of an attempt's keys where attempts share a prefix)."""
    a = attempts.attempt_of(name)
    return name[len(attempts.PREFIX) + len(a) + 1:] if a else name


def is_chunk_file(name: str) -> bool:
    """Whether ``name`` is the file of one chunk (the only files ever linked)."""
    return plain_name(name).startswith(CHUNK_FILE_PREFIX)


def link_source(st: Storage, key: str, parent: str | None, *,
                hmac_key: bytes | None = None) -> tuple[LinkSource | None, Manifest | None]:
    """Coordinator, when an incremental save opens its attempt: the parent
    checkpoint to link from (for every rank, in the broadcast
    :class:`~reshard.planning.coordination_save.Attempt`: its canonical
    location and its attempt id, which names its files where attempts share
    a prefix) and its manifest; ``(None, None)``
    when there is no parent or it is not a committed checkpoint that reads
    (the save then writes everything; never a failure of the save)."""
    prev = parent_path(st, key, parent)
    if prev is None:
        return None, None
    where = st.canonical(prev)
    with _LOCK:
        m = _RECENT.get(f"{id(st)}:{where}")
    if m is None:
        try:
            m = read_manifest(st, where, hmac_key=hmac_key)
        except (CheckpointError, OSError):
            return None, None
    return LinkSource(path=where, attempt_id=m.attempt_id), m


def source_key(st: Storage, src: LinkSource, name: str) -> str:
    """The key of the parent's file ``name`` (as the plan names it, or as
    this attempt's key)."""
    return st.join(src.path, strategy_for(st).data_name(src.attempt_id, plain_name(name)))


def _parent_name(st: Storage, parent: Manifest, name: str) -> str | None:
    """The name under which ``parent`` lists the plan's file ``name``."""
    name = plain_name(name)
    if name in parent.files:
        return name
    keyed = strategy_for(st).data_name(parent.attempt_id, name)  # where attempts share the prefix
    return keyed if keyed in parent.files else None


def origin_of(st: Storage, parent: Manifest) -> Any:
    """``name -> attempt id`` for :func:`reshard.planning.coordination.build_manifest`:
    a file linked from ``parent`` keeps the origin recorded there, or gets
    ``parent``'s attempt id when ``parent``'s save wrote it."""
    def one(name: str) -> str:
        pn = _parent_name(st, parent, name)
        fe = parent.files.get(pn) if pn is not None else None
        return (fe.origin if fe is not None and fe.origin else "") or parent.attempt_id

    return one


def linkable_bytes(st: Storage, parent: Manifest, layout: Layout) -> int:
    """Bytes of the planned files that the save expects to link rather than
    write, for the space check before any rank writes: the chunk files that
    ``parent`` holds under the same name and that ``parent`` itself linked
    (unchanged across the previous save), or all such files when ``parent``
    linked none (no history yet: the first incremental save after a full
    one). An estimate: a chunk that changes against it is written, and a
    write that then does not fit fails with the store's error, costing that
    save only."""
    history = any(fe.origin for fe in parent.files.values())
    total = 0
    for a in layout.assignments:
        for name in a.files:
            if not is_chunk_file(name):
                continue
            pn = _parent_name(st, parent, name)
            if pn is None:
                continue
            fe = parent.files[pn]
            if fe.origin or not history:
                total += fe.size
    return total
