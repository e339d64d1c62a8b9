"""JupyterLab's debugger on 4 ranks, driven through one Jupyter Server as JupyterLab drives it
(its REST API and the kernel's websocket): the SPMD kernel beside the closest peer,
jupyter-distributed (a python3 kernel the peer's server extension runs as 4 processes), in
alternating rounds of one run.

Three figures for each, in JupyterLab's order of requests:

- ``setup``: ``initialize`` ... ``configurationDone`` (initialize, attach, debugInfo,
  configurationDone), the debugger turned on;
- ``execute_to_stopped``: a cell with a breakpoint, from its execute_request to the first
  ``stopped`` event;
- ``continue_to_reply``: once every rank has stopped, ``continue`` to the cell's execute_reply.

The peer runs where it is installed: in the Python that ``SPMD_BENCH_PEER_PYTHON`` names, or in
``.venv-peer`` (``make bench`` makes it: jupyter-distributed 0.1.1 with this checkout's
packages). The server then runs in that Python, with the peer's server extension, and the SPMD
kernel's spec points at this checkout's Python. Where the peer is not installed, the SPMD
kernel is measured alone and the run says so.

``python -m benchmarks.debugger_server [rounds]`` runs it alone; ``make bench`` runs it with
the rest.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.debugger import jupyter_data_in
from spmd.kernel.kernelspec import install

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / ".venv-peer"
KERNEL = "spmd-bench-server"
STOP_CELL = "a = 1\nb = a + 1\nc = b + 1"
FIGURES = ("setup", "execute_to_stopped", "continue_to_reply")


def peer_python() -> str | None:
    """The Python that has jupyter-distributed, or None where it is not installed."""
    named = os.environ.get("SPMD_BENCH_PEER_PYTHON") or str(PEER_VENV / "bin" / "python")
    if not Path(named).exists():
        return None
    found = subprocess.run([named, "-c", "import jupyter_distributed"], capture_output=True)
    return named if found.returncode == 0 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A Jupyter Server on 127.0.0.1 with a token, in ``python``; ended by its handle."""

    def __init__(self, python: str, jupyter_path: str, root: str) -> None:
        self.port, self.token = _free_port(), secrets.token_hex(16)
        env = dict(os.environ, JUPYTER_PATH=jupyter_path)
        self.proc = subprocess.Popen(
            [python, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", f"--IdentityProvider.token={self.token}",
             "--ServerApp.open_browser=False", f"--ServerApp.root_dir={root}",
             "--ServerApp.port_retries=0", "--ServerApp.allow_root=True"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def url(self, path: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    async def rest(self, method: str, path: str, body: dict | None = None, timeout=300) -> dict:
        from tornado.httpclient import AsyncHTTPClient

        response = await AsyncHTTPClient().fetch(
            self.url(path), method=method, request_timeout=timeout,
            headers={"Authorization": f"token {self.token}"},
            body=None if body is None else json.dumps(body), allow_nonstandard_methods=True)
        return json.loads(response.body) if response.body else {}

    async def ready(self, seconds: float = 60) -> None:
        end = time.monotonic() + seconds
        while True:
            try:
                await self.rest("GET", "/api/status")
                return
            except Exception:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError("the Jupyter Server did not start") from None
                await asyncio.sleep(0.2)

    def end(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Kernel:
    """One kernel's websocket, as JupyterLab holds it: requests on shell and control, replies
    and events read by one reader into per-message queues."""

    def __init__(self, server: Server, kernel_id: str) -> None:
        self.server, self.id = server, kernel_id
        self.session = uuid.uuid4().hex
        self._seq = 0
        self._waiting: dict[str, asyncio.Queue] = {}
        self.events: asyncio.Queue = asyncio.Queue()  # debug_events

    async def connect(self) -> None:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        request = HTTPRequest(
            self.server.url(f"/api/kernels/{self.id}/channels?session_id={self.session}", "ws"),
            headers={"Authorization": f"token {self.server.token}"})
        self.ws = await websocket_connect(request)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            raw = await self.ws.read_message()
            if raw is None:
                return
            msg = json.loads(raw)
            if msg["msg_type"] == "debug_event":
                self.events.put_nowait(msg["content"])
            queue = self._waiting.get(msg.get("parent_header", {}).get("msg_id", ""))
            if queue is not None:
                queue.put_nowait(msg)

    def _send(self, channel: str, msg_type: str, content: dict) -> asyncio.Queue:
        msg_id = uuid.uuid4().hex
        queue = self._waiting[msg_id] = asyncio.Queue()
        self.ws.write_message(json.dumps({
            "channel": channel, "content": content, "metadata": {}, "parent_header": {},
            "buffers": [],
            "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                       "username": "bench", "version": "5.3",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}))
        return queue

    async def _reply(self, queue: asyncio.Queue, reply_type: str, timeout: float) -> dict:
        while True:
            msg = await asyncio.wait_for(queue.get(), timeout)
            if msg["msg_type"] == reply_type:
                return msg["content"]

    async def debug(self, command: str, arguments: dict | None = None, timeout=120) -> dict:
        self._seq += 1
        queue = self._send("control", "debug_request", {
            "type": "request", "seq": self._seq, "command": command,
            "arguments": arguments or {}})
        return await self._reply(queue, "debug_reply", timeout)

    def execute(self, code: str) -> asyncio.Queue:
        return self._send("shell", "execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})

    async def run(self, code: str, timeout: float = 300) -> dict:
        return await self._reply(self.execute(code), "execute_reply", timeout)

    async def close(self) -> None:
        self.ws.close()
        self._reader.cancel()


async def _setup(kernel: Kernel) -> float:
    t0 = time.perf_counter()
    await kernel.debug("initialize", {
        "clientID": "jupyterlab", "clientName": "JupyterLab", "adapterID": "python",
        "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
        "supportsVariableType": True, "supportsVariablePaging": True,
        "supportsRunInTerminalRequest": True, "locale": "en"})
    await kernel.debug("attach", {})
    await kernel.debug("debugInfo", {})
    await kernel.debug("configurationDone", {})
    return time.perf_counter() - t0


async def _stop_and_continue(kernel: Kernel, ranks: int) -> tuple[float, float]:
    path = (await kernel.debug("dumpCell", {"code": STOP_CELL}))["body"]["sourcePath"]
    await kernel.debug("setBreakpoints", {"source": {"path": path},
                                          "breakpoints": [{"line": 2}]})
    while not kernel.events.empty():  # (what earlier rounds left)
        kernel.events.get_nowait()
    t0 = time.perf_counter()
    reply = kernel.execute(STOP_CELL)
    while True:
        event = await asyncio.wait_for(kernel.events.get(), 120)
        if event.get("event") == "stopped":
            to_stopped = time.perf_counter() - t0
            thread = event["body"]["threadId"]
            break
    # every rank stopped at its breakpoint (debugInfo's stopped threads), then continue
    end = time.monotonic() + 60
    while len((await kernel.debug("debugInfo"))["body"].get("stoppedThreads", [])) < ranks:
        if time.monotonic() > end:
            raise RuntimeError("not every rank stopped at the breakpoint")
        await asyncio.sleep(0.05)
    await kernel.debug("setBreakpoints", {"source": {"path": path}, "breakpoints": []})
    t1 = time.perf_counter()
    await kernel.debug("continue", {"threadId": thread})
    await kernel._reply(reply, "execute_reply", 120)
    return to_stopped, time.perf_counter() - t1


async def _round(kernel: Kernel, ranks: int, samples: dict, name: str) -> None:
    samples.setdefault(f"debugger_server_n4/setup_{name}", []).append(await _setup(kernel))
    stopped, went_on = await _stop_and_continue(kernel, ranks)
    samples.setdefault(f"debugger_server_n4/execute_to_stopped_{name}", []).append(stopped)
    samples.setdefault(f"debugger_server_n4/continue_to_reply_{name}", []).append(went_on)
    await kernel.debug("disconnect", {"restart": False, "terminateDebuggee": False})


async def _measure(rounds: int, peer: str | None, folder: str) -> dict[str, list[float]]:
    server = Server(peer or sys.executable, folder, folder)
    kernels: dict[str, Kernel] = {}
    samples: dict[str, list[float]] = {}
    try:
        await server.ready()
        spmd = await server.rest("POST", "/api/kernels", {"name": KERNEL})
        kernels["spmd"] = Kernel(server, spmd["id"])
        if peer:
            plain = await server.rest("POST", "/api/kernels", {"name": "python3"})
            await server.rest("POST", f"/jupyter-distributed/kernels/{plain['id']}",
                              {"action": "set", "world_size": 4})
            kernels["peer"] = Kernel(server, plain["id"])
        for kernel in kernels.values():
            await kernel.connect()
            await kernel.run("import os\nx = 1")
        for _ in range(rounds):
            for name, kernel in kernels.items():
                await _round(kernel, 4, samples, name)
    finally:
        for kernel in kernels.values():
            try:
                await kernel.close()
                await server.rest("DELETE", f"/api/kernels/{kernel.id}")
            except Exception:  # (the server's own shutdown ends it)
                pass
        server.end()
    return samples


def measure(rounds: int = 10) -> tuple[dict[str, list[float]], str]:
    """{figure: samples}, and a line on the peer (where it ran from, or that it did not)."""
    peer = peer_python()
    with tempfile.TemporaryDirectory(prefix="spmd-bench-server-") as folder:
        with jupyter_data_in(folder):
            install(KERNEL, user=True, processes=4)
        samples = asyncio.run(_measure(rounds, peer, folder))
    said = (f"jupyter-distributed from {peer}" if peer else
            "jupyter-distributed is not installed (make bench makes .venv-peer where pip can "
            "reach PyPI): the SPMD kernel alone")
    return samples, said


if __name__ == "__main__":
    found, said = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
    print(said)
    for name, xs in sorted(found.items()):
        print(f"{name}: median {statistics.median(xs) * 1000:.0f} ms "
              f"({min(xs) * 1000:.0f}-{max(xs) * 1000:.0f}), {len(xs)} runs")
    for figure in FIGURES:
        ours, theirs = (found.get(f"debugger_server_n4/{figure}_{k}") for k in ("spmd", "peer"))
        if ours and theirs:
            print(f"{figure}: spmd / peer = "
                  f"{statistics.median(ours) / statistics.median(theirs):.2f}")
