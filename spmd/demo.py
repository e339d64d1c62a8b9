"""``python -m spmd.demo NOTEBOOK``: execute a notebook headlessly and print what it showed.

The executed copy is written beside the original as ``NAME.executed.ipynb``. This is what
``make demo`` runs, and what the tests use to run notebooks for real (nbclient).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from spmd.words import uncoloured


def execute(path: str | Path, timeout: int = 300, allow_errors: bool = False):
    """Run every cell of the notebook at ``path`` in a fresh kernel; return the notebook."""
    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    client.execute()
    return nb


def output_text(output) -> str:
    """The text a reader of a saved notebook sees for one output."""
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("display_data", "execute_result"):
        text = output.get("data", {}).get("text/plain", "")
        return text + "\n" if text else ""  # an emptied live view shows nothing
    if kind == "error":
        return uncoloured("\n".join(output.get("traceback", []))) + "\n"
    return ""


def cell_text(cell) -> str:
    return "".join(output_text(o) for o in cell.get("outputs", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", metavar="notebook")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        show(Path(path), args.timeout)
    return 0


def show(src: Path, timeout: int) -> None:
    """Execute one notebook, save the executed copy, and print its cells and outputs."""
    print(f"=== {src} ===\n")
    nb = execute(src, timeout=timeout)
    out = src.with_name(src.stem + ".executed.ipynb")
    nbformat.write(nb, str(out))
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        print(
            f"In [{cell.get('execution_count') or ' '}]: " + cell.source.replace("\n", "\n    ... ")
        )
        shown = cell_text(cell).rstrip("\n")
        if shown:
            print(shown)
        print()
    print(f"Executed notebook written to {out}\n")


if __name__ == "__main__":
    sys.exit(main())
