"""Where a cluster keeps its files: a private ipyparallel profile folder per start.

It holds the connection files (with the key that signs every message) and the ranks' logs
and stack dumps. The notebook removes it at stop; a notebook that was killed cannot, so each
new start first removes the folders whose owner process is gone.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import psutil

PROFILE_PREFIX = "spmd-"
OWNER_FILE = "owner.json"  # which notebook process made a profile folder


def new_profile_dir() -> str:
    """A private folder for one cluster's ipyparallel profile (connection files, logs).

    The notebook removes it at stop; a notebook that was killed cannot, so each new one
    first removes the folders whose owner is gone.
    """
    remove_abandoned_profiles()
    path = tempfile.mkdtemp(prefix=PROFILE_PREFIX)
    me = psutil.Process()
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        json.dump({"pid": me.pid, "create_time": me.create_time()}, f)
    return path


def remove_abandoned_profiles() -> list[str]:
    """Remove the profile folders of notebook processes that no longer run; their paths."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PROFILE_PREFIX + "*")):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # not one of ours, or being made right now
        try:
            alive = psutil.Process(owner["pid"]).create_time() == owner["create_time"]
        except psutil.Error:
            alive = False
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
