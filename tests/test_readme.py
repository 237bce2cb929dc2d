"""The README's usage snippets run as written: the training snippet on a fresh
directory (first run starts fresh, second resumes), and the one-process load
on rank 0 alone inside an initialised gloo group (no hang)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard.diff import diff
from reshard.testing.pool import WorkerPool

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    use = README.read_text().split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", use, flags=re.S)


def test_usage_snippet_runs_fresh_then_resumes(tmp_path: Path) -> None:
    code = _blocks()[0]
    (tmp_path / "snippet.py").write_text(code)
    src = str(Path(reshard.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    outs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=100)
        assert p.returncode == 0, p.stdout + p.stderr
        outs.append(p.stdout)
    assert "resumed" not in outs[0] and outs[0].strip().endswith("True")
    assert "resumed from" in outs[1] and "at step 4" in outs[1], outs[1]
    assert reshard.latest(tmp_path / "ckpt").endswith("step-00000008")
    # each checkpoint holds the state of its own step: the model differs from one to the next
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step-00000003", "step-00000004", "step-00000007", "step-00000008"], names
    for a, b in zip(names, names[1:], strict=False):
        assert reshard.inspect(tmp_path / "ckpt" / b).step == int(b[5:])
        assert not diff(tmp_path / "ckpt" / a, tmp_path / "ckpt" / b).identical, (a, b)


def r_save_two_ranks(path: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reshard.save({"model": reshard.ModelState(model), "rank_note": 1}, path)


def r_load_on_rank0_alone(path: str) -> Any:
    """Only rank 0 loads, with the README's code, inside the initialised group."""
    if dist.get_rank() != 0:
        return None
    eval_model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        eval_model.weight.zero_()
    code = _blocks()[1]
    exec(code, {"reshard": reshard, "eval_model": eval_model, "path": path})  # noqa: S102
    torch.manual_seed(0)
    return torch.equal(eval_model.weight, torch.nn.Linear(4, 3).weight)


def test_one_process_load_inside_a_group(pool: WorkerPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    pool.run(2, r_save_two_ranks, path)
    assert pool.run(2, r_load_on_rank0_alone, path, timeout=60.0) == [True, None]
