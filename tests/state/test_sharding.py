"""ShardedTensor / ShardedObject validation and chunk geometry (single process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reshard
from reshard.errors import ShardingError
from reshard.state.sharding import (
    DTYPE_NAMES,
    ShardedObject,
    ShardedTensor,
    box_intersection,
    dtype_from_safetensors,
    dtype_name,
    itemsize,
    numel,
    safetensors_code,
    safetensors_entry,
    safetensors_view,
    torch_dtype,
)

# ----------------------------------------------------------------------------- ShardedTensor


def test_attributes_are_exposed_and_normalised() -> None:
    data = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    st = ShardedTensor("layer.w", data, global_shape=[4, 3], global_offset=[2, 0], replica_id=[1, 0])
    assert st.fqn == "layer.w"
    assert st.data is data
    assert st.global_shape == (4, 3) and type(st.global_shape) is tuple
    assert st.global_offset == (2, 0) and type(st.global_offset) is tuple
    assert st.local_shape == (2, 3)  # defaults to data.shape
    assert st.flattened_range is None
    assert st.flat_bounds is None
    assert st.replica_id == (1, 0)
    assert st.dtype is torch.float32
    # the public facade exports the same class
    assert reshard.ShardedTensor is ShardedTensor


def test_flattened_range_fields() -> None:
    data = torch.arange(4, dtype=torch.float32)
    st = ShardedTensor("p", data, global_shape=(4, 6), global_offset=(2, 0), local_shape=(2, 6),
                       flattened_range=slice(None, 4))
    assert st.flattened_range == slice(0, 4)  # start normalised to 0
    assert st.flat_bounds == (0, 4)
    assert st.local_shape == (2, 6)
    st2 = ShardedTensor("p", torch.zeros(5), global_shape=(4, 6), global_offset=(0, 0),
                        local_shape=(4, 6), flattened_range=slice(19, 24, 1))
    assert st2.flat_bounds == (19, 24)


def test_records_are_frozen() -> None:
    st = ShardedTensor("w", torch.zeros(2), global_shape=(2,), global_offset=(0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.fqn = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.global_offset = (1,)  # type: ignore[misc]
    ob = ShardedObject("rng", {"a": 1}, global_shape=(2,), global_offset=(1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ob.value = 3  # type: ignore[misc]


def test_zero_dim_and_empty_shards_are_valid() -> None:
    st = ShardedTensor("step", torch.tensor(3.0), global_shape=(), global_offset=())
    assert st.local_shape == () and st.global_shape == ()
    # an empty shard may sit at the end of a dimension (offset == size)
    e = ShardedTensor("w", torch.zeros(0), global_shape=(6,), global_offset=(6,))
    assert e.local_shape == (0,)
    e2 = ShardedTensor("w", torch.zeros(0, 3), global_shape=(0, 3), global_offset=(0, 0))
    assert e2.local_shape == (0, 3)


@pytest.mark.parametrize(
    ("data", "kwargs", "needle"),
    [
        # offset + local_shape past global_shape
        (torch.zeros(2, 3), dict(global_shape=(4, 3), global_offset=(3, 0)), "dim 0"),
        (torch.zeros(2, 3), dict(global_shape=(4, 3), global_offset=(0, 1)), "dim 1"),
        # an empty shard still must not start past the end
        (torch.zeros(0), dict(global_shape=(4,), global_offset=(5,)), "exceeds global_shape"),
        # negative offset
        (torch.zeros(2), dict(global_shape=(4,), global_offset=(-1,)), "negative"),
        # rank of offset differs from rank of global_shape
        (torch.zeros(2), dict(global_shape=(4,), global_offset=(0, 0)), "dims"),
        # local_shape rank differs from global_shape rank
        (torch.zeros(2), dict(global_shape=(4, 1), global_offset=(0, 0)), "differ in rank"),
        # local_shape does not match data
        (torch.zeros(2, 3), dict(global_shape=(4, 3), global_offset=(0, 0), local_shape=(3, 2)),
         "does not match data shape"),
        # offsets not ints
        (torch.zeros(2), dict(global_shape=4, global_offset=(0,)), "sequence of ints"),
    ],
)
def test_geometry_errors(data: torch.Tensor, kwargs: dict, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle) as ei:
        ShardedTensor("enc.w", data, **kwargs)
    assert "enc.w" in str(ei.value)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize(
    ("data", "local_shape", "fr", "needle"),
    [
        (torch.zeros(7), (2, 3), slice(0, 7), "outside the box of 6"),
        (torch.zeros(1), (2, 3), slice(5, 4), "outside the box"),
        (torch.zeros(2), (2, 3), slice(-1, 1), "outside the box"),
        (torch.zeros(3), (2, 3), slice(0, None), "outside the box"),
        (torch.zeros(2), (2, 3), slice(0, 4, 2), "step 1"),
        (torch.zeros(2), (2, 3), (0, 2), "must be a slice"),
        (torch.zeros(1, 2), (2, 3), slice(0, 2), "must be 1-D of length 2"),
        (torch.zeros(3), (2, 3), slice(0, 2), "must be 1-D of length 2"),
        (torch.zeros(2), None, slice(0, 2), "needs local_shape"),
    ],
)
def test_bad_flattened_range(data: torch.Tensor, local_shape, fr, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle) as ei:
        ShardedTensor("opt.m", data, global_shape=(2, 3), global_offset=(0, 0),
                      local_shape=local_shape, flattened_range=fr)
    assert "opt.m" in str(ei.value)


@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fnuz])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    data = torch.zeros(2, dtype=dtype)
    with pytest.raises(ShardingError, match="is not supported") as ei:
        ShardedTensor("c", data, global_shape=(2,), global_offset=(0,))
    assert str(dtype) in str(ei.value)


@pytest.mark.parametrize(
    ("fqn", "data", "needle"),
    [
        ("", torch.zeros(1), "non-empty str"),
        (3, torch.zeros(1), "non-empty str"),
        ("w", [1.0], "must be a torch.Tensor"),
    ],
)
def test_bad_fqn_or_data(fqn, data, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle):
        ShardedTensor(fqn, data, global_shape=(1,), global_offset=(0,))


def test_from_rank_offsets() -> None:
    data = torch.zeros(3, 4)
    st = ShardedTensor.from_rank_offsets("w", data, (0, 2, 4), (1, 1, 2), replica_id=5)
    assert st.global_shape == (12, 8)
    assert st.global_offset == (6, 4)
    assert st.local_shape == (3, 4)
    assert st.replica_id == 5


# ----------------------------------------------------------------------------- ShardedObject


def test_sharded_object_fields() -> None:
    ob = ShardedObject("rng", {"seed": 1}, global_shape=[2, 4], global_offset=[1, 3], replica_id=[0, 1])
    assert ob.key == "rng" and ob.fqn == "rng"
    assert ob.value == {"seed": 1}
    assert ob.global_shape == (2, 4) and ob.global_offset == (1, 3)
    assert ob.replica_id == (0, 1)
    single = ShardedObject("cursor", 5)
    assert single.global_shape == () and single.global_offset == () and single.replica_id == 0


@pytest.mark.parametrize(
    ("key", "shape", "offset", "needle"),
    [
        ("rng", (4,), (4,), "not inside the object grid"),
        ("rng", (2, 2), (0,), "not inside the object grid"),
        ("rng", (), (0,), "not inside the object grid"),
        ("rng", (2,), (-1,), "negative"),
        ("", (), (), "non-empty str"),
    ],
)
def test_sharded_object_errors(key: str, shape, offset, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle):
        ShardedObject(key, 1, global_shape=shape, global_offset=offset)


# ----------------------------------------------------------------------------- geometry, dtypes


def test_box_intersection() -> None:
    assert box_intersection((0, 0), (4, 4), (2, 3), (4, 4)) == ((2, 3), (2, 1))
    assert box_intersection((0,), (4,), (4,), (2,)) is None  # touching, half-open
    assert box_intersection((0, 0), (4, 4), (1, 4), (1, 1)) is None
    assert box_intersection((), (), (), ()) == ((), ())
    assert box_intersection((1, 1), (2, 2), (0, 0), (5, 5)) == ((1, 1), (2, 2))
    assert box_intersection((0,), (0,), (0,), (3,)) is None  # empty box


def test_numel_and_dtype_tables() -> None:
    assert numel(()) == 1 and numel((3, 0)) == 0 and numel((2, 3, 4)) == 24
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert torch_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    assert safetensors_code("float8_e5m2") == "F8_E5M2"
    assert dtype_from_safetensors("BOOL") == "bool"
    assert itemsize("int16") == 2 and itemsize("float64") == 8 and itemsize("bool") == 1
    for name in DTYPE_NAMES:
        assert dtype_name(torch_dtype(name)) == name
        if name != "complex128":  # the one dtype stored as a view (float64 pairs)
            assert dtype_from_safetensors(safetensors_code(name)) == name
    assert dtype_from_safetensors("C64") == "complex64" and dtype_from_safetensors("F64") == "float64"
    assert safetensors_entry("complex128", (4, 3)) == ("F64", [4, 3, 2])
    assert safetensors_view("complex128", "F64", [4, 3, 2]) == ("complex128", (4, 3))
    with pytest.raises(ShardingError, match="cannot hold a complex128 view"):
        safetensors_view("complex128", "F32", [4, 2])
    with pytest.raises(ShardingError, match="unknown dtype name 'complex32'"):
        torch_dtype("complex32")
    with pytest.raises(ShardingError, match="unsupported safetensors dtype 'C32'"):
        dtype_from_safetensors("C32")
