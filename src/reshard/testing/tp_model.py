"""A tiny tensor-parallel attention + gated-MLP block, for resharding tests.

:class:`Reference` is the unsharded model with canonical parameter names
(``attn.q.weight``, ``attn.k.weight``, ``attn.v.weight``, ``attn.o.weight``,
``mlp.gate.weight``, ``mlp.up.weight``, ``mlp.down.weight``; all ``Linear``
weights ``[out, in]`` without bias). :class:`TPBlock` is one tensor-parallel
rank of it, Megatron style:

* ``attn.qkv.weight``: column parallel, fused and packed per rank
  ``[q_r; k_r; v_r]`` (this rank's heads);
* ``attn.o.weight``: row parallel, ``[hidden, heads_r * head_dim]`` (split
  along dim 1);
* ``mlp.gate_up.weight``: column parallel, fused ``[gate_r; up_r]``;
* ``mlp.down.weight``: row parallel, ``[hidden, ffn_r]``.

The outputs of the row-parallel projections are partial sums, added over the
tensor-parallel group with ``all_reduce``. :meth:`TPBlock.layout` describes
the local buffers as views onto the canonical tensors, so a checkpoint saved
at one TP size loads at another (and into :class:`Reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.layouts import fused_views
from ..state.sharding import ShardedTensor


@dataclass(frozen=True)
class Config:
    hidden: int = 8
    heads: int = 4
    head_dim: int = 2
    ffn: int = 8

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim


QKV = ("attn.q.weight", "attn.k.weight", "attn.v.weight")
GATE_UP = ("mlp.gate.weight", "mlp.up.weight")


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Causal attention of ``[T, heads * head_dim]`` inputs -> ``[T, heads * head_dim]``."""
    t = q.shape[0]
    q, k, v = (x.reshape(t, heads, head_dim).transpose(0, 1) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(t, heads * head_dim)


class _RefAttn(nn.Module):
    """``Reference.attn``: a name scope for the attention projections."""

    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear


class _RefMLP(nn.Module):
    """``Reference.mlp``: a name scope for the MLP projections."""

    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


class _TPAttn(nn.Module):
    """``TPBlock.attn``: a name scope for this rank's attention projections."""

    qkv: nn.Linear
    o: nn.Linear


class _TPMLP(nn.Module):
    """``TPBlock.mlp``: a name scope for this rank's MLP projections."""

    gate_up: nn.Linear
    down: nn.Linear


class Reference(nn.Module):
    """The unsharded block: ``y = x + o(attn(q x, k x, v x)); z = y + down(silu(gate y) * up y)``."""

    def __init__(self, cfg: Config = Config(), *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        d, a, f = cfg.hidden, cfg.attn_dim, cfg.ffn
        self.attn = _RefAttn()
        self.attn.q, self.attn.k, self.attn.v = _linear(d, a), _linear(d, a), _linear(d, a)
        self.attn.o = _linear(a, d)
        self.mlp = _RefMLP()
        self.mlp.gate, self.mlp.up, self.mlp.down = _linear(d, f), _linear(d, f), _linear(f, d)
        if generator is not None:
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        at = self.attn
        y = x + at.o(_attend(at.q(x), at.k(x), at.v(x), c.heads, c.head_dim))
        return y + self.mlp.down(F.silu(self.mlp.gate(y)) * self.mlp.up(y))


class TPBlock(nn.Module):
    """Tensor-parallel rank ``tp_rank`` of ``tp_size`` of :class:`Reference`."""

    def __init__(self, cfg: Config = Config(), *, tp_rank: int = 0, tp_size: int = 1,
                 generator: torch.Generator | None = None):
        super().__init__()
        if cfg.heads % tp_size or cfg.ffn % tp_size:
            raise ValueError(f"heads {cfg.heads} and ffn {cfg.ffn} must divide by tp_size {tp_size}")
        self.cfg, self.tp_rank, self.tp_size = cfg, tp_rank, tp_size
        d = cfg.hidden
        a, f = cfg.attn_dim // tp_size, cfg.ffn // tp_size
        self.attn = _TPAttn()
        self.attn.qkv = _linear(d, 3 * a)
        self.attn.o = _linear(a, d)
        self.mlp = _TPMLP()
        self.mlp.gate_up = _linear(d, 2 * f)
        self.mlp.down = _linear(f, d)
        if generator is not None:
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.5)

    # -- layout
    def layout(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor] | ShardedTensor | None:
        """``ModelState`` layout: this rank's buffers as views of the canonical tensors."""
        c, r, n = self.cfg, self.tp_rank, self.tp_size
        if fqn == "attn.qkv.weight":
            return fused_views(t, QKV, [c.attn_dim] * 3, tp_rank=r, tp_size=n)
        if fqn == "mlp.gate_up.weight":
            return fused_views(t, GATE_UP, [c.ffn] * 2, tp_rank=r, tp_size=n)
        if fqn == "attn.o.weight":
            cols = c.attn_dim // n
            return ShardedTensor(fqn, t, global_shape=(c.hidden, c.attn_dim), global_offset=(0, r * cols))
        if fqn == "mlp.down.weight":
            cols = c.ffn // n
            return ShardedTensor(fqn, t, global_shape=(c.hidden, c.ffn), global_offset=(0, r * cols))
        return None

    @classmethod
    def from_reference(cls, ref: Reference, *, tp_rank: int, tp_size: int) -> TPBlock:
        """The rank-``tp_rank`` module holding ``ref``'s weights."""
        m = cls(ref.cfg, tp_rank=tp_rank, tp_size=tp_size)
        full = ref.state_dict()
        with torch.no_grad():
            for name, p in m.named_parameters():
                views = m.layout(name, p.data)
                assert views is not None
                for st in [views] if isinstance(views, ShardedTensor) else views:
                    box = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.local_shape, strict=True))
                    st.data.copy_(full[st.fqn][box])
        return m

    # -- forward
    def forward(self, x: torch.Tensor, group: object = None) -> torch.Tensor:
        c = self.cfg
        heads = c.heads // self.tp_size
        a = heads * c.head_dim
        q, k, v = self.attn.qkv(x).split(a, dim=-1)
        y = x + self._reduce(self.attn.o(_attend(q, k, v, heads, c.head_dim)), group)
        gate, up = self.mlp.gate_up(y).split(c.ffn // self.tp_size, dim=-1)
        return y + self._reduce(self.mlp.down(F.silu(gate) * up), group)

    def _reduce(self, partial: torch.Tensor, group: object) -> torch.Tensor:
        if self.tp_size == 1:
            return partial
        import torch.distributed as dist

        dist.all_reduce(partial, group=group)
        return partial
