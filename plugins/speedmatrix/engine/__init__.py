"""Everything that touches a GPU host.

``hosts`` (run commands and copy files over SSH or locally), ``lease`` (the machine-wide lease
one run holds), ``provision`` (the engine env at an exact ref), ``vllm_server`` (start, wait
ready, inspect, stop) and ``diagnose`` (a failed start's log, in one line). The two packages
hold one module per job; their docstrings map them.
"""
