"""On a rank: answer "where are you?" with every thread's Python stack, from C, when the
control thread cannot (the cell holds the GIL).

The notebook reads the dumps (``spmd.cluster.lockstep.where``).
"""

from __future__ import annotations

import faulthandler
import os
import signal

STACK_FILE_ENV = "SPMD_STACK_FILE"

# The notebook sends this signal to ask a busy rank where it is (``%spmd where``).
WHERE_SIGNAL = signal.SIGUSR1


def listen_for_where() -> None:
    """Dump every thread's Python stack to ``$SPMD_STACK_FILE`` on WHERE_SIGNAL.

    faulthandler writes from C inside the signal handler, so it answers while the main thread
    is blocked in a collective, holds the GIL, or never returns to the interpreter; the shell
    channel, which ipyparallel would use, is busy with the cell. The file is opened for
    appending, so the notebook reads each dump from the size the file had before it asked.
    """
    path = os.environ.get(STACK_FILE_ENV)
    if path:
        stacks = open(path, "a")  # noqa: SIM115 (open for the life of the process)
        faulthandler.register(WHERE_SIGNAL, file=stacks, all_threads=True, chain=False)
        # A crash (segfault, abort) dumps there too: the death report shows the cell line.
        faulthandler.enable(file=stacks, all_threads=True)
