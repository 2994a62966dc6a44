"""Where the output of engines and workers goes: files in the run directory, or the console.

A run prints its own progress; vLLM, Ray, transformers and torch print hundreds of lines a user did not
ask for. By default every process of a run sends its stdout and stderr (file descriptors 1 and 2, so the
processes it starts, vLLM's engine core among them, inherit them) to ``RUN_DIR/logs/<name>.log``, and the
console keeps the run's own lines. ``RAGEN_LOG_LEVEL=INFO`` or ``DEBUG`` (what ``train --verbose`` sets)
leaves all of it on the console, as before.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_LEVEL_ENV = "RAGEN_LOG_LEVEL"
"""The level of the project's own loggers on the console; INFO or DEBUG also shows engine and worker output."""

LOGS = "logs"
"""The run directory's folder of log files."""


def verbose() -> bool:
    """True when engine and worker output stays on the console."""
    return os.environ.get(LOG_LEVEL_ENV, "WARNING").upper() in {"DEBUG", "INFO"}


def log_dir(run_dir: Path) -> Path | None:
    """Where a run's processes write their output, or ``None`` when it stays on the console."""
    return None if verbose() else Path(run_dir) / LOGS


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def redirect_output(path: Path) -> bool:
    """From now on, this process's stdout and stderr (and those of every process it starts) append to
    ``path``. Returns False, leaving the output where it was, if ``path`` cannot be written (a run directory
    that is not on a file system this node shares)."""
    try:
        fd = _open(path)
    except OSError as e:
        print(f"output stays here: cannot write {path} ({e})", file=sys.stderr, flush=True)
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return True


@contextmanager
def output_to(path: Path | None) -> Iterator[None]:
    """Within the block, this process's stdout and stderr go to ``path`` (``None``: nowhere else); processes
    started inside it keep writing there."""
    if path is None:
        yield
        return
    fd = _open(path)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for s in saved:
            os.close(s)
        os.close(fd)


def loggers_to(path: Path | None, names: tuple[str, ...] = ("vllm",)) -> None:
    """The handlers of the loggers ``names`` that write to the console (file descriptor 1 or 2) write to
    ``path`` from now on (an in-process engine's per-request warnings); ``None`` changes nothing."""
    stream = None
    for name in names if path is not None else ():
        for handler in logging.getLogger(name).handlers:
            try:
                console = isinstance(handler, logging.StreamHandler) and handler.stream.fileno() in (1, 2)
            except (AttributeError, OSError, ValueError):  # not a real file (pytest's capture, a StringIO)
                console = False
            if console:
                stream = stream or path.open("a", buffering=1)
                handler.setStream(stream)


def keep_traceback(error: BaseException, path: Path) -> None:
    """Append ``error``'s traceback to ``path`` and name the file on the error, so that the console can
    show the error in one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        traceback.print_exception(error, file=f)
    error.add_note(f"traceback: {path}")


def one_line(error: BaseException) -> str:
    """``Type: first line of the message (notes)``: what the console shows of an error that ended a run."""
    lines = str(error).strip().splitlines()
    notes = "; ".join(getattr(error, "__notes__", []))
    return f"{type(error).__name__}: {lines[0] if lines else ''}" + (f" ({notes})" if notes else "")
