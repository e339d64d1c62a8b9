"""The notebook's channel to its ranks, on ipyparallel's client: the client, with a
cell sent once to the controller's fan-out and its replies routed back (client.py), and
control requests to one rank or all (control.py). The only code that touches the client's
internals; the lowest floor of cluster/."""
