"""Reference trainer (the parity harness is :mod:`reshard.demo.parity`).

:class:`Trainer` trains one rank of the :mod:`reshard.demo.model`
transformer in a ``(pp, dp, tp)`` :class:`Layout` over the default
``torch.distributed`` group (gloo on CPU): rank ``r`` has coordinates
``tp = r % tp``, ``dp = (r // tp) % dp``, ``pp = r // (tp * dp)``; the
tp / dp / embedding-tie sub-groups come from ``torch.distributed.new_group``.

* Pipeline: GPipe schedule (every micro-batch forward through the stages
  with send/recv, then every backward in the same order); the pipeline is
  flushed at each step boundary.
* Data parallel with ZeRO-1: each rank's trainable parameters form one flat
  buffer (in ``named_parameters`` order, padded to a multiple of ``dp``);
  gradients are all-reduced over the DP group, each DP rank runs AdamW (fp32)
  on its contiguous range of the buffer, the updated ranges are all-gathered.
  The moments are declared to reshard per logical tensor with
  ``flattened_range`` (boxes of TP shards, fused views split), so they load
  into any other layout.
* The bert tie across stages: the last stage's decoder copy is left out of
  its optimizer; its gradient is all-reduced with the first stage's
  embedding gradient (before the DP all-reduce) and the first stage's updated
  weight is broadcast back.
* Loss: the mean over the labelled tokens of the global batch (each
  micro-batch contributes ``sum / global token count``), so gradients sum
  over DP and micro-batches.
* Data: ``TrainConfig.data`` ``"random"`` (a seeded private generator: bert
  sequences ``[CLS] ... [SEP]`` with padding, llama full-length) or
  ``"stdlib"`` (standard-library docstrings tokenised for MiniLM); the order
  comes from :class:`reshard.DataCursor`; bert masking is
  :func:`reshard.demo.data.mlm_batch` (layout-independent), llama is a
  causal LM.

The training state is ``{"model": ModelState, "optim": OptimizerState, "rng":
RNGState, "data": DataCursor, "step": int}``.

:func:`reshard.demo.parity.parity` runs the next-step parity check (DESIGN.md section 5) on a
:class:`~reshard.testing.pool.WorkerPool`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard

from ..adapters.rng import derive_seed
from ..state.sharding import ShardedTensor
from .model import MicroBatch, ModelConfig, Stage
from .model_tp import TP

# ----------------------------------------------------------------------------- layout and groups


@dataclass(frozen=True)
class Layout:
    """A ``(pp, dp, tp)`` grid; ``tp`` varies fastest over ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"degrees must be positive: {self}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` coordinates of global ``rank``."""
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, p: int, d: int, t: int) -> int:
        return (p * self.dp + d) * self.tp + t

    @classmethod
    def parse(cls, spec: str | Layout) -> Layout:
        """``"dp2,tp2"``, ``"tp4"``, ``"pp2 dp2"`` (missing degrees are 1)."""
        if isinstance(spec, Layout):
            return spec
        kw: dict[str, int] = {}
        for part in re.split(r"[,\s×x*]+", spec.strip()):
            mt = re.fullmatch(r"(tp|pp|dp)(\d+)", part)
            if not mt or mt[1] in kw:
                raise ValueError(f"bad layout {spec!r} (e.g. 'dp2,tp2')")
            kw[mt[1]] = int(mt[2])
        return cls(**kw)

    def __str__(self) -> str:
        return f"pp{self.pp},dp{self.dp},tp{self.tp}"


@dataclass(frozen=True)
class Groups:
    """This rank's coordinates, sub-groups and pipeline neighbours."""

    layout: Layout
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    tp: Any = None
    dp: Any = None
    emb: Any = None  # first + last stage of this (dp, tp), when pp > 1
    prev: int | None = None
    next: int | None = None
    emb_src: int = 0  # global rank of the first stage in ``emb``


_GROUPS: dict[Layout, Groups] = {}


def grid_groups(layout: Layout) -> Groups:
    """The sub-groups of ``layout`` over the default group (created once per
    process and layout: every rank must call this for the same layouts in the
    same order)."""
    if not (dist.is_available() and dist.is_initialized()):
        if layout.world_size != 1:
            raise RuntimeError(f"layout {layout} needs {layout.world_size} ranks; no process group")
        return Groups(layout, 0, 0, 0, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the group has {world}")
    if layout in _GROUPS:
        return _GROUPS[layout]
    L = layout
    p0, d0, t0 = L.coords(rank)
    mine: dict[str, Any] = {}

    def make(kind: str, ranks: list[int]) -> None:
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine[kind] = g

    for p in range(L.pp):
        for d in range(L.dp):
            make("tp", [L.rank_of(p, d, t) for t in range(L.tp)])
    for p in range(L.pp):
        for t in range(L.tp):
            make("dp", [L.rank_of(p, d, t) for d in range(L.dp)])
    if L.pp > 1:
        for d in range(L.dp):
            for t in range(L.tp):
                make("emb", [L.rank_of(0, d, t), L.rank_of(L.pp - 1, d, t)])
    g = Groups(L, rank, p0, d0, t0, tp=mine.get("tp"), dp=mine.get("dp"), emb=mine.get("emb"),
               prev=L.rank_of(p0 - 1, d0, t0) if p0 > 0 else None,
               next=L.rank_of(p0 + 1, d0, t0) if p0 < L.pp - 1 else None,
               emb_src=L.rank_of(0, d0, t0))
    _GROUPS[layout] = g
    return g


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Training hyperparameters (AdamW, fp32) and data.

    ``micro_batch`` is the samples per micro-batch a DP rank aims for (its
    share of ``global_batch`` is split into the largest number of equal
    micro-batches not above ``share // micro_batch``, at least one).
    """

    seq_len: int = 16
    global_batch: int = 8
    micro_batch: int = 2
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    seed: int = 0  # initialisation and dropout
    data_seed: int = 0  # data order and masking
    mask_prob: float = 0.15
    data: str = "random"  # "random" | "stdlib"
    num_samples: int = 64  # size of the random corpus
    max_files: int | None = None  # stdlib files read (None: all)


class RandomCorpus:
    """Random token ids from a seeded private generator, with the attributes
    of :class:`reshard.demo.data.TokenizedCorpus` (``ids``,
    ``attention_mask``, ``seq_len``, ``len()``). bert rows are ``[CLS] ...
    [SEP]`` then padding (lengths from half to all of ``seq_len``)."""

    def __init__(self, n: int, seq_len: int, cfg: ModelConfig, seed: int):
        g = torch.Generator().manual_seed(derive_seed(seed, 0, {}, "random-corpus"))
        low = max(cfg.special_ids) + 1
        self.ids = torch.randint(low, cfg.vocab_size, (n, seq_len), generator=g)
        self.attention_mask = torch.ones(n, seq_len, dtype=torch.int64)
        self.seq_len = seq_len
        if cfg.preset == "bert":
            lengths = torch.randint(max(3, seq_len // 2), seq_len + 1, (n,), generator=g)
            for i, n_tok in enumerate(lengths.tolist()):
                self.ids[i, 0], self.ids[i, n_tok - 1] = cfg.cls_id, cfg.sep_id
                self.ids[i, n_tok:] = cfg.pad_id
                self.attention_mask[i, n_tok:] = 0

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@functools.lru_cache(maxsize=4)
def make_corpus(mc: ModelConfig, tc: TrainConfig) -> Any:
    """The training corpus (cached per process)."""
    if tc.data == "random":
        return RandomCorpus(tc.num_samples, tc.seq_len, mc, tc.data_seed)
    if tc.data == "stdlib":
        from .data import TokenizedCorpus, minilm_dir, stdlib_texts

        return TokenizedCorpus(stdlib_texts("train", max_files=tc.max_files),
                               minilm_dir() / "tokenizer.json", tc.seq_len)
    raise ValueError(f"unknown data {tc.data!r}")


# ----------------------------------------------------------------------------- ZeRO-1

Piece = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], "tuple[int, int] | None",
              torch.Tensor]
"""``(kind, fqn, global_shape, global_offset, local_shape, flattened_range, data)``."""


@dataclass(frozen=True)
class _Segment:
    """Where one canonical view of a parameter sits in the flat buffer."""

    view: ShardedTensor  # its metadata (data: a view of the parameter)
    start: int  # flat element of view element 0 (row-major, half-open)
    stop: int


class Zero1:
    """ZeRO-1 over the DP group (see the module doc)."""

    def __init__(self, module: Stage, tc: TrainConfig, g: Groups):
        self.module, self.g, self.dp = module, g, g.layout.dp
        replica = module.tie_replica()
        self.params = [(n, p) for n, p in module.named_parameters()
                       if p.requires_grad and p is not replica]
        n = sum(p.numel() for _, p in self.params)
        self.n = n
        self.per = max(1, -(-n // self.dp))
        self.lo = g.dp_rank * self.per
        self.segments: list[_Segment] = []
        a = 0
        for name, p in self.params:
            for v in module.views(name, p.detach()):
                if not v.data.is_contiguous():
                    raise ValueError(f"{v.fqn}: a view that is not contiguous in {name}")
                s = a + int(v.data.storage_offset()) - int(p.storage_offset())
                self.segments.append(_Segment(v, s, s + v.data.numel()))
            a += p.numel()
        self.flat = nn.Parameter(self.flat_params()[self.lo:self.lo + self.per].clone())
        self.opt = torch.optim.AdamW([self.flat], lr=tc.lr, betas=tc.betas, eps=tc.eps,
                                     weight_decay=tc.weight_decay)
        self.full_grad: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def _padded(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts + [torch.zeros(self.per * self.dp - self.n)])

    def flat_params(self) -> torch.Tensor:
        return self._padded([p.detach().reshape(-1) for _, p in self.params])

    def sync_master(self) -> None:
        """The master range from the model parameters (after a load)."""
        with torch.no_grad():
            self.flat.copy_(self.flat_params()[self.lo:self.lo + self.per])

    def reduce_grads(self) -> None:
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                 for _, p in self.params]
        flat = self._padded(grads)
        if self.dp > 1:
            dist.all_reduce(flat, group=self.g.dp)
        self.full_grad = flat

    def grad_of(self, name: str) -> torch.Tensor:
        """The reduced gradient of parameter ``name`` (after :meth:`reduce_grads`)."""
        assert self.full_grad is not None
        a = 0
        for n, p in self.params:
            if n == name:
                return self.full_grad[a:a + p.numel()].view_as(p)
            a += p.numel()
        raise KeyError(name)

    def step(self) -> None:
        assert self.full_grad is not None
        self.flat.grad = self.full_grad[self.lo:self.lo + self.per].clone()
        self.opt.step()
        self.flat.grad = None
        if self.dp > 1:
            parts = [torch.empty(self.per) for _ in range(self.dp)]
            dist.all_gather(parts, self.flat.detach().clone(), group=self.g.dp)
            full = torch.cat(parts)
        else:
            full = self.flat.detach()
        a = 0
        with torch.no_grad():
            for _, p in self.params:
                p.copy_(full[a:a + p.numel()].view_as(p))
                a += p.numel()

    def flat_views(self, local: torch.Tensor, name: Callable[[str], str]) -> list[ShardedTensor]:
        """``local`` (this rank's range of a flat buffer: a moment) as pieces of
        the canonical tensors, with ``flattened_range`` over each view's box."""
        hi = self.lo + self.per
        out = []
        for sg in self.segments:
            a, b = max(sg.start, self.lo), min(sg.stop, hi)
            if a < b:
                v = sg.view
                out.append(ShardedTensor(name(v.fqn), local[a - self.lo:b - self.lo],
                                         global_shape=v.global_shape, global_offset=v.global_offset,
                                         local_shape=v.local_shape,
                                         flattened_range=slice(a - sg.start, b - sg.start),
                                         replica_id=v.replica_id))
        return out

    def covered(self) -> list[str]:
        """Canonical tensors this rank holds any optimizer state of."""
        hi = self.lo + self.per
        return list(dict.fromkeys(sg.view.fqn for sg in self.segments
                                  if max(sg.start, self.lo) < min(sg.stop, hi)))

    def optim_layout(self, fqn: str | None, p: torch.Tensor, key: str,
                     v: torch.Tensor) -> list[ShardedTensor]:
        """``OptimizerState`` layout: moments by canonical fqn; the scalar
        ``step`` once per canonical tensor held (each its own copy, so no two
        names share memory)."""
        assert fqn is None and p is self.flat
        if v.dim() == 0:
            self._steps = [v.detach().clone() for _ in self.covered()]
            return [ShardedTensor(f"state.{f}.{key}", t, global_shape=(), global_offset=())
                    for f, t in zip(self.covered(), self._steps, strict=True)]
        return self.flat_views(v, lambda f: f"state.{f}.{key}")

    def finish_load(self) -> None:
        """After a load: master from the loaded weights, ``step`` from its copies."""
        self.sync_master()
        st = self.opt.state.get(self.flat)
        if st and self._steps:
            vals = {float(t) for t in self._steps}
            if len(vals) != 1:
                raise reshard.ShardingError(f"optimizer steps differ between tensors: {sorted(vals)}")
            st["step"].copy_(self._steps[0])
        self._steps = []


# ----------------------------------------------------------------------------- trainer


@dataclass
class StepResult:
    loss: float | None  # on last-stage ranks
    pieces: list[Piece] = field(default_factory=list)  # with record=True


class Trainer:
    """One rank of a ``layout`` run (see the module doc).

    Args:
        seed: initialisation seed (default ``train.seed``); the parity
            harness resumes from another seed so that anything not loaded
            shows up.
        corpus: data (default :func:`make_corpus`).
    """

    def __init__(self, model: ModelConfig, train: TrainConfig, layout: Layout | str, *,
                 seed: int | None = None, corpus: Any = None):
        self.mc, self.tc, self.layout = model, train, Layout.parse(layout)
        self.g = g = grid_groups(self.layout)
        self.module = Stage(model, tp=TP(g.tp_rank, self.layout.tp, g.tp), stage=g.pp_rank,
                            pp=self.layout.pp, seed=train.seed if seed is None else seed)
        self.corpus = corpus if corpus is not None else make_corpus(model, train)
        self.cursor = reshard.DataCursor(len(self.corpus), train.global_batch, seed=train.data_seed,
                                         dp_rank=g.dp_rank, dp_size=self.layout.dp)
        self.zero = Zero1(self.module, train, g)
        self.dropout_seed = derive_seed(train.seed, 0, {}, "dropout")
        self.step = 0

    # -- state
    def state(self) -> dict[str, Any]:
        ms = reshard.ModelState(self.module, layout=self.module.layout)
        g = self.g
        return {"model": ms,
                "optim": reshard.OptimizerState(ms, self.zero.opt, layout=self.zero.optim_layout),
                "rng": reshard.RNGState(base_seed=self.tc.seed,
                                        coords={"pp": g.pp_rank, "dp": g.dp_rank, "tp": g.tp_rank}),
                "data": self.cursor, "step": self.step}

    def save(self, path: str, **options: Any) -> reshard.SaveResult:
        L = self.layout
        opts = reshard.SaveOptions(mesh={"pp": L.pp, "dp": L.dp, "tp": L.tp}, **options)
        return reshard.save(self.state(), path, step=self.step, options=opts)

    def load(self, path: str, **kw: Any) -> reshard.LoadResult:
        res = reshard.load(self.state(), path, **kw)
        self.step = int(res.values["step"])
        self.zero.finish_load()
        return res

    def import_hf(self, hf_dir: str, **kw: Any) -> reshard.LoadResult:
        """The model weights from a Hugging Face directory (bert: the MLM head
        is not in it and keeps its initialisation from ``head_seed``)."""
        from ..formats.hf_import import import_hf
        from ..transforms import Rename

        kw.setdefault("allow_missing", [("model.cls.*", "keep")])
        # Hugging Face names are the module's own; here they sit under "model"
        kw["transforms"] = [Rename(r"^", "model."), *kw.get("transforms", ())]
        res = import_hf({"model": reshard.ModelState(self.module, layout=self.module.layout)},
                        hf_dir, **kw)
        self.zero.sync_master()
        return res

    # -- data
    def global_batch(self, samples: Sequence[int], step: int) -> tuple[torch.Tensor, ...]:
        """``(input_ids, attention_mask, labels)`` of the global batch."""
        mc, tc = self.mc, self.tc
        if mc.preset == "bert":
            from .data import mlm_batch

            return mlm_batch(self.corpus, list(samples), step=step, seed=tc.data_seed,
                             vocab_size=mc.vocab_size, mask_id=mc.mask_id,
                             special_ids=set(mc.special_ids), mask_prob=tc.mask_prob)
        idx = torch.as_tensor(list(samples), dtype=torch.int64)
        ids, att = self.corpus.ids[idx].clone(), self.corpus.attention_mask[idx].clone()
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = torch.where(att[:, 1:] == 1, ids[:, 1:], -100)
        return ids, att, labels

    def _micro_batches(self, samples: list[int], batch: tuple[torch.Tensor, ...]) -> list[MicroBatch]:
        share = self.tc.global_batch // self.layout.dp
        m = max(1, share // self.tc.micro_batch)
        while share % m:  # equal micro-batches, at most micro_batch samples where possible
            m -= 1
        size, lo = share // m, self.g.dp_rank * share
        out = []
        for i in range(m):
            s = slice(lo + i * size, lo + (i + 1) * size)
            ids, att, labels = (t[s] for t in batch)
            out.append(MicroBatch(samples[s], ids, att, labels, self.step, len(self.corpus)))
        return out

    # -- one step
    def _pipeline(self, mbs: list[MicroBatch], n_tokens: int) -> torch.Tensor:
        """GPipe forward/backward of this rank's micro-batches; the summed loss
        contribution on the last stage (0 elsewhere)."""
        st, g = self.module, self.g
        held: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        loss = torch.zeros(())
        for mb in mbs:
            x = None
            if not st.first:
                x = torch.empty(len(mb.samples), mb.input_ids.shape[1], self.mc.hidden)
                dist.recv(x, src=g.prev)
                x.requires_grad_(True)
            y = st(x, mb, seed=self.dropout_seed)
            if st.last:
                y = st.loss(y, mb) / max(n_tokens, 1)
                loss += y.detach()
            else:
                dist.send(y.detach().contiguous(), dst=g.next)
            held.append((x, y))
        for x, y in held:
            if st.last:
                y.backward()
            else:
                gy = torch.empty_like(y)
                dist.recv(gy, src=g.next)
                y.backward(gy)
            if x is not None:
                dist.send(x.grad if x.grad is not None else torch.zeros_like(x), dst=g.prev)
        return loss

    def _tied(self) -> torch.Tensor | None:
        """This rank's end of the bert tie across stages (None if not split)."""
        st = self.module
        if self.mc.preset != "bert" or self.layout.pp == 1:
            return None
        if st.first:
            return st.embeddings.word_embeddings.weight
        return st.tie_replica()

    def train_step(self, *, record: bool = False) -> StepResult:
        """One optimizer step on the next global batch. With ``record``, the
        result holds this rank's pieces of the loss, the reduced gradients
        (before the update), the updated weights and the moments."""
        samples = self.cursor.next_global_batch()
        batch = self.global_batch(samples, self.step)
        n_tokens = int((batch[2] != -100).sum())
        loss = self._pipeline(self._micro_batches(samples, batch), n_tokens)
        tied = self._tied()
        if tied is not None:  # gradient of the tie: all-reduced between first and last stage
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=self.g.emb)
        self.zero.reduce_grads()
        pieces: list[Piece] = []
        if record:
            for name, _ in self.zero.params:
                pieces += _pieces("grad", self.module.views(name, self.zero.grad_of(name)))
        self.zero.step()
        if tied is not None:
            with torch.no_grad():
                dist.broadcast(tied.data, src=self.g.emb_src, group=self.g.emb)
        for p in self.module.parameters():
            p.grad = None
        out: float | None = None
        if self.module.last:
            if self.layout.dp > 1:
                dist.all_reduce(loss, group=self.g.dp)
            out = float(loss)
            if record:
                pieces.append(("loss", "loss", (), (), (), None, loss.clone()))
        if record:
            pieces += self.state_pieces()
        self.step += 1
        return StepResult(out, pieces)

    def state_pieces(self) -> list[Piece]:
        """This rank's pieces of the weights (``"param"``) and the AdamW
        moments (``"exp_avg"``, ``"exp_avg_sq"``) as they are now; empty
        moments before the first step."""
        pieces: list[Piece] = []
        for name, t in self.module.state_dict().items():
            pieces += _pieces("param", self.module.views(name, t))
        st = self.zero.opt.state.get(self.zero.flat, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                pieces += _pieces(key, self.zero.flat_views(st[key], lambda f: f))
        return pieces


def _pieces(kind: str, views: list[ShardedTensor]) -> list[Piece]:
    return [(kind, v.fqn, v.global_shape, v.global_offset, v.local_shape, v.flat_bounds,
             v.data.detach().clone()) for v in views]


__all__ = ["Layout", "Piece", "StepResult", "TrainConfig", "Trainer", "Zero1", "grid_groups",
           "make_corpus"]
