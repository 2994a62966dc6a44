"""Engine and worker output goes to the run directory's log files; the console keeps the run's own lines."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ragen_async.records import logfiles


def test_redirected_output_of_a_process_and_of_the_processes_it_starts_lands_in_the_file(tmp_path):
    log = tmp_path / "logs" / "rollout-w0.log"
    code = (
        "import subprocess, sys\n"
        "from pathlib import Path\n"
        "from ragen_async.records.logfiles import redirect_output\n"
        "print('before', flush=True)\n"
        f"assert redirect_output(Path({str(log)!r}))\n"
        "print('to the file'); print('stderr too', file=sys.stderr)\n"
        "subprocess.run([sys.executable, '-c', 'print(\"from a child\")'], check=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "before\n" and out.stderr == ""
    assert log.read_text().splitlines() == ["to the file", "stderr too", "from a child"]


def test_output_to_is_undone_after_the_block_and_none_changes_nothing(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with logfiles.output_to(log):
        subprocess.run([sys.executable, "-c", "print('engine says hi')"], check=True)
    with logfiles.output_to(None):
        subprocess.run([sys.executable, "-c", "print('on the console')"], check=True)
    subprocess.run([sys.executable, "-c", "print('after')"], check=True)
    assert log.read_text() == "engine says hi\n"
    assert capfd.readouterr().out == "on the console\nafter\n"


@pytest.mark.parametrize("level, verbose", [(None, False), ("WARNING", False), ("info", True), ("DEBUG", True)])
def test_verbose_follows_the_log_level(monkeypatch, tmp_path, level, verbose):
    if level is None:
        monkeypatch.delenv(logfiles.LOG_LEVEL_ENV, raising=False)
    else:
        monkeypatch.setenv(logfiles.LOG_LEVEL_ENV, level)
    assert logfiles.verbose() is verbose
    assert logfiles.log_dir(tmp_path) == (None if verbose else tmp_path / "logs")


def test_an_error_is_one_line_naming_the_file_that_keeps_its_traceback(tmp_path):
    try:
        raise RuntimeError("learner rank(s) [1] died during a learner step\nmore detail")
    except RuntimeError as e:
        logfiles.keep_traceback(e, tmp_path / "logs" / "driver.log")
        line = logfiles.one_line(e)
    path = tmp_path / "logs" / "driver.log"
    assert line == f"RuntimeError: learner rank(s) [1] died during a learner step (traceback: {path})"
    assert "Traceback (most recent call last)" in path.read_text() and "more detail" in path.read_text()


def test_console_handlers_of_a_library_logger_move_to_the_file_and_others_stay(tmp_path):
    import io
    import logging

    log = tmp_path / "engine.log"
    logger = logging.getLogger("ragen_test_lib")
    logger.propagate = False
    console = logging.StreamHandler(open(2, "w", closefd=False))  # noqa: SIM115 - the process's stderr
    memory = logging.StreamHandler(io.StringIO())  # not a console: stays
    logger.handlers = [console, memory]
    try:
        logfiles.loggers_to(None, ("ragen_test_lib",))
        assert console.stream.fileno() == 2
        logfiles.loggers_to(log, ("ragen_test_lib",))
        logger.warning("deprecated raw prompts")
        assert log.read_text() == "deprecated raw prompts\n"
        assert memory.stream.getvalue() == "deprecated raw prompts\n"
    finally:
        logger.handlers = []
