"""The CLI starts fast (issue 27 point 8): ``reshard --help``, ``--version``,
``ls``, ``inspect`` of a native checkpoint and ``plan`` import no torch (each
checked in a fresh interpreter); ``inspect`` describes what is on disk (a
``convert --from dcp`` result is native and checksummed, a DCP folder is DCP
and complete only as DCP counts it) and ``convert`` keeps the source's step.
Start-up time itself is measured outside the suite (figures in the report)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import _read_state_fns as fns
import reshard
from reshard.cli import main
from reshard.testing.pool import WorkerPool

PROBE = """
import sys
sys.argv = ["reshard", *sys.argv[1:]]
from reshard.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
print("EXIT", code, "TORCH", "torch" in sys.modules, "NUMPY", "numpy" in sys.modules)
"""


@pytest.fixture(scope="module")
def root(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with a checkpoint saved by 2 gloo ranks, a DCP folder of step 6
    and that folder converted."""
    r = tmp_path_factory.mktemp("cli")
    pool.run(2, fns.r_save_training_state, str(r / "step-00000003"))
    m = torch.nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": m.state_dict(), "step": 6}, checkpoint_id=str(r / "dcp-6"), no_dist=True)
    return r


def _probe(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env,
                       timeout=120)
    return p.stdout + p.stderr


@pytest.mark.parametrize("cmd", [["--help"], ["--version"], ["ls", "{root}"],
                                 ["inspect", "{root}/step-00000003"],
                                 ["plan", "{root}/step-00000003", "--layout", "tp2,dp2", "--read-rate", "100"]])
def test_commands_that_read_no_tensor_import_no_torch(root: Path, cmd: list[str]) -> None:
    out = _probe(*(c.format(root=root) for c in cmd))
    assert "EXIT 0 TORCH False" in out, out


def test_inspect_and_convert_say_what_is_on_disk(root: Path, tmp_path: Path) -> None:
    def run(*args: Any) -> str:
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        return r.output

    # a DCP folder: DCP's format and DCP's notion of complete, no checksums
    head = run("inspect", root / "dcp-6").splitlines()[1:4]
    assert head[0].startswith("  PyTorch DCP checkpoint"), head
    assert "format dcp" in head[1] and "step 6" in head[1] and "reshard" not in head[1], head
    assert "complete as DCP counts it" in head[2] and "no checksums" in head[2], head
    assert "committed" not in " ".join(head) and "attempt" not in " ".join(head), head
    # converted: native, checksummed, one file, the source's step; ls and verify agree
    conv = tmp_path / "root" / "step-6"
    run("convert", "--from", "dcp", root / "dcp-6", conv)
    head = run("inspect", conv).splitlines()[1:4]
    assert "format reshard v3  step 6" in head[0], head
    assert "committed" in head[1] and "1 file," in head[1] and "checksums xxh3_64" in head[1], head
    assert head[2] == "  converted from a PyTorch DCP checkpoint (reshard convert --from dcp)", head
    rows = run("ls", tmp_path / "root").splitlines()
    cols = dict(zip(rows[1].split(), rows[2].replace(" B", "B").split(), strict=False))
    assert cols["step"] == "6" and cols["size"] == "224B" and cols["files"] == "1", rows
    assert "checksummed" in run("verify", conv)
    assert reshard.inspect(conv).step == 6
    # a step given on the command line wins
    run("convert", "--from", "dcp", root / "dcp-6", tmp_path / "root" / "x", "--step", "9")
    assert reshard.inspect(tmp_path / "root" / "x").step == 9


STEP_FIRST = """
import reshard            # before torch, as isort orders the imports of a training script
import torch

m = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(m.parameters())
m(torch.randn(2, 3)).sum().backward()
opt.step()                # no reshard adapter touched before the first step
from reshard.collectives import SingleProcess
reshard.save({"optim": reshard.OptimizerState(m, opt)}, {path!r}, group=SingleProcess())
m(torch.randn(2, 3)).sum().backward()   # accumulation since the step: refused
try:
    reshard.save({"optim": reshard.OptimizerState(m, opt)}, {path!r} + "-2", group=SingleProcess())
except reshard.CheckpointError as e:
    print("refused:", "accumulated" in str(e))
"""


def test_a_lazy_import_still_sees_every_optimizer_step(tmp_path: Path) -> None:
    """`import reshard` imports no torch, yet the step-boundary check of
    OptimizerState sees a step taken before any adapter was used (the post-import
    hook on torch.optim.optimizer): the save after step() is taken, the one after
    a further backward() refused."""
    code = STEP_FIRST.replace("{path!r}", repr(str(tmp_path / "ck")))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "refused: True", p.stdout + p.stderr
    assert reshard.verify(tmp_path / "ck").ok
