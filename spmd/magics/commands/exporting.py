"""``%spmd export``: the cells the ranks ran, written out as a job (magics/export/)."""

from __future__ import annotations

from IPython.core.error import UsageError

from spmd.magics.commands.say import say
from spmd.magics.export import script


class Exporting:
    """SpmdMagics' export command (a mixin: the state is SpmdMagics', see magics.py)."""

    def _cmd_export(self, args: list[str]) -> None:
        self._take_pending()
        if self.session is None:
            raise UsageError(
                "No cluster has run a cell here yet: %spmd start -n 4, run the cells, then "
                "%spmd export train.py writes them as a job."
            )
        say(script.export(self.session, args))
