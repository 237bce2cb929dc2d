"""DCP interop, whole (issue 10 item 2): a checkpoint written by
``torch.distributed.checkpoint.save`` from ``get_state_dict`` (and from an
AppState-style Stateful) plus plain Stateful objects (LR scheduler, a
dataloader, the step) restores into reshard's adapters with ``strict=True`` on
another rank count: weights, Adam moments, param-group hyperparameters (DCP
keeps them by group position), scheduler and dataloader state; the next step
matches an uninterrupted run bit for bit. ``inspect``, ``verify`` and ``ls``
understand DCP folders."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import reshard
from reshard.adapters.torch_native import TorchState
from reshard.cli import main
from reshard.testing.pool import WorkerPool


class Loader:
    """A dataloader-like Stateful with nested state (as torchdata's StatefulDataLoader)."""

    def __init__(self) -> None:
        self.state = {"sampler": {"epoch": 0, "seed": 0, "order": [0, 1]}, "consumed": 0}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = sd


class AppState:
    """The Stateful wrapper of DCP's tutorial: ``get_state_dict`` at save."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("not used")


def _setup(seed: int, lrs: tuple[float, float]) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": lrs[0]},
                             {"params": model[2].parameters(), "lr": lrs[1], "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: Any, opt: Any, sched: Any, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(4, 5, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _reference(steps: int) -> tuple[Any, Any, Any]:
    model, opt, sched = _setup(0, (1e-2, 5e-3))
    _train(model, opt, sched, range(steps))
    return model, opt, sched


SAVED_AT = 3


def r_dcp_save(path: str, app_path: str) -> None:
    """Every rank holds the same (replicated) training state; DCP deduplicates."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _reference(SAVED_AT)
    loader = Loader()
    loader.state = {"sampler": {"epoch": 1, "seed": 3, "order": [4, 2, 7]}, "consumed": 24}
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "sched": sched, "data": loader, "step": SAVED_AT},
                 checkpoint_id=path)
        dcp.save({"app": AppState(model, opt), "sched": sched, "step": SAVED_AT}, checkpoint_id=app_path)


def _check(model: Any, opt: Any, sched: Any) -> list[str]:
    ref_m, ref_o, ref_s = _reference(SAVED_AT)
    bad = []
    for (n, p), q in zip(model.named_parameters(), ref_m.parameters(), strict=True):
        if not torch.equal(p, q):
            bad.append(f"weight {n}")
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if not torch.equal(opt.state[p][k], ref_o.state[q][k]):
                bad.append(f"{k} of {n}")
    for g, h in zip(opt.param_groups, ref_o.param_groups, strict=True):
        for k in ("lr", "weight_decay", "betas", "eps", "initial_lr"):
            if g[k] != h[k]:
                bad.append(f"param group {k}: {g[k]} != {h[k]}")
    if sched.state_dict() != ref_s.state_dict():
        bad.append(f"scheduler {sched.state_dict()} != {ref_s.state_dict()}")
    # next-step parity with the uninterrupted run
    _train(model, opt, sched, range(SAVED_AT, SAVED_AT + 2))
    _train(ref_m, ref_o, ref_s, range(SAVED_AT, SAVED_AT + 2))
    for (n, p), q in zip(model.named_parameters(), ref_m.parameters(), strict=True):
        if not torch.equal(p, q):
            bad.append(f"after 2 more steps: {n}")
    return bad


def r_restore_adapters(path: str) -> list[str]:
    model, opt, sched = _setup(9, (0.3, 0.3))  # another init and other hyperparameters
    ms = reshard.ModelState(model)
    loader = Loader()
    state = {"model": ms, "optim": reshard.OptimizerState(ms, opt), "sched": sched, "data": loader,
             "step": 0}
    res = reshard.load(state, path)  # strict
    bad = _check(model, opt, sched)
    if res.values["step"] != SAVED_AT:
        bad.append(f"step {res.values['step']}")
    if loader.state != {"sampler": {"epoch": 1, "seed": 3, "order": [4, 2, 7]}, "consumed": 24}:
        bad.append(f"loader {loader.state}")
    return [f"rank {dist.get_rank()}: {b}" for b in bad]


def r_restore_torchstate(path: str) -> list[str]:
    model, opt, sched = _setup(9, (0.3, 0.3))
    reshard.load({"app": TorchState(model, opt), "sched": sched, "step": 0}, path)  # strict
    return [f"rank {dist.get_rank()}: {b}" for b in _check(model, opt, sched)]


@pytest.fixture(scope="module")
def dcp_ckpts(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("dcp")
    paths = str(d / "plain"), str(d / "app")
    pool.run(2, r_dcp_save, *paths)
    return paths


@pytest.mark.parametrize("world", [1, 3])
def test_dcp_state_restores_strictly_into_adapters(pool: WorkerPool, dcp_ckpts: tuple[str, str],
                                                   world: int) -> None:
    assert pool.run(world, r_restore_adapters, dcp_ckpts[0]) == [[]] * world


def test_dcp_appstate_restores_strictly_into_torchstate(pool: WorkerPool,
                                                        dcp_ckpts: tuple[str, str]) -> None:
    assert pool.run(3, r_restore_torchstate, dcp_ckpts[1]) == [[]] * 3


def test_dcp_hyperparameter_keys_are_by_group_position(dcp_ckpts: tuple[str, str]) -> None:
    """The keys torch writes: ``optim.param_groups.<i>.<name>`` (and ``...params``
    listing each group's fqns); reshard saves ``optim.param_group.<fqn>``."""
    m = reshard.inspect(dcp_ckpts[0])
    assert {"optim.param_groups.0.lr", "optim.param_groups.1.lr", "optim.param_groups.1.params",
            "sched.last_epoch", "data.sampler.epoch", "step"} <= set(m.values or {})
    assert "optim.state.0.weight.exp_avg" in m.tensors and "model.2.bias" in m.tensors


def test_cli_inspect_verify_ls_understand_dcp(dcp_ckpts: tuple[str, str], tmp_path: Path) -> None:
    path = dcp_ckpts[0]
    r = CliRunner().invoke(main, ["inspect", path], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "DCP checkpoint" in r.stdout and "optim.state.0.weight.exp_avg" in r.stdout
    r = CliRunner().invoke(main, ["verify", path], catch_exceptions=False)
    assert r.exit_code == 0 and r.stdout.startswith("OK"), r.output
    assert "DCP has no checksums" in r.stdout
    r = CliRunner().invoke(main, ["ls", str(Path(path).parent)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "plain" in r.stdout and "app" in r.stdout and "DCP" in r.stdout
    # a truncated DCP data file: the structure check fails (exit 1)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    data = sorted(broken.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-16])
    r = CliRunner().invoke(main, ["verify", str(broken)], catch_exceptions=False)
    assert r.exit_code == 1 and "FAILED" in r.stdout, r.output
