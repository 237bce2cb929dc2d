"""Optimizer hyperparameters restored by parameter name.

A checkpoint records, for every parameter, the hyperparameters of the group
it was in (``lr``, ``betas``, ``weight_decay``, ...), never a group position.
At load, each group of the optimizer receives the saved values of its
parameters. When the optimizer was built with another partition into groups,
a group can hold parameters whose saved values differ; what happens then is
the rule the user chose (:data:`HyperparamRule`):

* ``"error"`` (default): raise ShardingError naming the parameters and their
  values; nothing about the groups is guessed. The load raises it before any
  target is written (the adapters' ``reshard_check_load``).
* ``"saved"``: every parameter gets exactly its saved values: a group whose
  parameters disagree is split, in place, into one group per distinct set of
  values (``optimizer.param_groups`` grows; create LR schedulers after the
  load, since a scheduler built before holds one base value per old group).
* ``"current"``: hyperparameters are not restored at all; every group keeps
  the values the optimizer was constructed with.

Parameters without saved values (new parameters) follow their group. A
parameter that cannot be split from others (a ZeRO flat buffer holding
several parameters, or the views of one fused tensor) whose parameters
disagree raises even with ``"saved"``.
"""

from __future__ import annotations

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
                        check_only: bool = False) -> None:
    """Give each group of ``optimizer`` the saved hyperparameters of its parameters.

    Args:
        names: ``id(param) -> the saved names of that parameter`` (its fqn; the
            canonical tensors a fused view or a flat buffer holds).
        saved: saved name -> the hyperparameters recorded for it.
        rule: see :data:`HyperparamRule`.
        where: the adapter, for messages.
        check_only: raise what applying would raise, change nothing (the
            load calls it before any target is written).

    Raises:
        ShardingError: a group (or one parameter) whose parameters were saved
            with different values, under ``"error"`` (or a parameter that
            cannot be split, under ``"saved"``).
    """
    if check_rule(rule) == "current" or not saved:
        return
    keys: dict[str, Any] = {}  # saved name -> _key of its hyperparameters (once each)

    def key_of(n: str) -> Any:
        k = keys.get(n)
        if k is None:
            k = keys[n] = _key(saved[n])
        return k

    new_groups: list[dict[str, Any]] = []
    for gi, g in enumerate(optimizer.param_groups):
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
        if not distinct:
            new_groups.append(g)
            continue
        if len(distinct) == 1:
            new_groups.append({**g, **next(iter(distinct.values()))})
            continue
        if rule == "error":
            values = _describe(g, per_param, names)
            raise ShardingError(
                f"{where}: param group {gi} holds parameters saved with different hyperparameters "
                f"({values}); the optimizer's groups do not match the checkpoint's. Build the "
                "optimizer with the saved groups, or pass hyperparams='saved' (split the group: "
                "each parameter gets its saved values) or hyperparams='current' (keep the "
                "constructed values)")
        # "saved": one group per distinct set of values, in the order first met; parameters
        # without saved values stay with the first
        parts: dict[Any, list[torch.Tensor]] = {k: [] for k in distinct}
        first = next(iter(distinct))
        for p, k, _ in per_param:
            parts[first if k is None else k].append(p)
        base = group_hyperparams(g)
        for k, ps in parts.items():
            new_groups.append({**base, **distinct[k], "params": ps})
    if check_only:
        return
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
