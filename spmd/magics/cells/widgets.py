"""Widgets made on the ranks: their saved text is what they read when the cell ended.

ipyparallel relays the comm messages of a rank's widget both ways, so a front end that renders
widgets shows it live and can change it. A widget's display carries only the text it had when
it was shown; this asks each rank, once per cell that showed widgets, for the text they read
now (``spmd.engine.shell.widget_text``) and puts it in the outputs the notebook keeps.
"""

from __future__ import annotations

from spmd.cluster.session import RankCell, Session
from spmd.engine.shell.widget_text import text_forms
from spmd.magics.cells.render import widget_id

ASK_SECONDS = 5.0  # a rank that does not answer keeps its first text


def refresh_texts(session: Session, cells: dict[int, RankCell], ranks: list[int]) -> None:
    """The text form of every widget output of ``ranks`` (ranks that finished the cell)."""
    wanted = {
        rank: {widget_id(o): o for o in cells[rank].outputs if widget_id(o) is not None}
        for rank in ranks
    }
    asks = {
        rank: session.record().client[session.ranks[rank].engine_id].apply_async(text_forms, list(outs))
        for rank, outs in wanted.items()
        if outs
    }
    for rank, ask in asks.items():
        try:
            texts = ask.get(ASK_SECONDS)
        except Exception:  # (a rank that died or is busy: its widgets keep their first text)
            continue
        for model_id, text in texts.items():
            out = wanted[rank][model_id]
            out.data = {**out.data, "text/plain": text}
