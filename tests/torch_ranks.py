"""What the torch tests share (test_torch, test_torch_starts): the cell that sets up a torch
rank, one all_reduce and what it prints, the line a cell's init_process_group gets on ranks
the start joined, and the addresses a rank listens on."""

from __future__ import annotations

import psutil

SETUP = "import os, time, torch, torch.distributed as dist\nrank = dist.get_rank()"
ALL_REDUCE = "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint(t.item())"
ALREADY = ("torch.distributed is already initialized: %spmd start joined the 2 processes in "
           "one group, backend gloo: carrying on.")


def listening(pids: list[int]) -> set[str]:
    """The addresses the processes ``pids`` listen on (TCP)."""
    found = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.add(conn.laddr.ip)
    return found
