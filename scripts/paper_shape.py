#!/usr/bin/env python3
"""`make paper-shape`: a paper config's settings end to end at Qwen2.5-0.5B's shape on CPU.

    .venv/bin/python scripts/paper_shape.py                 # the full shape: 24 layers, vocabulary 151,936
    .venv/bin/python scripts/paper_shape.py --layers 2      # the quick variant (the 0.5B's widths and vocabulary)

What it builds, runs and checks: ragen_async/bench/paper_shape.py. Exit status 0 only when every check
passes; the last line is `paper-shape: OK ...` or `paper-shape: FAILED ...`.
"""

import sys

from ragen_async.bench.paper_shape import main

if __name__ == "__main__":
    sys.exit(main())
