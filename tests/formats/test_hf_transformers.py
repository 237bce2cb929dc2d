"""transformers as the judge of an export: tiny GPT-2 (tied) and Llama (tied
and untied) models built from configs, trained a step with FSDP2 on 2 gloo
ranks, saved by reshard under each common layout of a training state
(``{"model": TorchState}``, ``{"model": ModelState, "optim":
OptimizerState}``, the DCP tutorial's ``{"app": AppState}``, a plain
``model.state_dict()``), exported with the default flags and loaded by
``from_pretrained``: no missing, unexpected or mismatched key, and logits
bitwise equal to those of the trained model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from reshard.cli import main
from reshard.formats.hf_export import export_hf

pytest.importorskip("transformers")

import _hf_fns as fns  # noqa: E402

CASES = [("gpt2", True), ("llama", True), ("llama", False)]


@pytest.fixture(scope="module")
def trained(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    out = {}
    for kind, tied in CASES:
        root = tmp_path_factory.mktemp(f"{kind}-{'tied' if tied else 'untied'}")
        pool.run(2, fns.train_and_save, kind, tied, str(root), timeout=300)
        out[(kind, tied)] = root
    return out


def _reference(kind: str, tied: bool, root: Path) -> torch.nn.Module:
    """The trained model, unsharded: its full state dict loaded strictly."""
    m = fns.build(kind, tied, seed=1)
    m.load_state_dict(torch.load(root / "full.pt"), strict=True)
    return m.eval()


def _logits(m: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=fns.batch(7)).logits


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,tied", CASES, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in CASES])
def test_default_export_loads_exactly_in_transformers(trained: dict[tuple[str, bool], Path], tmp_path: Path,
                                                      kind: str, tied: bool) -> None:
    root = trained[(kind, tied)]
    want = _logits(_reference(kind, tied, root))
    cfg = root / "config" / "config.json"
    for layout in fns.LAYOUTS:
        out = tmp_path / layout
        if layout == "torchstate":  # the command with its defaults
            r = CliRunner().invoke(main, ["export", str(root / layout), str(out), "--copy", str(cfg)])
            assert r.exit_code == 0, r.output
            assert "optim" not in r.output.split("skipped")[0]
        else:
            res = export_hf(root / layout, out, copy_files=[cfg])
            assert not any("exp_avg" in k or k.startswith(("optim", "model.model", "app.")) for k in res.weight_map)
        names = set(json.loads((out / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
            (out / "model.safetensors").read_bytes()[:8], "little")]))
        assert not any("exp_avg" in n or "optim" in n or "step" == n for n in names), (layout, sorted(names))
        got, info = fns.model_class(kind).from_pretrained(str(out), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (layout, info)
        assert not info["mismatched_keys"] and not info["error_msgs"], (layout, info)
        assert torch.equal(_logits(got.eval()), want), layout
        if tied:
            assert got.lm_head.weight is got.get_input_embeddings().weight


@pytest.mark.timeout(300)
def test_export_dtype_rewrites_the_copied_config(trained: dict[tuple[str, bool], Path], tmp_path: Path) -> None:
    root = trained[("llama", False)]
    out = tmp_path / "bf16"
    r = CliRunner().invoke(main, ["export", str(root / "model_optim"), str(out), "--dtype", "bf16",
                                  "--copy", str(root / "config" / "config.json")])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg.get("torch_dtype", "bfloat16") == "bfloat16"
    got = fns.model_class("llama").from_pretrained(str(out))  # dtype from the config
    assert got.dtype == torch.bfloat16
    ref = _reference("llama", False, root)
    for name, p in got.state_dict().items():
        assert torch.equal(p, ref.state_dict()[name].to(torch.bfloat16)), name
    # the source config is untouched
    assert json.loads((root / "config" / "config.json").read_text()).get("dtype") in (None, "float32")
    assert os.path.isfile(out / "model.safetensors")


IMPORT_CASES = [("gpt2", True), ("llama", False)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,tied", IMPORT_CASES, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in IMPORT_CASES])
def test_save_pretrained_imports_strictly_and_training_resumes(pool: Any, tmp_path: Path, kind: str,
                                                               tied: bool) -> None:
    """``save_pretrained`` (sharded; the tied lm_head left out, the tie only in
    config.json) imported with ``strict=True`` into TorchState and into
    ModelState + OptimizerState on 1 rank, and into one of them on 2 FSDP2
    ranks: every weight
    equal, the tie kept, the optimizer as constructed, then a training step
    equal to that of the saved model trained from the same fresh optimizer."""
    hf = tmp_path / "hf"
    fns.save_pretrained(kind, tied, str(hf))
    assert len(list(hf.glob("model-*.safetensors"))) > 1
    assert "lm_head.weight" not in json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"] or not tied
    ref = fns.build(kind, tied)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want_loss = fns.train_step(ref, ref_opt, 0)
    for layout in ("torchstate", "model_optim"):
        one = fns.import_and_resume(kind, tied, str(hf), layout, False)
        assert not one["missing"] and not one["unexpected"], (layout, one["missing"], one["unexpected"])
        assert one["same"] and one["tie_ok"] and one["fresh_optimizer"], layout
        assert one["loss"] == want_loss, layout  # bitwise: same weights, same fresh AdamW
        for n, p in ref.named_parameters():
            assert torch.equal(one["after"][n], p.detach()), (layout, n)
    # on 2 FSDP2 ranks (one layout per model, to keep the suite short)
    layout = "torchstate" if kind == "gpt2" else "model_optim"
    two = pool.run(2, fns.import_and_resume, kind, tied, str(hf), layout, True, timeout=300)
    for r in two:
        assert not r["missing"] and not r["unexpected"] and r["same"] and r["tie_ok"], layout
        assert r["fresh_optimizer"]
        assert abs(r["loss"] - want_loss) < 1e-5, layout  # FSDP2 reduces gradients across ranks
    for n, p in ref.named_parameters():
        torch.testing.assert_close(two[0]["after"][n], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_convert_from_hf_keeps_the_config_tie(tmp_path: Path, kind: str) -> None:
    """``reshard convert --from hf`` of a tied ``save_pretrained`` directory
    (sharded; lm_head left out, the tie only in config.json) takes the tie as
    ``import_hf`` does: exit 0, the tie recorded as a manifest alias, and a
    strict load into a fresh tied model gives the saved model's logits."""
    import reshard
    from reshard.ondisk.committed import read_manifest
    from reshard.storage import resolve
    from reshard.transforms import Rename

    hf, out = tmp_path / "hf", tmp_path / "ck"
    fns.save_pretrained(kind, True, str(hf))
    res = CliRunner().invoke(main, ["convert", "--from", "hf", str(hf), str(out)])
    assert res.exit_code == 0, res.output
    m = read_manifest(*resolve(str(out)))
    emb = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    assert m.aliases == {"lm_head.weight": emb} and "lm_head.weight" not in m.tensors
    fresh = fns.build(kind, True, seed=3)
    got = reshard.load({"model": reshard.ModelState(fresh)}, str(out), transforms=[Rename(r"^", "model.")])
    assert not got.missing and not got.unexpected
    assert fresh.get_input_embeddings().weight is fresh.lm_head.weight
    assert torch.equal(_logits(fresh.eval()), _logits(fns.build(kind, True).eval()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,tied", [("llama", False), ("gpt2", True)], ids=["llama-untied", "gpt2-tied"])
def test_export_of_a_wrapped_models_state_dict_uses_the_models_own_names(pool: Any, tmp_path: Path, kind: str,
                                                                         tied: bool) -> None:
    """A plain ``state_dict()`` of a DDP-wrapped, ``torch.compile``d (or both)
    model, saved as ``{"model": sd}``: the default export writes the unwrapped
    model's names (no ``module.`` / ``_orig_mod.``), and ``from_pretrained``
    loads it with no missing or unexpected key, logits bitwise equal."""
    pool.run(1, fns.save_wrapped, kind, tied, str(tmp_path), timeout=120)
    want = _logits(fns.build(kind, tied).eval())
    for w in fns.WRAPPERS:
        out = tmp_path / f"{w}-hf"
        res = CliRunner().invoke(main, ["export", str(tmp_path / w), str(out), "--copy",
                                        str(tmp_path / "config" / "config.json")])
        assert res.exit_code == 0, (w, res.output)
        got, info = fns.model_class(kind).from_pretrained(str(out), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (w, info)
        assert torch.equal(_logits(got.eval()), want), w


@pytest.mark.parametrize("app", [False, True], ids=["model-optim", "appstate"])
def test_export_reads_a_dcp_folder(tmp_path: Path, app: bool) -> None:
    """``reshard export`` of a PyTorch DCP folder (``dcp.save`` of
    ``get_state_dict`` after an AdamW step; as ``{"model", "optim"}`` or under
    an ``"app"`` key): exit 0, no optimizer state written, the shared prefix
    stripped; ``from_pretrained`` loads it with no missing or unexpected key,
    logits bitwise equal to the saved model's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fns.build("llama", False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fns.train_step(model, opt, 0)
    if app:  # the DCP tutorial's AppState
        dcp.save({"app": fns.AppState(model, opt)}, checkpoint_id=str(tmp_path / "dcp"))
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    model.config.save_pretrained(str(tmp_path / "config"))
    out = tmp_path / "hf"
    res = CliRunner().invoke(main, ["export", str(tmp_path / "dcp"), str(out), "--copy",
                                    str(tmp_path / "config" / "config.json")])
    assert res.exit_code == 0, res.output
    got, info = fns.model_class("llama").from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(_logits(got.eval()), _logits(model.eval()))
