"""How processes get started and ended: ipyparallel's Cluster and launchers, configured
(launch.py, remote.py, ssh.py), the rank servers that fork the ranks (servers.py, forks.py),
the controller (controller.py), the client (client.py), and room and ends on this machine
(processes.py). The lowest floor of cluster/: it imports from no other part of it."""
