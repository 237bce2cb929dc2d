"""Export to / import from Hugging Face safetensors (reshard.formats): a
checkpoint saved on 2 gloo ranks (row-, column-, unevenly and flat (ZeRO) sharded tensors,
replicated tensors, a tied alias, AdamW-like optimizer state, objects and
values) exported, checked with ``safetensors.torch.load_file``, and imported
back into a 2-rank row-sharded model. The rank functions live in this module
(the workers import it by name: its folder is on the path)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import reshard
from reshard.cli import main
from reshard.errors import CheckpointNotFoundError, ManifestError
from reshard.formats.hf_export import INDEX_NAME, SINGLE_NAME, export_hf, parse_size
from reshard.formats.hf_import import hf_manifest, import_hf
from reshard.storage import LocalStorage
from reshard.transforms import Rename, Reset, Transpose

ROWS = (0, 17, 40)  # uneven row split of "model.layers.0.mlp.up.weight" over 2 ranks


def reference() -> dict[str, torch.Tensor]:
    """The unsharded model tensors (names as saved), deterministic."""
    g = torch.Generator().manual_seed(1234)
    return {
        "model.embed.weight": torch.randn(50, 16, generator=g),  # row-sharded
        "model.layers.0.attn.q.weight": torch.randn(32, 24, generator=g),  # column-sharded
        "model.layers.0.mlp.up.weight": torch.randn(40, 24, generator=g).to(torch.bfloat16),  # uneven rows
        "model.layers.0.norm.weight": torch.randn(24, generator=g),  # replicated
        "model.big.weight": torch.randn(256, 64, generator=g),  # row-sharded, 64 KiB
        "model.pos.count": torch.arange(7, dtype=torch.int64) * 3,  # replicated int
        "model.scale": torch.tensor(0.5, dtype=torch.float16),  # 0-dim, replicated
        "model.flat.weight": torch.randn(9, 7, generator=g),  # ZeRO: flat ranges of the whole
        "model.tpflat.weight": torch.randn(10, 6, generator=g),  # flat ranges of column boxes
    }


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    lo = n * rank // world
    return lo, n * (rank + 1) // world - lo


def r_save(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = reference()
    st = reshard.ShardedTensor
    emb = ref["model.embed.weight"]
    a, n = _rows(50, rank, world)
    emb_local = emb[a:a + n].clone()
    q = ref["model.layers.0.attn.q.weight"]
    up = ref["model.layers.0.mlp.up.weight"]
    big = ref["model.big.weight"]
    b, nb = _rows(256, rank, world)
    r0, r1 = ROWS[rank], ROWS[rank + 1]
    model = {
        "embed": st("embed.weight", emb_local, global_shape=(50, 16), global_offset=(a, 0)),
        # tied: the same local buffer under a second fqn -> a manifest alias
        "lm_head": st("lm_head.weight", emb_local, global_shape=(50, 16), global_offset=(a, 0)),
        "q": st.from_rank_offsets("layers.0.attn.q.weight",
                                  q[:, 12 * rank:12 * (rank + 1)].clone(), (1, rank, world)),
        "up": st("layers.0.mlp.up.weight", up[r0:r1].clone(), global_shape=(40, 24),
                 global_offset=(r0, 0)),
        "big": st("big.weight", big[b:b + nb].clone(), global_shape=(256, 64),
                  global_offset=(b, 0)),
        "flat": st("flat.weight", ref["model.flat.weight"].reshape(-1)[30 * rank:30 + 33 * rank].clone(),
                   global_shape=(9, 7), global_offset=(0, 0), local_shape=(9, 7),
                   flattened_range=slice(30 * rank, 30 + 33 * rank)),
        "tpflat": st("tpflat.weight",
                     ref["model.tpflat.weight"][:, 3 * rank:3 * rank + 3].reshape(-1).clone(),
                     global_shape=(10, 6), global_offset=(0, 3 * rank), local_shape=(10, 3),
                     flattened_range=slice(0, 30)),
        "layers": {"0": {"norm": {"weight": ref["model.layers.0.norm.weight"].clone()}}},
        "pos": {"count": ref["model.pos.count"].clone()},
        "scale": ref["model.scale"].clone(),
    }
    optim = {
        "m": st("state.model.embed.weight.exp_avg", emb_local * 0.1, global_shape=(50, 16),
                global_offset=(a, 0)),
        "v": st("state.model.embed.weight.exp_avg_sq", emb_local * emb_local,
                global_shape=(50, 16), global_offset=(a, 0)),
        "step": st("state.model.embed.weight.step", torch.tensor(3.0), global_shape=(),
                   global_offset=()),
        "lr": 1e-3,
    }
    rng = reshard.ShardedObject("rng", {"rank": rank}, global_shape=(world,), global_offset=(rank,))
    reshard.save({"model": model, "optim": optim, "rng": rng, "step": 3}, path, step=3)


def r_import(hf_dir: str, half: bool) -> dict[str, Any]:
    """Import into a row-sharded model (renamed back to the saved names); with
    ``half`` request only this rank's half of the rows of ``big.weight``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = reference()
    ref["model.lm_head.weight"] = ref["model.embed.weight"]  # the tie the export recorded
    state: dict[str, Any] = {}
    keys = ["model.big.weight"] if half else list(ref)
    for k in keys:
        t = ref[k]
        if t.dim() == 2:
            a, n = _rows(t.shape[0], rank, world)
            buf = torch.full((n, t.shape[1]), -1.0, dtype=t.dtype)
            state[k.replace(".", "_")] = reshard.ShardedTensor(
                k, buf, global_shape=tuple(t.shape), global_offset=(a, 0))
        else:
            state[k.replace(".", "_")] = reshard.ShardedTensor(
                k, torch.zeros_like(t), global_shape=tuple(t.shape), global_offset=(0,) * t.dim())
    st = LocalStorage()
    res = import_hf(state, hf_dir, strict=not half, transforms=[Rename(r"^", "model.")], storage=st)
    return {"tensors": {s.fqn: (s.global_offset, s.data) for s in state.values()},
            "bytes_read": res.bytes_read, "storage_bytes": st.bytes_read}


@pytest.fixture(scope="module")
def ckpt(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "step-00000003"
    pool.run(2, r_save, str(path))
    m = reshard.inspect(path)
    assert m.world_size == 2 and m.aliases == {"model.lm_head.weight": "model.embed.weight"}
    assert len(m.tensors["model.layers.0.attn.q.weight"].chunks) == 2
    return path


def _model_ref() -> dict[str, torch.Tensor]:
    return reference()


def _read_all(out: Path, files: tuple[str, ...]) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(out / f))
        assert not set(part) & set(got)
        got.update(part)
    return got


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_export_sharded_with_index(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    res = export_hf(ckpt, out, max_shard_bytes=4096, subtree="")  # every name as saved
    ref = _model_ref()
    assert len(res.files) >= 3 and res.index_file == INDEX_NAME
    assert res.files == tuple(f"model-{i:05d}-of-{len(res.files):05d}.safetensors"
                              for i in range(1, len(res.files) + 1))
    assert sorted(os.listdir(out)) == sorted([*res.files, INDEX_NAME])
    idx = json.loads((out / INDEX_NAME).read_text())
    assert idx["weight_map"] == res.weight_map
    assert idx["metadata"]["total_size"] == sum(t.nbytes for t in ref.values()) == res.total_size
    assert idx["metadata"]["tied_weights"] == {"model.lm_head.weight": "model.embed.weight"}
    # optimizer state, the tied alias, objects and values are not exported
    assert set(res.weight_map) == set(ref)
    assert "model.lm_head.weight" in res.skipped and "optim.state.model.embed.weight.exp_avg" in res.skipped
    assert res.aliases == {"model.lm_head.weight": "model.embed.weight"}
    got: dict[str, torch.Tensor] = {}
    for f in res.files:
        part = load_file(str(out / f))
        assert all(res.weight_map[k] == f for k in part)
        # shards hold whole tensors in name order, each at most the limit unless a single tensor
        nbytes = sum(t.nbytes for t in part.values())
        assert nbytes <= 4096 or len(part) == 1
        got.update(part)
    assert list(res.weight_map) == sorted(res.weight_map)
    assert set(got) == set(ref)
    for k, t in ref.items():
        assert _same(got[k], t), k
    # the index's file order follows name order
    order = [res.files.index(res.weight_map[k]) for k in sorted(ref)]
    assert order == sorted(order)


def test_export_one_file_bf16_rename_copy(ckpt: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "toy", "hidden_size": 16}))
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b'{"version": "1.0", "model": {}}')
    out = tmp_path / "hf16"
    res = export_hf(ckpt, out, dtype="bf16", transforms=[Rename(r"^model\.", "")],
                    copy_files=[cfg, tok])
    assert res.files == (SINGLE_NAME,) and res.index_file is None
    assert sorted(os.listdir(out)) == sorted([SINGLE_NAME, "config.json", "tokenizer.json"])
    # the copied config names the export's dtype (transformers reads "dtype", before 4.56 "torch_dtype")
    assert json.loads((out / "config.json").read_text()) == {
        "model_type": "toy", "hidden_size": 16, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    got = load_file(str(out / SINGLE_NAME))
    ref = _model_ref()
    assert set(got) == {k.removeprefix("model.") for k in ref}
    for k, t in ref.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert _same(got[k.removeprefix("model.")], want), k
    assert got["pos.count"].dtype == torch.int64


def test_export_streams_row_blocks(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors larger than READ_BLOCK_BYTES are read and written in blocks of
    rows (through row- and column-sharded chunks, with and without a cast)."""
    import reshard.formats.hf_write as ex

    monkeypatch.setattr(ex, "READ_BLOCK_BYTES", 200)
    m = reshard.inspect(ckpt)

    def blocks(name: str) -> list[Any]:
        te = m.tensors[name]
        return ex._blocks(ex._Item(out=name, saved=name, src_dtype=te.dtype, dtype=te.dtype,
                                   shape=tuple(te.global_shape)), te)

    assert [(b.offset, b.shape) for b in blocks("model.embed.weight")[:2]] == [
        ((0, 0), (3, 16)), ((3, 0), (3, 16))]
    assert [b.flat for b in blocks("model.flat.weight")] == [(0, 50), (50, 63)]
    assert [(b.offset, b.shape, b.flat) for b in blocks("model.tpflat.weight")] == [
        ((0, 0), (10, 6), None)]
    ref = _model_ref()
    for dtype in (None, torch.float16):
        out = tmp_path / f"blocks-{dtype}"
        res = export_hf(ckpt, out, dtype=dtype, max_shard_bytes=4096, subtree="")
        got = _read_all(out, res.files)
        for k, t in ref.items():
            want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            assert _same(got[k], want), k


def test_export_empty_and_0dim(tmp_path: Path) -> None:
    state = {"e": torch.zeros(0, 5), "f": torch.zeros(3, 0, dtype=torch.bfloat16),
             "s": torch.tensor(2.5, dtype=torch.float64), "b": torch.tensor([True, False])}
    reshard.save(state, tmp_path / "c")
    res = export_hf(tmp_path / "c", tmp_path / "hf")
    got = load_file(str(tmp_path / "hf" / SINGLE_NAME))
    assert set(got) == set(state) and res.files == (SINGLE_NAME,)
    for k, t in state.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_export_aliases_and_include(ckpt: Path, tmp_path: Path) -> None:
    res = export_hf(ckpt, tmp_path / "a", include_aliases=True, subtree="")
    got = load_file(str(tmp_path / "a" / SINGLE_NAME))
    assert torch.equal(got["model.lm_head.weight"], got["model.embed.weight"])
    # a glob over checkpoint fqns: optimizer state can be exported when asked
    res = export_hf(ckpt, tmp_path / "o", include="optim.state.*", subtree="")
    assert set(res.weight_map) == {"optim.state.model.embed.weight.exp_avg",
                                   "optim.state.model.embed.weight.exp_avg_sq",
                                   "optim.state.model.embed.weight.step"}
    with pytest.raises(ValueError, match="no tensor selected"):
        export_hf(ckpt, tmp_path / "n", include=lambda fqn: False, subtree="")
    # Reset drops keys (reported as skipped); geometric transforms do not apply to an export
    res = export_hf(ckpt, tmp_path / "r", transforms=[Reset("model.big.*")], subtree="")
    assert "model.big.weight" not in res.weight_map and "model.big.weight" in res.skipped
    with pytest.raises(ValueError, match="only transforms that act on saved names"):
        export_hf(ckpt, tmp_path / "t", transforms=[Transpose("model.embed.weight")], subtree="")
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export_hf(ckpt, ckpt)


def test_export_refuses_existing_and_overwrites(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    res = export_hf(ckpt, out, max_shard_bytes="4KiB")
    assert len(res.files) > 1
    with pytest.raises(FileExistsError):
        export_hf(ckpt, out)
    res2 = export_hf(ckpt, out, overwrite=True)
    # the stale shards and index of the first export are gone
    assert sorted(os.listdir(out)) == [SINGLE_NAME]
    assert res2.files == (SINGLE_NAME,)
    assert not list(out.glob(".*"))


def test_round_trip_import_row_sharded(pool: Any, ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_bytes=4096, transforms=[Rename(r"^model\.", "")])
    ref = _model_ref()
    ref["model.lm_head.weight"] = ref["model.embed.weight"]
    results = pool.run(2, r_import, str(out), False)
    for r in results:
        for fqn, (off, data) in r["tensors"].items():
            want = ref[fqn]
            if want.dim() == 2:
                want = want[off[0]:off[0] + data.shape[0]]
            assert _same(data, want), fqn
    # together the ranks read each byte of the model about once (rows of 2-D
    # tensors split, 1-D / 0-dim tensors read by both)
    total = sum(t.nbytes for k, t in ref.items() if k != "model.lm_head.weight")
    assert sum(r["bytes_read"] for r in results) < total * 1.05


def test_import_reads_only_its_rows(pool: Any, ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_bytes=4096, transforms=[Rename(r"^model\.", "")])
    half = 256 * 64 * 4 // 2
    results = pool.run(2, r_import, str(out), True)
    for r in results:
        # exact rows, no checksum blocks to round to
        assert r["bytes_read"] == half
        # plus the safetensors headers and the index
        assert half <= r["storage_bytes"] < half + 8192


def test_import_single_process_and_strictness(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_hf(ckpt, out, subtree="")
    ref = _model_ref()
    ref["model.lm_head.weight"] = ref["model.embed.weight"]  # the tie, recorded by the export
    tgt = {k.replace(".", "_"): reshard.ShardedTensor(k, torch.zeros_like(t), global_shape=tuple(t.shape),
                                                      global_offset=(0,) * t.dim())
           for k, t in ref.items()}
    res = import_hf(tgt, out)
    assert res.missing == () and res.unexpected == ()
    for s in tgt.values():
        assert _same(s.data, ref[s.fqn])
    with pytest.raises(reshard.ShardingError, match="unexpected"):
        import_hf({"x": reshard.ShardedTensor("model.big.weight", torch.zeros(256, 64),
                                              global_shape=(256, 64), global_offset=(0, 0))}, out)
    # a plain safetensors file written by the safetensors library itself
    other = tmp_path / "plain"
    other.mkdir()
    w = torch.randn(6, 5)
    save_file({"w": w, "b": torch.ones(5, dtype=torch.float16)}, str(other / SINGLE_NAME))
    t = {"w": torch.zeros(6, 5), "b": torch.zeros(5, dtype=torch.float16)}
    import_hf(t, other)
    assert torch.equal(t["w"], w) and torch.equal(t["b"], torch.ones(5, dtype=torch.float16))


def test_import_refuses_bad_directories(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        hf_manifest(tmp_path)
    save_file({"w": torch.ones(2)}, str(tmp_path / "real.safetensors"))
    # a weight_map naming a file outside the directory
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "../real.safetensors"}}))
    with pytest.raises(ManifestError, match="plain file"):
        hf_manifest(tmp_path)
    # a shard that is a symbolic link out of the directory (one to a file
    # inside it is followed, as a hub cache snapshot's are: test_hf_snapshot.py)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    save_file({"w": torch.ones(2)}, str(outside))
    os.symlink(outside, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / INDEX_NAME).write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ManifestError, match="model-00001-of-00001.safetensors: resolves to .*outside"):
        hf_manifest(tmp_path)
    # a header whose data_offsets reach past the end of the file
    bad = tmp_path / "bad"
    bad.mkdir()
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    (bad / SINGLE_NAME).write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\0" * 8)
    with pytest.raises(reshard.IntegrityError):
        hf_manifest(bad)


def test_parse_size() -> None:
    assert parse_size("2GB") == 2 * 10**9 and parse_size("2GiB") == 2 * 1024**3
    assert parse_size("128MiB") == 128 << 20 and parse_size("1000") == 1000 and parse_size(5) == 5
    with pytest.raises(ValueError):
        parse_size("lots")


def test_cli_export(ckpt: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    out = tmp_path / "cli"
    r = CliRunner().invoke(main, ["export", str(ckpt), str(out), "--format", "hf", "--dtype", "bf16",
                                  "--max-shard-size", "4KiB", "--copy", str(cfg), "--subtree", ""])
    assert r.exit_code == 0, r.output
    assert "exported 9 tensors" in r.output
    idx = json.loads((out / INDEX_NAME).read_text())
    assert (out / "config.json").exists()
    got = _read_all(out, tuple(sorted(set(idx["weight_map"].values()))))
    assert got["model.embed.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.embed.weight"], _model_ref()["model.embed.weight"].to(torch.bfloat16))
    r = CliRunner().invoke(main, ["export", str(ckpt), str(out)])
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = CliRunner().invoke(main, ["export", str(tmp_path / "nothing"), str(tmp_path / "o2")])
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "o3"), "--dtype", "int3"])
    assert r.exit_code == 2


def test_unwrapped_names_leave_out_wrapper_components_only() -> None:
    """The name-level rule export uses for a saved wrapped state_dict: wrapper-only
    components anywhere, DDP's leading ``module`` only when every name has it."""
    from reshard.adapters.names import unwrapped_names

    assert unwrapped_names(["_orig_mod.module.a.w", "_orig_mod.module.b"]) == {
        "_orig_mod.module.a.w": "a.w", "_orig_mod.module.b": "b"}
    assert unwrapped_names(["h._checkpoint_wrapped_module.w", "_fsdp_wrapped_module.x.w"]) == {
        "h._checkpoint_wrapped_module.w": "h.w", "_fsdp_wrapped_module.x.w": "x.w"}
    own = ["module.proj.weight", "head.weight"]  # a model's own submodule named "module"
    assert unwrapped_names(own) == {n: n for n in own}
    with pytest.raises(ValueError, match=r"'_orig_mod.w'.*both name 'w'|'w'.*both name 'w'"):
        unwrapped_names(["w", "_orig_mod.w"])


def test_export_help_states_the_default_it_applies() -> None:
    """`reshard export --help` says what is exported without --include: every
    model tensor, optimizer state under any optim/optimizer name left out (not
    "all but optim.*", which would export TorchTitan's optimizer.* state)."""
    out = CliRunner().invoke(main, ["export", "--help"], terminal_width=200).output
    text = " ".join(out.split())
    assert "all but optim.*" not in text
    assert "default: every model tensor: optimizer state under any optim/optimizer name" in text, text
