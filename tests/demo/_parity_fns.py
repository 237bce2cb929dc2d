"""Rank functions of ``tests/demo/test_parity.py`` (run on gloo ranks by the pool).

The real all-MiniLM-L6-v2 file: imported into the ``bert`` preset at TP=2,
saved, loaded at TP=1; every imported tensor is compared with the file's
bytes (bit for bit: floats compared as integers, so -0.0 != 0.0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from reshard.demo.data import minilm_dir
from reshard.demo.model import DECODER, TIED, logical_init, model_config
from reshard.demo.trainer import Layout, TrainConfig, Trainer

_INT = {4: torch.int32, 8: torch.int64, 2: torch.int16, 1: torch.int8}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        it = _INT[a.element_size()]
        return torch.equal(a.contiguous().view(it), b.contiguous().view(it))
    return torch.equal(a, b)


def _file() -> Any:
    from safetensors import safe_open

    return safe_open(str(minilm_dir() / "model.safetensors"), framework="pt")


def _minilm_trainer(layout: Layout) -> Trainer:
    # a tiny random corpus: only the weights matter here
    return Trainer(model_config("bert", "full"), TrainConfig(num_samples=8, global_batch=4), layout)


def r_minilm_import_save(path: str) -> dict[str, Any]:
    """TP=2: import the Hugging Face file, check this rank's shards against
    the file's slices, save the training state."""
    tr = _minilm_trainer(Layout(tp=dist.get_world_size()))
    res = tr.import_hf(str(minilm_dir()))
    f = _file()
    checked, bad = set(), []
    for name, t in tr.module.state_dict().items():
        for v in tr.module.views(name, t):
            if v.fqn.startswith("cls."):
                continue
            box = tuple(slice(o, o + s) for o, s in zip(v.global_offset, v.local_shape, strict=True))
            want = f.get_slice(v.fqn)[box] if box else f.get_tensor(v.fqn)
            if not same_bits(v.data, want):
                bad.append(v.fqn)
            checked.add(v.fqn)
    tr.save(path)
    return {"checked": sorted(checked), "bad": bad, "missing": list(res.missing),
            "shapes": {n: tuple(p.shape) for n, p in tr.module.named_parameters()}}


def r_minilm_load_tp1(path: str) -> dict[str, Any]:
    """TP=1 (one rank): load, compare all 104 tensors with the file, check the tie and the head."""
    tr = _minilm_trainer(Layout())
    with torch.no_grad():  # nothing may survive from the constructor
        for p in tr.module.parameters():
            p.fill_(float("nan"))
    tr.load(path)
    f = _file()
    m = tr.module
    sd = m.state_dict()
    # canonical tensors: at TP=1 each view (q/k/v of the fused qkv buffer) is a whole tensor
    canon = {v.fqn: v.data for n, t in sd.items() for v in m.views(n, t)}
    names = sorted(f.keys())
    bad = [n for n in names if n not in canon or not same_bits(canon[n], f.get_tensor(n))]
    tied = m.cls.predictions.decoder.weight is m.embeddings.word_embeddings.weight
    head = {n: same_bits(t, logical_init(n, tuple(t.shape), tr.mc, 0))
            for n, t in sd.items() if n.startswith("cls.") and n != DECODER}
    return {"n_file": len(names), "bad": bad, "tied": tied, "head_restored": head,
            "decoder_equals_file": same_bits(sd[DECODER], f.get_tensor(TIED))}


def r_step_scalar_ties(path: str, clone: bool) -> tuple[str, str]:
    """ZeRO ranks declare the scalar AdamW ``step`` under the names of the
    tensors whose state they hold (different sets per rank): views of one
    0-dim tensor are ties on one rank and tensors of their own on another."""
    import reshard

    step = torch.tensor(3.0)
    names = [["a", "b"], ["b", "c"]][dist.get_rank()]
    tree = {f"s{i}": reshard.ShardedTensor(f"optim.state.{n}.step", step.clone() if clone else step,
                                           global_shape=(), global_offset=())
            for i, n in enumerate(names)}
    try:
        reshard.save(tree, path)
    except reshard.ShardingError as e:
        return "ShardingError", str(e)
    return "ok", ""


def resume_with_fault(mc: Any, tc: TrainConfig, layout: str, path: str, fault: str | None) -> Any:
    """Load ``path`` in ``layout`` (a trainer from another seed), inject a real
    restore error, take the next step and return its pieces. ``fault``:
    ``None``; ``"exp_avg"`` (the first moment of this rank's ZeRO range
    restored as 0.5 of itself); ``"rng_step"`` (the step the dropout masks and
    MLM masking are drawn for is one ahead)."""
    tr = Trainer(mc, tc, layout, seed=tc.seed + 1000)
    tr.load(path)
    if fault == "exp_avg":
        tr.zero.opt.state[tr.zero.flat]["exp_avg"].mul_(0.5)
    elif fault == "rng_step":
        tr.step += 1
    return tr.train_step(record=True).pieces
