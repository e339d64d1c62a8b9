"""The controller's heart monitor: a rank that starts is registered at its first heartbeat.

ipyparallel's hub finishes an engine's registration once the heart monitor has heard the
engine's heart. The monitor pings every heart each period (300 ms at 64 ranks), and took a
pong from a heart it did not know as new only at the next beat: a registration waited one to
two periods (0.7 s of a 64-rank restart). Here (installed by controller.py, before the
monitor's process is forked from the controller):

- a new heart's first pong to the current ping announces it to the hub at once;
- when a heart connects to the ping socket, the current ping is sent again 20 ms later (once
  for all hearts that connect meanwhile), so a new heart need not wait for the next beat to
  answer. The repeated ping carries the same beat, so hearts that answer it twice count once
  and the misses are counted as before.

Threads: the heart monitor's process has one thread, its event loop; all of this runs there.
"""

from __future__ import annotations

import zmq
from zmq.eventloop.zmqstream import ZMQStream

# How long after a heart connects its ping is repeated (its subscription has reached the
# ping socket by then, on the loopback; a heart that misses it answers the next beat).
REPING_SECONDS = 0.02

_handle_pong = _start = None  # ipyparallel's own, bound by install()


def install() -> None:
    global _handle_pong, _start
    from ipyparallel.controller.heartmonitor import HeartMonitor

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
    events = ZMQStream(self.ping_stream.socket.get_monitor_socket(zmq.EVENT_ACCEPTED), self.loop)
    pending = False

    def ping() -> None:
        nonlocal pending
        pending = False
        self.ping_stream.send(str(self.lifetime).encode("ascii"))
        self.ping_stream.flush()

    def connected(_event: list) -> None:
        nonlocal pending
        if not pending:
            pending = True
            self.loop.call_later(REPING_SECONDS, ping)

    events.on_recv(connected)
    self._spmd_connections = events  # (kept: the stream is the monitor socket's reader)
