"""The controller's heart monitor: a rank that starts is registered at its first heartbeat.

ipyparallel's hub finishes an engine's registration once the heart monitor has heard the
engine's heart. The monitor pings every heart each period (300 ms at 64 ranks), and takes a
pong from a heart it does not know as new only at the next beat: a registration would wait
one to two periods (0.7 s of a 64-rank restart). Here (installed by start.py):

- a new heart's first pong to the current ping announces it to the hub at once;
- when a heart has connected to the ping socket (its handshake done), the current ping is
  sent again 20 ms later, so a new heart need not wait for the next beat to answer. Hearts
  that connect meanwhile are covered by the same repeat, or by one more 20 ms after the last
  of them. A repeated ping carries the same beat: hearts that answer it twice count once,
  and misses are counted as before.

The monitor runs in a process of its own (multiprocessing): a forked one inherits the
patches; one started afresh (spawn, forkserver) starts through ``start_heartmonitor`` here,
which installs them first. It ends itself once the controller that started it is gone: the
controller's own end takes it along only when the controller lives to say so (a SIGKILL
after the launcher's one second, a SIGTERM before ipyparallel's handler is set, or an end
that raced the monitor's fork left it pinging for ever, reparented to init).

Threads: the heart monitor's process runs all of this on its event loop's thread, but for
``_end_with_controller``'s watch, which touches nothing else.
"""

from __future__ import annotations

import zmq
from zmq.eventloop.zmqstream import ZMQStream

# How long after a heart connects its ping is repeated (its subscription has reached the
# ping socket by then, on the loopback; a heart that misses it answers the next beat).
REPING_SECONDS = 0.02
# How often the monitor looks whether its controller still runs.
PARENT_CHECK_SECONDS = 0.5

_handle_pong = _start = None  # ipyparallel's own, bound by _patch()


def install() -> None:
    """(the controller, before it starts the heart monitor's process)"""
    import ipyparallel.controller.app as app

    _patch()
    app.start_heartmonitor = start_heartmonitor


def start_heartmonitor(*args, **kwargs) -> None:
    """ipyparallel's ``start_heartmonitor`` (the monitor process's target), patched."""
    from ipyparallel.controller import heartmonitor

    _end_with_controller()
    _patch()
    heartmonitor.start_heartmonitor(*args, **kwargs)


def _patch() -> None:
    global _handle_pong, _start
    from ipyparallel.controller.heartmonitor import HeartMonitor

    if HeartMonitor.start is not start:  # (once: a forked monitor has them already)
        _handle_pong, _start = HeartMonitor.handle_pong, HeartMonitor.start
        HeartMonitor.handle_pong, HeartMonitor.start = handle_pong, start


def handle_pong(self, msg: list) -> None:
    """``HeartMonitor.handle_pong``: a new heart's answer announces it now."""
    _handle_pong(self, msg)
    heart = msg[0]
    if heart in self.responses and heart not in self.hearts:
        self.handle_new_hearts([heart])  # (adds it to the hearts: the beat finds it good)


def start(self) -> None:
    """``HeartMonitor.start``, and the ping repeated soon after a heart connects."""
    _start(self)
    socket = self.ping_stream.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    events = ZMQStream(socket, self.loop)
    loop = self.loop
    last = 0.0  # when the latest heart connected
    timer = None

    def ping() -> None:
        nonlocal timer
        timer = None
        self.ping_stream.send(str(self.lifetime).encode("ascii"))
        self.ping_stream.flush()
        if last > loop.time() - REPING_SECONDS:  # (one connected since: its own, later)
            timer = loop.call_at(last + REPING_SECONDS, ping)

    def connected(_event: list) -> None:
        nonlocal last, timer
        last = loop.time()
        if timer is None:
            timer = loop.call_at(last + REPING_SECONDS, ping)

    events.on_recv(connected)
    self._spmd_connections = events  # (kept: the stream is the monitor socket's reader)


def _end_with_controller() -> None:
    """End this process soon after the controller that started it ends, watched from a
    thread of its own from the start (the monitor's loop waits for the hub before it turns).
    multiprocessing's own record of the parent answers for fork, spawn and forkserver alike
    (under forkserver, the parent process is the fork server, not the controller)."""
    import multiprocessing
    import os
    import threading
    import time

    controller = multiprocessing.parent_process()
    if controller is None:  # (not the monitor's own process)
        return

    def watch() -> None:
        while controller.is_alive():
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="spmd-controller-watch", daemon=True).start()
