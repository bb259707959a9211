import sys

from dmlib.cli import main

sys.exit(main())
