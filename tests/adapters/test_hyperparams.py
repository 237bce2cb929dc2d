"""Optimizer hyperparameters are never changed silently: a changed group
partition (a split, a merge, another partition) raises under the default rule,
naming groups, parameters and values; a changed value with the same partition
is restored and reported in ``LoadResult.notes``; ``"saved"`` / ``"current"``
do what they say for every partition; ``"current"`` with a restored LR
scheduler continues the restored position from the constructed rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import reshard
from reshard import ModelState, OptimizerState, ShardingError
from reshard.adapters.torch_native import TorchState


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)


def _step(m: Net, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    m.out(m.norm(m.fc(torch.ones(2, 3)))).square().sum().backward()
    opt.step()


def _train(m: Net, opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[list[float]]:
    """``steps`` optimizer + scheduler steps; the group lrs after each."""
    lrs = []
    for _ in range(steps):
        _step(m, opt)
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def _state(adapter: str, m: Net, opt: torch.optim.Optimizer, rule: str | None = None,
           **extra: Any) -> dict[str, Any]:
    kw = {} if rule is None else {"hyperparams": rule}
    if adapter == "torch":
        return {"train": TorchState(m, opt, **kw), **extra}
    return {"model": ModelState(m), "optim": OptimizerState(m, opt, **kw), **extra}


def _decay_split(m: Net, wd: float = 0.01) -> list[dict[str, Any]]:
    """The usual decay / no-decay groups: biases and norms at 0.0."""
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    no = [p for n, p in m.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    return [{"params": decay, "weight_decay": wd}, {"params": no, "weight_decay": 0.0}]


def _groups(opt: torch.optim.Optimizer, m: Net) -> list[tuple[list[str], float]]:
    names = {id(p): n for n, p in m.named_parameters()}
    return [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in opt.param_groups]


def _saved_one_group(tmp_path: Path, adapter: str) -> Path:
    return _saved_one_group_and_model(tmp_path, adapter)[0]


def _saved_one_group_and_model(tmp_path: Path, adapter: str) -> tuple[Path, Net]:
    src = Net()
    opt = torch.optim.AdamW(src.parameters(), lr=1e-3, weight_decay=0.01)
    _step(src, opt)
    reshard.save(_state(adapter, src, opt), tmp_path / adapter)
    return tmp_path / adapter, src


@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_decay_split_of_one_saved_group_raises_by_default(tmp_path: Path, adapter: str) -> None:
    """Saved with one AdamW group (weight_decay 0.01), resumed with the
    decay / no-decay split: the load raises naming both groups, their
    parameters and values (it restored 0.01 into the no-decay group, silently);
    "saved" gives every parameter 0.01; "current" keeps 0.0 for the norms."""
    ckpt, src = _saved_one_group_and_model(tmp_path, adapter)
    dst = Net(1)
    opt = torch.optim.AdamW(_decay_split(dst), lr=1e-3)
    before = dst.fc.weight.detach().clone()
    with pytest.raises(ShardingError) as ei:
        reshard.load(_state(adapter, dst, opt), ckpt)
    msg = str(ei.value)
    assert "weight_decay=0.01" in msg and "weight_decay=0.0" in msg, msg
    assert "group 0" in msg and "group 1" in msg and "norm.weight" in msg and "fc.weight" in msg, msg
    assert "hyperparams='saved'" in msg and "hyperparams='current'" in msg
    assert "every target is unchanged" in msg and torch.equal(dst.fc.weight, before)
    assert [wd for _, wd in _groups(opt, dst)] == [0.01, 0.0] and dict(opt.state) == {}
    for rule, want in (("saved", [0.01, 0.01]), ("current", [0.01, 0.0])):
        dst = Net(1)
        opt = torch.optim.AdamW(_decay_split(dst), lr=1e-3)
        reshard.load(_state(adapter, dst, opt, rule), ckpt)
        assert [wd for _, wd in _groups(opt, dst)] == want, rule
        assert torch.equal(dst.fc.weight, src.fc.weight), rule  # the model is the saved one
        assert opt.state[dst.norm.weight]["exp_avg"].abs().sum() > 0, rule


@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_changed_value_same_partition_is_restored_and_reported(tmp_path: Path, adapter: str) -> None:
    ckpt = _saved_one_group(tmp_path, adapter)
    dst = Net(1)
    opt = torch.optim.AdamW(dst.parameters(), lr=3e-3, weight_decay=0.01)
    res = reshard.load(_state(adapter, dst, opt), ckpt)
    assert opt.param_groups[0]["lr"] == 1e-3  # the saved value, as DCP restores it
    key = "train.optim.hyperparams_restored" if adapter == "torch" else "optim.hyperparams_restored"
    assert res.notes[key] == {"group 0": {"lr": {"constructed": 3e-3, "saved": 1e-3}}}
    # the same values: nothing to report
    dst = Net(1)
    opt = torch.optim.AdamW(dst.parameters(), lr=1e-3, weight_decay=0.01)
    res = reshard.load(_state(adapter, dst, opt), ckpt)
    assert not any("hyperparams" in k for k in res.notes)


def test_another_partition_raises_and_saved_splits(tmp_path: Path) -> None:
    """Saved {fc.*, norm.*} at wd 0.1 and {out.*} at wd 0.2; loaded as
    {fc.*} and {norm.*, out.*}: group 1 merges two saved groups and the first
    saved group is split over groups constructed differently."""
    src = Net()
    sp = dict(src.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [sp["fc.weight"], sp["fc.bias"], sp["norm.weight"], sp["norm.bias"]], "weight_decay": 0.1},
        {"params": [sp["out.weight"], sp["out.bias"]], "weight_decay": 0.2}])
    _step(src, opt)
    reshard.save(_state("optim", src, opt), tmp_path / "ck")
    dst = Net(1)
    dp = dict(dst.named_parameters())
    groups = [{"params": [dp["fc.weight"], dp["fc.bias"]], "weight_decay": 0.3},
              {"params": [dp["norm.weight"], dp["norm.bias"], dp["out.weight"], dp["out.bias"]],
               "weight_decay": 0.4}]
    opt = torch.optim.AdamW(groups)
    with pytest.raises(ShardingError) as ei:
        reshard.load(_state("optim", dst, opt), tmp_path / "ck")
    msg = str(ei.value)
    assert "param group 1 holds parameters saved with different hyperparameters" in msg, msg
    assert "norm.weight" in msg and "out.bias" in msg and "weight_decay=0.2" in msg, msg
    assert "split over param groups" in msg, msg
    dst = Net(1)
    dp = dict(dst.named_parameters())
    opt = torch.optim.AdamW([{**g, "params": [dp[n] for n in ns]} for g, ns in zip(
        groups, [["fc.weight", "fc.bias"], ["norm.weight", "norm.bias", "out.weight", "out.bias"]],
        strict=True)])
    res = reshard.load(_state("optim", dst, opt, "saved"), tmp_path / "ck")
    assert _groups(opt, dst) == [(["fc.weight", "fc.bias"], 0.1), (["norm.weight", "norm.bias"], 0.1),
                                 (["out.weight", "out.bias"], 0.2)]
    assert res.notes["optim.hyperparams_restored"]["group 1"] == {"split_into": 2}


# ----------------------------------------------------------------------------- schedulers

N = 5  # steps before the save


def _lambda(k: int) -> float:
    return min(1.0, (k + 1) / 3) * 0.9 ** k  # warm-up then decay


def _sched(kind: str, opt: torch.optim.Optimizer) -> Any:
    L = torch.optim.lr_scheduler
    if kind == "lambda":
        return L.LambdaLR(opt, _lambda)
    if kind == "sequential":  # warm-up then step decay: the sub-schedulers hold the bases
        return L.SequentialLR(opt, [L.LinearLR(opt, 0.5, total_iters=3), L.StepLR(opt, 2, 0.5)],
                              milestones=[3])
    return L.StepLR(opt, step_size=2, gamma=0.5)


def _run(lr: float, kind: str, steps: int) -> list[float]:
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    return [x[0] for x in _train(m, opt, _sched(kind, opt), steps)]


@pytest.mark.parametrize("kind", ["lambda", "step", "sequential"])
@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_current_rebases_a_restored_scheduler_on_the_constructed_lr(tmp_path: Path, kind: str,
                                                                    adapter: str) -> None:
    """Saved at lr 1e-3 after N steps of a schedule. Resumed with lr 2e-3 and
    5e-4 under "current": the schedule continues from step N on the new base
    (the lrs of a run started at the new lr); under "saved" (and the default),
    the old schedule continues exactly."""
    src = Net()
    opt = torch.optim.AdamW(src.parameters(), lr=1e-3)
    s = _sched(kind, opt)
    _train(src, opt, s, N)
    reshard.save(_state(adapter, src, opt, sched=s), tmp_path / "ck")
    for rule, lr in (("current", 2e-3), ("current", 5e-4), ("saved", 2e-3), (None, 1e-3)):
        dst = Net(1)
        opt = torch.optim.AdamW(dst.parameters(), lr=lr)
        s = _sched(kind, opt)
        reshard.load(_state(adapter, dst, opt, rule, sched=s), tmp_path / "ck")
        got = [opt.param_groups[0]["lr"]]
        got += [lr[0] for lr in _train(dst, opt, s, 3)]
        want = _run(lr if rule == "current" else 1e-3, kind, N + 3)[N - 1:]
        assert got == pytest.approx(want, rel=1e-12), (rule, lr)
        for x in [s, *getattr(s, "_schedulers", [])]:
            if hasattr(x, "base_lrs"):
                assert x.base_lrs == [lr if rule == "current" else 1e-3]


def _dcp_target(adapter: str, m: Net, opt: torch.optim.Optimizer, rule: str = "error") -> dict[str, Any]:
    if adapter == "torch":
        return {"app": TorchState(m, opt, hyperparams=rule)}  # type: ignore[arg-type]
    return {"model": ModelState(m), "optim": OptimizerState(m, opt, hyperparams=rule)}  # type: ignore[arg-type]


@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_dcp_checkpoint_split_raises_before_writing(tmp_path: Path, adapter: str) -> None:
    """The same rule for a DCP checkpoint (hyperparameters by group position):
    one saved group resumed with the decay / no-decay split raises before any
    target is written; "saved" restores 0.01 everywhere."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    src = Net()
    opt = torch.optim.AdamW(src.parameters(), lr=1e-3, weight_decay=0.01)
    _step(src, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(src, opt)
        tree = {"model": msd, "optim": osd}
        dcp.save({"app": tree} if adapter == "torch" else tree, checkpoint_id=str(tmp_path / "dcp"))
    dst = Net(1)
    before = dst.fc.weight.detach().clone()
    opt = torch.optim.AdamW(_decay_split(dst), lr=1e-3)
    with pytest.raises(ShardingError) as ei:
        reshard.load(_dcp_target(adapter, dst, opt), str(tmp_path / "dcp"))
    msg = str(ei.value)
    assert "every target is unchanged" in msg and "weight_decay=0.0" in msg, msg
    assert torch.equal(dst.fc.weight, before)
    dst = Net(1)
    opt = torch.optim.AdamW(_decay_split(dst), lr=1e-3)
    reshard.load(_dcp_target(adapter, dst, opt, "saved"), str(tmp_path / "dcp"))
    assert [wd for _, wd in _groups(opt, dst)] == [0.01, 0.01]
    assert torch.equal(dst.fc.weight, src.fc.weight)


def _sched2(kind: str, opt: torch.optim.Optimizer) -> Any:
    """Schedulers with per-group lists beside ``base_lrs``, built from the groups' lr."""
    L = torch.optim.lr_scheduler
    lrs = [g["lr"] for g in opt.param_groups]
    if kind == "warm_restarts":
        return L.CosineAnnealingWarmRestarts(opt, T_0=3)
    if kind == "cyclic":  # max_lrs: a list the groups do not hold
        return L.CyclicLR(opt, base_lr=[x / 10 for x in lrs], max_lr=lrs, step_size_up=4,
                          cycle_momentum=False)
    if kind == "onecycle":
        return L.OneCycleLR(opt, max_lr=lrs, total_steps=20)
    return _sched(kind, opt)


def _run_groups(lr: float, kind: str, steps: int, split: bool) -> list[list[float]]:
    m = Net()
    opt = torch.optim.AdamW(_decay_split(m) if split else m.parameters(), lr=lr)
    return _train(m, opt, _sched2(kind, opt), steps)


@pytest.mark.parametrize("kind", ["lambda", "warm_restarts", "cyclic", "onecycle", "sequential"])
@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_schedulers_follow_a_partition_change(tmp_path: Path, kind: str, adapter: str) -> None:
    """Saved with one AdamW group (lr 1e-3) after N steps of a schedule;
    resumed with decay / no-decay groups at lr 5e-4. Every per-group list of
    the restored scheduler has one entry per group and it steps on: under
    "saved" each group continues the saved schedule, under "current" each
    follows an uninterrupted run of the new groups (CyclicLR's new peak too)."""
    src = Net()
    opt = torch.optim.AdamW(src.parameters(), lr=1e-3)
    s = _sched2(kind, opt)
    _train(src, opt, s, N)
    reshard.save(_state(adapter, src, opt, sched=s), tmp_path / "ck")
    for rule in ("saved", "current"):
        dst = Net(1)
        opt = torch.optim.AdamW(_decay_split(dst), lr=5e-4)
        s = _sched2(kind, opt)
        reshard.load(_state(adapter, dst, opt, rule, sched=s), tmp_path / "ck")
        assert len(opt.param_groups) == 2
        for x in [s, *getattr(s, "_schedulers", [])]:
            for a in ("base_lrs", "_last_lr", "max_lrs", "lr_lambdas"):
                if isinstance(getattr(x, a, None), list):
                    assert len(getattr(x, a)) == 2, (rule, type(x).__name__, a)
        got = [[g["lr"] for g in opt.param_groups]]
        got += _train(dst, opt, s, 3)
        if rule == "saved":
            want = [[x[0]] * 2 for x in _run_groups(1e-3, kind, N + 3, split=False)[N - 1:]]
        else:
            want = _run_groups(5e-4, kind, N + 3, split=True)[N - 1:]
        assert sum(got, []) == pytest.approx(sum(want, []), rel=1e-12), rule


def test_cyclic_current_without_split_continues_with_the_new_peak(tmp_path: Path) -> None:
    """One group saved and resumed, CyclicLR constructed at half the saved
    rates: under "current" the restored cycle peaks at the constructed max_lr."""
    src = Net()
    opt = torch.optim.AdamW(src.parameters(), lr=1e-3)
    s = _sched2("cyclic", opt)
    _train(src, opt, s, N)
    reshard.save(_state("optim", src, opt, sched=s), tmp_path / "ck")
    dst = Net(1)
    opt = torch.optim.AdamW(dst.parameters(), lr=5e-4)
    s = _sched2("cyclic", opt)
    reshard.load(_state("optim", dst, opt, "current", sched=s), tmp_path / "ck")
    assert s.max_lrs == [5e-4] and s.base_lrs == [5e-5]
    got = [lr[0] for lr in _train(dst, opt, s, 8)]
    assert max(got) == pytest.approx(5e-4, rel=1e-12)
    assert got == pytest.approx([x[0] for x in _run_groups(5e-4, "cyclic", N + 8, split=False)[N:]], rel=1e-12)

    def cyc(o: torch.optim.Optimizer) -> Any:  # the same base, only a lower peak
        return torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-4, max_lr=5e-4, step_size_up=4,
                                                 cycle_momentum=False)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    s = cyc(opt)
    want = [lr[0] for lr in _train(ref, opt, s, N + 3)]
    dst = Net(1)
    opt = torch.optim.AdamW(dst.parameters(), lr=1e-3)
    s = cyc(opt)
    reshard.load(_state("optim", dst, opt, "current", sched=s), tmp_path / "ck")
    got = [opt.param_groups[0]["lr"]]  # the lr at the restored position too
    got += [lr[0] for lr in _train(dst, opt, s, 3)]
    assert got == pytest.approx(want[N - 1:], rel=1e-12)


def test_scheduler_list_the_groups_cannot_tell_apart_raises(tmp_path: Path) -> None:
    """Saved with decay / no-decay groups at one base lr but CyclicLR peaks of
    their own; resumed with the decay group split in two under "saved": which
    saved peak a new group had is unknown, and the load says so (naming the
    scheduler, the list and the ways out) instead of guessing."""
    src = Net()
    opt = torch.optim.AdamW(_decay_split(src), lr=1e-3)
    s = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-4, max_lr=[1e-3, 2e-3], step_size_up=4,
                                          cycle_momentum=False)
    _train(src, opt, s, N)
    reshard.save(_state("optim", src, opt, sched=s), tmp_path / "ck")
    dst = Net(1)
    decay, no = _decay_split(dst)
    opt = torch.optim.AdamW([{**decay, "params": decay["params"][:1]}, {**decay, "params": decay["params"][1:]},
                             no], lr=1e-3)
    s = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-4, max_lr=1e-3, step_size_up=4, cycle_momentum=False)
    with pytest.raises(reshard.CheckpointError, match=r"CyclicLR was saved with max_lrs=.*hyperparams='current'"):
        reshard.load(_state("optim", dst, opt, "saved", sched=s), tmp_path / "ck")


def test_saved_split_of_a_merged_group_keeps_a_scheduler_built_before(tmp_path: Path) -> None:
    """Saved with decay / no-decay groups, resumed with one group and a
    LambdaLR built before the load under "saved": the group is split in two
    and the scheduler follows (one lambda, one base per group), continuing
    the saved schedule."""
    src = Net()
    opt = torch.optim.AdamW(_decay_split(src), lr=1e-3)
    s = _sched("lambda", opt)
    _train(src, opt, s, N)
    reshard.save(_state("optim", src, opt, sched=s), tmp_path / "ck")
    dst = Net(1)
    opt = torch.optim.AdamW(dst.parameters(), lr=5e-4)
    s = _sched("lambda", opt)
    reshard.load(_state("optim", dst, opt, "saved", sched=s), tmp_path / "ck")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert len(s.lr_lambdas) == len(s.base_lrs) == 2
    _step(dst, opt)
    s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 * _lambda(N + 1)] * 2, rel=1e-12)
