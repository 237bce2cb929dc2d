"""Workloads of ``reshard bench io``: real ``nn.Module`` state with AdamW
moments, built on the fly, and one real training step of each.

* ``synthetic``: a stack of square ``Linear`` layers without bias (a few large
  tensors, ``--synthetic-mib`` MiB of parameters);
* ``gpt2-small``: GPT-2 124M (12 layers, hidden 768, 12 heads, vocabulary
  50257, 1024 positions, the LM head tied to the token embedding), written
  here in plain torch; about 124M parameters, 1.49 GB with the two AdamW
  moments, 148 parameter tensors (about 450 state tensors);
* ``llama-tiny``: :func:`reshard.testing.model.model_config` ``("llama", "small")``
  (the demo's llama: hidden 128, 4 layers, vocabulary 1000);
* ``bert-minilm``: ``("bert", "full")``, the exact all-MiniLM-L6-v2 shapes
  with the MLM head (the demo's default model).

Layouts (:func:`parse_layout`): ``fsdp`` / ``fsdpN`` (FSDP2 ``fully_shard`` of
every block and the root over a 1-D CPU gloo mesh: parameters and moments are
``Shard(0)`` DTensors) and ``dpN`` (the demo's syntax; replicated, as DDP
holds it: every rank holds the whole state, the writers are balanced by the
planner). The state handed to ``reshard.save`` and to DCP is the same:
``{"model": msd, "optim": osd}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict``.
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
    """``kind`` "fsdp" or "dp" over ``world`` ranks (None: the run's world size)."""

    kind: str
    world: int | None = None

    def on(self, world: int) -> LayoutSpec:
        return LayoutSpec(self.kind, self.world or world)

    def __str__(self) -> str:
        return f"{self.kind}{self.world or ''}"


def parse_layout(spec: str) -> LayoutSpec:
    """``fsdp``, ``fsdp4``, ``dp``, ``dp2`` (``dp2,tp1,pp1`` too: degrees of 1 are
    ignored); without a degree, the run's world size.

    Raises:
        ValueError: an unknown spec, or tensor/pipeline degrees above 1 (not
            available in this benchmark yet).
    """
    s = spec.strip().lower()
    m = re.fullmatch(r"(fsdp|dp)(\d*)", s)
    if m:
        return LayoutSpec(m[1], int(m[2]) if m[2] else None)
    kw: dict[str, int] = {}
    for part in re.split(r"[,\s×x*]+", s):
        mt = re.fullmatch(r"(tp|pp|dp)(\d+)", part)
        if not mt or mt[1] in kw or int(mt[2]) < 1:
            raise ValueError(f"bad layout {spec!r}: 'fsdp', 'fsdpN' or the demo's syntax ('dp2')")
        kw[mt[1]] = int(mt[2])
    if kw.get("tp", 1) > 1 or kw.get("pp", 1) > 1:
        raise ValueError(f"layout {spec!r}: tensor and pipeline parallel layouts are not available in "
                         "`reshard bench io` yet (use 'fsdp' or 'dpN')")
    return LayoutSpec("dp", kw.get("dp"))


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
    """A :class:`reshard.testing.model.Stage` (one stage, no TP) with a loss forward."""

    def __init__(self, preset: str, size: str):
        super().__init__()
        from ..testing.model import Stage, model_config

        self.cfg = model_config(preset, size)
        self.stage = Stage(self.cfg, seed=0)

    def blocks(self) -> list[nn.Module]:
        return list(self.stage.layers())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from ..testing.model import MicroBatch

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

    def step(self) -> float:
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


def build(name: str, layout: LayoutSpec, *, synthetic_mib: float = 256.0, seq_len: int = 16,
          seed: int = 0) -> Workload:
    """Build ``name`` in ``layout`` on the current default process group, and
    run one training step (which creates the AdamW moments).

    Raises:
        ValueError: an unknown model.
    """
    import torch.distributed as dist

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1 + (dist.get_rank() if dist.is_initialized() else 0))
    model: Any
    if name == "synthetic":
        width = 2048 if synthetic_mib >= 64 else 256
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
