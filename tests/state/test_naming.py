"""DESIGN.md section 2, the naming rule: a leaf's checkpoint key is its tree
path (keys may contain '.'), ShardedTensor fqns sit below their container,
adapters name relative to their position, wrapper prefixes are stripped, and
checkpoints of format version 1 are migrated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import _naming_fns as fns
import reshard
from reshard import ModelState, OptimizerState, ShardingError
from reshard.loading.load import MIGRATED

DATA = Path(__file__).parents[1] / "support" / "data"


def test_model_state_dict_saved_on_2_loaded_on_1_and_3(pool, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    keys = pool.run(2, fns.r_save_state_dict, path)[0]
    m = reshard.inspect(path)
    assert set(m.tensors) == {f"model.{k}" for k in keys}  # model.0.weight, as DCP flattens
    for world in (1, 3):
        for r in pool.run(world, fns.r_load_state_dict, path):
            assert r["equal"] and r["missing"] == () and r["unexpected"] == ()


def test_module_leaf_saves_the_keys_of_its_state_dict(tmp_path: Path) -> None:
    src = fns.net(0)
    reshard.save({"model": src}, tmp_path / "a")
    reshard.save({"model": src.state_dict()}, tmp_path / "b")
    assert set(reshard.inspect(tmp_path / "a").tensors) == set(reshard.inspect(tmp_path / "b").tensors)
    dst = fns.net(1)
    reshard.load({"model": dst}, tmp_path / "b")  # a module leaf loads the state_dict checkpoint
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values(),
                                                  strict=True))


def test_model_and_ema_never_collide(tmp_path: Path) -> None:
    model, ema = fns.net(0), fns.net(1)
    reshard.save({"model": ModelState(model), "ema": ModelState(ema)}, tmp_path / "ck")
    names = set(reshard.inspect(tmp_path / "ck").tensors)
    assert names == {f"{p}.{k}" for p in ("model", "ema") for k in model.state_dict()}
    m2, e2 = fns.net(2), fns.net(3)
    reshard.load({"model": ModelState(m2), "ema": ModelState(e2)}, tmp_path / "ck")
    for a, b in ((m2, model), (e2, ema)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                      strict=True))


def test_two_leaves_of_one_key_name_both_tree_paths(tmp_path: Path) -> None:
    m = fns.net(0)
    with pytest.raises(ShardingError) as ei:
        reshard.save({"model": ModelState(m), "model.0.bias": torch.zeros(6)}, tmp_path / "ck")
    msg = str(ei.value)
    assert "'model.0.bias' is given by two leaves" in msg
    assert "state['model']" in msg and "state['model.0.bias']" in msg and "nest one under" in msg
    assert not (tmp_path / "ck").exists()


def test_compiled_model_loads_into_the_plain_one(tmp_path: Path) -> None:
    """torch.compile's OptimizedModule names everything ``_orig_mod.*``; the
    compiled forward really runs (dynamo with the "eager" backend: inductor's
    C++ toolchain is not needed here)."""
    src = fns.net(0)
    compiled = torch.compile(src, backend="eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
    compiled(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    reshard.save({"model": ModelState(compiled), "optim": OptimizerState(compiled, opt),
                  "leaf": compiled}, tmp_path / "ck")
    m = reshard.inspect(tmp_path / "ck")
    names = set(m.tensors) | set(m.aliases)  # "leaf" is the same memory: aliases of "model"
    assert "model.0.weight" in names and "optim.state.0.weight.momentum_buffer" in names
    assert "leaf.2.bias" in names and not any("_orig_mod" in n for n in names)
    plain = fns.net(7)
    popt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.1)
    reshard.load({"model": ModelState(plain), "optim": OptimizerState(plain, popt), "leaf": fns.net(8)},
                 tmp_path / "ck")
    for (n, p), q in zip(plain.named_parameters(), src.parameters(), strict=True):
        assert torch.equal(p, q), n
        assert torch.equal(popt.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"]), n
    assert popt.param_groups[0]["lr"] == 0.1 and popt.param_groups[0]["momentum"] == 0.9


def test_ddp_model_loads_into_the_plain_one(pool, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    saved = pool.run(2, fns.r_ddp_save, path)[0]
    m = reshard.inspect(path)
    names = set(m.tensors) | set(m.aliases)
    assert "model.0.weight" in names and "optim.state.2.bias.exp_avg" in names
    assert "module_leaf.0.weight" in names and not any("module" in n.split(".") for n in names)
    plain = fns.net(9)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.5)
    reshard.load({"model": ModelState(plain), "optim": OptimizerState(plain, opt),
                  "module_leaf": fns.net(10)}, path)
    for n, p in plain.named_parameters():
        assert torch.equal(p, saved["params"][n]), n
        assert torch.equal(opt.state[p]["exp_avg"], saved["moments"][n]), n
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["weight_decay"] == 0.1


def test_fsdp1_model_loads_into_the_plain_one(pool, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    (saved,) = pool.run(1, fns.r_fsdp1_save, path)
    assert all(n.startswith("_fsdp_wrapped_module.") for n in saved["wrapped"])
    names = set(reshard.inspect(path).tensors)
    assert {"model.0.weight", "optim.state.0.weight.exp_avg", "optim.state.2.bias.step"} <= names
    assert not any("_fsdp" in n for n in names)
    plain = fns.net(9)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.5)
    reshard.load({"model": ModelState(plain), "optim": OptimizerState(plain, opt)}, path)
    for n, p in plain.named_parameters():
        assert torch.equal(p, saved["params"][n]), n
        assert torch.equal(opt.state[p]["exp_avg"], saved["moments"][n]), n
    assert opt.param_groups[0]["lr"] == 0.03


def test_tensor_keys_equal_those_dcp_writes(tmp_path: Path) -> None:
    """``{"model": ModelState(m), "optim": OptimizerState(m, opt)}`` and DCP's
    ``{"model": msd, "optim": osd}`` from ``get_state_dict(m, opt)`` (default
    options) have the same tensor keys. Hyperparameters differ by design: DCP
    keeps ``optim.param_groups`` by group position, reshard saves
    ``optim.param_group.<param fqn>`` objects (restored by parameter name)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    m.register_buffer("scale", torch.ones(2))
    opt = torch.optim.Adam([{"params": m[0].parameters(), "lr": 0.1},
                            {"params": [*m[1].parameters(), *m[2].parameters()], "lr": 0.2}])
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    md = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    dcp_tensors = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    reshard.save({"model": ModelState(m), "optim": OptimizerState(m, opt)}, tmp_path / "ours")
    ours = reshard.inspect(tmp_path / "ours")
    assert set(ours.tensors) == dcp_tensors
    assert "optim.state.0.weight.step" in dcp_tensors
    assert {k for k in ours.objects if k.startswith("optim.param_group.")} == {
        f"optim.param_group.{n}" for n, _ in m.named_parameters()}


def test_format_version_1_checkpoint_is_migrated(tmp_path: Path) -> None:
    """``tests/support/data/v1_checkpoint`` was written by reshard's format version 1
    (ShardedTensors named by their own fqn, ModelState without its tree key,
    RNGState as "rng"): it loads strictly into today's tree, the renames are
    recorded in LoadResult.notes, and the values are those of the run that
    wrote it (same seed, same step, recomputed here)."""
    ckpt = tmp_path / "v1"
    shutil.copytree(DATA / "v1_checkpoint", ckpt)
    assert json.loads((ckpt / "manifest.json").read_text())["format_version"] == 1
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    ref(torch.ones(1, 3)).sum().backward()
    ropt.step()
    dst = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = torch.optim.AdamW(dst.parameters(), lr=0.5)
    table = torch.zeros(2, 3)
    aux = reshard.ShardedTensor("cache.table", table, global_shape=(2, 3), global_offset=(0, 0))
    rng = reshard.RNGState(base_seed=3)
    res = reshard.load({"model": ModelState(dst), "optim": OptimizerState(dst, opt), "rng": rng,
                        "aux": {"t": aux}, "step": 0}, ckpt)
    assert res.missing == () and res.unexpected == () and res.values["step"] == 1
    mig = res.notes[MIGRATED]
    assert mig["from_format_version"] == 1
    assert mig["renamed"]["model.0.weight"] == "0.weight"
    assert mig["renamed"]["aux.cache.table"] == "cache.table"
    assert mig["renamed"]["rng.streams"] == "rng"
    assert torch.equal(table, torch.arange(6.0).reshape(2, 3))
    # the moments bit for bit as the v1 file holds them (under their v1 names), and equal to
    # this machine's recomputation within fp32 rounding: AdamW's exp_avg_sq is computed with
    # the CPU's own vector kernels, whose rounding differs in the last bit between processors
    with safe_open(str(ckpt / "data-r00000-0.safetensors"), "pt") as f:
        stored = {k.split("@")[0]: f.get_tensor(k) for k in f.keys() if "exp_avg_sq" in k}
    for (n, p), q in zip(dst.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
        assert torch.equal(opt.state[p]["exp_avg_sq"], stored[f"optim.state.{n}.exp_avg_sq"]), n
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ropt.state[q]["exp_avg_sq"],
                                   rtol=1e-6, atol=0)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.1


def test_adapter_hooks_see_names_relative_to_their_position(tmp_path: Path) -> None:
    """An OptimizerState under any key (here two, of two models) creates the
    state of a fresh optimizer from the names below its own position."""
    a, b = fns.net(0), fns.net(1)
    oa, ob = torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.2,
                                                                          momentum=0.5)
    for m, o in ((a, oa), (b, ob)):
        m(torch.ones(1, 4)).sum().backward()
        o.step()
        o.zero_grad()
    reshard.save({"a": ModelState(a), "b": ModelState(b), "opt_a": OptimizerState(a, oa),
                  "nested": {"opt_b": OptimizerState(b, ob)}}, tmp_path / "ck")
    names = set(reshard.inspect(tmp_path / "ck").tensors)
    assert "opt_a.state.0.weight.exp_avg" in names and "nested.opt_b.state.2.bias.momentum_buffer" in names
    a2, b2 = fns.net(2), fns.net(3)
    oa2, ob2 = torch.optim.Adam(a2.parameters(), lr=1.0), torch.optim.SGD(b2.parameters(), lr=1.0,
                                                                             momentum=0.1)
    res = reshard.load({"a": ModelState(a2), "b": ModelState(b2), "opt_a": OptimizerState(a2, oa2),
                        "nested": {"opt_b": OptimizerState(b2, ob2)}}, tmp_path / "ck")
    assert res.missing == () and res.unexpected == ()
    for p, q in zip(a2.parameters(), a.parameters(), strict=True):
        assert torch.equal(oa2.state[p]["exp_avg"], oa.state[q]["exp_avg"])
    for p, q in zip(b2.parameters(), b.parameters(), strict=True):
        assert torch.equal(ob2.state[p]["momentum_buffer"], ob.state[q]["momentum_buffer"])
    assert oa2.param_groups[0]["lr"] == 0.1 and ob2.param_groups[0]["momentum"] == 0.5
