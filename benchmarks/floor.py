"""The floors: what the same work costs with nothing of ours or ipyparallel's in the way."""

from __future__ import annotations

import subprocess
import sys
import time

from spmd.engine.join.address import free_port

_RANK = r"""
import sys
rank, n, port, k = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
import jax
jax.config.update("jax_num_cpu_devices", k)
addr = f"127.0.0.1:{port}"
jax.distributed.initialize(addr, n, rank, coordinator_bind_address=addr)
xs = jax.numpy.ones(jax.local_device_count())
jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(xs).block_until_ready()
"""


_TORCH_RANK = r"""
import sys
rank, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
t = torch.ones(1)
dist.all_reduce(t)
"""


def bare_processes(n: int = 4, devices: int = 2) -> float:
    """Seconds for n plain processes to import jax, initialize on 127.0.0.1 and run one psum."""
    return _bare(_RANK, n, str(devices))


def bare_torch_processes(n: int = 4) -> float:
    """Seconds for n plain processes to import torch, join a gloo process group on
    127.0.0.1 and run one all_reduce."""
    return _bare(_TORCH_RANK, n)


def _bare(program: str, n: int, *args: str) -> float:
    # gloo in bare processes aborts now and then (SIGABRT, seen once in ~20 torch floors):
    # that is the floor's own flake, not a figure; measure again.
    for attempt in range(3):
        try:
            return _bare_once(program, n, *args)
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _bare_once(program: str, n: int, *args: str) -> float:
    port = free_port()
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", program, str(r), str(n), str(port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(n)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    if any(codes):
        raise RuntimeError(f"a bare rank failed: exit codes {codes}")
    return time.perf_counter() - t0


_ECHO = r"""
import sys, zmq
sock = zmq.Context().socket(zmq.REP)
sock.bind(f"tcp://127.0.0.1:{sys.argv[1]}")
while True:
    sock.send(sock.recv())
"""


class EchoServers:
    """n processes that answer a zmq message at once: the physical floor of a cell's round trip."""

    def __init__(self, n: int) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.procs, self.socks = [], []
        for _ in range(n):
            port = free_port()
            self.procs.append(subprocess.Popen([sys.executable, "-c", _ECHO, str(port)]))
            sock = self.ctx.socket(zmq.REQ)
            sock.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(sock)
        self.round_trip()  # wait until every server answers

    def round_trip(self) -> float:
        t0 = time.perf_counter()
        for sock in self.socks:
            sock.send(b"x = 1")
        for sock in self.socks:
            sock.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.ctx.destroy(linger=0)
