"""Tensor-parallel primitives of the reference model (:mod:`reshard.demo.model`): a rank's
place in its TP group, the identity/all-reduce pair of Megatron's column and row layers, the
vocab-parallel cross-entropy, and counter-based dropout (the same mask in every layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..adapters.rng import counter_uniform


@dataclass(frozen=True)
class TP:
    """This rank's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, all-reduce of the gradient (Megatron's ``f``)."""
        return x if self.size == 1 else _Copy.apply(x, self.group)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce forward, identity backward (Megatron's ``g``)."""
        return x if self.size == 1 else _Reduce.apply(x, self.group)

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """``(rows per rank, first row, logical rows held)`` of a vocab-parallel shard."""
        rows = -(-vocab // self.size)
        start = self.rank * rows
        return rows, start, max(0, min(rows, vocab - start))


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _VocabParallelCE(torch.autograd.Function):
    """Per-row cross entropy of logits split over TP along the vocabulary
    (Megatron-LM ``vocab_parallel_cross_entropy``); columns at or past
    ``valid`` are padding and get probability 0."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, valid: int,
                tp: TP) -> torch.Tensor:
        n, cols = logits.shape
        lg = logits.detach()
        if valid < cols:
            lg = lg.clone()
            lg[:, valid:] = float("-inf")
        live = tp.size > 1 and n > 0
        m = lg.max(dim=-1).values if cols else torch.full((n,), float("-inf"))
        if live:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)
        sh = lg - m[:, None]
        e = sh.exp()
        s = e.sum(-1)
        inr = (target >= start) & (target < start + valid)
        lt = torch.where(inr, target - start, torch.zeros_like(target))
        pred = torch.where(inr, sh.gather(1, lt[:, None]).squeeze(1), torch.zeros_like(s))
        if live:
            dist.all_reduce(s, group=tp.group)
            dist.all_reduce(pred, group=tp.group)
        ctx.save_for_backward(e / s[:, None], lt, inr)
        return s.log() - pred

    @staticmethod
    def backward(ctx: Any, gl: torch.Tensor) -> tuple[Any, ...]:
        p, lt, inr = ctx.saved_tensors
        g = p.clone()
        rows = torch.arange(g.shape[0])
        g[rows, lt] -= inr.to(g.dtype)
        return g * gl[:, None], None, None, None, None


def counter_dropout(x: torch.Tensor, p: float, *, seed: int, step: int, site: int,
                    samples: list[int], dataset_len: int, tail_shape: tuple[int, ...],
                    tail_offset: tuple[int, ...]) -> torch.Tensor:
    """Dropout of ``x`` (``[len(samples), *box]``): element ``(b, *j)`` keeps
    ``x`` when ``counter_uniform`` of logical index ``(samples[b], *(tail_offset
    + j))`` in ``(dataset_len, *tail_shape)`` is at least ``p``."""
    if p <= 0.0:
        return x
    box = tuple(x.shape[1:])
    u = torch.cat([counter_uniform(seed, step, (dataset_len, *tail_shape), (s, *tail_offset),
                                   (1, *box), stream=site) for s in samples])
    return x * ((u >= p).to(x.dtype) * (1.0 / (1.0 - p)))
