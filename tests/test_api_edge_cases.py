"""Contract details of DESIGN.md section 2 that a new user relies on (found by a
fresh user trying to break reshard)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import reshard
from _manifest_doc import write_manifest_doc
from reshard.errors import CoverageError, IntegrityError, ShardingError


def test_public_names() -> None:
    for name in ("ShardedTensor", "ShardedObject", "save", "async_save", "load", "latest", "inspect",
                 "verify", "CheckpointManager", "SaveOptions", "LoadOptions", "ModelState",
                 "OptimizerState", "RNGState", "DataCursor", "CheckpointError",
                 "CheckpointNotFoundError", "ManifestError", "ShardingError", "IntegrityError",
                 "StorageError"):
        assert hasattr(reshard, name), name
    assert issubclass(reshard.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(reshard.ShardingError, ValueError)


def test_parameter_leaf_is_filled_in_place(tmp_path: Path) -> None:
    w = nn.Parameter(torch.arange(6.0).reshape(2, 3))
    reshard.save({"w": w}, tmp_path / "c")
    target = nn.Parameter(torch.zeros(2, 3))
    reshard.load({"w": target}, tmp_path / "c")
    assert torch.equal(target.detach(), w.detach()) and target.requires_grad


@pytest.mark.parametrize("step", [np.int64(5), torch.tensor(5), 5])
def test_integer_like_steps_are_recorded_as_int(tmp_path: Path, step: object) -> None:
    r = reshard.save({"w": torch.ones(1)}, tmp_path / "c", step=step)
    assert r.step == 5 and reshard.inspect(tmp_path / "c").step == 5


@pytest.mark.parametrize("step", ["5", True, 5.0])
def test_bad_steps_are_refused_before_any_write(tmp_path: Path, step: object) -> None:
    with pytest.raises(TypeError, match="step must be an int"):
        reshard.save({"w": torch.ones(1)}, tmp_path / "c", step=step)
    assert not tmp_path.joinpath("c").exists() and list(tmp_path.iterdir()) == []


def test_latest_of_a_url_root_is_loadable() -> None:
    from reshard.storage import clear_memory_storage

    clear_memory_storage()
    reshard.save({"w": torch.ones(2)}, "memory://bucket/run/step-1", step=1)
    reshard.save({"w": torch.full((2,), 2.0)}, "memory://bucket/run/step-2", step=2)
    path = reshard.latest("memory://bucket/run")
    assert path == "memory://bucket/run/step-2"
    t = torch.zeros(2)
    reshard.load({"w": t}, path)
    assert torch.equal(t, torch.full((2,), 2.0))


def test_declared_shape_larger_than_the_data_is_a_coverage_error(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(3, 4)}, tmp_path / "c")
    mpath = tmp_path / "c" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["tensors"]["w"]["global_shape"] = [6, 4]
    write_manifest_doc(mpath, m)
    with pytest.raises(CoverageError, match="chunks hold 12 elements") as ei:
        reshard.load({"w": torch.zeros(6, 4)}, tmp_path / "c")
    assert isinstance(ei.value, IntegrityError) and isinstance(ei.value, ShardingError)


def test_verify_decodes_common_values(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(1), "cfg": {"a": 1}}, tmp_path / "c")
    mpath = tmp_path / "c" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["values"]["cfg"] = {"$pickle": "Y29zCnN5c3RlbQo="}
    write_manifest_doc(mpath, m)
    rep = reshard.verify(tmp_path / "c")
    assert not rep.ok and any("value 'cfg'" in p and "unknown tag" in p for p in rep.problems)


def r_plain_on_rank0_only(path: str) -> str:
    import torch.distributed as dist

    state = {"w": torch.ones(2)} if dist.get_rank() == 0 else {}
    try:
        reshard.save(state, path)
    except ShardingError as e:
        return str(e)
    return "saved"


def test_plain_tensor_held_by_one_rank_only_is_refused(pool, tmp_path: Path) -> None:
    out = pool.run(2, r_plain_on_rank0_only, str(tmp_path / "c"))
    for msg in out:
        assert "<tensor>w" in msg and "every rank" in msg
    assert not (tmp_path / "c").exists()


def test_hmac_signed_manifest(tmp_path: Path) -> None:
    key = b"secret-key"
    reshard.save({"w": torch.arange(4.0)}, tmp_path / "c", options=reshard.SaveOptions(hmac_key=key))
    t = torch.zeros(4)
    reshard.load({"w": t}, tmp_path / "c", options=reshard.LoadOptions(hmac_key=key))
    assert torch.equal(t, torch.arange(4.0))
    with pytest.raises(IntegrityError, match="HMAC does not match"):
        reshard.load({"w": t}, tmp_path / "c", options=reshard.LoadOptions(hmac_key=b"other"))
    # a tampered manifest (same data, another step) fails the signature
    mpath = tmp_path / "c" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["step"] = 99
    write_manifest_doc(mpath, m)
    with pytest.raises(IntegrityError, match="HMAC does not match"):
        reshard.load({"w": t}, tmp_path / "c", options=reshard.LoadOptions(hmac_key=key))
    # an unsigned checkpoint is refused when a key is given
    reshard.save({"w": torch.ones(4)}, tmp_path / "u")
    with pytest.raises(IntegrityError, match="not signed"):
        reshard.load({"w": t}, tmp_path / "u", options=reshard.LoadOptions(hmac_key=key))


def test_save_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "precious.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(reshard.CheckpointError, match="not a committed checkpoint"):
            reshard.save({"w": torch.ones(1)}, tmp_path / "x",
                         options=reshard.SaveOptions(overwrite=overwrite))
    assert (tmp_path / "x" / "precious.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()  # an empty directory made for the checkpoint is fine
    reshard.save({"w": torch.ones(1)}, tmp_path / "empty")
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_export_refuses_to_write_into_the_checkpoint_or_cast_to_ints(tmp_path: Path) -> None:
    from reshard.formats.hf_export import export_hf

    reshard.save({"w": torch.ones(2, 2)}, tmp_path / "ck")
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export_hf(tmp_path / "ck", tmp_path / "ck" / "hf")
    with pytest.raises(ValueError, match="floating-point"):
        export_hf(tmp_path / "ck", tmp_path / "hf", dtype=torch.int32)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["data-r00000-0.safetensors",
                                                                   "manifest.json", "plan.bin"]


def test_hf_import_refuses_overlapping_data_offsets(tmp_path: Path) -> None:
    import struct

    from reshard.errors import ManifestError
    from reshard.formats.hf_import import import_hf

    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "c": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}  # c aliases a's bytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(ManifestError, match="overlaps the previous tensor"):
        import_hf({"a": torch.zeros(2), "c": torch.zeros(2)}, tmp_path / "hf")


def test_demo_refuses_settings_it_cannot_honour_before_touching_anything(tmp_path: Path) -> None:
    from reshard.demo.job import DemoConfig, run_demo

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "precious.txt").write_text("x")
    for kw, msg in (({"kill_at": 10}, "kill_at a multiple of every"),
                    ({"seq_len": 64}, "exceeds the bert"),
                    ({"layout_a": "tp3"}, "tp 3 must divide"),
                    ({"global_batch": 1}, "multiple of dp 2"),
                    ({}, "not demo checkpoints")):
        base = dict(out=tmp_path, size="tiny", data="random", steps=7, every=2, kill_at=4,
                    seq_len=16)
        cfg = DemoConfig(**{**base, **kw})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=msg):
            run_demo(cfg)
    assert (tmp_path / "ckpt" / "precious.txt").exists()
