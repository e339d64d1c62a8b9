"""The notebook's side of ``spmd.engine.control``: requests on ipyparallel's control channel.

For ranks with no process handle on this machine (SSH, mpiexec, srun): their stacks and
their signals travel on the channel ipyparallel already signs (and encrypts off the loopback).
"""

from __future__ import annotations

import time

from spmd.engine import control


def request(client, engine_ids: list[int], msg_type: str, content: dict, timeout: float,
            contents: dict[int, dict] | None = None):
    """Send one request to each engine (``contents``: each engine's own, where given);
    {engine id: the reply's content, or None when the engine is gone or did not answer
    within ``timeout`` seconds}."""
    futures = {}
    for engine_id in engine_ids:
        try:
            ident = client._build_targets([engine_id])[0][0]
            futures[engine_id] = client._send(
                client._control_stream, msg_type, ident=ident,
                content=(contents or {}).get(engine_id, content),
            )
        except Exception:  # unregistered (dead), or the client is closed
            futures[engine_id] = None
    deadline = time.monotonic() + timeout
    replies = {}
    for engine_id, future in futures.items():
        try:
            msg = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # no future, a timeout
            replies[engine_id] = None
            continue
        replies[engine_id] = msg["content"]
    return replies


def stacks(client, engine_ids: list[int], timeout: float = 1.0) -> dict[int, list | None]:
    """{engine id: its main thread's frames as [file, line, function, source] (None: no
    answer)}."""
    replies = request(client, engine_ids, control.WHERE, {}, timeout)
    return {eid: None if reply is None else reply.get("frames") for eid, reply in replies.items()}


def signal(client, engine_ids: list[int], signum: int, timeout: float = 1.0) -> list[int]:
    """Send ``signum`` to the engines' processes; the engine ids that confirmed it."""
    replies = request(client, engine_ids, control.SIGNAL, {"signum": int(signum)}, timeout)
    return [eid for eid, reply in replies.items() if reply is not None]


def resume_debugged(client, engine_ids: list[int], timeout: float = 2.0) -> None:
    """Ranks paused in JupyterLab's debugger go on (DAP ``continue`` on each stopped thread):
    an interrupt then reaches their cell."""
    paused = dict(client.paused)
    for engine_id in engine_ids:
        for thread in paused.get(engine_id, ()):
            request(client, [engine_id], "debug_request",
                    {"type": "request", "seq": 0, "command": "continue",
                     "arguments": {"threadId": thread}}, timeout)
    client.resume(engine_ids)
