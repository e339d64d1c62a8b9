"""``python -m spmd.kernel install | list | remove``."""

import sys

from spmd.kernel.kernelspec import main

sys.exit(main())
