"""The notebook's side of a rank's ``input()``, ``getpass`` or pdb prompt: the person answers
it here, with the rank in the prompt (``[rank 1] (Pdb) ``).

The question is asked with the notebook's own ``input``/``getpass``, so it goes to the front
end's stdin like any prompt of the notebook. Where the front end has none (nbclient,
papermill), that raises StdinNotImplementedError at once, and the rank raises the same.
"""

from __future__ import annotations

import builtins
import getpass

from spmd.magics.cells.render import LiveView


class Prompter:
    """``CellRun.on_prompt`` for one cell."""

    def __init__(self, live: LiveView) -> None:
        self.live = live

    def __call__(self, rank: int, request: dict, run) -> dict:
        if self.live.panel is not None:  # (it cannot update while the person types)
            self.live.panel.show_now(run)
        self.live.show_rank(rank)  # what it printed since: pdb's lines come before its prompt
        label = f"[rank {rank}] {request.get('prompt', '')}"
        try:
            if request.get("password"):
                text = getpass.getpass(label)
            else:
                text = builtins.input(label)
        except EOFError:
            text = "\x04"
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # StdinNotImplementedError: no stdin in this front end
            return {"error": str(exc) or type(exc).__name__}
        return {"text": text}
