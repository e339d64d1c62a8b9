"""A rank's process and its end: it ends with the notebook process that started it, or
after its linger (orphans.py); while it lingers, what it prints goes to its log
(unattended.py); and the wait for its end that ssh runs on its host (hostwait.py)."""
