"""Rank functions for tests/adapters/test_peft.py: LoRA adapters (the ``peft`` package)
on a small transformers Llama built from a config, and on a toy
tensor-parallel block (column- and row-parallel base layers), on gloo ranks."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import reshard
from reshard import ModelState, OptimizerState, SaveOptions, ShardedTensor
from reshard.adapters.peft import distribute_lora, lora_layout
from reshard.manager.manager import CheckpointManager

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(seed: int = 0, dtype: torch.dtype = torch.float32, r: int = 4) -> Any:
    """A 2-layer Llama (hidden 256: every base weight 128-512 KiB) with LoRA
    rank ``r`` on all seven projections; the base from ``seed``, the adapters
    from a fixed seed."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).to(dtype)
    torch.manual_seed(1234)
    pm = get_peft_model(m, LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                      init_lora_weights="gaussian"))
    return pm


def _opt(pm: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)


def _step(pm: Any, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the same batch on every DP rank: replicas stay equal
    x = torch.randint(0, 512, (2, 16), generator=g)
    opt.zero_grad()
    pm(input_ids=x, labels=x).loss.backward()
    opt.step()


def _trained(pm: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every trainable parameter and its AdamW moments, by name (copies)."""
    out = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            out[n] = p.detach().clone()
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor):
                    out[f"{n}#{k}"] = v.clone()
    return out


def r_lora_run(root: str, saves: int, keep_last: int, own_file_bytes: int) -> dict[int, dict[str, torch.Tensor]]:
    """``saves`` managed saves of a LoRA fine-tune (one step each), DP over
    the group (replicated model, the same batch on every rank); returns the
    trained tensors of the last ``keep_last`` steps."""
    pm = llama()
    opt = _opt(pm)
    mgr = CheckpointManager(root, keep_last=keep_last, preempt_signals=(),
                            options=SaveOptions(own_file_bytes=own_file_bytes))
    kept: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for s in range(1, saves + 1):
            _step(pm, opt, s)
            mgr.save(s, {"model": ModelState(pm), "optim": OptimizerState(pm, opt), "meta": {"step": s}})
            if s > saves - keep_last:
                kept[s] = _trained(pm, opt)
        mgr.wait()
    finally:
        mgr.close()
    return kept if dist.get_rank() == 0 else {}


def r_lora_load(path: str) -> dict[str, torch.Tensor]:
    """Resume the LoRA run from ``path`` at this layout (a fresh model from
    another seed, so every byte of the base must come from the checkpoint)
    and return what it holds: trained tensors and the base's bytes."""
    pm = llama(seed=99)
    opt = _opt(pm)
    res = reshard.load({"model": ModelState(pm), "optim": OptimizerState(pm, opt), "meta": {"step": -1}}, path)
    out = _trained(pm, opt)
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            out[n] = p.detach().clone()
    out["#step"] = torch.tensor(res.values["meta"]["step"])
    return out


def r_rows_load(path: str) -> dict[str, torch.Tensor]:
    """Load every tensor of ``path`` into a row split over this group (the
    layout a TP/FSDP resize gives: each rank a slab of rows) and return this
    rank's slabs, for comparison with the whole tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = reshard.inspect(path)
    tgt: dict[str, Any] = {}
    for fqn, te in m.tensors.items():
        g = tuple(te.global_shape)
        from reshard.state.sharding import torch_dtype

        dt = torch_dtype(te.dtype)
        if len(g) >= 1 and g[0] % world == 0 and g[0] >= world:
            n = g[0] // world
            tgt[fqn] = ShardedTensor(fqn, torch.zeros((n, *g[1:]), dtype=dt), global_shape=g,
                                     global_offset=(rank * n,) + (0,) * (len(g) - 1))
        else:
            tgt[fqn] = torch.zeros(g, dtype=dt)
    reshard.load(tgt, path, strict=False)
    return {k: (v.data if isinstance(v, ShardedTensor) else v) for k, v in tgt.items()}


# ----------------------------------------------------------------------------- a TP block with LoRA

H, F, R = 16, 32, 4  # hidden, ffn, LoRA rank


class Block(nn.Module):
    """``row(silu(col(x)))``: ``col`` column parallel ([F/T, H] a rank), ``row``
    row parallel ([H, F/T] a rank); T=1 is the unsharded reference."""

    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.col = nn.Linear(H, F // tp, bias=False)
        self.row = nn.Linear(F // tp, H, bias=False)


def reference(base_seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The unsharded tensors: base weights (from ``base_seed``), LoRA A/B,
    and one step's gradients of the LoRA weights."""
    g = torch.Generator().manual_seed(base_seed)
    out = {"col.W": torch.randn(F, H, generator=g).to(dtype), "row.W": torch.randn(H, F, generator=g).to(dtype)}
    g = torch.Generator().manual_seed(77)
    for layer, (o, i) in (("col", (F, H)), ("row", (H, F))):
        out[f"{layer}.A"] = torch.randn(R, i, generator=g)
        out[f"{layer}.B"] = torch.randn(o, R, generator=g)
        out[f"{layer}.gA"] = torch.randn(R, i, generator=g)
        out[f"{layer}.gB"] = torch.randn(o, R, generator=g)
    return out


def lora_block(tp: int, rank: int, base_seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A PEFT LoRA model of :class:`Block` at TP ``tp`` (this rank's shards
    of the reference, the adapters by the rule)."""
    from peft import LoraConfig, get_peft_model

    ref = reference(base_seed, dtype)
    m = Block(tp).to(dtype)
    pm = get_peft_model(m, LoraConfig(r=R, lora_alpha=R, target_modules=["col", "row"], lora_dropout=0.0))
    f = F // tp
    cols = slice(rank * f, (rank + 1) * f)
    with torch.no_grad():
        mods = dict(pm.named_modules())
        col, row = mods["base_model.model.col"], mods["base_model.model.row"]
        col.base_layer.weight.copy_(ref["col.W"][cols])
        row.base_layer.weight.copy_(ref["row.W"][:, cols])
        col.lora_A["default"].weight.copy_(ref["col.A"])  # column: A replicated, B split on out
        col.lora_B["default"].weight.copy_(ref["col.B"][cols])
        row.lora_A["default"].weight.copy_(ref["row.A"][:, cols])  # row: A split on in, B replicated
        row.lora_B["default"].weight.copy_(ref["row.B"])
    return pm


def _local_grads(tp: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's slices of the reference gradients, by the rule (by parameter name)."""
    ref = reference()
    f = F // tp
    cols = slice(rank * f, (rank + 1) * f)
    pre = "base_model.model"
    return {f"{pre}.col.lora_A.default.weight": ref["col.gA"].clone(),
            f"{pre}.col.lora_B.default.weight": ref["col.gB"][cols].clone(),
            f"{pre}.row.lora_A.default.weight": ref["row.gA"][:, cols].clone(),
            f"{pre}.row.lora_B.default.weight": ref["row.gB"].clone()}


def _grads(pm: Any, tp: int, rank: int) -> None:
    grads = _local_grads(tp, rank)
    for n, p in pm.named_parameters():
        if n in grads:
            p.grad = grads[n]


def base_layout(tp: int, rank: int) -> Any:
    f = F // tp

    def layout(fqn: str, t: torch.Tensor) -> Any:
        if fqn.endswith("col.base_layer.weight"):
            return ShardedTensor(fqn, t, global_shape=(F, H), global_offset=(rank * f, 0))
        if fqn.endswith("row.base_layer.weight"):
            return ShardedTensor(fqn, t, global_shape=(H, F), global_offset=(0, rank * f))
        return None

    return layout


def _adapter(pm: Any, tp: int, rank: int, trainable_only: bool) -> ModelState:
    if tp == 1:
        return ModelState(pm, trainable_only=trainable_only)
    return ModelState(pm, layout=lora_layout(pm, base_layout(tp, rank)), trainable_only=trainable_only)


def r_block_save(path: str, trainable_only: bool) -> bool:
    """Save the TP block (this group's size is TP) after one AdamW step."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    pm = lora_block(tp, rank)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=0.1, foreach=False)
    _grads(pm, tp, rank)
    opt.step()
    ms = _adapter(pm, tp, rank, trainable_only)
    reshard.save({"model": ms, "optim": OptimizerState(ms, opt)}, path)
    return True


def r_block_load(path: str, trainable_only: bool, base_seed: int = 0,
                 dtype: str = "float32") -> dict[str, Any]:
    """Load the block at this group's TP into a fresh model and optimizer;
    return this rank's LoRA weights and moments, or the error's text."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    pm = lora_block(tp, rank, base_seed, getattr(torch, dtype))
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.zero_()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=0.1, foreach=False)
    ms = _adapter(pm, tp, rank, trainable_only)
    try:
        reshard.load({"model": ms, "optim": OptimizerState(ms, opt)}, path)
    except reshard.CheckpointError as e:
        return {"error": str(e)}
    return _trained(pm, opt)


def expected_after_step() -> dict[str, torch.Tensor]:
    """The reference LoRA weights and AdamW moments after the same step (TP=1)."""
    pm = lora_block(1, 0)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=0.1, foreach=False)
    _grads(pm, 1, 0)
    opt.step()
    return _trained(pm, opt)


def r_block_save_dtensor(path: str) -> bool:
    """The TP block with DTensor base weights (col Shard(0), row Shard(1)) and
    the adapters placed by :func:`distribute_lora`; one AdamW step on
    DTensor gradients; saved through ModelState (placements as they are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, tp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    pm = lora_block(tp, rank)
    mods = dict(pm.named_modules())
    for name, dim, gshape in (("col", 0, (F, H)), ("row", 1, (H, F))):
        lin = mods[f"base_model.model.{name}"].base_layer
        dt = DTensor.from_local(lin.weight.data, mesh, [Shard(dim)], shape=torch.Size(gshape),
                                stride=torch.empty(gshape).stride(), run_check=False)
        lin.weight = nn.Parameter(dt, requires_grad=False)
    changed = distribute_lora(pm)
    assert len(changed) == 4, changed
    grads = _local_grads(tp, rank)
    for n, p in pm.named_parameters():
        if p.requires_grad:
            p.grad = DTensor.from_local(grads[n], p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride(), run_check=False)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=0.1, foreach=False)
    opt.step()
    reshard.save({"model": ModelState(pm), "optim": OptimizerState(pm, opt)}, path)
    return True
