"""Pieces the trainer integrations share: RNG streams restored at a moment the
integration chooses, the state of a trainer's own objects (callbacks, a data
module) saved as the coordinator's copy, and the check that a framework still
has the internals an integration relies on.

Nothing here imports a training framework.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import wait
from typing import Any

from ..adapters.rng import RNGState
from ..ondisk import codec
from ..saving.staging import SaveHandle
from ..state.sharding import ShardedObject

__all__ = ["DeferredRNG", "Internal", "RankZeroObjects", "missing_internals", "quiet_torchao_import",
           "wait_staged"]


class _TorchaoNoise(logging.Filter):
    """The lines torchao's import logs about itself: its compiled extensions
    that do not load on this machine (``Failed to load .../_C*.so``, built for
    another Python, torch or GPU; or skipped for the torch version) and torch's
    deprecation of the Enum constants it registers with pytree."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.name == "torchao":
            return not msg.startswith(("Failed to load ", "Skipping import of cpp extensions"))
        return "is an Enum subclass and is now natively supported by torch.compile" not in msg


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Around a framework import that imports torchao as a side effect
    (``from transformers import Trainer`` imports its quantizers, which import
    torchao when it is installed): torchao's lines about its own compiled
    extensions and torch's pytree deprecation notes for its Enum constants are
    dropped, nothing else. reshard uses no torchao; once torchao is imported
    (by the user first, or after this block), nothing is filtered."""
    if "torchao" in sys.modules:
        yield
        return
    noise = _TorchaoNoise()
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for lg in loggers:
        lg.addFilter(noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(noise)


class DeferredRNG:
    """A run's RNG streams (an :class:`~reshard.RNGState`), whose restored
    value is applied when the training loop is ready for it, not when the
    checkpoint is read.

    Why: ``iter(DataLoader)`` draws its base seed from the global torch
    generator (``torch.empty((), dtype=torch.int64).random_()``), and a
    ``RandomSampler`` without a generator draws one more. A trainer creates
    its iterator after the hook where the model and optimizers first exist,
    so streams restored in that hook are one or two draws off by the first
    resumed batch: the same samples and learning rate, a different dropout
    mask, a different loss. The integrations call :meth:`loaded` right after
    the load (which set the global generators) and :meth:`apply` at the last
    moment before the first resumed batch uses them.
    """

    def __init__(self, rng: RNGState):
        self.rng = rng
        self._pending: dict[str, Any] | None = None

    @property
    def pending(self) -> bool:
        """Whether restored streams wait to be applied."""
        return self._pending is not None

    def loaded(self) -> None:
        """Take the streams the load just set (the saved ones, or the ones
        re-derived at another world size) as those to apply later."""
        self._pending = self.rng.capture()

    def apply(self) -> bool:
        """Set the global generators to the restored streams, once; returns
        whether anything was applied."""
        st, self._pending = self._pending, None
        if st is None:
            return False
        self.rng.restore(st)
        return True


def wait_staged(handle: SaveHandle | None) -> None:
    """Block until ``handle``'s state is staged (its tensors copied into
    reshard's buffers), without raising its failure (the manager reports a
    failed save itself). No-op for None or an already staged save."""
    if handle is not None and not handle.staged.done():
        wait([handle.staged])


class RankZeroObjects:
    """A Stateful over named objects of a trainer (its callbacks, a data
    module): each one's ``state_dict()`` is saved as element ``(rank,)`` of a
    ``(world_size,)`` grid, and every rank loads the coordinator's element
    ``(0,)``, as the trainer's own checkpoint (written by rank 0) would.

    Every saved element is requested at load (so a strict load succeeds when
    this run has fewer such objects); an element with no object of its name in
    this run is reported by a ``RuntimeWarning``, an object with no saved
    state keeps its own. An object whose state reshard cannot store (a value
    the typed codec refuses) is left out with one ``RuntimeWarning`` naming it,
    rather than failing every save of the run.

    Args:
        objects: ``name -> object`` with ``state_dict()`` / ``load_state_dict()``,
            called each time (the set may change between runs).
        rank, world_size: this process's place.
        what: a word for the warnings ("callback", "data module").
    """

    NAMES = "__names__"

    def __init__(self, objects: Callable[[], Mapping[str, Any]], *, rank: int, world_size: int,
                 what: str):
        self.objects, self.rank, self.world_size, self.what = objects, rank, world_size, what
        self._saved: dict[str, tuple[int, ...]] | None = None  # set by reshard_prepare_load
        self._refused: set[str] = set()

    def reshard_prepare_load(self, m: Any) -> None:
        """Note the saved elements (``m``: the manifest seen from here)."""
        self._saved = {k: tuple(oe.global_shape) for k, oe in m.objects.items()}

    def state_dict(self) -> dict[str, Any]:
        saved, self._saved = self._saved, None
        if saved is not None:  # a load: every saved element, the coordinator's
            return {self.NAMES: [], **{k: ShardedObject(k, None, global_shape=shape,
                                                        global_offset=(0,) * len(shape))
                                       for k, shape in saved.items()}}
        out: dict[str, Any] = {self.NAMES: []}
        for name, obj in self.objects().items():
            st = obj.state_dict()
            if not st or name in self._refused:
                continue
            try:
                codec.encode(st)
            except TypeError as e:
                self._refused.add(name)
                warnings.warn(f"reshard: the state of {self.what} {name!r} is not saved: {e}",
                              RuntimeWarning, stacklevel=2)
                continue
            out[name] = ShardedObject(name, st, global_shape=(self.world_size,),
                                      global_offset=(self.rank,))
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        here = self.objects()
        for name, ob in sd.items():
            if name == self.NAMES:
                continue
            obj = here.get(name)
            if obj is None:
                warnings.warn(f"reshard: the checkpoint holds the state of {self.what} {name!r}, "
                              f"which this run does not have; it is not restored", RuntimeWarning,
                              stacklevel=2)
                continue
            obj.load_state_dict(ob.value)


class Internal:
    """One private attribute of a framework that an integration relies on.

    Args:
        name: how the framework spells it (``Trainer._save_checkpoint``).
        why: what the integration uses it for.
        probe: ``probe(subject) -> bool``, True when it is there as expected.
    """

    def __init__(self, name: str, why: str, probe: Callable[[Any], bool]):
        self.name, self.why, self.probe = name, why, probe

    def __repr__(self) -> str:
        return f"Internal({self.name!r})"


def missing_internals(internals: tuple[Internal, ...], subject: Any) -> list[str]:
    """``"name (why)"`` of each internal whose probe fails (or raises) on ``subject``."""
    out = []
    for it in internals:
        try:
            ok = bool(it.probe(subject))
        except Exception:  # noqa: BLE001 - an attribute gone or changed: reported as missing
            ok = False
        if not ok:
            out.append(f"{it.name} ({it.why})")
    return out
