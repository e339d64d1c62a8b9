"""The private parts of ipyparallel, ipykernel, IPython and jax that the project uses: all
there in the installed versions, and a missing one is one sentence naming it and the version;
the controller refuses to serve plain text where encryption was asked for and not given."""

from __future__ import annotations

import logging
import types

import pytest

from spmd import internals


@pytest.mark.parametrize("side", ["notebook", "rank"])
def test_every_private_part_used_is_there(side):
    assert internals.missing(side) == []


def test_a_missing_private_part_is_one_sentence_with_the_version(monkeypatch):
    gone = internals.Internal(
        "ipyparallel", "ipyparallel", "Client._gone_in_a_new_release", "notebook", "a test"
    )
    monkeypatch.setattr(internals, "INTERNALS", [*internals.INTERNALS, gone])
    internals.check.cache_clear()
    try:
        with pytest.raises(internals.InternalsChanged) as raised:
            internals.check("notebook")
    finally:
        internals.check.cache_clear()
    import ipyparallel

    assert str(raised.value) == (
        f"ipyparallel {ipyparallel.__version__} has no ipyparallel.Client."
        "_gone_in_a_new_release, which jupyter-spmd needs for a test: install a version that "
        "does (see pyproject.toml)."
    )


def test_the_controller_refuses_plain_text_where_encryption_was_asked_for(monkeypatch, tmp_path):
    from spmd.controller import start as controller

    monkeypatch.setenv(controller.CURVE_ENV, "1")
    app = types.SimpleNamespace(
        profile_dir=types.SimpleNamespace(security_dir=str(tmp_path)),
        log=logging.getLogger("test"),
    )
    with pytest.raises(SystemExit):
        # what ipyparallel would write if it stopped honouring enable_curve: no server key
        controller.save_connection_dict(app, "client.json", {"key": "k", "curve_serverkey": None})
    assert list(tmp_path.iterdir()) == []  # no connection file: nobody connects
    controller.save_connection_dict(app, "client.json", {"key": "k", "curve_serverkey": "s"})
    assert [p.name for p in tmp_path.iterdir()] == ["client.json"]
