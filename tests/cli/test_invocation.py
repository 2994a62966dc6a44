"""A benchmark records the command as it was typed: every flag given, none rebuilt by hand (the rebuilt lines
dropped flags, so the commands quoted in docs/benchmarks.md were once edited by hand)."""

from __future__ import annotations

import subprocess
import sys

from ragen_async.cli import invocation


def test_a_benchmark_prints_and_records_every_flag_it_was_given(tmp_path):
    out = tmp_path / "bench.md"
    args = ["bench", "transport", "--groups", "10", "--repeats", "1", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "ragen_async.cli", *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    line = f"command: `ragen-async bench transport --groups 10 --repeats 1 --out {out}`"
    assert line in result.stdout and line in out.read_text()


def test_the_invocation_quotes_what_a_shell_would_split():
    assert invocation(["report", "a b", "--out", "x"]) == "ragen-async report 'a b' --out x"
