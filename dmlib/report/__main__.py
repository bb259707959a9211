"""``python -m dmlib.report ...`` is ``dmlib report ...``."""

import sys

from dmlib.cli import main

sys.exit(main(["report", *sys.argv[1:]]))
