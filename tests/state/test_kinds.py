"""Kinds of state (reshard.state.kinds): one registry of handlers, one Protocol.

A tensor subclass that no handler takes is refused (its key and type named,
and how to register a handler) before any file is written or any target is
changed, on every rank; a handler registered in the test converts one through
save -> load, also into another split of its rows on 2 gloo ranks. Rank
functions and the toy subclass live in tests/state/_kinds_fns.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import _kinds_fns as fns
import reshard
from _kinds_fns import FloatHandler, Int8Rows, RowsHandler, empty_rows, int8_rows, quantize
from reshard.state import kinds
from reshard.state.sharding import ShardedObject, ShardedTensor

pytestmark = pytest.mark.timeout(120)


@contextmanager
def handler(cls: type | str, h: kinds.KindHandler) -> Iterator[kinds.KindHandler]:
    """``h`` registered for ``cls`` (through the public name) for the body of the block only."""
    reshard.register_state_kind(cls, h)
    try:
        yield h
    finally:
        kinds.unregister(cls)


def _matrix(rows: int = 8, cols: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _files(p: Path) -> list[Path]:
    return [f for f in p.rglob("*") if f.is_file()] if p.exists() else []


# ----------------------------------------------------------------------------- the registry


def test_every_builtin_handler_is_a_kind_handler_registered_in_one_table() -> None:
    names = [n for n, _ in kinds.registered()]
    for cls, h in kinds.BUILTIN:
        assert isinstance(h, kinds.KindHandler), h
        assert (cls if isinstance(cls, str) else kinds.qualified_name(cls)) in names
    assert isinstance(kinds.UNKNOWN_TENSOR, kinds.KindHandler)
    assert isinstance(kinds.PLAIN_VALUE, kinds.KindHandler)
    assert isinstance(RowsHandler(), kinds.KindHandler) and isinstance(FloatHandler(), kinds.KindHandler)
    assert reshard.register_state_kind == kinds.register and "register_state_kind" in reshard.__all__
    with pytest.raises(TypeError, match="not a KindHandler"):
        kinds.register(Int8Rows, object())  # type: ignore[arg-type]


def test_the_order_tried_follows_the_mro_most_derived_first() -> None:
    plain = kinds.handler_for(torch.ones(1))
    stateful = kinds.handler_for(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    assert plain is not None and plain.name == "plain tensor"
    assert stateful is not None and stateful.name.startswith("Stateful")
    # a subclass without a handler: the plain-tensor handler refuses it (exact types), then the refusal
    assert kinds.tried(Int8Rows) == (plain, stateful, kinds.UNKNOWN_TENSOR)
    x = int8_rows(_matrix())
    assert kinds.handler_for(x) is kinds.UNKNOWN_TENSOR
    with handler(Int8Rows, RowsHandler()) as h:
        assert kinds.tried(Int8Rows) == (h, plain, stateful, kinds.UNKNOWN_TENSOR)
        assert kinds.handler_for(x) is h
    assert kinds.handler_for(x) is kinds.UNKNOWN_TENSOR  # unregistered again
    # by qualified name, without importing the class: what a message tells a user to type
    with handler("_kinds_fns.Int8Rows", RowsHandler()) as h:
        assert kinds.handler_for(x) is h
    # an nn.Module is tried as a module before the Stateful probe on `object`
    module = kinds.handler_for(nn.Linear(2, 2))
    assert module is not None and module.name.startswith("nn.Module")
    assert kinds.tried(nn.Linear) == (module, stateful)
    # ShardedTensor and the views of one list; containers and values have no handler
    st = ShardedTensor("a", torch.ones(2), global_shape=(4,), global_offset=(0,))
    assert kinds.handler_for(st) is not None and kinds.handler_for([st, st]) is not None
    assert kinds.handler_for([st, 1]) is None
    assert kinds.handler_for(ShardedObject("o", 1)) is kinds.handler_for(st)
    assert kinds.handler_for(np.ones(2)) is not None
    for v in (3, "s", {"a": torch.ones(1)}, [torch.ones(1)], None):
        assert kinds.handler_for(v) is None


def test_a_dtensor_is_found_by_its_qualified_name() -> None:
    from torch.distributed.tensor import DTensor

    dt = kinds.tried(DTensor)
    assert [h.name for h in dt] == ["DTensor", "plain tensor", "Stateful (state_dict() / load_state_dict())",
                                    kinds.UNKNOWN_TENSOR.name]


def test_plain_tensor_types_are_a_stated_list() -> None:
    assert kinds.PLAIN_TENSOR_TYPES[:2] == ("torch.Tensor", "torch.nn.parameter.Parameter")
    assert kinds.is_plain_tensor(torch.ones(1)) and kinds.is_plain_tensor(nn.Parameter(torch.ones(1)))
    assert kinds.is_plain_tensor(nn.Linear(2, 2).weight)
    assert not kinds.is_plain_tensor(int8_rows(_matrix()))
    assert not kinds.is_plain_tensor(_Packed4bit(torch.ones(4, dtype=torch.uint8)))
    from torch.distributed.fsdp._flat_param import FlatParameter

    assert kinds.qualified_name(FlatParameter) in kinds.PLAIN_TENSOR_TYPES


def test_registering_twice_needs_override_and_unregister_returns_the_handler() -> None:
    first, second = RowsHandler(), FloatHandler()
    with handler(Int8Rows, first):
        kinds.register(Int8Rows, first)  # the same handler again: nothing changes
        with pytest.raises(ValueError, match=r"_kinds_fns.Int8Rows already has the handler"):
            kinds.register(Int8Rows, second)
        with pytest.raises(ValueError, match="already has"):
            kinds.register("_kinds_fns.Int8Rows", second)  # the same class by name
        kinds.register(Int8Rows, second, override=True)
        assert kinds.handler_for(int8_rows(_matrix())) is second
    with pytest.raises(KeyError, match="has no handler"):
        kinds.unregister(Int8Rows)


# ----------------------------------------------------------------------------- refused


class _Packed4bit(nn.Parameter):
    """A Parameter subclass over real (packed) storage, as bitsandbytes'
    ``Params4bit``: its storage holds packed nibbles, not its values."""

    def __new__(cls, data: torch.Tensor) -> _Packed4bit:
        return torch.Tensor._make_subclass(cls, data, False)  # type: ignore[return-value]


def test_a_wrapper_subclass_is_refused_naming_its_key_and_type(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    with pytest.raises(reshard.ShardingError) as e:
        reshard.save({"model": {"w": int8_rows(_matrix())}, "b": torch.ones(2)}, ck, step=1)
    msg = str(e.value)
    assert "model.w: cannot save a _kinds_fns.Int8Rows" in msg
    assert "reshard.register_state_kind('_kinds_fns.Int8Rows', handler)" in msg and "\n" not in msg
    assert "docs/extending.md" in msg and "invalid python storage" not in msg
    assert _files(tmp_path) == []  # refused before any file is written


def test_a_parameter_subclass_over_packed_storage_is_refused(tmp_path: Path) -> None:
    p = _Packed4bit(torch.arange(8, dtype=torch.uint8).reshape(2, 4))
    with pytest.raises(reshard.ShardingError, match=r"optim.w4: cannot save a test_kinds._Packed4bit"):
        reshard.save({"optim": {"w4": p, "lr": 0.1}}, tmp_path / "ck")
    assert _files(tmp_path) == []


def test_a_subclass_inside_a_model_or_a_sharded_tensor_is_refused(tmp_path: Path) -> None:
    m = nn.Sequential(nn.Linear(6, 8))
    m[0].weight = nn.Parameter(int8_rows(_matrix()), requires_grad=False)
    with pytest.raises(reshard.ShardingError, match=r"model.0.weight: cannot save a _kinds_fns.Int8Rows"):
        reshard.save({"model": m}, tmp_path / "a")
    st = ShardedTensor("w", int8_rows(_matrix()), global_shape=(8, 6), global_offset=(0, 0))
    with pytest.raises(reshard.ShardingError,
                       match=r"w: cannot save the data of a ShardedTensor, a _kinds_fns.Int8Rows.*convert it"):
        reshard.save({"w": st}, tmp_path / "b")
    lazy = nn.LazyLinear(3)
    with pytest.raises(reshard.ShardingError, match=r"model.weight: .*UninitializedParameter.*materialise"):
        reshard.save({"model": lazy}, tmp_path / "c")
    assert _files(tmp_path) == []


def test_loading_into_a_subclass_is_refused_before_any_target_changes(tmp_path: Path) -> None:
    reshard.save({"w": _matrix(), "b": torch.ones(3)}, tmp_path / "ck")
    target = empty_rows(8, 6)
    b = torch.zeros(3)
    with pytest.raises(reshard.ShardingError, match=r"w: cannot load into a _kinds_fns.Int8Rows.*register"):
        reshard.load({"w": target, "b": b}, tmp_path / "ck")
    assert not target.qdata.any() and not b.any()


def test_an_async_save_of_a_subclass_fails_with_the_same_line(tmp_path: Path) -> None:
    handle = reshard.async_save({"w": int8_rows(_matrix())}, tmp_path / "ck", step=1)
    with pytest.raises(reshard.ShardingError, match=r"w: cannot save a _kinds_fns.Int8Rows"):
        handle.wait(timeout=60)
    assert not (tmp_path / "ck" / "manifest.json").exists()


def _torchao_model(config: str) -> nn.Module:
    """A linear layer quantized by torchao's ``config`` (skipped, with the
    reason, where torchao is missing or cannot build that tensor on CPU)."""
    tq = pytest.importorskip("torchao.quantization")
    m = nn.Sequential(nn.Linear(32, 16))
    try:
        tq.quantize_(m, getattr(tq, config)())
    except Exception as e:  # noqa: BLE001 - the reason of the skip
        pytest.skip(f"torchao cannot build a {config} weight here: {type(e).__name__}: {e}")
    return m


@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_torchao_quantized_weights_are_refused(tmp_path: Path, config: str) -> None:
    m = _torchao_model(config)
    name = kinds.qualified_name(type(m[0].weight))
    assert name.startswith("torchao.") and not kinds.is_plain_tensor(m[0].weight)
    with pytest.raises(reshard.ShardingError) as e:
        reshard.save({"model": m}, tmp_path / "ck")
    msg = str(e.value)
    assert f"model.0.weight: cannot save a {name}" in msg and "\n" not in msg
    assert f"reshard.register_state_kind({name!r}, handler)" in msg
    assert _files(tmp_path) == []
    # and as a load target: refused before the bias (a plain tensor) is filled
    reshard.save({"model": nn.Sequential(nn.Linear(32, 16))}, tmp_path / "plain")
    bias = m[0].bias.detach().clone()
    with pytest.raises(reshard.ShardingError, match=rf"model.0.weight: cannot load into a {name}"):
        reshard.load({"model": m}, tmp_path / "plain")
    assert torch.equal(m[0].bias.detach(), bias)


class _TorchaoParts:
    """torchao's ``Int8Tensor`` as its int8 data and scales (its own memory:
    filled in place at load), registered by qualified name in the test."""

    name = "torchao Int8Tensor (qdata and scale)"

    def accepts(self, x: Any) -> bool:
        return isinstance(getattr(x, "qdata", None), torch.Tensor) and \
            isinstance(getattr(x, "scale", None), torch.Tensor)

    def save(self, x: Any, at: kinds.Where) -> kinds.Form:
        return kinds.Tree({"qdata": x.qdata, "scale": x.scale})

    load = save


def test_a_handler_registered_by_name_saves_and_loads_torchao_int8(tmp_path: Path) -> None:
    src, dst = _torchao_model("Int8WeightOnlyConfig"), _torchao_model("Int8WeightOnlyConfig")
    with torch.no_grad():
        dst[0].weight.qdata.zero_()
        dst[0].weight.scale.zero_()
        dst[0].bias.zero_()
    name = kinds.qualified_name(type(src[0].weight))
    with handler(name, _TorchaoParts()):
        m = reshard.save({"model": src}, tmp_path / "ck").manifest
        reshard.load({"model": dst}, tmp_path / "ck")
    assert m is not None and m.tensors["model.0.weight.qdata"].dtype == "int8"
    assert torch.equal(dst[0].weight.qdata, src[0].weight.qdata)
    assert torch.equal(dst[0].weight.scale, src[0].weight.scale)
    assert torch.equal(dst[0].bias, src[0].bias)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(dst(x), src(x))


def test_every_rank_refuses_when_one_holds_a_subclass(pool: Any, tmp_path: Path) -> None:
    out = pool.run(2, fns.save_one_rank_subclass, str(tmp_path / "ck"))
    for name, is_ckpt_error, msg in out:
        assert is_ckpt_error and "w: cannot save a _kinds_fns.Int8Rows" in msg, (name, msg)
    assert _files(tmp_path) == []


# ----------------------------------------------------------------------------- converted by a handler


def test_a_handler_saves_and_loads_a_subclass_in_place(tmp_path: Path) -> None:
    f = _matrix()
    x = int8_rows(f)
    with handler(Int8Rows, RowsHandler()):
        m = reshard.save({"w": x, "note": "q"}, tmp_path / "ck", step=2).manifest
        target = empty_rows(8, 6)
        res = reshard.load({"w": target, "note": ""}, tmp_path / "ck")
    assert m is not None
    assert sorted(m.tensors) == ["w.qdata", "w.scale"] and m.tensors["w.qdata"].dtype == "int8"
    assert torch.equal(target.qdata, x.qdata) and torch.equal(target.scale, x.scale)
    assert torch.allclose(target.dequantize(), f, atol=float(x.scale.max()))
    assert res.values["note"] == "q"
    # the saved parts are plain tensors: a plain target loads them without the handler
    q, s = torch.zeros(8, 6, dtype=torch.int8), torch.zeros(8)
    reshard.load({"w": {"qdata": q, "scale": s}, "note": ""}, tmp_path / "ck")
    assert torch.equal(q, x.qdata) and torch.equal(s, x.scale)


def test_a_handler_inside_a_model_converts_through_restore(tmp_path: Path) -> None:
    f = _matrix()
    src = nn.Sequential(nn.Linear(6, 8))
    src[0].weight = nn.Parameter(int8_rows(f), requires_grad=False)
    dst = nn.Sequential(nn.Linear(6, 8))
    dst[0].weight = nn.Parameter(empty_rows(8, 6), requires_grad=False)
    with handler(Int8Rows, FloatHandler()):
        m = reshard.save({"model": src}, tmp_path / "ck").manifest
        reshard.load({"model": dst}, tmp_path / "ck")
        # saved as the float matrix at the weight's own key: a plain float model loads it too
        plain = nn.Sequential(nn.Linear(6, 8))
        reshard.load({"model": plain}, tmp_path / "ck")
    q, s = quantize(f)
    assert torch.equal(dst[0].weight.qdata, q) and torch.equal(dst[0].weight.scale, s)
    assert torch.equal(dst[0].bias, src[0].bias)
    assert torch.equal(plain[0].weight.detach(), src[0].weight.dequantize())
    assert m is not None and m.tensors["model.0.weight"].dtype == "float32"


def test_a_handler_that_returns_no_form_is_named(tmp_path: Path) -> None:
    class Bad:
        name = "bad toy handler"

        def accepts(self, x: Any) -> bool:
            return True

        def save(self, x: Any, at: kinds.Where) -> Any:
            return x.qdata  # a tensor, not a form

        def load(self, x: Any, at: kinds.Where) -> Any:
            return kinds.Tree(x)  # the leaf itself

    with handler(Int8Rows, Bad()):
        with pytest.raises(reshard.ShardingError, match=r"w: the handler 'bad toy handler' made Tensor"):
            reshard.save({"w": int8_rows(_matrix())}, tmp_path / "ck")
        reshard.save({"w": _matrix()}, tmp_path / "ok")
        with pytest.raises(reshard.ShardingError, match=r"w: the handler 'bad toy handler' made Tree"):
            reshard.load({"w": empty_rows(8, 6)}, tmp_path / "ok")


def test_a_handler_reshards_a_subclass_on_two_ranks(pool: Any, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    total, cols = 8, 5
    saved = pool.run(2, fns.save_rows, ck, 7, total, cols)
    assert saved == [[0, 4], [4, 4]]
    q, s = quantize(torch.randn(total, cols, generator=torch.Generator().manual_seed(7)))
    # another split of the rows on 2 ranks
    for r, got in enumerate(pool.run(2, fns.load_rows, ck, total, cols, [3, 5])):
        rows = slice(got["row0"], got["row0"] + [3, 5][r])
        assert torch.equal(got["qdata"], q[rows]) and torch.equal(got["scale"], s[rows]) and got["step"] == 3
    # and the whole matrix in one process
    whole = empty_rows(total, cols)
    with handler(Int8Rows, RowsHandler()):
        reshard.load({"w": whole, "step": 0}, ck)
    assert torch.equal(whole.qdata, q) and torch.equal(whole.scale, s)


def _quantized_base_with_head() -> nn.Module:
    """A frozen base quantized by torchao (Int8WeightOnlyConfig) under a trainable head."""
    m = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))
    base = _torchao_model("Int8WeightOnlyConfig")
    m[0] = base[0]
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m


def test_the_identity_of_a_quantized_base_goes_through_its_handler(tmp_path: Path) -> None:
    # ModelState(trainable_only=True) digests the base: a subclass there is refused by name too
    src = _quantized_base_with_head()
    with pytest.raises(reshard.ShardingError, match=r"model: 0.weight: cannot save a torchao\.") as e:
        reshard.save({"model": reshard.ModelState(src, trainable_only=True)}, tmp_path / "no")
    assert "invalid python storage" not in str(e.value)
    assert _files(tmp_path) == []
    name = kinds.qualified_name(type(src[0].weight))
    with handler(name, _TorchaoParts()):
        m = reshard.save({"model": reshard.ModelState(src, trainable_only=True)}, tmp_path / "ck").manifest
        assert m is not None and sorted(m.tensors) == ["model.1.bias", "model.1.weight"]
        dst = copy.deepcopy(src)  # the same base, another head
        dst[1] = nn.Linear(16, 4)
        assert not torch.equal(dst[1].weight, src[1].weight)
        reshard.load({"model": reshard.ModelState(dst, trainable_only=True)}, tmp_path / "ck")
        assert torch.equal(dst[1].weight, src[1].weight) and torch.equal(dst[1].bias, src[1].bias)
        # another base (other int8 weights): refused
        other = copy.deepcopy(src)
        with torch.no_grad():
            other[0].weight.qdata.add_(1)
        with pytest.raises(reshard.CheckpointError, match="base"):
            reshard.load({"model": reshard.ModelState(other, trainable_only=True)}, tmp_path / "ck")
