"""The non-tensor values of a DCP checkpoint, regrouped into the paths a load asks for.

DCP flattens a state dict to its leaves: ``sched.last_epoch``,
``optim.param_groups.0.lr``, ``data.sampler.epoch``. reshard names a plain
value by its tree path down to the first container without tensors, so the
same state asks for ``sched.last_epoch`` (a Stateful's mapping is walked) but
for ``optim.param_groups`` (one list) or ``data.sampler`` (one dict).
:func:`reshard.ondisk.dcp.open_dcp` keeps every DCP leaf as a value under its
own key and records in ``manifest.extra[DCP_VALUES]`` its state-dict path (the
default planner's ``planner_data``) and its default group (the largest
container without a tensor below it). :func:`regroup`, called by
:func:`reshard.load` with the value paths the target state asks for, builds
each asked-for value from the leaves below it (dicts for str keys, lists
where the keys are exactly ``0..n-1``); leaves nobody asked for are grouped
by their default group (what a strict load then reports as unexpected).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import ManifestError
from . import codec
from .manifest import Manifest

#: ``manifest.extra`` entry: DCP key -> ``[state-dict path, length of its default group]``
DCP_VALUES = "dcp_values"
#: ``manifest.extra`` entry: DCP tensor key -> its state-dict path (``planner_data``), where
#: the path is not the key itself (:func:`reshard.read_state` nests by it)
DCP_TENSOR_PATHS = "dcp_tensor_paths"


def _assemble(parts: list[tuple[tuple[Any, ...], Any]]) -> Any:
    """Rebuild one value from DCP-flattened pieces ``(relative path, value)``:
    dicts for str keys, lists where the keys are exactly 0..n-1."""
    if len(parts) == 1 and parts[0][0] == ():
        return parts[0][1]
    tree: dict[Any, Any] = {}
    for path, v in parts:
        node = tree
        for c in path[:-1]:
            node = node.setdefault(c, {})
            if not isinstance(node, dict):
                raise ValueError("a value is both a leaf and a container")
        node[path[-1]] = v

    def fix(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        out = {k: fix(v) for k, v in x.items()}
        if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        return out

    return fix(tree)


def _join(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def regroup(m: Manifest, requested: set[str] | frozenset[str]) -> Manifest:
    """``m`` with its DCP leaf values grouped into the ``requested`` value
    paths (the rest by their default groups); unchanged when ``m`` carries no
    DCP value table. A group with a leaf that could not be decoded is listed
    in ``extra["dcp_skipped_values"]`` under the group's path.

    Raises:
        ManifestError: the value table is malformed, or a value is both a
            leaf and a container.
    """
    table = m.extra.get(DCP_VALUES)
    if not isinstance(table, dict) or not table:
        return m
    vals = dict(m.values or {})
    skipped_leaf = dict(m.extra.get("dcp_skipped_values") or {})
    leaves: dict[str, tuple[tuple[Any, ...], int]] = {}
    for k, entry in table.items():
        try:
            path, cut = entry
            leaves[k] = (tuple(path), int(cut))
        except (TypeError, ValueError):
            raise ManifestError(f"manifest extra {DCP_VALUES!r}: malformed entry for {k!r}") from None
    # every prefix of every leaf path, by its dotted name
    by_prefix: dict[str, list[str]] = {}
    for k, (path, _cut) in leaves.items():
        for i in range(1, len(path) + 1):
            by_prefix.setdefault(_join(path[:i]), []).append(k)
    groups: dict[str, tuple[int, list[str]]] = {}  # group name -> (prefix length, leaves)
    claimed: set[str] = set()
    for r in sorted(requested, key=len):  # a shorter path claims first (a leaf is in one group)
        members = [k for k in by_prefix.get(r, ()) if k not in claimed]
        if members:
            n = next(i for i in range(1, len(leaves[members[0]][0]) + 1)
                     if _join(leaves[members[0]][0][:i]) == r)
            groups[r] = (n, members)
            claimed.update(members)
    for k, (path, cut) in leaves.items():
        if k not in claimed:
            name = _join(path[:cut])
            groups.setdefault(name, (cut, []))[1].append(k)
    out_vals = {k: v for k, v in vals.items() if k not in leaves}
    skipped = {k: v for k, v in skipped_leaf.items() if k not in leaves}
    for name, (n, members) in sorted(groups.items()):
        bad = [k for k in members if k in skipped_leaf or k not in vals]
        if bad:
            skipped[name] = skipped_leaf.get(bad[0], "not decoded")
            continue
        parts = [(leaves[k][0][n:], codec.from_json(vals[k])) for k in members]
        try:
            out_vals[name] = codec.to_json(_assemble(parts), path=name)
        except (TypeError, ValueError) as e:
            raise ManifestError(f"DCP value {name!r}: {e}") from None
    extra = {k: v for k, v in m.extra.items() if k not in (DCP_VALUES, "dcp_skipped_values")}
    if skipped:
        extra["dcp_skipped_values"] = skipped
    return msgspec.structs.replace(m, values=dict(sorted(out_vals.items())), extra=extra)
