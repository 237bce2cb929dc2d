"""The typed, pickle-free encoding of plain values (reshard.ondisk.codec)."""

from __future__ import annotations

import collections
import math
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reshard.errors import ManifestError
from reshard.ondisk import codec
from reshard.ondisk.codec import from_json, to_json


def same(a: Any, b: Any) -> bool:
    """Type-exact, order-exact structural equality; NaN equals NaN, -0.0 differs from 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)  # exact (repr round-trips), nan == nan, sign of zero kept
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):  # dict, OrderedDict, Counter: insertion order is kept too
        return list(a.keys()) == list(b.keys()) and all(same(a[k], b[k]) for k in a) and all(
            type(x) is type(y) for x, y in zip(a.keys(), b.keys())
        )
    if isinstance(a, (set, frozenset)):
        return a == b and all(any(x == y and same(x, y) for y in b) for x in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist())
    return a == b


def roundtrip(value: Any) -> Any:
    raw = codec.encode(value)
    assert isinstance(raw, bytes)
    assert b"\x80" not in raw[:1]  # JSON text, not a pickle stream
    out = codec.decode(raw)
    assert same(value, out), (value, out)
    # equal values encode to equal bytes (canonical)
    assert codec.encode(out) == raw
    return out


def test_same_helper_can_fail() -> None:
    assert not same((1, 2), [1, 2])
    assert not same({1: "a"}, {"1": "a"})
    assert not same(0.0, -0.0)
    assert not same(collections.Counter(a=1), {"a": 1})
    assert not same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert not same({1}, {True})
    assert same(float("nan"), float("nan"))


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -7, 1.5, -0.0, "", "héllo ✓", b"", b"\x00\xff\x80", [], (), {},
        (1, "a", (2.5, None)),
        [(1, 2), (3, 4)],
        {0: "zero", 1: "one", -5: "minus five"},
        {(1, 2): "tuple key", "s": 1, 3: [1]},
        {"nested": {"list": [1, {"t": (1, [2, (3,)])}], "int_keys": {10: {20: 30}}}},
        collections.OrderedDict([("b", 1), ("a", 2)]),
        {"a": collections.OrderedDict([(2, "x")])},
        {1, 2, 3}, frozenset({"a", "b"}), {frozenset({1, 2}), (3, 4)},
        set(), frozenset(),
        slice(1, 10, 2), slice(None, 5),
        [float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 1.7976931348623157e308],
        {"lr": float("inf"), "loss": float("nan")},
        2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, 3**200, -(7**150),
        torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool,
        np.float32(1.25), np.float64(-2.5), np.int64(-3), np.uint8(200), np.bool_(True),
        np.int32(7), np.float16(0.5),
        np.arange(6, dtype=np.int16).reshape(2, 3),
        np.array([], dtype=np.float64),
        np.array(3.5),
    ],
)
def test_roundtrip_examples(value: Any) -> None:
    roundtrip(value)


def test_counter_multisteplr_milestones() -> None:
    sched = torch.optim.lr_scheduler.MultiStepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), milestones=[30, 80, 80], gamma=0.5
    )
    sd = sched.state_dict()
    assert type(sd["milestones"]) is collections.Counter
    out = roundtrip(sd)
    assert type(out["milestones"]) is collections.Counter
    assert out["milestones"] == collections.Counter({30: 1, 80: 2})
    assert list(out["milestones"].keys()) == [30, 80]
    # the value is usable: a fresh scheduler takes it
    fresh = torch.optim.lr_scheduler.MultiStepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), milestones=[1]
    )
    fresh.load_state_dict(out)
    assert fresh.milestones == collections.Counter({30: 1, 80: 2})
    assert fresh.gamma == 0.5


def test_numpy_random_state_roundtrip() -> None:
    rs = np.random.RandomState(1234)
    rs.standard_normal(3)  # leaves a cached gaussian
    state = rs.get_state()
    assert isinstance(state, tuple) and state[0] == "MT19937"
    out = roundtrip(state)
    assert type(out) is tuple and len(out) == 5
    assert out[1].dtype == np.uint32 and out[1].shape == (624,)
    other = np.random.RandomState(0)
    other.set_state(out)
    assert other.standard_normal(5).tolist() == rs.standard_normal(5).tolist()


def test_global_numpy_random_state_roundtrip() -> None:
    state = np.random.get_state()
    out = codec.decode(codec.encode(state))
    assert out[0] == state[0] and np.array_equal(out[1], state[1])
    assert out[2:] == state[2:] and [type(x) for x in out[2:]] == [type(x) for x in state[2:]]


def test_numpy_scalar_types_exact() -> None:
    for v in (np.float32(0.1), np.int8(-5), np.uint64(2**64 - 1), np.complex64(1 + 2j)):
        out = codec.decode(codec.encode(v))
        assert type(out) is type(v)
        assert out.tobytes() == v.tobytes()


def test_small_tensor_inside_value() -> None:
    t = torch.tensor([[1.5, -2.0], [float("nan"), 4.0]], dtype=torch.bfloat16)
    out = roundtrip({"t": t, "e": torch.empty(0, 3, dtype=torch.int32), "z": torch.tensor(True)})
    assert out["t"].dtype is torch.bfloat16 and out["t"].shape == (2, 2)
    assert out["e"].shape == (0, 3) and out["z"].shape == ()


def test_nan_and_inf_json_is_standard() -> None:
    raw = codec.encode([float("nan"), float("inf"), float("-inf")])
    assert b"NaN" not in raw and b"Infinity" not in raw
    assert msgspec.json.decode(raw) == [{"$float": "nan"}, {"$float": "inf"}, {"$float": "-inf"}]


def test_user_dict_cannot_spoof_a_tag() -> None:
    value = {"$tuple": [1, 2], "$bigint": "5"}
    out = roundtrip(value)
    assert type(out) is dict and out == value


def test_set_encoding_is_order_independent() -> None:
    a = {3, 1, 2, "x", (1, 2)}
    b = set()
    for x in ["x", (1, 2), 2, 1, 3]:
        b.add(x)
    assert codec.encode(a) == codec.encode(b)


# ----------------------------------------------------------------------------- errors


def test_unknown_tag_is_manifest_error() -> None:
    with pytest.raises(ManifestError, match=r"unknown tag '\$pickle'"):
        codec.decode(b'{"$pickle": "gASVAAAA"}')
    with pytest.raises(ManifestError, match="unknown tag"):
        codec.decode(b'[1, {"$tuple": [{"$evil": 1}]}]')


def test_multi_key_object_is_manifest_error() -> None:
    with pytest.raises(ManifestError, match="single-tag object"):
        codec.decode(b'{"a": 1, "b": 2}')


def test_not_json_is_manifest_error() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        codec.decode(b"\x80\x04K\x01.")  # a pickle of 1


def test_unknown_torch_dtype_is_manifest_error() -> None:
    with pytest.raises(ManifestError, match="unknown torch dtype 'system'"):
        codec.decode(b'{"$torch_dtype": "system"}')
    with pytest.raises(ManifestError, match="unknown torch dtype"):
        codec.decode(b'{"$torch_dtype": "nn"}')


@pytest.mark.parametrize(
    "raw",
    [
        b'{"$tuple": 5}',
        b'{"$dict": [[1]]}',
        b'{"$dict": [[[1, 2], 3]]}',  # unhashable key
        b'{"$bytes": "A"}',  # bad padding
        b'{"$bigint": "12x"}',
        b'{"$float": "abc"}',
        b'{"$ndarray": ["<f4", [3], "AAAA"]}',
        b'{"$npscalar": ["<f8", ""]}',
        b'{"$tensor": ["complex32", [1], "AAAAAAAAAAA="]}',
        b'{"$set": [[1]]}',
    ],
)
def test_malformed_payload_is_manifest_error(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="encoded value"):
        codec.decode(raw)


def test_unsupported_object_is_type_error_naming_path() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"cfg\.a\[1\].*Opaque"):
        codec.encode({"a": [1, Opaque()]}, path="cfg")
    with pytest.raises(TypeError, match=r"sched\.hook.*function"):
        codec.encode({"hook": lambda: 0}, path="sched")
    with pytest.raises(TypeError, match="object arrays"):
        codec.encode(np.array([object()]), path="x")


def test_nothing_pickled() -> None:
    # a value whose pickle would call a function is refused, not reduced
    class Evil:
        def __reduce__(self):  # pragma: no cover - must never run
            raise AssertionError("pickled")

    with pytest.raises(TypeError):
        codec.encode([Evil()])
    assert b"pickle" not in codec.encode({"a": (1, 2)})
    assert "pickle" not in vars(codec)


# ----------------------------------------------------------------------------- property

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**130), max_value=2**130)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_hashable = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=4) | st.binary(max_size=4),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
_values = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(_hashable, inner, max_size=4)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict)
        | st.dictionaries(st.integers(-5, 50), st.integers(-3, 9), max_size=4).map(collections.Counter)
        | st.sets(_hashable, max_size=4)
        | st.frozensets(_hashable, max_size=4)
    ),
    max_leaves=20,
)


@given(_values)
def test_roundtrip_property(value: Any) -> None:
    raw = codec.encode(value)
    out = codec.decode(raw)
    assert same(value, out)
    assert codec.encode(out) == raw


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float_bits_property(x: float) -> None:
    out = codec.decode(codec.encode(x))
    assert type(out) is float
    assert math.isnan(out) if math.isnan(x) else (out == x and math.copysign(1, out) == math.copysign(1, x))


@pytest.mark.parametrize("value, expect", [
    ({"$torch_device": "bogus"}, "RuntimeError: Expected one of"),
    ({"$torch_device": "cuda:-5"}, "malformed"),
    ({"$tensor": ["float32", [3], "AAAA"]}, "3 bytes of data for shape [3] of float32 (12 expected)"),
    ({"$tensor": ["float32", [1 << 20], ""]}, "0 bytes of data for shape [1048576]"),
    ({"$tensor": ["float32", [1 << 40, 1 << 40], ""]}, "0 bytes of data"),
    ({"$tensor": ["float32", [-1], ""]}, "not a list of at most 64 non-negative ints"),
    ({"$tensor": ["float32", ["a"], "AAAA"]}, "not a list"),
    ({"$tensor": ["float32", 3, "AAAA"]}, "not a list"),
])
def test_regression_hostile_payloads_are_manifest_errors(value: Any, expect: str) -> None:
    """A hostile manifest value escaped as torch's raw RuntimeError (a device
    name torch refuses, a tensor payload of the wrong size), and a tensor with
    a shape but no bytes decoded to an uninitialised allocation of that shape
    (garbage values, or gigabytes from a few bytes of JSON). Every one is a
    ManifestError now, and nothing is allocated from a shape alone."""
    with pytest.raises(ManifestError, match="encoded") as ei:
        from_json(value)
    assert expect in str(ei.value), str(ei.value)


def test_empty_tensors_still_decode() -> None:
    import torch

    for t in (torch.empty(0), torch.empty(3, 0, dtype=torch.bfloat16), torch.tensor(2.5)):
        back = from_json(to_json(t))
        assert back.shape == t.shape and back.dtype == t.dtype and torch.equal(back, t)
