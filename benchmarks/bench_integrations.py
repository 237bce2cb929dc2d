"""The trainer integrations run the way users run them, killed and resumed.

Not a test. Usage::

    python benchmarks/bench_integrations.py [--only lightning-ddp,hf-trainer] [--steps 16]

For each entry (PyTorch Lightning under DDP, Lightning under
ModelParallelStrategy / FSDP2, the Hugging Face Trainer), a small job under
``torchrun`` (``benchmarks/integrations/*_job.py``, checkpointing with
``reshard.integrations``) is run:

* **same layout**: uninterrupted on 2 ranks, against the same job SIGKILLed
  from outside (every process of the torchrun group) once it passed step
  ``--kill-after``, then started again on 2 ranks with the same command: the
  resumed steps must be bitwise equal (each rank's loss, the learning rate,
  the sample ids), with dropout on;
* **naive RNG**: the same resume with the RNG streams applied where the
  checkpoint is read (before the DataLoader iterators exist: the HF Trainer's
  training loader, and the validation loader Lightning fast-forwards at a
  resume at a validation step; the Lightning callback's own training loader
  draws nothing from the global generator): same samples and learning rate,
  other losses (what the integrations avoid);
* **Lightning's default** (the DDP entry): the same job checkpointed by
  Lightning's ``ModelCheckpoint(save_last=True)`` and resumed with
  ``fit(ckpt_path="last")``, against its own uninterrupted run;
* **2 -> 1**: without randomness in the step (dropout 0), uninterrupted on 2
  ranks against the job killed on 2 ranks and resumed on 1 (the same command:
  the per-device batch as written, the global batch kept by the
  integration): losses within 1e-5 relative of the 2-rank global loss, the
  same samples every step, every sample of each epoch once.

Both curves are printed step by step. An entry is a function returning
:class:`Case` results; a new trainer (TorchTitan's checkpoint component) is one
more function in :data:`ENTRIES`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: a step's records: (step, rank) -> {"loss", "lr", "ids"}
Records = dict[tuple[int, int], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One comparison: the uninterrupted curve and the resumed one.

    ``kind``: "bitwise" (every resumed step equal bit for bit), "naive" (the
    resumed steps expected to differ), "tolerance" (a 2-rank reference, a
    1-rank resume: losses within ``rtol`` of the 2-rank global mean, the
    same global batch). ``resumed_at``: the step the resumed run started after.
    ``epoch_ids``: per epoch, the sample ids the stopped and resumed runs
    trained together (for the every-sample-once check); ``dataset_len``.
    """

    entry: str
    kind: str
    reference: Records
    resumed: Records
    resumed_at: int
    epoch_ids: dict[int, list[int]] = field(default_factory=dict)
    dataset_len: int = 0
    rtol: float = 1e-5
    seconds: float = 0.0


@dataclass(frozen=True)
class Job:
    """A torchrun job script of ``benchmarks/integrations`` and its flags."""

    name: str
    script: str
    root_flag: str
    records_flag: str
    extra: tuple[str, ...] = ()
    dataset_len: int = 64
    steps_per_epoch_2: int = 8  # at 2 ranks x 4 samples


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchrun(job: Job, ranks: int, root: Path, records: Path, args: list[str],
              kill_after: int = 0, timeout: float = 600.0) -> tuple[float, str]:
    """Run ``job`` on ``ranks`` processes; with ``kill_after``, SIGKILL the
    whole process group once a record of a step past it exists. Returns the
    seconds taken and the output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(HERE / "integrations" / job.script), job.root_flag, str(root), job.records_flag,
           str(records), *job.extra, *args]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, text=True)
    if kill_after:
        while p.poll() is None:
            if _last_step(records) > kill_after:
                _kill_tree(p.pid)  # torchrun's workers run in sessions of their own
                break
            time.sleep(0.05)
        out = p.communicate()[0]
        if p.returncode == 0:
            raise RuntimeError(f"{job.name}: the job ended before the kill after step {kill_after}:\n"
                               f"{out[-3000:]}")
        return time.perf_counter() - t0, out
    try:
        out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    if p.returncode != 0:
        raise RuntimeError(f"{job.name}: {' '.join(cmd[3:])} exited {p.returncode}:\n{out[-4000:]}")
    return time.perf_counter() - t0, out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descending from it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    todo, tree = [pid], []
    while todo:
        q = todo.pop()
        tree.append(q)
        todo.extend(children.get(q, []))
    for q in reversed(tree):  # the workers first, then the agent
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read(records: Path, world: int | None = None) -> Records:
    """The records of every rank (the last line of a step wins: a resumed
    run's), optionally those written at ``world`` ranks only."""
    out: Records = {}
    for f in sorted(records.parent.glob(records.name + ".*")):
        for line in f.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            if world is None or d["world"] == world:
                out[(d["step"], d["rank"])] = d
    return out


def _last_step(records: Path) -> int:
    return max((s for s, _ in _read(records)), default=0)


def _resumed_at(output: str) -> int:
    """N of the integration's one line "resuming from PATH (step N)"."""
    m = re.findall(r"resuming from \S+ \(step (\d+)\)", output)
    if not m:
        raise RuntimeError(f"the job did not resume:\n{output[-3000:]}")
    return int(m[-1])


def torchrun_matrix(job: Job, work: Path, steps: int, every: int, kill_after: int) -> list[Case]:
    """The standard matrix of a torchrun job (module docstring)."""
    out: list[Case] = []
    d = work / job.name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    common = ["--steps", str(steps), "--every", str(every), "--step-sleep", "0.15"]
    # same layout, dropout on
    t, _ = _torchrun(job, 2, d / "full", d / "full.jsonl", common)
    ref = _read(d / "full.jsonl")
    _torchrun(job, 2, d / "run", d / "run.jsonl", common, kill_after=kill_after)
    shutil.copytree(d / "run", d / "naive")
    dt, log = _torchrun(job, 2, d / "run", d / "run.jsonl", common)
    at = _resumed_at(log)
    resumed = {k: v for k, v in _read(d / "run.jsonl").items() if k[0] > at}
    out.append(Case(job.name, "bitwise", ref, resumed, at, seconds=t + dt))
    _, log = _torchrun(job, 2, d / "naive", d / "naive.jsonl", [*common, "--naive-rng"])
    naive = {k: v for k, v in _read(d / "naive.jsonl").items() if k[0] > _resumed_at(log)}
    out.append(Case(job.name, "naive", ref, naive, at))
    # 2 -> 1, no randomness in the step
    plain = [*common, "--dropout", "0"] + (["--noise", "0"] if "lightning" in job.script else [])
    t, _ = _torchrun(job, 2, d / "full0", d / "full0.jsonl", plain)
    ref0 = _read(d / "full0.jsonl")
    _torchrun(job, 2, d / "one", d / "one.jsonl", plain, kill_after=kill_after)
    before = _read(d / "one.jsonl", world=2)
    dt, log = _torchrun(job, 1, d / "one", d / "one.jsonl", plain)
    at = _resumed_at(log)
    after = {k: v for k, v in _read(d / "one.jsonl", world=1).items() if k[0] > at}
    per_epoch: dict[int, list[int]] = {}
    for (s, _), v in sorted({**{k: v for k, v in before.items() if k[0] <= at}, **after}.items()):
        per_epoch.setdefault((s - 1) // job.steps_per_epoch_2, []).extend(v["ids"])
    out.append(Case(job.name, "tolerance", ref0, after, at, epoch_ids=per_epoch,
                    dataset_len=job.dataset_len, seconds=t + dt))
    return out


def lightning_ddp(work: Path, steps: int, every: int, kill_after: int) -> list[Case]:
    """PyTorch Lightning, DDPStrategy: ReshardCheckpoint, dropout, noise drawn in
    the dataset's __getitem__, validation at the checkpoint steps; and the
    same job with Lightning's own checkpointing, the baseline."""
    job = Job("lightning-ddp", "lightning_job.py", "--root", "--out",
              extra=("--strategy", "ddp", "--val-every", str(every)))
    cases = torchrun_matrix(job, work, steps, every, kill_after)
    d = work / job.name
    base = ["--steps", str(steps), "--every", str(every), "--step-sleep", "0.15", "--lightning-default"]
    _torchrun(job, 2, d / "pl-full", d / "pl-full.jsonl", base)
    _torchrun(job, 2, d / "pl-run", d / "pl-run.jsonl", base, kill_after=kill_after)
    _, log = _torchrun(job, 2, d / "pl-run", d / "pl-run.jsonl", base)
    at = _resumed_at(log)
    resumed = {k: v for k, v in _read(d / "pl-run.jsonl").items() if k[0] > at}
    cases.append(Case("lightning-ddp", "baseline", _read(d / "pl-full.jsonl"), resumed, at))
    return cases


def lightning_fsdp2(work: Path, steps: int, every: int, kill_after: int) -> list[Case]:
    """PyTorch Lightning, ModelParallelStrategy (FSDP2 over the data-parallel mesh),
    validation at the checkpoint steps."""
    job = Job("lightning-fsdp2", "lightning_job.py", "--root", "--out",
              extra=("--strategy", "fsdp2", "--val-every", str(every)))
    return torchrun_matrix(job, work, steps, every, kill_after)


def hf_trainer(work: Path, steps: int, every: int, kill_after: int) -> list[Case]:
    """The Hugging Face Trainer (DDP through accelerate): ReshardTrainer, a cosine
    schedule with warmup, dropout."""
    job = Job("hf-trainer", "transformers_job.py", "--out-dir", "--records")
    return torchrun_matrix(job, work, steps, every, kill_after)


#: the entries, in the order they run: name -> function(work, steps, every, kill_after)
ENTRIES: dict[str, Callable[[Path, int, int, int], list[Case]]] = {
    "lightning-ddp": lightning_ddp,
    "lightning-fsdp2": lightning_fsdp2,
    "hf-trainer": hf_trainer,
}


def report(c: Case) -> tuple[bool, str]:
    """Print the two curves of ``c`` step by step; (passed, summary line)."""
    lines = [f"\n== {c.entry}: {c.kind} (resumed after step {c.resumed_at})"]
    ok, worst = True, 0.0
    steps = sorted({s for s, _ in c.resumed})
    if c.kind in ("bitwise", "naive", "baseline"):
        lines.append(f"{'step':>4} {'rank':>4} {'uninterrupted':>14} {'resumed':>14} {'|d|':>10} lr ids")
        diff_steps = 0
        for s in steps:
            for r in sorted(rk for st, rk in c.resumed if st == s):
                a, b = c.reference[(s, r)], c.resumed[(s, r)]
                d = abs(a["loss"] - b["loss"])
                worst = max(worst, d)
                same = a["loss"] == b["loss"] and a["lr"] == b["lr"] and a["ids"] == b["ids"]
                diff_steps += not same
                lines.append(f"{s:>4} {r:>4} {a['loss']:>14.9f} {b['loss']:>14.9f} {d:>10.3g} "
                             f"{'=' if a['lr'] == b['lr'] else 'X'}  {'=' if a['ids'] == b['ids'] else 'X'}")
        if c.kind == "bitwise":
            ok = diff_steps == 0
            summary = f"{c.entry} same layout: {'bitwise' if ok else f'{diff_steps} steps differ'}"
        elif c.kind == "baseline":
            same_ids = sum(c.reference[k]["ids"] == v["ids"] for k, v in c.resumed.items())
            summary = (f"{c.entry} Lightning's own ModelCheckpoint + fit(ckpt_path='last') (baseline, "
                       f"not judged): {diff_steps} of {len(c.resumed)} rank-steps differ, max |d| loss "
                       f"{worst:.3g}, {same_ids} with the same samples")
        else:
            ok = diff_steps > 0 and all(c.reference[k]["ids"] == v["ids"] and c.reference[k]["lr"] == v["lr"]
                                        for k, v in c.resumed.items())
            summary = (f"{c.entry} naive RNG timing: same samples and lr, max |d| loss {worst:.3g} "
                       f"({diff_steps} of {len(c.resumed)} rank-steps differ)")
    else:
        lines.append(f"{'step':>4} {'2 ranks (mean)':>15} {'1 rank':>14} {'rel':>10} lr batch")
        for s in steps:
            a, b = c.reference[(s, 0)], c.reference[(s, 1)]
            mean = (a["loss"] + b["loss"]) / 2
            r = c.resumed[(s, 0)]
            rel = abs(r["loss"] - mean) / abs(mean)
            worst = max(worst, rel)
            same_batch = r["ids"] == a["ids"] + b["ids"]
            ok &= rel <= c.rtol and r["lr"] == a["lr"] and same_batch
            lines.append(f"{s:>4} {mean:>15.9f} {r['loss']:>14.9f} {rel:>10.3g} "
                         f"{'=' if r['lr'] == a['lr'] else 'X'}  {'=' if same_batch else 'X'}")
        full = [e for e, ids in c.epoch_ids.items() if len(ids) >= c.dataset_len]
        once = all(sorted(c.epoch_ids[e]) == list(range(c.dataset_len)) for e in full)
        ok &= once and bool(full)
        summary = (f"{c.entry} 2 -> 1 rank: max rel |d| loss {worst:.3g} (<= {c.rtol:g}: "
                   f"{worst <= c.rtol}), every sample once in epochs {full}: {once}")
    print("\n".join(lines))
    return ok, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated entries (default: all)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=10, help="kill once a step past this one ran")
    p.add_argument("--work", default="", help="directory for the runs (default: a temporary one)")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n] or list(ENTRIES)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-integrations-"))
    results = []
    t0 = time.perf_counter()
    for name in names:
        for case in ENTRIES[name](work, a.steps, a.every, a.kill_after):
            results.append(report(case))
    print(f"\n== summary ({time.perf_counter() - t0:.0f} s; runs under {work})")
    for ok, line in results:
        print(("PASS " if ok else "FAIL ") + line)
    sys.exit(0 if all(ok for ok, _ in results) else 1)


if __name__ == "__main__":
    main()
