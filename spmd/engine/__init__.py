"""What runs inside every rank. Imports nothing from cluster/, magics/ or kernel/. Here what
commands name by path (``python -m spmd.engine``, ``spmd.engine.server``) and the rank's
kernel; below them, by concern: shell/, arrays/, watch/, life/ and join/."""
