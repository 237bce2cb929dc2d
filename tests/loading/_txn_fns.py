"""Rank functions for tests/loading/test_transactional.py (run inside WorkerPool
workers, imported by name): one checkpoint per save call, transactional loads,
unplaceable targets. Real files, real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard.storage import LocalStorage, WriteStream

ROWS, COLS = 4, 6  # "w" and "v": rows split over the ranks; "w" float32, "v" float64


def sharded_state(rank: int, world: int, scale: float = 1.0) -> dict[str, Any]:
    """Rank's rows of ``w`` and ``v`` (value = global element index * scale)."""
    per = ROWS // world
    rows = slice(rank * per, (rank + 1) * per)
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)[rows] * scale
    v = torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS)[rows] * -scale
    off = (rank * per, 0)
    return {"model": {
        "w": reshard.ShardedTensor("w", w.clone(), global_shape=(ROWS, COLS), global_offset=off),
        "v": reshard.ShardedTensor("v", v.clone(), global_shape=(ROWS, COLS), global_offset=off),
    }}


def _targets(rank: int, world: int, *, v_dtype: torch.dtype = torch.float64,
             device: str = "cpu") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A target state of sentinel values (-7) for this rank's rows, and clones of it."""
    per = ROWS // world
    off = (rank * per, 0)
    w = torch.full((per, COLS), -7.0, dtype=torch.float32, device=device)
    v = torch.full((per, COLS), -7.0, dtype=v_dtype, device=device)
    state = {"model": {
        "w": reshard.ShardedTensor("w", w, global_shape=(ROWS, COLS), global_offset=off),
        "v": reshard.ShardedTensor("v", v, global_shape=(ROWS, COLS), global_offset=off),
    }}
    return state, {"model.w": w.clone(), "model.v": v.clone()}


def _unchanged(state: dict[str, Any], before: dict[str, torch.Tensor]) -> dict[str, bool]:
    got = {"model.w": state["model"]["w"].data, "model.v": state["model"]["v"].data}
    return {k: bool(torch.equal(got[k], before[k])) for k in before}


def _error(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e),
            "failed_ranks": sorted(getattr(e, "failures", {}))}


def _entries(*dirs: str) -> dict[str, list[str]]:
    return {d: sorted(os.listdir(d)) if os.path.isdir(d) else [] for d in dirs}


# ----------------------------------------------------------------------------- save


class TruncatingStorage(LocalStorage):
    """Local files; every data file shrinks by ``cut`` bytes right after its
    writer closed it (a lost write the writer's own report cannot see)."""

    def __init__(self, cut: int = 8):
        super().__init__()
        self.cut = cut

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        inner = super().open_write(path, durable=durable)
        if not path.endswith(".safetensors"):
            return inner
        cut = self.cut

        class Shrink(WriteStream):
            def write(self, data: bytes | memoryview) -> None:
                inner.write(data)

            def close(self) -> None:
                inner.close()
                os.truncate(path, max(0, os.path.getsize(path) - cut))

            def abort(self) -> None:
                inner.abort()

        return Shrink()


def r_save_paths(how: str, root: str, use_async: bool = False) -> dict[str, Any]:
    """Save on 2 ranks with each rank spelling the checkpoint path as ``how`` says:

    * ``per-rank``: ``root/ck-<rank>`` (different checkpoints);
    * ``cwd``: the relative path ``ck`` from ``root/d<rank>`` (different checkpoints);
    * ``spellings``: rank 0 ``root/real/ck`` (absolute), rank 1 ``link/ck``
      relative to ``root`` where ``root/link -> root/real`` (one checkpoint);
    * ``memory``: ``memory://<root>/ck`` on both (one spelling, but each process
      has its own memory store: the node-local case);
    * ``truncate``: ``root/ck`` on both, rank 1's data files shrink after close.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and how == "spellings":
        os.makedirs(os.path.join(root, "real"))
        os.symlink(os.path.join(root, "real"), os.path.join(root, "link"))
    if how == "cwd":
        os.makedirs(os.path.join(root, f"d{rank}"), exist_ok=True)
    dist.barrier()
    cwd = os.getcwd()
    storage = None
    if how == "per-rank":
        path = os.path.join(root, f"ck-{rank}")
    elif how == "cwd":
        os.chdir(os.path.join(root, f"d{rank}"))
        path = "ck"
    elif how == "spellings":
        if rank == 0:
            path = os.path.join(root, "real", "ck")
        else:
            os.chdir(root)
            path = os.path.join("link", "ck")
    elif how == "memory":
        path = f"memory://{root.strip('/')}/ck"
    else:
        path = os.path.join(root, "ck")
        storage = TruncatingStorage() if rank == 1 else None
    out: dict[str, Any] = {"raised": None}
    try:
        state = sharded_state(rank, world)
        if use_async:
            reshard.async_save(state, path, step=1, storage=storage).wait(60)
        else:
            reshard.save(state, path, step=1, storage=storage)
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    finally:
        os.chdir(cwd)
    dist.barrier()
    if how == "memory":
        from reshard.storage import MemoryStorage

        out["memory_keys"] = sorted(k for k in MemoryStorage()._objects if k.startswith(root.strip("/")))
    elif how == "spellings" and out["raised"] is None:
        state, before = _targets(rank, world)
        reshard.load(state, os.path.join(root, "link", "ck"))  # either spelling loads it
        out["loaded"] = {k: v.tolist() for k, v in
                         (("w", state["model"]["w"].data), ("v", state["model"]["v"].data))}
        out["expected"] = {k: v.data.tolist() for k, v in sharded_state(rank, world)["model"].items()}
    return out


# ----------------------------------------------------------------------------- load


def r_save(path: str) -> None:
    reshard.save(sharded_state(dist.get_rank(), dist.get_world_size()), path, step=1)


def r_load_unchanged(path: str, how: str) -> dict[str, Any]:
    """Load after the test damaged the checkpoint (or with a refused request,
    as ``how`` says); report whether this rank's targets are unchanged."""
    rank, world = dist.get_rank(), dist.get_world_size()
    v_dtype = torch.float32 if how == "dtype-rank1" and rank == 1 else torch.float64
    state, before = _targets(rank, world, v_dtype=v_dtype)
    # a missing key with a "zeros" rule: must not be zeroed when the load fails
    extra = torch.full((3,), -7.0)
    state["model"]["extra"] = extra
    kw: dict[str, Any] = {"allow_missing": [("model.extra", "zeros")]}
    opts = reshard.LoadOptions(threads=1, verify_first=how.endswith("verify-first"))
    if how == "unexpected":
        del state["model"]["v"]  # strict: model.v saved but not requested
    if how == "meta":
        state, before = _targets(rank, world, device="meta")
        kw = {}
    st = LocalStorage()
    out: dict[str, Any] = {"raised": None}
    try:
        reshard.load(state, path, options=opts, storage=st, **kw)
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    out["bytes_read"] = st.bytes_read
    out["manifest_bytes"] = os.path.getsize(os.path.join(path, "manifest.json"))
    if how == "meta":
        out["still_meta"] = all(state["model"][k].data.is_meta for k in ("w", "v"))
        return out
    if how == "unexpected":
        state["model"]["v"] = reshard.ShardedTensor("v", before["model.v"].clone(),
                                                     global_shape=(ROWS, COLS),
                                                     global_offset=(rank * (ROWS // world), 0))
    out["unchanged"] = _unchanged(state, before)
    out["extra_unchanged"] = bool((extra == -7.0).all())
    out["changed"] = sorted(k for k, same in out["unchanged"].items() if not same)
    return out


def r_convert_per_rank(root: str) -> dict[str, Any]:
    """convert_dcp of one DCP checkpoint with a per-rank destination."""
    import torch.distributed.checkpoint as dcp

    from reshard.formats.dcp_convert import convert_dcp

    rank = dist.get_rank()
    src = os.path.join(root, "dcp")
    if rank == 0:
        dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, checkpoint_id=src, no_dist=True)
    dist.barrier()
    out: dict[str, Any] = {"raised": None}
    try:
        convert_dcp(src, os.path.join(root, f"out-{rank}"))
    except reshard.CheckpointError as e:
        out["raised"] = _error(e)
    dist.barrier()
    return out
