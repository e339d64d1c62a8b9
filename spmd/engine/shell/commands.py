"""``!cmd`` on a rank, run without fork.

IPython runs a shell command through pexpect, which forks the process to make a pty. A rank
is multithreaded (jax, the engine's IO threads), so JAX warns at every ``!cmd`` that "os.fork()
was called ... this will likely lead to a deadlock", and it can. ``subprocess`` spawns the
command without running Python in a forked child, so neither the warning nor the risk apply.
The output reaches the cell's stdout line by line, as with IPython's own ``!cmd``.

``system`` is the rank's shell's own ``system`` method (engine/rank_kernel.py).
"""

from __future__ import annotations

import subprocess
import sys


def system(shell, cmd: str) -> None:
    """IPython's ``system_piped``, with ``subprocess`` in place of pexpect. (A method of the
    rank's shell as it is: no frame of its own between the cell and ``var_expand``.)"""
    if cmd.rstrip().endswith("&"):
        raise OSError("Background processes not supported.")
    # depth=1: the variables of the frame that wrote !cmd, as IPython's own system does
    command = shell.var_expand(cmd, depth=1)
    process = subprocess.Popen(
        command,
        shell=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in order, as a terminal shows it
        text=True,
        errors="replace",
    )
    try:
        for line in process.stdout:
            sys.stdout.write(line)
        exit_code = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait()
        raise
    finally:
        process.stdout.close()
    shell.user_ns["_exit_code"] = exit_code
    if shell.system_raise_on_error and exit_code != 0:
        raise subprocess.CalledProcessError(exit_code, cmd)

