"""The template-free read (issue 27 point 4): ``reshard.read_state(path)``
returns a checkpoint saved by 2 gloo ranks as a nested dict of plain CPU
tensors and values on one process (no process group, or rank 0 alone inside
one), reads only the keys asked for, verifies checksums, refuses before
allocating past its memory limit, never unpickles, and reads DCP folders and
S3 URLs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import _read_state_fns as fns
import reshard
from reshard.loading import read_state as rs
from reshard.storage import LocalStorage
from reshard.testing.pool import WorkerPool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def saved(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("rs") / "step-00000003")
    ref = pool.run(2, fns.r_save_training_state, path)
    return {"path": path, "ref": ref}


def test_a_two_rank_checkpoint_as_a_nested_dict(saved: dict[str, Any]) -> None:
    ref = saved["ref"]
    out = reshard.read_state(saved["path"])
    assert sorted(out) == ["cfg", "emb", "model", "optim", "rng", "sched", "step", "zero"]
    assert out["step"] == 3 and out["cfg"] == {"name": "tiny", "dims": (6, 8, 6)}
    # the model's own state_dict() keys under its subtree: load_state_dict takes them as they are
    m = fns._model()
    m.load_state_dict(out["model"])
    for k, v in ref[0]["model"].items():
        assert torch.equal(out["model"][k], v), k
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in out["model"].values())
    # sharded across the ranks: whole again (rows, and a flat ZeRO range)
    assert torch.equal(out["emb"], ref[0]["emb"]) and torch.equal(out["zero"], ref[0]["zero"])
    assert out["zero"].dtype == torch.float64
    # optimizer moments by parameter name, hyperparameters per parameter
    for n, v in ref[0]["exp_avg"].items():
        assert torch.equal(out["optim"][f"state.{n}.exp_avg"], v), n
    assert out["optim"]["param_group.0.weight"]["lr"] == ref[0]["sched"]["_last_lr"][0]
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), 2)
    sched.load_state_dict(out["sched"])
    assert sched.state_dict() == ref[0]["sched"]
    # per-rank RNG streams: a grid of 2, in rank order
    streams = out["rng"]["streams"]
    assert isinstance(streams, list) and len(streams) == 2
    for r in (0, 1):
        assert torch.equal(streams[r]["torch"], ref[r]["torch_rng"])


def test_rank0_alone_inside_a_process_group(pool: WorkerPool, saved: dict[str, Any]) -> None:
    got = pool.run(2, fns.r_read_on_rank0_only, saved["path"], timeout=60)
    assert got[1] is None
    assert got[0] == {"keys": ["model", "step"], "model": ["0.bias", "0.weight", "2.bias", "2.weight"],
                      "step": 3}


class _Recording(LocalStorage):
    """The local file system, recording every read: (path, offset, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int, int]] = []

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        self.reads.append((path, offset, len(buf)))
        super().read_into(path, offset, buf)


def test_reads_only_what_it_returns(saved: dict[str, Any]) -> None:
    m = reshard.inspect(saved["path"])
    st = _Recording()
    out = reshard.read_state(saved["path"], keys="model", storage=st)
    assert list(out) == ["model"]
    # every byte read is the manifest, a byte of a selected chunk, or its file's block digests
    chunks = [c for k, te in m.tensors.items() if k.startswith("model.") for c in te.chunks]
    got = 0
    for path, off, n in st.reads:
        name = os.path.basename(path)
        if name == "manifest.json":
            continue
        fe = m.files[name]
        table = fe.size - 8 * fe.blocks
        if off >= table:
            continue
        # (adjacent small chunks are read as one span)
        mine = sum(max(0, min(off + n, c.offset + c.length) - max(off, c.offset)) for c in chunks if c.file == name)
        assert mine == n, f"read {name} [{off}, {off + n}) holds bytes of no selected chunk"
        got += n
    assert got == sum(c.length for c in chunks)
    # globs cross dots; a pattern selecting nothing is named
    out = reshard.read_state(saved["path"], keys=["optim.state.*.exp_avg", "step"])
    assert sorted(out["optim"]) == ["state.0.bias.exp_avg", "state.0.weight.exp_avg",
                                    "state.2.bias.exp_avg", "state.2.weight.exp_avg"]
    with pytest.raises(reshard.ShardingError, match="'modle' selects no saved key"):
        reshard.read_state(saved["path"], keys=["modle"])


def test_checksums_are_verified(saved: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "ck"
    shutil.copytree(saved["path"], path)
    m = reshard.inspect(path)
    c = m.tensors["model.0.weight"].chunks[0]
    with open(path / c.file, "r+b") as f:
        f.seek(c.offset + 5)
        b = f.read(1)
        f.seek(c.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(reshard.IntegrityError, match="checksum mismatch in 'model.0.weight'"):
        reshard.read_state(path)
    assert reshard.read_state(path, keys="emb")["emb"].shape == (8, 3)  # the rest still reads


def test_refuses_before_allocating(saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    st = _Recording()
    with pytest.raises(reshard.CheckpointError, match=r"more than 1000 bytes .*max_bytes.*nothing was allocated"):
        reshard.read_state(saved["path"], max_bytes=1000, storage=st)
    assert {os.path.basename(p) for p, _, _ in st.reads} == {"manifest.json"}  # no data byte was read
    empty = torch.empty
    calls: list[Any] = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: calls.append(a) or empty(*a, **k))
    # the default limit: 80 % of what the system reports available
    monkeypatch.setattr(rs, "available_memory", lambda: 2000)
    with pytest.raises(reshard.CheckpointError, match="80% of the 0 MiB the system reports available"):
        reshard.read_state(saved["path"])
    assert calls == []
    monkeypatch.setattr(rs, "available_memory", lambda: 1 << 30)
    assert reshard.read_state(saved["path"], keys="step") == {"step": 3}


class _Marker:
    """Unpickling it would create the file named by ``path`` (it must not happen)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_dcp_folder_nests_by_its_paths_and_nothing_is_unpickled(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    marker = tmp_path / "UNPICKLED"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "step": 6, "loader": {"blob": _Marker(str(marker))}},
                 checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(reshard.IntegrityError, match="loader.blob"):
        reshard.read_state(tmp_path / "dcp")
    out = reshard.read_state(tmp_path / "dcp", keys=["model", "optim", "step"])
    assert not marker.exists()
    assert sorted(out) == ["model", "optim", "step"] and out["step"] == 6
    assert torch.equal(out["model"]["0.weight"], m[0].weight)
    assert torch.equal(out["optim"]["state"]["1.bias"]["momentum_buffer"],
                       opt.state[m[1].bias]["momentum_buffer"])
    assert out["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    # converted to a native checkpoint: the same dict
    from reshard.formats.dcp_convert import convert_dcp

    with pytest.raises(reshard.IntegrityError):
        convert_dcp(tmp_path / "dcp", tmp_path / "conv")
    convert_dcp(tmp_path / "dcp", tmp_path / "conv", skip_unsafe_values=True)
    again = reshard.read_state(tmp_path / "conv")
    assert sorted(again) == sorted(out) and sorted(again["model"]) == sorted(out["model"])
    assert again["optim"]["param_groups"] == out["optim"]["param_groups"]
    assert not marker.exists()


def test_a_saved_optimizer_state_dict_comes_back_loadable(tmp_path: Path) -> None:
    """A dict as Lightning's CheckpointIO is given (a raw Optimizer.state_dict()
    in a list) reads back in torch's layout: int parameter ids, a list."""
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    ck = {"state_dict": m.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 1}
    reshard.save(ck, tmp_path / "lit", step=1)
    out = reshard.read_state(tmp_path / "lit")
    assert isinstance(out["optimizer_states"], list) and list(out["optimizer_states"][0]["state"]) == [0, 1]
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(out["optimizer_states"][0])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert out["epoch"] == 1 and torch.equal(out["state_dict"]["weight"], m.weight)


def test_s3_url(pool: WorkerPool, s3e: Any) -> None:
    url = s3e.url("rs") + "/step-00000003"
    ref = pool.run(2, fns.r_save_training_state, url, s3e.env)
    out = reshard.read_state(url, keys=["emb", "model.0.weight"])
    assert torch.equal(out["emb"], ref[0]["emb"])
    assert torch.equal(out["model"]["0.weight"], ref[0]["model"]["0.weight"])


def test_tied_weights_are_one_tensor(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    reshard.save({"model": reshard.ModelState(m)}, tmp_path / "tied", step=0)
    out = reshard.read_state(tmp_path / "tied")
    assert out["model"]["head.weight"] is out["model"]["emb.weight"]  # read once, tied as saved
    assert torch.equal(out["model"]["emb.weight"], m.emb.weight)
    alone = reshard.read_state(tmp_path / "tied", keys="model.head.weight")  # the alias alone
    assert list(alone["model"]) == ["head.weight"] and torch.equal(alone["model"]["head.weight"], m.emb.weight)
