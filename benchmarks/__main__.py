"""``python -m kvroute.benchmarks NAME [args]``: the same as ``kvroute bench NAME [args]``."""

import sys

from kvroute.benchmarks.cli import main

sys.exit(main())
