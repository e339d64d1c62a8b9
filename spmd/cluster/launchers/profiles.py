"""Where a cluster keeps its files: private folders in the temporary folder, each marked with
the notebook process that made it.

A start makes an ipyparallel profile folder (the connection files, with the key that signs
every message, and the ranks' logs and stack dumps), and, as needed, a folder for the ranks'
output (logs.py), for jax's compilation cache and for ssh's master connections. The notebook
removes them at stop or at its end; a notebook that was killed cannot, so each new start first
removes every such folder whose owner process is gone (the cache can be gigabytes, and the
temporary folder is often memory).
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
    """A private folder for one cluster's ipyparallel profile (connection files, logs),
    made once the folders of notebooks that are gone are removed."""
    remove_abandoned_folders()
    return owned_folder(PROFILE_PREFIX)


def owned_folder(prefix: str) -> str:
    """A new folder only this user can read (``prefix`` starts with ``spmd-``), marked with
    this process, so that a later notebook removes it if this one is killed."""
    path = tempfile.mkdtemp(prefix=prefix)  # (made 0700)
    me = psutil.Process()
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        json.dump({"pid": me.pid, "create_time": me.create_time()}, f)
    return path


def remove_abandoned_folders() -> list[str]:
    """Remove the folders of notebook processes that no longer run; their paths."""
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
