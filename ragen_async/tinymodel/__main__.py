import sys

from ragen_async.tinymodel.cli import main

sys.exit(main())
