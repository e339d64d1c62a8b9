"""The notebook side of the machine: the cluster's life, lockstep cells, the watchdog."""
