"""``python -m spmd.controller``: ipyparallel's controller, ending with the notebook,
writing its connection files whole, encrypting its traffic where it leaves the machine,
keeping of each request only what the cluster needs (hub.py), registering a rank at its first
heartbeat (hearts.py), and sending a cell to all its ranks from one request of the notebook
(fanout.py).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile

from spmd.engine.life.orphans import note_gone, watch_parent


def save_connection_dict(self, fname: str, cdict: dict) -> None:
    """``IPController.save_connection_dict``, written whole or not at all.

    The engines start with the controller and poll for its connection file. ipyparallel
    writes the file in place, so an engine could read it half-written and die with a
    JSONDecodeError (about 1 start in 60). Here the file appears complete, by rename, and is
    private (0600) from its first byte: it holds the key that signs every message.
    """
    if os.environ.get(CURVE_ENV) == "1" and not cdict.get("curve_serverkey"):
        # ipyparallel did not turn CurveZMQ on: plain text would leave the machine. No
        # connection file, no rank and no notebook connects; the controller ends.
        import ipyparallel

        sys.stderr.write(
            f"ipyparallel {ipyparallel.__version__} did not honour enable_curve: the "
            "controller refuses to serve unencrypted traffic off the loopback.\n"
        )
        raise SystemExit(3)
    from spmd.controller import fanout

    cdict = fanout.with_port(self, fname, cdict)  # (the client's file: the fan-out's port)
    path = os.path.join(self.profile_dir.security_dir, fname)
    self.log.info("writing connection info to %s", path)
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{fname}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(cdict, indent=2))
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise


# Set (to "1") by the notebook for a cluster whose ranks may run on other machines.
CURVE_ENV = "SPMD_CURVE"


def _encrypt() -> None:
    """CurveZMQ on every socket, and messages still signed.

    ipyparallel drops the signing key when it turns CurveZMQ on, unless a key is configured;
    messages carry pickles, and an unsigned pickle must never be trusted. The key is made
    here, in this process's own arguments (never on a command line ``ps`` shows), and goes
    to the engines and the notebook in the private connection files and environment.
    """
    sys.argv += ["--IPController.enable_curve=True", f"--Session.key={secrets.token_hex(32)}"]


def main() -> None:
    note_gone(watch_parent())  # (when the linger began: python -m spmd list counts from it)
    if os.environ.get(CURVE_ENV) == "1":
        _encrypt()
    from ipyparallel.controller.app import IPController
    from ipyparallel.controller.app import main as controller_main

    from spmd.controller import fanout, hearts, hub

    IPController.save_connection_dict = save_connection_dict
    hub.install()
    hearts.install()
    fanout.install()
    controller_main()
