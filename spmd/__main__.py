"""``python -m spmd list`` and ``python -m spmd stop ID`` (or ``--all``): this user's clusters
from a terminal, as ``ipcluster list`` and ``ipcluster stop`` show and end ipyparallel's. A
cluster listed is one that runs: held by a notebook, or lingering after its notebook process
ended (spmd/cluster/linger.py). ``python -m spmd mcp``: the MCP server for agents, over stdio
(spmd/agents/mcp_server.py)."""

from __future__ import annotations

import argparse
import sys

from spmd.cluster import attach, linger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="this user's clusters")
    stop = commands.add_parser("stop", help="end a cluster and everything it runs")
    stop.add_argument("id", nargs="?", default="")
    stop.add_argument("--all", action="store_true", help="every cluster of this user")
    commands.add_parser("mcp", help="the MCP server for agents, over stdin and stdout")
    args = parser.parse_args(argv)
    if args.command == "mcp":
        from spmd.agents import mcp_server

        return mcp_server.main()
    records = linger.every()
    if args.command == "list":
        print(linger.table(records) if records else "No cluster of this user runs.")
        return 0
    if bool(args.id) == bool(args.all):
        parser.error("stop takes one cluster id, or --all (python -m spmd list shows them)")
    chosen = records if args.all else [r for r in records if r.id == args.id]
    if not chosen and args.id:
        print(f"No cluster has the id {args.id!r} (python -m spmd list shows them).",
              file=sys.stderr)
        return 1
    for record in chosen:
        attach.end(record)
        print(f"Stopped cluster {record.id} ({record.n()} ranks).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
