"""Runs the documentation's blocks in one process (one torch import for all):
``python tests/_doc_runner.py JOBS.json RESULTS.json``.

JOBS is a list of ``{"id", "kind", "dir", "code"}``: kind ``python`` runs
the code as a script (``__name__ == "__main__"``) with ``dir`` as the current
directory; kind ``reshard`` runs one ``reshard`` command line (the arguments
after ``reshard``, shell-quoted) in-process through click, in ``dir``.
RESULTS maps each id to ``{"ok", "exit", "output"}``: python ok when it
raised nothing, a command's exit code as it is (the test judges it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import traceback
from typing import Any


def run_python(code: str, name: str) -> dict[str, Any]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102
    except BaseException:  # noqa: BLE001 - a snippet's failure, whatever it is, is reported
        return {"ok": False, "exit": 1, "output": out.getvalue() + traceback.format_exc()}
    return {"ok": True, "exit": 0, "output": out.getvalue()}


def run_reshard(line: str) -> dict[str, Any]:
    from click.testing import CliRunner

    from reshard.cli import main

    r = CliRunner().invoke(main, shlex.split(line), prog_name="reshard")
    out = r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        out += "".join(traceback.format_exception(r.exception))
    return {"ok": r.exception is None or isinstance(r.exception, SystemExit), "exit": r.exit_code,
            "output": out}


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    results: dict[str, Any] = {}
    home = os.getcwd()
    for job in jobs:
        os.makedirs(job["dir"], exist_ok=True)
        os.chdir(job["dir"])
        try:
            if job["kind"] == "python":
                results[job["id"]] = run_python(job["code"], job["id"])
            else:
                results[job["id"]] = run_reshard(job["code"])
        finally:
            os.chdir(home)
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
