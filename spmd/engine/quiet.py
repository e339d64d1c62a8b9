"""On a rank: the messages no one reads are not sent.

ipykernel announces every request twice on IOPub before it runs it: a ``status: busy`` and,
for a cell, an ``execute_input`` echoing its code. A Jupyter front end shows them; the
notebook that drives the ranks does not read them (it knows the code it sent, and a rank is
busy from the send until its reply and ``status: idle``). At 64 ranks they were half of what
a trivial cell's ranks sent: 128 messages a cell that each rank signed and sent, the
controller forwarded and parsed, and the notebook's client verified and parsed, one Python
message at a time. ``status: idle`` stays: it tells the notebook that a rank's outputs have
all come (ipyparallel's output future), and the reply stays.

The kernel's log also made five DEBUG records a cell (each message's type and content) that
no handler wrote: ipyparallel renames the engine's logger after registration, and the copy
the kernel holds is left at DEBUG. It is set to the engine's own level, WARNING.

Threads: installed from the rank's main thread once it has joined; the kernel's methods are
replaced on its instance before the first cell, and read by whichever thread publishes.
"""

from __future__ import annotations

import logging


def install(kernel) -> None:
    """The kernel leaves out ``status: busy`` and ``execute_input`` (spmd/internals.py lists
    ``Kernel._publish_status`` and ``Kernel._publish_execute_input``)."""
    publish_status = kernel._publish_status

    def _publish_status(status, channel, parent=None):
        if status != "busy":
            publish_status(status, channel, parent)

    kernel._publish_status = _publish_status
    kernel._publish_execute_input = lambda code, parent, execution_count: None
    if kernel.log.level < logging.WARNING:
        kernel.log.setLevel(logging.WARNING)
