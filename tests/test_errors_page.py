"""The errors page (docs/_ext/spmd_docs/errors.py): every error sentence the code can show has
its entry in docs/reference/errors.yaml, and a sentence added without one, an entry left after
its sentence went, or a sentence the page cannot read fails the build. Seconds: the code is
read, not run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

from spmd_docs import errors  # noqa: E402
from spmd_docs.tables import Drift  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _package_copy(tmp_path: Path, added: str = "") -> Path:
    copy = tmp_path / "spmd"
    shutil.copytree(ROOT / "spmd", copy, ignore=shutil.ignore_patterns("__pycache__"))
    if added:
        say = copy / "magics" / "commands" / "say.py"
        say.write_text(say.read_text() + "\n\n" + added + "\n")
    return copy


def test_the_page_has_every_kind_of_error_with_its_topic():
    page = errors.page()
    for topic, sentence in [
        ("Commands and cells", "`No SPMD cluster is running: start one with %spmd start -n 4.`"),
        ("Hosts and launchers (ssh, MPI, Slurm)",  # (a HostsError)
         "`--hosts needs at least one host name, like --hosts node1,node2`"),
        ("Attaching and lingering", "`Cluster … has ended: start one with %spmd start.`"),
        ("GPUs and torch", "`--torch-backend nccl needs a GPU for each rank, and rank … on … "
                           "sees none: use --torch-backend gloo.`"),
        ("JupyterLab's debugger",  # (a helper's sentence: no_answer)
         "`… did not answer the debugger within … s (stopped, or stuck outside Python?), and "
         "… asked nothing for … s: interrupt the kernel, or %spmd restart.`"),
    ]:
        section = page.split(f"## {topic}\n", 1)[1].split("\n## ", 1)[0]
        assert f"- {sentence}" in section, (topic, sentence)


def test_a_refusal_without_its_entry_fails_the_build(tmp_path):
    copy = _package_copy(tmp_path, 'def refuse():\n    from IPython.core.error import '
                                   'UsageError\n\n    raise UsageError(f"A new refusal of '
                                   '{1} nobody wrote up.")')
    with pytest.raises(Drift) as failed:
        errors.page(copy)
    assert "1 error sentence(s) of the code have no entry in errors.yaml" in str(failed.value)
    assert "spmd/magics/commands/say.py:" in str(failed.value)
    assert "'A new refusal of … nobody wrote up.'" in str(failed.value)


def test_an_entry_whose_sentence_went_fails_the_build(tmp_path):
    entries = tmp_path / "errors.yaml"
    entries.write_text(errors.ENTRIES.read_text() + "Export:\n- says: 'An old sentence.'\n")
    with pytest.raises(Drift, match="match no sentence the code says.*\n  'An old sentence.'"):
        errors.page(path=entries)


def test_a_sentence_the_page_cannot_read_fails_the_build(tmp_path):
    copy = _package_copy(tmp_path, "def refuse(why):\n    from IPython.core.error import "
                                   "UsageError\n\n    raise UsageError(why.upper())")
    with pytest.raises(Drift, match=r"cannot read the sentence.*\n  spmd/magics/commands/say"
                                    r"\.py:\d+ \(why\.upper\(\)\)"):
        errors.page(copy)
