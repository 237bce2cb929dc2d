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

    The walk is depth first, in each mapping's own order (a list's or tuple's
    by index); :class:`_Walk` has one step per kind of node.

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
    loaded = None if loaded_values is None else _Loaded(values=loaded_values, objects=loaded_objects)
    walk = _Walk(loaded=loaded, module_adapter=module_adapter)
    walk.container(state, "", (), _IDENTITY)
    return walk.out


#: version-1 naming rules: ``((v1_prefix, rel_prefix), ...)`` (see ``V1_NAMES``)
_Rules = tuple[tuple[str, str], ...]


@dataclass(frozen=True, kw_only=True)
class _Loaded:
    """What a load read, by checkpoint key: how a Stateful's state dict is
    rebuilt after the reads (:meth:`rebuild`). The two mappings are the
    caller's, filled after the walk and before any restore is called.

    Attributes:
        values: checkpoint key -> plain value loaded.
        objects: ``(checkpoint key, global_offset)`` -> the value of one
            ShardedObject grid element loaded.
    """

    values: dict[str, Any]
    objects: dict[tuple[str, tuple[int, ...]], Any]

    def rebuild(self, x: Any, path: str, cpath: str, root: bool = False) -> Any:
        """``x`` (at checkpoint key ``path``, held by the container at
        ``cpath``) with the loaded plain values and objects in place of its
        own; tensors stay themselves (filled in place). ``root``: ``x`` is
        the mapping a Stateful gave (rebuilt even when it holds only values).
        A mapping is rebuilt as its own type, a tuple as a tuple."""
        if isinstance(x, ShardedObject):
            key = (join(cpath, x.key), x.global_offset)
            return _with(x, "value", self.objects[key]) if key in self.objects else x
        if not root and path in self.values and kinds.handler_for(x) is None:
            return self.values[path]  # (a leaf a handler lowered to a value stays itself: restored)
        if isinstance(x, Mapping) and (root or _is_special(x)):
            d = {k: self.rebuild(v, join(path, k), path) for k, v in x.items()}
            return d if type(x) is dict else type(x)(d)  # type: ignore[call-arg]
        if isinstance(x, (list, tuple)) and _is_special(x):
            if x and _all_sharded(x):
                items = [self.rebuild(v, path, cpath) for v in x]
            else:
                items = [self.rebuild(v, join(path, i), path) for i, v in enumerate(x)]
            return type(x)(items) if isinstance(x, tuple) else items
        return x


def _below(path: str, tops: list[str]) -> bool:
    """Whether ``path`` is one of ``tops`` or lies below one (``""``: everything)."""
    return any(path == q or path.startswith(q + ".") or not q for q in tops)


class _Walk:
    """One walk of a state tree (:func:`flatten`): what it has gathered so far
    in :attr:`out`, and one method per kind of node.

    Every step takes the node ``x``, its checkpoint key ``path``, the key of
    the container holding it ``cpath`` (what a ShardedTensor's ``fqn`` is
    named below), the steps of its tree path ``tree`` (for messages: e.g.
    ``("['model']", "[0]")``) and the version-1 naming ``rules`` in force.
    The walk holds no reference cycle: dropping the returned :class:`Leaves`
    frees every tensor it holds without the cyclic garbage collector (the
    restore closures of a load refer to :class:`_Loaded`, not to the walk).
    """

    def __init__(self, *, loaded: _Loaded | None, module_adapter: Callable[[torch.nn.Module], Any]) -> None:
        self.out = Leaves()
        self.loaded = loaded
        self.loading = loaded is not None
        self.module_adapter = module_adapter
        #: checkpoint key -> (tree path parts, container of a ShardedTensor/ShardedObject or None)
        self.owner: dict[str, tuple[tuple[str, ...], str | None]] = {}
        #: paths whose subtree is not recorded further (optimizer state, or too many records)
        self.quiet: list[str] = []
        #: paths of mappings recorded as "tensors" (but the root): a plain mapping below one is part of it
        self.plains: list[str] = []

    # --------------------------------------------------------------- the bookkeeping

    def record(self, path: str, kind: str) -> None:
        """Record ``kind`` for the subtree at ``path`` in ``out.adapters``
        (not below optimizer state, nor a mapping of tensors below another;
        past :data:`MAX_ADAPTER_RECORDS`, nothing at all)."""
        if _below(path, self.quiet) or (kind == "tensors" and _below(path, self.plains)):
            return
        if kind == "tensors" and path:  # the root is a container, not one model, when it nests them
            self.plains.append(path)
        adapters = self.out.adapters
        if len(adapters) >= MAX_ADAPTER_RECORDS:
            adapters.clear()
            self.quiet.append("")
            return
        adapters[path] = kind
        if kind in NON_MODEL_KINDS:
            self.quiet.append(path)

    def claim(self, key: str, tree: tuple[str, ...], group: str | None) -> None:
        """Claim checkpoint key ``key`` for the leaf at ``tree``; ``group``:
        the container of a ShardedTensor/ShardedObject (its chunks share a
        key), :data:`_VALUE` for a plain value, None for a whole tensor.

        Raises:
            ShardingError: another leaf holds ``key`` (both tree paths named).
        """
        prev = self.owner.get(key)
        if prev is None:
            self.owner[key] = (tree, group)
            return
        if group is not None and prev[1] == group:
            return  # another chunk of the same tensor (element of the same grid)
        if self.loading and group != _VALUE and prev[1] != _VALUE:
            return  # at load, two destinations of one saved tensor are two requests
        raise ShardingError(
            f"checkpoint key {key!r} is given by two leaves: {_tree(prev[0])} and {_tree(tree)}; keys join tree "
            "paths with '.', so separate them: nest one under another key (e.g. "
            "{'model': ..., 'ema': ...}) or rename the tensor")

    # --------------------------------------------------------------- the nodes

    def container(self, m: Mapping[Any, Any], path: str, tree: tuple[str, ...], rules: _Rules) -> None:
        """A mapping (the root, a Stateful's state dict, a mapping holding
        something a handler takes): recorded at a save as optimizer state or
        a mapping of tensors, then each item walked below ``path``."""
        if not self.loading and path not in self.out.adapters:
            if _is_optimizer_dict(m):
                self.record(path, "optimizer")
            elif any(_is_tensor_leaf(v) for v in m.values()):
                self.record(path, "tensors")
        for k, v in m.items():
            self.walk(v, join(path, k), path, (*tree, f"[{k!r}]"), rules)

    def walk(self, x: Any, path: str, cpath: str, tree: tuple[str, ...], rules: _Rules) -> None:
        """Any object below the root: what the registry's handler for it
        makes of it (:meth:`place`); without a handler, a mapping, list or
        tuple holding something a handler takes is walked as a container,
        anything else is a plain value (:data:`kinds.PLAIN_VALUE`)."""
        handler = kinds.handler_for(x)
        if handler is None:
            if isinstance(x, Mapping) and _is_special(x):
                self.container(x, path, tree, rules)
                return
            if isinstance(x, (list, tuple)) and _is_special(x):
                for i, v in enumerate(x):
                    self.walk(v, join(path, i), path, (*tree, f"[{i}]"), rules)
                return
            handler = kinds.PLAIN_VALUE
        if not path:
            raise ShardingError("the root of the state must be a mapping")
        at = kinds.Where(key=path, container=cpath, loading=self.loading, module_adapter=self.module_adapter)
        form = handler.load(x, at) if self.loading else handler.save(x, at)
        self.place(x, form, handler, path, cpath, tree, rules)

    def place(self, x: Any, form: Any, handler: Any, path: str, cpath: str, tree: tuple[str, ...],
              rules: _Rules) -> None:
        """Put what ``handler`` made of leaf ``x`` (a form of :mod:`.kinds`) into ``out``.

        Raises:
            ShardingError: ``form`` is no form (or a Tree of ``x`` itself); a
                ShardedTensor's data is a tensor subclass; a key claimed twice.
        """
        out = self.out
        if isinstance(form, kinds.Sharded):
            self.sharded(x, form, cpath, tree, rules)
        elif isinstance(form, kinds.Replica):
            self.claim(path, tree, None)
            out.plain[path] = form.tensor
        elif isinstance(form, kinds.Distributed):
            self.claim(path, tree, None)
            out.dtensors[path] = form.dtensor
        elif isinstance(form, kinds.Value):
            self.claim(path, tree, _VALUE)
            out.values[path] = form.value
        elif isinstance(form, kinds.Tree) and form.subtree is not x:
            self.subtree(x, form, path, cpath, tree, rules)
        else:
            raise ShardingError(f"{path}: the handler {handler.name!r} made {type(form).__name__} of a "
                                f"{type(x).__name__}, not a form of reshard.state.kinds (Replica, Sharded, "
                                "Distributed, Value, or a Tree of something else)")

    def sharded(self, x: Any, form: kinds.Sharded, cpath: str, tree: tuple[str, ...], rules: _Rules) -> None:
        """This rank's chunks and grid elements of leaf ``x``, each renamed
        to its ``fqn`` (``key``) below ``cpath``, with its version-1 name."""
        for i, v in enumerate(form.items):
            if isinstance(v, ShardedTensor) and not kinds.is_plain_tensor(v.data):
                raise kinds.unknown_tensor(join(cpath, v.fqn), v.data, loading=self.loading,
                                           inside="the data of a ShardedTensor")
            name = join(cpath, v.fqn)
            self.claim(name, tree if v is x else (*tree, f"[{i}]"), cpath)
            v1 = v.fqn if rules == _IDENTITY else _v1_name(rules, v.fqn)
            if v1 != name:
                self.out.legacy[name] = v1
            (self.out.objects if isinstance(v, ShardedObject) else self.out.tensors).append(_renamed(v, name))

    def subtree(self, x: Any, form: kinds.Tree, path: str, cpath: str, tree: tuple[str, ...],
                rules: _Rules) -> None:
        """What stands for leaf ``x`` (a Stateful's state dict, a module's
        ModelState, a handler's conversion): a mapping is walked as a
        container at ``path`` (recorded at a save as ``form.record`` says),
        anything else in ``x``'s place; at a load, ``form.restore`` is queued
        after the restores of everything below."""
        sub, whole = form.subtree, isinstance(form.subtree, Mapping)
        inner = (*tree, form.label) if form.label else tree
        sub_rules = rules if form.v1_names is None else form.v1_names
        if whole:
            if not self.loading and form.record is not None:
                self.record(path, form.record)
            self.container(sub, path, inner, sub_rules)
        else:
            self.walk(sub, path, cpath, inner, sub_rules)
        if self.loaded is not None and form.restore is not None:
            self.out.statefuls.append((path, x, functools.partial(
                _restore, form.restore, functools.partial(self.loaded.rebuild, sub, path, cpath, whole))))


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
