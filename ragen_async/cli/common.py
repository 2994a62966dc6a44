"""What the command line's handlers share: the console, the config arguments, failing with a message, the bench
tables' printing and the parsers of repeated options."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from collections.abc import Callable



console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
EXIT_INTERRUPTED = 75
"""``train``'s exit status after a stop signal (a checkpoint was written; ``--resume`` continues): EX_TEMPFAIL."""


ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config (configs/*.yaml); defaults if omitted")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. algo.clip_eps_high=0.28")]


def fail(message: str) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # one line, brackets as written
    raise typer.Exit(2)


def load(config: Path | None, overrides: list[str] | None):
    from ragen_async.config import ConfigError, load_config

    # A config path may be given as the first override-looking argument by mistake; say so clearly.
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        fail(str(e))
    from ragen_async.envs.registry import make_env_from_tag

    # Environments are built here once, before anything is created or loaded: an unknown tag or option
    # is one line, not a traceback after the run directory exists.
    for where, specs in (("rollout.envs", cfg.rollout.envs), ("validation.envs", cfg.validation.envs)):
        for spec in specs:
            try:
                make_env_from_tag(spec.tag, **spec.overrides)
            except (ValueError, TypeError) as e:
                fail(f"{where}: {e}")
    return cfg


VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", help="engine, Ray and worker output on the console too (default: RUN_DIR/logs/); sets RAGEN_LOG_LEVEL=INFO")]


def setup_logging(verbose: bool = False) -> None:
    from ragen_async.records.logfiles import LOG_LEVEL_ENV

    if verbose:
        os.environ[LOG_LEVEL_ENV] = "INFO"
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus)) or "?"


def invocation(argv: list[str] | None = None) -> str:
    """The command line as it was typed (``ragen-async`` and every argument given), for a benchmark's record: no
    flag rebuilt by hand, so none is dropped; what was not given took its default, which ``--help`` shows."""
    return shlex.join(["ragen-async", *(sys.argv[1:] if argv is None else argv)])


def print_bench(title: str, note: str, table: str, out: Path | None) -> None:
    """Print a benchmark's tables under the machine, the command as typed (:func:`invocation`) and a note, and
    (``out``) append them to a markdown file under a dated heading."""
    from ragen_async.bench.machine import machine_description

    text = f"machine: {machine_description()}\ncommand: `{invocation()}`\n{note}\n\n{table}\n"
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(f"\n## {title} ({time.strftime('%Y-%m-%d %H:%M')})\n\n{text}")


def parse_k(text: str) -> int | None:
    """A staleness bound as the command line gives it: an integer >= 0, or ``inf`` for unbounded."""
    if text.strip().lower() in ("inf", "none", "null"):
        return None
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise ValueError(f"--max-staleness {text!r}: expected an integer >= 0 or inf (unbounded)")
    return k


def pairs(items: list[str] | None, option: str, expected: str, key: Callable[[str], Any],
           value: Callable[[str], Any]) -> dict[Any, Any]:
    """Parse repeated ``KEY=VALUE`` options; a converter's ValueError fails the command naming the option."""
    parsed: dict[Any, Any] = {}
    for item in items or []:
        left, sep, right = item.partition("=")
        try:
            if not sep:
                raise ValueError("no '='")
            parsed[key(left)] = value(right)
        except ValueError:
            fail(f"{option} {item!r}: expected {expected}")
    return parsed
