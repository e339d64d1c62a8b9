"""The notebook side of the machine, in four floors, each importing only from those below:

- here, the cluster's life: Session (session.py) keeps the lock and the generation and
  delegates to its parts: the launch (startup.py, restarts.py, stopping.py), the death watch
  (deaths.py), the cell runner (cells.py) and the late outputs (late.py);
- ``lockstep/``: one cell on N ranks, their outputs, logs and stacks, and the records of why
  a cell stopped (the words are the magics');
- ``launchers/``: how processes get started (ipyparallel's launchers, configured; ssh; the
  rank servers that fork the ranks);
- ``channel/``: the notebook's channel to its ranks on ipyparallel's client, the only code
  that touches the client's internals.
"""
