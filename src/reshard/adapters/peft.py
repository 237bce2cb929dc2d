"""Adapters (LoRA/PEFT) on a frozen base: the identity of the base, the
sharding rule of LoRA weights, and the helpers :class:`~reshard.ModelState`
uses for ``trainable_only``.

**The base's identity** (:func:`base_identity`), recorded by a
``ModelState(model, trainable_only=True)`` save, which stores the trainable
parameters only: per tensor of the base (every ``state_dict`` entry that is
not a trainable parameter), its dtype, its global shape and a 128-bit digest
of its logical elements that does not depend on the parallel layout: the sum
(mod 2**64, in two lanes with different mixing constants) of a 64-bit mix of
each element's global row-major index and its bits. A sum over elements is
the same however the tensor is cut into chunks, so a base saved at TP=2 and
checked at TP=1 (or after any DP/FSDP change) has the same identity; a
changed element, a changed dtype or a changed shape changes it. Each rank
mixes the elements of the chunks it holds (a sharded tensor: its box; a
plain tensor: the coordinator only), the coordinator gathers the chunk sums
(O(own chunks) from each rank), counts each distinct chunk once (DP
replicas) and broadcasts the identity: one gather and one broadcast on the
adapter's group, bounded by the checkpoint timeout. The elements are hashed
once per run (kept while no base tensor changes: their version counters).
Not cryptographic: it detects another base, not an adversary.

**The LoRA rule** (:func:`lora_layout` for ``layout=``, :func:`distribute_lora`
for DTensor placements): on a column-parallel base layer (its weight
``[out, in]`` split along ``out``), ``lora_B`` ``[out, r]`` is split along
``out`` like it and ``lora_A`` ``[r, in]`` is replicated; on a row-parallel
one (split along ``in``), ``lora_A`` is split along ``in`` and ``lora_B`` is
replicated. This is what PEFT creates on each rank's local shard of the base
layer, and the sum ``W x + B A x`` of the shards equals the unsharded one.
The optimizer moments of the adapters follow the same rule
(:class:`~reshard.OptimizerState` shards state like its parameter).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch
import xxhash

from ..errors import CheckpointError, ShardingError
from ..state.sharding import ShardedTensor, dtype_name, numel
from .names import canonical_parameters

_M64 = (1 << 64) - 1
#: two lanes: (odd multiplier of the index, of the bits, of the mix), splitmix64-style constants
_LANES = ((0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB),
          (0xD6E8FEB86659FD93, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))
_SLAB = 1 << 22  # elements mixed at once (bounds the int64 temporaries)


def _s64(c: int) -> int:
    """``c`` (unsigned 64-bit) as a signed int64 constant for torch."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``k`` bits."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` (1-D, contiguous) as int64 of their bit patterns."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8).to(torch.int64)
    if t.is_complex():  # (re, im) bit patterns, combined into one int64 per element
        pair = _bits(torch.view_as_real(t).reshape(-1)).view(-1, 2)
        return pair[:, 0] * _s64(0x9E3779B97F4A7C15) + pair[:, 1]
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view).to(torch.int64)


def _global_index(pos: torch.Tensor, local_shape: tuple[int, ...], offset: tuple[int, ...],
                  gshape: tuple[int, ...]) -> torch.Tensor:
    """Global row-major flat indices of the elements at local flat positions ``pos``."""
    out = torch.zeros_like(pos)
    rest = pos
    gstrides = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        gstrides[d] = gstrides[d + 1] * gshape[d + 1]
    for d in range(len(local_shape) - 1, -1, -1):
        n = max(local_shape[d], 1)
        out += (rest % n + offset[d]) * gstrides[d]
        rest = rest // n
    return out


def chunk_sums(st: ShardedTensor) -> tuple[int, int]:
    """The two lane sums (unsigned 64-bit) of the elements of one chunk: a
    64-bit mix of each element's global flat index and its bits, summed."""
    data = st.data.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    flat = data.contiguous().reshape(-1)
    fr = st.flat_bounds
    first = fr[0] if fr is not None else 0
    sums = [0, 0]
    for a in range(0, flat.numel(), _SLAB):
        part = flat[a:a + _SLAB]
        pos = torch.arange(first + a, first + a + part.numel(), dtype=torch.int64)
        idx = _global_index(pos, tuple(st.local_shape), tuple(st.global_offset), tuple(st.global_shape))
        bits = _bits(part)
        for lane, (ci, cb, cm) in enumerate(_LANES):
            z = idx * _s64(ci) + bits * _s64(cb)
            z = (z ^ _srl(z, 30)) * _s64(cm)
            z = (z ^ _srl(z, 27)) * _s64(ci)
            z = z ^ _srl(z, 31)
            sums[lane] = (sums[lane] + int(z.sum())) & _M64
    return sums[0], sums[1]


class _ChunkSum(msgspec.Struct, array_like=True, frozen=True):
    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    flat: tuple[int, int] | None
    lanes: tuple[int, int]


def _combine(parts: Iterable[list[_ChunkSum]]) -> dict[str, Any]:
    """The coordinator: every distinct chunk once, summed per tensor."""
    seen: dict[tuple[Any, ...], _ChunkSum] = {}
    for rank_parts in parts:
        for c in rank_parts:
            seen.setdefault((c.fqn, c.global_offset, c.local_shape, c.flat), c)
    per: dict[str, list[Any]] = {}
    for c in seen.values():
        e = per.setdefault(c.fqn, [c.dtype, list(c.global_shape), 0, 0, 0])
        if e[0] != c.dtype or e[1] != list(c.global_shape):
            raise ShardingError(f"{c.fqn}: ranks hold it as {e[0]} {e[1]} and as {c.dtype} "
                                f"{list(c.global_shape)}")
        e[2] = (e[2] + c.lanes[0]) & _M64
        e[3] = (e[3] + c.lanes[1]) & _M64
        e[4] += (c.flat[1] - c.flat[0]) if c.flat is not None else numel(c.local_shape)
    tensors = {}
    for fqn in sorted(per):
        dt, shape, l1, l2, n = per[fqn]
        if n != numel(tuple(shape)):
            raise ShardingError(f"{fqn}: the ranks hold {n} of its {numel(tuple(shape))} elements: "
                                "the base's identity needs every element of every base tensor")
        tensors[fqn] = [dt, shape, f"{l1:016x}{l2:016x}"]
    digest = xxhash.xxh3_128_hexdigest(msgspec.json.encode(tensors))
    return {"digest": digest, "tensors": tensors}


def base_identity(chunks: list[ShardedTensor], coll: Any, cache: dict[Any, tuple[int, int]]) -> dict[str, Any]:
    """The base's identity (module docstring) from this rank's chunks of the
    base tensors; collective over ``coll`` (every rank calls it). ``cache``:
    chunk sums kept between calls (keyed by the tensor's storage, version
    and box), so an unchanged base is not hashed again.

    Returns ``{"digest": hex, "tensors": {fqn: [dtype, global_shape, hex]}}``,
    equal on every rank.

    Raises:
        ShardingError: ranks disagree on a tensor's dtype or shape, or the
            ranks together do not hold every element of a base tensor.
    """
    mine: list[_ChunkSum] = []
    for st in chunks:
        if st.data.numel() and st.data.device.type == "meta":
            raise ShardingError(f"{st.fqn}: the base tensor is on the meta device (not materialised): "
                                "its identity cannot be computed")
        d = st.data
        key = (st.fqn, d.untyped_storage().data_ptr() if d.numel() else 0, d.storage_offset(),
               getattr(d, "_version", 0), tuple(d.shape), tuple(st.global_offset), st.flat_bounds,
               d.dtype)
        lanes = cache.get(key)
        if lanes is None:
            lanes = cache[key] = chunk_sums(st)
        mine.append(_ChunkSum(st.fqn, dtype_name(d.dtype), tuple(st.global_shape), tuple(st.global_offset),
                              tuple(st.local_shape), st.flat_bounds, lanes))
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(list[_ChunkSum])
    got = coll.gather_bytes(enc.encode(mine))
    out: bytes | None = None
    err = ""
    if got is not None:
        try:
            out = msgspec.json.encode(_combine(dec.decode(b) for b in got))
        except ShardingError as e:
            err = str(e)
            out = msgspec.json.encode({"error": err})
    raw = coll.broadcast_bytes(out)
    ident = msgspec.json.decode(raw)
    if "error" in ident:
        raise ShardingError(ident["error"])
    return dict(ident)


def differences(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """One line naming how ``current`` differs from ``saved`` (identities of
    :func:`base_identity`), or None when they are equal."""
    if saved.get("digest") == current.get("digest"):
        return None
    a, b = saved.get("tensors") or {}, current.get("tensors") or {}
    diffs: list[str] = []
    for fqn in sorted(set(a) | set(b)):
        if fqn not in b:
            diffs.append(f"{fqn}: in the saved base, not in this model")
        elif fqn not in a:
            diffs.append(f"{fqn}: in this model, not in the saved base")
        elif a[fqn][0] != b[fqn][0]:
            diffs.append(f"{fqn}: dtype {b[fqn][0]}, the saved base's {a[fqn][0]}")
        elif list(a[fqn][1]) != list(b[fqn][1]):
            diffs.append(f"{fqn}: shape {list(b[fqn][1])}, the saved base's {list(a[fqn][1])}")
        elif a[fqn][2] != b[fqn][2]:
            diffs.append(f"{fqn}: other values than the saved base's")
    if not diffs:
        diffs.append(f"digest {current.get('digest')}, the saved base's {saved.get('digest')}")
    more = f" (and {len(diffs) - 1} more tensor(s) differ)" if len(diffs) > 1 else ""
    return diffs[0] + more


def refuse(where: str, why: str) -> CheckpointError:
    """The one-line refusal of a resume onto another base."""
    return CheckpointError(
        f"{where}: this checkpoint holds trainable parameters only and was trained on another base: "
        f"{why}; refusing to resume onto it (load the base it was trained on, or resume from a "
        "checkpoint that holds the base)")


# ----------------------------------------------------------------------------- the LoRA rule

_LORA = re.compile(r"^(?P<prefix>.*)\.(?P<kind>lora_A|lora_B)\.(?P<name>[^.]+)\.weight$")


def _split_dim(st: ShardedTensor) -> int | None:
    """The dim along which a base weight's chunk is split (None: whole)."""
    split = [d for d, (n, g) in enumerate(zip(st.local_shape, st.global_shape, strict=True)) if n != g]
    if st.flattened_range is not None or len(split) > 1:
        raise ShardingError(f"{st.fqn}: a LoRA base layer must be split along one dim (column or row "
                            f"parallel), not as {list(st.local_shape)} of {list(st.global_shape)}")
    return split[0] if split else None


def lora_views(fqn: str, t: torch.Tensor, base: ShardedTensor) -> ShardedTensor:
    """The ShardedTensor of LoRA weight ``fqn`` (``...lora_A.<adapter>.weight``
    or ``...lora_B....``, this rank's local tensor ``t``) given its base
    layer's chunk ``base`` on this rank, by the rule of the module docstring.

    Raises:
        ShardingError: the base is split along neither dim 0 (column) nor 1
            (row), or ``t``'s shape does not fit the rule.
    """
    m = _LORA.match(fqn)
    if m is None:
        raise ShardingError(f"{fqn}: not a LoRA weight (…lora_A.<name>.weight / …lora_B.<name>.weight)")
    a = m.group("kind") == "lora_A"
    dim = _split_dim(base)
    out_g, in_g = base.global_shape[0], base.global_shape[1]
    if dim is None:  # the base layer is whole here: so are its adapters
        return ShardedTensor(fqn, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim(),
                             replica_id=base.replica_id)
    n = base.local_shape[dim]
    tp_rank = base.global_offset[dim] // max(n, 1)
    r = t.shape[0] if a else t.shape[1]
    if dim == 0:  # column parallel: B split along out like the base, A replicated
        if a:
            want, gshape, goff = (r, in_g), (r, in_g), (0, 0)
        else:
            want, gshape, goff = (n, r), (out_g, r), (base.global_offset[0], 0)
    elif dim == 1:  # row parallel: A split along in like the base, B replicated
        if a:
            want, gshape, goff = (r, n), (r, in_g), (0, base.global_offset[1])
        else:
            want, gshape, goff = (out_g, r), (out_g, r), (0, 0)
    else:
        raise ShardingError(f"{base.fqn}: a LoRA base layer split along dim {dim} (only 0: column "
                            "parallel, or 1: row parallel, have a rule)")
    if tuple(t.shape) != want:
        raise ShardingError(f"{fqn}: local shape {list(t.shape)}, the LoRA rule for a "
                            f"{'column' if dim == 0 else 'row'}-parallel base chunk "
                            f"{list(base.local_shape)} of {list(base.global_shape)} wants {list(want)}")
    replicated = (dim == 0 and a) or (dim == 1 and not a)
    return ShardedTensor(fqn, t, global_shape=gshape, global_offset=goff,
                         replica_id=tp_rank if replicated else base.replica_id)


def lora_layout(model: torch.nn.Module, base_layout: Callable[[str, torch.Tensor], Any]) -> Any:
    """A ``ModelState`` layout for a PEFT model whose base layers are split by
    ``base_layout`` (column or row parallel): the base weights as
    ``base_layout`` says, every ``lora_A``/``lora_B`` weight by the LoRA rule
    from its base layer's chunk (``<prefix>.base_layer.weight``), anything
    else as ``base_layout`` says (None: replicated)."""
    params = dict(canonical_parameters(model))

    def layout(fqn: str, t: torch.Tensor) -> Any:
        m = _LORA.match(fqn)
        if m is None:
            return base_layout(fqn, t)
        bfqn = f"{m.group('prefix')}.base_layer.weight"
        bp = params.get(bfqn)
        if bp is None:
            raise ShardingError(f"{fqn}: no base layer weight {bfqn!r} beside it")
        got = base_layout(bfqn, bp.data)
        views = [got] if isinstance(got, ShardedTensor) else list(got or [])
        if len(views) > 1:
            raise ShardingError(f"{bfqn}: a fused base layer ({len(views)} views) has no LoRA rule")
        base = views[0] if views else ShardedTensor(bfqn, bp.data, global_shape=tuple(bp.shape),
                                                    global_offset=(0,) * bp.dim())
        return lora_views(fqn, t, base)

    return layout


def distribute_lora(model: torch.nn.Module) -> list[str]:
    """Give every LoRA weight whose base layer weight is a DTensor split along
    dim 0 or 1 the placements of the LoRA rule on the base's mesh (its local
    tensor as it is: PEFT made it from the local shard): returns the fqns
    changed. Parameters are replaced by DTensor parameters (build the
    optimizer after)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    changed = []
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        base = getattr(mod, "base_layer", None)
        w = getattr(base, "weight", None)
        if not isinstance(w, DTensor) or not hasattr(mod, "lora_A"):
            continue
        shard_dims = [p.dim for p in w.placements if isinstance(p, Shard)]
        if len(shard_dims) != 1 or shard_dims[0] not in (0, 1):
            continue
        dim = shard_dims[0]
        for kind in ("lora_A", "lora_B"):
            for adapter, lin in getattr(mod, kind).items():
                p = lin.weight
                if isinstance(p, DTensor):
                    continue
                split = (kind == "lora_B" and dim == 0) or (kind == "lora_A" and dim == 1)
                placements = [Shard(dim) if isinstance(q, Shard) and split else Replicate()
                              for q in w.placements]
                gshape = list(p.shape)
                if split:
                    gshape[dim] = w.shape[dim]
                dt = DTensor.from_local(p.data, w.device_mesh, placements, shape=torch.Size(gshape),
                                        stride=torch.empty(gshape, device="meta").stride(),
                                        run_check=False)
                lin.weight = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
                changed.append(f"{name}.{kind}.{adapter}.weight")
    return changed
