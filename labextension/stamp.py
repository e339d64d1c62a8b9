"""The hash of the Ranks sidebar's sources, kept beside its build.

``make labextension`` builds the extension into spmd/labextension, which git keeps (a wheel
builds with no node), and then runs this to write the hash of the sources it was built from
into spmd/labextension/sources.sha256. tests/test_labextension.py checks that the hash of the
sources in the checkout is that one: a source changed without a new build fails it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP = HERE.parent / "spmd" / "labextension" / "sources.sha256"


def sources() -> list[Path]:
    return sorted([HERE / "package.json", HERE / "tsconfig.json",
                   *HERE.glob("src/**/*.ts"), *HERE.glob("style/**/*.css")])


def digest() -> str:
    h = hashlib.sha256()
    for path in sources():
        h.update(path.relative_to(HERE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


if __name__ == "__main__":
    STAMP.write_text(digest() + "\n")
