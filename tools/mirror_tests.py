#!/usr/bin/env python3
"""Lay ``tests/`` out as ``src/reshard/`` is laid out (issue 31 point 6).

One folder per package of ``src/reshard`` (``tests/saving/`` tests
``reshard/saving/``, ...); tests of the top-level modules and of the facade
(``reshard.save`` / ``load`` round trips), and of the repository's own
documents and scripts (README, docs, examples, the GPU check), stay in
``tests/`` itself; a rank helper (``_*_fns.py``, a job script) sits beside the
tests that use it, and one used from several folders sits in
``tests/support/``. Files are named after the module or feature they test.

Run from anywhere inside the repository::

    python tools/mirror_tests.py --dry-run   # the plan, nothing changed
    python tools/mirror_tests.py             # move (git mv) and rewrite

What a run does, in this order:

1. Plans: every ``MOVES`` entry whose old path exists is moved; one whose
   new path exists is done; both existing is a conflict (exit 2, nothing
   changed). Test files and helpers in ``tests/`` that ``MOVES`` does not
   name are *unknown*: their placement by the rule below is printed and the
   run stops (exit 2, nothing changed) unless ``--place-unknown`` is given;
   add them to ``MOVES`` instead to choose their place and name yourself.
2. Moves each file with ``git mv`` (a plain rename for an untracked file);
   a file moved one folder deeper gets ``Path(__file__).parents[N]`` and
   ``os.path.join(HERE, "..", ...)`` adjusted to its new depth.
3. Rewrites every reference in the repository's text files (not this
   script, not ``benchmarks/results_*``): ``tests/OLD`` paths (docs,
   README, comments, messages, ``::`` node ids), ``"tests" / "OLD"`` and
   ``"tests", "OLD"`` joins, and the module name of every renamed file
   (``import _user_fns`` and ``test_contract.py`` alike).
4. Applies ``EDITS`` (exact replacements: the pytest and ruff paths in
   pyproject.toml, the sys.path of a benchmark that imports a helper, the
   pool's docstring); an edit whose text is found neither before nor after
   is reported.
5. Checks the result: basenames unique over ``tests/`` (pytest's default
   import mode imports a test file by its basename, and the worker pool
   imports a rank function by its module name in the spawned workers, whose
   ``sys.path`` is the parent's: each test folder and ``tests``,
   ``tests/support``); every helper or test module imported by a test sits
   beside it, in ``tests/`` or in ``tests/support/``; a ``"_x.py"`` script
   a test starts sits beside it. A failed check exits 1.

Running it again changes nothing (idempotent). After merging a branch that
adds or changes tests: run it; moved files keep their history (git follows
renames), new files are reported with a proposed place.

The rule for a file not in ``MOVES`` (``--place-unknown``):

* a test file goes to the folder of the helper it imports (if any), else to
  the ``reshard`` package its ``import`` statements name most often
  (``reshard.testing`` and ``reshard.errors`` count only when nothing else is
  named; a top-level module such as ``reshard.collectives`` counts for
  ``tests/``), else stays in ``tests/``;
* a helper goes beside the tests that import it (after they are placed):
  to their folder if they share one, to ``tests/support/`` otherwise, and
  stays where it is if nothing imports it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

#: old path -> new path, both relative to ``tests/``.
MOVES: dict[str, str] = {
    # -- adapters (reshard/adapters) ---------------------------------------------------
    "test_cursor_packing.py": "adapters/test_cursor_packing.py",
    "_cursor_fns.py": "adapters/_cursor_fns.py",
    "test_pending.py": "adapters/test_cursor_pending.py",
    "test_hyperparams.py": "adapters/test_hyperparams.py",
    "test_optim_restore.py": "adapters/test_optimizer_restore.py",
    "_optim_fns.py": "adapters/_optim_fns.py",
    "test_peft.py": "adapters/test_peft.py",
    "_peft_fns.py": "adapters/_peft_fns.py",
    "test_rng_timing.py": "adapters/test_rng_timing.py",
    "_rng_timing_fns.py": "adapters/_rng_timing_fns.py",
    "test_torch_native.py": "adapters/test_torch_native.py",
    "_native_fns.py": "adapters/_native_fns.py",
    "test_training_state.py": "adapters/test_training_state.py",
    "test_training_state_dist.py": "adapters/test_training_state_dist.py",
    # -- bench (reshard/bench) ---------------------------------------------------------
    "test_bench_io.py": "bench/test_io.py",
    "test_real_ranks.py": "bench/test_real_ranks.py",
    "test_sim_clock.py": "bench/test_sim_clock.py",
    # -- catalog (reshard/catalog) -----------------------------------------------------
    "test_diff_logical.py": "catalog/test_diff_logical.py",
    "_diff_fns.py": "catalog/_diff_fns.py",
    # -- cli (reshard/cli) -------------------------------------------------------------
    "test_cli.py": "cli/test_cli.py",
    "test_cli_messages.py": "cli/test_cli_messages.py",
    "test_cli_start.py": "cli/test_cli_start.py",
    # -- commit (reshard/commit) -------------------------------------------------------
    "test_head_cas.py": "commit/test_head_cas.py",
    "test_lineage.py": "commit/test_lineage.py",
    "test_user_workflows.py": "commit/test_lineage_dist.py",
    "_user_fns.py": "commit/_lineage_dist_fns.py",
    "test_small_items.py": "commit/test_listing_edge_cases.py",
    "test_retention.py": "commit/test_retention.py",
    "test_shared_root.py": "commit/test_shared_root.py",
    "_shared_fns.py": "commit/_shared_fns.py",
    # -- demo (reshard/demo) -----------------------------------------------------------
    "test_data.py": "demo/test_data.py",
    "test_parity.py": "demo/test_parity.py",
    "test_parity_tolerance.py": "demo/test_parity_tolerance.py",
    "_parity_fns.py": "demo/_parity_fns.py",
    # -- faults (reshard/faults, and what a fault may cost) ----------------------------
    "test_failure_budget.py": "faults/test_fault_costs_one_save.py",
    "_budget_fns.py": "faults/_fault_cost_fns.py",
    "test_faults.py": "faults/test_faults.py",
    "test_faults_s3.py": "faults/test_faults_s3.py",
    "_s3_kill_job.py": "faults/_s3_kill_job.py",
    "test_peer_faults.py": "faults/test_peer_faults.py",
    "_peer_fns.py": "faults/_peer_fns.py",
    # -- formats (reshard/formats) -----------------------------------------------------
    "test_dcp_interop.py": "formats/test_dcp_interop.py",
    "test_export.py": "formats/test_hf_export.py",
    "test_hf_snapshot.py": "formats/test_hf_snapshot.py",
    "test_hf_ties.py": "formats/test_hf_ties.py",
    "test_hf_transformers.py": "formats/test_hf_transformers.py",
    "_hf_fns.py": "formats/_hf_fns.py",
    # -- fuzz (reshard/fuzz) -----------------------------------------------------------
    "test_fuzz.py": "fuzz/test_fuzz.py",
    # -- integrations (reshard/integrations) -------------------------------------------
    "test_integration_lightning.py": "integrations/test_lightning.py",
    "_lightning_fns.py": "integrations/_lightning_fns.py",
    "test_integration_transformers.py": "integrations/test_transformers.py",
    "_transformers_fns.py": "integrations/_transformers_fns.py",
    "test_integrations_torchtitan.py": "integrations/test_torchtitan.py",
    "_torchtitan_fns.py": "integrations/_torchtitan_fns.py",
    "_torchtitan_registry.py": "integrations/_torchtitan_registry.py",
    # -- loading (reshard/loading) -----------------------------------------------------
    "test_integrity.py": "loading/test_integrity.py",
    "test_io_floor.py": "loading/test_io_floor.py",
    "test_read_once.py": "loading/test_read_once.py",
    "_read_once_fns.py": "loading/_read_once_fns.py",
    "test_read_once_auto.py": "loading/test_read_once_auto.py",
    "test_read_state.py": "loading/test_read_state.py",
    "test_tp_reshard_reads.py": "loading/test_tp_reshard_reads.py",
    "test_transactional.py": "loading/test_transactional.py",
    "_txn_fns.py": "loading/_txn_fns.py",
    # -- manager (reshard/manager) -----------------------------------------------------
    "test_manager.py": "manager/test_manager.py",
    "test_manager_dist.py": "manager/test_manager_dist.py",
    "_manager_fns.py": "manager/_manager_fns.py",
    "test_tiers.py": "manager/test_tiers.py",
    "_tier_job.py": "manager/_tier_job.py",
    # -- ondisk (reshard/ondisk) -------------------------------------------------------
    "test_codec.py": "ondisk/test_codec.py",
    "test_dcp.py": "ondisk/test_dcp.py",
    "_dcp_fns.py": "ondisk/_dcp_fns.py",
    "test_manifest.py": "ondisk/test_manifest.py",
    "test_manifest_seal.py": "ondisk/test_manifest_seal.py",
    "test_values.py": "ondisk/test_values.py",
    # -- planning (reshard/planning) ---------------------------------------------------
    "test_scale.py": "planning/test_coordination_scale.py",
    "_scale_fns.py": "planning/_scale_fns.py",
    "test_plan_cli.py": "planning/test_plan_cli.py",
    "test_plan_restart.py": "planning/test_plan_restart.py",
    "_restart_fns.py": "planning/_restart_fns.py",
    "test_plan_store.py": "planning/test_plan_store.py",
    "test_planning.py": "planning/test_planner.py",
    # -- saving (reshard/saving) -------------------------------------------------------
    "test_async.py": "saving/test_async.py",
    "test_async_exit.py": "saving/test_async_exit.py",
    "test_cuda.py": "saving/test_cuda.py",
    "test_exit.py": "saving/test_exit.py",
    "test_incremental.py": "saving/test_incremental.py",
    "_incremental_fns.py": "saving/_incremental_fns.py",
    "test_staging_budget.py": "saving/test_staging_budget.py",
    "_staging_fns.py": "saving/_staging_fns.py",
    "test_staging_threads.py": "saving/test_staging_threads.py",
    # -- state (reshard/state) ---------------------------------------------------------
    "test_state_kinds.py": "state/test_kinds.py",
    "_kinds_fns.py": "state/_kinds_fns.py",
    "test_naming.py": "state/test_naming.py",
    "_naming_fns.py": "state/_naming_fns.py",
    "data": "support/data",  # checkpoints of earlier format versions (test_naming: v1, test_manifest_seal: v2)
    "test_sharding.py": "state/test_sharding.py",
    # -- storage (reshard/storage) -----------------------------------------------------
    "test_storage.py": "storage/test_conformance.py",
    "test_storage_registry.py": "storage/test_registry.py",
    "test_storage_backend_toy.py": "storage/test_backend_toy.py",
    "test_paths.py": "storage/test_path_schemes.py",
    "test_s3.py": "storage/test_s3.py",
    "_s3_fns.py": "storage/_s3_fns.py",
    "test_s3rver.py": "storage/test_s3rver.py",
    # -- testing (reshard/testing) -----------------------------------------------------
    "test_pool.py": "testing/test_pool.py",
    "_pool_fns.py": "support/_pool_fns.py",
    # -- tests/ itself: top-level modules, the facade, the repository's documents ------
    "test_arrival.py": "test_collectives_arrival.py",
    "test_tries.py": "test_collectives_tries.py",
    "test_commit_strategy.py": "commit/test_strategy.py",
    "test_options.py": "test_options.py",
    "test_architecture.py": "test_architecture.py",
    "_arrival_fns.py": "_arrival_fns.py",
    "test_contract.py": "test_api_edge_cases.py",
    "test_distributed.py": "test_save_load_dist.py",
    "test_save_load.py": "test_save_load.py",
    "test_transforms.py": "test_transforms.py",
    "test_public_paths.py": "test_public_paths.py",
    "test_readme.py": "test_readme.py",
    "_doc_runner.py": "_doc_runner.py",
    "_cli_doc.py": "_cli_doc.py",
    "test_examples.py": "test_examples.py",
    "test_gpu_check.py": "test_gpu_check.py",
    # -- tests/support: helpers imported from several folders --------------------------
    "_async_fns.py": "support/_async_fns.py",
    "_state_fns.py": "support/_state_fns.py",
    "_manifest_doc.py": "support/_manifest_doc.py",
    "_read_state_fns.py": "support/_read_state_fns.py",
}

SUPPORT = "support"  # the folder of helpers used from several folders (on pytest's pythonpath)

#: (file, old text, new text): exact replacements made after the moves.
EDITS: list[tuple[str, str, str]] = [
    ("pyproject.toml", 'pythonpath = ["tests"]', f'pythonpath = ["tests", "tests/{SUPPORT}"]'),
    ("pyproject.toml", 'src = ["src", "tests"]', 'src = ["src", "tests", "tests/*"]'),
    ("benchmarks/bench_integrations_torchtitan.py",
     'os.path.join(ROOT, "tests")]', 'os.path.join(ROOT, "tests", "integrations")]'),
    ("src/reshard/testing/pool.py",
     "(usually in ``tests/_*.py``) that runs once on every rank of an already initialised default\n"
     "  gloo process group of exactly ``world_size`` ranks.",
     "(usually in a rank helper ``tests/<package>/_*_fns.py`` beside the tests that use it) that\n"
     "  runs once on every rank of an already initialised default gloo process group of exactly\n"
     "  ``world_size`` ranks. Workers import it by its module name with the parent's ``sys.path``\n"
     "  (under pytest: ``tests``, ``tests/support`` and the folder of every collected test file)."),
    ("tests/conftest.py",
     '"""Session-wide fixtures: the gloo ``WorkerPool`` and hypothesis profiles."""',
     '"""Session-wide fixtures: the gloo ``WorkerPool`` and hypothesis profiles.\n\n'
     "``tests/`` mirrors ``src/reshard/``: ``tests/saving/`` tests ``reshard.saving`` and so\n"
     "on; tests of the top-level modules, of the facade and of the documents stay here. A rank\n"
     "helper (``_*_fns.py``) sits beside the tests that use it; one used from several folders\n"
     "sits in ``tests/support/`` (on pytest's ``pythonpath``). Basenames are unique over the\n"
     "tree (pytest imports each test file by its basename, and the pool's workers import rank\n"
     "functions by module name). ``tools/mirror_tests.py`` keeps the layout; run it after\n"
     'merging a branch that adds tests."""'),
    ("tests/formats/test_hf_export.py",
     "(the workers import it by name: ``tests`` is on the path)",
     "(the workers import it by name: its folder is on the path)"),
]

#: top-level modules of reshard: their tests live in tests/ itself.
TOP_MODULES = {"collectives", "collectives_base", "collectives_deferred", "errors", "options",
               "progress", "transforms", "_moved"}
WEAK = {"testing", "errors"}  # imported by tests of every package: a vote only when alone

TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".txt", ".yml", ".yaml", ".sh", ".rst"}
TEXT_NAMES = {"Makefile", "run"}


def sh(*args: str, cwd: Path) -> str:
    return subprocess.run(args, cwd=cwd, check=True, text=True, stdout=subprocess.PIPE).stdout


def is_test_file(rel: str) -> bool:
    name = PurePosixPath(rel).name
    return name.endswith(".py") and (name.startswith("test_") or name.startswith("_"))


def depth(rel: str) -> int:
    return len(PurePosixPath(rel).parts) - 1


def stem(rel: str) -> str:
    return PurePosixPath(rel).name.removesuffix(".py")


def folder(rel: str) -> str:
    parent = str(PurePosixPath(rel).parent)
    return "" if parent == "." else parent


# -- the state of tests/ -------------------------------------------------------------------
def test_files(tests: Path) -> list[str]:
    """Test files and helpers under tests/ (relative), conftest and data left out."""
    out = []
    for p in sorted(tests.rglob("*.py")):
        rel = p.relative_to(tests).as_posix()
        if "__pycache__" in rel or p.name == "conftest.py" or not is_test_file(rel):
            continue
        out.append(rel)
    return out


IMPORT_RE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.M)


def imported_modules(text: str) -> list[str]:
    return [a or b for a, b in IMPORT_RE.findall(text)]


def reshard_package_votes(text: str) -> collections.Counter[str]:
    votes: collections.Counter[str] = collections.Counter()
    for mod in imported_modules(text):
        parts = mod.split(".")
        if parts[0] == "reshard" and len(parts) > 1:
            votes["" if parts[1] in TOP_MODULES else parts[1]] += 1
    return votes


def propose(unknown: list[str], tests: Path, placed: dict[str, str]) -> dict[str, str]:
    """Placement of files MOVES does not name (rule in the module docstring).

    ``placed`` maps every known module stem to its folder after the moves."""
    src_packages = {p.name for p in (tests.parent / "src" / "reshard").iterdir()
                    if p.is_dir() and (p / "__init__.py").exists()}
    out: dict[str, str] = {}
    texts = {rel: (tests / rel).read_text() for rel in unknown}
    helpers = [r for r in unknown if PurePosixPath(r).name.startswith("_")]
    tests_ = [r for r in unknown if r not in helpers]
    for rel in tests_:
        mods = imported_modules(texts[rel])
        dirs = {placed[m] for m in mods if m.startswith("_") and m in placed} - {"", SUPPORT}
        if len(dirs) == 1:
            where = dirs.pop()
        else:
            votes = reshard_package_votes(texts[rel])
            strong = {k: v for k, v in votes.items() if k not in WEAK}
            pick = strong or votes
            where = max(sorted(pick), key=lambda k: pick[k]) if pick else ""
            if where and where not in src_packages:
                where = ""
        out[rel] = f"{where}/{PurePosixPath(rel).name}" if where else PurePosixPath(rel).name
        placed[stem(rel)] = where
    all_texts = {rel: (tests / rel).read_text() for rel in test_files(tests)}
    for rel in helpers:
        users = set()
        for other, text in all_texts.items():
            if other != rel and stem(rel) in imported_modules(text):
                users.add(placed.get(stem(other), folder(MOVES.get(other, out.get(other, other)))))
        where = folder(rel) if not users else users.pop() if len(users) == 1 else SUPPORT
        out[rel] = f"{where}/{PurePosixPath(rel).name}" if where else PurePosixPath(rel).name
    return out


# -- rewriting -----------------------------------------------------------------------------
def depth_rewrite(text: str, delta: int) -> tuple[str, list[str]]:
    """Adjust a moved file's references to the repository root by ``delta`` levels."""
    notes: list[str] = []
    if delta == 0:
        return text, notes

    def parents(m: re.Match[str]) -> str:
        return f"{m.group(1)}.parents[{int(m.group(2)) + delta}]"

    text = re.sub(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parents\[(\d+)\]", parents, text)
    here_names = re.findall(r"^(\w+)\s*=\s*os\.path\.dirname\((?:os\.path\.abspath\()?__file__\)?\)",
                            text, flags=re.M)
    for name in here_names:
        up = '"..", ' * delta
        text = re.sub(rf'os\.path\.join\({name}, "\.\.", ', f'os.path.join({name}, "..", {up}', text)
    for line in text.splitlines():
        if "__file__" in line and re.search(r"\.parent\.parent|dirname\(os\.path\.dirname", line):
            notes.append(f"check by hand (depth changed by {delta}): {line.strip()}")
    return text, notes


def reference_rules(moves: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    rules: list[tuple[re.Pattern[str], str]] = []
    for old, new in sorted(moves.items(), key=lambda kv: -len(kv[0])):
        if old == new:
            continue
        o = re.escape(old)
        rules.append((re.compile(rf"(?<![\w-])tests/{o}(?![\w])"), f"tests/{new}"))
        joined_slash = " / ".join(f'"{p}"' for p in PurePosixPath(new).parts)
        joined_comma = ", ".join(f'"{p}"' for p in PurePosixPath(new).parts)
        rules.append((re.compile(rf'"tests"(\s*)/(\s*)"{o}"'), f'"tests" / {joined_slash}'))
        rules.append((re.compile(rf'"tests",(\s*)"{o}"'), f'"tests", {joined_comma}'))
        if old.endswith(".py") and stem(old) != stem(new):
            rules.append((re.compile(rf"(?<![\w])(?<!def ){re.escape(stem(old))}(?![\w])"),
                          stem(new)))
    return rules


def text_files(root: Path, me: Path) -> list[Path]:
    listed = sh("git", "ls-files", "-co", "--exclude-standard", cwd=root).splitlines()
    out = []
    for rel in listed:
        p = root / rel
        if p.resolve() == me or rel.startswith("benchmarks/results_") or not p.is_file():
            continue
        if p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES:
            out.append(p)
    return out


# -- checks --------------------------------------------------------------------------------
def check(tests: Path) -> list[str]:
    problems = []
    files = test_files(tests)
    by_stem: dict[str, list[str]] = collections.defaultdict(list)
    for rel in files:
        by_stem[stem(rel)].append(rel)
    for s, rels in sorted(by_stem.items()):
        if len(rels) > 1:
            problems.append(f"basename {s}.py used twice: {', '.join(rels)}")
    where = {stem(rel): folder(rel) for rel in files}
    for rel in files:
        text = (tests / rel).read_text()
        for mod in imported_modules(text):
            if mod in where and where[mod] not in ("", SUPPORT, folder(rel)):
                problems.append(f"tests/{rel} imports {mod} from tests/{where[mod]}/: move it beside "
                                f"its users, or to tests/{SUPPORT}/ if several folders use it")
        for script in set(re.findall(r"[\"'](_[a-z]\w*\.py)[\"']", text)):
            if not (tests / folder(rel) / script).exists():
                problems.append(f"tests/{rel} names {script}, which is not beside it")
    for rel in files:
        if folder(rel) not in ("", SUPPORT) and not PurePosixPath(rel).name.startswith("test_"):
            users = [o for o in files if o != rel and stem(rel) in imported_modules((tests / o).read_text())]
            dirs = {folder(u) for u in users}
            if len(dirs) > 1:
                problems.append(f"tests/{rel} is used from {sorted(dirs)}: it belongs in tests/{SUPPORT}/")
    return problems


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    ap.add_argument("--place-unknown", action="store_true",
                    help="move the files MOVES does not name by the rule instead of stopping")
    args = ap.parse_args(argv)

    me = Path(__file__).resolve()
    root = Path(sh("git", "rev-parse", "--show-toplevel", cwd=me.parent).strip())
    tests = root / "tests"
    moves = dict(MOVES)

    todo, conflicts, missing = {}, [], []
    for old, new in moves.items():
        o, n = tests / old, tests / new
        if old == new:
            if not o.exists():
                missing.append(old)
        elif o.exists() and n.exists():
            conflicts.append(f"both tests/{old} and tests/{new} exist: merge them by hand")
        elif o.exists():
            todo[old] = new
        elif not n.exists():
            missing.append(old)
    known = set(moves) | set(moves.values())
    unknown = [rel for rel in test_files(tests)
               if rel not in known and not any(rel.startswith(k + "/") for k in known)]
    top_unknown = [rel for rel in unknown if folder(rel) == ""]
    placed_elsewhere = [rel for rel in unknown if folder(rel) != ""]

    placed = {stem(new): folder(new) for new in moves.values() if new.endswith(".py")}
    proposals = propose(top_unknown, tests, placed) if top_unknown else {}

    for m in missing:
        print(f"note: tests/{m} (in MOVES) is gone: drop it from MOVES if it was removed on purpose")
    for rel in placed_elsewhere:
        print(f"note: tests/{rel} is not in MOVES; left where it is")
    if proposals:
        print("files in tests/ that MOVES does not name (proposed by the rule):")
        for old, new in proposals.items():
            print(f"    {old!r}: {new!r},")
    if conflicts:
        print("\n".join(conflicts))
        return 2
    if proposals and not args.place_unknown:
        print("add them to MOVES in tools/mirror_tests.py (or rerun with --place-unknown); nothing changed")
        return 2
    for old, new in proposals.items():
        if old != new:
            todo[old] = new
            moves[old] = new
    if args.dry_run:
        for old, new in todo.items():
            print(f"would move tests/{old} -> tests/{new}")
        print(f"{len(todo)} to move")
        return 0

    tracked = set(sh("git", "ls-files", "tests", cwd=root).splitlines())
    notes: list[str] = []
    for old, new in todo.items():
        o, n = tests / old, tests / new
        n.parent.mkdir(parents=True, exist_ok=True)
        if o.is_file() and old.endswith(".py"):
            text, more = depth_rewrite(o.read_text(), depth(new) - depth(old))
            notes += [f"tests/{new}: {x}" for x in more]
            o.write_text(text)
        if any(t == f"tests/{old}" or t.startswith(f"tests/{old}/") for t in tracked):
            sh("git", "mv", f"tests/{old}", f"tests/{new}", cwd=root)
        else:
            shutil.move(str(o), str(n))
            notes.append(f"tests/{old} was not tracked: moved without git (git add it)")
        print(f"moved tests/{old} -> tests/{new}")

    rules = reference_rules(moves)
    changed = []
    for p in text_files(root, me):
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        new_text = text
        for pat, repl in rules:
            new_text = pat.sub(repl, new_text)
        if new_text != text:
            p.write_text(new_text)
            changed.append(p.relative_to(root).as_posix())
    for rel in changed:
        print(f"rewrote references in {rel}")

    for rel, old, new in EDITS:
        p = root / rel
        text = p.read_text() if p.exists() else ""
        if old in text:
            p.write_text(text.replace(old, new))
            print(f"edited {rel}")
        elif new not in text:
            notes.append(f"EDITS: {rel}: neither the old nor the new text is there: {old[:60]!r}")

    for x in notes:
        print(f"note: {x}")
    problems = check(tests)
    for x in problems:
        print(f"problem: {x}")
    print(f"{len(todo)} moved, {len(changed)} files' references rewritten, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")
    sys.exit(main())
