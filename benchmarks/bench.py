"""The notebook every benchmark part drives, and what the parts recorded into it.

``Bench`` is an IPython shell in this process with ``%load_ext spmd``, the samples of every
figure, the facts said beside them, and the parts left out for want of room. Every part
(lifecycle.py, faults.py, cells.py, arrays.py, many.py, census_cost.py, attach.py, flood.py) takes
one and records into it; run.py runs them in turn and table.py reads what they recorded.

This module imports none of the parts: each part's own ``python -m benchmarks.<part>`` makes
a ``Bench`` from here, and run.py imports the parts, without an import circle.

Only the main thread touches a ``Bench``: the shell runs its cells there, and the samples,
facts and left-out parts are written there between cells.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from spmd.cluster.launchers import processes

# The cell that says the ranks are ready: a psum across every device of every process.
PSUM = (
    "import jax\nxs = jax.numpy.ones(jax.local_device_count())\n"
    "jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')(xs).block_until_ready()"
)
GRACE = 2.0  # the watchdog's default grace (spmd.cluster.session.Settings.grace)


class Bench:
    """The notebook (an IPython shell with the magics loaded) and the figures recorded in it."""

    def __init__(self) -> None:
        self.shell = InteractiveShell.instance()
        self.shell.run_line_magic("load_ext", "spmd")
        self.magics = self.shell.magics_manager.registry["SpmdMagics"]
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.facts: dict[str, object] = {}
        self.left_out: dict[str, str] = {}  # a part not measured here -> why (fits)
        self.left_out_ranks: set[int] = set()  # the numbers of ranks of those parts

    def cell(self, code: str) -> str:
        """Run ``code`` as a notebook cell; what it printed. A failed cell raises."""
        with capture_output() as cap:
            result = self.shell.run_cell(code)
        if not result.success:
            raise RuntimeError(
                f"benchmark cell failed: {code!r}: {cap.stderr}{result.error_in_exec}"
            )
        return cap.stdout

    def failing_cell(self, code: str) -> None:
        """Run ``code``, meant to fail; one that succeeds raises."""
        with capture_output():
            result = self.shell.run_cell(code)
        if result.success:
            raise RuntimeError(f"benchmark cell was meant to fail: {code!r}")

    def record(self, name: str, seconds: float) -> None:
        self.samples[name].append(seconds)

    def fits(self, n: int, backend: str, what: str) -> bool:
        """Whether this machine has room for ``n`` ranks of ``backend`` now, as ``%spmd
        start``'s own check counts them (forked by the rank server); where not, ``what`` is
        left out, with the check's sentence, into ``left_out``."""
        try:
            processes.check_room(n, backend, forked=True)
        except processes.StartRefused as exc:
            self.left_out[what] = str(exc)
            self.left_out_ranks.add(n)
            print(f"left out, {what}: {exc}", file=sys.stderr, flush=True)
            return False
        return True
