"""Addresses a rank chooses: the coordinator's port, and its own address as others see it."""

from __future__ import annotations

import random
import socket
import time

# The coordinator's port is chosen now and bound a second later, by rank 0, after its jax
# import. In between, the controller binds random ports (zmq: 49152-65535) and every
# connection takes an ephemeral one (Linux: 32768-60999); a port below both is not taken by
# this start itself. A collision with another program is still possible, hence the retry.
_COORDINATOR_PORTS = (20000, 32768)
# The draw's own randomness, from the system: the process's global generator is the user's
# (a notebook's random.seed(0), pytest-randomly's seed per test), and two notebooks seeded
# alike would draw the same ports in the same order.
_draw = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, outside the ranges other sockets draw from.

    Not portpicker's: it asks the system for a port from the ephemeral range, which every
    outgoing connection of the ranks (gloo's, gRPC's) also draws from, so one of those can
    take the coordinator's port before rank 0 binds it (the start then tries once more)."""
    for _ in range(100):
        port = _draw.randrange(*_COORDINATOR_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def coordinator_addresses(host: str, backends: list[str]) -> dict[str, str]:
    """``host:port`` for each backend's coordinator (jax's and torch's), distinct free ports."""
    addresses: dict[str, str] = {}
    for backend in backends:
        address = f"{host}:{free_port(host)}"
        while address in addresses.values():
            address = f"{host}:{free_port(host)}"
        addresses[backend] = address
    return addresses


def address_toward(peer: str) -> str:
    """This machine's address on the interface that reaches ``peer`` (no packet is sent:
    connecting a UDP socket only asks the routing table)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def wait_listening(address: str, seconds: float) -> bool:
    """Until something listens at ``address`` (host:port), or ``seconds`` passed; whether it
    does."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host.strip("[]"), int(port))) == 0:
                return True
        time.sleep(0.005)
    return False
