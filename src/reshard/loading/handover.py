"""The replica handover of a load (``LoadOptions.read_once``): ranges that several ranks need
are read from storage by one of them and sent to the others over the group (small ranges
packed per pair of ranks); a failed handover falls back to every rank reading for itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..collectives import Collectives
from ..errors import (
    CheckpointError,
)
from ..planning.coordination_load import read_once
from .check import _Plan


@dataclass(kw_only=True)
class _Handover:
    """This rank's part in reading replicas once, by group key (see
    :func:`reshard.planning.coordination_load.read_once`): groups it receives (from
    rank, tag) and groups it reads and sends (to ranks, tag); bytes moved."""

    recv: dict[tuple[str, int], tuple[int, int]]
    send: dict[tuple[str, int], tuple[tuple[int, ...], int]]
    received: int = 0
    sent: int = 0


def _plan_handover(coll: Collectives, plan: _Plan, min_bytes: int) -> _Handover:
    """Every rank's chunk ranges of at least ``min_bytes`` to the coordinator,
    its own handover back (one gather, one scatter)."""
    index = {f: i for i, f in enumerate(sorted(plan.manifest.tensors))}
    keys, units = [], []
    for f, ci in plan.groups:
        lo, hi = plan.reader.unit_range(plan.groups[(f, ci)])
        if hi - lo >= min_bytes:
            keys.append((f, ci))
            units.append((index[f], ci, lo, hi))
    h = read_once(coll, units)
    return _Handover(recv={keys[i]: v for i, v in h.recv.items()},
                     send={keys[i]: v for i, v in h.send.items()})


#: handed-over ranges smaller than this (bytes) travel packed per pair of ranks
PACK_BYTES = 1 << 20


#: the tag of the packed message between a pair of ranks (above every range's tag)
PACK_TAG = 1 << 30


def _hand_over(coll: Collectives, plan: _Plan, hand: _Handover) -> str | None:
    """Send the ranges this rank read to the ranks that need them and receive
    its own (straight into a destination where the read would have been
    direct, else into a buffer then placed). Every rank learns whether every
    rank's handover completed (one all-reduce). Returns None when it did,
    else the failure (this rank's own, or "on another rank"): the caller then
    reads the received ranges from storage on every rank."""
    rd = plan.reader
    mine: str | None = None
    try:
        sends: list[tuple[int, int, torch.Tensor]] = []
        recvs: list[tuple[int, int, torch.Tensor]] = []
        places: list[tuple[tuple[str, int], torch.Tensor]] = []
        # ranges under PACK_BYTES travel packed: one message per (reader, receiver)
        # pair, in tag order (a message per small range costs more than its bytes)
        packs_out: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        packs_in: dict[int, list[tuple[int, tuple[str, int], torch.Tensor, bool]]] = defaultdict(list)
        for k, (dsts, tag) in hand.send.items():
            buf = rd.kept.pop(k) if k in rd.kept else rd.hand_buffer(plan.groups[k])[0]
            for d in dsts:
                if buf.numel() >= PACK_BYTES:
                    sends.append((d, tag, buf))
                else:
                    packs_out[d].append((tag, buf))
            hand.sent += buf.numel() * len(dsts)
        for k, (src, tag) in hand.recv.items():
            items = plan.groups[k]
            buf, direct = rd.hand_buffer(items)
            if direct:
                rd.mark_written(items[0][1].req.fqn)
            if buf.numel() < PACK_BYTES:
                packs_in[src].append((tag, k, buf, direct))
                continue
            if not direct:
                places.append((k, buf))
            recvs.append((src, tag, buf))
        for d, parts in packs_out.items():
            parts.sort(key=lambda p: p[0])
            sends.append((d, PACK_TAG, torch.cat([b for _, b in parts]) if parts else torch.empty(0)))
        unpack: list[tuple[torch.Tensor, list[tuple[int, tuple[str, int], torch.Tensor, bool]]]] = []
        for src, ins in packs_in.items():
            ins.sort(key=lambda p: p[0])
            whole = torch.empty(sum(b.numel() for _, _, b, _ in ins), dtype=torch.uint8)
            recvs.append((src, PACK_TAG, whole))
            unpack.append((whole, ins))
        coll.exchange(sends, recvs)
        hand.received = sum(t.numel() for _, _, t in recvs)
        for whole, ins in unpack:
            at = 0
            for _, k, buf, direct in ins:
                buf.copy_(whole[at:at + buf.numel()])
                at += buf.numel()
                if not direct:
                    places.append((k, buf))
        for (f, ci), buf in places:
            rd.place(f, ci, plan.groups[(f, ci)], buf)
    except Exception as e:  # noqa: BLE001 - every rank falls back below
        mine = f"{type(e).__name__}: {e}"[:500]
    rd.kept.clear()
    failed = coll.all_reduce_ints([1 if mine else 0], "max")[0]
    if not failed:
        return None
    hand.received = 0
    return mine or "the handover failed on another rank"


def _raise_after_writes(rank: int, agreed: CheckpointError, mine: BaseException | None,
                        written: Sequence[str]) -> None:
    """Raise the agreed failure of the writing phase (``on_fail`` of
    :class:`reshard.collectives.Tries`), naming the targets this rank had
    already written: they hold a mix of checkpoint and earlier values and
    must be reloaded."""
    if written:
        note = (f"\nrank {rank} had already written {len(written)} target(s), which must be "
                f"reloaded (they may mix checkpoint and earlier values): {list(written[:20])}"
                + (f" and {len(written) - 20} more" if len(written) > 20 else ""))
    else:
        note = f"\nrank {rank} had written no target (every target of this rank is unchanged)"
    raise type(agreed)(str(agreed) + note, failures=agreed.failures) from mine
