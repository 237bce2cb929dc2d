"""reshard.collectives.Tries: every rank tries, then all agree (one rank in
process, and N ranks of a protocol run in lockstep by the simulator)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import reshard
from reshard.bench.simulate import SimWorld
from reshard.collectives import SingleProcess, Tries
from reshard.errors import CheckpointError, ShardingError


def test_keeps_the_first_failure_and_agrees_it() -> None:
    tries = Tries()
    with tries:
        raise ShardingError("first")
    with tries:
        raise ValueError("second")
    assert not tries.ok
    seen: list[tuple[CheckpointError, BaseException | None]] = []
    with pytest.raises(ShardingError, match="first") as got:
        tries.agree(SingleProcess(), "phase", on_fail=lambda a, mine: seen.append((a, mine)))
    assert got.value.__cause__ is not None and str(got.value.__cause__) == "first"
    assert len(seen) == 1 and seen[0][0] is got.value and str(seen[0][1]) == "first"
    assert tries.ok  # empty again, for the next phase


def test_success_reduces_values_and_never_calls_on_fail() -> None:
    tries = Tries()
    with tries:
        x = 1
    called: list[Any] = []
    assert tries.agree(SingleProcess(), "phase", [3, 4], on_fail=lambda a, m: called.append(a)) == [3, 4]
    assert x == 1 and not called


def test_on_fail_may_raise_another_error() -> None:
    tries = Tries(ValueError("given"))

    def other(agreed: CheckpointError, mine: BaseException | None) -> None:
        raise CheckpointError(f"{agreed} + note") from mine

    with pytest.raises(CheckpointError, match=r"given[\s\S]*\+ note"):
        tries.agree(SingleProcess(), "phase", on_fail=other)


def test_keyboard_interrupt_is_not_kept() -> None:
    tries = Tries()
    with pytest.raises(KeyboardInterrupt), tries:
        raise KeyboardInterrupt
    assert tries.ok


def test_gather_returns_every_outcome_or_raises() -> None:
    tries = Tries()
    assert tries.gather(SingleProcess(), "phase", {"n": 2}) == [{"error": None, "n": 2}]
    with tries:
        raise OSError("disk")
    with pytest.raises(CheckpointError, match="disk"):
        tries.gather(SingleProcess(), "phase", {"n": 2})


def test_one_rank_fails_every_rank_raises_the_agreed_error() -> None:
    n = 4
    cleaned: list[int] = []

    def rank(r: int) -> Any:
        tries = Tries()
        with tries:
            if r == n:  # never: phase one succeeds on every rank
                raise ShardingError(f"rank {r}: bad shard")
        red = yield from tries.agree_steps(r, "phase one", [r])
        assert red == [n - 1]
        with tries:
            if r == 1:
                raise ShardingError(f"rank {r}: late")
        yield from tries.agree_steps(r, "phase two", on_fail=lambda a, m: cleaned.append(r))
        return "unreachable"

    results, _ = SimWorld(n).run([rank(r) for r in range(n)])
    assert sorted(cleaned) == list(range(n))
    for r, res in enumerate(results):
        assert isinstance(res, ShardingError), res
        assert "phase two" in str(res) and "rank 1: late" in str(res)
        assert (res.__cause__ is not None) == (r == 1)


def _hand_agreements(tree: ast.AST) -> list[int]:
    """Lines of calls that agree without :class:`Tries`: ``Collectives.agree``
    (its receiver a ``coll``, or its first argument the phase's text: a
    ``Tries.agree`` takes the collectives first) and the bare protocol
    function ``agree_steps``."""
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Name) and f.id == "agree_steps":
            out.append(n.lineno)
        elif isinstance(f, ast.Attribute) and f.attr == "agree":
            recv = f.value
            by_coll = (isinstance(recv, ast.Name) and recv.id == "coll") or \
                (isinstance(recv, ast.Attribute) and recv.attr == "coll")
            text_first = bool(n.args) and isinstance(n.args[0], (ast.Constant, ast.JoinedStr))
            if by_coll or text_first:
                out.append(n.lineno)
    return out


def test_the_scan_finds_an_agreement_by_hand() -> None:
    hand = ast.parse("coll.agree('x', err)\nself._mgr.coll.agree(f'y {p}', err)\n"
                     "c.agree('z', None)\nagree_steps(0, 'w', err)\nTries().agree(coll, 'ok')\n")
    assert _hand_agreements(hand) == [1, 2, 3, 4]


def test_every_agreement_outside_the_collectives_goes_through_tries() -> None:
    root = Path(reshard.__file__).parent
    found = {}
    for p in sorted(root.rglob("*.py")):
        if p.name == "collectives_base.py":  # Tries itself, and the interface it calls
            continue
        lines = _hand_agreements(ast.parse(p.read_text(encoding="utf-8")))
        if lines:
            found[str(p.relative_to(root))] = lines
    assert not found, f"agreed by hand, not through reshard.collectives.Tries: {found}"
