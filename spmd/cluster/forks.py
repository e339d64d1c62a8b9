"""The notebook's side of a rank server (spmd/engine/server.py): the process that imports
what ranks need once per host and forks them, and the ipyparallel launchers whose engines it
forks.

Threads: the session's thread starts and closes the server; ipyparallel's event-loop thread
asks it for forks (the launchers' ``start``); one reader thread per server reads its replies
and is the only writer of ``_replies`` and ``_exits`` (each reply sets an Event that the
others wait on). ``_send`` is under a lock: requests come from the event-loop thread and, at
the end, the session's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time

import psutil

from spmd.cluster.launch import RankedEngineLauncher, RankedEngineSetLauncher
from spmd.cluster.watchdog import how_it_ended
from spmd.engine import server as rank_server
from spmd.engine.orphans import PARENT_ENV


class ServerUnavailable(RuntimeError):
    """The rank server cannot fork ranks; the text says why."""


class RankServer:
    """One host's rank server, started by this notebook (``command`` runs it: here, or
    through ssh on another host)."""

    def __init__(self, command: list[str], log_path: str) -> None:
        self.command = command
        self.log_path = log_path
        self.why_not = ""  # why it cannot be used ('' while it can)
        self.pid = 0  # the server's own pid, on its host
        self._ready = threading.Event()
        self._replies: dict[str, dict] = {}
        self._replied = threading.Condition()
        self._exits: dict[int, int] = {}  # pid of a rank: its exit code (negative: signal)
        self._send_lock = threading.Lock()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server (it imports on its own while the caller goes on)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                # (its parent, for the ranks it forks: they watch it, and it watches us
                # through its stdin)
                env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}),
                start_new_session=True,  # (the notebook's ^C is not for it)
            )
        threading.Thread(target=self._read, name="spmd-rank-server", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server is ready to fork (waiting up to ``timeout`` for its imports);
        when it is not, ``why_not`` says why."""
        if not self._ready.wait(timeout) and not self.why_not:
            self.why_not = f"its imports took more than {timeout:.0f} s"
        return not self.why_not

    def fork(self, key: str, env: dict[str, str], argv: list[str], output: str, cwd: str,
             timeout: float = 30.0) -> int:
        """Fork one rank; its pid. Raises ServerUnavailable (the start then fails)."""
        self._send({"fork": key, "env": env, "argv": argv, "output": output, "cwd": cwd})
        deadline = time.monotonic() + timeout
        with self._replied:
            while key not in self._replies:
                left = deadline - time.monotonic()
                if self.why_not or left <= 0:
                    raise ServerUnavailable(self.why_not or "it did not answer a fork")
                self._replied.wait(min(left, 0.5))
            reply = self._replies.pop(key)
        if "error" in reply:
            raise ServerUnavailable(f"it could not fork: {reply['error']}")
        return reply["pid"]

    def exit_code(self, pid: int, timeout: float) -> tuple[bool, int | None]:
        """(whether the rank ``pid`` has ended, its exit code), waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._replied:
            while pid not in self._exits and not self._gone():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, None
                self._replied.wait(left)
            return True, self._exits.get(pid)

    def close(self) -> None:
        """End the server and every rank it forked (it kills them when its stdin closes)."""
        process = self.process
        if process is None:
            return
        with self._send_lock:
            try:
                process.stdin.close()
            except OSError:
                pass
        try:
            process.wait(timeout=6)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @property
    def usable(self) -> bool:
        """Whether it runs and can fork."""
        return not self.why_not and not self._gone()

    def ended_how(self) -> str:
        """How the server ended, in words ('' while it runs)."""
        return how_it_ended(self.process.returncode) if self._gone() else ""

    def _gone(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def _send(self, message: dict) -> None:
        with self._send_lock:
            try:
                self.process.stdin.write((json.dumps(message) + "\n").encode())
                self.process.stdin.flush()
            except (OSError, ValueError) as exc:  # (closed: the server ended)
                raise ServerUnavailable(f"it has ended ({exc})") from None

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._replied:
                if "ready" in message:
                    self.pid = message["ready"]
                    self._ready.set()
                elif "failed" in message:
                    self.why_not = message["failed"]
                    self._ready.set()
                elif "forked" in message:
                    self._replies[message["forked"]] = message
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                self._replied.notify_all()
        with self._replied:
            self.why_not = self.why_not or "it ended"
            self._ready.set()
            self._replied.notify_all()


def local_server(python: str, backend: str, preload: list[str], log_path: str) -> RankServer:
    """This machine's rank server for ranks of ``backend``, started."""
    modules = rank_server.modules_for(backend, preload)
    server = RankServer([python, "-m", "spmd.engine.server", *modules], log_path)
    server.start()
    return server


class ForkedEngineLauncher(RankedEngineLauncher):
    """One local rank, forked by the rank server instead of started as a new Python."""

    @property
    def server(self) -> RankServer:
        return self.parent.server

    def start(self) -> None:
        env = dict(os.environ, **self.get_env())
        # (what comes after ``-m spmd.engine`` is the engine's own command line)
        argv = [self.args[0], *self.args[self.args.index("spmd.engine") + 1:]]
        key = f"{self.parent.engine_set_id}/{self.identifier}"
        self.pid = self.server.fork(key, env, argv, self.output_file, self.work_dir)
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()

    def _wait(self) -> None:
        """Until the server reports the rank's end (it is the rank's parent: only it reads
        the exit code), keeping the code where the notebook reads it (see the parent's)."""
        ended, code = False, None
        while not self._stop_waiting.is_set() and self.state == "running" and not ended:
            ended, code = self.server.exit_code(self.pid, timeout=0.5)
        if ended or not self._stop_waiting.is_set():
            self.exit_code, self.exited_at = (code if ended else None), time.monotonic()
        stop_data = dict(exit_code=self.exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))


class ForkedEngineSetLauncher(RankedEngineSetLauncher):
    """The local ranks, forked by the cluster's rank server; started the usual way (a Python
    each) where the server could not be used, which ``fell_back`` then says."""

    launcher_class = ForkedEngineLauncher
    fell_back = ""

    @property
    def server(self) -> RankServer:
        return self.parent.rank_server

    async def start(self, n: int):
        server = self.server
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, server.wait_ready, 60.0)
        if not ready:
            self.fell_back = server.why_not
            self.launcher_class = RankedEngineLauncher
        return super().start(n)

