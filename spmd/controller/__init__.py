"""What runs inside ipyparallel's controller process (``python -m spmd.controller``): its
start (start.py), each request's record kept short (hub.py), a rank registered at its first
heartbeat (hearts.py), and one cell sent to all its ranks from one request (fanout.py).
Imports nothing from the notebook's side (cluster/, magics/, kernel/)."""
