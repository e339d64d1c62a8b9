"""The notebook surface: %spmd / %%spmd / %%local (magics.py); below it, by concern: the
commands (commands/), export (export/), a start as the notebook shows it (start/), a cell
(cells/), and arrays over several processes (arrays/)."""
