"""Kinds of state: what each object of a state tree is, in one registry.

The walk of a state tree (:func:`reshard.state.tree.flatten`, at every save
and load, on every rank, on the caller's thread) asks this registry which
handler takes each object it meets below the root mapping, and the handler
says what the object is in reshard's data model: a *form*.

Forms (what :meth:`KindHandler.save` and :meth:`KindHandler.load` return):

* :class:`Replica`: a whole tensor that every rank holding it holds alike (a
  plain tensor): saved once, its copies compared across ranks; at load "the
  whole tensor", filled in place.
* :class:`Sharded`: this rank's chunks (``ShardedTensor``) and grid elements
  (``ShardedObject``), each named by its own ``fqn`` / ``key`` below the
  leaf's container; at load the chunks' ``data`` are filled in place.
* :class:`Distributed`: a DTensor, chunked as its placements say (at load in
  its own mesh and placements).
* :class:`Value`: a plain value (common state: the typed, pickle-free codec,
  equal on every rank).
* :class:`Tree`: another object (or a mapping of them) that stands in the
  leaf's place and is asked its kind in turn, with an optional ``restore``
  called after the reads (how a Stateful, an ``nn.Module`` or a tensor
  subclass that reshard does not know is lowered to the forms above).

The order the registry tries handlers for an object ``x`` (:func:`handler_for`):

1. the classes of ``type(x).__mro__``, most derived first: the handler
   registered for a class (or for its qualified name, ``module.qualname``,
   which needs no import of the class's package) is asked ``accepts(x)``; the
   first that accepts takes ``x``. A handler for a subclass is so tried
   before one for its base (a handler registered for a tensor subclass
   before the plain-tensor one registered for ``torch.Tensor``), as
   ``functools.singledispatch`` and Orbax's leaf handler registry resolve;
2. a ``torch.Tensor`` that no handler accepted is refused
   (:data:`UNKNOWN_TENSOR`): one ``ShardingError`` naming its key and type and
   how to register a handler, raised by the walk before any file is written
   or any target is changed, and so agreed on every rank;
3. otherwise the walk decides: a mapping, list or tuple that holds anything a
   handler takes is walked as a container (its items keyed below it); any
   other object is a plain value (:data:`PLAIN_VALUE`).

Plain tensors are a stated list (:data:`PLAIN_TENSOR_TYPES`, by exact type):
``torch.Tensor``, ``torch.nn.Parameter``, FSDP1's ``FlatParameter`` (a
Parameter over its own flat storage) and ``FakeTensor`` (a load target only:
the load's check refuses it, naming ``to_empty()``). Any other subclass (a
wrapper subclass made with ``torch.Tensor._make_wrapper_subclass``, torchao's
quantized and float8 tensors, bitsandbytes' ``Params4bit``, a lazy module's
``UninitializedParameter``) is refused, never saved as its raw storage,
unless a handler registered for it converts it; so is such a tensor as the
``data`` of a ``ShardedTensor`` or the local tensor of a ``DTensor``.

Registering a handler: ``reshard.register_state_kind(cls_or_qualified_name,
handler)`` (this module's :func:`register`) in the module that defines the
handler, once, at import (docs/extending.md walks one). The built-in handlers are registered at the bottom of this module, in
one table.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import ShardingError
from .sharding import ShardedObject, ShardedTensor

# ----------------------------------------------------------------------------- probes

_WALKING: contextvars.ContextVar[bool] = contextvars.ContextVar("reshard_walking", default=False)


def walking() -> bool:
    """True inside a ``state_dict()`` call made by reshard's walk of a state
    (``reshard.save`` / ``reshard.load``); False when anyone else calls it
    (``torch.distributed.checkpoint.save``, user code). A Stateful may then
    return a form that other tools store faithfully (plain values, no
    ShardedObject): :class:`~reshard.DataCursor` does."""
    return _WALKING.get()


#: Name of an optional attribute of a Stateful: ``((v1_prefix, rel_prefix), ...)``
#: saying how format version 1 named what its ``state_dict()`` now names
#: relative to its position: a relative name starting with ``rel_prefix`` was
#: ``v1_prefix + rest`` (a prefix that is neither empty nor ends with ``.`` is an
#: exact name). Pairs are tried in order; without the attribute a relative
#: name was the version-1 name as it is.
V1_NAMES = "_reshard_v1_names"

_IDENTITY: tuple[tuple[str, str], ...] = (("", ""),)


def v1_rules(x: Any) -> tuple[tuple[str, str], ...]:
    return tuple(getattr(x, V1_NAMES, None) or _IDENTITY)


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


def adapter_kind(x: Any) -> str:
    """The kind recorded for Stateful ``x``: the class name for reshard's own
    adapters (``"ModelState"``, ``"TorchState"``, ``"OptimizerState"``...),
    ``"Stateful:<qualified name>"`` for any other."""
    cls = type(x)
    if cls.__module__.startswith("reshard."):
        return cls.__name__
    return f"Stateful:{cls.__module__}.{cls.__qualname__}"


def qualified_name(cls: type) -> str:
    """``cls.__module__ + "." + cls.__qualname__``: how the registry and its
    messages name a class (``"torch.Tensor"``, ``"torchao.quantization.Int8Tensor"``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


#: The tensor types saved and loaded as plain tensors (exact types, by
#: qualified name: no import of FSDP or fake tensors is needed to state them)
PLAIN_TENSOR_TYPES: tuple[str, ...] = (
    "torch.Tensor",
    "torch.nn.parameter.Parameter",
    "torch.distributed.fsdp._flat_param.FlatParameter",  # FSDP1: a Parameter over its own flat storage
    "torch._subclasses.fake_tensor.FakeTensor",  # a load target the load's check refuses (to_empty())
)
_FAKE = "torch._subclasses.fake_tensor.FakeTensor"
_PLAIN_NAMES = ", ".join(n.rsplit(".", 1)[-1] for n in PLAIN_TENSOR_TYPES)
_PLAIN: dict[type, bool] = {}


def is_plain_tensor(x: Any) -> bool:
    """True when ``x``'s exact type is one of :data:`PLAIN_TENSOR_TYPES`."""
    t = type(x)
    got = _PLAIN.get(t)
    if got is None:
        got = _PLAIN[t] = issubclass(t, torch.Tensor) and qualified_name(t) in PLAIN_TENSOR_TYPES
    return got


def unknown_tensor(key: str, t: Any, *, loading: bool, inside: str = "") -> ShardingError:
    """The one-line refusal of tensor ``t`` at checkpoint key ``key``: its
    type, the plain types, and how to register a handler (``inside``: "the
    data of a ShardedTensor", "the local tensor of a DTensor", where the
    tensor is not a leaf of its own)."""
    name = qualified_name(type(t))
    what = f"{inside}, a {name}" if inside else f"a {name}"
    if isinstance(t, getattr(torch.nn.parameter, "UninitializedTensorMixin", ())):
        how = "materialise the lazy module first (one forward pass)"
    elif inside:
        how = "convert it to a plain tensor first"
    else:
        how = (f"register a handler for it (reshard.register_state_kind({name!r}, handler); "
               "docs/extending.md) or convert it to a plain tensor first")
    return ShardingError(
        f"{key}: cannot {'load into' if loading else 'save'} {what}: a tensor subclass that no handler of "
        f"reshard.state.kinds takes (plain tensors are {_PLAIN_NAMES}; another "
        f"subclass's raw storage is not its value); {how}")


# ----------------------------------------------------------------------------- forms


@dataclass(frozen=True)
class Replica:
    """A whole tensor every rank holding it holds alike (``tensor``, of a
    type in :data:`PLAIN_TENSOR_TYPES`); at load, the whole tensor, filled in place."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Sharded:
    """This rank's chunks and grid elements, each named by its own ``fqn``
    (``key``) below the leaf's container (:attr:`Where.container`), as a
    ``ShardedTensor`` in a state dict is. A ``ShardedTensor``'s ``data`` must
    be a plain tensor; at load it is filled in place."""

    items: tuple[ShardedTensor | ShardedObject, ...]


@dataclass(frozen=True)
class Distributed:
    """A DTensor: its chunks are those its placements give this rank (at load,
    in its own mesh and placements); its local tensor must be a plain tensor."""

    dtensor: Any


@dataclass(frozen=True)
class Value:
    """A plain value: common state, equal on every rank, stored in the typed,
    pickle-free codec (:mod:`reshard.ondisk.codec`)."""

    value: Any


@dataclass(frozen=True)
class Tree:
    """``subtree`` stands in the leaf's place and is walked in turn.

    A mapping's keys join below the leaf's key (``{"qdata": t}`` under key
    ``w`` saves ``w.qdata``); anything else stands at the leaf's key itself
    and is asked its kind (an ``nn.Module`` stands as its ``ModelState``).

    Attributes:
        subtree: what stands for the leaf (never the leaf itself).
        restore: at load only: called once, after every rank's reads
            succeeded and before the ``load_state_dict`` of any Stateful that
            holds the leaf, with ``subtree`` rebuilt: tensors filled in place,
            plain values and objects as loaded. None: nothing to do (the
            subtree's tensors are the leaf's own memory).
        record: at save: the kind recorded for the leaf's key in
            ``Manifest.adapters`` (a Stateful's class); None records nothing
            more than a mapping of tensors would.
        v1_names: how format version 1 named the subtree's keys (a Stateful's
            ``_reshard_v1_names``); None: as its container did.
        label: how messages name this step of the tree path.
    """

    subtree: Any
    restore: Callable[[Any], None] | None = field(default=None, kw_only=True)
    record: str | None = field(default=None, kw_only=True)
    v1_names: tuple[tuple[str, str], ...] | None = field(default=None, kw_only=True)
    label: str | None = field(default=None, kw_only=True)


Form = Replica | Sharded | Distributed | Value | Tree


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where the walk met a leaf.

    Attributes:
        key: the leaf's checkpoint key (its tree path, keys joined with ``.``).
        container: the checkpoint key of the mapping, list or Stateful holding
            it (``""`` at the root); ``Sharded`` items are named below it.
        loading: True in a load's walk, False in a save's.
        module_adapter: how an ``nn.Module`` is presented as a Stateful
            (``reshard.ModelState``; passed in, so this floor knows no adapter).
    """

    key: str
    container: str
    loading: bool
    module_adapter: Callable[[Any], Any]


@runtime_checkable
class KindHandler(Protocol):
    """How one kind of object in a state tree is saved and loaded.

    Who calls what: the walk of every save and load, on every rank, on the
    caller's thread, once per object it meets (:func:`handler_for` chooses the
    handler): ``accepts(x)``, then ``save(x, at)`` in a save or
    ``load(x, at)`` in a load. Neither may write anything: a save writes what
    the forms describe after every rank's walk succeeded, and a load fills the
    destinations its form names, then calls ``Tree.restore``.

    Attributes:
        name: what messages and :func:`registered` call this kind.
    """

    name: str

    def accepts(self, x: Any) -> bool:
        """Whether this handler takes ``x`` (an instance of a class it was
        registered for); False passes ``x`` on to the next handler tried."""
        ...

    def save(self, x: Any, at: Where) -> Form:
        """What is written for ``x`` at ``at.key``: its chunks (``Sharded``,
        ``Distributed``, ``Replica``), a ``Value``, or the ``Tree`` that stands
        for it. Raises ShardingError (naming ``at.key``) for what cannot be saved."""
        ...

    def load(self, x: Any, at: Where) -> Form:
        """What ``x`` is loaded through: the same forms, whose tensors are the
        destinations filled in place (``x``'s own memory, or buffers a
        ``Tree.restore`` then puts into ``x``); keys as ``save`` gives them."""
        ...


# ----------------------------------------------------------------------------- the built-in handlers


class _ShardedLeaf:
    name = "ShardedTensor / ShardedObject"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Any, at: Where) -> Form:
        return Sharded((x,))

    load = save


class _Views:
    name = "views (a list or tuple of ShardedTensor / ShardedObject)"

    def accepts(self, x: Any) -> bool:
        return bool(x) and all(isinstance(v, (ShardedTensor, ShardedObject)) for v in x)

    def save(self, x: Any, at: Where) -> Form:
        return Sharded(tuple(x))

    load = save


class _Module:
    name = "nn.Module (as its ModelState)"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Any, at: Where) -> Form:
        return Tree(at.module_adapter(x))

    load = save


class _Stateful:
    name = "Stateful (state_dict() / load_state_dict())"

    def accepts(self, x: Any) -> bool:
        return is_stateful(x) and not isinstance(x, Mapping)

    def save(self, x: Any, at: Where) -> Form:
        token = _WALKING.set(True)
        try:
            sd = x.state_dict()
        except ShardingError as e:
            raise ShardingError(f"{at.key}: {e}") from None
        finally:
            _WALKING.reset(token)
        if not isinstance(sd, Mapping):
            raise ShardingError(f"{at.key}: state_dict() returned {type(sd).__name__}, not a mapping")
        return Tree(sd, restore=x.load_state_dict, record=adapter_kind(x), v1_names=v1_rules(x),
                    label=f"<{type(x).__name__}>.state_dict()")

    load = save


class _PlainTensor:
    name = "plain tensor"

    def accepts(self, x: Any) -> bool:
        return is_plain_tensor(x)

    def save(self, x: Any, at: Where) -> Form:
        if qualified_name(type(x)) == _FAKE:
            raise ShardingError(f"{at.key}: cannot save a FakeTensor: it stands in for a tensor and holds "
                                "no elements; save the real tensor")
        return Replica(x)

    def load(self, x: Any, at: Where) -> Form:
        return Replica(x)


class _DTensor:
    name = "DTensor"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Any, at: Where) -> Form:
        local = getattr(x, "_local_tensor", None)
        if isinstance(local, torch.Tensor) and not is_plain_tensor(local):
            raise unknown_tensor(at.key, local, loading=at.loading, inside="the local tensor of a DTensor")
        return Distributed(x)

    load = save


class _Numpy:
    name = "numpy.ndarray"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Any, at: Where) -> Form:
        if x.dtype.hasobject:
            raise ShardingError(f"{at.key}: NumPy object arrays cannot be saved")
        # filled in place at load through the shared memory, unless the array is read-only
        return Replica(torch.from_numpy(x) if x.flags.writeable else torch.from_numpy(x.copy()))

    load = save


class _UnknownTensor:
    name = "tensor subclass without a handler (refused)"

    def accepts(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def save(self, x: Any, at: Where) -> Form:
        raise unknown_tensor(at.key, x, loading=False)

    def load(self, x: Any, at: Where) -> Form:
        raise unknown_tensor(at.key, x, loading=True)


class _PlainValue:
    name = "plain value"

    def accepts(self, x: Any) -> bool:
        return True

    def save(self, x: Any, at: Where) -> Form:
        return Value(x)

    load = save


#: tried for a ``torch.Tensor`` that no registered handler accepted: refuses it
UNKNOWN_TENSOR: KindHandler = _UnknownTensor()
#: what the walk makes of an object no handler takes that is not a container
PLAIN_VALUE: KindHandler = _PlainValue()


# ----------------------------------------------------------------------------- the registry


class KindRegistry:
    """Handlers by class (or qualified class name), resolved along the MRO.

    One registry serves the process (:data:`REGISTRY`, behind the module's
    functions); registering is meant for import time (it is locked, and the
    resolution cache is dropped at every change)."""

    def __init__(self) -> None:
        self._by_type: dict[type, KindHandler] = {}
        self._by_name: dict[str, KindHandler] = {}
        self._tried: dict[type, tuple[KindHandler, ...]] = {}
        self._lock = threading.Lock()

    def register(self, cls: type | str, handler: KindHandler, *, override: bool = False) -> None:
        """Let ``handler`` take instances of ``cls``: a class (matched by
        identity), or a qualified class name ``"module.QualName"`` (matched by
        name, which registers without importing the class; see
        :func:`qualified_name`). Registering the same handler again does nothing.

        Raises:
            TypeError: ``handler`` lacks a member of :class:`KindHandler`.
            ValueError: ``cls`` already has another handler (by class or by
                name) and ``override`` is False.
        """
        if not isinstance(handler, KindHandler) or not isinstance(getattr(handler, "name", None), str):
            raise TypeError(f"{handler!r} is not a KindHandler: it needs a str `name` and the methods "
                            "accepts(x), save(x, at) and load(x, at)")
        with self._lock:
            prev = self._registered(cls)
            if prev is not None and prev is not handler and not override:
                name = cls if isinstance(cls, str) else qualified_name(cls)
                raise ValueError(f"{name} already has the handler {prev.name!r}; pass override=True "
                                 "to replace it")
            if override:
                self._drop(cls)
            if isinstance(cls, str):
                self._by_name[cls] = handler
            else:
                self._by_type[cls] = handler
            self._tried.clear()

    def unregister(self, cls: type | str) -> KindHandler:
        """Remove the handler of ``cls`` (as :meth:`register` matches it) and return it.

        Raises:
            KeyError: ``cls`` has no handler.
        """
        with self._lock:
            got = self._drop(cls)
            self._tried.clear()
        if got is None:
            raise KeyError(f"{cls if isinstance(cls, str) else qualified_name(cls)} has no handler")
        return got

    def _registered(self, cls: type | str) -> KindHandler | None:
        if isinstance(cls, str):
            return self._by_name.get(cls) or next(
                (h for t, h in self._by_type.items() if qualified_name(t) == cls), None)
        return self._by_type.get(cls) or self._by_name.get(qualified_name(cls))

    def _drop(self, cls: type | str) -> KindHandler | None:
        if isinstance(cls, str):
            got = self._by_name.pop(cls, None)
            for t in [t for t in self._by_type if qualified_name(t) == cls]:
                got = self._by_type.pop(t)
            return got
        return self._by_type.pop(cls, None) or self._by_name.pop(qualified_name(cls), None)

    def tried(self, cls: type) -> tuple[KindHandler, ...]:
        """The handlers tried, in order, for an instance of ``cls``: those
        registered along ``cls.__mro__``, most derived first, then
        :data:`UNKNOWN_TENSOR` for a tensor type."""
        got = self._tried.get(cls)
        if got is None:
            out: list[KindHandler] = []
            for c in cls.__mro__:
                h = self._by_type.get(c) or self._by_name.get(qualified_name(c))
                if h is not None and h not in out:
                    out.append(h)
            if issubclass(cls, torch.Tensor):
                out.append(UNKNOWN_TENSOR)
            got = self._tried[cls] = tuple(out)
        return got

    def handler_for(self, x: Any) -> KindHandler | None:
        """The first handler of :meth:`tried` that accepts ``x``; None when
        none does (the walk then makes ``x`` a container or a plain value)."""
        for h in self.tried(type(x)):
            if h.accepts(x):
                return h
        return None

    def registered(self) -> list[tuple[str, KindHandler]]:
        """``(qualified class name, handler)`` of every registration, in the
        order they were made (by class, then by name)."""
        with self._lock:
            return ([(qualified_name(t), h) for t, h in self._by_type.items()]
                    + list(self._by_name.items()))


REGISTRY = KindRegistry()
register = REGISTRY.register
unregister = REGISTRY.unregister
handler_for = REGISTRY.handler_for
tried = REGISTRY.tried
registered = REGISTRY.registered
#: the public name of :func:`register` (``reshard.register_state_kind``)
register_state_kind = register

#: The built-in handlers, registered in this one place (most are found by
#: the MRO: a ShardedTensor by its class before ``object``'s Stateful probe).
_SHARDED, _VIEWS = _ShardedLeaf(), _Views()
BUILTIN: tuple[tuple[type | str, KindHandler], ...] = (
    (ShardedTensor, _SHARDED),
    (ShardedObject, _SHARDED),
    (list, _VIEWS),
    (tuple, _VIEWS),
    (torch.nn.Module, _Module()),
    (torch.Tensor, _PlainTensor()),
    ("torch.distributed.tensor.DTensor", _DTensor()),  # by name: importing DTensor costs ~0.5 s
    (np.ndarray, _Numpy()),
    (object, _Stateful()),  # duck-typed: anything with state_dict() and load_state_dict()
)
for _cls, _handler in BUILTIN:
    register(_cls, _handler)
del _cls, _handler
