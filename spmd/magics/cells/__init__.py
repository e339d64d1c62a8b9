"""A ``%%spmd`` cell in the notebook: its steps (cell.py), auto mode (automode.py), its
per-rank outputs grouped and its live view, which asks a rank's prompt (render.py), the
live panel (panel.py) and rows of many ranks (grouped.py), and widgets' saved text
(widgets.py)."""
