"""The walk of a state tree (reshard.state.tree.flatten) on one mixed state:
every kind of leaf in the order the walk meets it (depth first, each mapping
in its own order), the version-1 names and subtree kinds it records, the
state dict a Stateful gets back at load, and no reference cycle left behind."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from reshard import ModelState, ShardedObject, ShardedTensor, ShardingError
from reshard.state.tree import flatten


class _Counter:
    """A Stateful whose state dict holds a tensor, a value and a grid element,
    named ``old.<name>`` by format version 1."""

    _reshard_v1_names = (("old.", ""),)

    def __init__(self) -> None:
        self.got: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"w": torch.ones(2), "n": 3, "obj": ShardedObject("pos", 1, global_shape=(2,), global_offset=(1,))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.got = sd


def _chunk(fqn: str, row0: int) -> ShardedTensor:
    """Rows ``[row0, row0 + 2)`` of a 4 x 2 tensor ``fqn``."""
    return ShardedTensor(fqn, torch.ones(2, 2), global_shape=(4, 2), global_offset=(row0, 0))


def _mixed() -> dict[str, Any]:
    return {
        "model": {"b": torch.zeros(2), "a": torch.ones(2, 2), "grid": _chunk("g.w", 2)},
        "views": [_chunk("v", 0), _chunk("v", 2)],
        "cfg": {"lr": 0.1, "names": ["x", "y"]},
        "mixed": [torch.ones(1), 5, {"deep": np.arange(2.0)}],
        "counter": _Counter(),
        "optim": {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 7,
    }


@pytest.mark.parametrize("loading", [False, True])
def test_a_mixed_state_flattens_to_these_keys_in_this_order(loading: bool) -> None:
    state = _mixed()
    leaves = flatten(state, loaded_values={} if loading else None, module_adapter=ModelState)
    assert [(t.fqn, t.global_offset) for t in leaves.tensors] == [
        ("model.g.w", (2, 0)), ("v", (0, 0)), ("v", (2, 0))]
    assert [t.data for t in leaves.tensors][1] is state["views"][0].data  # renamed copies, same memory
    assert list(leaves.plain) == ["model.b", "model.a", "mixed.0", "mixed.2.deep", "counter.w",
                                  "optim.state.0.momentum_buffer"]
    assert leaves.plain["model.a"] is state["model"]["a"]
    assert type(leaves.plain["mixed.2.deep"]) is torch.Tensor  # a NumPy array, as a tensor over its memory
    assert list(leaves.values.items()) == [("cfg", {"lr": 0.1, "names": ["x", "y"]}), ("mixed.1", 5),
                                           ("counter.n", 3), ("optim.param_groups", [{"lr": 0.1, "params": [0]}]),
                                           ("step", 7)]
    assert [(o.key, o.global_offset, o.value) for o in leaves.objects] == [("counter.pos", (1,), 1)]
    assert list(leaves.legacy.items()) == [("model.g.w", "g.w"), ("counter.pos", "old.pos")]
    assert leaves.dtensors == {}
    # subtree kinds are recorded at a save only
    assert list(leaves.adapters.items()) == ([] if loading else [
        ("", "tensors"), ("model", "tensors"), ("mixed.2", "tensors"),
        ("counter", f"Stateful:{__name__}._Counter"), ("optim", "optimizer")])
    assert [(p, o) for p, o, _ in leaves.statefuls] == ([("counter", state["counter"])] if loading else [])


def test_a_stateful_gets_its_state_dict_back_with_the_loaded_values_and_objects() -> None:
    state = _mixed()
    values: dict[str, Any] = {}
    objects: dict[tuple[str, tuple[int, ...]], Any] = {}
    leaves = flatten(state, loaded_values=values, loaded_objects=objects, module_adapter=ModelState)
    values.update({k: ("loaded", k) for k in leaves.values})  # filled after the walk, as a load does
    objects[("counter.pos", (1,))] = "loaded pos"
    (_, _, restore), = leaves.statefuls
    restore()
    got = state["counter"].got
    assert list(got) == ["w", "n", "obj"]
    assert got["w"] is leaves.plain["counter.w"]  # the destination filled in place
    assert got["n"] == ("loaded", "counter.n")
    assert isinstance(got["obj"], ShardedObject) and got["obj"].key == "pos" and got["obj"].value == "loaded pos"


def test_the_walk_names_both_tree_paths_of_a_collision() -> None:
    state = {"counter.w": torch.ones(2), "counter": _Counter()}
    with pytest.raises(ShardingError, match=r"checkpoint key 'counter.w' is given by two leaves: "
                                            r"state\['counter.w'\] and state\['counter'\]<_Counter>"
                                            r"\.state_dict\(\)\['w'\]"):
        flatten(state, module_adapter=ModelState)


@pytest.mark.parametrize("loading", [False, True])
def test_dropping_the_leaves_frees_them_without_the_cyclic_collector(loading: bool) -> None:
    # a reference cycle through the walk would keep every tensor of the state
    # alive after the caller drops the leaves, until the cyclic collector runs
    state = _mixed()
    gc.collect()
    gc.disable()
    try:
        leaves = flatten(state, loaded_values={} if loading else None, module_adapter=ModelState)
        assert len(leaves.statefuls) == (1 if loading else 0)
        ref = weakref.ref(leaves)
        del leaves
        assert ref() is None
    finally:
        gc.enable()
