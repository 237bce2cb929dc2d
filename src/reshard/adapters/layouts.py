"""Layout helpers: describe physical per-rank buffers as views onto canonical
logical tensors, so that a checkpoint never depends on the parallel layout.

* :func:`fused_views`: a TP rank's fused buffer packing several logical
  tensors per rank, e.g. ``[q_r; k_r; v_r]`` or ``[gate_r; up_r]`` (column
  parallel, split along ``dim``).
* :func:`interleaved_qkv_views`: Megatron-LM's fused QKV interleaved per query
  group (``[q_g; k_g; v_g]`` for each local group ``g``; see Megatron-LM
  ``SelfAttention`` / ``get_query_key_value_tensors``).
* :func:`vocab_parallel_view`: a vocabulary-parallel embedding padded to a
  multiple of TP: only the logical rows are saved; padding rows are never
  data (on load they keep their constructed value; :func:`vocab_padding`
  returns them for a fill rule).
* :func:`flat_param_shards`: a ZeRO / flat-buffer shard holding a contiguous
  range of several parameters laid out back to back (padding at the end is not
  data), as ShardedTensors with ``flattened_range``.

All sizes are in elements (rows along ``dim``); offsets are row-major,
intervals half-open. The fqns passed in are names relative to the adapter
whose layout returns the views (for ModelState the canonical tensor's fqn, for
OptimizerState ``state.{fqn}.{key}``): the state tree adds the adapter's path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShardingError
from ..state.sharding import ShardedTensor, numel


def _even(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ShardingError(f"{what}: {n} rows do not split evenly over {tp} tensor-parallel ranks")
    return n // tp


def fused_views(local: torch.Tensor, fqns: Sequence[str], sizes: Sequence[int], *, tp_rank: int,
                tp_size: int, dim: int = 0, replica_id: int = 0) -> list[ShardedTensor]:
    """Views of a fused per-rank buffer ``[part_0_r; part_1_r; ...]`` along ``dim``.

    Args:
        local: this rank's buffer; along ``dim`` it holds ``sizes[i] / tp_size``
            rows of each logical tensor ``fqns[i]``, in order.
        sizes: global rows of each logical tensor along ``dim``.

    Returns:
        One ShardedTensor per logical tensor, global shape = ``local``'s shape
        with ``sizes[i]`` along ``dim``.
    """
    out = []
    start = 0
    for fqn, size in zip(fqns, sizes, strict=True):
        n = _even(size, tp_size, fqn)
        view = local.narrow(dim, start, n)
        gshape = list(local.shape)
        gshape[dim] = size
        goff = [0] * local.dim()
        goff[dim] = tp_rank * n
        out.append(ShardedTensor(fqn, view, global_shape=tuple(gshape), global_offset=tuple(goff),
                                 replica_id=replica_id))
        start += n
    if start != local.shape[dim]:
        raise ShardingError(f"{list(fqns)}: parts hold {start} rows, the fused buffer has "
                            f"{local.shape[dim]} along dim {dim}")
    return out


def interleaved_qkv_views(local: torch.Tensor, fqns: tuple[str, str, str], *, num_heads: int,
                          num_query_groups: int, head_dim: int, tp_rank: int, tp_size: int,
                          replica_id: int = 0) -> list[ShardedTensor]:
    """Views of Megatron's fused QKV buffer, interleaved per query group.

    The buffer holds, for each of its ``num_query_groups / tp_size`` local
    groups, ``heads_per_group * head_dim`` query rows, then ``head_dim`` key
    rows, then ``head_dim`` value rows (dim 0). Canonical tensors: ``q`` of
    ``num_heads * head_dim`` rows, ``k`` and ``v`` of ``num_query_groups *
    head_dim`` rows each; trailing dims as ``local``.
    """
    if num_heads % num_query_groups:
        raise ShardingError("num_heads must be a multiple of num_query_groups")
    hpg = num_heads // num_query_groups
    groups = _even(num_query_groups, tp_size, "query groups")
    rest = tuple(local.shape[1:])
    per = (hpg + 2) * head_dim
    if local.shape[0] != groups * per:
        raise ShardingError(f"fused QKV buffer has {local.shape[0]} rows, expected {groups * per}")
    qf, kf, vf = fqns
    out = []
    for j in range(groups):
        g = tp_rank * groups + j
        base = j * per
        parts = ((qf, hpg * head_dim, num_heads * head_dim, g * hpg * head_dim),
                 (kf, head_dim, num_query_groups * head_dim, g * head_dim),
                 (vf, head_dim, num_query_groups * head_dim, g * head_dim))
        for fqn, rows, total, goff in parts:
            out.append(ShardedTensor(fqn, local.narrow(0, base, rows), global_shape=(total, *rest),
                                     global_offset=(goff,) + (0,) * len(rest), replica_id=replica_id))
            base += rows
    return out


def vocab_parallel_view(local: torch.Tensor, fqn: str, *, vocab_size: int, tp_rank: int,
                        tp_size: int, replica_id: int = 0) -> ShardedTensor:
    """The logical rows of a vocab-parallel shard padded to a multiple of TP.

    ``local`` has ``padded_vocab / tp_size`` rows; rank ``r`` holds padded rows
    ``[r * rows, (r + 1) * rows)``; rows at or past ``vocab_size`` are padding
    and are not saved (a rank may hold zero logical rows).
    """
    rows = local.shape[0]
    start = tp_rank * rows
    valid = max(0, min(rows, vocab_size - start))
    return ShardedTensor(fqn, local.narrow(0, 0, valid), global_shape=(vocab_size, *local.shape[1:]),
                         global_offset=(min(start, vocab_size),) + (0,) * (local.dim() - 1),
                         replica_id=replica_id)


def vocab_padding(local: torch.Tensor, *, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """The padding rows of a vocab-parallel shard (a view; fill it by your rule)."""
    rows = local.shape[0]
    valid = max(0, min(rows, vocab_size - tp_rank * rows))
    return local.narrow(0, valid, rows - valid)


def flat_param_shards(params: Sequence[tuple[str, tuple[int, ...]]], local: torch.Tensor,
                      start: int, *, replica_id: int = 0) -> list[ShardedTensor]:
    """ShardedTensors for a rank's range of a flat buffer of several parameters.

    Args:
        params: ``(fqn, shape)`` of each parameter, in buffer order, back to
            back from flat element 0 (anything after the last is padding).
        local: 1-D, this rank's elements ``[start, start + len(local))`` of the
            buffer.
        start: flat element offset of ``local[0]`` in the buffer.
    """
    if local.dim() != 1:
        raise ShardingError("flat_param_shards: local must be 1-D")
    stop = start + local.numel()
    out = []
    a = 0
    for fqn, shape in params:
        n = numel(shape)
        lo, hi = max(a, start), min(a + n, stop)
        if lo < hi:
            out.append(ShardedTensor(fqn, local[lo - start:hi - start], global_shape=tuple(shape),
                                     global_offset=(0,) * len(shape), local_shape=tuple(shape),
                                     flattened_range=slice(lo - a, hi - a), replica_id=replica_id))
        a += n
    return out
