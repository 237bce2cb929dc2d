"""The template-free read: a whole checkpoint (or the keys asked for) as a
nested dict of plain CPU tensors and values, on one process.

For tools and plug-in points that must *return* a state rather than fill one
(Lightning's ``CheckpointIO.load_checkpoint``, a notebook, an evaluation
script), where :func:`reshard.load` needs a target state. It is a load like
any other: the manifest (or a PyTorch DCP folder's ``.metadata``) is read and
checked, every returned tensor is allocated at its global shape and requested
as "the whole tensor", and :func:`reshard.load` plans and reads the exact byte
ranges and verifies their checksums, over :class:`reshard.collectives.SingleProcess`
(no process group is used, even inside one: a rank-0-only plug-in point may
call it). Peer: ``torch.distributed.checkpoint.state_dict_loader._load_state_dict_from_keys``
(DCP's template-free load, which nests by the tree paths DCP records).

Nesting (how saved keys, tree paths joined with ``.``, become nested dicts):

* A key is split only where the checkpoint says a tree node is. A native
  checkpoint records the subtrees its save walked (``Manifest.adapters``: a
  ``ModelState``, an ``OptimizerState``, any Stateful, a mapping holding
  tensors such as ``model.state_dict()``, an ``Optimizer.state_dict()``):
  ``{"model": ModelState(m), "optim": ..., "step": 5}`` reads back as
  ``{"model": {"0.weight": ..., ...}, "optim": {...}, "step": 5}``. Below a
  subtree the keys are those of its ``state_dict()`` as saved, dots and all,
  so ``module.load_state_dict(out["model"])`` and
  ``scheduler.load_state_dict(out["sched"])`` take them as they are.
* The path of a recorded subtree is split at its dots (``optimizer_states.0``
  is ``out["optimizer_states"][0]``); a key outside every recorded subtree is
  split only at nodes those paths create (``train.step`` beside a recorded
  ``train.model`` is ``out["train"]["step"]``), else kept whole (a
  ``ShardedTensor`` named ``mlp.gate`` at the root is ``out["mlp.gate"]``).
* A subtree saved as ``torch.optim.Optimizer.state_dict()`` comes back in that
  layout: ``{"state": {param id (int) or fqn: {name: tensor}}, "param_groups": [...]}``,
  ready for ``optimizer.load_state_dict``.
* A level made by splitting whose keys are exactly ``0 .. n-1`` is a list
  (list items of the saved tree), as DCP rebuilds them.
* A PyTorch DCP folder (and a ``reshard convert --from dcp`` of one) nests by
  the tree paths DCP recorded (``planner_data``), as DCP's own template-free
  load does.
* A checkpoint that records no subtrees (written before the record existed,
  or by a tree of more than 4096 subtrees) reads back flat: every key whole.
* Objects (``ShardedObject``): a grid of shape ``()`` is its value; a grid of
  another shape a nested list in grid order (``rng.streams`` of 2 ranks: a
  list of 2). Tied weights (``Manifest.aliases``) are the same tensor object.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from typing import Any

from ..collectives_base import SingleProcess
from ..errors import CheckpointError, IntegrityError, ShardingError
from ..ondisk.dcp_values import DCP_TENSOR_PATHS, DCP_VALUES
from ..ondisk.manifest import Manifest
from ..options import LoadOptions
from ..state.geometry import itemsize, numel
from ..storage import Storage, resolve

#: ``read_state``'s default memory limit: this fraction of the memory the
#: system reports available when the call starts (see :func:`available_memory`)
DEFAULT_MEMORY_FRACTION = 0.8

_GLOB = frozenset("*?[")


def available_memory() -> int | None:
    """Bytes of memory this process may still allocate, as the system
    reports it: ``MemAvailable`` of ``/proc/meminfo``, or less where the
    process's cgroup (v2 ``memory.max`` minus ``memory.current``, v1
    ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``) leaves less;
    elsewhere ``SC_AVPHYS_PAGES`` pages. None when none of them can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit, encoding="ascii") as f:
                lim = f.read().strip()
            with open(used, encoding="ascii") as f:
                cur = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if lim.isdigit() and int(lim) < 1 << 60:  # "max", or v1's "no limit" (2**63 - page)
            found.append(max(0, int(lim) - cur))
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return min(found)


def _selector(keys: str | Iterable[str] | None) -> tuple[list[str], Any]:
    """The patterns and a predicate over saved keys (see :func:`read_state`)."""
    if keys is None:
        return [], lambda k: True
    pats = [keys] if isinstance(keys, str) else list(keys)
    for p in pats:
        if not isinstance(p, str) or not p:
            raise ValueError(f"read_state(keys=...): patterns are non-empty strings, got {p!r}")

    def one(p: str, k: str) -> bool:
        if _GLOB & set(p):
            return fnmatch.fnmatchcase(k, p)
        return k == p or k.startswith(p + ".")

    return pats, lambda k: any(one(p, k) for p in pats)


def read_state(
    path: str | os.PathLike[str],
    *,
    keys: str | Iterable[str] | None = None,
    max_bytes: int | None = None,
    options: LoadOptions | None = None,
    storage: Storage | None = None,
) -> dict[str, Any]:
    """The checkpoint at ``path`` (a reshard checkpoint, a PyTorch DCP folder,
    a local path or an ``s3://``/``memory://``/``file://`` URL) as a nested
    dict of plain CPU tensors and values, without a target state.

    It reads only what it returns, through :func:`reshard.load` (the load plan,
    exact byte ranges, every block's checksum verified: ``options.checksums``
    is on by default), on this process alone (never a collective, whether or
    not a process group exists), and unpickles nothing (a DCP folder goes
    through the restricted decoders :func:`reshard.load` uses). Nesting: see
    :mod:`reshard.loading.read_state` (keys split only where the checkpoint
    records a tree node).

    Args:
        keys: None (default): every key. Else a pattern or a list of them,
            matched against the saved keys (tree paths joined with ``.``,
            as ``reshard inspect`` lists them): a pattern without ``*?[``
            selects that key and everything below it (``"model"`` selects
            ``model.0.weight``; ``"model.0"`` does not select ``model.00``);
            one with them is an ``fnmatch`` glob over whole keys, ``*``
            crossing dots (``"optim.state.*.exp_avg"``). Only the selected
            keys are read.
        max_bytes: the most the result may take (bytes): every returned
            tensor's elements, the encoded size of the objects (values come
            with the manifest, already in memory), and
            the read buffers of chunks smaller than
            ``options.direct_read_min_bytes`` (they are read in coalesced
            spans; larger chunks are read straight into the result), plus,
            for a DCP folder, one decoded chunk per reader thread. Checked
            before anything is allocated. None (default):
            :data:`DEFAULT_MEMORY_FRACTION` (80 %) of :func:`available_memory`
            when the call starts (no limit where the system reports none).
        options: :class:`reshard.LoadOptions` (checksums, threads, hmac_key,
            progress); its timeout and read_once do not apply (one process).
        storage: a backend to use instead of resolving ``path``.

    Returns:
        The nested dict (a fresh one; its tensors are contiguous CPU tensors
        of the saved dtypes and global shapes, owned by the caller).

    Raises:
        CheckpointNotFoundError: no committed checkpoint (nor DCP folder) at ``path``.
        ManifestError, IntegrityError: the checkpoint is invalid or corrupt (a
            checksum mismatch, a file missing or short); IntegrityError too for
            a selected DCP value or tensor that only an unrestricted unpickler
            or an unsupported dtype could read (leave it out with ``keys``).
        ShardingError: a pattern of ``keys`` that selects no saved key.
        CheckpointError: the result would exceed ``max_bytes`` (nothing was
            allocated; the message names the sizes and the largest keys).
        ValueError: a malformed pattern or ``max_bytes``.
    """
    import torch

    from ..commit.leases import reader_lease
    from ..state.sharding import ShardedObject, torch_dtype
    from .load import _read_or_dcp, load

    opts = options or LoadOptions()
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes < 0):
        raise ValueError(f"read_state(max_bytes=...) must be an int >= 0 (bytes) or None, got {max_bytes!r}")
    pats, selected = _selector(keys)
    st, key = resolve(path, storage)
    where = st.url(key)
    # one reader lease for the whole read, the manifest's included: retention and gc keep the
    # checkpoint meanwhile (a lease that cannot be written: one warning, unless required)
    with reader_lease(st, key, what="read_state", required=opts.require_lease):
        st, m = _read_or_dcp(st, key, opts)  # the manifest, or a DCP folder presented as one
        tensors = [k for k in m.tensors if selected(k)]
        aliases = {a: t for a, t in m.aliases.items() if selected(a)}
        objects = [k for k in m.objects if selected(k)]
        values = [k for k in (m.values or {}) if selected(k)]
        # a DCP folder's values and tensors only an unrestricted unpickler (or another dtype) could
        # read (a conversion that left them out records them too: they are not there to return)
        refused = ({**(m.extra.get("dcp_skipped_values") or {}), **(m.extra.get("dcp_skipped_tensors") or {})}
                   if m.extra.get("source") == "dcp" else {})
        bad = sorted(k for k in refused if selected(k))
        if bad:
            raise IntegrityError(
                f"{where}: {len(bad)} selected key(s) can only be read by an unrestricted unpickler or are of "
                f"an unsupported dtype, and are refused: {bad[:5]} ({refused[bad[0]]}); select the rest with "
                "keys=[...]")
        every = [*m.tensors, *m.aliases, *m.objects, *(m.values or {}), *refused]
        for p in pats:
            if not any(_selector(p)[1](k) for k in every):
                raise ShardingError(f"{where}: read_state(keys=...): {p!r} selects no saved key (saved e.g. "
                                    f"{sorted(every)[:5]})")
        _check_size(m, where, tensors, aliases, objects, opts, max_bytes)
        # the target: every selected tensor whole (an alias whose target is not selected too,
        # as itself), every selected object element, every selected value
        state: dict[str, Any] = {}
        out_t: dict[str, torch.Tensor] = {}
        for k in tensors:
            te = m.tensors[k]
            out_t[k] = state[k] = torch.empty(tuple(te.global_shape), dtype=torch_dtype(te.dtype))
        for a, t in aliases.items():
            if t not in out_t:
                te = m.tensors[t]
                out_t[a] = state[a] = torch.empty(tuple(te.global_shape), dtype=torch_dtype(te.dtype))
        grids: dict[str, tuple[int, ...]] = {}
        for k in objects:
            oe = m.objects[k]
            grids[k] = tuple(oe.global_shape)
            state[k] = [ShardedObject(k, None, global_shape=tuple(oe.global_shape),
                                      global_offset=tuple(c.global_offset)) for c in oe.chunks]
        for k in values:
            state[k] = None
        res = load(state, key, group=SingleProcess(), strict=False, options=opts, storage=st, manifest=m)
        if res.missing:  # never hand back an element that was not read
            raise CheckpointError(f"{where}: {len(res.missing)} key(s) were not read: {list(res.missing)[:5]}")
        flat: dict[str, Any] = dict(out_t)
        for a, t in aliases.items():
            flat[a] = out_t[t] if t in out_t else out_t[a]
        for k in objects:
            flat[k] = _grid(grids[k], {off: v for (ok, off), v in res.objects.items() if ok == k})
        for k in values:
            flat[k] = res.values[k]
        return nest(m, flat)


def _grid(shape: tuple[int, ...], elements: dict[tuple[int, ...], Any]) -> Any:
    """The elements of an object grid: the value itself for shape ``()``, else
    nested lists in row-major grid order."""
    def build(prefix: tuple[int, ...]) -> Any:
        if len(prefix) == len(shape):
            return elements[prefix]
        return [build((*prefix, i)) for i in range(shape[len(prefix)])]

    return build(())


def _check_size(m: Manifest, where: str, tensors: list[str], aliases: dict[str, str], objects: list[str],
                opts: LoadOptions, max_bytes: int | None) -> None:
    """Refuse, before anything is allocated, a result larger than ``max_bytes``
    (what :func:`read_state` counts)."""
    sizes: dict[str, int] = {}
    for k in [*tensors, *(a for a, t in aliases.items() if t not in tensors)]:
        te = m.tensors[m.aliases.get(k, k)]
        sizes[k] = numel(te.global_shape) * itemsize(te.dtype)
    for k in objects:
        sizes[k] = sum(c.length for c in m.objects[k].chunks)
    result = sum(sizes.values())
    read = {m.aliases.get(k, k) for k in sizes if k not in m.objects}
    chunks = [c for k in read for c in m.tensors[k].chunks]
    buffers = sum(c.length for c in chunks if c.length < opts.direct_read_min_bytes)
    if m.extra.get("source") == "dcp" and chunks:  # a decoded DCP chunk per reader thread
        buffers += opts.threads * max(c.length for c in chunks)
    total = result + buffers
    limit = max_bytes
    how = "max_bytes"
    if limit is None:
        avail = available_memory()
        if avail is None:
            return
        limit = int(avail * DEFAULT_MEMORY_FRACTION)
        how = (f"the default limit: {DEFAULT_MEMORY_FRACTION:.0%} of the {avail / 2**20:.0f} MiB the "
               "system reports available")
    if total <= limit:
        return
    big = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    raise CheckpointError(
        f"{where}: read_state would need {total} bytes ({total / 2**20:.1f} MiB: {result} returned, "
        f"{buffers} of read buffers), more than {limit} bytes ({limit / 2**20:.1f} MiB, {how}); nothing "
        f"was allocated. The largest: {', '.join(f'{k} ({v / 2**20:.1f} MiB)' for k, v in big)}. Select "
        "less with keys=[...] or pass max_bytes=")


def _dcp_parts(k: str, path: Any) -> list[Any]:
    """The components of DCP key ``k``: its recorded path (str and int parts
    whose join is ``k``), else ``k`` itself."""
    if (isinstance(path, list) and path and all(type(c) in (int, str) for c in path)
            and ".".join(map(str, path)) == k):
        return list(path)
    return [_Key(k)]


def _split_path(path: str) -> list[Any]:
    return path.split(".") if path else []


def nest(m: Manifest, flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (saved key -> leaf) nested as :mod:`reshard.loading.read_state`
    describes: by the tree paths a DCP folder recorded, else by the subtrees
    the manifest records (``Manifest.adapters``); a key nothing describes
    stays whole. A level whose keys, made by splitting, are exactly
    ``0 .. n-1`` becomes a list."""
    dcp_paths = m.extra.get(DCP_TENSOR_PATHS)
    table = m.extra.get(DCP_VALUES)
    if isinstance(dcp_paths, dict) or isinstance(table, dict):
        paths: dict[str, list[Any]] = {}
        for k, p in (dcp_paths or {}).items():
            paths[k] = list(p)
        for k, entry in (table or {}).items():
            if isinstance(entry, list) and entry and isinstance(entry[0], list):
                paths[k] = list(entry[0])
        return _build({k: _dcp_parts(k, paths.get(k)) for k in flat}, flat, ints_list=True)
    subtrees = dict(m.adapters or {})
    # nodes the recorded subtree paths create (every dot-prefix of one)
    interior = {".".join(_split_path(p)[:i]) for p in subtrees for i in range(1, len(_split_path(p)))}
    interior |= {p for p in subtrees if p}
    ordered = sorted((p for p in subtrees if p), key=len, reverse=True)
    parts: dict[str, list[Any]] = {}
    for k in flat:
        s = next((p for p in ordered if k.startswith(p + ".")), None)
        if s is None:  # outside every recorded subtree: split at the deepest node there is
            node = next((p for p in sorted(interior, key=len, reverse=True) if k.startswith(p + ".")), None)
            parts[k] = [_Key(k)] if node is None else [*_split_path(node), _Key(k[len(node) + 1:])]
            continue
        rest = k[len(s) + 1:]
        inner: list[Any] = [_Key(rest)]
        if subtrees[s] == "optimizer" and rest.startswith("state.") and rest.count(".") >= 2:
            pid, name = rest[len("state."):].rsplit(".", 1)
            inner = [_Key("state"), _Key(int(pid) if pid.isdigit() else pid), _Key(name)]
        parts[k] = [*_split_path(s), *inner]
    return _build(parts, flat, ints_list=False)


class _Key:
    """A key taken as it is (an optimizer's parameter id): never part of a list."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


def _build(parts: dict[str, list[Any]], flat: dict[str, Any], *, ints_list: bool) -> dict[str, Any]:
    """Nest ``flat`` by ``parts`` (key -> path components; a :class:`_Key`
    component is a key of its level taken as it is, which keeps that level a
    dict). A key whose path would pass through a leaf, or end on a
    container, is kept whole at the root. A level of split components whose
    keys are exactly ``0 .. n-1`` is a list (ints from a DCP path with
    ``ints_list``, digit strings from a split subtree path)."""
    root: dict[Any, Any] = {}
    fixed: set[int] = {id(root)}  # levels never turned into a list (the root, a state_dict's keys)
    for k in sorted(flat):
        comps = parts[k]
        node: Any = root
        for c in comps[:-1]:
            ck = c.key if isinstance(c, _Key) else c
            if isinstance(c, _Key):
                fixed.add(id(node))
            nxt = node.setdefault(ck, {})
            if not isinstance(nxt, dict):  # a leaf there already
                node = None
                break
            node = nxt
        last = comps[-1]
        lk = last.key if isinstance(last, _Key) else last
        if node is None or lk in node:
            root[k] = flat[k]
            continue
        if isinstance(last, _Key):
            fixed.add(id(node))
        node[lk] = flat[k]

    def fix(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        out = {kk: fix(v) for kk, v in x.items()}
        if id(x) in fixed or not out:
            return out
        if ints_list:
            if all(type(kk) is int for kk in out) and sorted(out) == list(range(len(out))):
                return [out[i] for i in range(len(out))]
        elif all(type(kk) is str and kk.isdigit() for kk in out) and sorted(out, key=int) == [
                str(i) for i in range(len(out))]:
            return [out[str(i)] for i in range(len(out))]
        return out

    return fix(root)
