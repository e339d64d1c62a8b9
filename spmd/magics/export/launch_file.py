"""The file that launches an exported script (``%spmd export``, export.py): a shell script for
local processes, ssh, mpiexec or torchrun, or an sbatch script, for the cluster's launcher.

Plain functions of the cluster's settings; runs on the main thread, like every magic.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

from spmd.cluster.records import Settings

DEFAULT_PORT = 29500  # torch's own default MASTER_PORT


@dataclass(frozen=True)
class LaunchFile:
    """How ``script`` is launched: ``settings.n`` processes, by ``launcher``."""

    settings: Settings
    launcher: str
    script: str  # the script's absolute path
    path: str  # where this file is written
    python: str  # the Python the ranks ran
    gpus: int | None  # GPUs each rank had (None: left alone)
    # rank 0's address as the other ranks reached it in the notebook ('': unknown): an ssh
    # alias or a host file's name need not resolve on the other hosts
    master: str = ""
    # each line the job prints begins with its rank ("[rank 1] "), as in the notebook, where
    # there is more than one (--raw-output: as the processes wrote them)
    labels: bool = True
    # the ranks' one string-hash secret in the notebook ('': each rank had its own)
    hash_seed: str = ""

    @property
    def backends(self) -> list[str]:
        return [b for b in self.settings.backend.split(",") if b != "none"]

    def command(self) -> str:
        name = os.path.basename(self.path)
        hosts = self.settings.where.hosts
        if self.launcher == "torchrun" and len(hosts) > 1:
            return ", ".join(f"bash {shlex.quote(name)} {i} on {h}"
                             for i, (h, _) in enumerate(hosts))
        return f"sbatch {shlex.quote(name)}" if self.launcher == "slurm" else \
            f"bash {shlex.quote(name)}"

    def text(self) -> str:
        s, n = self.settings, self.settings.n
        script = self.script
        py_dir = os.path.dirname(self.python)
        py_dir = (_in_double_quotes(py_dir) if os.path.isabs(py_dir) else
                  "$HOME" + _in_double_quotes(py_dir[1:]) if py_dir.startswith("~/") else "")
        # (the processes run the ranks' own interpreter by its path, whatever `python` is
        # here; PATH is for the tools beside it: torchrun, and the cells' commands)
        path_line = [f'export PATH="{py_dir}:$PATH"  # the Python the ranks ran, with its '
                     "packages"] if py_dir else []
        if self.hash_seed:  # (one for every process, as the rank server gave the ranks)
            path_line += ["# The ranks' string-hash secret in the notebook: a set's order is "
                          "the same in every process.",
                          f"export PYTHONHASHSEED={self.hash_seed}"]
        python = _shell_path(self.python)
        here = '"$(dirname "$0")"/' + shlex.quote(os.path.basename(script))
        store = ([f"rm -f {shlex.quote(script[:-3] + '.torch-store')}  # (torch's file store, "
                  "fresh for each run)"]
                 if "torch" in self.backends and s.init_method not in ("tcp", "env")
                 and self.launcher != "torchrun" else [])
        port = f"${{MASTER_PORT:-{DEFAULT_PORT}}}"
        if self.launcher == "slurm":
            return self._sbatch(path_line + store, script, python)
        if self.launcher == "mpi":
            label = ["-prepend-pattern", shlex.quote("[rank %r] ")] if self._labels else []
            line = ["mpiexec", "-n", str(n), *label, *self._mpi_hosts(),
                    "-genv", "MASTER_ADDR", self._master(), "-genv", "MASTER_PORT", port,
                    python, here]
            return _bash(
                [f"# {os.path.basename(script)} as {n} MPI processes, with MPICH's mpiexec.",
                 f"# (Open MPI: mpirun -n {n} -x MASTER_ADDR={self._master()} "
                 f"-x MASTER_PORT={DEFAULT_PORT} {python} {os.path.basename(script)})"]
                + path_line + store
                # (not PYTHONUNBUFFERED: mpiexec puts the rank before each piece it reads, and
                # unbuffered, print's words come as pieces; the script makes its stdout and
                # stderr line-buffered whatever the person's environment says: export.py)
                + [*_MPI_STOP, " ".join(line) + " &", "job=$!",
                                       *_MPI_WAIT])
        if self.launcher == "torchrun":
            hosts = s.where.hosts
            lines = path_line + store
            if len(hosts) > 1:
                places = ", ".join(f"{i} on {h} ({c} process{'es' if c > 1 else ''})"
                                   for i, (h, c) in enumerate(hosts))
                lines = [f"# Run on every host, with its place: {places}.",
                         "# (each host's processes, and its place, as %spmd start placed the "
                         "ranks)"] + lines + [
                    f'node=${{1:?"give this host\'s place: {places}"}}',
                    f"counts=({' '.join(str(c) for _, c in hosts)})",
                    f'torchrun --nnodes {len(hosts)} --node-rank "$node" --nproc-per-node '
                    f'"${{counts[$node]}}" --master-addr {self._master()} --master-port {port} '
                    f"{here}"]
            else:
                lines = [f"# {os.path.basename(script)} as {n} processes on this machine."] + \
                    lines + [f"torchrun --standalone --nproc-per-node {n} {here}"]
            return _bash(lines)
        if self.launcher == "ssh":
            return self._ssh_loop(path_line + store, script, port)
        return _bash(
            [f"# {os.path.basename(script)} as {n} processes on this machine, as %spmd start "
             f"-n {n} ran them.", "# (MASTER_PORT: rank 0's port, where the others join it)"]
            + path_line + store
            + [f"export WORLD_SIZE={n} MASTER_ADDR=127.0.0.1 MASTER_PORT={port}",
               *self._label_lines(), *_STOP,
               f"for rank in $(seq 0 {n - 1}); do",
               "  [ -z \"$status\" ] || break  # (^C while they start)",
               f"  RANK=$rank LOCAL_RANK=$rank setsid {python} {here}{self._labelled()} &",
               "  running+=($!) groups+=(-$!)",
               "done", *_STARTED, *_WAIT])

    @property
    def _labels(self) -> bool:
        return self.labels and self.settings.n > 1

    def _label_lines(self) -> list[str]:
        if not self._labels:
            return []
        return ["# Each line begins with its rank, as in the notebook (%spmd export --raw-output:",
                "# as written); Python writes each line as it comes, not when its buffer fills.",
                "label() { sed -u \"s/^/[rank $1] /\"; }",
                "export PYTHONUNBUFFERED=1"]

    def _labelled(self) -> str:
        return ' > >(label "$rank") 2> >(label "$rank" >&2)' if self._labels else ""

    def _master(self) -> str:
        where = self.settings.where
        # (the notebook's rank 0 address where the job runs on its hosts: an ssh cluster's,
        # or an mpi one's from a host file; not a Slurm allocation's, which is gone)
        if self.master and (where.hosts or where.launcher == self.launcher == "mpi"):
            return self.master
        return where.hosts[0][0].rpartition("@")[2] if where.hosts else "127.0.0.1"

    def _mpi_hosts(self) -> list[str]:
        hosts = self.settings.where.hosts
        args = dict(self.settings.where.launcher_args).get("mpi_args", "")
        spec = ",".join(f"{h.rpartition('@')[2]}:{c}" for h, c in hosts)
        return (["-hosts", spec] if hosts else []) + ([args] if args else [])

    def _ssh_loop(self, before: list[str], script: str, port: str) -> str:
        w, n = self.settings.where, self.settings.n
        user_args = dict(w.launcher_args)
        ssh = shlex.join([*(shlex.split(user_args.get("ssh_cmd", "")) or ["ssh"]),
                          *shlex.split(user_args.get("ssh_args", "")), "-o", "BatchMode=yes"])
        spread = " ".join(f"{h}:{c}" for h, c in w.hosts)
        home = self.python.startswith("~/")
        # There, the process runs beside a watcher of the ssh connection's input: without a
        # terminal, a process whose ssh ended (^C here, or a failed rank) would run on; its
        # input ends with the connection, and the watcher ends it (SIGKILL after 3 s: jax's
        # own SIGTERM handler only notes a preemption). (The watcher reads a copy, fd 4: a
        # background command's own input is /dev/null. The process becomes the shell, $$.
        # The paths are quoted for the remote shell by printf %q here, whatever they hold.)
        remote = ("cd $(printf %q \"$PWD\") || exit; exec 4<&0; "
                  "(cat <&4; kill \\$\\$ && sleep 3 && kill -9 \\$\\$) >/dev/null 2>&1 & "
                  f"RANK=$rank LOCAL_RANK=$local_rank WORLD_SIZE={n} MASTER_ADDR=$MASTER_ADDR "
                  "MASTER_PORT=$MASTER_PORT "
                  + ("PYTHONHASHSEED=$PYTHONHASHSEED " if self.hash_seed else "")
                  + ("PYTHONUNBUFFERED=1 " if self._labels else "")
                  + ("exec \\\"\\$HOME\\\"/$(printf %q \"$python\") " if home else
                     "exec $(printf %q \"$python\") ")
                  + "$(printf %q \"$script\") </dev/null 4<&-")
        return _bash(
            [f"# {os.path.basename(script)} as {n} processes over ssh ({spread}), as %spmd start "
             "placed them.",
             "# Every host needs the script and the Python at the same paths (shared storage)."]
            + before
            + [f"python={shlex.quote(self.python[2:] if home else self.python)}"
               + ("  # (under the home folder there)" if home else ""),
               f"script={shlex.quote(script)}",
               f"export MASTER_ADDR={self._master()} MASTER_PORT={port}",
               "# (each ssh reads a pipe nobody writes, which ends only with the ssh: a",
               "# background command's own input is /dev/null, which ends at once)",
               'pipe=$(mktemp -u) && mkfifo -m 600 "$pipe" && exec 3<>"$pipe" && rm -f "$pipe"',
               *self._label_lines(), *_STOP,
               "rank=0",
               f"for host_count in {spread}; do",
               "  host=${host_count%:*}",
               "  for ((local_rank = 0; local_rank < ${host_count##*:}; local_rank++)); do",
               "    [ -z \"$status\" ] || break 2  # (^C while they start)",
               f'    {ssh} "$host" "{remote}" <&3{self._labelled()} &',
               "    running+=($!) groups+=($!)  # (the ssh alone: its end ends the process)",
               "    rank=$((rank + 1))",
               "  done",
               "done", *_STARTED, *_WAIT])

    def _sbatch(self, before: list[str], script: str, python: str) -> str:
        s = self.settings
        name = os.path.basename(script)[:-3]
        job_name = re.sub(r"[^\w.+-]", "_", name)  # (squeue's columns: no spaces)
        # (sbatch reads an #SBATCH line's value up to a space or a # outside double quotes,
        # where a backslash keeps the next character; the output's name is a pattern, where
        # %% is a % and a backslash turns the pattern off)
        output = name.replace("%", "%%").replace("\\", "_") + "-%j.out"
        if job_name != name:
            output = '"' + output.replace('"', '\\"') + '"'
        options = [f"#SBATCH --job-name={job_name}",
                   f"#SBATCH --ntasks={s.n}", f"#SBATCH --output={output}"]
        if self.gpus:
            options.append(f"#SBATCH --gpus-per-task={self.gpus}")
        # (the cluster's --launcher-arg options are Slurm's own where it ran under Slurm; an
        # ssh or mpi cluster's are not sbatch options)
        for key, value in (s.where.launcher_args if s.where.launcher == "slurm" else ()):
            option = f"#SBATCH --{key}={value}" if value else f"#SBATCH --{key}"
            if option not in options:
                options.append(option)
        lines = ["#!/bin/bash", *options,
                 f"# {name}.py as {s.n} Slurm tasks, as %spmd start --launcher slurm ran them: "
                 f"sbatch {shlex.quote(name + '.sbatch')}", *before]
        if "torch" in self.backends:
            lines += ["# rank 0's node and a port, for torch's rendezvous",
                      'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | '
                      "head -n 1)",
                      "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))"]
        label = "--label " if self._labels else ""  # ("1: " before each line of rank 1)
        lines.append(f"srun --kill-on-bad-exit=1 {label}{python} {shlex.quote(script)}")
        return "\n".join(lines) + "\n"


# A timer: ``action`` 3 s from now, in the background (its pid is the job's $killer). Killed
# early (SIGTERM), it ends its sleep too, which would otherwise outlive the job, holding the
# job's output open for what is left of its 3 s. (Its sleep is found by ``jobs -p``, not by a
# variable: a TERM that comes right after the sleep started runs the trap before ``$!`` is
# kept, as a job that ends at the stop's first signal makes it come.)
def _in_3_s(action: str) -> str:
    return (f"(trap 'kill $(jobs -p) 2>/dev/null; exit' TERM; sleep 3 & wait $!; "
            f"{action}) & killer=$!")


# The job's processes end together. The trap is set before the first one starts: a ^C then
# would end this shell alone, and the processes it started ignore SIGINT (they run in the
# background of a shell without a terminal of its own). Each process runs in a session of
# its own (setsid), whose id is its pid: signalled as a group, the processes it started
# (a cell's `!cmd`, a Popen) end with it, where SIGKILL to the process alone leaves them.
# (The terminal's ^C and hang-up then reach this shell alone; it passes both on.)
_STOP = [
    "# The job's processes end together: at ^C, or when one fails, each, with what it",
    "# started, is sent SIGINT and SIGTERM, then SIGKILL 3 s later (jax's own SIGTERM",
    "# handler only notes a preemption); a second ^C kills at once. The job's status is the",
    "# first failure's.",
    "status= killer= running=() groups=()",
    "stop() {",
    "  if [ -n \"$killer\" ]; then kill -9 -- \"${groups[@]}\" 2>/dev/null; return; fi",
    "  kill -INT -- \"${groups[@]}\" 2>/dev/null; kill -TERM -- \"${groups[@]}\" 2>/dev/null",
    "  " + _in_3_s('kill -9 -- "${groups[@]}" 2>/dev/null'),
    "}",
    "trap 'status=${status:-130}; stop' INT",
    "trap 'status=${status:-143}; stop' TERM",
    "trap 'status=${status:-129}; stop' HUP",
]
# A ^C that came while they started: stopped again, with every process that started (the
# first stop's SIGKILL knows only those started before it).
_STARTED = [
    "[ -z \"$status\" ] || { [ -z \"$killer\" ] || kill \"$killer\" 2>/dev/null; killer=; stop; }",
]
# Wait for every process; when one fails, end the others (they would wait for it forever in
# their next collective) and exit with its status. `wait -n` gives one status, while more
# than one process may have ended: each one that has is asked for its own (bash keeps it).
# Once stopped, what the processes started and left running gets the SIGKILL too.
_WAIT = [
    "while [ ${#running[@]} -gt 0 ]; do",
    "  wait -n \"${running[@]}\" 2>/dev/null",
    "  still=()",
    "  for pid in \"${running[@]}\"; do",
    "    if kill -0 \"$pid\" 2>/dev/null; then still+=(\"$pid\"); continue; fi",
    "    wait \"$pid\" 2>/dev/null; code=$?",
    "    if [ -z \"$status\" ] && [ \"$code\" != 0 ]; then",
    "      status=$code; stop  # (one failed: the others would wait for it for ever)",
    "    fi",
    "  done",
    "  running=(\"${still[@]}\")",
    "done",
    "if [ -n \"$killer\" ]; then",
    "  ! kill -0 -- \"${groups[@]}\" 2>/dev/null || wait \"$killer\"",
    "  kill \"$killer\" 2>/dev/null",
    "fi",
    "exit \"${status:-0}\"",
]


# mpiexec ends the job when one process fails (the script says hello to it, so it knows);
# at ^C it sends SIGINT to every process, and a second SIGINT makes it kill them all.
_MPI_STOP = [
    "# At ^C or SIGTERM, mpiexec is sent SIGINT, which it forwards to every process, and a",
    "# second SIGINT 3 s later makes it kill them (a process waiting in a collective sees no",
    "# SIGINT); at a terminal's ^C it sees one itself too, and kills them at once. When one",
    "# process fails, mpiexec ends the others; the job's status is that process's.",
    "status= killer= job=",
    "stop() {",
    "  [ -n \"$job\" ] || return  # (mpiexec has yet to start: it is stopped when it has)",
    "  kill -INT \"$job\" 2>/dev/null",
    "  [ -n \"$killer\" ] || { " + _in_3_s('kill -INT "$job" 2>/dev/null') + "; }",
    "}",
    "trap 'status=${status:-130}; stop' INT",
    "trap 'status=${status:-143}; stop' TERM",
]
_MPI_WAIT = [
    "[ -z \"$status\" ] || stop  # (^C while it started)",
    "while :; do",
    "  wait \"$job\"; code=$?",
    "  kill -0 \"$job\" 2>/dev/null || break  # (else a trap ended the wait)",
    "done",
    "[ -z \"$killer\" ] || kill \"$killer\" 2>/dev/null",
    "exit \"${status:-$code}\"",
]


def _in_double_quotes(text: str) -> str:
    """``text`` to write between double quotes in a shell line, as it is."""
    return re.sub(r'([\\"$`])', r"\\\1", text)


def _shell_path(path: str) -> str:
    """``path`` for a shell line: quoted, a ``~/`` in front as the home folder."""
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _bash(lines: list[str]) -> str:
    return "\n".join(["#!/bin/bash", *lines]) + "\n"
