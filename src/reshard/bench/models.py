"""Workloads of ``reshard bench io``: real ``nn.Module`` state with AdamW
moments, built on the fly, and one real training step of each.

* ``synthetic``: a stack of square ``Linear`` layers without bias (a few large
  tensors, ``--synthetic-mib`` MiB of parameters);
* ``gpt2-small``: GPT-2 124M (12 layers, hidden 768, 12 heads, vocabulary
  50257, 1024 positions, the LM head tied to the token embedding), written
  here in plain torch; about 124M parameters, 1.49 GB with the two AdamW
  moments, 148 parameter tensors (about 450 state tensors);
* ``llama-tiny``: :func:`reshard.demo.model.model_config` ``("llama", "small")``
  (the demo's llama: hidden 128, 4 layers, vocabulary 1000);
* ``bert-minilm``: ``("bert", "full")``, the exact all-MiniLM-L6-v2 shapes
  with the MLM head (the demo's default model).

Layouts (:func:`parse_layout`): ``fsdp`` / ``fsdpN`` (FSDP2 ``fully_shard`` of
every block and the root over a 1-D CPU gloo mesh: parameters and moments are
``Shard(0)`` DTensors) and ``dpN`` (the demo's syntax; replicated, as DDP
holds it: every rank holds the whole state, the writers are balanced by the
planner). The state handed to ``reshard.save`` and to DCP is the same:
``{"model": msd, "optim": osd}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict``.
Layouts with TP or PP in the demo's syntax (``dp2,tp2``, ``tp1,pp2,dp2``)
run the demo's own trainer (:class:`GridWorkload`, ``llama-tiny`` and
``bert-minilm`` only): the state ``reshard demo`` saves, with no peer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("synthetic", "gpt2-small", "llama-tiny", "bert-minilm")


@dataclass(frozen=True)
class LayoutSpec:
    """``kind`` "fsdp", "dp" or "grid" over ``world`` ranks (None: the run's
    world size). A "grid" is the demo's ``(pp, dp, tp)`` layout
    (:class:`reshard.demo.trainer.Layout`): its world is ``tp * pp * dp``."""

    kind: str
    world: int | None = None
    tp: int = 1
    pp: int = 1

    def on(self, world: int) -> LayoutSpec:
        if self.kind == "grid" and self.world != world:
            raise ValueError(f"layout {self} needs {self.world} ranks, not {world}")
        return LayoutSpec(self.kind, self.world or world, self.tp, self.pp)

    @property
    def dp(self) -> int | None:
        return None if self.world is None else self.world // (self.tp * self.pp)

    def grid(self) -> Any:
        """The demo's :class:`~reshard.demo.trainer.Layout` of a "grid" spec."""
        from ..demo.trainer import Layout

        return Layout(tp=self.tp, pp=self.pp, dp=self.dp or 1)

    def __str__(self) -> str:
        if self.kind == "grid":
            return str(self.grid())
        return f"{self.kind}{self.world or ''}"


#: models whose module is the demo's :class:`reshard.demo.model.Stage` (TP/PP-capable)
GRID_MODELS = ("llama-tiny", "bert-minilm")


def parse_layout(spec: str) -> LayoutSpec:
    """``fsdp``, ``fsdp4``, ``dp``, ``dp2`` (FSDP2 / replicated over the run's
    world size when no degree is given), or the demo's syntax parsed by
    :meth:`reshard.demo.trainer.Layout.parse` (``dp2,tp2``,
    ``tp1,pp2,dp2``): with degrees of 1 for tp and pp it is ``dpN``, else a
    "grid" layout of the demo's trainer (manual Megatron-style TP, GPipe PP,
    ZeRO-1 over DP) on ``tp * pp * dp`` ranks.

    Raises:
        ValueError: an unknown spec, or a degree of 0.
    """
    from ..demo.trainer import Layout

    s = spec.strip().lower()
    m = re.fullmatch(r"(fsdp|dp)(\d*)", s)
    if m:
        if m[2] and int(m[2]) < 1:
            raise ValueError(f"bad layout {spec!r}: a degree is at least 1 (or none: the run's world size)")
        return LayoutSpec(m[1], int(m[2]) if m[2] else None)
    try:
        lay = Layout.parse(s)
    except ValueError:
        raise ValueError(f"bad layout {spec!r}: 'fsdp', 'fsdpN', 'dpN' or the demo's syntax "
                         "('dp2,tp2', 'tp1,pp2,dp2')") from None
    if lay.tp == 1 and lay.pp == 1:
        return LayoutSpec("dp", lay.dp)
    return LayoutSpec("grid", lay.world_size, lay.tp, lay.pp)


# ----------------------------------------------------------------------------------- GPT-2
@dataclass(frozen=True)
class GPT2Config:
    vocab: int = 50257
    positions: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12


class _Box(nn.Module):
    """A module container whose attributes type as Any (submodules set by name)."""

    def __getattr__(self, name: str) -> Any:
        return super().__getattr__(name)


class _Block(_Box):
    def __init__(self, c: GPT2Config):
        super().__init__()
        h = c.hidden
        self.heads = c.heads
        self.ln_1 = nn.LayerNorm(h)
        self.attn = _Box()
        self.attn.c_attn = nn.Linear(h, 3 * h)
        self.attn.c_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp = _Box()
        self.mlp.c_fc = nn.Linear(h, 4 * h)
        self.mlp.c_proj = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(_Box):
    """GPT-2 (``transformer.*`` names as in the original checkpoint; ``lm_head`` tied to ``wte``)."""

    def __init__(self, c: GPT2Config = GPT2Config()):
        super().__init__()
        self.transformer = _Box()
        self.transformer.wte = nn.Embedding(c.vocab, c.hidden)
        self.transformer.wpe = nn.Embedding(c.positions, c.hidden)
        self.transformer.h = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.transformer.ln_f = nn.LayerNorm(c.hidden)
        self.vocab = c.vocab

    def blocks(self) -> list[nn.Module]:
        return list(self.transformer.h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tr = self.transformer
        x = tr.wte(ids) + tr.wpe(torch.arange(ids.shape[1]))
        for blk in tr.h:
            x = blk(x)
        logits = F.linear(tr.ln_f(x), tr.wte.weight)  # the tied LM head
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))


class Synthetic(nn.Module):
    """``n`` square bias-free ``Linear(width, width)`` layers with GELU between them."""

    def __init__(self, n: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n))
        self.width = width

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = F.gelu(lin(x))
        return x.square().mean()


class _StageModel(nn.Module):
    """A :class:`reshard.demo.model.Stage` (one stage, no TP) with a loss forward."""

    def __init__(self, preset: str, size: str):
        super().__init__()
        from ..demo.model import Stage, model_config

        self.cfg = model_config(preset, size)
        self.stage = Stage(self.cfg, seed=0)

    def blocks(self) -> list[nn.Module]:
        return list(self.stage.layers())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from ..demo.model import MicroBatch

        labels = ids.clone()
        labels[:, ::2] = -100
        mb = MicroBatch(samples=list(range(ids.shape[0])), input_ids=ids,
                        attention_mask=torch.ones_like(ids), labels=labels, step=0,
                        dataset_len=ids.shape[0])
        x = self.stage(None, mb, seed=0)
        return self.stage.loss(x, mb) / max(1, int((labels != -100).sum()))


@dataclass
class Workload:
    """One rank's model, optimizer and batch; ``step()`` is a real forward/backward/AdamW step."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    batch: torch.Tensor
    replicated: bool = False  # dp: gradients averaged over the ranks (as DDP does)
    #: DCP, torch.save and safetensors can save this state (an nn.Module state dict)
    peers: bool = True

    def after_load(self) -> None:
        """What a training loop does after ``reshard.load`` (nothing here)."""

    def step(self, before_update: Any = None) -> float:
        """One training step; ``before_update()`` (if given) is called after
        the backward, right before ``optimizer.step()`` mutates the state
        (where a loop calls ``reshard.wait_for_staging()``)."""
        import torch.distributed as dist

        loss = self.model(self.batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.replicated and dist.is_initialized() and dist.get_world_size() > 1:
            n = dist.get_world_size()
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= n
        if before_update is not None:
            before_update()
        self.opt.step()
        return float(loss.detach())

    def dcp_state(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` from DCP's ``get_state_dict`` (the
        live tensors: a load fills them in place)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def reshard_state(self) -> dict[str, Any]:
        """The same tensors through :class:`reshard.adapters.torch_native.TorchState`."""
        from ..adapters.torch_native import TorchState

        return {"train": TorchState(self.model, self.opt)}

    def tensors(self) -> list[torch.Tensor]:
        """This rank's local tensors of the state (DTensors' local shards), in state order."""
        out: list[torch.Tensor] = []

        def walk(x: Any) -> None:
            if isinstance(x, torch.Tensor):
                out.append(x.to_local() if hasattr(x, "to_local") else x)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(self.dcp_state())
        return [t.detach() for t in out]


@dataclass
class GridWorkload(Workload):
    """One rank of the demo's trainer (:class:`reshard.demo.trainer.Trainer`)
    in a ``(pp, dp, tp)`` layout: its state is the demo's (``ModelState`` with
    the TP views, ZeRO-1 ``OptimizerState``, RNG, data cursor, step), so the
    figures compare with ``reshard demo``'s. DCP, ``torch.save`` and
    safetensors have no equivalent of this manually sharded state."""

    trainer: Any = None

    def step(self, before_update: Any = None) -> float:
        if before_update is not None:  # the trainer's step mutates as it goes: the wait comes first
            before_update()
        loss = self.trainer.train_step().loss
        return 0.0 if loss is None else float(loss)

    def reshard_state(self) -> dict[str, Any]:
        return dict(self.trainer.state())

    def dcp_state(self) -> dict[str, Any]:
        raise ValueError(f"{self.name} in layout {self.trainer.layout}: no DCP state (manual TP/PP)")

    def after_load(self) -> None:
        self.trainer.zero.finish_load()  # the ZeRO-1 master copy from the loaded weights

    def tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers (tied ones once) and the two
        AdamW moment buffers of this rank's ZeRO-1 range."""
        out: list[torch.Tensor] = []
        seen: set[tuple[int, int]] = set()
        for t in self.trainer.module.state_dict().values():
            k = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), t.numel())
            if k not in seen:
                seen.add(k)
                out.append(t.detach())
        z = self.trainer.zero
        st = z.opt.state.get(z.flat, {})
        out.extend(st[k].detach() for k in ("exp_avg", "exp_avg_sq") if k in st)
        return out


def _build_grid(name: str, layout: LayoutSpec, seq_len: int, seed: int) -> GridWorkload:
    from ..demo.model import model_config
    from ..demo.trainer import TrainConfig, Trainer

    if name not in GRID_MODELS:
        raise ValueError(f"layout {layout}: tensor/pipeline layouts need a model of the demo's trainer "
                         f"({', '.join(GRID_MODELS)}), not {name!r}")
    lay = layout.grid()
    preset, size = ("llama", "small") if name == "llama-tiny" else ("bert", "full")
    mc = model_config(preset, size)
    if seq_len > mc.max_positions:
        raise ValueError(f"--seq-len {seq_len}: {name} has {mc.max_positions} positions")
    gb = 8 if 8 % lay.dp == 0 else 2 * lay.dp
    tc = TrainConfig(seq_len=seq_len, global_batch=gb, micro_batch=2, seed=seed, data="random")
    tr = Trainer(mc, tc, lay)
    w = GridWorkload(name, tr.module, tr.zero.opt, torch.empty(0), peers=False, trainer=tr)
    w.step()
    return w


def build(name: str, layout: LayoutSpec, *, synthetic_mib: float = 256.0, seq_len: int = 16,
          seed: int = 0, synthetic_width: int | None = None) -> Workload:
    """Build ``name`` in ``layout`` on the current default process group, and
    run one training step (which creates the AdamW moments).

    A "grid" layout builds the demo's trainer (:class:`GridWorkload`).
    ``synthetic_width``: columns (and rows) of each synthetic layer (default
    2048: 16 MiB tensors; 256 below 64 MiB of parameters).

    Raises:
        ValueError: an unknown model; a grid layout of a model the demo's
            trainer does not have.
    """
    import torch.distributed as dist

    if layout.kind == "grid":
        return _build_grid(name, layout, seq_len, seed)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1 + (dist.get_rank() if dist.is_initialized() else 0))
    model: Any
    if name == "synthetic":
        width = synthetic_width or (2048 if synthetic_mib >= 64 else 256)
        n = max(1, round(synthetic_mib * (1 << 20) / (width * width * 4)))
        model = Synthetic(n, width)
        batch = torch.randn(8, width, generator=g)
    elif name == "gpt2-small":
        model = GPT2()
        batch = torch.randint(0, 50257, (1, seq_len), generator=g)
    elif name in ("llama-tiny", "bert-minilm"):
        preset, size = ("llama", "small") if name == "llama-tiny" else ("bert", "full")
        model = _StageModel(preset, size)
        batch = torch.randint(4, model.cfg.vocab_size, (2, seq_len), generator=g)
    else:
        raise ValueError(f"unknown model {name!r} (one of {', '.join(MODELS)})")
    if layout.kind == "fsdp" and dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks():
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    w = Workload(name, model, opt, batch, replicated=layout.kind == "dp")
    w.step()
    return w


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fmt_count(n: float) -> str:
    if n <= 0:
        return "0"
    e = min(int(math.log10(n)) // 3, 4)
    return f"{n / 10 ** (3 * e):.1f}{' kMGT'[e].strip()}"
