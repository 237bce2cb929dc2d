"""RNG streams: per-rank state, and layout-independent counter-based randomness.

:class:`RNGState` saves, **per rank**, Python's ``random``, NumPy's global
generator, torch's CPU generator, every CUDA device's generator and any named
``torch.Generator`` the user registers (e.g. a tensor-parallel tracker), as
one element of a ``ShardedObject`` grid of shape ``(world_size,)`` (never
deduplicated as replicas).

* Same layout: every rank gets its own streams back; the next dropout mask is
  identical to an uninterrupted run.
* Changed layout (another grid shape): streams cannot follow ranks that no
  longer exist. The documented rule: every stream of new rank ``r`` is
  re-seeded from ``derive_seed(base_seed, step, coords)`` where ``coords`` is
  the rank's logical coordinates (default ``{"rank": r}``), and a
  ``RuntimeWarning`` says so. No stream of another rank is ever reused.

:func:`counter_uniform` gives randomness keyed by (seed, step, logical element
index) — identical whatever the parallel layout — for dropout and masking that
must agree across layouts (a counter-based generator in the spirit of
Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the mixer
is SplitMix64, Steele et al., OOPSLA'14).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ..ondisk.manifest import Manifest
from ..state.sharding import ShardedObject

_MASK64 = (1 << 64) - 1


def derive_seed(base_seed: int, step: int, coords: dict[str, int], stream: str = "") -> int:
    """A 63-bit seed from ``(base_seed, step, coords, stream)``, independent of
    any global generator."""
    text = f"{base_seed}|{step}|{sorted(coords.items())}|{stream}"
    return xxhash.xxh3_64_intdigest(text.encode()) & ((1 << 63) - 1)


class RNGState:
    """Stateful adapter for this rank's random number generators.

    Args:
        rank, world_size: this rank's place in the grid (default: from
            torch.distributed when initialised, else 0 and 1).
        base_seed: the run's seed, recorded for the re-derivation rule.
        coords: logical coordinates of this rank (e.g. ``{"dp": 1, "tp": 0}``)
            used when streams must be re-derived.
        streams: named ``torch.Generator``s to save besides the global ones.
        key: the name of the streams in format-version-1 checkpoints (read
            only: the streams are now saved as ``streams`` and the base seed as
            ``meta``, relative to the adapter's position, e.g. ``rng.streams``).

    Attributes:
        loaded: the streams the last load restored (the form :meth:`capture`
            returns), to restore them again later with :meth:`restore`
            (see "When to restore" below); None before a load and after
            one that re-derived the streams.

    When to restore, relative to the DataLoader iterator: restore the streams
    at the point of the loop where they were captured, so that the draws
    between that point and the next step are the same as in the
    uninterrupted run. ``iter(DataLoader)`` draws from the global torch
    generator (its workers' base seed, one int64, unless the loader has a
    ``generator`` of its own; and a ``RandomSampler`` without a generator
    draws its seed at the first batch). A checkpoint saved between two steps
    of an epoch was captured after that epoch's iterator existed, so restore
    it after the resumed run has created its iterator: a restore before
    ``iter()`` leaves every later draw one step off the uninterrupted run
    (other dropout masks from the first resumed step on, silently; the
    samples are the same when they come from the checkpoint, e.g. a
    :class:`~reshard.DataCursor`). With :func:`reshard.load`, which restores
    everything at once, either create the iterator before the load, or
    restore again once it exists: ``it = iter(loader); rng.restore(rng.loaded)``.
    The data order must then come from the checkpoint (a ``DataCursor``, or
    a sampler with its own generator saved beside it), not from the global
    generator. A checkpoint saved at an epoch boundary, before the next
    epoch's iterator, is restored before ``iter()``. (Found with PyTorch
    Lightning, which creates the iterator after ``on_fit_start``.)
    """

    def __init__(self, *, rank: int | None = None, world_size: int | None = None,
                 base_seed: int = 0, coords: dict[str, int] | None = None,
                 streams: dict[str, torch.Generator] | None = None, key: str = "rng"):
        if rank is None or world_size is None:
            import torch.distributed as dist

            ok = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if ok and rank is None else (rank or 0)
            world_size = dist.get_world_size() if ok and world_size is None else (world_size or 1)
        self.rank, self.world_size = rank, world_size
        self.base_seed = base_seed
        self.coords = dict(coords) if coords is not None else {"rank": rank}
        self.streams = dict(streams or {})
        self.key = key
        self._rederive: int | None = None  # step to re-derive from, set by prepare
        self.rederived = False
        self.loaded: dict[str, Any] | None = None

    def capture(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "named": {k: g.get_state() for k, g in self.streams.items()},
        }
        if torch.cuda.is_available():
            out["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        return out

    def restore(self, st: dict[str, Any]) -> None:
        random.setstate(st["python"])
        np.random.set_state(st["numpy"])
        torch.set_rng_state(st["torch"])
        for name, s in st.get("named", {}).items():
            if name in self.streams:
                self.streams[name].set_state(s)
        if "cuda" in st and torch.cuda.is_available():
            for i, s in enumerate(st["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)

    @property
    def _reshard_v1_names(self) -> tuple[tuple[str, str], ...]:
        """Format version 1 named the streams ``key`` and the seed ``key.meta``."""
        return ((f"{self.key}.meta", "meta"), (self.key, "streams"))

    def state_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"meta": ShardedObject("meta", {"base_seed": self.base_seed})}
        if self._rederive is None:
            d["streams"] = ShardedObject("streams", self.capture(), global_shape=(self.world_size,),
                                         global_offset=(self.rank,))
        return d

    def reshard_prepare_load(self, m: Manifest) -> dict[str, Any] | None:
        oe = m.objects.get("streams")
        if oe is None or tuple(oe.global_shape) == (self.world_size,):
            self._rederive = None
            return None
        self._rederive = m.step or 0
        warnings.warn(
            f"RNG streams were saved for a grid of {list(oe.global_shape)} ranks and are loaded on "
            f"{self.world_size}: re-deriving every stream of rank {self.rank} from (base_seed, step "
            f"{self._rederive}, coords {self.coords}) instead of reusing another rank's stream",
            RuntimeWarning, stacklevel=2)
        from ..state.tree import HANDLED

        return {"rederived": True, HANDLED: ["streams"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        base = sd["meta"].value["base_seed"]
        if self._rederive is None:
            self.loaded = sd["streams"].value
            self.restore(self.loaded)
            self.rederived = False
            return
        self.loaded = None
        step = self._rederive
        self._rederive = None
        seed = derive_seed(base, step, self.coords)
        random.seed(seed)
        np.random.seed(seed & 0xFFFFFFFF)
        torch.manual_seed(seed)
        for name, g in self.streams.items():
            g.manual_seed(derive_seed(base, step, self.coords, name))
        self.rederived = True


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (wrap-around arithmetic)."""
    def srl(v: torch.Tensor, k: int) -> torch.Tensor:  # logical right shift
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = x + torch.tensor(0x9E3779B97F4A7C15 - (1 << 64), dtype=torch.int64)
    x = (x ^ srl(x, 30)) * torch.tensor(0xBF58476D1CE4E5B9 - (1 << 64), dtype=torch.int64)
    x = (x ^ srl(x, 27)) * torch.tensor(0x94D049BB133111EB - (1 << 64), dtype=torch.int64)
    return x ^ srl(x, 31)


def counter_uniform(seed: int, step: int, global_shape: Sequence[int],
                    global_offset: Sequence[int] | None = None,
                    local_shape: Sequence[int] | None = None, *, stream: int = 0) -> torch.Tensor:
    """Uniform ``[0, 1)`` float32 values of the box ``[global_offset,
    global_offset + local_shape)`` of a logical tensor of ``global_shape``.

    Element ``i`` (row-major index in the logical tensor) gets a value that
    depends only on ``(seed, step, stream, i)``, so every parallel layout that
    holds element ``i`` draws the same number for it.
    """
    gshape = tuple(global_shape)
    off = tuple(global_offset) if global_offset is not None else (0,) * len(gshape)
    shp = tuple(local_shape) if local_shape is not None else gshape
    strides = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        strides[d] = strides[d + 1] * gshape[d + 1]
    idx = torch.zeros(shp, dtype=torch.int64)
    for d, (o, n, s) in enumerate(zip(off, shp, strides, strict=True)):
        view = [1] * len(shp)
        view[d] = n
        idx = idx + (torch.arange(o, o + n, dtype=torch.int64) * s).reshape(view)
    key = derive_seed(seed, step, {"stream": stream})
    h = _splitmix64(idx ^ torch.tensor(key, dtype=torch.int64))
    h = _splitmix64(h)
    return (((h >> 40) & ((1 << 24) - 1)).to(torch.float32)) * (1.0 / (1 << 24))
