"""Walking the state tree (DESIGN.md section 2: a leaf's checkpoint key is its tree path).

Leaves: what each object is, the walk asks the registry of kinds of state
(:mod:`reshard.state.kinds`: one handler per kind, tried along the object's
MRO): ``ShardedTensor`` (or a list/tuple of them: several views of one local
buffer), ``ShardedObject``, ``torch.Tensor`` / ``numpy.ndarray`` (plain
tensors: replicated; a tensor subclass no handler takes is refused),
``DTensor`` (sharded as its placements say), Stateful objects
(``state_dict()``/``load_state_dict()``, whose mapping is walked the same
way; an ``nn.Module`` is walked as :class:`~reshard.ModelState` of it) and
plain values. A container (mapping, list, tuple) that holds nothing a handler
takes is one plain value.

Naming (format version 2):

* A leaf's key is its tree path, the keys from the root joined with ``.``;
  keys may contain ``.`` themselves, so ``{"model": model.state_dict()}``
  saves ``model.0.weight`` as DCP does. List and tuple items are keyed by
  their index.
* A ``ShardedTensor``'s ``fqn`` (a ``ShardedObject``'s ``key``) takes the place
  of the key under which it sits, below its container's path: at the root,
  ``{"mlp.gate": ShardedTensor("mlp.gate", ...)}`` is ``mlp.gate``; under
  ``"model"`` it is ``model.mlp.gate``. A list or tuple made only of them is
  several views: each view takes the place of the list's key.
* Two leaves that map to one key raise ShardingError naming both tree paths.
  Several ShardedTensors (or ShardedObjects) of one name inside one container
  are chunks of one tensor (elements of one grid), not a collision; at load,
  several tensor leaves of one key are several destinations of one tensor.

Adapters name their tensors relative to their own position and never see
absolute names: at load, :func:`scoped_manifest` presents the manifest to a
``reshard_prepare_load`` hook as seen from the adapter's position.

Checkpoints of format version 1 named a ShardedTensor/ShardedObject by its own
fqn alone (no container path) and adapters by fixed prefixes; every leaf
records that name in :attr:`Leaves.legacy`, so :func:`reshard.load` migrates
such a checkpoint's names to the new ones (see ``V1_NAMES``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from ..errors import ShardingError
from . import kinds
from .kinds import (  # noqa: F401 - the probes live with the handlers; their old names stay importable here
    _IDENTITY,
    _WALKING,
    V1_NAMES,
    adapter_kind,
    is_dtensor,
    is_stateful,
    v1_rules,
    walking,
)
from .sharding import ShardedObject, ShardedTensor


def _is_special(x: Any) -> bool:
    """True when ``x`` is not a plain value: a handler takes it, or it is a
    container holding something a handler takes."""
    if kinds.handler_for(x) is not None:
        return True
    if isinstance(x, Mapping):
        return any(_is_special(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_is_special(v) for v in x)
    return False


def _check_key(where: str, key: Any) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise ShardingError(f"{where}: state keys must be str or int, got {type(key).__name__} {key!r}")
    k = str(key)
    if not k:
        raise ShardingError(f"{where}: empty key")
    return k


def join(prefix: str, key: Any) -> str:
    """The checkpoint key of ``key`` below ``prefix`` (``""`` at the root)."""
    k = _check_key(prefix or "<root>", key)
    return f"{prefix}.{k}" if prefix else k


def _v1_name(rules: tuple[tuple[str, str], ...], rel: str) -> str:
    for v1, mine in rules:
        if not mine or mine.endswith("."):
            if rel.startswith(mine):
                return v1 + rel[len(mine):]
        elif rel == mine:
            return v1
    return rel


def _v1_rel(rules: tuple[tuple[str, str], ...], name: str) -> str | None:
    """Inverse of :func:`_v1_name`: the relative name of version-1 ``name``, if it is one."""
    for v1, mine in rules:
        if not v1 or v1.endswith("."):
            if name.startswith(v1):
                return mine + name[len(v1):]
        elif name == v1:
            return mine
    return None if rules else name


@dataclass
class Leaves:
    """The flattened state: what a save writes or a load fills. Every name is a
    checkpoint key (ShardedTensors and ShardedObjects are renamed copies)."""

    tensors: list[ShardedTensor] = field(default_factory=list)
    #: plain tensors by path (replicated at save, "the whole tensor" at load)
    plain: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: list[ShardedObject] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    dtensors: dict[str, Any] = field(default_factory=dict)
    #: at load, what to do once every rank's reads succeeded, in post-order (a
    #: leaf before what holds it): ``(path, object, restore)``, where
    #: ``restore()`` hands a Stateful its rebuilt state dict (``load_state_dict``)
    #: or calls a handler's ``Tree.restore`` (:mod:`reshard.state.kinds`)
    statefuls: list[tuple[str, Any, Callable[[], None]]] = field(default_factory=list)
    #: checkpoint key -> the name format version 1 gave it, where they differ
    legacy: dict[str, str] = field(default_factory=dict)
    #: what holds each subtree (tree path -> kind, see :func:`adapter_kind`),
    #: recorded in the manifest as ``Manifest.adapters``
    adapters: dict[str, str] = field(default_factory=dict)


def _renamed(x: Any, name: str) -> Any:
    if x.fqn == name:
        return x
    return _with(x, "key" if isinstance(x, ShardedObject) else "fqn", name)


def _with(x: Any, field_name: str, value: Any) -> Any:
    """A copy of the (validated) ShardedTensor or ShardedObject ``x`` with
    one field changed, without validating its geometry again
    (``dataclasses.replace`` would: once per parameter, for the optimizer's
    hyperparameter objects, it cost loads measurable time)."""
    out = object.__new__(type(x))
    d = out.__dict__
    d.update(x.__dict__)
    d[field_name] = value
    return out


def _all_sharded(x: Any) -> bool:
    return all(isinstance(v, (ShardedTensor, ShardedObject)) for v in x)


def _tree(parts: tuple[str, ...]) -> str:
    return "state" + "".join(parts)


#: the claim group of a plain value (never shared with a tensor, even at load)
_VALUE = "\x00value"


#: a ``reshard_prepare_load`` hook returns ``{HANDLED: [keys]}`` for saved keys
#: it consumes by a rule of its own (e.g. RNG streams re-derived for another
#: grid), so they are not reported as unexpected.
HANDLED = "reshard.handled_keys"


#: kinds in :attr:`Leaves.adapters` whose subtree is not model weights
NON_MODEL_KINDS = frozenset({"OptimizerState", "optimizer", "RNGState", "DataCursor"})
#: at most this many subtrees are recorded (a tree of more is not recorded at all)
MAX_ADAPTER_RECORDS = 4096


def _is_tensor_leaf(v: Any) -> bool:
    if isinstance(v, ShardedTensor):
        return len(v.global_shape) > 0
    if isinstance(v, (list, tuple)):
        return bool(v) and all(isinstance(x, ShardedTensor) for x in v) and _is_tensor_leaf(v[0])
    return isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim > 0


def _is_optimizer_dict(m: Mapping[Any, Any]) -> bool:
    """The shape of ``torch.optim.Optimizer.state_dict()`` (and of DCP's
    ``get_optimizer_state_dict``): ``{"state": {...}, "param_groups": [...]}``."""
    return "state" in m and "param_groups" in m and isinstance(m["state"], Mapping)


def flatten(
    state: Mapping[str, Any],
    *,
    loaded_values: dict[str, Any] | None = None,
    loaded_objects: dict[tuple[str, tuple[int, ...]], Any] | None = None,
    module_adapter: Callable[[torch.nn.Module], Any],
) -> Leaves:
    """Flatten ``state`` into leaves named by checkpoint key.

    Each object below the root is what the handler that takes it says
    (:mod:`reshard.state.kinds`: ``save`` at a save, ``load`` at a load).
    With ``loaded_values`` (key -> value) and ``loaded_objects`` ((key,
    global_offset) -> value), at load, each Stateful gets a closure that
    rebuilds its state dict with the loaded plain values and objects in place
    of its own (tensors are filled in place) and calls its
    ``load_state_dict`` (a handler's ``Tree.restore`` likewise).
    ``module_adapter`` presents an ``nn.Module`` leaf as a Stateful
    (:class:`reshard.ModelState`; passed in, so the walk knows no adapter).

    Raises:
        ShardingError: a key that is not a str or int, or is empty; two leaves
            that map to one checkpoint key (both tree paths named); a root that
            is not a mapping; an object array; a tensor subclass that no
            handler takes, as a leaf, a ShardedTensor's data or a DTensor's
            local tensor (its key and type named).
    """
    if loaded_objects is None:
        loaded_objects = {}
    if not isinstance(state, Mapping):
        raise ShardingError(f"state must be a mapping, got {type(state).__name__}")
    out = Leaves()
    #: checkpoint key -> (tree path parts, container of a ShardedTensor/ShardedObject or None)
    owner: dict[str, tuple[tuple[str, ...], str | None]] = {}
    loading = loaded_values is not None
    #: paths whose subtree is not recorded further (optimizer state, or too many records)
    quiet: list[str] = []

    #: paths of mappings recorded as "tensors" (but the root): a plain mapping below one is part of it
    plains: list[str] = []

    def below(path: str, tops: list[str]) -> bool:
        return any(path == q or path.startswith(q + ".") or not q for q in tops)

    def record(path: str, kind: str) -> None:
        if below(path, quiet) or (kind == "tensors" and below(path, plains)):
            return
        if kind == "tensors" and path:  # the root is a container, not one model, when it nests them
            plains.append(path)
        if len(out.adapters) >= MAX_ADAPTER_RECORDS:
            out.adapters.clear()
            quiet.append("")
            return
        out.adapters[path] = kind
        if kind in NON_MODEL_KINDS:
            quiet.append(path)

    def claim(key: str, tree: tuple[str, ...], group: str | None) -> None:
        prev = owner.get(key)
        if prev is None:
            owner[key] = (tree, group)
            return
        if group is not None and prev[1] == group:
            return  # another chunk of the same tensor (element of the same grid)
        if loading and group != _VALUE and prev[1] != _VALUE:
            return  # at load, two destinations of one saved tensor are two requests
        raise ShardingError(
            f"checkpoint key {key!r} is given by two leaves: {_tree(prev[0])} and {_tree(tree)}; keys join tree "
            "paths with '.', so separate them: nest one under another key (e.g. "
            "{'model': ..., 'ema': ...}) or rename the tensor")

    def rebuild(x: Any, path: str, cpath: str, root: bool = False) -> Any:
        if loaded_values is None:
            return x
        if isinstance(x, ShardedObject):
            key = (join(cpath, x.key), x.global_offset)
            return _with(x, "value", loaded_objects[key]) if key in loaded_objects else x
        if not root and path in loaded_values and kinds.handler_for(x) is None:
            return loaded_values[path]  # (a leaf a handler lowered to a value stays itself: restored)
        if isinstance(x, Mapping) and (root or _is_special(x)):
            d = {k: rebuild(v, join(path, k), path) for k, v in x.items()}
            return d if type(x) is dict else type(x)(d)  # type: ignore[call-arg]
        if isinstance(x, (list, tuple)) and _is_special(x):
            if x and _all_sharded(x):
                items = [rebuild(v, path, cpath) for v in x]
            else:
                items = [rebuild(v, join(path, i), path) for i, v in enumerate(x)]
            return type(x)(items) if isinstance(x, tuple) else items
        return x

    def sharded(x: Any, cpath: str, tree: tuple[str, ...], rules: tuple[tuple[str, str], ...]) -> None:
        name = join(cpath, x.fqn)
        claim(name, tree, cpath)
        v1 = x.fqn if rules == _IDENTITY else _v1_name(rules, x.fqn)
        if v1 != name:
            out.legacy[name] = v1
        (out.objects if isinstance(x, ShardedObject) else out.tensors).append(_renamed(x, name))

    def walk(x: Any, path: str, cpath: str, tree: tuple[str, ...],
             rules: tuple[tuple[str, str], ...]) -> None:
        handler = kinds.handler_for(x)
        if handler is None:
            if isinstance(x, Mapping) and _is_special(x):
                walk_container(x, path, tree, rules)
                return
            if isinstance(x, (list, tuple)) and _is_special(x):
                for i, v in enumerate(x):
                    walk(v, join(path, i), path, (*tree, f"[{i}]"), rules)
                return
            handler = kinds.PLAIN_VALUE
        if not path:
            raise ShardingError("the root of the state must be a mapping")
        at = kinds.Where(key=path, container=cpath, loading=loading, module_adapter=module_adapter)
        form = handler.load(x, at) if loading else handler.save(x, at)
        place(x, form, handler, path, cpath, tree, rules)

    def place(x: Any, form: Any, handler: Any, path: str, cpath: str, tree: tuple[str, ...],
              rules: tuple[tuple[str, str], ...]) -> None:
        """Put what ``handler`` made of leaf ``x`` (a form of :mod:`.kinds`) into ``out``."""
        if isinstance(form, kinds.Sharded):
            for i, v in enumerate(form.items):
                if isinstance(v, ShardedTensor) and not kinds.is_plain_tensor(v.data):
                    raise kinds.unknown_tensor(join(cpath, v.fqn), v.data, loading=loading,
                                               inside="the data of a ShardedTensor")
                sharded(v, cpath, tree if v is x else (*tree, f"[{i}]"), rules)
        elif isinstance(form, kinds.Replica):
            claim(path, tree, None)
            out.plain[path] = form.tensor
        elif isinstance(form, kinds.Distributed):
            claim(path, tree, None)
            out.dtensors[path] = form.dtensor
        elif isinstance(form, kinds.Value):
            claim(path, tree, _VALUE)
            out.values[path] = form.value
        elif isinstance(form, kinds.Tree) and form.subtree is not x:
            sub, whole = form.subtree, isinstance(form.subtree, Mapping)
            inner = (*tree, form.label) if form.label else tree
            sub_rules = rules if form.v1_names is None else form.v1_names
            if whole:
                if not loading and form.record is not None:
                    record(path, form.record)
                walk_container(sub, path, inner, sub_rules)
            else:
                walk(sub, path, cpath, inner, sub_rules)
            if loading and form.restore is not None:
                out.statefuls.append((path, x, functools.partial(
                    _restore, form.restore, functools.partial(rebuild, sub, path, cpath, whole))))
        else:
            raise ShardingError(f"{path}: the handler {handler.name!r} made {type(form).__name__} of a "
                                f"{type(x).__name__}, not a form of reshard.state.kinds (Replica, Sharded, "
                                "Distributed, Value, or a Tree of something else)")

    def walk_container(m: Mapping[Any, Any], path: str, tree: tuple[str, ...],
                       rules: tuple[tuple[str, str], ...]) -> None:
        if not loading and path not in out.adapters:
            if _is_optimizer_dict(m):
                record(path, "optimizer")
            elif any(_is_tensor_leaf(v) for v in m.values()):
                record(path, "tensors")
        for k, v in m.items():
            walk(v, join(path, k), path, (*tree, f"[{k!r}]"), rules)

    try:
        walk_container(state, "", (), _IDENTITY)
    finally:
        # walk and walk_container refer to each other: break that cycle, which
        # would otherwise keep `out` (and every tensor of the state) alive
        # after the caller drops it, until the cyclic garbage collector runs
        walk = walk_container = place = None  # type: ignore[assignment]
    return out


def _restore(restore: Callable[[Any], None], rebuilt: Callable[[], Any]) -> None:
    restore(rebuilt())


def positions(state: Any) -> Iterator[tuple[str, Any]]:
    """``(checkpoint key, object)`` of every object reachable from ``state``
    through mappings, lists and tuples (never calling ``state_dict()``), depth
    first, each object once."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        path, x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield path, x
        if isinstance(x, Mapping):
            stack.extend(reversed([(join(path, k), v) for k, v in x.items()]))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed([(join(path, i), v) for i, v in enumerate(x)]))


def scoped_manifest(m: Any, path: str, rules: tuple[tuple[str, str], ...] = (("", ""),)) -> Any:
    """The manifest ``m`` as seen from position ``path``: the tensors,
    objects, aliases and common values whose keys lie below ``path``, with
    ``path.`` stripped (at the root, ``m`` itself). For a format-version-1
    checkpoint, the names are those the adapter's ``V1_NAMES`` rules give."""
    legacy = m.format_version < 2
    if not path and not legacy:
        return m
    pre = f"{path}." if path else ""

    def rel(name: str) -> str | None:
        if legacy:
            return _v1_rel(rules, name)
        return name[len(pre):] if name.startswith(pre) else None

    def scope(d: Mapping[str, Any]) -> dict[str, Any]:
        return {r: v for k, v in d.items() if (r := rel(k)) is not None}

    tensors, objects = scope(m.tensors), scope(m.objects)
    aliases = {}
    for k, t in m.aliases.items():
        rk, rt = rel(k), rel(t)
        if rk is not None and rt is not None:
            aliases[rk] = rt
    # common values are named by their tree path in both versions
    values = ({k[len(pre):]: v for k, v in m.values.items() if k.startswith(pre)}
              if isinstance(m.values, Mapping) else m.values)
    return msgspec.structs.replace(m, tensors=tensors, objects=objects, aliases=aliases, values=values)
