"""The text form of a rank's widgets as they are now, for the notebook's saved copy.

A widget's display carries the text form it had when it was shown ("0%" for a ``tqdm`` bar that
has just begun); later changes travel only as comm messages, which a notebook saved without a
widget front end (nbclient, papermill) keeps in no output. After a cell, the notebook asks the
ranks for the text their widgets read now and puts it in the saved output.
"""

from __future__ import annotations

import html
import re

_TAG = re.compile(r"<[^>]+>")
_BAR_WIDTH = 10


def text_forms(model_ids: list[str]) -> dict[str, str]:
    """{model id: what the widget reads now} for the ids this process still has."""
    try:
        from ipywidgets import Widget
    except ImportError:
        return {}
    live = Widget.widgets if hasattr(Widget, "widgets") else {}
    return {mid: text_form(live[mid]) for mid in model_ids if mid in live}


def text_form(widget) -> str:
    """A box reads as its children; a progress bar as a bar; HTML and labels as their text;
    anything else as its own repr (``IntSlider(value=3)``).

    ``tqdm.auto``'s bar is a box of (left text, progress, right text), so it reads as tqdm
    prints it: ``100%|██████████| 100/100 [00:01<00:00, 99.5it/s]``. (tqdm's own repr of that
    box needs the tqdm object, which is gone once the loop has ended.)
    """
    from ipywidgets import HTML, Box, FloatProgress, IntProgress, Label

    if isinstance(widget, Box):
        parts = [text_form(child) for child in widget.children]
        return "".join(parts).strip()
    if isinstance(widget, (FloatProgress, IntProgress)):
        span = (widget.max - widget.min) or 1
        filled = round(_BAR_WIDTH * min(max((widget.value - widget.min) / span, 0.0), 1.0))
        return "|" + "█" * filled + " " * (_BAR_WIDTH - filled) + "|"
    if isinstance(widget, (HTML, Label)):
        # tqdm pads with figure spaces so that HTML keeps them
        return html.unescape(_TAG.sub("", widget.value)).replace("\u2007", " ")
    return repr(widget)
