"""The ``%spmd`` commands by what they do, as SpmdMagics' mixins (magics.py dispatches them):
the cluster's life (lifecycle.py), looking at the ranks (inspection.py), arrays between the
notebook and the ranks (sharing.py), the cells as a job (exporting.py), and how every magic
speaks (say.py)."""
