"""Start, wait for, inspect and stop the engine server of a recipe on a host.

Why this shape:

- The server is started exactly as ``speedmatrix recipes render`` prints the recipe's launch
  command, through a launcher script in its own session and process group
  (``setsid bash -c 'echo $$ > pid; exec …'``), so that ``pid`` is the group id and stopping the
  group reaches every engine process (API server, engine core, workers).
- The API key never appears on a command line of a real vLLM: it is written to a 0600
  ``secrets.env`` in the run directory and reaches vLLM as ``VLLM_API_KEY``. (The simulator takes
  it as ``--api-key``, which the team accepted for the simulator only.)
- Readiness is four checks done *on the host* (GPU hosts' ports are not always reachable from
  the Airflow worker): ``/health`` 200, ``/version`` answers as vLLM (a JSON object with a
  non-empty ``version`` string; any other answer from a server that is up fails the start at
  once: it is not the engine the recipe names), ``/v1/models`` lists the served name, and a
  one-token completion succeeds. An answer that waiting cannot change (a model list without the
  served name, the key refused, the completion refused with a 4xx) fails the start at once too.
- Every launcher exports vLLM's usage-stats opt-outs (:data:`NO_TELEMETRY_ENV`): a server we
  start contacts nothing but loopback.
- A failed start ends with a one-line diagnosis (:mod:`speedmatrix.engine.diagnose`) and the log's
  tail, and the half-started server is stopped.
- ``stop`` is TERM to the group, wait, KILL (logged, and told in its result), then verify no
  process of the group is left and, on GPU hosts, that nvidia-smi lists no compute process of
  ours (an nvidia-smi that fails is reported as such, never read as "none left"; a host
  without nvidia-smi skips that check); safe when it already died.

State per server lives in ``<servers_dir>/<port>/`` on the host (default
``$HOME/.speedmatrix/servers``): ``pid``, ``pid.identity``, ``run`` (the run that started it:
its lease holder), ``server.log``, ``launch.sh``, ``command.txt`` (the redacted launch line),
``secrets.env``. The launcher also registers the server machine-wide, in the lease's directory
(:mod:`speedmatrix.engine.lease`, ``/var/tmp/speedmatrix``): ``server.<uid>.<port>``, readable by every
user, holding its PID, identity, run dir and run. "A previous server of ours" is any live group
recorded there or under ``servers_dir``: a server started with another HOME or by another SSH
user of the box refuses a start as well, since the GPUs are the machine's. Before a start,
nvidia-smi is asked for the GPUs' compute processes: any (nothing of this run is running yet)
refuses the start; a host without nvidia-smi has no GPU to check (said in the log).

Those records are also how a teardown finds a server whose handle never reached it (a setup
that failed after the launch, a worker killed during setup): :func:`run_servers` lists the
servers a run started, from the host alone.

PID reuse: a pid file outlives its server (a crash, a reboot), and its number may later belong
to an unrelated process group: signalling it would kill someone else's work. So the launcher
records its own identity before its PID: ``pid.identity`` is "<start time> <boot id>" (field 22
of ``/proc/<pid>/stat``, clock ticks after boot, and the kernel's boot id). The recorded group
is ours only while the process with that PID has that start time on that boot, or, the leader
gone, while its group still has members on that boot (Linux does not hand out a PID that is
still a process group's id, so they are the leader's; the one case this cannot tell is a PID
reused by a new group leader that died in turn, leaving its own group behind). Otherwise the
server is gone: said in the log, never signalled. A run dir with only a ``pid`` file (written
before identities were recorded) is judged as before: a live group is ours.

One module per job:

================  ===========================================================================
``contract``      the handle, the errors, and the settings every step shares
``registry``      the host's records of our servers; whether a recorded group is still ours
``gpus``          nvidia-smi's GPU compute processes, and the one way we name them
``launch``        :func:`start_server`: the refusals, the run dir, the launcher
``ready``         :func:`wait_ready`: the four readiness checks, run on the host
``inspection``    :func:`inspect_server`: version, commit, KV capacity, limits, hardware
``stop``          :func:`stop_server`: TERM, KILL, verify (processes and GPUs)
================  ===========================================================================
"""

from speedmatrix.engine.vllm_server.contract import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_SERVERS_DIR,
    NO_TELEMETRY_ENV,
    GpuBusy,
    PortInUse,
    ServerAlreadyRunning,
    ServerError,
    ServerHandle,
)
from speedmatrix.engine.vllm_server.gpus import (
    GPU_APPS_QUERY,
    describe_gpu_apps,
    gpu_compute_apps,
)
from speedmatrix.engine.vllm_server.inspection import (
    hardware_facts,
    inspect_server,
    kv_tokens_from_log,
    parse_cache_config,
)
from speedmatrix.engine.vllm_server.launch import port_holder, start_server
from speedmatrix.engine.vllm_server.ready import log_tail, wait_ready
from speedmatrix.engine.vllm_server.registry import (
    ServerRecord,
    alive_servers,
    group_pids,
    is_alive,
    run_servers,
    server_records,
    server_state,
)
from speedmatrix.engine.vllm_server.stop import stop_server

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "DEFAULT_SERVERS_DIR",
    "GPU_APPS_QUERY",
    "NO_TELEMETRY_ENV",
    "GpuBusy",
    "PortInUse",
    "ServerAlreadyRunning",
    "ServerError",
    "ServerHandle",
    "ServerRecord",
    "alive_servers",
    "describe_gpu_apps",
    "gpu_compute_apps",
    "group_pids",
    "hardware_facts",
    "inspect_server",
    "is_alive",
    "kv_tokens_from_log",
    "log_tail",
    "parse_cache_config",
    "port_holder",
    "run_servers",
    "server_records",
    "server_state",
    "start_server",
    "stop_server",
    "wait_ready",
]
