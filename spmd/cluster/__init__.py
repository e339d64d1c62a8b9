"""The notebook side of the machine, in three floors, each importing only from those below:

- here, the cluster's life: start, restart, deaths, stop (session.py owns it), and a cell's
  run within that life (cells.py);
- ``lockstep/``: one cell on N ranks, their outputs, logs and stacks, and the watchdog's words;
- ``launchers/``: how processes get started (ipyparallel's launchers, configured; ssh; the
  rank servers that fork the ranks) and ended.
"""
