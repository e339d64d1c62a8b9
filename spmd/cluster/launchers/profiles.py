"""Where a cluster keeps its files: private folders in the temporary folder, each marked with
the notebook process that made it.

A start makes an ipyparallel profile folder (the connection files, with the key that signs
every message, and the ranks' logs and stack dumps), and, as needed, a folder for the ranks'
output (logs.py), for jax's compilation cache and for ssh's master connections. The notebook
removes them at stop or at its end; a notebook that was killed cannot, so each new start first
removes every such folder whose owner process is gone (the cache can be gigabytes, and the
temporary folder is often memory). A lingering cluster's folders are kept by its controller
while no notebook holds them (linger.py).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import psutil

from spmd.engine.life import orphans
from spmd.engine.life.orphans import started_at

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
    mark_owner(path)
    # (what its processes and an attach lock: engine/life/orphans.folder_lock)
    os.close(os.open(os.path.join(path, orphans.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600))
    return path


def mark_owner(path: str, keeper: int = 0) -> None:
    """Mark the folder as this notebook process's (in one step: a lingering cluster's
    processes read this file every second to know whether a notebook holds it). ``keeper``:
    a process that keeps the folder while no notebook holds it (a lingering cluster's
    controller, which removes it when its linger is over); 0 keeps the one marked before."""
    me = psutil.Process()
    owner = {"pid": me.pid, "started": started_at(me.pid), "create_time": me.create_time()}
    before = orphans.read_owner(os.path.join(path, OWNER_FILE))
    if keeper:
        owner["keeper"] = {"pid": keeper, "started": started_at(keeper)}
    elif "keeper" in before:
        owner["keeper"] = before["keeper"]
    write_owner(path, owner)


def write_owner(path: str, owner: dict) -> None:
    """Replace the folder's owner file in one step (its readers never see half of it)."""
    fd, partial = tempfile.mkstemp(dir=path, prefix=".owner.")
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
    os.replace(partial, os.path.join(path, OWNER_FILE))


def remove_abandoned_folders() -> list[str]:
    """Remove the folders of notebook processes that no longer run; their paths."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PROFILE_PREFIX + "*")):
        owner = orphans.read_owner(os.path.join(path, OWNER_FILE))
        if not owner:
            continue  # not one of ours, or being made right now
        # (a lingering cluster's folder is its keeper's until its linger is over)
        if not orphans.runs(owner) and not orphans.runs(owner.get("keeper")):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
