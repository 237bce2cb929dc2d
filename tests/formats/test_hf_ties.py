"""Hugging Face round trip with tied weights (issue 10 item 3, case 3): export
writes the model's own parameter names (the container path stripped; an
option names the subtree), leaves the tied copy out as ``save_pretrained``
does and records the tie; import restores it."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

import reshard
from reshard.cli import main
from reshard.formats.hf_export import INDEX_NAME, SINGLE_NAME, AmbiguousModelError, export_hf
from reshard.formats.hf_import import hf_manifest, import_hf
from reshard.testing.pool import WorkerPool

V, D = 11, 4


class Tied(nn.Module):
    def __init__(self, seed: int, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def r_save_tied(path: str) -> None:
    """Two gloo ranks save the same (replicated) tied model and an EMA copy."""
    reshard.save({"model": reshard.ModelState(Tied(0)), "ema": reshard.ModelState(Tied(5)),
                  "step": 3}, path, step=3)


@pytest.fixture(scope="module")
def ckpt(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("hf") / "ck"
    pool.run(2, r_save_tied, str(p))
    return p


def _file_meta(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])["__metadata__"]


def test_export_writes_own_names_and_leaves_the_tied_copy_out(ckpt: Path, tmp_path: Path) -> None:
    assert reshard.inspect(ckpt).aliases == {"model.head.weight": "model.emb.weight",
                                              "ema.head.weight": "ema.emb.weight"}
    # two models: the export does not guess which one (the CLI exits 2 with this line)
    with pytest.raises(AmbiguousModelError, match="candidates: 'ema', 'model'.*--subtree"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    r = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "hf")])
    assert r.exit_code == 2 and "candidates: 'ema', 'model'" in r.output and "--subtree" in r.output
    res = export_hf(ckpt, tmp_path / "hf", subtree="model")
    assert sorted(res.weight_map) == ["emb.weight", "norm.bias", "norm.weight"]  # "model." stripped
    assert res.aliases == {"head.weight": "emb.weight"}
    assert json.loads(_file_meta(tmp_path / "hf" / SINGLE_NAME)["tied_weights"]) == {
        "head.weight": "emb.weight"}
    with safe_open(str(tmp_path / "hf" / SINGLE_NAME), framework="pt") as f:
        assert sorted(f.keys()) == ["emb.weight", "norm.bias", "norm.weight"]
        assert torch.equal(f.get_tensor("emb.weight"), Tied(0).emb.weight.detach())
    # the other subtree, by name; sharded: the tie is in the index metadata too
    res = export_hf(ckpt, tmp_path / "ema", subtree="ema", max_shard_bytes=V * D * 4)
    idx = json.loads((tmp_path / "ema" / INDEX_NAME).read_text())
    assert idx["metadata"]["tied_weights"] == {"head.weight": "emb.weight"}
    assert sorted(idx["weight_map"]) == ["emb.weight", "norm.bias", "norm.weight"]
    with safe_open(str(tmp_path / "ema" / idx["weight_map"]["emb.weight"]), framework="pt") as f:
        assert torch.equal(f.get_tensor("emb.weight"), Tied(5).emb.weight.detach())
    # the whole checkpoint, names as saved
    res = export_hf(ckpt, tmp_path / "all", subtree="")
    assert "model.emb.weight" in res.weight_map and "ema.emb.weight" in res.weight_map
    with pytest.raises(ValueError, match="no tensor under 'nope'"):
        export_hf(ckpt, tmp_path / "x", subtree="nope")


@pytest.mark.parametrize("sharded", [False, True])
def test_import_restores_the_tie(ckpt: Path, tmp_path: Path, sharded: bool) -> None:
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_bytes=V * D * 4 if sharded else 1 << 30, subtree="model")
    assert hf_manifest(out)[2].aliases == {"head.weight": "emb.weight"}
    m = Tied(9)  # tied, other values
    res = import_hf({"model": reshard.ModelState(m)}, out, subtree="model")  # strict
    assert not res.missing and not res.unexpected
    ref = Tied(0)
    assert torch.equal(m.emb.weight, ref.emb.weight) and torch.equal(m.norm.weight, ref.norm.weight)
    assert m.head.weight is m.emb.weight  # still the same tensor
    # into an untied model: the copy is filled from its target
    u = Tied(9, tie=False)
    import_hf({"model": reshard.ModelState(u)}, out, subtree="model")
    assert torch.equal(u.head.weight, ref.emb.weight) and u.head.weight is not u.emb.weight



def _s3_bytes(s3e: Any, url: str, name: str) -> bytes:
    prefix = url.split("/", 3)[3]
    return bytes(s3e.server.client().get_object(Bucket=s3e.bucket, Key=f"{prefix}/{name}")["Body"].read())


def _header_of(raw: bytes) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("sharded", [False, True])
def test_export_to_s3_records_the_tie_as_the_local_export_does(ckpt: Path, tmp_path: Path,
                                                                s3e: Any, sharded: bool) -> None:
    """The object-store export path wrote its shard headers (and its index)
    without ``tied_weights``, so an import from S3 could not restore the tie."""
    shard = V * D * 4 if sharded else 1 << 30
    local = export_hf(ckpt, tmp_path / "hf", max_shard_bytes=shard, subtree="model")
    url = s3e.url("hf-tied")
    remote = export_hf(ckpt, url, max_shard_bytes=shard, subtree="model")
    assert remote.files == local.files and remote.aliases == local.aliases == {"head.weight": "emb.weight"}
    for name in local.files:  # byte for byte: header (tied_weights included) and data
        raw = _s3_bytes(s3e, url, name)
        assert _header_of(raw) == _header_of((tmp_path / "hf" / name).read_bytes())
        assert json.loads(_header_of(raw)["__metadata__"]["tied_weights"]) == {"head.weight": "emb.weight"}
        assert raw == (tmp_path / "hf" / name).read_bytes()
    if sharded:
        idx = json.loads(_s3_bytes(s3e, url, INDEX_NAME))
        assert idx == json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
        assert idx["metadata"]["tied_weights"] == {"head.weight": "emb.weight"}


def test_model_only_import_is_strict_about_weights_only(ckpt: Path, tmp_path: Path) -> None:
    """A Hugging Face directory holds weights alone: a strict import into
    TorchState / OptimizerState asks it for no optimizer state or objects
    (the optimizers stay as constructed), but a weight really absent is
    still missing."""
    from reshard.adapters.torch_native import TorchState

    out = tmp_path / "hf"
    export_hf(ckpt, out, subtree="model")
    m = Tied(9)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    res = import_hf({"model": TorchState(m, opt)}, out, subtree="model.model")  # strict
    assert not res.missing and not res.unexpected and not opt.state
    assert torch.equal(m.emb.weight, Tied(0).emb.weight) and m.head.weight is m.emb.weight
    m2 = Tied(9)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    res = import_hf({"model": reshard.ModelState(m2), "optim": reshard.OptimizerState(m2, opt2)}, out,
                    subtree="model")
    assert not res.missing and torch.equal(m2.norm.bias, Tied(0).norm.bias) and not opt2.state
    # a weight that is not there: still an error under strict
    part = tmp_path / "part"
    export_hf(ckpt, part, subtree="model", include=["emb.*"])
    m3 = Tied(9)
    with pytest.raises(reshard.CheckpointError, match=r"missing from the checkpoint: .*norm\.weight"):
        import_hf({"model": TorchState(m3, torch.optim.AdamW(m3.parameters()))}, part, subtree="model.model")


def test_tie_from_config_json(tmp_path: Path) -> None:
    """save_pretrained leaves the tied lm_head out and records the tie only in
    config.json (tie_word_embeddings): the import restores it from there."""
    from safetensors.torch import save_file

    from reshard.formats.hf_import import config_ties, hf_manifest

    emb = torch.randn(V, D)
    save_file({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(D)},
              str(tmp_path / SINGLE_NAME))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert hf_manifest(tmp_path)[2].aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert hf_manifest(tmp_path)[2].aliases == {}
    st, key, m = hf_manifest(tmp_path)
    assert config_ties(st, key, m.tensors) == {}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # transformers' default: tied
    lm = torch.zeros(V, D)
    res = import_hf({"model.embed_tokens.weight": torch.zeros(V, D), "model.norm.weight": torch.zeros(D),
                     "lm_head.weight": lm}, tmp_path)
    assert not res.missing and torch.equal(lm, emb)


def test_base_model_config_implies_no_tie(tmp_path: Path) -> None:
    """A base model's directory (config.json architectures ``BertModel``, the
    sentence-transformers layout: no LM head, tie_word_embeddings left at its
    default) implies no lm_head tie: a strict import into the base model
    succeeds (an implied ``lm_head.weight`` made it 'unexpected'), while the
    same weights named by an LM-head class are tied."""
    from safetensors.torch import save_file

    from reshard.formats.hf_import import hf_manifest

    emb = torch.randn(V, D)
    save_file({"embeddings.word_embeddings.weight": emb, "pooler.dense.bias": torch.ones(D)},
              str(tmp_path / SINGLE_NAME))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    assert hf_manifest(tmp_path)[2].aliases == {}
    dst = {"embeddings.word_embeddings.weight": torch.zeros(V, D), "pooler.dense.bias": torch.zeros(D)}
    res = import_hf(dst, tmp_path)
    assert not res.missing and not res.unexpected and torch.equal(dst["embeddings.word_embeddings.weight"], emb)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert hf_manifest(tmp_path)[2].aliases == {"lm_head.weight": "embeddings.word_embeddings.weight"}
