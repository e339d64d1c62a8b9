"""``python -m spmd.engine``: the command ipyparallel launches for every rank."""

# Run under -m, this file is __main__; the notebook calls the functions of the importable
# module (spmd.engine.bootstrap), so the join lives there.
from spmd.engine.bootstrap import main

main()
