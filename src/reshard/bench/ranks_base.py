"""What every rank function of ``reshard bench io`` (:mod:`reshard.bench.ranks`) shares: the
workload held in the worker between tasks (``_W``), the barrier-to-barrier timer, and the
views of the model state that the measurements read and write.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import reshard

from .models import Workload

_W: dict[str, Any] = {}


def _w() -> Workload:
    w: Workload = _W["w"]
    return w


def _rank() -> int:
    return dist.get_rank()


def _timed(fn: Callable[[], Any], profile: str | None = None) -> tuple[Any, float, float]:
    """``(result, own seconds, barrier-to-barrier seconds)``; with ``profile``
    (a name) and a profile directory set, the call runs under pyinstrument and
    its text report is written there."""
    prof = None
    if profile is not None and _W.get("profile_dir"):
        from pyinstrument import Profiler

        prof = Profiler(interval=0.0005)
    dist.barrier()
    if prof is not None:
        prof.start()
    t0 = time.perf_counter()
    out = fn()
    own = time.perf_counter() - t0
    if prof is not None:
        prof.stop()
        name = f"{profile}-w{dist.get_world_size()}-r{_rank()}"
        with open(os.path.join(_W["profile_dir"], name + ".txt"), "w") as f:
            f.write(prof.output_text(unicode=False, color=False, show_all=False))
    dist.barrier()
    return out, own, time.perf_counter() - t0


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _flat_tensors(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            out.extend(_flat_tensors(v))
    elif isinstance(x, (list, tuple)):
        for v in x:
            out.extend(_flat_tensors(v))
    return out


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc): the state-sized copies of
    the peers (tensors under glibc's 32 MiB mmap threshold come from the heap)
    otherwise stay resident after they are freed and add up over the phases."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reshard_load(path: str, opts: reshard.LoadOptions | None = None) -> reshard.LoadResult:
    w = _w()
    res = reshard.load(w.reshard_state(), path, options=opts)
    w.after_load()
    return res


def _owned() -> dict[str, torch.Tensor]:
    """The tensors this rank writes in the torch.save / safetensors baselines:
    its local shards (FSDP), or a byte-balanced share of the replicated state
    (each tensor once, tied tensors once)."""
    w = _w()
    names: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            t = (x.to_local() if hasattr(x, "to_local") else x).detach()
            if t.numel() and t.untyped_storage().data_ptr() in seen:
                return
            if t.numel():
                seen.add(t.untyped_storage().data_ptr())
            names.append((path, t.contiguous()))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))

    walk(w.dcp_state(), "")
    fsdp = any(hasattr(t, "to_local") for t in _flat_tensors(w.dcp_state()))
    if fsdp:
        return dict(names)
    world, rank = dist.get_world_size(), _rank()
    load = [0] * world
    out = {}
    for name, t in sorted(names, key=lambda nt: -nt[1].nbytes):
        r = min(range(world), key=lambda i: load[i])
        load[r] += t.nbytes
        if r == rank:
            out[name] = t
    return out


# ----------------------------------------------------------------------- writes / reads
def _views() -> list[memoryview]:
    from ..ondisk.shardfile import tensor_bytes

    return [tensor_bytes(t) for t in _w().tensors() if t.numel()]


def _local_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def drop(path: str) -> None:
    """Delete ``path`` (rank 0, after every rank is done with it)."""
    dist.barrier()
    if _rank() == 0:
        if "://" in path:
            from ..storage import resolve

            st, key = resolve(path)
            st.delete_tree(key)
        else:
            shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
