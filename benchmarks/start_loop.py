"""``python -m benchmarks.start_loop [N]``: start and stop a 2-rank cluster N times (500 by
default) and count the starts that failed. Not a test: it takes minutes.

Each start is a real ``%spmd start -n 2`` (jax initialized in both ranks) followed by
``%spmd stop``; a failure prints its message and the loop goes on.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 500
    backend = args[1] if len(args) > 1 else "jax"
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "spmd")
    failures: Counter[str] = Counter()
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        with capture_output() as cap:
            started = shell.run_cell(f"%spmd start -n 2 --backend {backend}")
            shell.run_cell("%spmd stop")
        if not started.success:
            why = str(started.error_in_exec or started.error_before_exec or cap.stderr)
            failures[why.splitlines()[0] if why else "?"] += 1
            print(f"start {i}: FAILED: {why}", flush=True)
        if i % 50 == 0:
            print(
                f"{i} starts, {sum(failures.values())} failed, "
                f"{(time.perf_counter() - t0) / i:.2f} s each",
                flush=True,
            )
    print(f"{n} starts ({backend}), {sum(failures.values())} failed")
    for why, count in failures.most_common():
        print(f"  {count} x {why}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
