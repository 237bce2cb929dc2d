"""Optimizer hyperparameters restored by parameter name.

A checkpoint records, for every parameter, the hyperparameters of the group
it was in (``lr``, ``betas``, ``weight_decay``, ...), never a group position.
At load, each group of the optimizer receives the saved values of its
parameters. What happens when the optimizer's groups differ from the
checkpoint's is the rule the user chose (:data:`HyperparamRule`); the saved
groups are known by their values (parameters saved with equal values were in
one group, as far as anyone can tell):

* ``"error"`` (default): the optimizer must partition the saved parameters as
  the checkpoint did. A group holding parameters saved with different values
  (a merge), or groups constructed with different values whose parameters
  were saved with the same ones (a split: one saved AdamW group resumed with
  the usual decay / no-decay groups), raises ShardingError naming the groups,
  the parameters and the values, before any target is written (the adapters'
  ``reshard_check_load``). With the same partition, the saved values are
  restored (as DCP does: a changed ``lr`` or ``weight_decay`` in the
  constructor is overridden by the checkpoint) and every constructed value so
  replaced is reported in ``LoadResult.notes`` under
  ``<adapter path>.hyperparams_restored`` (``{"group <i>": {key:
  {"constructed": v, "saved": w}}}``; ``lr`` is not reported when
  ``initial_lr`` is saved and unchanged: that is an LR scheduler's progress).
* ``"saved"``: every parameter gets exactly its saved values, for every
  partition: a group whose parameters disagree is split, in place, into one
  group per distinct set of values (``optimizer.param_groups`` grows); groups
  split at this run all take the saved values. An LR scheduler restored in the
  same load gets one entry per current group in each of its per-group lists,
  from each group's restored values (:func:`fit_schedulers`).
  Reported in the notes as above (a split as ``{"split_into": n}``).
* ``"current"``: hyperparameters are not restored at all; every group keeps
  the values the optimizer was constructed with, for every partition. An LR
  scheduler restored in the same load would bring the saved schedule back at
  its next ``step()`` (its saved ``base_lrs`` win); so the schedulers of the
  optimizer found in the same state are rebased on the constructed rates
  (:func:`rebase_schedulers`): the restored position continues with the new
  base, as Megatron's ``override_opt_param_scheduler`` does; its other
  per-group lists (CyclicLR's ``max_lrs``...) are the constructed ones.

Parameters without saved values (new parameters) follow their group. A
parameter that cannot be split from others (a ZeRO flat buffer holding
several parameters, or the views of one fused tensor) whose parameters
disagree raises even with ``"saved"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from ..errors import ShardingError

HyperparamRule = Literal["error", "saved", "current"]
RULES = ("error", "saved", "current")


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"hyperparams must be one of {RULES}, got {rule!r}")
    return rule


def group_hyperparams(g: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (everything but ``params``)."""
    return {k: v for k, v in g.items() if k != "params"}


_SCALARS = (int, bool, str, type(None))


def _canon(v: Any) -> Any:
    """A comparable form of a hyperparameter value (tensors by value)."""
    t = type(v)
    if t in _SCALARS:  # the common case, without the slower abstract-class checks below
        return v
    if t is float:
        return ("nan",) if v != v else v
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape), tuple(v.detach().cpu().reshape(-1).tolist()))
    if isinstance(v, Mapping):
        return tuple(sorted((str(k), _canon(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_canon(x) for x in v))
    if isinstance(v, float) and v != v:
        return ("nan",)
    return v


def _key(hp: Mapping[str, Any]) -> Any:
    return tuple(sorted((k, _canon(v)) for k, v in hp.items()))


def restore_hyperparams(optimizer: torch.optim.Optimizer, names: Mapping[int, Sequence[str]],
                        saved: Mapping[str, Mapping[str, Any]], rule: str, *, where: str,
                        check_only: bool = False) -> dict[str, Any]:
    """Give each group of ``optimizer`` the saved hyperparameters of its parameters.

    Args:
        names: ``id(param) -> the saved names of that parameter`` (its fqn; the
            canonical tensors a fused view or a flat buffer holds).
        saved: saved name -> the hyperparameters recorded for it.
        rule: see :data:`HyperparamRule`.
        where: the adapter, for messages.
        check_only: raise what applying would raise, change nothing (the
            load calls it before any target is written).

    Returns:
        Notes for ``LoadResult.notes``: ``{"hyperparams_restored": {"group <i>":
        {key: {"constructed": v, "saved": w}}}}`` for every constructed value a
        saved one replaces (not ``lr`` when ``initial_lr`` is saved and
        unchanged: a scheduler's progress is no change), empty when none.

    Raises:
        ShardingError: under ``"error"``, a group partition other than the
            checkpoint's: a group holding parameters saved with different
            values (a merge), or groups constructed with different values
            whose parameters were saved with the same ones (a split; the usual
            decay / no-decay split of one saved group); the message names the
            groups, parameters and values. Under ``"error"`` and ``"saved"``,
            one parameter that cannot be split (a flat buffer, fused views)
            whose saved parameters differ.
    """
    if check_rule(rule) == "current" or not saved:
        return {}
    keys: dict[str, Any] = {}  # saved name -> _key of its hyperparameters (once each)

    def key_of(n: str) -> Any:
        k = keys.get(n)
        if k is None:
            k = keys[n] = _key(saved[n])
        return k

    groups = optimizer.param_groups
    plans: list[tuple[list[tuple[torch.Tensor, Any, dict[str, Any] | None]], dict[Any, dict[str, Any]]]] = []
    for g in groups:
        per_param: list[tuple[torch.Tensor, Any, dict[str, Any] | None]] = []
        conflicts: list[str] = []
        for p in g["params"]:
            own = [(n, saved[n]) for n in names.get(id(p), ()) if n in saved]
            kinds = {key_of(n) for n, _ in own}
            if len(kinds) > 1:
                conflicts.extend(f"{n}: {_diff(hp, own[0][1])}" for n, hp in own)
            per_param.append((p, key_of(own[0][0]) if own else None, dict(own[0][1]) if own else None))
        if conflicts:
            raise ShardingError(
                f"{where}: one optimizer parameter holds saved parameters whose hyperparameters "
                f"differ ({'; '.join(conflicts[:6])}); it cannot take both (hyperparams="
                f"{rule!r}): build the optimizer with these parameters apart, or pass "
                "hyperparams='current'")
        distinct: dict[Any, dict[str, Any]] = {}
        for _, k, hp in per_param:
            if k is not None and hp is not None:
                distinct.setdefault(k, hp)
        plans.append((per_param, distinct))
    if rule == "error":
        _check_partition(groups, plans, names, where)
    notes: dict[str, Any] = {}
    new_groups: list[dict[str, Any]] = []
    for gi, (g, (per_param, distinct)) in enumerate(zip(groups, plans, strict=True)):
        if not distinct:
            new_groups.append(g)
            continue
        if len(distinct) == 1:
            hp = next(iter(distinct.values()))
            changed = _changes(g, hp)
            if changed:
                notes[f"group {gi}"] = changed
            new_groups.append({**g, **hp})
            continue
        # "saved": one group per distinct set of values, in the order first met; parameters
        # without saved values stay with the first
        parts: dict[Any, list[torch.Tensor]] = {k: [] for k in distinct}
        first = next(iter(distinct))
        for p, k, _ in per_param:
            parts[first if k is None else k].append(p)
        base = group_hyperparams(g)
        notes[f"group {gi}"] = {"split_into": len(parts)}
        for k, ps in parts.items():
            new_groups.append({**base, **distinct[k], "params": ps})
    if check_only:
        return {"hyperparams_restored": notes} if notes else {}
    # every group planned without error: now change the optimizer (a group kept
    # whole is updated in place, so references to it stay valid)
    old = {id(g): g for g in optimizer.param_groups}
    out = []
    for ng in new_groups:
        og = next((o for o in old.values() if o["params"] is ng["params"]), None)
        if og is not None:
            og.update(ng)
            out.append(og)
        else:
            out.append(ng)
    optimizer.param_groups[:] = out
    return {"hyperparams_restored": notes} if notes else {}


def _changes(g: Mapping[str, Any], hp: Mapping[str, Any]) -> dict[str, Any]:
    """The constructed values of group ``g`` that the saved ``hp`` replace."""
    out = {k: {"constructed": g[k], "saved": v} for k, v in hp.items()
           if k in g and k != "params" and _canon(g[k]) != _canon(v)}
    if "lr" in out and "initial_lr" in hp and "initial_lr" in g and "initial_lr" not in out:
        del out["lr"]  # the same schedule, further on: a scheduler's progress, not a change
    return out


def _names(ps: Sequence[torch.Tensor], names: Mapping[int, Sequence[str]], n: int = 4) -> str:
    got = [", ".join(names.get(id(p), ("<unnamed>",))) for p in ps]
    return ", ".join(got[:n]) + (f", ... {len(got) - n} more" if len(got) > n else "")


def _check_partition(groups: Sequence[Mapping[str, Any]],
                     plans: Sequence[tuple[list[tuple[torch.Tensor, Any, dict[str, Any] | None]],
                                           dict[Any, dict[str, Any]]]],
                     names: Mapping[int, Sequence[str]], where: str) -> None:
    """Under ``"error"``: raise unless the optimizer's groups partition the saved
    parameters as the checkpoint's groups did (by their saved values)."""
    problems: list[str] = []
    by_key: dict[Any, list[int]] = {}  # saved values -> the groups holding parameters saved with them
    for gi, (per_param, distinct) in enumerate(plans):
        if len(distinct) > 1:  # a merge
            problems.append(f"param group {gi} holds parameters saved with different hyperparameters "
                            f"({_describe(groups[gi], per_param, names)})")
        for k in distinct:
            by_key.setdefault(k, []).append(gi)
    for k, gis in by_key.items():
        cons = [group_hyperparams(groups[gi]) for gi in gis]
        if len({_key(c) for c in cons}) < 2:
            continue  # groups constructed alike: restoring keeps them alike
        differing = sorted({n for c in cons for n in c if len({_canon(d.get(n)) for d in cons}) > 1})
        hp = plans[gis[0]][1][k]
        parts = []
        for gi in gis:
            ps = [p for p, kk, _ in plans[gi][0] if kk == k]
            vals = ", ".join(f"{n}={groups[gi].get(n)!r}" for n in differing)
            parts.append(f"group {gi} ({vals}: {_names(ps, names)})")
        saved_vals = ", ".join(f"{n}={hp.get(n)!r}" for n in differing)
        problems.append(f"parameters saved in one group ({saved_vals}) are split over param groups "
                        f"constructed with different values: {'; '.join(parts)}")
    if problems:
        raise ShardingError(
            f"{where}: the optimizer's param groups do not partition the parameters as the "
            f"checkpoint's groups did: {'; '.join(problems)}. Restoring the saved values would "
            "silently undo that. Build the optimizer with the saved groups, or pass "
            "hyperparams='saved' (each parameter gets its saved values, a group whose parameters "
            "disagree is split) or hyperparams='current' (keep the constructed values)")


def _diff(hp: Mapping[str, Any], ref: Mapping[str, Any]) -> dict[str, Any]:
    keys = [k for k in hp if _canon(hp.get(k)) != _canon(ref.get(k))] or list(hp)[:3]
    return {k: hp[k] for k in keys}


def _describe(g: Mapping[str, Any], per_param: list[tuple[torch.Tensor, Any, dict[str, Any] | None]],
              names: Mapping[int, Sequence[str]]) -> str:
    hps = [hp for _, _, hp in per_param if hp is not None]
    differing = sorted({k for hp in hps for k in hp if len({_canon(h.get(k)) for h in hps}) > 1})
    out = []
    for p, _, hp in per_param:
        if hp is None:
            continue
        n = ", ".join(names.get(id(p), ("<unnamed>",)))
        out.append(f"{n}: " + ", ".join(f"{k}={hp.get(k)!r}" for k in differing))
    return "; ".join(out[:8]) + (f"; ... {len(out) - 8} more" if len(out) > 8 else "")


def model_only(m: Any) -> bool:
    """The manifest ``m`` describes model weights alone, by what it is: a
    Hugging Face directory (``extra["source"] == "huggingface"``, see
    :func:`reshard.formats.hf_import.hf_manifest`) holds no optimizer state,
    hyperparameters or objects, so an optimizer adapter asks it for none and
    keeps its own (as constructed, or as trained), under ``strict`` too."""
    return isinstance(getattr(m, "extra", None), dict) and m.extra.get("source") == "huggingface"


def dcp_param_groups_saved(m: Any, prefix: str = "") -> bool:
    """The manifest ``m`` (seen from an adapter) holds hyperparameters as DCP
    writes them, by group position (``{prefix}param_groups.<i>.<name>`` values,
    ``...params`` naming each group's parameter fqns), and not reshard's
    ``{prefix}param_group.<fqn>`` records."""
    head = f"{prefix}param_groups"
    names = [*(m.values or {}), *(m.extra.get("dcp_skipped_values") or {})]
    ours = any(k.startswith(f"{prefix}param_group.") for k in m.objects)
    return not ours and any(k == head or k.startswith(head + ".") for k in names)


def hyperparams_from_dcp(groups: Any, *, where: str) -> dict[str, dict[str, Any]]:
    """``fqn -> hyperparameters`` from DCP's ``param_groups`` (a list of groups,
    each with ``params``: the fqns of its parameters), for :func:`restore_hyperparams`.

    Raises:
        ShardingError: not a list of groups each naming its parameters.
    """
    if not isinstance(groups, list) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise ShardingError(f"{where}: DCP param_groups is not a list of groups with 'params' "
                            f"(got {type(groups).__name__})")
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        hp = group_hyperparams(g)
        for fqn in g["params"]:
            out[str(fqn)] = hp
    return out


def rebase_schedulers(optimizer: torch.optim.Optimizer, peers: Sequence[Any], *, where: str) -> list[str]:
    """Under ``hyperparams="current"``: the LR schedulers among ``peers`` that
    drive ``optimizer`` continue their restored position from the constructed
    learning rates.

    A restored scheduler holds the saved ``base_lrs``, and at its next
    ``step()`` it would bring the saved schedule back (PyTorch's semantics),
    undoing ``"current"``. So, for each scheduler (and each scheduler a
    ``SequentialLR`` / ``ChainedScheduler`` holds): ``base_lrs`` become the
    groups' constructed ``initial_lr`` (``lr`` without one), and each group's
    ``lr`` (and the scheduler's ``_last_lr``) becomes the constructed base times
    the restored schedule's factor at the restored position (saved ``_last_lr``
    / saved ``base_lrs``). This is exact for schedules proportional to their
    base (StepLR, MultiStepLR, ExponentialLR, LambdaLR, LinearLR,
    CosineAnnealingLR with ``eta_min=0``, warmup-decay lambdas), as Megatron's
    ``override_opt_param_scheduler`` recomputes the rate from the new values at
    the saved step. ``ReduceLROnPlateau`` (no base) keeps the constructed
    ``lr``. Called by :func:`fit_schedulers` (the adapters' ``reshard_finish_load``) after every
    Stateful of the state was loaded.

    Returns:
        One line per rebased scheduler, for logs.

    Raises:
        ShardingError: the saved schedule had one factor per group and the
            optimizer has another number of groups, or a saved base of 0 that
            cannot be rescaled to a nonzero constructed rate.
    """
    from torch.optim.lr_scheduler import LRScheduler

    done = []
    for s in peers:
        if not isinstance(s, LRScheduler) or getattr(s, "optimizer", None) is not optimizer:
            continue
        subs = [c for c in getattr(s, "_schedulers", ()) if hasattr(c, "base_lrs")]
        base = getattr(s, "base_lrs", None) or (subs[0].base_lrs if subs else None)
        if not base:
            continue
        last = list(getattr(s, "_last_lr", None) or base)
        new = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        factors = []
        for i, (b, x) in enumerate(zip(base, last, strict=False)):
            if b == 0:
                if any(n != 0 for n in new):
                    raise ShardingError(f"{where}: {type(s).__name__} was saved with base lr 0 in group "
                                        f"{i}; it cannot continue from the constructed lr {new}")
                factors.append(0.0)
            else:
                factors.append(float(x) / float(b))
        if len(factors) != len(new):
            if len(set(factors)) != 1:
                raise ShardingError(
                    f"{where}: {type(s).__name__} was saved for {len(base)} param groups with different "
                    f"factors {factors}; the optimizer has {len(new)} groups, so hyperparams='current' "
                    "cannot continue it: build the groups as saved, or do not restore the scheduler")
            factors = factors[:1] * len(new)
        lrs = [n * f for n, f in zip(new, factors, strict=True)]
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        for x in (s, *subs):
            if hasattr(x, "base_lrs"):
                x.base_lrs = list(new)
            if hasattr(x, "_last_lr"):
                x._last_lr = list(lrs)
        done.append(f"{type(s).__name__}: base_lrs {list(base)} -> {new}, lr {last} -> {lrs}")
    return done


#: the per-group lists of PyTorch's LR schedulers besides ``base_lrs`` / ``_last_lr``
#: (CyclicLR's ``max_lrs`` and momenta, ReduceLROnPlateau's ``min_lrs``), with the
#: param-group key where the scheduler also keeps the value, if any
_PER_GROUP: dict[str, str | None] = {"max_lrs": None, "base_momentums": "base_momentum",
                                     "max_momentums": "max_momentum", "min_lrs": None}


def _schedulers_of(optimizer: torch.optim.Optimizer, peers: Sequence[Any]) -> list[tuple[Any, list[Any]]]:
    """The LR schedulers among ``peers`` that drive ``optimizer``, each with
    itself and the schedulers it holds (``SequentialLR`` / ``ChainedScheduler``)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    out = []
    for s in peers:
        if not isinstance(s, LRScheduler | ReduceLROnPlateau) or getattr(s, "optimizer", None) is not optimizer:
            continue
        out.append((s, [s, *getattr(s, "_schedulers", ())]))
    return out


def snapshot_schedulers(optimizer: torch.optim.Optimizer, peers: Sequence[Any]) -> dict[int, dict[str, list[Any]]]:
    """The per-group lists (:data:`_PER_GROUP`) of the schedulers of
    ``optimizer`` among ``peers`` as constructed, before their state is
    loaded: ``id(scheduler) -> {attribute: list}``, for :func:`fit_schedulers`."""
    out: dict[int, dict[str, list[Any]]] = {}
    for _s, xs in _schedulers_of(optimizer, peers):
        for x in xs:
            got = {a: list(v) for a in _PER_GROUP if isinstance(v := getattr(x, a, None), list)}
            if got:
                out[id(x)] = got
    return out


def fit_schedulers(optimizer: torch.optim.Optimizer, peers: Sequence[Any], rule: str,
                   constructed: Mapping[int, Mapping[str, list[Any]]], *, where: str) -> list[str]:
    """After a load: every per-group list of the LR schedulers of ``optimizer``
    among ``peers`` (and of those a ``SequentialLR`` / ``ChainedScheduler``
    holds) has one entry per current param group, so that the next
    ``step()`` runs, whatever partition the checkpoint had.

    Under ``"current"`` the schedulers are first rebased on the constructed
    rates (:func:`rebase_schedulers`) and every other per-group list
    (CyclicLR's ``max_lrs``, ``base_momentums``, ``max_momentums``,
    ReduceLROnPlateau's ``min_lrs``) is the one the scheduler was constructed
    with (``constructed``, from :func:`snapshot_schedulers`): the restored
    position continues with the new values, peak included. Under ``"saved"``
    and ``"error"``, a list whose length is not the number of groups (the
    groups were partitioned otherwise than the checkpoint's) is rebuilt per
    current group from that group's restored values: ``base_lrs`` from its
    ``initial_lr`` (``lr`` without one), ``_last_lr`` from its ``lr``, the
    momenta from its ``base_momentum`` / ``max_momentum``, and a list the
    groups do not hold (``max_lrs``, ``min_lrs``) from the saved entry of the
    saved group whose ``base_lrs`` entry is the group's ``initial_lr`` (every
    entry when they are all equal, e.g. one saved group). OneCycleLR keeps its
    values in the groups and needs no rebuild.

    Returns:
        One line per scheduler changed, for logs.

    Raises:
        ShardingError: a list the groups do not hold cannot be matched to
            the current groups (no saved group with that base lr, or several
            with different values); the message names the scheduler, the list
            and the ways out (the saved partition, ``hyperparams='current'``,
            or a scheduler created after the load).
    """
    from torch.optim.lr_scheduler import CyclicLR

    done = rebase_schedulers(optimizer, peers, where=where) if rule == "current" else []
    groups = optimizer.param_groups
    n = len(groups)
    for top, xs in _schedulers_of(optimizer, peers):
        for x in xs:
            changed = []
            saved_base = list(getattr(x, "base_lrs", None) or ())
            if rule == "current":
                for a, want in constructed.get(id(x), {}).items():
                    if getattr(x, a, None) != want:
                        changed.append(f"{a} {getattr(x, a, None)} -> {want} (constructed)")
                        setattr(x, a, list(want))
            for a in ("base_lrs", "_last_lr", *_PER_GROUP):
                v = getattr(x, a, None)
                if not isinstance(v, list) or len(v) == n:
                    continue
                key = _PER_GROUP.get(a)
                new: list[Any]
                if a == "base_lrs":
                    new = [g.get("initial_lr", g["lr"]) for g in groups]
                elif a == "_last_lr":
                    new = [g["lr"] for g in groups]
                elif key is not None and all(key in g for g in groups):
                    new = [g[key] for g in groups]
                else:
                    new = [_saved_entry(x, a, v, saved_base, g, n, where) for g in groups]
                changed.append(f"{a} {v} -> {new} ({len(v)} saved groups, {n} now)")
                setattr(x, a, new)
            fns = getattr(x, "lr_lambdas", None)  # LambdaLR / MultiplicativeLR, built for the constructed groups
            if isinstance(fns, list) and fns and len(fns) != n:
                if len({id(f) for f in fns}) != 1:
                    raise ShardingError(
                        f"{where}: {type(x).__name__} was built with {len(fns)} different lr_lambdas and "
                        f"the optimizer now has {n} param groups (a group was split at this load): "
                        "build the groups as saved, or create the scheduler after the load")
                changed.append(f"lr_lambdas: {len(fns)} -> {n} (one function)")
                x.lr_lambdas = fns[:1] * n
            if changed:
                done.append(f"{type(x).__name__}: " + "; ".join(changed))
        if rule == "current" and isinstance(top, CyclicLR):
            # not proportional to its base (base + (max - base) * x): the lr at the restored
            # position from the fitted lists, as its next step() computes it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lrs = [float(x) for x in top.get_lr()]
            for g, lr in zip(groups, lrs, strict=True):
                g["lr"] = lr
            top._last_lr = list(lrs)
    return done


def _saved_entry(x: Any, a: str, v: list[Any], saved_base: list[Any], g: Mapping[str, Any], n: int,
                 where: str) -> Any:
    """The saved entry of list ``a`` for current group ``g`` (see :func:`fit_schedulers`)."""
    if len({_canon(e) for e in v}) == 1:
        return v[0]
    base = g.get("initial_lr", g["lr"])
    hits = {_canon(e): e for e, b in zip(v, saved_base, strict=False) if b == base}
    if len(hits) == 1:
        return next(iter(hits.values()))
    raise ShardingError(
        f"{where}: {type(x).__name__} was saved with {a}={v} for {len(v)} param groups (base_lrs "
        f"{saved_base}); the optimizer now has {n} groups and a group with "
        f"initial_lr {base!r} matches {'no' if not hits else 'several'} saved groups, so its {a} "
        "is unknown: build the optimizer's groups as saved, pass hyperparams='current' (the "
        "constructed values), or create the scheduler after the load (not restored)")
