"""Cells in lockstep: one cell sent to N ranks and what each rank sends back (run.py), every
line of it (logs.py), the ranks' stacks (where.py), why a cell stopped (stall.py) and where
the ranks' launches parted (census.py), as data: the magics say them in words.
Imports from launchers/ and channel/ below it, never from the cluster's life above."""
