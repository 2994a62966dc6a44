"""``python -m ragen_async.cli``: the command line (vLLM on CPU spawns processes that import this module again,
hence the guard)."""

import sys

from ragen_async.cli import app

if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
