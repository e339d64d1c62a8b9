"""The user's SPMD kernels, as a program reaches them: their connection files in Jupyter's
runtime folder (where jupyter_client and Jupyter Server write them), each message signed with
its file's key, so only the user who owns a kernel (and can read that file) can reach it.

A kernel is asked on its control channel (``kernel_info``, and the questions of
spmd/kernel/agents.py), which it answers while a cell runs; a cell is sent on its shell
channel, and what it shows is read from IOPub, by its request's id.

Threads: each ``Kernel`` is used by the one thread that opened it (each of the MCP server's
tools opens its own, in a worker thread of its own); its client's channels are its own.
"""

from __future__ import annotations

import glob
import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path

from spmd.wire import RANKS_DATA_MIME as MIME

ASK_SECONDS = 10.0  # a control request's answer (a kernel stuck outside Python: no answer)
FIND_SECONDS = 1.5  # kernel_info while listing (a connection file left by a kernel gone)


class NoKernel(RuntimeError):
    """The kernel asked for is not there, or did not answer; the text says what to do."""


def connection_files() -> list[Path]:
    """This user's kernels' connection files, newest first."""
    from jupyter_core.paths import jupyter_runtime_dir

    found = []
    for name in glob.glob(os.path.join(glob.escape(jupyter_runtime_dir()), "kernel-*.json")):
        try:
            if os.stat(name).st_uid == os.getuid():
                found.append(Path(name))
        except OSError:  # (removed meanwhile: its kernel ended)
            continue
    return sorted(found, key=_modified, reverse=True)


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # (removed meanwhile)
        return 0.0


def kernel_id(path: Path) -> str:
    """'kernel-1f2e....json' -> '1f2e...' (Jupyter Server's id of it)."""
    return path.stem.removeprefix("kernel-")


@dataclass
class Kernel:
    """One kernel, reached through its connection file."""

    path: Path
    client: object = field(repr=False)

    @classmethod
    def open(cls, path: Path) -> Kernel:
        from jupyter_client.blocking import BlockingKernelClient

        client = BlockingKernelClient(connection_file=str(path))
        client.load_connection_file()
        client.start_channels()
        return cls(path, client)

    @property
    def id(self) -> str:
        return kernel_id(self.path)

    def close(self) -> None:
        self.client.stop_channels()

    # -- the control channel ---------------------------------------------------------------

    def _control(self, msg_type: str, content: dict, seconds: float) -> dict:
        msg = self.client.session.msg(msg_type, content)
        self.client.control_channel.send(msg)
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoKernel(f"Kernel {self.id} did not answer within {seconds:.0f} s (ended, "
                               "or stuck outside Python?): list_kernels shows those that run.")
            try:
                reply = self.client.control_channel.get_msg(timeout=left)
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def info(self, seconds: float = ASK_SECONDS) -> dict:
        """Its kernel_info (answered on control while a cell runs)."""
        return self._control("kernel_info_request", {}, seconds)

    def ask(self, command: str, arguments: dict | None = None,
            seconds: float = ASK_SECONDS) -> dict:
        """The body of its answer to one of spmd/kernel/agents.py's (or the Ranks sidebar's)
        questions."""
        said = self._control("debug_request", {"type": "request", "seq": 0, "command": command,
                                               "arguments": arguments or {}}, seconds)
        body = said.get("body") or {}
        if said.get("success") is False or "error" in body:
            raise NoKernel(body.get("error") or said.get("message") or f"{command} failed.")
        return body

    def interrupt(self) -> None:
        """Kernel > Interrupt, as a front end whose kernel asks for it by message."""
        self._control("interrupt_request", {}, ASK_SECONDS)

    # -- the shell channel -----------------------------------------------------------------

    def run(self, code: str, seconds: float) -> dict:
        """``code`` as a cell: {"status", "text" (what a person sees, as text), "data" (the
        per-rank data, magics/cells/cell.py), "error"}; "status" is "running" where it had
        not ended after ``seconds`` (it goes on in the kernel)."""
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False,
                                     stop_on_error=False)
        text, data, error, status = [], None, None, "running"
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                msg = self.client.iopub_channel.get_msg(timeout=min(0.5, seconds))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind in ("display_data", "execute_result"):
                if MIME in content["data"]:
                    data = content["data"][MIME]
                elif content["data"].get("text/plain"):
                    text.append(content["data"]["text/plain"] + "\n")
            elif kind == "error":
                error = {"ename": content["ename"], "evalue": content["evalue"]}
                status = "error"
            elif kind == "clear_output":
                text.clear()
            elif kind == "status" and content["execution_state"] == "idle":
                status = "error" if error is not None else "ok"
                break
        return {"status": status, "text": "".join(text), "data": data, "error": error}


def find(kernel: str | None) -> Kernel:
    """The SPMD kernel of id ``kernel`` (or its first characters), or the only one; NoKernel
    says which there are where none or several match."""
    kernel = kernel or None  # ('' names no kernel: as if left out)
    files = [p for p in connection_files() if kernel_id(p).startswith(kernel or "")]
    if not files:
        raise NoKernel(f"No kernel of this user has an id beginning {kernel!r}: list_kernels "
                       "shows the SPMD kernels that run." if kernel else
                       "No kernel of this user runs: open a notebook with the SPMD kernel.")
    if kernel is not None and len(files) > 1:
        exact = [p for p in files if kernel_id(p) == kernel]
        if not exact:  # (never the newest of several: an interrupt would reach another's)
            raise NoKernel(f"{len(files)} kernels have an id beginning {kernel!r} ("
                           f"{', '.join(kernel_id(p) for p in files)}): give more of it.")
        files = exact
    if kernel is None and len(files) > 1:
        spmd = [k for k in every() if k["spmd"]]
        if len(spmd) != 1:
            raise NoKernel(f"{len(spmd)} SPMD kernels run: name one (list_kernels shows their "
                           "ids)." if spmd else "No SPMD kernel of this user runs.")
        files = [p for p in files if kernel_id(p) == spmd[0]["id"]]
    found = Kernel.open(files[0])
    try:
        if found.info(FIND_SECONDS).get("implementation") != "spmd":
            raise NoKernel(f"Kernel {found.id} is not an SPMD kernel: list_kernels shows them.")
    except NoKernel:
        found.close()
        raise
    return found


def every() -> list[dict]:
    """Each kernel of this user that answers: {"id", "spmd", "language", ...}, and for an SPMD
    kernel what it says of its cluster (spmdAbout)."""
    found = []
    for path in connection_files():
        try:
            kernel = Kernel.open(path)
        except (OSError, ValueError):  # (removed, or half written, as its kernel ends or starts)
            continue
        try:
            info = kernel.info(FIND_SECONDS)
        except NoKernel:  # (a file left by a kernel that ended: not listed)
            kernel.close()
            continue
        row = {"id": kernel.id, "spmd": info.get("implementation") == "spmd"}
        try:
            if row["spmd"]:
                row.update(kernel.ask("spmdAbout"))
        except NoKernel as exc:  # (it answers, but not this: say so, rather than hide it)
            row["error"] = str(exc)
        finally:
            kernel.close()
        found.append(row)
    return found
