"""Walking the state tree.

Leaves: ``ShardedTensor`` (or a list/tuple of them: several views of one
local buffer), ``ShardedObject``, ``torch.Tensor`` / ``numpy.ndarray`` (plain
tensors: replicated), ``DTensor`` (sharded as its placements say), Stateful
objects (``state_dict()``/``load_state_dict()``, whose mapping is walked the
same way) and plain values. A container (mapping, list, tuple) that holds
none of the special leaves is one plain value. Paths join keys with ``.``; a
key containing ``.`` is a ShardingError. A ShardedTensor's own fqn is
authoritative; every other leaf is named by its path.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from .errors import ShardingError
from .sharding import ShardedObject, ShardedTensor


def is_stateful(x: Any) -> bool:
    return (
        not isinstance(x, type)
        and callable(getattr(x, "state_dict", None))
        and callable(getattr(x, "load_state_dict", None))
    )


def is_dtensor(x: Any) -> bool:
    """True for a DTensor (without importing DTensor support when no DTensor
    can exist yet: the import costs about half a second)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dt = getattr(mod, "DTensor", None) if mod is not None else None
    return dt is not None and isinstance(x, dt)


def _is_special(x: Any) -> bool:
    if isinstance(x, (ShardedTensor, ShardedObject, torch.Tensor, np.ndarray)) or is_stateful(x):
        return True
    if isinstance(x, Mapping):
        return any(_is_special(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_is_special(v) for v in x)
    return False


def _join(prefix: str, key: Any) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise ShardingError(
            f"{prefix or '<root>'}: state keys must be str or int, got {type(key).__name__} {key!r}"
        )
    k = str(key)
    if "." in k:
        raise ShardingError(
            f"{prefix or '<root>'}: key {k!r} contains '.', which joins tree paths "
            "(nest the mapping instead, or wrap a module in reshard.ModelState)"
        )
    if not k:
        raise ShardingError(f"{prefix or '<root>'}: empty key")
    return f"{prefix}.{k}" if prefix else k


@dataclass
class Leaves:
    """The flattened state: what a save writes or a load fills."""

    tensors: list[ShardedTensor] = field(default_factory=list)
    #: plain tensors by path (replicated at save, "the whole tensor" at load)
    plain: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: list[ShardedObject] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    dtensors: dict[str, Any] = field(default_factory=dict)
    #: Stateful objects with the rebuilt state dict to hand back at load
    statefuls: list[tuple[str, Any, Callable[[], Any]]] = field(default_factory=list)


def flatten(
    state: Mapping[str, Any],
    *,
    loaded_values: dict[str, Any] | None = None,
    loaded_objects: dict[tuple[str, tuple[int, ...]], Any] | None = None,
) -> Leaves:
    """Flatten ``state`` into leaves.

    With ``loaded_values`` (path -> value) and ``loaded_objects`` ((key,
    global_offset) -> value), at load, each Stateful gets a closure that
    rebuilds its state dict with the loaded plain values and objects in place
    of its own (tensors are filled in place), ready for ``load_state_dict``.
    """
    if loaded_objects is None:
        loaded_objects = {}
    if not isinstance(state, Mapping):
        raise ShardingError(f"state must be a mapping, got {type(state).__name__}")
    out = Leaves()
    seen_paths: set[str] = set()

    def rebuild(x: Any, path: str, root: bool = False) -> Any:
        if loaded_values is None:
            return x
        if isinstance(x, ShardedObject):
            key = (x.key, x.global_offset)
            return replace(x, value=loaded_objects[key]) if key in loaded_objects else x
        if not root and path in loaded_values:
            return loaded_values[path]
        if isinstance(x, Mapping) and (root or _is_special(x)):
            d = {k: rebuild(v, _join(path, k)) for k, v in x.items()}
            return d if type(x) is dict else type(x)(d)  # type: ignore[call-arg]
        if isinstance(x, (list, tuple)) and _is_special(x) and not _all_sharded(x):
            items = [rebuild(v, _join(path, i)) for i, v in enumerate(x)]
            return type(x)(items) if isinstance(x, tuple) else items
        return x

    def walk(x: Any, path: str) -> None:
        if path in seen_paths:
            raise ShardingError(f"{path}: two leaves map to the same path (keys '1' and 1?)")
        if isinstance(x, ShardedTensor):
            out.tensors.append(x)
        elif isinstance(x, ShardedObject):
            out.objects.append(x)
        elif isinstance(x, (list, tuple)) and x and _all_sharded(x):
            out.tensors.extend(x)
        elif is_dtensor(x):
            out.dtensors[path] = x
        elif isinstance(x, torch.Tensor):
            out.plain[path] = x
        elif isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise ShardingError(f"{path}: NumPy object arrays cannot be saved")
            out.plain[path] = torch.from_numpy(x) if x.flags.writeable else torch.from_numpy(x.copy())
        elif is_stateful(x) and not isinstance(x, Mapping):
            sd = x.state_dict()
            if not isinstance(sd, Mapping):
                raise ShardingError(f"{path}: state_dict() returned {type(sd).__name__}, not a mapping")
            walk_container(sd, path)
            out.statefuls.append((path, x, functools.partial(rebuild, sd, path, True)))
            return
        elif isinstance(x, Mapping) and _is_special(x):
            walk_container(x, path)
            return
        elif isinstance(x, (list, tuple)) and _is_special(x):
            for i, v in enumerate(x):
                walk(v, _join(path, i))
            return
        else:
            if not path:
                raise ShardingError("the root of the state must be a mapping")
            out.values[path] = x
        seen_paths.add(path)

    def walk_container(m: Mapping[Any, Any], path: str) -> None:
        for k, v in m.items():
            walk(v, _join(path, k))

    try:
        walk_container(state, "")
    finally:
        # walk and walk_container refer to each other: break that cycle, which
        # would otherwise keep `out` (and every tensor of the state) alive
        # after the caller drops it, until the cyclic garbage collector runs
        walk = walk_container = None  # type: ignore[assignment]
    return out


def _all_sharded(x: Any) -> bool:
    return all(isinstance(v, ShardedTensor) for v in x)
