"""``python -m benchmarks.chaos --store sqlite|postgres|redis [--tasks N] [--faults ...]``."""

import sys

from .run import main

sys.exit(main())
