"""``python -m ragen_async.tinymodel`` = ``ragen-async make-model``."""

import sys

from ragen_async.cli import app

sys.exit(app(["make-model", *sys.argv[1:]]))
