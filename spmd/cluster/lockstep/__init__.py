"""Cells in lockstep: one cell sent to N ranks (run.py), what each rank sends back
(outputs.py, logs.py), their stacks (where.py), and why a cell stopped (watchdog.py).
Imports from launchers/ and channel/ below it, never from the cluster's life above."""
