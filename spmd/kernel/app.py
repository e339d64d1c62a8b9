"""``python -m spmd.kernel.app -f CONNECTION_FILE``: what a kernelspec's argv runs.

The cluster starts first, from the kernelspec's settings in argv, and ipykernel is imported
while the engines start: about a second of the kernel's own start-up that the first cell no
longer waits for. The kernel adopts that start when its settings (which a config file may
change) say the same; otherwise it cancels it and starts its own.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

# The kernelspec's settings (``--SpmdKernel.NAME=VALUE``, see kernelspec.kernel_dict), with
# the kernel's defaults for those it does not give.
_DEFAULTS = {"processes": "4", "devices_per_process": "0", "backend": "jax",
             "torch_backend": "gloo", "cluster": ""}


def settings_from_argv(argv: list[str]):
    """The cluster's Settings as the kernelspec's argv gives them, or None when they cannot
    be used (the kernel then says why, in its first cell)."""
    from IPython.core.error import UsageError

    from spmd import options
    from spmd.magics.start.arguments import start_settings

    given = dict(_DEFAULTS)
    for arg in argv:
        name, _, value = arg.removeprefix("--SpmdKernel.").partition("=")
        if arg.startswith("--SpmdKernel.") and name in given:
            given[name] = value
    try:
        return start_settings(options.start_args(**given))[1]
    except (UsageError, ValueError):
        return None


def main() -> None:
    # ``kill -USR2 PID`` writes every thread's stack to the kernel's log (its stderr): for a
    # kernel that seems stuck, what it is waiting for.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    from spmd.magics.start.background import BackgroundStart

    settings = settings_from_argv(sys.argv[1:])
    from spmd.cluster import linger

    # (where the kernel before this one died and its cluster lingers: attach to it)
    early = BackgroundStart(settings, attach_to=linger.mine()) if (
        settings is not None and settings.n > 0) else None

    from ipykernel.kernelapp import IPKernelApp

    from spmd.kernel.kernel import SpmdKernel

    SpmdKernel.early_start = early
    IPKernelApp.launch_instance(kernel_class=SpmdKernel)


if __name__ == "__main__":
    main()
