"""The notebook's side of ``spmd.engine.watch.answers``: requests on ipyparallel's control channel.

Every rank's stack is asked here first (a rank on this machine that does not answer is
then asked by signal: cells.py), and the signals of ranks with no process handle on this
machine (SSH, mpiexec, srun) travel here: on the channel ipyparallel already signs (and
encrypts off the loopback).
Requests go through the client's ``control`` and ``drop`` (client.py), called from any thread.
"""

from __future__ import annotations

import time

from spmd import wire


def request(client, engine_ids: list[int], msg_type: str, content: dict, timeout: float,
            contents: dict[int, dict] | None = None):
    """Send one request to each engine (``contents``: each engine's own, where given);
    {engine id: the reply's content, or None when the engine is gone or did not answer
    within ``timeout`` seconds}."""
    sends = [(e, (contents or {}).get(e, content)) for e in engine_ids]
    return {e: said for (e, _), said in zip(sends, send_all(client, msg_type, sends, timeout))}


def send_all(client, msg_type: str, sends: list[tuple[int, dict]], timeout: float) -> list:
    """Each (engine id, content) of ``sends`` sent at once, then one wait of ``timeout``
    seconds for them all: each reply's content, in order (None: the engine is gone or did not
    answer). A request left unanswered is dropped from the client's futures."""
    futures = []
    for engine_id, content in sends:
        try:
            futures.append(client.control(engine_id, msg_type, content))
        except Exception:  # unregistered (dead), or the client is closed
            futures.append(None)
    deadline = time.monotonic() + timeout
    replies = []
    for future in futures:
        try:
            msg = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # no future, a timeout
            replies.append(None)
            if future is not None:
                client.drop(future)
            continue
        replies.append(msg["content"])
    return replies


def stacks(client, engine_ids: list[int], timeout: float = 1.0) -> dict[int, list | None]:
    """{engine id: its main thread's frames as [file, line, function, source] (None: no
    answer)}."""
    replies = request(client, engine_ids, wire.WHERE_REQUEST, {}, timeout)
    return {eid: None if reply is None else reply.get("frames") for eid, reply in replies.items()}


def signal(client, engine_ids: list[int], signum: int, timeout: float = 1.0) -> list[int]:
    """Send ``signum`` to the engines' processes; the engine ids that confirmed it."""
    replies = request(client, engine_ids, wire.SIGNAL_REQUEST, {"signum": int(signum)}, timeout)
    return [eid for eid, reply in replies.items() if reply is not None]


def resume_debugged(client, engine_ids: list[int], timeout: float = 2.0) -> None:
    """Ranks paused in JupyterLab's debugger go on (DAP ``continue`` on each stopped thread):
    an interrupt then reaches their cell. Sent to every rank at once, one wait for all."""
    paused = dict(client.paused)
    sends = [(engine_id, {"type": "request", "seq": 0, "command": "continue",
                          "arguments": {"threadId": thread}})
             for engine_id in engine_ids for thread in paused.get(engine_id, ())]
    send_all(client, "debug_request", sends, timeout)
    client.resume(engine_ids)
