"""``%spmd export``: the cells the ranks ran as a script a job runs (script.py), each cell
as plain Python (to_python.py), and the file that launches it (launch_file.py)."""
