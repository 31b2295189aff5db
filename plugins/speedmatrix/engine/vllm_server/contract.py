"""The handle of a started server, its errors, and the settings every part of the lifecycle shares.

One job: the contract between starting, waiting, inspecting and stopping a server. The handle
is JSON-able (it travels between Airflow tasks) and holds everything needed to reach and stop
the server, never the API key itself (only the name of the variable that holds it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from speedmatrix.engine.diagnose import Diagnosis
from speedmatrix.engine.hosts import Host, get_host

DEFAULT_SERVERS_DIR = "$HOME/.speedmatrix/servers"


# Exported by every launcher, before the engine starts. The project's rule: a server we start
# contacts no address but loopback (and installs reach only the package registries). vLLM
# sends usage stats to stats.vllm.ai unless told not to: VLLM_NO_USAGE_STATS and DO_NOT_TRACK
# are the opt-outs its usage-stats page documents, VLLM_DO_NOT_TRACK the one vllm/envs.py reads;
# HF_HUB_DISABLE_TELEMETRY turns off the Hugging Face hub client's telemetry in the same process.
NO_TELEMETRY_ENV: dict[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


DEFAULT_API_KEY_ENV = "SPEEDMATRIX_API_KEY"


PROBE_KEY_VAR = "SPEEDMATRIX_PROBE_KEY"


class ServerError(RuntimeError):
    """A server could not be started, got ready, or be stopped; carries the diagnosis."""

    def __init__(
        self,
        message: str,
        diagnosis: Diagnosis | None = None,
        log_tail: str = "",
        log_path: str | None = None,
    ):
        self.diagnosis = diagnosis
        self.log_tail = log_tail
        self.log_path = log_path
        text = message if diagnosis is None else f"{message}: {diagnosis.message}"
        if log_tail:
            text += f"\n--- last lines of {log_path or 'the server log'} ---\n{log_tail}"
        super().__init__(text)


class PortInUse(ServerError):
    """The port is taken before we start (nothing was launched)."""


class ServerAlreadyRunning(ServerError):
    """A previous server of ours is still alive on the host (nothing was launched)."""


class GpuBusy(ServerError):
    """nvidia-smi lists GPU compute processes before the start (nothing was launched)."""


@dataclass
class ServerHandle:
    """Everything needed to reach and stop a started server. JSON-able (``to_dict``)."""

    host: str
    host_env: dict[str, str]
    pid: int  # also the process group and session id
    run_dir: str
    log_path: str
    base_url: str  # as seen from the host itself
    port: int
    served_name: str
    python: str  # the python used for probes on the host
    api_key_env: str | None  # name of the variable holding the key (never the key)
    command: str  # the launch command, secrets redacted
    started_at: float
    ready_s: float | None = None
    facts: dict = field(default_factory=dict)
    # "<start time> <boot id>" of the group leader (see the package docstring); None in a
    # handle from before identities were recorded (then the run dir's pid.identity is used).
    identity: str | None = None
    # The run that started it (its lease holder), and its machine-wide registry entry.
    run: str | None = None
    record: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ServerHandle:
        return cls(**data)

    def get_host(self) -> Host:
        return get_host(self.host, env=self.host_env)
