"""Option values shared by ``%spmd start`` and ``python -m spmd.kernel install``."""

from __future__ import annotations

import argparse

BACKENDS = ("jax", "torch", "none")


def count(what: str, example: str):
    """An argparse type: a whole number of at least 1, or a sentence that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{what} must be a whole number of at least 1, like {example}, not {text!r}"
            )
        return value

    return parse
