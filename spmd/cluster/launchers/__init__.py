"""How processes get started and ended: ipyparallel's Cluster and launchers, configured
(launch.py, remote.py, ssh.py), the rank servers that fork the ranks (servers.py, forks.py),
and room and ends on this machine
(processes.py). Imports only the rank channel (channel/) of the rest of cluster/."""
