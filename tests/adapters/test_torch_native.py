"""FSDP2 / tensor-parallel / 2-D DTensor state saved and loaded across layouts
on real gloo ranks, through torch.distributed.checkpoint.state_dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _native_fns as fns

CASES = [
    # (save layout, save ranks, load layout, load ranks)
    ("fsdp", 4, "fsdp", 2),
    ("fsdp", 4, "fsdp", 3),
    ("fsdp_tp", 4, "fsdp", 4),
    ("fsdp_tp", 4, "tp", 2),
    ("tp", 4, "fsdp", 2),
]


@pytest.mark.parametrize(("src", "n_src", "dst", "n_dst"), CASES,
                         ids=[f"{a}{n}-to-{b}{m}" for a, n, b, m in CASES])
def test_reshard_torch_native(pool, tmp_path: Path, src: str, n_src: int, dst: str, n_dst: int) -> None:
    path = str(tmp_path / "ckpt")
    before = pool.run(n_src, fns.source, src, path, 2, timeout=120)[0]
    after = pool.run(n_dst, fns.target, dst, path, 2, timeout=120)
    for r in after:
        assert r["step"] == 2
        assert r["lr"] == 0.05  # hyperparameters restored by parameter name
        # model and AdamW state equal to the source's logical tensors, bit-exact
        assert set(r["state"]) == set(before["state"])
        for k, v in before["state"].items():
            assert torch.equal(r["state"][k], v), k
        # the next step: loss equal to the uninterrupted run's (reduction order may
        # differ across layouts: fp32 tolerance), and the updated state too
        assert r["next_loss"] == pytest.approx(before["next_loss"], rel=1e-5, abs=1e-6)
        for k, v in before["after"].items():
            torch.testing.assert_close(r["after"][k], v, rtol=1e-5, atol=1e-6)


def test_cpu_offloaded_state_dict_loads_back_onto_the_model(pool, tmp_path: Path) -> None:
    """StateDictOptions(cpu_offload=True): the loaded host copies are copied back
    into the FSDP2 model and optimizer by set_state_dict."""
    path = str(tmp_path / "ckpt")
    before = pool.run(4, fns.source, "fsdp", path, 2, timeout=120)[0]
    for r in pool.run(2, fns.target, "fsdp", path, 2, True, timeout=120):
        for k, v in before["state"].items():
            assert torch.equal(r["state"][k], v), k
        assert r["next_loss"] == pytest.approx(before["next_loss"], rel=1e-5, abs=1e-6)


def test_partial_dtensor_is_refused(pool, tmp_path: Path) -> None:
    out = pool.run(2, fns_partial, str(tmp_path / "p"))
    assert all("Partial" in m for m in out)


def fns_partial(path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    import reshard

    mesh = init_device_mesh("cpu", (2,))
    dt = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        reshard.save({"x": dt}, path)
    except reshard.ShardingError as e:
        return str(e)
    return "saved"


def fns_dtensor_leaf(path: str, save: bool) -> list[float]:
    """A bare DTensor leaf: Shard(0) over 2 ranks saved, Shard(1) over 3 ranks loaded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import reshard

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    if save:
        dt = distribute_tensor(full, mesh, [Shard(0)])
        reshard.save({"w": dt}, path)
        return []
    dt = distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)])
    reshard.load({"w": dt}, path)
    assert torch.equal(dt.full_tensor(), full)
    return dt.to_local().reshape(-1).tolist()


def test_bare_dtensor_leaf_reshards(pool, tmp_path: Path) -> None:
    p = str(tmp_path / "d")
    pool.run(2, fns_dtensor_leaf, p, True)
    out = pool.run(3, fns_dtensor_leaf, p, False)
    assert sum(len(o) for o in out) == 35
