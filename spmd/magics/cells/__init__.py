"""A ``%%spmd`` cell in the notebook: its steps (cell.py), auto mode (automode.py), its
per-rank outputs grouped (render.py), the live panel (panel.py) and rows of many ranks
(grouped.py), a rank's prompt (prompts.py), and widgets' saved text (widgets.py)."""
