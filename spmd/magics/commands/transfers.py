"""Values between the notebook and the ranks: ``%spmd sharding``, ``gather``, ``push`` and
``export`` (the cells the ranks ran, as a job)."""

from __future__ import annotations

import numpy as np
from IPython.core.error import UsageError
from IPython.display import display

from spmd.cluster.session import Ran
from spmd.magics.arrays import arrays
from spmd.magics.commands.say import say
from spmd.magics.export import export
from spmd.magics.start.arguments import _gather_options


class Transfers:
    """SpmdMagics' commands that move values (a mixin: the state is SpmdMagics', see
    magics.py)."""

    def _cmd_sharding(self, expr: str) -> None:
        if not expr:
            raise UsageError("Say which array: %spmd sharding x draws the layout of x.")
        session = self._require_session()
        display(arrays.sharding_bundle(session, expr), raw=True)

    def _cmd_gather(self, text: str):
        expr, name, max_bytes = _gather_options(text)
        session = self._require_session()
        value = arrays.gather(session, expr, max_bytes)
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

    def _cmd_export(self, args: list[str]) -> None:
        self._take_pending()
        if self.session is None:
            raise UsageError(
                "No cluster has run a cell here yet: %spmd start -n 4, run the cells, then "
                "%spmd export train.py writes them as a job."
            )
        say(export.export(self.session, args))

    def _cmd_push(self, names: list[str]) -> None:
        if not names or not all(n.isidentifier() for n in names):
            raise UsageError(
                "Say which notebook variables: %spmd push x y sends x and y to every rank."
            )
        session = self._require_session()
        say(arrays.push(session, names, self.shell.user_ns))
        count = self.shell.displayhook.prompt_count
        session.ran.append(Ran(export.pushed(names, self.shell.user_ns), count, where="push"))
