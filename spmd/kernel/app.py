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

# The kernelspec's settings (``--SpmdKernel.NAME=VALUE``, see kernelspec.kernel_dict) and
# the Settings field each one is.
_FIELDS = {
    "processes": ("n", int),
    "devices_per_process": ("cpu_devices", lambda text: int(text) or None),
    "backend": ("backend", str),
    "torch_backend": ("torch_backend", str),
}


def settings_from_argv(argv: list[str]):
    """The cluster's Settings as the kernelspec's argv gives them (the kernel's defaults for
    the rest), or None when an argument cannot be read (the kernel then says why)."""
    from spmd.cluster.session import Settings

    given = {"n": 4}  # (SpmdKernel.processes's default)
    for arg in argv:
        name, _, value = arg.removeprefix("--SpmdKernel.").partition("=")
        if arg.startswith("--SpmdKernel.") and name in _FIELDS:
            field, convert = _FIELDS[name]
            try:
                given[field] = convert(value)
            except ValueError:
                return None
    return Settings(**given)


def main() -> None:
    # ``kill -USR2 PID`` writes every thread's stack to the kernel's log (its stderr): for a
    # kernel that seems stuck, what it is waiting for.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    from spmd.magics.background import BackgroundStart

    settings = settings_from_argv(sys.argv[1:])
    early = BackgroundStart(settings) if settings is not None and settings.n > 0 else None

    from ipykernel.kernelapp import IPKernelApp

    from spmd.kernel.kernel import SpmdKernel

    SpmdKernel.early_start = early
    IPKernelApp.launch_instance(kernel_class=SpmdKernel)


if __name__ == "__main__":
    main()
