"""The ``%spmd`` commands by what they do, as SpmdMagics' mixins (magics.py dispatches them):
the cluster's life (lifecycle.py), looking at the ranks (inspection.py), values to and from
the ranks (transfers.py), and how every magic speaks (say.py)."""
