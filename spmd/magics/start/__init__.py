"""A cluster's start as the notebook shows it: every option read and checked
(arguments.py), the SPMD kernel's start on a thread (background.py), its progress
(progress.py), its summary and the rank table (status.py), and what happened while no notebook
held the cluster, said at ``%spmd attach`` (away.py)."""
