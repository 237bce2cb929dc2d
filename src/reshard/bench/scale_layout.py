"""Synthetic per-rank save plans of Llama-style training states (for the scale simulator).

No tensors are allocated: each simulated rank gets the :class:`~reshard.planning.planner.LocalTensorItem`
records its real state would produce (fqn, dtype, global shape, chunk box, flat range, replica id,
bytes; no digest: a save computes the replicas' digests while it writes and sends them in its write
report, not in its plan), under the keys :class:`reshard.ModelState` / :class:`reshard.OptimizerState`
give (``model.<fqn>``, ``optim.state.<fqn>.<key>``).

Layout (Megatron order: rank = ((pp * dp + d) * ep_tp ...) with tp fastest, then dp, then pp):

* bf16 weights: attention ``q``/``k``/``v`` and MLP ``gate``/``up`` split on dim 0 over TP,
  ``o``/``down`` on dim 1, norms replicated over TP; layers split over PP (embedding on the first
  stage, final norm and ``lm_head`` on the last); every weight replicated over DP.
* Adam (``--optimizer adam``): fp32 ``master``, ``exp_avg``, ``exp_avg_sq`` of every parameter.
  ``zero_split="flat"`` (Megatron's distributed optimizer, ZeRO-1): each (TP, PP) rank's fp32 state
  is one flat buffer of its parameters in order, split into DP contiguous ranges, so a DP rank holds
  flat ranges of the few parameters its range crosses; ``"per-param"``: every parameter's chunk is
  split into DP ranges (each DP rank holds a range of every parameter: pessimistic).
* MoE models (``moe-*``): experts split over EP (inside the DP dimension: ``dp % ep == 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from ..planning.planner import LocalPlan, LocalTensorItem

MODELS: dict[str, dict[str, int]] = {
    "llama-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv=8, vocab=128256, experts=0),
    "llama-70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv=8, vocab=128256, experts=0),
    "llama-405b": dict(layers=126, hidden=16384, ffn=53248, heads=128, kv=8, vocab=128256, experts=0),
    "moe-8x7b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv=8, vocab=32000, experts=8),
    "moe-8x22b": dict(layers=56, hidden=6144, ffn=16384, heads=48, kv=8, vocab=32768, experts=8),
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel layout: ``world = tp * pp * dp``; ``ep`` divides ``dp`` (MoE only)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp, dp, pp)`` coordinates of ``rank``."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def __str__(self) -> str:
        s = f"tp{self.tp},pp{self.pp},dp{self.dp}"
        return s + (f",ep{self.ep}" if self.ep > 1 else "")


def parse_layout(text: str) -> Layout:
    """``"tp4,pp8,dp512"`` (any order; ``ep`` optional) -> Layout; ValueError otherwise."""
    vals = {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    for part in text.replace(" ", "").split(","):
        key, num = part[:2], part[2:]
        if key not in vals or not num.isdigit() or int(num) < 1:
            raise ValueError(f"layout {text!r}: expected parts like tp4,pp8,dp512 (got {part!r})")
        vals[key] = int(num)
    return Layout(**vals)


@dataclass(frozen=True, kw_only=True)
class Param:
    fqn: str
    shape: tuple[int, ...]
    split_dim: int | None  # TP split dim; None: replicated over TP
    expert: int | None = None  # MoE expert index (EP-sharded), None: dense


def stage_params(model: str, layout: Layout, stage: int) -> list[Param]:
    """The parameters (logical, unsharded) that pipeline stage ``stage`` holds, in order."""
    cfg = MODELS[model]
    h, f, hd = cfg["hidden"], cfg["ffn"], cfg["hidden"] // cfg["heads"]
    kvd = cfg["kv"] * hd
    nl = cfg["layers"]
    per = -(-nl // layout.pp)
    out: list[Param] = []
    if stage == 0:
        out.append(Param(fqn="embed.weight", shape=(cfg["vocab"], h), split_dim=0))
    for layer in range(stage * per, min(nl, (stage + 1) * per)):
        p = f"layers.{layer}."
        out += [
            Param(fqn=p + "input_norm.weight", shape=(h,), split_dim=None),
            Param(fqn=p + "attn.q.weight", shape=(h, h), split_dim=0),
            Param(fqn=p + "attn.k.weight", shape=(kvd, h), split_dim=0),
            Param(fqn=p + "attn.v.weight", shape=(kvd, h), split_dim=0),
            Param(fqn=p + "attn.o.weight", shape=(h, h), split_dim=1),
            Param(fqn=p + "post_norm.weight", shape=(h,), split_dim=None),
        ]
        if cfg["experts"]:
            out.append(Param(fqn=p + "mlp.router.weight", shape=(cfg["experts"], h), split_dim=None))
            for e in range(cfg["experts"]):
                q = f"{p}mlp.experts.{e}."
                out += [Param(fqn=q + "gate.weight", shape=(f, h), split_dim=0, expert=e),
                        Param(fqn=q + "up.weight", shape=(f, h), split_dim=0, expert=e),
                        Param(fqn=q + "down.weight", shape=(h, f), split_dim=1, expert=e)]
        else:
            out += [Param(fqn=p + "mlp.gate.weight", shape=(f, h), split_dim=0),
                    Param(fqn=p + "mlp.up.weight", shape=(f, h), split_dim=0),
                    Param(fqn=p + "mlp.down.weight", shape=(h, f), split_dim=1)]
    if stage == layout.pp - 1:
        out += [Param(fqn="final_norm.weight", shape=(h,), split_dim=None),
                Param(fqn="lm_head.weight", shape=(cfg["vocab"], h), split_dim=0)]
    return out


def _box(p: Param, tp: int, tpi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if p.split_dim is None:
        return (0,) * len(p.shape), p.shape
    d = p.split_dim
    n = p.shape[d]
    lo, hi = n * tpi // tp, n * (tpi + 1) // tp
    off = tuple(lo if i == d else 0 for i in range(len(p.shape)))
    shape = tuple(hi - lo if i == d else s for i, s in enumerate(p.shape))
    return off, shape


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def item_digest(it: LocalTensorItem) -> str:
    """The replica digest a rank reports for ``it`` after writing or hashing
    it (the same on every holder of the chunk)."""
    return xxhash.xxh3_64_hexdigest(repr((it.fqn, it.global_offset, it.flattened_range)).encode())


def rank_items(model: str, layout: Layout, rank: int, *, optimizer: str = "adam",
               zero_split: str = "flat") -> list[LocalTensorItem]:
    """The tensor items rank ``rank`` of ``layout`` would describe in its local plan."""
    tpi, dpi, ppi = layout.coords(rank)
    params = stage_params(model, layout, ppi)
    ep, epi = layout.ep, dpi % layout.ep
    mine: list[tuple[Param, tuple[int, ...], tuple[int, ...]]] = []
    for p in params:
        if p.expert is not None and p.expert % ep != epi:
            continue  # another EP rank holds this expert
        off, shape = _box(p, layout.tp, tpi)
        mine.append((p, off, shape))
    # weights: replicated over DP (over EP-replicas for experts), norms also over TP
    items: list[LocalTensorItem] = []
    for p, off, shape in mine:
        rep = dpi if p.split_dim is not None else dpi * layout.tp + tpi
        fqn = "model." + p.fqn
        items.append(LocalTensorItem(fqn=fqn, dtype="bfloat16", global_shape=p.shape, global_offset=off,
                                     local_shape=shape, flattened_range=None, replica_id=rep,
                                     nbytes=2 * _numel(shape)))
    if optimizer != "adam":
        return items
    # fp32 state, ZeRO-1 over the DP ranks that share this (TP, PP) (for experts: dp / ep)
    dpn = layout.dp // ep if any(p.expert is not None for p, _, _ in mine) else layout.dp
    dpk = dpi // ep if dpn != layout.dp else dpi
    ranges: list[tuple[Param, tuple[int, ...], tuple[int, ...], int, int]] = []
    if zero_split == "per-param":
        for p, off, shape in mine:
            n = _numel(shape)
            a, b = n * dpk // dpn, n * (dpk + 1) // dpn
            if a < b:
                ranges.append((p, off, shape, a, b))
    else:
        total = sum(_numel(s) for _, _, s in mine)
        lo, hi = total * dpk // dpn, total * (dpk + 1) // dpn
        pos = 0
        for p, off, shape in mine:
            n = _numel(shape)
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                ranges.append((p, off, shape, a - pos, b - pos))
            pos += n
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for p, off, shape, a, b in ranges:
            fqn = f"optim.state.model.{p.fqn}.{key}"
            rep = 0 if p.split_dim is not None else tpi  # TP-replicated norms: same flat buffer
            items.append(LocalTensorItem(fqn=fqn, dtype="float32", global_shape=p.shape,
                                         global_offset=off, local_shape=shape, flattened_range=(a, b),
                                         replica_id=rep, nbytes=4 * (b - a)))
    return items


def rank_plan(model: str, layout: Layout, rank: int, **kw: str) -> LocalPlan:
    return LocalPlan(rank=rank, tensors=tuple(rank_items(model, layout, rank, **kw)))


def scaled_layouts(layout: Layout, smallest: int = 8) -> list[Layout]:
    """``layout`` scaled down along DP, then PP (halving), down to ``smallest`` ranks; ascending."""
    out = [layout]
    cur = layout
    while cur.world > smallest:
        if cur.dp > cur.ep and cur.dp // 2 >= cur.ep and cur.dp % 2 == 0:
            cur = Layout(tp=cur.tp, pp=cur.pp, dp=cur.dp // 2, ep=cur.ep)
        elif cur.pp > 1 and cur.pp % 2 == 0:
            cur = Layout(tp=cur.tp, pp=cur.pp // 2, dp=cur.dp, ep=cur.ep)
        else:
            break
        out.append(cur)
    return out[::-1]
