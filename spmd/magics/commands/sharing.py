"""Arrays between the notebook and the ranks: ``%spmd sharding``, ``gather`` and ``push``."""

from __future__ import annotations

import numpy as np
from IPython.core.error import UsageError
from IPython.display import display

from spmd.cluster.session import Ran
from spmd.magics.arrays import transfers
from spmd.magics.commands.say import say
from spmd.magics.export.script import pushed
from spmd.magics.start.arguments import _gather_options


class Sharing:
    """SpmdMagics' commands on arrays the ranks share (a mixin: the state is SpmdMagics',
    see magics.py)."""

    def _cmd_sharding(self, expr: str) -> None:
        if not expr:
            raise UsageError("Say which array: %spmd sharding x draws the layout of x.")
        session = self._require_session()
        display(transfers.sharding_bundle(session, expr), raw=True)

    def _cmd_gather(self, text: str):
        expr, name, max_bytes = _gather_options(text)
        session = self._require_session()
        value = transfers.gather(session, expr, max_bytes)
        if name is None:
            return value
        self.shell.user_ns[name] = value
        what = (
            f"numpy {value.dtype}{list(value.shape)}"
            if isinstance(value, np.ndarray)
            else (f"a list of {len(value)} values, by rank")
        )
        say(f"{name} = {what}, from {expr} on the ranks.")
        return None

    def _cmd_push(self, names: list[str]) -> None:
        if not names or not all(n.isidentifier() for n in names):
            raise UsageError(
                "Say which notebook variables: %spmd push x y sends x and y to every rank."
            )
        session = self._require_session()
        say(transfers.push(session, names, self.shell.user_ns))
        count = self.shell.displayhook.prompt_count
        session.ran.append(Ran(pushed(names, self.shell.user_ns), count, where="push"))
