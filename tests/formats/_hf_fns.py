"""Rank functions for tests/formats/test_hf_transformers.py: tiny transformers models
(GPT-2, Llama) built from configs, trained a step with FSDP2 on gloo ranks,
saved with reshard under the common layouts of a training state."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard

VOCAB, SEQ = 64, 8
#: the layouts of a training state a user saves (name -> how it is built, see ``_state``)
LAYOUTS = ("torchstate", "model_optim", "appstate", "plain")


def config(kind: str, tied: bool) -> Any:
    """A tiny config of ``kind`` ("gpt2" or "llama"), float32, no download."""
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                          bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)


def model_class(kind: str) -> Any:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM


def build(kind: str, tied: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return model_class(kind)(config(kind, tied))


def blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "transformer", None) or model.model
    return list(getattr(inner, "h", None) or inner.layers)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(1, VOCAB, (2, SEQ), generator=g)


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in blocks(model):
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    ids = batch(step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


class AppState:
    """The AppState of PyTorch's DCP tutorial: ``get_state_dict`` of the model
    and its optimizer as ``{"model": msd, "optim": osd}``."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer):
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _state(layout: str, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    if layout == "torchstate":
        from reshard.adapters.torch_native import TorchState

        return {"model": TorchState(model, opt), "step": 1}
    if layout == "model_optim":
        return {"model": reshard.ModelState(model), "optim": reshard.OptimizerState(model, opt)}
    if layout == "appstate":
        return {"app": AppState(model, opt)}
    if layout == "plain":
        return model.state_dict()
    raise ValueError(layout)


def train_and_save(kind: str, tied: bool, root: str) -> dict[str, Any]:
    """FSDP2 over every rank, one AdamW step, then one reshard checkpoint per
    layout under ``root/<layout>``; rank 0 writes ``root/full.pt`` (the full
    model state dict after the step) and ``root/config/config.json``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = shard(build(kind, tied))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = train_step(model, opt, 0)
    for layout in LAYOUTS:
        reshard.save(_state(layout, model, opt), os.path.join(root, layout), step=1)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(root, "full.pt"))
        model.config.save_pretrained(os.path.join(root, "config"))
    dist.barrier()
    return {"loss": loss}


def save_pretrained(kind: str, tied: bool, out: str) -> None:
    """``save_pretrained`` of the seed-0 model, sharded (several files and an
    index), tied weights left out as transformers does."""
    build(kind, tied).save_pretrained(out, max_shard_size="20KB")


def import_and_resume(kind: str, tied: bool, hf_dir: str, layout: str, fsdp: bool) -> dict[str, Any]:
    """A fresh model (another seed) and a fresh AdamW, ``import_hf`` strictly
    under ``layout`` ("torchstate" or "model_optim"), then one training step.
    Returns whether every parameter equals the saved one, whether the tie
    holds, the step's loss and the full parameters after it."""
    from reshard.adapters.torch_native import TorchState
    from reshard.formats.hf_import import import_hf

    model = build(kind, tied, seed=7)
    if fsdp:
        shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if layout == "torchstate":
        res = import_hf({"model": TorchState(model, opt)}, hf_dir, subtree="model.model")
    else:
        res = import_hf({"model": reshard.ModelState(model), "optim": reshard.OptimizerState(model, opt)},
                        hf_dir, subtree="model")
    ref = build(kind, tied)
    full = {n: _full(p) for n, p in model.named_parameters()}
    same = all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters())
    out_emb = model.get_output_embeddings().weight
    tie_ok = (out_emb is model.get_input_embeddings().weight) == tied
    fresh = not opt.state
    loss = train_step(model, opt, 0)
    after = {n: _full(p) for n, p in model.named_parameters()}
    return {"missing": list(res.missing), "unexpected": list(res.unexpected), "same": same,
            "tie_ok": tie_ok, "fresh_optimizer": fresh, "loss": loss, "after": after}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


#: how a user holds the model when calling ``state_dict()`` (see ``save_wrapped``)
WRAPPERS = ("ddp", "compile", "compile_ddp")


def save_wrapped(kind: str, tied: bool, root: str) -> None:
    """The seed-0 model's ``state_dict()`` taken through each wrapper of
    ``WRAPPERS`` (DDP's ``module.``, torch.compile's ``_orig_mod.``, both),
    saved by reshard as ``{"model": sd}`` under ``root/<wrapper>``; its config
    under ``root/config``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(kind, tied)
    for w in WRAPPERS:
        held = {"ddp": lambda: DDP(model), "compile": lambda: torch.compile(model),
                "compile_ddp": lambda: torch.compile(DDP(model))}[w]()
        reshard.save({"model": held.state_dict()}, os.path.join(root, w), step=1)
    if dist.get_rank() == 0:
        model.config.save_pretrained(os.path.join(root, "config"))
    dist.barrier()
