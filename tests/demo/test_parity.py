"""Next-step parity across a reshard matrix, and the real MiniLM weights
through import -> save at TP=2 -> load at TP=1 -> export.

Parity (:func:`reshard.demo.parity.parity`): an uninterrupted run in the
save layout takes step N+1; a separate run saves at N; processes that never
ran the save side (a second worker pool) build the model from another seed,
load in the load layout and take step N+1 on the same global batch. Loss,
reduced gradients, updated weights and AdamW moments (gathered to logical
tensors) must be bit-exact for the same layout and within
``|a - b| <= 1e-6 + 1e-5 |b|`` (fp32) otherwise. Tiny models (hidden 32,
vocabulary 97: padded at TP 2 and 4), dropout 0.1 on, lr 1e-4, N = 2.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import _parity_fns as fns
import reshard
from reshard.demo.model import TIED, Stage, model_config
from reshard.demo.parity import assemble, compare, parity, rank_continuous
from reshard.demo.trainer import Layout, TrainConfig
from reshard.testing.pool import WorkerPool
from reshard.transforms import Rename

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def resume_pool() -> Iterator[WorkerPool]:
    """Workers for the resumed runs, kept apart from those that saved."""
    p = WorkerPool(grace=5.0)
    try:
        yield p
    finally:
        p.close()


CASES = [
    ("llama", "dp2,tp2", "tp4"),
    ("llama", "tp2,pp2", "dp4"),
    ("llama", "dp4", "dp2,tp2"),
    ("llama", "tp4", "dp1,pp2,tp2"),
    ("llama", "pp2,dp2", "pp1,dp1"),
    ("bert", "dp2,tp2", "pp2,dp2"),
    ("bert", "tp4", "pp4"),  # 2 layers on 4 stages: stages without parameters save and load
    ("bert", "pp2,tp2", "pp2,tp2"),  # same layout: bit-exact, dropout on
    ("llama", "dp2,tp2", "dp2,tp2"),  # same layout: bit-exact, ZeRO-1 over dp
]


def _canonical(preset: str) -> dict[str, tuple[int, ...]]:
    """Saved names and shapes a checkpoint must hold in any layout: the
    logical tensors of the unsharded model (q/k/v and gate/up apart, the
    vocabulary unpadded), their AdamW moments and steps (trainable only)."""
    m = Stage(model_config(preset))
    out = {f"model.{v.fqn}": v.global_shape for n, t in m.state_dict().items() for v in m.views(n, t)}
    for n, p in m.named_parameters():
        if p.requires_grad:
            for v in m.views(n, p.detach()):
                out[f"optim.state.{v.fqn}.exp_avg"] = out[f"optim.state.{v.fqn}.exp_avg_sq"] = v.global_shape
                out[f"optim.state.{v.fqn}.step"] = ()
    return out


@pytest.mark.parametrize(("preset", "save", "load"), CASES, ids=[f"{p}:{s}->{t}" for p, s, t in CASES])
def test_next_step_parity(pool: WorkerPool, resume_pool: WorkerPool, tmp_path, preset: str,
                          save: str, load: str) -> None:
    rep = parity(save, load, preset=preset, steps_before=2, pool=pool, resume_pool=resume_pool,
                 workdir=str(tmp_path))
    print(rep.summary())
    assert rep.ok, rep.summary()
    assert rep.exact == (Layout.parse(save) == Layout.parse(load))
    assert rep.notes["loaded_step"] == 2
    assert set(rep.stats) == {"loss", "grad", "param", "exp_avg", "exp_avg_sq"}
    # the comparison saw every logical tensor: bert has 2 layers x 16 + 5 embedding + 5 head +
    # 2 pooler (frozen: weights only) tensors; llama 4 layers x 9 + 3
    n_grad = {"llama": 39, "bert": 42}[preset]
    assert rep.stats["grad"].tensors == n_grad and rep.stats["exp_avg"].tensors == n_grad
    m = reshard.inspect(rep.notes["checkpoint"])
    assert {k: tuple(e.global_shape) for k, e in m.tensors.items()} == _canonical(preset)
    assert m.aliases == {}


def test_same_layout_dropout_matters(pool: WorkerPool) -> None:
    """Dropout is really on: without it the step differs (so bit-exactness
    above is not vacuous), and masks do not depend on the layout (the
    dropout run itself matches across layouts, checked above)."""
    tc = TrainConfig()
    with_drop = assemble(pool.run(2, rank_continuous, model_config("llama"), tc, Layout(dp=2), 1))
    no_drop = assemble(pool.run(2, rank_continuous, model_config("llama", dropout=0.0, attn_dropout=0.0),
                                tc, Layout(dp=2), 1))
    assert not torch.equal(with_drop["loss/loss"], no_drop["loss/loss"])


LAYOUTS = [Layout(tp=t, pp=p, dp=d) for t in (1, 2, 4) for p in (1, 2, 3, 4) for d in (1, 2, 3, 4)
           if t * p * d <= 4]


@pytest.mark.parametrize("preset", ["bert", "llama"])
def test_every_layout_trains_like_one_rank(pool: WorkerPool, preset: str) -> None:
    """Every layout with tp in {1, 2, 4} and tp x pp x dp <= 4 runs (pp 3
    and 4, dp 3; pp 4 on the 2-layer bert leaves stages without layers) and
    its second step matches the single-rank run within the fp32 tolerance."""
    assert len(LAYOUTS) == 12
    tc = TrainConfig(global_batch=12, micro_batch=1)  # divisible by dp 1..4
    mc = model_config(preset)
    ref = assemble(pool.run(1, rank_continuous, mc, tc, Layout(), 2))
    for lay in LAYOUTS[1:]:
        got = assemble(pool.run(lay.world_size, rank_continuous, mc, tc, lay, 2))
        _, failures = compare(got, ref, exact=False)
        assert not failures, f"{preset} {lay}: {failures[:3]}"


def test_minilm_forward_is_the_real_model() -> None:
    """The imported bert preset computes what all-MiniLM-L6-v2 computes:
    mean-pooled, normalised embeddings put a paraphrase far above unrelated
    sentences (0.755 for the pair below, sentence-transformers' own value)."""
    from tokenizers import Tokenizer

    from reshard.demo.data import minilm_dir
    from reshard.demo.model import MicroBatch
    from reshard.formats.hf_import import import_hf

    m = Stage(model_config("bert", "full"))
    import_hf({"m": reshard.ModelState(m, layout=m.layout)}, str(minilm_dir()),
              allow_missing=[("m.cls.*", "keep")], transforms=[Rename(r"^", "m.")])
    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome.",
             "The stock market crashed today."]
    enc = tok.encode_batch(texts)
    ids = torch.tensor([e.ids for e in enc])
    att = torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        h = m(None, MicroBatch(list(range(4)), ids, att, ids, 0, 4), seed=0, training=False)
    emb = torch.nn.functional.normalize((h * att[..., None]).sum(1) / att.sum(1, keepdim=True), dim=-1)
    sim = emb @ emb.T
    assert abs(float(sim[0, 1]) - 0.7553) < 2e-3
    assert float(sim[0, 2].abs()) < 0.2 and float(sim[0, 3].abs()) < 0.2


def test_minilm_import_tp2_save_load_tp1_export(pool: WorkerPool, tmp_path) -> None:
    """The real all-MiniLM-L6-v2 file: all 104 tensors bit-identical after
    import at TP=2 (2 ranks), save, load at TP=1, and export_hf; the MLM
    decoder is tied to the word embeddings again; the head is exported too."""
    from safetensors import safe_open

    from reshard.demo.data import minilm_dir
    from reshard.formats.hf_export import export_hf

    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    saved = pool.run(2, fns.r_minilm_import_save, ckpt, timeout=180)
    for r in saved:
        assert r["bad"] == [] and len(r["checked"]) == 104
        assert set(r["missing"]) == {"model.cls.predictions.transform.dense.weight",
                                     "model.cls.predictions.transform.dense.bias",
                                     "model.cls.predictions.transform.LayerNorm.weight",
                                     "model.cls.predictions.transform.LayerNorm.bias",
                                     "model.cls.predictions.bias"}
    # TP=2 really sharded: fused qkv [3 * 384 / 2, 384], vocab split 15261 rows per rank
    shapes = saved[0]["shapes"]
    assert shapes["encoder.layer.0.attention.self.qkv.weight"] == (576, 384)
    assert shapes[TIED] == (15261, 384)
    m = reshard.inspect(ckpt)
    assert f"model.{TIED}" in m.tensors and "model.cls.predictions.decoder.weight" not in m.tensors
    assert len(m.tensors[f"model.{TIED}"].chunks) == 2
    (loaded,) = pool.run(1, fns.r_minilm_load_tp1, ckpt, timeout=180)
    assert loaded["n_file"] == 104 and loaded["bad"] == []
    assert loaded["tied"] and loaded["decoder_equals_file"]
    assert loaded["head_restored"] and all(loaded["head_restored"].values())
    # the model's own names: the "model" subtree's path left out (export_hf's default; and the
    # optimizer state)
    res = export_hf(ckpt, out)
    src = safe_open(str(minilm_dir() / "model.safetensors"), framework="pt")
    with safe_open(str(out / res.files[0]), framework="pt") as exp:
        names = set(exp.keys())
        assert set(src.keys()) <= names
        assert {f"model.{n}" for n in names - set(src.keys())} == set(saved[0]["missing"])
        for n in src.keys():
            assert fns.same_bits(exp.get_tensor(n), src.get_tensor(n)), n


def test_tie_on_one_rank_tensor_on_another_is_refused(pool: WorkerPool, tmp_path) -> None:
    """Regression: a name aliased on one rank (same memory as another name)
    but saved as a tensor of its own on another rank was published as both,
    its replicas never compared. Now a ShardingError on every rank; the
    trainer gives each scalar its own memory (which saves)."""
    got = pool.run(2, fns.r_step_scalar_ties, str(tmp_path / "tied"), False)
    assert [g[0] for g in got] == ["ShardingError"] * 2
    assert "optim.state.b.step" in got[0][1]
    assert pool.run(2, fns.r_step_scalar_ties, str(tmp_path / "own"), True) == [("ok", "")] * 2
    m = reshard.inspect(str(tmp_path / "own"))
    assert sorted(m.tensors) == [f"optim.state.{n}.step" for n in "abc"] and m.aliases == {}
