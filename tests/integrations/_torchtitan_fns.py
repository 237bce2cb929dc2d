"""A tiny TorchTitan job on gloo ranks, for tests/integrations/test_torchtitan.py
and benchmarks/bench_integrations_torchtitan.py (run inside WorkerPool workers or torchrun).

TorchTitan's Trainer needs CUDA, so the job drives TorchTitan's own components
the way ``torchtitan.trainer.Trainer.train`` does: a Llama 3 model built from
TorchTitan's model code (a debugmodel made smaller, its inner attention
swapped for TorchTitan's ``ScaledDotProductAttention``: FlexAttention has no
backward on CPU), sharded by TorchTitan's ``apply_fsdp_to_decoder`` (FSDP2) on
a CPU mesh, ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup
and linear decay), ``HuggingFaceTextDataLoader`` over a local JSON dataset and
a tokenizer built here (no hub), a ``train_state`` Stateful shaped as the
Trainer's, and the checkpoint component built from its Config exactly as the
Trainer builds it. The loop: ``checkpointer.load(load_step)``, then per step
forward/backward, ``maybe_wait_for_staging()``, ``optimizers.step()``,
``lr_schedulers.step()``, ``checkpointer.save(step, last_step)``.

``r_run`` returns, on every rank, the per-step record (global mean loss, lr,
the global batch's token digest) and the final full state (``full_tensor()``
of the model and optimizer moments, scheduler and train state).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from typing import Any

import torch
import torch.distributed as dist

VOCAB_WORDS = 56
SEQ = 16


def assets(d: str) -> tuple[str, str]:
    """A WordLevel tokenizer (tokenizer.json + tokenizer_config.json) and a
    JSON dataset of 240 documents under ``d``; returns (hf_assets dir, data dir)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf, data = os.path.join(d, "hf_assets"), os.path.join(d, "data")
    if os.path.exists(os.path.join(data, "train.json")):
        return hf, data
    os.makedirs(hf, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    words = [f"w{i}" for i in range(VOCAB_WORDS)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    tk.save(os.path.join(hf, "tokenizer.json"))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    rng = random.Random(0)
    tmp = os.path.join(data, "train.json.tmp")
    with open(tmp, "w") as f:
        for _ in range(240):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))}) + "\n")
    os.replace(tmp, os.path.join(data, "train.json"))
    return hf, data


def _offline(d: str) -> None:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_CACHE"] = os.path.join(d, "hf_cache")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def model_config(dim: int = 32, layers: int = 2, heads: int = 4, vocab: int = 64) -> Any:
    """TorchTitan's Llama 3 debugmodel config made smaller, with TorchTitan's
    ScaledDotProductAttention as inner attention (CPU has no FlexAttention backward)."""
    import torchtitan.models.llama3 as L
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    cfg = L.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex"))
    for _fqn, _c, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


class TrainState:
    """The Trainer's own Stateful (``torchtitan.trainer.Trainer.state_dict``);
    ``tensor_step``: as older TorchTitan releases had it, the counters saved as
    int32 tensors and read back with ``.item()``."""

    def __init__(self, tensor_step: bool = False) -> None:
        self.step = 0
        self.ntokens_seen = 0
        self.tensor_step = tensor_step

    def state_dict(self) -> dict[str, Any]:
        if self.tensor_step:
            return {"step": torch.tensor(self.step, dtype=torch.int32),
                    "ntokens_seen": torch.tensor(self.ntokens_seen, dtype=torch.int64)}
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.tensor_step:
            self.step, self.ntokens_seen = sd["step"].item(), sd["ntokens_seen"].item()
        else:
            self.step = sd["step"]
            self.ntokens_seen = sd["ntokens_seen"]


def cursor_loader_cls() -> Any:
    """A TorchTitan dataloader whose position is a reshard.DataCursor (global,
    reshardable across DP sizes): map-style windows of the token stream."""
    from torchtitan.components.dataloader import BaseDataLoader

    import reshard

    class CursorLoader(reshard.DataCursor, BaseDataLoader):
        def __init__(self, tokens: torch.Tensor, global_batch: int, dp_rank: int, dp_size: int):
            n = (len(tokens) - 1) // SEQ
            reshard.DataCursor.__init__(self, n, global_batch, seed=7, dp_rank=dp_rank, dp_size=dp_size)
            self.tokens = tokens

        def __iter__(self) -> Any:
            while True:
                idx = torch.tensor(self.next_batch())
                starts = idx * SEQ
                win = torch.stack([self.tokens[s:s + SEQ + 1] for s in starts.tolist()])
                pos = torch.arange(SEQ).repeat(len(idx), 1)
                yield {"input": win[:, :-1], "positions": pos}, win[:, 1:]

    return CursorLoader


def build(d: str, *, folder: str, steps: int, interval: int, global_batch: int = 4,
          ckpt: dict[str, Any] | None = None, cursor: bool = False, manager: str = "reshard",
          seed: int = 0, hf: bool = False, tensor_step: bool = False) -> dict[str, Any]:
    """The job's components on this process group (FSDP2 over all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from reshard.integrations.torchtitan import ReshardCheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        assets(d)
    dist.barrier()
    hf, data = assets(d)
    _offline(d)
    torch.manual_seed(seed)
    cfg = model_config()
    with torch.device("meta"):
        model = cfg.build()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False)
    # as TorchTitan's parallelize does: gradients summed (gloo has no PREMUL_SUM), the loss
    # divided by the DP size instead
    disable_fsdp_gradient_division(model)
    for m in model.modules():  # gloo reduces with SUM only
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=None)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
            "lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})],
        implementation="foreach").build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                      min_lr_factor=0.1).build(optimizers=optimizers, training_steps=steps)
    tok = HuggingFaceTokenizer(tokenizer_path=hf)
    local = global_batch // world
    if cursor:
        with open(os.path.join(data, "train.json")) as f:
            ids = [t for line in f for t in tok.encode(json.loads(line)["text"], add_bos=True, add_eos=True)]
        loader = cursor_loader_cls()(torch.tensor(ids), global_batch, rank, world)
    else:
        loader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=data).build(
            dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=local)
    ts = TrainState(tensor_step)
    kw = {"enable": True, "folder": folder, "interval": interval, **(ckpt or {})}
    cls = ReshardCheckpointManager if manager == "reshard" else CheckpointManager
    adapter = None
    if hf:  # the model's Hugging Face state-dict adapter, as its ModelSpec gives it to the Trainer
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        adapter = Llama3StateDictAdapter(cfg, None)
    checkpointer = cls.Config(**kw).build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr,
        states={"train_state": ts}, sd_adapter=adapter, base_folder=d)
    return {"model": model, "optimizers": optimizers, "lr": lr, "loader": loader, "ts": ts,
            "checkpointer": checkpointer, "steps": steps}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()[:12]


def train(job: dict[str, Any], *, stop_after: int | None = None, load_step: int = -1,
          fixed_batch: bool = False) -> list[dict[str, Any]]:
    """TorchTitan's Trainer.train loop over ``job``; the per-step records.
    ``stop_after``: leave the loop after that step (a killed run: no close);
    ``fixed_batch``: every step trains on one fixed global batch (layout-independent)."""
    model, opt, lr, ts, ck = job["model"], job["optimizers"], job["lr"], job["ts"], job["checkpointer"]
    try:
        ck.load(step=load_step)
    except BaseException:
        ck.close()  # TorchTitan's train.py closes the trainer (its checkpointer) in a finally
        raise
    rank, world = dist.get_rank(), dist.get_world_size()
    it = iter(job["loader"])
    out = []
    while ts.step < job["steps"]:
        ts.step += 1
        if fixed_batch:
            g = torch.Generator().manual_seed(1000 + ts.step)
            x_all = torch.randint(4, 64, (4, SEQ + 1), generator=g)
            per = 4 // world
            win = x_all[rank * per:(rank + 1) * per]
            inputs, labels = {"input": win[:, :-1]}, win[:, 1:]
        else:
            inputs, labels = next(it)
        tokens = inputs["input"]
        ts.ntokens_seen += tokens.numel()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        (loss / world).backward()
        ck.maybe_wait_for_staging()
        opt.step()
        lr.step()
        opt.zero_grad()
        g_loss = loss.detach().clone()
        dist.all_reduce(g_loss)
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, tokens)
        out.append({"step": ts.step, "loss": g_loss.item() / world, "lr": lr.schedulers[0].get_last_lr()[0],
                    "batch": _digest(torch.cat(parts))})  # the global batch, in DP-rank order
        ck.save(ts.step, last_step=ts.step == job["steps"])
        if stop_after is not None and ts.step >= stop_after:
            ck.maybe_wait_for_saving()
            return out
    ck.close()
    return out


def full_state(job: dict[str, Any]) -> dict[str, Any]:
    """Layout-free copies: model and optimizer tensors (``full_tensor()``), the
    scheduler's ``last_epoch`` and lr, the train state."""
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        return t.full_tensor().clone() if isinstance(t, DTensor) else (
            t.clone() if isinstance(t, torch.Tensor) else t)

    model = {k: full(v) for k, v in job["model"].state_dict().items()}
    optim = {k: full(v) for k, v in job["optimizers"].state_dict().items()}
    return {"model": model, "optim": optim, "last_epoch": job["lr"].schedulers[0].last_epoch,
            "lr": job["lr"].schedulers[0].get_last_lr()[0], "train": job["ts"].state_dict()}


def loader_next(job: dict[str, Any], n: int = 2) -> list[str]:
    """Digests of this rank's next ``n`` batches of the job's loader."""
    it = iter(job["loader"])
    return [_digest(next(it)[0]["input"]) for _ in range(n)]


# ----------------------------------------------------------------------------- rank functions


def r_run(d: str, folder: str, steps: int, interval: int, *, stop_after: int | None = None,
          ckpt: dict[str, Any] | None = None, cursor: bool = False, manager: str = "reshard",
          fixed_batch: bool = False, load_step: int = -1, fresh: bool = False,
          state: bool = False, hf: bool = False, tensor_step: bool = False) -> dict[str, Any]:
    """Build the job, run its loop; ``fresh``: rank 0 empties ``d/folder`` first."""
    if fresh and dist.get_rank() == 0:
        shutil.rmtree(os.path.join(d, folder), ignore_errors=True)
    dist.barrier()
    job = build(d, folder=folder, steps=steps, interval=interval, ckpt=ckpt, cursor=cursor,
                manager=manager, hf=hf, tensor_step=tensor_step)
    curve = train(job, stop_after=stop_after, load_step=load_step, fixed_batch=fixed_batch)
    out: dict[str, Any] = {"curve": curve}
    if state:
        out["state"] = full_state(job)
        out["next"] = loader_next(job)
    return out


def r_load_only(d: str, folder: str, steps: int, *, ckpt: dict[str, Any] | None = None,
                cursor: bool = False, hf: bool = False, seed: int = 0) -> dict[str, Any]:
    """Build the job and load its checkpoint (no training): the loaded full state."""
    job = build(d, folder=folder, steps=steps, interval=1000, ckpt=ckpt, cursor=cursor, hf=hf, seed=seed)
    loaded = job["checkpointer"].load()
    out = full_state(job)
    out["loaded"] = loaded
    job["checkpointer"].close()
    return out


def r_seed(d: str) -> dict[str, Any]:
    """TorchTitan's create_seed_checkpoint flow (``torchtitan.train``: ``checkpointer.save(
    curr_step=0, last_step=True)``), then a job of another seed loading it: both models."""
    a = build(d, folder="seed", steps=2, interval=10, ckpt={"last_save_model_only": False}, seed=0)
    a["checkpointer"].save(curr_step=0, last_step=True)
    a["checkpointer"].close()
    b = build(d, folder="seed", steps=2, interval=10, seed=9)
    loaded = b["checkpointer"].load()
    out = {"loaded": loaded, "a": full_state(a)["model"], "b": full_state(b)["model"],
           "step": b["ts"].step}
    b["checkpointer"].close()
    return out
