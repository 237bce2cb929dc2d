"""Adapter checkpoints (issue 30 point 4, and the done-when's LoRA run) with
the ``peft`` package on real gloo ranks: a LoRA fine-tune of a small
transformers Llama saves through ModelState/OptimizerState as it is, the
frozen base once across 20 managed saves; ``trainable_only`` saves the
adapters and their moments with the base's identity, accepted on the same
base in another layout and refused on another in one line; LoRA weights and
their moments reshard by the stated rule from ``layout=`` and from DTensor
placements."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reshard
from _peft_fns import (
    expected_after_step,
    r_block_load,
    r_block_save,
    r_block_save_dtensor,
    r_lora_load,
    r_lora_run,
    r_rows_load,
)
from reshard.cli import main

pytest.importorskip("peft")

N = 2


def _stored(root: Path) -> int:
    seen: dict[tuple[int, int], int] = {}
    for c in root.iterdir():
        if (c / "manifest.json").exists():
            for p in c.glob("*.safetensors"):
                s = p.stat()
                seen[(s.st_dev, s.st_ino)] = s.st_size
    return sum(seen.values())


@pytest.mark.timeout(420)
def test_lora_twenty_saves_hold_the_base_once(pool: Any, tmp_path: Path) -> None:
    """The done-when: 20 managed saves of a LoRA run (rank 4 on all seven
    projections, AdamW, 2 DP ranks) with keep_last=3: the root holds the
    base's bytes once; every kept checkpoint verifies, loads bit for bit on
    one rank (another DP size) into a model whose base came from another
    seed, and into a row split over 2 ranks (another TP/FSDP layout);
    ``reshard ls`` shows each one's size and own bytes."""
    root = tmp_path / "lora"
    kept = pool.run(N, r_lora_run, str(root), 20, 3, 64 << 10, timeout=400.0)[0]
    names = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())
    assert names == ["step-00000018", "step-00000019", "step-00000020"]
    m = reshard.inspect(str(root / names[-1]))
    base = sum(c.length for fqn, te in m.tensors.items() if "lora_" not in fqn and fqn.startswith("model.")
               for c in te.chunks)
    logical = sum(reshard.inspect(str(root / n)).total_bytes for n in names)
    stored = _stored(root)
    assert base < stored < base + 3 * (logical / 3 - base) + (256 << 10), (base, stored, logical)
    assert stored < 1.5 * base < 2 * logical / 3  # the base once, not three times
    for n in names:
        path = str(root / n)
        assert reshard.verify(path).ok
        step = int(n.split("-")[1])
        got = pool.run(1, r_lora_load, path, timeout=120.0)[0]
        assert int(got["#step"]) == step
        for k, v in kept[step].items():
            assert torch.equal(got[k], v), (n, k)
        rows = pool.run(N, r_rows_load, path, timeout=120.0)
        full = pool.run(1, r_rows_load, path, timeout=120.0)[0]
        for k, whole in full.items():
            parts = [r[k] for r in rows]
            joined = torch.cat(parts) if parts[0].shape != whole.shape else parts[0]
            assert torch.equal(joined, whole), (n, k)
        lora = [k for k in full if "lora_A" in k and k.startswith("model.")]
        assert lora and torch.equal(full[lora[0]], kept[step][lora[0][len("model."):]])
    r = CliRunner().invoke(main, ["ls", str(root)])
    assert r.exit_code == 0, r.output
    assert " own " in r.output and "stored" in r.output
    for n in names:
        row = next(ln for ln in r.output.splitlines() if n in ln and "step" not in ln.split()[0])
        assert "KiB" in row, row  # each holds its adapters alone; the base is shared


@pytest.mark.timeout(300)
def test_trainable_only_and_the_base_identity(pool: Any, tmp_path: Path) -> None:
    """``ModelState(trainable_only=True)`` saves the LoRA weights and their
    moments only, with the base's identity: saved at TP=2 it resumes at TP=1
    onto the same base (the identity does not depend on the layout) with
    every weight and moment bit for bit; onto a base of other values or
    another dtype it is refused on every rank, in one line naming the tensor
    and what differs, and nothing is written."""
    path = str(tmp_path / "adapters")
    assert all(pool.run(N, r_block_save, path, True, timeout=120.0))
    m = reshard.inspect(path)
    assert sorted(m.tensors) == sorted(
        f"{k}.{n}" for k in ("model.base_model.model.col", "model.base_model.model.row")
        for n in ("lora_A.default.weight", "lora_B.default.weight")) + sorted(
        f"optim.state.base_model.model.{k}.lora_{ab}.default.weight.{mom}"
        for k in ("col", "row") for ab in "AB" for mom in ("exp_avg", "exp_avg_sq", "step"))
    assert "model._reshard_base" in m.values
    want = expected_after_step()
    got = pool.run(1, r_block_load, path, True, timeout=120.0)[0]
    assert "error" not in got, got
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for seed, dtype, what in ((5, "float32", "other values than the saved base's"),
                              (0, "bfloat16", "dtype bfloat16, the saved base's float32")):
        outs = pool.run(N, r_block_load, path, True, seed, dtype, timeout=120.0)
        for o in outs:
            assert "error" in o, o
            # every rank refused for the same reason: one agreed line naming it
            line = o["error"].splitlines()[-1]
            assert "ranks 0-1" in line and "trained on another base" in line, o["error"]
            assert what in line and "base_layer.weight" in line, o["error"]
    full = str(tmp_path / "full")
    assert all(pool.run(N, r_block_save, full, False, timeout=120.0))
    assert any("base_layer" in k for k in reshard.inspect(full).tensors)
    got = pool.run(1, r_block_load, full, False, timeout=120.0)[0]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.timeout(300)
def test_lora_reshards_by_the_rule(pool: Any, tmp_path: Path) -> None:
    """LoRA weights and AdamW moments saved at TP=2 (column-parallel base: B
    split along out, A replicated; row-parallel: A split along in, B
    replicated) load at TP=1 equal, bit for bit, to the unsharded run's after
    the same step, whether the layout came from ``layout=``
    (:func:`reshard.adapters.peft.lora_layout`) or from DTensor placements
    (:func:`reshard.adapters.peft.distribute_lora`); and back at TP=2."""
    want = expected_after_step()
    manual = str(tmp_path / "manual")
    assert all(pool.run(N, r_block_save, manual, False, timeout=120.0))
    dtensor = str(tmp_path / "dtensor")
    assert all(pool.run(N, r_block_save_dtensor, dtensor, timeout=120.0))
    m = reshard.inspect(dtensor)
    b = m.tensors["model.base_model.model.col.lora_B.default.weight"]
    assert len(b.chunks) == 2  # split along out, one chunk per TP rank
    a = m.tensors["model.base_model.model.row.lora_A.default.weight"]
    assert [c.global_offset for c in a.chunks] == [(0, 0), (0, 16)]  # split along in
    for path in (manual, dtensor):
        got = pool.run(1, r_block_load, path, False, timeout=120.0)[0]
        for k, v in want.items():
            assert torch.equal(got[k], v), (path, k)
    # and from TP=1 to TP=2: each rank gets its slices by the rule
    one = str(tmp_path / "one")
    assert all(pool.run(1, r_block_save, one, False, timeout=120.0))
    outs = pool.run(N, r_block_load, one, False, timeout=120.0)
    col_b = "base_model.model.col.lora_B.default.weight"
    row_a = "base_model.model.row.lora_A.default.weight"
    for rank, o in enumerate(outs):
        assert torch.equal(o[col_b], want[col_b][rank * 16:(rank + 1) * 16])
        assert torch.equal(o[f"{row_a}#exp_avg"], want[f"{row_a}#exp_avg"][:, rank * 16:(rank + 1) * 16])
        assert torch.equal(o["base_model.model.col.lora_A.default.weight"],
                           want["base_model.model.col.lora_A.default.weight"])


def test_peft_model_through_torchstate(tmp_path: Path) -> None:
    """A PEFT model saves through TorchState as it is and loads back."""
    from _peft_fns import _opt, _step, _trained, llama

    pm = llama()
    opt = _opt(pm)
    _step(pm, opt, 1)
    reshard.save({"app": reshard.TorchState(pm, opt)}, str(tmp_path / "t"))
    pm2 = llama(seed=3)
    opt2 = _opt(pm2)
    reshard.load({"app": reshard.TorchState(pm2, opt2)}, str(tmp_path / "t"))
    a, b = _trained(pm, opt), _trained(pm2, opt2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(pm.state_dict().values(), pm2.state_dict().values(),
                                                 strict=True))
    os.environ.pop("RESHARD_PROGRESS", None)
