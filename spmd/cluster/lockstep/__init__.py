"""Cells in lockstep: one cell sent to N ranks and what each rank sends back (run.py), every
line of it (logs.py, with a process's last lines), the ranks' stacks (where.py) and where
the ranks' launches parted (census.py), as data: the magics say them in words.
Imports from records.py, launchers/ and channel/ below it, never from the cluster's life
above."""
