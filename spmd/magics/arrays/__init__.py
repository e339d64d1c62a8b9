"""Arrays over several processes, in the notebook: ``%spmd sharding``, ``gather`` and
``push`` (transfers.py), a cell's value that is one (values.py), ``print(x)`` of one
(printed.py), and the sentence above an error on ranks that hold none of a mesh (meshes.py)."""
