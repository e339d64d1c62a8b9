"""``python -m spmd.cluster.controller``: ipyparallel's controller, ending with the notebook."""

from __future__ import annotations

from spmd.engine.orphans import watch_parent


def main() -> None:
    watch_parent()
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
