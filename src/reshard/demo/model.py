"""Reference transformer of the parity harness: one pipeline stage of one
tensor-parallel rank, with parameters that reshard describes as views onto
canonical (layout-independent) logical tensors.

Presets (:func:`model_config`):

* ``bert``: exactly the MiniLM / BERT encoder of sentence-transformers/all-MiniLM-L6-v2
  (word/position/token-type embeddings + LayerNorm, post-LN encoder layers
  with q/k/v/o attention and a GELU FFN, the pooler) plus a masked-LM head
  (``cls.predictions.transform`` dense + GELU + LayerNorm, initialised from
  ``ModelConfig.head_seed``; decoder tied to the word embeddings; decoder
  bias ``cls.predictions.bias``). The pooler is kept (imported, frozen,
  unused by the loss). Canonical names are the Hugging Face file's names.
* ``llama``: RMSNorm, SwiGLU gated MLP, grouped-query attention (8 query /
  4 key-value heads by default), rotary positions, untied ``lm_head``;
  trained from scratch on a causal-LM loss. Canonical names follow Hugging
  Face ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight`` ...).

Tensor parallelism (Megatron-LM style, on a ``torch.distributed`` group):
the fused attention projection is column parallel (``qkv`` packed per rank
``[q_r; k_r; v_r]`` for ``bert`` via :func:`~reshard.adapters.layouts.fused_views`,
interleaved per query group for ``llama`` via
:func:`~reshard.adapters.layouts.interleaved_qkv_views`), the attention output
and FFN output projections are row parallel, the FFN input (``[gate_r; up_r]``
fused for ``llama``) is column parallel, and the word embeddings, MLM decoder
bias and ``lm_head`` are vocab parallel, padded to a multiple of TP (padding
rows are never data). The loss is a vocab-parallel cross entropy.

Pipeline parallelism: a :class:`Stage` holds a contiguous range of layers
under their *global* indices (``encoder.layer.3...``); the first stage holds
the embeddings, the last the head. When the word embeddings and the MLM
decoder live on different stages, the last stage holds a copy of the tied
weight, declared with the embedding's fqn and ``replica_id=1``.

Dropout draws from :func:`reshard.adapters.rng.counter_uniform` keyed by
``(seed, step, site, global sample index, position, global head / hidden
index)``, so masks are identical in every layout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.layouts import fused_views, interleaved_qkv_views, vocab_parallel_view
from ..adapters.rng import derive_seed
from ..state.sharding import ShardedTensor
from .model_tp import TP, _VocabParallelCE, counter_dropout

TIED = "embeddings.word_embeddings.weight"  # the bert decoder's canonical fqn
DECODER = "cls.predictions.decoder.weight"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture. Sizes in elements; ``head_dim = hidden // heads``."""

    preset: str  # "bert" | "llama"
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_positions: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    dropout: float = 0.1  # hidden dropout (embeddings, attention output, FFN output)
    attn_dropout: float = 0.1  # on attention probabilities
    rope_theta: float = 10000.0
    init_std: float = 0.02
    head_seed: int = 1234  # bert MLM head (transform, decoder bias): not in the MiniLM file
    pad_id: int = 0
    cls_id: int = 1
    sep_id: int = 2
    mask_id: int = 3
    special_ids: tuple[int, ...] = (0, 1, 2, 3)

    def __post_init__(self) -> None:
        if self.preset not in ("bert", "llama"):
            raise ValueError(f"preset must be 'bert' or 'llama', got {self.preset!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must divide by heads, heads by kv_heads")
        if self.preset == "bert" and self.kv_heads != self.heads:
            raise ValueError("bert has as many key/value heads as query heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check_tp(self, tp: int) -> None:
        if self.kv_heads % tp or self.ffn % tp:
            raise ValueError(f"kv_heads {self.kv_heads} and ffn {self.ffn} must divide by tp {tp}")


def model_config(preset: str, size: str = "tiny", **overrides: Any) -> ModelConfig:
    """``bert``/``llama`` in size ``tiny`` (tests), ``small`` (llama demo) or
    ``full`` (``bert``: exactly all-MiniLM-L6-v2). Overrides replace fields."""
    if preset == "bert" and size == "full":
        base: dict[str, Any] = dict(vocab_size=30522, hidden=384, layers=6, heads=12, kv_heads=12,
                                    ffn=1536, max_positions=512, norm_eps=1e-12, cls_id=101,
                                    sep_id=102, mask_id=103, special_ids=(0, 100, 101, 102, 103))
    elif preset == "bert" and size == "tiny":
        base = dict(vocab_size=97, hidden=32, layers=2, heads=4, kv_heads=4, ffn=64,
                    max_positions=32, norm_eps=1e-12)
    elif preset == "llama" and size == "tiny":
        base = dict(vocab_size=97, hidden=32, layers=4, heads=8, kv_heads=4, ffn=64,
                    max_positions=32, norm_eps=1e-6)
    elif preset == "llama" and size in ("small", "full"):
        base = dict(vocab_size=1000, hidden=128, layers=4, heads=8, kv_heads=4, ffn=256,
                    max_positions=128, norm_eps=1e-6)
    else:
        raise ValueError(f"no {size!r} config for preset {preset!r}")
    base.update(overrides)
    return ModelConfig(preset=preset, **base)


# ----------------------------------------------------------------------------- micro-batch


@dataclass
class MicroBatch:
    """What every stage needs of one micro-batch (all int64 ``[b, T]``)."""

    samples: list[int]  # global (dataset) sample indices
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # -100 where no loss
    step: int  # the counter key of this training step
    dataset_len: int


# ----------------------------------------------------------------------------- layers


def _site(layer: int, k: int) -> int:
    """Dropout stream of site ``k`` of layer ``layer`` (embeddings: layer -1)."""
    return 1000 + 8 * (layer + 1) + k


class _Ctx:
    """Per-forward context shared by the layers of a stage."""

    def __init__(self, cfg: ModelConfig, tp: TP, mb: MicroBatch, seed: int, training: bool):
        self.cfg, self.tp, self.mb, self.seed, self.training = cfg, tp, mb, seed, training

    def drop(self, x: torch.Tensor, p: float, site: int, tail_shape: tuple[int, ...],
             tail_offset: tuple[int, ...]) -> torch.Tensor:
        if not self.training:
            return x
        return counter_dropout(x, p, seed=self.seed, step=self.mb.step, site=site,
                               samples=self.mb.samples, dataset_len=self.mb.dataset_len,
                               tail_shape=tail_shape, tail_offset=tail_offset)

    def drop_hidden(self, x: torch.Tensor, site: int) -> torch.Tensor:
        return self.drop(x, self.cfg.dropout, site, tuple(x.shape[1:]), (0,) * (x.dim() - 1))

    def drop_probs(self, probs: torch.Tensor, site: int) -> torch.Tensor:
        b, h, t, _ = probs.shape
        return self.drop(probs, self.cfg.attn_dropout, site, (self.cfg.heads, t, t),
                         (self.tp.rank * h, 0, 0))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, ctx: _Ctx,
            site: int) -> torch.Tensor:
    """``[b, h, T, d]`` inputs; additive ``bias`` broadcast to the scores."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    probs = ctx.drop_probs(torch.softmax(scores, dim=-1), site)
    out = probs @ v
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


class _Box(nn.Module):
    """A container of named submodules (Hugging Face's nesting of names)."""

    def __getattr__(self, name: str) -> Any:
        return super().__getattr__(name)


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    """A Linear filled with zeros, without drawing from the global generator
    (:meth:`Stage.init_weights` sets the values)."""
    lin = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias)
    with torch.no_grad():
        for p in lin.parameters():
            p.zero_()
    return lin


class BertLayer(_Box):
    """Post-LN encoder layer, Hugging Face ``BertLayer`` names, TP-sharded."""

    def __init__(self, cfg: ModelConfig, tp: TP, index: int):
        super().__init__()
        self.index = index
        h, f = cfg.hidden, cfg.ffn
        a = cfg.hidden // tp.size
        self.attention = _Box()
        self.attention.self = _Box()
        self.attention.self.qkv = _linear(h, 3 * a, True)
        self.attention.output = _Box()
        self.attention.output.dense = _linear(a, h, True)
        self.attention.output.LayerNorm = nn.LayerNorm(h, cfg.norm_eps)
        self.intermediate = _Box()
        self.intermediate.dense = _linear(h, f // tp.size, True)
        self.output = _Box()
        self.output.dense = _linear(f // tp.size, h, True)
        self.output.LayerNorm = nn.LayerNorm(h, cfg.norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        c, tp = ctx.cfg, ctx.tp
        b, t, _ = x.shape
        hl, d = c.heads // tp.size, c.head_dim
        qkv = self.attention.self.qkv(tp.copy(x))
        q, k, v = (z.reshape(b, t, hl, d).transpose(1, 2) for z in qkv.split(hl * d, dim=-1))
        at = _attend(q, k, v, bias, ctx, _site(self.index, 0))
        out = self.attention.output
        y = tp.reduce(F.linear(at, out.dense.weight)) + out.dense.bias
        x = out.LayerNorm(ctx.drop_hidden(y, _site(self.index, 1)) + x)
        inter = F.gelu(self.intermediate.dense(tp.copy(x)))
        y = tp.reduce(F.linear(inter, self.output.dense.weight)) + self.output.dense.bias
        return self.output.LayerNorm(ctx.drop_hidden(y, _site(self.index, 2)) + x)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``[b, T, h, d]`` (Hugging Face ``rotate_half`` convention)."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


class LlamaLayer(_Box):
    """Pre-norm decoder layer with GQA and a SwiGLU MLP, TP-sharded."""

    def __init__(self, cfg: ModelConfig, tp: TP, index: int):
        super().__init__()
        self.index = index
        h, d = cfg.hidden, cfg.head_dim
        groups = cfg.kv_heads // tp.size
        hpg = cfg.heads // cfg.kv_heads
        self.input_layernorm = RMSNorm(h, cfg.norm_eps)
        self.self_attn = _Box()
        self.self_attn.qkv_proj = _linear(h, groups * (hpg + 2) * d, False)
        self.self_attn.o_proj = _linear(groups * hpg * d, h, False)
        self.post_attention_layernorm = RMSNorm(h, cfg.norm_eps)
        self.mlp = _Box()
        self.mlp.gate_up_proj = _linear(h, 2 * cfg.ffn // tp.size, False)
        self.mlp.down_proj = _linear(cfg.ffn // tp.size, h, False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        c, tp = ctx.cfg, ctx.tp
        b, t, _ = x.shape
        d, hpg, g = c.head_dim, c.heads // c.kv_heads, c.kv_heads // tp.size
        qkv = self.self_attn.qkv_proj(tp.copy(self.input_layernorm(x))).reshape(b, t, g, hpg + 2, d)
        q = _rope(qkv[:, :, :, :hpg].reshape(b, t, g * hpg, d), c.rope_theta)
        k = _rope(qkv[:, :, :, hpg], c.rope_theta)
        v = qkv[:, :, :, hpg + 1]
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        k, v = k.repeat_interleave(hpg, dim=1), v.repeat_interleave(hpg, dim=1)
        at = _attend(q, k, v, bias, ctx, _site(self.index, 0))
        y = tp.reduce(F.linear(at, self.self_attn.o_proj.weight))
        x = x + ctx.drop_hidden(y, _site(self.index, 1))
        gate, up = self.mlp.gate_up_proj(tp.copy(self.post_attention_layernorm(x))).chunk(2, dim=-1)
        y = tp.reduce(F.linear(F.silu(gate) * up, self.mlp.down_proj.weight))
        return x + ctx.drop_hidden(y, _site(self.index, 2))


# ----------------------------------------------------------------------------- stage


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """Contiguous global layer indices of ``stage`` (the first stages take one more)."""
    q, r = divmod(layers, pp)
    start = stage * q + min(stage, r)
    return range(start, start + q + (1 if stage < r else 0))


_COL = re.compile(r"^(encoder\.layer\.\d+\.intermediate\.dense)\.(weight|bias)$")
_ROW = re.compile(r"^(encoder\.layer\.\d+\.(attention\.output|output)\.dense"
                  r"|model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj))\.weight$")
_BERT_QKV = re.compile(r"^(encoder\.layer\.\d+\.attention\.self)\.qkv\.(weight|bias)$")
_LLAMA_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.qkv_proj\.weight$")
_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_up_proj\.weight$")
_VOCAB = {"embeddings.word_embeddings.weight", "cls.predictions.bias", "model.embed_tokens.weight",
          "lm_head.weight"}


class Stage(_Box):
    """Pipeline stage ``stage`` of ``pp`` on tensor-parallel rank ``tp``.

    Args:
        cfg: the architecture.
        tp: this rank's tensor-parallel place (and group).
        stage, pp: the pipeline stage and the number of stages.
        seed: initialisation seed (every logical tensor is drawn whole from a
            generator seeded by ``(seed, fqn)``, then this rank copies its
            shard: the same model in every layout); the bert head uses
            ``cfg.head_seed``.
    """

    def __init__(self, cfg: ModelConfig, *, tp: TP = TP(), stage: int = 0, pp: int = 1, seed: int = 0):  # noqa: B008 (TP: frozen)
        super().__init__()
        cfg.check_tp(tp.size)
        self.cfg, self.tp, self.stage, self.pp = cfg, tp, stage, pp
        self.first, self.last = stage == 0, stage == pp - 1
        self.layer_ids = stage_layers(cfg.layers, pp, stage)
        rows, _, _ = tp.vocab_range(cfg.vocab_size)
        h = cfg.hidden
        self.tied_locally = False
        if cfg.preset == "bert":
            if self.first:
                self.embeddings = _Box()
                self.embeddings.word_embeddings = nn.Embedding(rows, h, _weight=torch.zeros(rows, h))
                self.embeddings.position_embeddings = nn.Embedding(
                    cfg.max_positions, h, _weight=torch.zeros(cfg.max_positions, h))
                self.embeddings.token_type_embeddings = nn.Embedding(
                    cfg.type_vocab_size, h, _weight=torch.zeros(cfg.type_vocab_size, h))
                self.embeddings.LayerNorm = nn.LayerNorm(h, cfg.norm_eps)
                self.embeddings.register_buffer(
                    "position_ids", torch.arange(cfg.max_positions, dtype=torch.int64)[None, :])
            self.encoder = _Box()
            self.encoder.layer = nn.ModuleDict({str(i): BertLayer(cfg, tp, i) for i in self.layer_ids})
            if self.last:
                self.pooler = _Box()
                self.pooler.dense = _linear(h, h, True)
                self.pooler.requires_grad_(False)  # kept and imported, unused by the MLM loss
                self.cls = _Box()
                pr = self.cls.predictions = _Box()
                pr.transform = _Box()
                pr.transform.dense = _linear(h, h, True)
                pr.transform.LayerNorm = nn.LayerNorm(h, cfg.norm_eps)
                pr.bias = nn.Parameter(torch.zeros(rows))
                pr.decoder = _Box()
                if self.first:
                    pr.decoder.weight = self.embeddings.word_embeddings.weight  # the tie itself
                    self.tied_locally = True
                else:
                    pr.decoder.weight = nn.Parameter(torch.zeros(rows, h))  # replica of the tie
        else:
            self.model = _Box()
            if self.first:
                self.model.embed_tokens = nn.Embedding(rows, h, _weight=torch.zeros(rows, h))
            self.model.layers = nn.ModuleDict({str(i): LlamaLayer(cfg, tp, i) for i in self.layer_ids})
            if self.last:
                self.model.norm = RMSNorm(h, cfg.norm_eps)
                self.lm_head = _linear(h, rows, False)
        self.init_weights(seed)

    # -- description
    def layers(self) -> list[nn.Module]:
        holder = self.encoder.layer if self.cfg.preset == "bert" else self.model.layers
        return [holder[str(i)] for i in self.layer_ids]

    def tie_replica(self) -> nn.Parameter | None:
        """The last stage's copy of the tied bert embedding (None unless split by PP)."""
        if self.cfg.preset == "bert" and self.last and not self.tied_locally:
            return self.cls.predictions.decoder.weight
        return None

    def layout(self, fqn: str, t: torch.Tensor) -> ShardedTensor | list[ShardedTensor] | None:
        """``ModelState`` layout: ``t`` (this rank's tensor ``fqn``, or any
        tensor shaped like it: a gradient) as views of canonical tensors."""
        c, r, n = self.cfg, self.tp.rank, self.tp.size
        if fqn == DECODER:
            if self.tied_locally:
                return []  # the same tensor as the word embeddings: saved once under TIED
            return vocab_parallel_view(t, TIED, vocab_size=c.vocab_size, tp_rank=r, tp_size=n,
                                       replica_id=1)
        if fqn in _VOCAB:
            return vocab_parallel_view(t, fqn, vocab_size=c.vocab_size, tp_rank=r, tp_size=n)
        mt = _BERT_QKV.match(fqn)
        if mt:
            qkv = [f"{mt[1]}.{p}.{mt[2]}" for p in ("query", "key", "value")]
            return fused_views(t, qkv, [c.hidden] * 3, tp_rank=r, tp_size=n)
        mt = _LLAMA_QKV.match(fqn)
        if mt:
            q, k, v = (f"{mt[1]}.{p}_proj.weight" for p in ("q", "k", "v"))
            return interleaved_qkv_views(t, (q, k, v), num_heads=c.heads,
                                         num_query_groups=c.kv_heads, head_dim=c.head_dim,
                                         tp_rank=r, tp_size=n)
        mt = _GATE_UP.match(fqn)
        if mt:
            names = [f"{mt[1]}.{p}_proj.weight" for p in ("gate", "up")]
            return fused_views(t, names, [c.ffn] * 2, tp_rank=r, tp_size=n)
        if _COL.match(fqn):
            rows = t.shape[0]
            return ShardedTensor(fqn, t, global_shape=(rows * n, *t.shape[1:]),
                                 global_offset=(r * rows,) + (0,) * (t.dim() - 1))
        if _ROW.match(fqn):
            cols = t.shape[1]
            return ShardedTensor(fqn, t, global_shape=(t.shape[0], cols * n), global_offset=(0, r * cols))
        return None

    def views(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor]:
        """:meth:`layout` with the default (the whole tensor, replicated) filled in."""
        out = self.layout(fqn, t)
        if out is None:
            return [ShardedTensor(fqn, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim())]
        return [out] if isinstance(out, ShardedTensor) else list(out)

    # -- initialisation
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from its logical tensor (see the class doc)."""
        for fqn, t in self.state_dict().items():
            if not t.is_floating_point():
                continue
            for v in self.views(fqn, t):
                full = logical_init(v.fqn, v.global_shape, self.cfg, seed)
                box = tuple(slice(o, o + s) for o, s in zip(v.global_offset, v.local_shape, strict=True))
                v.data.copy_(full[box])

    # -- forward
    def forward(self, x: torch.Tensor | None, mb: MicroBatch, *, seed: int,
                training: bool = True) -> torch.Tensor:
        """Hidden states ``[b, T, hidden]`` after this stage's layers; ``x`` is
        the previous stage's output (None on the first stage)."""
        ctx = _Ctx(self.cfg, self.tp, mb, seed, training)
        if self.first:
            x = self._embed(mb, ctx)
        assert x is not None
        bias = self._attention_bias(mb)
        for layer in self.layers():
            x = layer(x, bias, ctx)
        return x

    def _attention_bias(self, mb: MicroBatch) -> torch.Tensor:
        t = mb.input_ids.shape[1]
        if self.cfg.preset == "bert":  # Hugging Face's extended mask: 0 or finfo.min
            return (1.0 - mb.attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        return torch.zeros(t, t).masked_fill(causal, float("-inf"))

    def _lookup(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        _, start, valid = self.tp.vocab_range(self.cfg.vocab_size)
        if self.tp.size == 1:
            return F.embedding(ids, weight)
        inr = (ids >= start) & (ids < start + valid)
        e = F.embedding(torch.where(inr, ids - start, torch.zeros_like(ids)), weight)
        return self.tp.reduce(e.masked_fill(~inr[..., None], 0.0))

    def _embed(self, mb: MicroBatch, ctx: _Ctx) -> torch.Tensor:
        if self.cfg.preset == "llama":
            return self._lookup(self.model.embed_tokens.weight, mb.input_ids)
        e = self.embeddings
        t = mb.input_ids.shape[1]
        x = self._lookup(e.word_embeddings.weight, mb.input_ids)
        x = x + e.token_type_embeddings(torch.zeros_like(mb.input_ids))
        x = x + e.position_embeddings(e.position_ids[:, :t])
        return ctx.drop_hidden(e.LayerNorm(x), _site(-1, 0))

    def loss(self, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Sum over this micro-batch's labelled tokens of the cross entropy
        (last stage only); divide by the global token count for the mean."""
        sel = mb.labels != -100
        target = mb.labels[sel]
        _, start, valid = self.tp.vocab_range(self.cfg.vocab_size)
        if self.cfg.preset == "bert":
            pr = self.cls.predictions
            h = x[sel]
            h = pr.transform.LayerNorm(F.gelu(pr.transform.dense(h)))
            logits = F.linear(self.tp.copy(h), pr.decoder.weight) + pr.bias
        else:
            h = self.model.norm(x)[sel]
            logits = F.linear(self.tp.copy(h), self.lm_head.weight)
        return _VocabParallelCE.apply(logits, target, start, valid, self.tp).sum()


def logical_init(fqn: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The initial value of the logical tensor ``fqn`` (independent of layout):
    norms one, biases zero, other weights ``N(0, init_std)`` from a generator
    seeded by ``(seed, fqn)``; the bert MLM head (``cls.*``) uses ``cfg.head_seed``."""
    if fqn.endswith(("LayerNorm.weight", "layernorm.weight", "norm.weight")):
        return torch.ones(shape)
    if fqn.endswith(".bias") or fqn == "cls.predictions.bias":
        return torch.zeros(shape)
    s = cfg.head_seed if fqn.startswith("cls.") else seed
    g = torch.Generator().manual_seed(derive_seed(s, 0, {}, fqn))
    return torch.randn(shape, generator=g) * cfg.init_std
