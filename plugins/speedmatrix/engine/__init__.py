"""Everything that touches a GPU host.

``hosts`` (run commands and copy files over SSH or locally), ``lease`` (the machine-wide lease
one run holds), ``provision`` (the engine env at an exact ref), ``vllm_server`` (start, wait
ready, inspect, stop), ``diagnose`` (a failed start's log, in one line), ``remote_cell`` (a cell
measured on a remote host with the shipped load generator) and ``health`` (the server's /health,
asked before and after each cell). The two packages hold one module per job; their docstrings
map them.
"""
