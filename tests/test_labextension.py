"""The Ranks sidebar's JupyterLab extension as the checkout keeps it: built (spmd/labextension,
which git keeps, so that no build needs node) from the sources in labextension/, and found by
this environment's JupyterLab. Seconds: nothing is built here (make labextension builds)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILT = ROOT / "spmd" / "labextension"

pytestmark = pytest.mark.timeout(60)


def _stamp():
    spec = importlib.util.spec_from_file_location("stamp", ROOT / "labextension" / "stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_built_extension_is_of_the_sources_in_the_checkout():
    stamp = _stamp()
    assert stamp.STAMP == BUILT / "sources.sha256"
    assert (BUILT / "sources.sha256").read_text().strip() == stamp.digest(), (
        "labextension/ changed since spmd/labextension was built: run make labextension")
    built = json.loads((BUILT / "package.json").read_text())
    source = json.loads((ROOT / "labextension" / "package.json").read_text())
    assert built["name"] == source["name"] == "jupyter-spmd"
    assert (BUILT / "static" / "style.js").exists()
    assert built["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")


def test_a_source_changed_without_a_build_is_seen(tmp_path, monkeypatch):
    stamp = _stamp()
    copy = tmp_path / "labextension"
    for path in stamp.sources():
        target = copy / path.relative_to(stamp.HERE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    monkeypatch.setattr(stamp, "HERE", copy)
    assert stamp.digest() == (BUILT / "sources.sha256").read_text().strip()
    index = copy / "src" / "index.ts"
    index.write_text(index.read_text() + "\n// a change\n")
    assert stamp.digest() != (BUILT / "sources.sha256").read_text().strip()


def test_this_environments_jupyterlab_finds_the_extension():
    listed = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"],
                            capture_output=True, text=True, timeout=50)
    said = listed.stdout + listed.stderr
    line = next((ln for ln in said.splitlines() if "jupyter-spmd" in ln), "")
    assert "enabled" in line and "OK" in line, said
