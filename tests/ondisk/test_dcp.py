"""DCP import (reshard.ondisk.dcp): an FSDP2 + AdamW state saved by
torch.distributed.checkpoint on 4 gloo ranks, read by reshard on 2 ranks
directly and after conversion; crafted pickles refused with nothing executed
(DESIGN.md section 3, cases/README.md case 10)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import _dcp_fns as fns
import reshard
from reshard.cli import main as cli_main
from reshard.formats.dcp_convert import convert_dcp
from reshard.ondisk.dcp import DCP_METADATA, open_dcp, read_dcp_metadata
from reshard.state.sharding import dtype_name
from reshard.testing.pool import WorkerPool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def fsdp2_dcp(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("dcp") / "fsdp2")
    ref = pool.run(4, fns.r_fsdp2_dcp_save, path, timeout=120.0)[0]
    shapes = {k: (tuple(t.shape), dtype_name(t.dtype)) for k, t in ref["tensors"].items()}
    return {"path": path, "expected": ref["tensors"], "param_groups": ref["param_groups"],
            "shapes": shapes}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_rows(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    expected = ref["expected"]
    for r in results:
        assert r["values"]["optim.param_groups"] == ref["param_groups"]
        for fqn, (a, b, t) in r["pieces"].items():
            want = expected[fqn] if expected[fqn].dim() == 0 else expected[fqn][a:b]
            assert t.dtype == want.dtype and t.shape == want.shape, fqn
            assert _bits(t) == _bits(want), f"{fqn} rows [{a}, {b}) differ"
    # every row of every tensor was loaded by some rank
    for fqn, t in expected.items():
        if t.dim():
            covered = sorted((a, b) for r in results for f, (a, b, _) in r["pieces"].items() if f == fqn)
            assert covered[0][0] == 0 and covered[-1][1] == t.shape[0]


def test_fsdp2_dcp_4_ranks_loads_into_2(pool: WorkerPool, fsdp2_dcp: dict[str, Any]) -> None:
    # the fixture's checkpoint is a genuine DCP directory with uneven and empty shards
    md = read_dcp_metadata(fsdp2_dcp["path"])
    chunks = md.state_dict_metadata["model.fc2.weight"].chunks
    assert [tuple(c.sizes) for c in chunks] == [(1, 10), (1, 10), (1, 10), (0, 10)]
    assert not (Path(fsdp2_dcp["path"]) / "manifest.json").exists()
    results = pool.run(2, fns.r_load_rows, fsdp2_dcp["path"], fsdp2_dcp["shapes"])
    _check_rows(results, fsdp2_dcp)
    assert {"model.fc1.weight", "optim.state.fc1.weight.exp_avg_sq",
            "optim.state.fc2.bias.step"} <= set(fsdp2_dcp["shapes"])


def test_open_dcp_manifest_and_bounded_cache(fsdp2_dcp: dict[str, Any]) -> None:
    st, m = open_dcp(fsdp2_dcp["path"], cache_bytes=200)  # chunks here are 4 to 96 bytes
    assert m.world_size == 4 and m.extra["source"] == "dcp"
    assert all(not c.checksums for te in m.tensors.values() for c in te.chunks)
    te = m.tensors["model.fc1.weight"]
    assert te.dtype == "float32" and te.global_shape == (10, 8)
    assert [c.local_shape for c in te.chunks] == [(3, 8), (3, 8), (3, 8), (1, 8)]
    assert len(m.tensors["model.fc2.weight"].chunks) == 3  # the empty shard is dropped
    # partial reads go through a bounded LRU; a whole-chunk read bypasses it
    st0, _ = open_dcp(fsdp2_dcp["path"], cache_bytes=0)
    for s in (st, st0):
        for name in sorted(m.files):
            p, n = s.join(s.root, name), m.files[name].size
            whole = s.read_bytes(p)
            assert s.read_bytes(p, 0, n // 2) + s.read_bytes(p, n // 2, n - n // 2) == whole
            assert s.cached_bytes <= s.cache_bytes
    assert st.decodes == 2 * len(m.files)  # whole (not kept), then the halves (one decode)
    assert st0.decodes == 3 * len(m.files)  # nothing kept
    assert st.cached_bytes > 0
    # whole tensors through the explicit (storage, manifest) pair, single process
    out = {"w": torch.empty(10, 8)}
    res = reshard.load({"model": {"fc1": {"weight": out["w"]}}}, fsdp2_dcp["path"], storage=st,
                       manifest=m, strict=False)
    assert torch.equal(out["w"], fsdp2_dcp["expected"]["model.fc1.weight"])
    assert "model.fc2.weight" in res.unexpected


def test_convert_then_load_and_verify(pool: WorkerPool, fsdp2_dcp: dict[str, Any], tmp_path: Path) -> None:
    dst = str(tmp_path / "converted")
    res = convert_dcp(fsdp2_dcp["path"], dst, step=7, file_bytes=1024)
    assert res.num_files > 1  # packed into several small files
    rep = reshard.verify(dst)
    assert rep.ok, rep.problems
    m = reshard.inspect(dst)
    assert m.step == 7 and m.extra["converted_from"] == "dcp"
    assert all(c.checksums for te in m.tensors.values() for c in te.chunks)
    results = pool.run(2, fns.r_load_rows, dst, fsdp2_dcp["shapes"])
    _check_rows(results, fsdp2_dcp)
    with pytest.raises(reshard.CheckpointError, match="already there"):  # as reshard.save
        convert_dcp(fsdp2_dcp["path"], dst)
    # the command line
    dst2 = str(tmp_path / "cli")
    r = CliRunner().invoke(cli_main, ["convert", "--from", "dcp", fsdp2_dcp["path"], dst2])
    assert r.exit_code == 0, r.output
    assert "converted" in r.output and reshard.verify(dst2).ok
    r = CliRunner().invoke(cli_main, ["convert", "--from", "dcp", str(tmp_path / "nothing"), dst2 + "x"])
    assert r.exit_code == 2, r.output


def test_convert_on_4_ranks(pool: WorkerPool, fsdp2_dcp: dict[str, Any], tmp_path: Path) -> None:
    dst = str(tmp_path / "converted")
    got = pool.run(4, fns.r_convert, fsdp2_dcp["path"], dst)
    assert all(g["bytes_written"] > 0 for g in got)  # every rank wrote its share of the files
    assert [g["has_manifest"] for g in got] == [True, False, False, False]
    assert reshard.verify(dst).ok
    results = pool.run(2, fns.r_load_rows, dst, fsdp2_dcp["shapes"])
    _check_rows(results, fsdp2_dcp)


def test_unsupported_dtype_skipped_with_note(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "z": {"c": torch.ones(2, dtype=torch.float8_e4m3fnuz)}, "lr": 0.1,
                  "cplx": torch.tensor([1 + 2j, -1j], dtype=torch.complex64)},
                 checkpoint_id=str(ck), no_dist=True)
    _st, m = open_dcp(ck)
    assert set(m.tensors) == {"w", "cplx"} and "z.c" in m.extra["dcp_skipped_tensors"]
    cplx = torch.zeros(2, dtype=torch.complex64)
    reshard.load({"cplx": cplx}, str(ck), strict=False)  # complex tensors are supported
    assert torch.equal(cplx, torch.tensor([1 + 2j, -1j], dtype=torch.complex64))
    w = torch.zeros(2)
    zc = reshard.ShardedTensor("z.c", torch.zeros(2), global_shape=(2,), global_offset=(0,))
    with pytest.raises(reshard.ShardingError, match=r"missing from the checkpoint: \['z.c'\]"):
        reshard.load({"w": w, "zc": zc, "lr": None}, str(ck))
    res = reshard.load({"w": w, "lr": None}, str(ck), strict=False)
    assert torch.equal(w, torch.ones(2)) and res.values["lr"] == 0.1


# ----------------------------------------------------------------------------- crafted pickles


class _Payload:
    """Pickles as a call of ``fn(*args)``; unpickling it unrestricted would run it."""

    def __init__(self, fn: Any, args: tuple[Any, ...]):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _payloads(marker: Path) -> dict[str, _Payload]:
    return {
        "os.system": _Payload(os.system, (f"touch {marker}",)),
        "builtins.eval": _Payload(eval, (f"open({str(marker)!r}, 'w')",)),
        "subprocess.Popen": _Payload(subprocess.Popen, (["touch", str(marker)],)),
        "builtins.open": _Payload(open, (str(marker), "w")),
    }


def test_payloads_would_run_if_unpickled(tmp_path: Path) -> None:
    """The detector works: an unrestricted unpickle of a payload creates the marker."""
    for which in ("builtins.open", "builtins.eval"):
        marker = tmp_path / which
        f = pickle.loads(pickle.dumps(_payloads(marker)[which]))  # the test's own bytes
        f.close()
        assert marker.exists()


def _small_dcp(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "n": torch.tensor(5), "cfg": {"lr": 0.5}},
                 checkpoint_id=str(path), no_dist=True)


def _trusted_metadata(path: Path) -> Any:
    with open(path / DCP_METADATA, "rb") as f:  # the test's own file: plain pickle is fine here
        return pickle.load(f)


@pytest.mark.parametrize("which", ["os.system", "builtins.eval", "subprocess.Popen", "builtins.open"])
def test_malicious_metadata_refused_nothing_executed(tmp_path: Path, which: str) -> None:
    ck = tmp_path / "ck"
    _small_dcp(ck)
    marker = tmp_path / "pwned"
    md = _trusted_metadata(ck)
    md.planner_data = {"w": ("w",), "evil": _payloads(marker)[which]}
    (ck / DCP_METADATA).write_bytes(pickle.dumps(md))
    # the global as pickle names it (os.system is posix.system, open is io.open)
    mod, name = {"os.system": ("posix", "system"), "builtins.open": ("io", "open")}.get(
        which, tuple(which.split(".")))
    with pytest.raises(reshard.ManifestError, match=rf"{mod}\.{name}.*not allowed"):
        read_dcp_metadata(ck)
    with pytest.raises(reshard.ManifestError, match=rf"{mod}\.{name}"):
        reshard.load({"w": torch.empty(3, 4)}, str(ck), strict=False)
    with pytest.raises(reshard.ManifestError):
        convert_dcp(ck, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_metadata_cannot_alter_torch_classes(tmp_path: Path) -> None:
    """BUILD onto an allowed class object only touches a throwaway subclass."""
    from torch.distributed.checkpoint.metadata import Metadata

    ck = tmp_path / "ck"
    ck.mkdir()
    raw = (b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nMetadata\n"
           + b"N}\x8c\x05pwnedK\x01s\x86b.")  # BUILD(Metadata, (None, {"pwned": 1}))
    (ck / DCP_METADATA).write_bytes(raw)
    with pytest.raises(reshard.ManifestError, match="not a Metadata"):
        read_dcp_metadata(ck)
    assert not hasattr(Metadata, "pwned")
    (ck / DCP_METADATA).write_bytes(b"\x80\x04garbage")
    with pytest.raises(reshard.ManifestError, match="unreadable"):
        read_dcp_metadata(ck)


def test_legacy_tensor_properties_names(tmp_path: Path) -> None:
    """Older torch pickled TensorProperties from torch.distributed._shard."""
    from torch.distributed._shard.sharded_tensor import metadata as legacy

    ck = tmp_path / "ck"
    _small_dcp(ck)
    md = _trusted_metadata(ck)
    for meta in md.state_dict_metadata.values():
        if hasattr(meta, "properties"):
            meta.properties = legacy.TensorProperties(dtype=meta.properties.dtype)
    raw = pickle.dumps(md)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in raw
    (ck / DCP_METADATA).write_bytes(raw)
    w = torch.empty(3, 4)
    reshard.load({"w": w}, str(ck), strict=False)
    assert torch.equal(w, torch.arange(12.0).reshape(3, 4))


def _replace_item(ck: Path, fqn: str, blob: bytes) -> None:
    """Append ``blob`` to the data file of ``fqn``'s (first) item and point
    the metadata at it."""
    md = _trusted_metadata(ck)
    idx = next(k for k in md.storage_data if k.fqn == fqn)
    info = md.storage_data[idx]
    f = ck / info.relative_path
    info.offset, info.length = f.stat().st_size, len(blob)
    with open(f, "ab") as fh:
        fh.write(blob)
    (ck / DCP_METADATA).write_bytes(pickle.dumps(md))


def test_non_tensor_item_refused_when_read(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for kind in ("dict", "payload", "wrong-shape"):
        ck = tmp_path / kind
        _small_dcp(ck)
        if kind == "dict":
            import io

            buf = io.BytesIO()
            torch.save({"not": "a tensor"}, buf)
            blob = buf.getvalue()
        elif kind == "payload":
            blob = pickle.dumps(_payloads(marker)["builtins.open"])
        else:
            import io

            buf = io.BytesIO()
            torch.save(torch.zeros(2, 2), buf)
            blob = buf.getvalue()
        _replace_item(ck, "w", blob)
        st, m = open_dcp(ck)  # the metadata itself is fine
        assert m.tensors["w"].global_shape == (3, 4)
        out = torch.zeros(3, 4)
        with pytest.raises(reshard.IntegrityError, match="'w'") as ei:
            reshard.load({"w": out}, str(ck), strict=False)
        msg = str(ei.value)
        assert {"dict": "not a tensor", "payload": "weights_only",
                "wrong-shape": "declares float32 [3, 4]"}[kind] in msg, msg
        assert torch.equal(out, torch.zeros(3, 4))
        # the untouched items still load
        n = torch.zeros((), dtype=torch.int64)
        res = reshard.load({"n": n, "cfg": None}, str(ck), strict=False)
        assert int(n) == 5 and res.values["cfg"] == {"lr": 0.5}
        with pytest.raises(reshard.IntegrityError):
            convert_dcp(ck, tmp_path / f"out-{kind}")
        assert not (tmp_path / f"out-{kind}").exists()
    assert not marker.exists()


def test_undecodable_value_skipped_with_note(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _small_dcp(ck)
    marker = tmp_path / "pwned"
    _replace_item(ck, "cfg.lr", pickle.dumps(_payloads(marker)["os.system"]))
    _st, m = open_dcp(ck)
    # the DCP leaf is skipped, and so is the value a load groups it into
    assert "cfg.lr" in m.extra["dcp_skipped_values"] and "cfg.lr" not in (m.values or {})
    w = torch.empty(3, 4)
    reshard.load({"w": w}, str(ck), strict=False)
    assert torch.equal(w, torch.arange(12.0).reshape(3, 4))
    with pytest.raises(reshard.IntegrityError, match=r"\['cfg'\] need more than torch.load"):
        reshard.load({"w": w, "cfg": None}, str(ck), strict=False)
    assert not marker.exists()


def test_cli_convert_refusal_names_the_cli_flag(tmp_path: Path) -> None:
    """The refusal of a value that needs more than weights_only names the CLI
    flag (it named the Python keyword skip_unsafe_values=True); the flag converts."""
    ck = tmp_path / "ck"
    _small_dcp(ck)
    marker = tmp_path / "pwned"
    _replace_item(ck, "cfg.lr", pickle.dumps(_payloads(marker)["os.system"]))
    r = CliRunner().invoke(cli_main, ["convert", "--from", "dcp", str(ck), str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "pass --skip-unsafe-values" in r.stderr and "skip_unsafe_values=True" not in r.stderr, r.stderr
    r = CliRunner().invoke(cli_main, ["convert", "--from", "dcp", "--skip-unsafe-values", str(ck),
                                      str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert not marker.exists()


def test_reshard_stateful_pickled_by_dcp_save_is_refused_saying_why(tmp_path: Path) -> None:
    """RNGState / ModelState saved through dcp.save: DCP pickles their
    ShardedObject/ShardedTensor records; the load refuses them (nothing
    unpickled) naming the cause and what to do, not a bare 'missing' key."""
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.save({"rng": reshard.RNGState(base_seed=1), "w": torch.ones(2)},
                                          checkpoint_id=str(ck))
    with pytest.raises(reshard.IntegrityError) as ei:
        reshard.load({"rng": reshard.RNGState(base_seed=1), "w": torch.zeros(2)}, str(ck))
    msg = str(ei.value)
    assert "['rng']" in msg and "reshard ShardedObject/ShardedTensor pickled by dcp.save" in msg, msg
    assert "reshard.save" in msg and "get_state_dict" in msg, msg


def test_data_file_outside_checkpoint_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _small_dcp(ck)
    md = _trusted_metadata(ck)
    for info in md.storage_data.values():
        info.relative_path = "../" + info.relative_path
    (ck / DCP_METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(reshard.ManifestError, match="not a plain file"):
        open_dcp(ck)
    shutil.rmtree(ck)
    with pytest.raises(reshard.CheckpointNotFoundError):
        open_dcp(ck)
