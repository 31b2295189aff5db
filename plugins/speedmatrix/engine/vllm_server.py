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
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import time
from dataclasses import asdict, dataclass, field

from speedmatrix.engine.diagnose import Diagnosis, diagnose
from speedmatrix.engine.hosts import Host, get_host
from speedmatrix.engine.lease import LeaseError, machine_dir
from speedmatrix.engine.provision import ProvisionResult
from speedmatrix.recipes import Recipe

log = logging.getLogger("speedmatrix.server")

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
_PROBE_KEY_VAR = "SPEEDMATRIX_PROBE_KEY"


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
    # "<start time> <boot id>" of the group leader (see the module docstring); None in a
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


# ---------------------------------------------------------------------------- helpers
def _q(s: str) -> str:
    return shlex.quote(s)


def _with_port(recipe: Recipe, port: int | None) -> Recipe:
    if port is None or port == recipe.serve.port:
        return recipe
    return recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"port": port})})


def _probe_host(bind: str) -> str:
    return "127.0.0.1" if bind in ("0.0.0.0", "", "::") else bind


def _api_key_value(recipe: Recipe, api_key: str | None) -> str | None:
    if not recipe.has_api_key:
        return None
    if api_key is not None:
        return api_key
    name = recipe.serve.api_key_secret or DEFAULT_API_KEY_ENV
    value = os.environ.get(name)
    if not value:
        raise ServerError(
            f"recipe {recipe.id} needs an API key: set the environment variable {name}"
        )
    return value


# What the launcher runs first, in its own new session: its identity, then its PID (in that
# order, so a pid file that is there always has its identity beside it).
_RECORD_IDENTITY = (
    "s=$(cat /proc/$$/stat 2>/dev/null) && { s=${s##*) }; set -- $s; "
    'i="${20} $(cat /proc/sys/kernel/random/boot_id 2>/dev/null)"; '
    'printf "%s\\n" "$i" > pid.identity; }; '
)

# sm_state PID IDENTITY: is the group recorded as PID (with that identity, or "" for a run dir
# without one) still our server? Prints "alive" (the leader is ours), "orphans" (the leader
# died, its group lives on), "dead", or "gone: <why>" (the PID is another process now).
_STATE_SH = r"""
sm_state() {
  local p=$1 ident=$2 want_start want_boot now= boot s grp=
  ps -eo pgid= | awk -v g="$p" '$1 == g {f = 1} END {exit !f}' && grp=1
  if [ -z "$ident" ]; then
    if [ -n "$grp" ]; then echo alive; else echo dead; fi
    return 0
  fi
  set -- $ident; want_start=$1; want_boot=$2
  if s=$(cat /proc/"$p"/stat 2>/dev/null); then s=${s##*) }; set -- $s; now=${20}; fi
  if [ -z "$now" ] && [ -z "$grp" ]; then echo dead; return 0; fi
  boot=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)
  if [ -n "$want_boot" ] && [ -n "$boot" ] && [ "$boot" != "$want_boot" ]; then
    echo "gone: the host rebooted since the server started (boot id $want_boot, now $boot): PID $p is another process now"
    return 0
  fi
  if [ -n "$now" ] && [ "$now" != "$want_start" ]; then
    echo "gone: PID $p is another process now (started $now clock ticks after boot; the server's leader started at $want_start)"
    return 0
  fi
  if [ -n "$now" ]; then echo alive; else echo orphans; fi
}
"""
_OURS = ("alive", "orphans")


@dataclass(frozen=True)
class ServerRecord:
    """A server as the host's own records tell it."""

    run_dir: str
    pid: int
    identity: str | None
    run: str | None  # the run that started it (its lease holder), when recorded
    owner: str  # the user who started it
    state: str  # alive, orphans, dead or "gone: <why>" (see server_state)
    entry: str | None  # its machine-wide registry file, when it has one

    def handle(self, host: Host) -> ServerHandle:
        """A handle :func:`stop_server` can use (what the server's run dir says)."""
        port = os.path.basename(self.run_dir)
        return ServerHandle(
            host=host.name,
            host_env=dict(host.env),
            pid=self.pid,
            run_dir=self.run_dir,
            log_path=f"{self.run_dir}/server.log",
            base_url="",
            port=int(port) if port.isdigit() else 0,
            served_name="",
            python="",
            api_key_env=None,
            command="",
            started_at=0.0,
            identity=self.identity,
            run=self.run,
            record=self.entry,
        )


# $1 servers dir, $2 machine-wide dir. One tab-separated line per record: state, PID,
# identity, run dir, owner, run, registry entry.
_RECORDS_SH = (
    _STATE_SH
    + r"""
line() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(sm_state "$1" "$2")" "$@"; }
for f in "$1"/*/pid; do
  [ -s "$f" ] || continue
  rd=$(dirname "$f"); p=$(cat "$f")
  case $p in ""|*[!0-9]*) continue ;; esac
  line "$p" "$(cat "$rd/pid.identity" 2>/dev/null)" "$rd" "$(id -un)" \
    "$(cat "$rd/run" 2>/dev/null)" ""
done
for f in "$2"/server.*; do
  [ -f "$f" ] || continue
  p=; i=; rd=; run=
  { read -r p; read -r i; read -r rd; read -r run; } < "$f" 2>/dev/null
  case $p in ""|*[!0-9]*) continue ;; esac
  line "$p" "$i" "$rd" "$(stat -c %U "$f" 2>/dev/null)" "$run" "$f"
done
"""
)


def server_records(
    host: Host, servers_dir: str = DEFAULT_SERVERS_DIR, lease_dir: str | None = None
) -> list[ServerRecord]:
    """Every server the host has a record of: in ``servers_dir`` (this HOME's) and in the
    machine-wide registry (every HOME's, every user's), one per run dir and PID."""
    try:
        where, _ = machine_dir(host, lease_dir)
    except LeaseError as exc:
        raise ServerError(f"cannot read the servers recorded on {host.name}: {exc}") from exc
    return _records_in(host, servers_dir, where)


def _records_in(host: Host, servers_dir: str, where: str) -> list[ServerRecord]:
    """:func:`server_records` with the machine-wide directory already resolved."""
    res = host.run(
        f"bash -c {_q(_RECORDS_SH)} records {_q(host.resolve(servers_dir))} {_q(where)}",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    if res.rc != 0:
        raise ServerError(f"cannot read the servers recorded on {host.name}: {res.tail(5)}")
    out: dict[tuple[str, int], ServerRecord] = {}
    for line in res.stdout.splitlines():
        fields = line.split("\t")
        if len(fields) != 7 or not fields[1].isdigit():
            continue
        state, pid, ident, run_dir, owner, run, entry = fields
        rec = ServerRecord(
            run_dir, int(pid), ident or None, run or None, owner, state, entry or None
        )
        key = (rec.run_dir, rec.pid)
        seen = out.get(key)
        out[key] = ServerRecord(
            rec.run_dir,
            rec.pid,
            rec.identity or (seen.identity if seen else None),
            rec.run or (seen.run if seen else None),
            rec.owner if rec.entry else (seen.owner if seen else rec.owner),
            rec.state,
            rec.entry or (seen.entry if seen else None),
        )
    return list(out.values())


def alive_servers(
    host: Host, servers_dir: str = DEFAULT_SERVERS_DIR, lease_dir: str | None = None
) -> dict[str, int]:
    """Run directories of the servers on the machine whose process group is still ours ->
    PID (:func:`server_records`: this HOME's and the machine-wide registry's).

    A recorded PID that now belongs to another process (its start time or the boot differs
    from ``pid.identity``) is not: the server is gone, which is logged.
    """
    out: dict[str, int] = {}
    for rec in server_records(host, servers_dir, lease_dir):
        if rec.state in _OURS:
            out[rec.run_dir] = rec.pid
        elif rec.state.startswith("gone"):
            log.warning(
                "%s: the server recorded in %s (PID %s) is gone, %s; not ours, not signalled",
                host.name,
                rec.run_dir,
                rec.pid,
                rec.state.partition(": ")[2],
            )
    return out


def run_servers(
    host: Host, run: str, servers_dir: str = DEFAULT_SERVERS_DIR, lease_dir: str | None = None
) -> list[ServerRecord]:
    """The servers the host recorded as started by ``run`` (its lease holder), whatever
    became of them: what a teardown stops when no handle reached it."""
    return [r for r in server_records(host, servers_dir, lease_dir) if r.run == run]


def server_state(host: Host, handle: ServerHandle) -> str:
    """Whether the handle's group is still our server: ``alive``, ``orphans`` (leader gone,
    group alive: still ours, stop it), ``dead``, or ``gone: <why>`` (the PID was reused: never
    signal it). Uses the handle's identity, else the run dir's when its pid file is this PID's,
    else none (a server started before identities were recorded: judged as before)."""
    pid = int(handle.pid)
    d = handle.run_dir
    res = host.run(
        _STATE_SH + f"i={_q(handle.identity or '')}; "
        f'if [ -z "$i" ] && [ "$(cat {_q(d + "/pid")} 2>/dev/null)" = {pid} ]; then '
        f"i=$(cat {_q(d + '/pid.identity')} 2>/dev/null); fi; "
        f'sm_state {pid} "$i"',
        timeout_s=30,
        idempotent=True,
        stream=False,
    )
    state = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    if res.rc != 0 or not (state in (*_OURS, "dead") or state.startswith("gone: ")):
        raise ServerError(
            f"on {host.name}: cannot tell whether server group {pid} is ours: "
            f"{res.tail(5) or 'no answer'}"
        )
    return state


def port_holder(host: Host, bind: str, port: int) -> str | None:
    """None when ``port`` is free on the host, else a description of who holds it."""
    probe = _probe_host(bind)
    # bash opens /dev/tcp/HOST/PORT itself, also when the word is quoted: the recipe's
    # serve.host stays one word and is never run
    tcp = _q(f"/dev/tcp/{probe}/{int(port)}")
    res = host.run(
        f"(exec 3<>{tcp}) 2>/dev/null && echo taken || echo free",
        timeout_s=30,
        idempotent=True,
        stream=False,
    )
    if "taken" not in res.stdout:
        return None
    who = host.run(
        f"ss -Hltnp 'sport = :{int(port)}' 2>/dev/null | grep -o 'pid=[0-9]*' | head -1",
        timeout_s=30,
        idempotent=True,
        stream=False,
    ).stdout.strip()
    return f"held by PID {who[4:]}" if who.startswith("pid=") else "held by another process"


# ---------------------------------------------------------------------------- start
def start_server(
    recipe: Recipe,
    prov: ProvisionResult,
    host: Host | str = "local",
    *,
    ref: str | None = None,
    port: int | None = None,
    api_key: str | None = None,
    servers_dir: str = DEFAULT_SERVERS_DIR,
    check_port: bool = True,
    wait: bool = True,
    ready_timeout_s: float | None = None,
    run: str | None = None,
    lease_dir: str | None = None,
) -> ServerHandle:
    """Launch the recipe's server; by default also :func:`wait_ready` (stopping it on failure).

    Refuses (nothing launched) when a server of ours is alive on the machine, under
    ``servers_dir`` or in the machine-wide registry (:class:`ServerAlreadyRunning`), when
    nvidia-smi lists a GPU compute process (:class:`GpuBusy`), or when the port is taken
    (:class:`PortInUse`; skip with ``check_port=False``, e.g. to see the engine's own
    diagnosis). The key comes from ``api_key`` or the environment variable the recipe names
    (``serve.api_key_secret``). ``run`` (the run's lease holder) is recorded with the server,
    so that the run's teardown finds it from the host alone (:func:`run_servers`);
    ``lease_dir`` overrides the machine-wide directory (tests).
    """
    if isinstance(host, str):
        host = get_host(host)
    recipe = _with_port(recipe, port)
    ref = ref or prov.ref or recipe.engine.ref
    try:
        machine, uid = machine_dir(host, lease_dir)
    except LeaseError as exc:
        raise ServerError(f"cannot record a server on {host.name}: {exc}") from exc
    for rec in _records_in(host, servers_dir, machine):
        if rec.state in _OURS:
            by = f"started by {rec.owner}" + (f" for {rec.run}" if rec.run else "")
            raise ServerAlreadyRunning(
                f"a previous server of ours is still alive on {host.name}: PID {rec.pid} "
                f"({rec.run_dir}, {by}); stop it first"
            )
    _check_gpus_free(host)
    s = recipe.serve
    if check_port and (who := port_holder(host, s.host, s.port)):
        raise PortInUse(f"port {s.port} on {host.name} is already in use ({who})")

    overridden = {
        k: v for k, v in s.env.items() if k in NO_TELEMETRY_ENV and v != NO_TELEMETRY_ENV[k]
    }
    if overridden:
        # The recipe's env is applied after the launcher's exports, so it could switch the
        # opt-outs back on: refused, nothing launched.
        raise ServerError(
            f"recipe {recipe.id} sets {overridden} in serve.env: the usage-stats opt-outs "
            f"{sorted(NO_TELEMETRY_ENV)} stay on for every server speedmatrix starts"
        )
    key = _api_key_value(recipe, api_key)
    is_sim = recipe.engine.install.kind == "sim"
    key_var = s.api_key_secret or DEFAULT_API_KEY_ENV
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_var):
        # it is written unquoted after `export` (a name cannot be quoted): the loader refuses
        # such a recipe already; refused here too, so no path around the loader runs it
        raise ServerError(f"serve.api_key_secret {key_var!r} is not a variable name")
    python = prov.python
    include = prov.include_dir or "include"
    if key is None:
        line = recipe.render_launch_command(ref, api_key="omit", python=python, include=include)
    elif is_sim:
        line = recipe.render_launch_command(
            ref, api_key=f'"${key_var}"', python=python, include=include
        )
    else:
        # vLLM reads VLLM_API_KEY: the key stays out of the process list.
        line = recipe.render_launch_command(ref, api_key="omit", python=python, include=include)
    shown = recipe.render_launch_command(ref, api_key="redact", python=python, include=include)

    run_dir = f"{host.resolve(servers_dir)}/{s.port}"
    host.run(f"rm -rf {_q(run_dir)} && mkdir -p {_q(run_dir)}", 60, check=True, idempotent=True)
    secrets = ""
    if key is not None:
        secrets = f"export {key_var}={_q(key)}\nexport {_PROBE_KEY_VAR}={_q(key)}\n" + (
            "" if is_sim else f"export VLLM_API_KEY={_q(key)}\n"
        )
    host.put_text(secrets, f"{run_dir}/secrets.env", mode=0o600)
    host.put_text(shown + "\n", f"{run_dir}/command.txt", mode=0o644)
    if run:
        host.put_text(run + "\n", f"{run_dir}/run", mode=0o644)
    host.put_text(
        "#!/bin/bash\n"
        "# Written by speedmatrix.engine.vllm_server: the recipe's launch command, secrets from secrets.env.\n"
        f"set -a; . {_q(run_dir + '/secrets.env')}; set +a\n"
        f"unset {_PROBE_KEY_VAR}\n"
        "# No usage stats, no telemetry: the server contacts nothing but loopback.\n"
        + "".join(f"export {k}={_q(v)}\n" for k, v in NO_TELEMETRY_ENV.items())
        + f"exec {line}\n",
        f"{run_dir}/launch.sh",
        mode=0o700,
    )
    log_path = f"{run_dir}/server.log"
    pid_path = f"{run_dir}/pid"
    # The registry entry, machine-wide and readable by every user (see the module docstring):
    # written by the launcher itself, so it exists as soon as the server does.
    entry = f"{machine}/server.{uid}.{s.port}"
    tmp = f"{machine}/.tmp.server.{uid}.{s.port}"
    register = (
        f'( umask 022; printf \'%s\\n\' "$$" "${{i:-}}" {_q(run_dir)} {_q(run or "")} '
        f"> {_q(tmp)} ) 2>/dev/null && mv -f {_q(tmp)} {_q(entry)} 2>/dev/null; "
    )
    launcher = f"{_RECORD_IDENTITY}echo $$ > {_q(pid_path)}; {register}exec bash ./launch.sh"
    host.run(
        # The subshell's own output is redirected too: nothing keeps this command's pipes open.
        f"(cd {_q(run_dir)} && exec setsid bash -c {_q(launcher)}"
        f") > {_q(log_path)} 2>&1 < /dev/null &",
        timeout_s=60,
        check=True,
    )
    pid = 0
    identity = None
    for _ in range(50):
        res = host.run(
            f"cat {_q(pid_path)} 2>/dev/null && cat {_q(run_dir + '/pid.identity')} 2>/dev/null",
            30,
            idempotent=True,
            stream=False,
        )
        lines = res.stdout.splitlines()
        if lines and lines[0].strip().isdigit():
            pid = int(lines[0].strip())
            identity = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
            break
        time.sleep(0.1)
    if not pid:
        raise ServerError(f"the server on {host.name} did not record its PID in {pid_path}")
    handle = ServerHandle(
        host=host.name,
        host_env=dict(host.env),
        pid=pid,
        run_dir=run_dir,
        log_path=log_path,
        base_url=f"http://{_probe_host(s.host)}:{s.port}",
        port=s.port,
        served_name=recipe.model.served_name,
        python=python,
        api_key_env=key_var if key is not None else None,
        command=shown,
        started_at=time.time(),
        identity=identity,
        run=run,
        record=entry,
    )
    log.info("%s: started server PID %d: %s", host.name, pid, shown)
    if wait:
        try:
            wait_ready(handle, ready_timeout_s or s.ready_timeout_s, host=host)
        except BaseException:
            stop_server(handle, host=host)
            raise
    return handle


# ---------------------------------------------------------------------------- readiness
_PROBE_PY = r"""
import json, os, sys, urllib.request, urllib.error
base, model = sys.argv[1], sys.argv[2]
key = os.environ.get("SPEEDMATRIX_PROBE_KEY")
def call(path, body=None, auth=False, timeout=10.0):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    if auth and key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except Exception as e:
        return None, type(e).__name__ + ": " + str(e)
out = {}
out["health"] = call("/health")[0]
if out["health"] == 200:
    st, txt = call("/version")
    out["version"], out["version_status"], out["version_error"] = None, st, None
    try:
        data = json.loads(txt) if st == 200 else None
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("version"), str) and data["version"].strip():
        out["version"] = data["version"]
    elif st is not None:
        out["version_error"] = "HTTP %s: %s" % (st, " ".join(txt.split())[:200] or "(empty body)")
    st, txt = call("/v1/models", auth=True)
    try:
        out["models"] = [m.get("id") for m in json.loads(txt).get("data", [])] if st == 200 else []
    except Exception:
        out["models"] = []
    out["models_status"] = st
    if model in out["models"]:
        st, txt = call(
            "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 1}, auth=True,
            timeout=float(sys.argv[3]),
        )
        out["completion"] = st
        out["completion_error"] = None if st == 200 else txt[-300:]
print(json.dumps(out))
"""


def _probe(host: Host, handle: ServerHandle, timeout_s: float = 120) -> dict:
    """The four readiness checks, run on the host; ``timeout_s`` bounds the completion (the
    first request on a cold server can be slow), 10 s each of the others."""
    res = host.run(
        f"set -a; . {_q(handle.run_dir + '/secrets.env')} 2>/dev/null; set +a; "
        f"{_q(handle.python)} -c {_q(_PROBE_PY)} {_q(handle.base_url)} "
        f"{_q(handle.served_name)} {timeout_s:g}",
        timeout_s=timeout_s + 60,
        idempotent=True,
        stream=False,
    )
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"probe_error": res.tail(5)}


def is_alive(host: Host, handle: ServerHandle) -> bool:
    """Whether the handle's process group is alive and still ours (:func:`server_state`)."""
    return server_state(host, handle) in _OURS


def log_tail(host: Host, handle: ServerHandle, lines: int = 40) -> str:
    res = host.run(
        f"tail -n {lines} {_q(handle.log_path)}", timeout_s=60, idempotent=True, stream=False
    )
    return res.stdout.rstrip()


def _read_log(host: Host, handle: ServerHandle, max_bytes: int = 2_000_000) -> str:
    res = host.run(
        f"tail -c {max_bytes} {_q(handle.log_path)}", timeout_s=120, idempotent=True, stream=False
    )
    return res.stdout


def _failure(host: Host, handle: ServerHandle, what: str) -> ServerError:
    text = _read_log(host, handle)
    tail = "\n".join(text.rstrip().splitlines()[-40:])
    return ServerError(what, diagnose(text), tail, handle.log_path)


def wait_ready(
    handle: ServerHandle,
    timeout_s: float = 3600,
    *,
    host: Host | None = None,
    poll_s: float = 2.0,
) -> ServerHandle:
    """Block until the server passes all four readiness checks; raise ServerError otherwise.

    Ends early (with the diagnosis) as soon as the server's process group is gone, its log has
    a line that is fatal by itself (``diagnose(..., fatal_only=True)``: a hang is diagnosed at
    the timeout, not on sight), or an answer says waiting cannot help (:func:`_not_ready`).
    """
    host = host or handle.get_host()
    deadline = time.monotonic() + timeout_s
    last: dict = {}
    while True:
        if not is_alive(host, handle):
            raise _failure(host, handle, f"the server on {host.name} exited before it was ready")
        # A line that is fatal by itself ends the wait at once, even while the process
        # lingers. Only those: a hang-like line (NCCL) is the timeout's diagnosis, below.
        recent = host.run(
            f"tail -c 200000 {_q(handle.log_path)}", timeout_s=60, idempotent=True, stream=False
        ).stdout
        if diagnose(recent, fatal_only=True).code != "unknown":
            raise _failure(host, handle, f"the server on {host.name} failed while starting")
        last = _probe(host, handle)
        if last.get("health") == 200 and last.get("version_error"):
            # Up, yet /version is not vLLM's answer (a JSON object with a "version" string):
            # whatever serves the port is not the engine the recipe names. Waiting won't help.
            raise _failure(
                host,
                handle,
                f"the server on {host.name} answers /health but not /version as vLLM does "
                f'(a JSON object with a "version" string); it answered {last["version_error"]}',
            )
        missing, final = _not_ready(last, handle.served_name)
        if missing is None:
            handle.ready_s = round(time.time() - handle.started_at, 2)
            handle.facts["version"] = last["version"]
            log.info("%s: server ready after %.1f s", host.name, handle.ready_s)
            return handle
        if final:
            raise _failure(host, handle, f"the server on {host.name} is up but {missing}")
        if time.monotonic() > deadline:
            raise _failure(
                host,
                handle,
                f"the server on {host.name} was not ready within {timeout_s:g} s: {missing} "
                f"(last probe: {json.dumps(last)[:300]})",
            )
        time.sleep(poll_s)


def _not_ready(probe: dict, served: str) -> tuple[str | None, bool]:
    """What the probe says is still missing (None: ready), and whether waiting cannot help.

    Final (the start fails at once): ``/v1/models`` refusing the key, or listing models but not
    the served name (the engine serves under another name: the recipe's ``served_name`` and the
    engine's ``--served-model-name`` differ), or the one-token completion refused with a client
    error (4xx but 408/429: the request will not become acceptable). Not final, until the
    ready timeout: no answer yet, a 5xx, an empty model list (still loading).
    """
    if "probe_error" in probe:
        return f"the readiness probe failed on the host: {probe['probe_error']}", False
    if probe.get("health") != 200:
        return f"/health answered {probe.get('health') or 'nothing (no connection)'}", False
    if not probe.get("version"):
        return "/version did not answer", False
    models, st = probe.get("models") or [], probe.get("models_status")
    if served not in models:
        if st in (401, 403):
            return f"/v1/models refused the API key (HTTP {st})", True
        if st == 200 and models:
            return f"/v1/models does not list the served name {served!r} (it lists {models})", True
        return f"/v1/models does not list {served!r} yet (HTTP {st}, models {models})", False
    st = probe.get("completion")
    if st == 200:
        return None, False
    why = " ".join(str(probe.get("completion_error") or "").split())[:300] or "(empty body)"
    if st is not None and 400 <= st < 500 and st not in (408, 429):
        return f"the one-token completion was refused: HTTP {st}: {why}", True
    return f"the one-token completion failed: HTTP {st or 'no answer'}: {why}", False


# ---------------------------------------------------------------------------- inspect
_KV_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(.*)\}\s", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

_METRICS_PY = r"""
import os, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/metrics")
key = os.environ.get("SPEEDMATRIX_PROBE_KEY")
if key:
    req.add_header("Authorization", "Bearer " + key)
print(urllib.request.urlopen(req, timeout=30).read().decode("utf-8", "replace"))
"""

_HW_CPU = (
    "echo cpu_model=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'); "
    "echo cpu_count=$(nproc); "
    "echo mem_total_kb=$(grep -m1 MemTotal /proc/meminfo | awk '{print $2}')"
)
_HW_GPU = "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"


def parse_cache_config(metrics_text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (empty when the metric is absent)."""
    m = _CACHE_INFO.search(metrics_text)
    return dict(_LABEL.findall(m.group(1))) if m else {}


def kv_tokens_from_log(log_text: str) -> int | None:
    """The last ``… KV cache size: N tokens`` start-up line's N."""
    found = _KV_LOG.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def inspect_server(handle: ServerHandle, *, host: Host | None = None) -> dict:
    """Version and commit, KV capacity, block size, max-model-len, and the hardware facts.

    KV capacity comes from ``vllm:cache_config_info`` (``kv_cache_size_tokens``, else
    ``num_gpu_blocks * block_size``), else from the start-up log line. Both are reported
    (``kv_cache_tokens_metrics`` / ``kv_cache_tokens_log``) so they can be cross-checked.
    """
    host = host or handle.get_host()
    facts: dict = {}
    probe = _probe(host, handle)
    facts["version"] = probe.get("version")
    res = host.run(
        f"set -a; . {_q(handle.run_dir + '/secrets.env')} 2>/dev/null; set +a; "
        f"{_q(handle.python)} -c {_q(_METRICS_PY)} {_q(handle.base_url)}",
        timeout_s=90,
        idempotent=True,
        stream=False,
    )
    cache = parse_cache_config(res.stdout) if res.rc == 0 else {}
    kv_metrics = None
    if cache.get("kv_cache_size_tokens", "").isdigit():
        kv_metrics = int(cache["kv_cache_size_tokens"])
    elif cache.get("num_gpu_blocks", "").isdigit() and cache.get("block_size", "").isdigit():
        kv_metrics = int(cache["num_gpu_blocks"]) * int(cache["block_size"])
    log_text = _read_log(host, handle)
    kv_log = kv_tokens_from_log(log_text)
    facts["kv_cache_tokens_metrics"] = kv_metrics
    facts["kv_cache_tokens_log"] = kv_log
    facts["kv_cache_tokens"] = kv_metrics if kv_metrics is not None else kv_log
    facts["block_size"] = (
        int(cache["block_size"]) if cache.get("block_size", "").isdigit() else None
    )
    facts["num_gpu_blocks"] = (
        int(cache["num_gpu_blocks"]) if cache.get("num_gpu_blocks", "").isdigit() else None
    )
    # max-model-len: /v1/models reports it per model.
    mm = host.run(
        f"set -a; . {_q(handle.run_dir + '/secrets.env')} 2>/dev/null; set +a; "
        f"{_q(handle.python)} -c {_q(_MODELS_PY)} {_q(handle.base_url)} {_q(handle.served_name)}",
        timeout_s=90,
        idempotent=True,
        stream=False,
    )
    mml = mm.stdout.strip().splitlines()[-1] if mm.stdout.strip() else ""
    facts["max_model_len"] = int(mml) if mml.isdigit() else None
    # The commit: vLLM's own metadata when the build recorded one.
    commit = host.run(
        f"{_q(handle.python)} -c 'from vllm._version import __commit_id__ as c; print(c or \"\")'",
        timeout_s=120,
        idempotent=True,
        stream=False,
    )
    facts["commit"] = commit.stdout.strip() or None if commit.rc == 0 else None
    facts["hardware"] = hardware_facts(host)
    handle.facts.update(facts)
    return facts


_MODELS_PY = r"""
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/models")
key = os.environ.get("SPEEDMATRIX_PROBE_KEY")
if key:
    req.add_header("Authorization", "Bearer " + key)
data = json.loads(urllib.request.urlopen(req, timeout=30).read())
for m in data.get("data", []):
    if m.get("id") == sys.argv[2] and m.get("max_model_len"):
        print(m["max_model_len"])
"""


def hardware_facts(host: Host) -> dict:
    """GPU name / memory / driver from nvidia-smi on GPU hosts; CPU model and memory else."""
    gpu = host.run(
        f"command -v nvidia-smi >/dev/null && {_HW_GPU}",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    facts: dict = {}
    if gpu.rc == 0 and gpu.stdout.strip():
        gpus = []
        for line in gpu.stdout.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3:
                mib = re.fullmatch(r"(\d+)\s*MiB", parts[1])
                gpus.append(
                    {
                        "name": parts[0],
                        "memory_total": parts[1],  # as nvidia-smi says it, e.g. "97887 MiB"
                        "memory_total_mib": int(mib.group(1)) if mib else None,
                        "driver": parts[2],
                    }
                )
        facts["gpus"] = gpus
        facts["gpu_count"] = len(gpus)
    cpu = host.run(_HW_CPU, timeout_s=60, idempotent=True, stream=False)
    for line in cpu.stdout.splitlines():
        k, _, v = line.partition("=")
        facts[k] = int(v) if v.isdigit() else v
    if "mem_total_kb" in facts:
        facts["mem_total_gb"] = round(facts["mem_total_kb"] / 1024 / 1024, 1)
    return facts


# ---------------------------------------------------------------------------- stop
def group_pids(host: Host, pgid: int) -> list[int]:
    """Processes still in process group ``pgid`` on the host."""
    res = host.run(
        f"ps -eo pid=,pgid= | awk '$2 == {int(pgid)} {{print $1}}'",
        timeout_s=30,
        idempotent=True,
        stream=False,
    )
    return [int(x) for x in res.stdout.split() if x.isdigit()]


_NO_NVIDIA_SMI = "speedmatrix:no-nvidia-smi"
# What stop_server asks the driver: one line per GPU compute process ("pid, name, memory").
GPU_APPS_QUERY = (
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader"
)


def gpu_compute_apps(host: Host) -> tuple[str, list[dict]]:
    """The GPU compute processes nvidia-smi lists on the host, and how the question went.

    Returns ``("absent", [])`` on a host without nvidia-smi (a CPU host: nothing to check),
    ``("ok", apps)`` with one ``{"pid", "name", "memory"}`` per process, or
    ``("failed: <why>", [])`` when nvidia-smi is there but does not answer (driver gone, GPU
    fallen off the bus): the caller must not read that as "no GPU process left".
    """
    res = host.run(
        f"command -v nvidia-smi >/dev/null 2>&1 || {{ echo {_NO_NVIDIA_SMI}; exit 0; }}; "
        f"{GPU_APPS_QUERY}",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    if res.rc == 0 and res.stdout.strip() == _NO_NVIDIA_SMI:
        return "absent", []
    if res.rc != 0:
        why = " ".join(res.tail(5).split())[:300] or "no output"
        return f"failed: nvidia-smi exited with code {res.rc}: {why}", []
    apps = []
    for line in res.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit():
            apps.append(
                {
                    "pid": int(parts[0]),
                    "name": parts[1] if len(parts) > 1 else "",
                    "memory": parts[2] if len(parts) > 2 else "",
                }
            )
    return "ok", apps


def _check_gpus_free(host: Host) -> None:
    """Refuse a start while a GPU compute process runs (see the module docstring)."""
    status, apps = gpu_compute_apps(host)
    if status == "absent":
        log.info("%s: no nvidia-smi on the host: no GPU to check before the start", host.name)
    elif status != "ok":
        # No driver answering: no process can hold a GPU either; the engine's own start says
        # whether it gets one.
        log.warning("%s: could not check the GPUs before the start (%s)", host.name, status)
    elif apps:
        shown = ", ".join(f"PID {a['pid']} ({a['name']}, {a['memory']})" for a in apps)
        raise GpuBusy(
            f"the GPUs of {host.name} are busy: nvidia-smi lists compute processes that are "
            f"not of this run: {shown}; a benchmark beside them would share the GPUs. Nothing "
            "was started: stop them or wait for them, then run again"
        )
    else:
        log.info("%s: nvidia-smi lists no GPU compute process: the GPUs are free", host.name)


def stop_server(
    handle: ServerHandle,
    *,
    host: Host | None = None,
    grace_s: float = 30.0,
    gpu_wait_s: float = 15.0,
) -> dict:
    """TERM the group, wait up to ``grace_s``, KILL the rest, verify nothing is left.

    Then, on a GPU host, ask nvidia-smi whether a process of ours (one seen in the group) still
    holds a GPU, for up to ``gpu_wait_s`` (the driver releases a killed process's context a
    moment after it exits). On a host without nvidia-smi that check is skipped; when nvidia-smi
    is there but fails, the result's ``gpu_check`` says so and a warning is logged (the GPUs
    could not be verified, which is not the same as verified free).

    Idempotent: a group already gone is fine. A PID that now belongs to another process (see
    the module docstring: PID reuse) is never signalled: ``gone`` says why the server is gone.
    Returns what happened (``killed`` and ``term_survivors`` tell that SIGTERM was not enough);
    raises ServerError when a process of the group survives SIGKILL or a GPU compute process of
    ours remains.
    """
    host = host or handle.get_host()
    pg = int(handle.pid)
    state = server_state(host, handle)
    gone = state.partition(": ")[2] if state.startswith("gone") else None
    before = [] if gone else group_pids(host, pg)
    ours = set() if gone else {*before, pg}
    outcome: dict = {
        "pid": pg,
        "was_running": bool(before),
        "gone": gone,
        "killed": False,
        "term_survivors": [],
        "left": [],
        "gpu_check": "",
        "gpu_left": [],
    }
    if gone:
        log.warning(
            "%s: server group %d is gone, %s; not signalled (nothing of that PID is ours)",
            host.name,
            pg,
            gone,
        )
    if before:
        host.run(f"kill -TERM -- -{pg} 2>/dev/null; true", timeout_s=30, idempotent=True)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_pids(host, pg):
            time.sleep(0.5)
        survivors = group_pids(host, pg)
        if survivors:
            ours.update(survivors)
            log.warning(
                "%s: server group %d still had PIDs %s %g s after SIGTERM: sending SIGKILL",
                host.name,
                pg,
                survivors,
                grace_s,
            )
            host.run(f"kill -KILL -- -{pg} 2>/dev/null; true", timeout_s=30, idempotent=True)
            outcome["killed"] = True
            outcome["term_survivors"] = survivors
            for _ in range(20):
                if not group_pids(host, pg):
                    break
                time.sleep(0.5)
    left = group_pids(host, pg) if not gone else []
    outcome["left"] = left

    gpu_left: list[dict] = []
    deadline = time.monotonic() + gpu_wait_s
    while True:
        status, apps = gpu_compute_apps(host)
        gpu_left = [a for a in apps if a["pid"] in ours]
        if status != "ok" or not gpu_left or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if status == "absent":
        outcome["gpu_check"] = "skipped: no nvidia-smi on the host"
    elif status != "ok":
        outcome["gpu_check"] = status
        log.warning(
            "%s: could not check the GPUs after stopping server group %d (%s): "
            "a GPU compute process of ours may remain",
            host.name,
            pg,
            status,
        )
    else:
        outcome["gpu_check"] = "ok" if not gpu_left else "GPU compute processes of ours remain"
    outcome["gpu_left"] = [a["pid"] for a in gpu_left]

    # Only this server's key: a run dir whose pid file names another PID belongs to a newer
    # server on the same port (started after this one died), which still needs its key.
    host.run(
        f"p=$(cat {_q(handle.run_dir + '/pid')} 2>/dev/null); "
        f'if [ -z "$p" ] || [ "$p" = {pg} ]; then rm -f {_q(handle.run_dir + "/secrets.env")}; fi',
        timeout_s=30,
        idempotent=True,
    )
    if handle.record and not left:
        # the machine-wide entry, when it still names this server (and is ours to remove)
        host.run(
            f'if [ "$(head -n 1 {_q(handle.record)} 2>/dev/null)" = {pg} ]; then '
            f"rm -f {_q(handle.record)}; fi; true",
            timeout_s=30,
            idempotent=True,
            stream=False,
        )
    if left:
        raise ServerError(f"server group {pg} on {host.name} survived SIGKILL: PIDs {left}")
    if gpu_left:
        shown = ", ".join(f"PID {a['pid']} ({a['name']}, {a['memory']})" for a in gpu_left)
        raise ServerError(
            f"server group {pg} on {host.name} is stopped, but nvidia-smi still lists GPU "
            f"compute processes of ours {gpu_wait_s:g} s later: {shown}; their GPU memory is "
            "not free for the next server"
        )
    log.info("%s: server group %d stopped (%s)", host.name, pg, outcome)
    return outcome
