"""On a rank: what the notebook asks when it watches the ranks, answered while a cell runs:
where the rank is and the signals it takes on the control channel (answers.py), its stack
dumped from C when that cannot answer (stacks.py), and each cell's cross-process launches,
recorded for the census (launches.py)."""
