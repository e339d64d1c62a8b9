"""input(), breakpoint() and post-mortem pdb on the ranks, answered by a front end with stdin.

Each test drives a real kernel through jupyter_client, as JupyterLab does, answering its
input_requests: the magic in a plain Python kernel, and the SPMD kernel.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import SPMD_KERNEL, kernel_stream, spmd_kernel

pytestmark = pytest.mark.timeout(180)

SETUP = "import os\nrank = int(os.environ['SPMD_RANK'])"


@pytest.fixture(scope="module", params=["magic", "kernel"])
def started(request):
    """A kernel with 2 ranks: python3 with %spmd start, or the SPMD kernel (one of each for
    the module: each test gets its ranks anew, below)."""
    name = "python3" if request.param == "magic" else SPMD_KERNEL
    with spmd_kernel(name) as (km, kc):
        if request.param == "magic":
            reply, text = kernel_stream(kc, "%load_ext spmd\n%spmd start -n 2 --backend none")
            assert reply["content"]["status"] == "ok", text
        yield km, kc


@pytest.fixture
def kernel(started):
    """The module's kernel with new ranks (%spmd restart: nothing an earlier test left, a
    failed rank's exception, a prompt, a pause, reaches this one), and SETUP run."""
    km, kc = started
    reply, text = kernel_stream(kc, "%spmd restart")
    assert reply["content"]["status"] == "ok", text
    reply, text = kernel_stream(kc, SETUP)
    assert reply["content"]["status"] == "ok", text
    return km, kc


class Person:
    """A person at the front end: answers prompts in order, and remembers them."""

    def __init__(self, *answers: str, think: float = 0.0) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []
        self.think = think

    def __call__(self, kc):
        def answer(content: dict) -> None:
            self.prompts.append(content["prompt"])
            time.sleep(self.think)
            kc.input(self.answers.pop(0))

        return answer


def test_input_on_one_rank_and_on_two_in_rank_order(kernel):
    km, kc = kernel
    # rank 0 is done at once; rank 1 waits for the person longer than the watchdog's grace
    person = Person("ada", think=1.5)
    reply, text = kernel_stream(
        kc, "%%spmd --grace 0.5\nname = input('your name? ') if rank == 1 else 'none'\n"
            "print('hello', name)",
        stdin=person(kc),
    )
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 1] your name? "]
    assert "[rank 0] hello none" in text
    assert "[rank 1]\nyour name? ada\nhello ada" in text
    # both ask: answered one at a time, lowest rank first
    person = Person("zero", "one")
    reply, text = kernel_stream(
        kc, "import getpass\nsecret = getpass.getpass(f'key {rank}? ')\nprint(len(secret))",
        stdin=person(kc),
    )
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 0] key 0? ", "[rank 1] key 1? "]
    assert "[rank 0]\nkey 0? \n4" in text and "[rank 1]\nkey 1? \n3" in text  # never echoed


def test_a_breakpoint_stops_the_lowest_rank_by_default_and_p_and_c_work(kernel):
    km, kc = kernel
    person = Person("p y", "n", "p z", "c")
    reply, text = kernel_stream(
        kc,
        "%%spmd --grace 5\ny = rank * 10 + 5\nif rank == 1:\n    breakpoint()\n    z = y + 1\n"
        "print('after', y)",
        stdin=person(kc),
    )
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 1] (Pdb) "] * 4
    assert "(Pdb) p y\n15\n" in text and "(Pdb) p z\n16\n" in text
    assert "[rank 0] after 5" in text and re.search(r"after 15", text)
    # every rank reaches it (pdb.set_trace, the same rule): only rank 0 stops; rank 1 goes on
    person = Person("c")
    reply, text = kernel_stream(
        kc, "%%spmd --grace 5\nimport pdb\npdb.set_trace()\nw = rank", stdin=person(kc)
    )
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 0] (Pdb) "]
    # --breakpoint all: each rank, one prompt at a time
    person = Person("p rank", "c", "p rank", "c")
    reply, text = kernel_stream(
        kc, "%%spmd --breakpoint all --grace 5\nbreakpoint()\nw = rank", stdin=person(kc)
    )
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 0] (Pdb) "] * 2 + ["[rank 1] (Pdb) "] * 2


def test_post_mortem_opens_pdb_on_the_failed_ranks_exception(kernel):
    km, kc = kernel
    reply, text = kernel_stream(
        kc, "def f(v):\n    secret = v * 2\n    raise ValueError('bad', secret)\n"
        "if rank == 1:\n    f(21)"
    )
    assert reply["content"]["status"] == "error"
    person = Person("p secret", "q")
    reply, text = kernel_stream(kc, "%spmd debug", stdin=person(kc))
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 1] ipdb> "] * 2
    assert "ipdb> p secret\n42\n" in text
    # pdb.pm() in a cell on that rank: the same exception
    person = Person("p secret * 2", "q")
    reply, text = kernel_stream(kc, "%%spmd --ranks 1\nimport pdb\npdb.pm()", stdin=person(kc))
    assert reply["content"]["status"] == "ok", text
    assert person.prompts == ["[rank 1] (Pdb) "] * 2 and "(Pdb) p secret * 2\n84\n" in text
    # a rank that never raised says so
    reply, text = kernel_stream(kc, "%spmd debug 0", stdin=Person()(kc))
    assert "This rank has raised no exception yet" in text


def test_interrupt_at_a_prompt_ends_the_prompt_and_the_cell(kernel):
    km, kc = kernel
    asked = []

    def interrupt(content: dict) -> None:
        asked.append(content["prompt"])
        km.interrupt_kernel()

    t0 = time.monotonic()
    reply, text = kernel_stream(kc, "answer = input('wait for me? ')", stdin=interrupt)
    assert asked == ["[rank 0] wait for me? "]  # (rank 1's prompt ended with it)
    assert reply["content"]["status"] == "error"
    assert time.monotonic() - t0 < 30
    report = "\n".join(reply["content"]["traceback"])
    assert "[ranks 0-1] KeyboardInterrupt: interrupted at the prompt" in report
    # no rank is left waiting, and they are in step: the next cell runs
    reply, text = kernel_stream(kc, "print('back')", timeout=30)
    assert text == "[ranks 0-1] back\n", (text, reply["content"])


def test_without_stdin_input_fails_at_once_on_every_rank(kernel):
    km, kc = kernel
    t0 = time.monotonic()
    reply, text = kernel_stream(kc, "name = input('name? ')")  # (no stdin: like nbclient)
    assert reply["content"]["status"] == "error"
    assert time.monotonic() - t0 < 10
    report = "\n".join(reply["content"]["traceback"])
    assert "Error on 2 of 2 ranks" in report
    assert "StdinNotImplementedError" in report and "does not support input requests" in report


def test_paused_ranks_that_cannot_answer_are_let_go_together_and_leave_no_futures(module_shell):
    """Letting paused ranks go (an interrupt) sends every rank's continue at once and waits
    once; the unanswered requests do not stay in the client's futures. (Two stopped ranks,
    two threads each: one after another, that was 4 waits.)"""
    import os
    import signal

    from conftest import ready_cluster

    from spmd.cluster.channel import control

    cluster = ready_cluster(module_shell, "start -n 2 --backend none")
    session = cluster.magics_manager.registry["SpmdMagics"].session
    client, ranks = session.record().client, session.ranks
    engine_ids = [r.engine_id for r in ranks]
    for r in ranks:
        os.kill(r.pid, signal.SIGSTOP)
    try:
        # (what the IO thread records from the ranks' stopped events)
        client._io_loop.add_callback(lambda: setattr(
            client, "paused", {e: frozenset({1, 2}) for e in engine_ids}))
        while set(client.paused) != set(engine_ids):
            time.sleep(0.01)
        t0 = time.monotonic()
        control.resume_debugged(client, engine_ids, timeout=2.0)
        took = time.monotonic() - t0
        assert took < 3.5, took  # (one wait of 2 s, not four)
        time.sleep(0.2)  # (the futures are dropped on the IO thread)
        left = [f for f in list(client._futures.values())
                if f.header.get("msg_type") == "debug_request"]
        assert not left, left
    finally:
        for r in ranks:
            os.kill(r.pid, signal.SIGCONT)
    assert not client.paused


def test_a_cells_folder_another_user_made_first_is_refused(tmp_path):
    """The ranks' cell folder has a public name (/tmp/ipykernel_<the kernel's pid>): one that
    another user made first, or a link, is refused with a sentence (before: used as found)."""
    import os

    from spmd.engine.shell.debugging import own_folder

    mine = tmp_path / "ipykernel_1"
    assert own_folder(str(mine)) == str(mine)
    assert (mine.stat().st_mode & 0o777) == 0o700
    assert own_folder(str(mine)) == str(mine)  # (again: it is ours)
    link = tmp_path / "ipykernel_2"
    link.symlink_to(mine)
    with pytest.raises(PermissionError, match="is a link or another user's"):
        own_folder(str(link))
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root (CI is root)")
    theirs = tmp_path / "ipykernel_3"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # (nobody)
    with pytest.raises(PermissionError, match=r"another user's \(uid 65534\): remove it"):
        own_folder(str(theirs))
