"""The SPMD kernel's settings as its process reads them from the kernelspec's argv, before
ipykernel is imported (``spmd.kernel.app``), checked against the kernelspec's own argv."""

from __future__ import annotations

import pytest

from spmd.cluster.session import Settings
from spmd.kernel.app import settings_from_argv
from spmd.kernel.kernelspec import kernel_dict

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "spec, settings",
    [
        (dict(processes=2), Settings(n=2)),
        (dict(processes=8, devices_per_process=2), Settings(n=8, cpu_devices=2)),
        (
            dict(processes=4, backend="torch", torch_backend="gloo"),
            Settings(n=4, backend="torch", torch_backend="gloo"),
        ),
        (dict(processes=3, backend="none"), Settings(n=3, backend="none")),
    ],
)
def test_kernel_argv_gives_the_kernelspecs_settings(spec, settings):
    argv = kernel_dict(**spec)["argv"]
    assert settings_from_argv(argv[3:]) == settings


def test_kernel_argv_that_cannot_be_read_starts_nothing_early():
    assert settings_from_argv(["-f", "x.json", "--SpmdKernel.processes=four"]) is None
