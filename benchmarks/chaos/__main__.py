"""``python -m benchmarks.chaos --store sqlite|postgres|redis|mysql [--tasks N] [--faults ...]``."""

import sys

from .run import main

sys.exit(main())
