"""The multi-process machine: cluster life, engine bootstrap, lockstep cells."""
