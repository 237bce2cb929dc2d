"""Every command and snippet of README.md and docs/*.md runs as written.

A fenced block is one of:

* ``python``: run as a script in a fresh directory of its own;
* ``bash``: every line is a ``reshard ...`` command (``&&`` chains allowed),
  run in a directory holding the ``ckpt`` root that the README's quick start
  writes; a command exits 0 unless its comment starts with ``exit N:``;
* any other language (``text``, ``mermaid``): not code, never run.

A block is exempt only under an explicit tag on the line before it:
``<!-- not-run: why -->``, ``<!-- tested-in: tests/FILE.py -->`` (the scripts
it runs are run by that test file) or ``<!-- snippet: NAME -->`` (run by the
test of that name below, with its own checks: the quick start runs twice,
fresh then resuming; the one-process load runs on rank 0 alone inside a gloo
group; the two-rank resharding runs on 2 gloo ranks of the pool). Every block that is not exempt must have run and succeeded.

The python blocks and the commands run in one subprocess
(tests/_doc_runner.py) so that torch is imported once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.catalog.diff import diff
from reshard.testing.pool import WorkerPool

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CODE = {"python", "bash"}
NOT_CODE = {"text", "mermaid", "json", "toml"}
TAGS = {"not-run", "tested-in", "snippet"}
SNIPPETS = {"quick-start", "one-process-load", "reshard-two-ranks"}  # the names the tests below claim

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Block:
    file: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    tag: str | None
    tag_value: str

    @property
    def id(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` with the tag on the line before each."""
    lines = path.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{path}:{i + 1}: unclosed code block"
        prev = next((x for x in reversed(lines[:i]) if x.strip()), "")
        t = re.match(r"^<!--\s*([\w-]+):\s*(.*?)\s*-->$", prev.strip())
        out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n",
                         t.group(1) if t else None, t.group(2) if t else ""))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks(p)]


def named(name: str) -> Block:
    found = [b for b in all_blocks() if b.tag == "snippet" and b.tag_value == name]
    assert len(found) == 1, f"snippet {name!r}: {len(found)} blocks carry it"
    return found[0]


def commands(b: Block) -> list[tuple[str, int]]:
    """The ``reshard`` command lines of bash block ``b`` with the exit code each
    must give; any other program is refused (tag the block instead)."""
    out = []
    text = re.sub(r"\\\n\s*", " ", b.code)
    for n, raw in enumerate(text.split("\n"), start=b.line + 1):
        line, comment = (re.split(r"(?:^|\s)#", raw, maxsplit=1) + [""])[:2]  # a shell comment
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"\s*exit (\d+):", comment)
        want = int(m.group(1)) if m else 0
        for part in line.split("&&"):
            words = part.split()
            assert words and words[0] == "reshard", (
                f"{b.file.name}:{n}: {part.strip()!r} is not a reshard command: run it here or tag the "
                "block (<!-- not-run: why --> or <!-- tested-in: tests/FILE.py -->)")
            out.append((" ".join(words[1:]), want))
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_every_block_is_code_we_run_or_tagged() -> None:
    bs = all_blocks()
    assert any(b.file == README for b in bs) and any(b.file != README for b in bs)
    problems = []
    for b in bs:
        if b.lang not in CODE | NOT_CODE:
            problems.append(f"{b.id}: a block needs a language ({sorted(CODE | NOT_CODE)}), got {b.lang!r}")
        if b.tag is not None and b.tag not in TAGS:
            problems.append(f"{b.id}: unknown tag {b.tag!r} (known: {sorted(TAGS)})")
        if b.tag == "not-run" and len(b.tag_value) < 10:
            problems.append(f"{b.id}: not-run needs a reason")
        if b.tag == "snippet" and b.tag_value not in SNIPPETS:
            problems.append(f"{b.id}: no test claims snippet {b.tag_value!r}")
        if b.tag == "tested-in":
            test = ROOT / b.tag_value
            if not test.is_file():
                problems.append(f"{b.id}: {b.tag_value} does not exist")
                continue
            src = test.read_text()
            for script in sorted(set(re.findall(r"examples/(\w+\.py)", b.code))):
                if f'"{script}"' not in src:
                    problems.append(f"{b.id}: {b.tag_value} never runs {script}")
            for flag in sorted(set(re.findall(r"(--[a-z][\w-]*)", b.code)) - {"--standalone",
                                                                                "--nproc-per-node"}):
                if f'"{flag}"' not in src and f"'{flag}'" not in src:
                    problems.append(f"{b.id}: {b.tag_value} never passes {flag}")
        if b.lang == "bash" and b.tag is None:
            try:
                commands(b)
            except AssertionError as e:
                problems.append(str(e))
    assert not problems, "\n".join(problems)
    for name in SNIPPETS:
        named(name)


def test_readme_starts_with_the_two_make_targets() -> None:
    """The README's first block is `make demo` and `make test`, both Makefile
    targets, and CI (.ci/run) runs the README's test command."""
    first = blocks(README)[0]
    cmds = [ln.split("#")[0].strip() for ln in first.code.splitlines() if ln.strip()]
    assert cmds == ["make demo", "make test"], cmds
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    assert {"demo", "test"} <= set(targets), targets
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == "make test", ci


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The README's quick start saved as train.py and run twice in a fresh
    directory: the checkpoint root ``ckpt`` and each run's stdout."""
    d = tmp_path_factory.mktemp("quick")
    (d / "train.py").write_text(named("quick-start").code)
    outs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "train.py"], cwd=d, env=_env(), capture_output=True,
                           text=True, timeout=100)
        assert p.returncode == 0, p.stdout + p.stderr
        outs.append(p.stdout)
    return d, outs


def test_quick_start_runs_fresh_then_resumes(quick_start: tuple[Path, list[str]]) -> None:
    d, outs = quick_start
    assert "resumed" not in outs[0] and outs[0].strip().endswith("True")
    assert "resumed from" in outs[1] and "at step 4" in outs[1], outs[1]
    assert reshard.latest(d / "ckpt").endswith("step-00000008")
    # each checkpoint holds the state of its own step: the model differs from one to the next
    names = sorted(p.name for p in (d / "ckpt").iterdir())
    assert names == ["step-00000003", "step-00000004", "step-00000007", "step-00000008"], names
    for a, b in zip(names, names[1:], strict=False):
        assert reshard.inspect(d / "ckpt" / b).step == int(b[5:])
        assert not diff(d / "ckpt" / a, d / "ckpt" / b).identical, (a, b)


def test_every_untagged_block_runs(quick_start: tuple[Path, list[str]], tmp_path: Path) -> None:
    """Each python block as a script in its own directory; each bash block's
    commands in a copy of the quick start's directory, in order."""
    jobs: list[dict[str, Any]] = []
    want_exit: dict[str, int] = {}
    todo = [b for b in all_blocks() if b.tag is None and b.lang in CODE]
    assert any(b.lang == "python" for b in todo) and any(b.lang == "bash" for b in todo)
    for k, b in enumerate(todo):
        if b.lang == "python":
            jobs.append({"id": b.id, "kind": "python", "dir": str(tmp_path / f"py{k}"), "code": b.code})
            want_exit[b.id] = 0
        else:
            d = tmp_path / f"sh{k}"
            shutil.copytree(quick_start[0] / "ckpt", d / "ckpt")
            cmds = commands(b)
            assert cmds, f"{b.id}: no command"
            for n, (line, want) in enumerate(cmds):
                jid = f"{b.id}#{n}"
                jobs.append({"id": jid, "kind": "reshard", "dir": str(d), "code": line})
                want_exit[jid] = want
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "_doc_runner.py"), "jobs.json", "results.json"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(want_exit), set(want_exit) ^ set(results)
    bad = [f"{jid} ({next(j['code'][:80] for j in jobs if j['id'] == jid)!r}): exit {r['exit']}, "
           f"want {want_exit[jid]}\n{r['output'][-2000:]}"
           for jid, r in results.items() if not r["ok"] or r["exit"] != want_exit[jid]]
    assert not bad, "\n\n".join(bad)


def test_commands_are_judged_by_their_exit(tmp_path: Path) -> None:
    """The bash parser: `exit N:` comments, `&&` chains, and anything but
    reshard refused."""
    doc = tmp_path / "x.md"
    doc.write_text("```bash\nreshard ls a && reshard gc a --keep-last 1\n"
                   "reshard diff a b # exit 1: differ\nreshard verify a   # exits 1 when it fails\n```\n"
                   "```bash\ntorchrun x.py\n```\n")
    b, other = blocks(doc)
    assert commands(b) == [("ls a", 0), ("gc a --keep-last 1", 0), ("diff a b", 1), ("verify a", 0)]
    with pytest.raises(AssertionError, match="not a reshard command"):
        commands(other)


def slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (code blocks skipped)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        s = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_links_between_the_pages_resolve() -> None:
    """Every relative link of README and docs names a file that exists and,
    with ``#anchor``, a heading of it."""
    bad = []
    n = 0
    for doc in doc_files():
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            n += 1
            file, _, frag = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target}: no file {dest}")
            elif frag and dest.suffix == ".md" and frag not in slugs(dest):
                bad.append(f"{doc.name}: {target}: no heading #{frag} in {dest.name}")
    assert n > 10 and not bad, "\n".join(bad)


def test_readme_stays_a_landing_page() -> None:
    """The reference lives in docs/: the README stays short."""
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move reference text into docs/"


def test_cli_reference_lists_every_command_and_option() -> None:
    from _cli_doc import CLI_DOC, options
    from _cli_doc import commands as cli_commands

    text = CLI_DOC.read_text()
    sections = dict(re.findall(r"^## (reshard(?: [\w-]+)*)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    missing = []
    for path, cmd in cli_commands():
        title = "reshard " + " ".join(path)
        if title not in sections:
            missing.append(f"no section '## {title}'")
            continue
        missing += [f"{title}: {o}" for o in options(cmd) if o not in sections[title]]
    assert not missing, "docs/cli.md misses (python tests/_cli_doc.py --write):\n" + "\n".join(missing)


def test_cli_reference_is_the_current_help() -> None:
    from _cli_doc import BEGIN, CLI_DOC, END, reference

    text = CLI_DOC.read_text()
    now = text[text.index(BEGIN):text.index(END) + len(END)] + "\n"
    assert now == reference(), "docs/cli.md is stale: run `python tests/_cli_doc.py --write`"


def r_save_two_ranks(path: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reshard.save({"model": reshard.ModelState(model), "rank_note": 1}, path)


def r_load_on_rank0_alone(path: str, code: str) -> Any:
    """Only rank 0 loads, with the documented code, inside the initialised group."""
    if dist.get_rank() != 0:
        return None
    eval_model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        eval_model.weight.zero_()
    exec(code, {"reshard": reshard, "eval_model": eval_model, "path": path})  # noqa: S102
    torch.manual_seed(0)
    return torch.equal(eval_model.weight, torch.nn.Linear(4, 3).weight)


def test_one_process_load_inside_a_group(pool: WorkerPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    pool.run(2, r_save_two_ranks, path)
    assert pool.run(2, r_load_on_rank0_alone, path, named("one-process-load").code,
                    timeout=60.0) == [True, None]


def r_run_in(directory: str, code: str) -> bool:
    """Run the documented code on this rank with ``directory`` as the current one."""
    here = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(code, "reshard-two-ranks", "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        os.chdir(here)
    return True


def test_resharding_snippet_on_two_ranks(pool: WorkerPool, tmp_path: Path) -> None:
    code = named("reshard-two-ranks").code
    assert pool.run(2, r_run_in, str(tmp_path), code, timeout=60.0) == [True, True]
    m = reshard.inspect(tmp_path / "split" / "step-00000001")
    assert m.world_size == 2 and len(m.tensors["layer.weight"].chunks) == 2  # saved as two row slabs
