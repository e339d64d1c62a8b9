"""The notebook surface: %spmd / %%spmd / %%local, auto mode, rendering."""
