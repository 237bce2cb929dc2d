"""A bit-exact, layout-independent digest of a training state's tensors
(``reshard bench io`` checks every load against the saved state with it).

Every element of every logical tensor contributes ``h(index, bits) =
(bits XOR index * K1) * K2`` (64-bit wrapping arithmetic; ``index`` is the
element's row-major position in the logical tensor, ``bits`` its raw value
bits), summed modulo 2**64 per tensor. The sum does not depend on how the
tensor is cut into chunks, so a state in one layout (FSDP shards, TP views,
ZeRO-1 flat ranges) and the same state loaded into another give the same
digest only if every element's bits are equal (up to a 2**-64 chance).

Each rank sums its own chunks (tree path as reshard flattens the state:
:func:`reshard.state.tree.flatten`; plain tensors and DTensors as a save describes
them); rank 0 receives ``{(key, chunk): sum}`` (one entry per local chunk),
keeps one copy of each chunk held by several ranks (replicas: the same key,
offset, shape and flat range), notes replicas whose sums differ, and
broadcasts the result. Objects and plain values are not part of the digest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MASK = (1 << 64) - 1
_BLOCK = 1 << 21  # elements hashed at once (16 MiB of int64 temporaries per pass)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def chunk_sum(data: torch.Tensor, global_shape: tuple[int, ...], global_offset: tuple[int, ...],
              local_shape: tuple[int, ...], flat_start: int = 0) -> int:
    """Sum over the chunk's elements of ``h(index, bits)`` modulo 2**64.

    ``data``: the chunk's elements in row-major order (``local_shape``, or
    the 1-D ``flattened_range`` of it starting at flat element ``flat_start``
    of the ``local_shape`` box).
    """
    flat = data.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits_t = _INT[flat.element_size()]
    n = flat.numel()
    gs, ls = _strides(global_shape), _strides(local_shape)
    dims = len(global_shape)
    # row-sharded (only dim 0 cut): the index is the local flat index plus a base
    simple = dims == 0 or (tuple(local_shape[1:]) == tuple(global_shape[1:])
                           and not any(global_offset[1:]))
    base = global_offset[0] * gs[0] if dims else 0
    total = 0
    for a in range(0, n, _BLOCK):
        e = min(n, a + _BLOCK)
        bits = flat[a:e].contiguous().view(bits_t).to(torch.int64)
        f = torch.arange(flat_start + a, flat_start + e, dtype=torch.int64)
        if simple:
            idx = f + base
        else:
            idx = torch.zeros_like(f)
            for d in range(dims):
                idx += ((f // ls[d]) % local_shape[d] + global_offset[d]) * gs[d]
        total += int(((bits ^ (idx * _K1)) * _K2).sum())
    return total & _MASK


def local_chunks(state: Any) -> dict[str, tuple[int, int]]:
    """``{chunk id: (sum, bytes)}`` of this rank's chunks of ``state`` (a
    chunk id is ``key|offset|shape|flat range``)."""
    from ..adapters.dtensor import dtensor_shards
    from ..adapters.model import ModelState
    from ..state.sharding import ShardedTensor
    from ..state.tree import flatten

    leaves = flatten(state, module_adapter=ModelState)
    sts: list[ShardedTensor] = list(leaves.tensors)
    for path, t in leaves.plain.items():
        sts.append(ShardedTensor(path, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim()))
    for path, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(path, dt))
    out: dict[str, tuple[int, int]] = {}
    for st in sts:
        fb = st.flat_bounds
        cid = f"{st.fqn}|{tuple(st.global_offset)}|{tuple(st.local_shape)}|{fb}"
        out[cid] = (chunk_sum(st.data, tuple(st.global_shape), tuple(st.global_offset),
                              tuple(st.local_shape), fb[0] if fb else 0),
                    st.data.numel() * st.data.element_size())
    return out


def combine(per_rank: list[dict[str, tuple[int, int]]]) -> dict[str, Any]:
    """One digest from every rank's chunks: ``{"digest": hex, "tensors": n,
    "chunks": n, "bytes": logical bytes (each chunk once), "replicas_differ":
    [chunk ids]}``."""
    chunks: dict[str, tuple[int, int]] = {}
    differ: list[str] = []
    for d in per_rank:
        for cid, v in d.items():
            if cid in chunks and chunks[cid][0] != v[0]:
                differ.append(cid)
            chunks.setdefault(cid, v)
    per_key: dict[str, int] = {}
    for cid, (hs, _) in chunks.items():
        key = cid.split("|", 1)[0]
        per_key[key] = (per_key.get(key, 0) + hs) & _MASK
    import xxhash

    h = xxhash.xxh3_64()
    for k in sorted(per_key):
        h.update(f"{k}={per_key[k]};".encode())
    return {"digest": h.hexdigest(), "tensors": len(per_key), "chunks": len(chunks),
            "bytes": sum(b for _, b in chunks.values()), "replicas_differ": sorted(set(differ))[:10]}


def state_digest(state: Any) -> dict[str, Any]:
    """:func:`combine` of every rank's :func:`local_chunks` (a collective:
    every rank of the default group calls it; each gets the same result)."""
    mine = local_chunks(state)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return combine([mine])
    got: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, got if dist.get_rank() == 0 else None, dst=0)
    box = [combine(got) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return dict(box[0])  # type: ignore[arg-type]
