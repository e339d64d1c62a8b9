"""``python -m spmd.kernel.app -f CONNECTION_FILE``: what a kernelspec's argv runs."""

from __future__ import annotations


def main() -> None:
    from ipykernel.kernelapp import IPKernelApp

    from spmd.kernel.kernel import SpmdKernel

    IPKernelApp.launch_instance(kernel_class=SpmdKernel)


if __name__ == "__main__":
    main()
