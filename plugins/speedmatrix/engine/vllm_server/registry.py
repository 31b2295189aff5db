"""Which servers on a host are ours: their records, and whether a recorded group still is ours.

One job: the host's own records of the servers we started (the run dir's ``pid`` and
``pid.identity``, and the machine-wide registry entries in the lease's directory), read back
and judged against PID reuse (see the package docstring): a recorded PID that now belongs to
another process is "gone" and never signalled.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass

from speedmatrix.engine.hosts import Host
from speedmatrix.engine.lease import LeaseError, machine_dir
from speedmatrix.engine.vllm_server.contract import DEFAULT_SERVERS_DIR, ServerError, ServerHandle

log = logging.getLogger("speedmatrix.server")

# What the launcher runs first, in its own new session: its identity, then its PID (in that
# order, so a pid file that is there always has its identity beside it).
RECORD_IDENTITY = (
    "s=$(cat /proc/$$/stat 2>/dev/null) && { s=${s##*) }; set -- $s; "
    'i="${20} $(cat /proc/sys/kernel/random/boot_id 2>/dev/null)"; '
    'printf "%s\\n" "$i" > pid.identity; }; '
)


# sm_members PGID: the PIDs of process group PGID still running, one per line. A zombie
# (exited, not yet reaped by its parent or the host's init) is not one: see group_pids.
# sm_state PID IDENTITY: is the group recorded as PID (with that identity, or "" for a run dir
# without one) still our server? Prints "alive" (the leader is ours), "orphans" (the leader
# died, its group lives on), "dead", or "gone: <why>" (the PID is another process now).
_STATE_SH = r"""
sm_members() {
  ps -eo pid=,pgid=,stat= | awk -v g="$1" '$2 == g && $3 !~ /^Z/ {print $1}'
}
sm_state() {
  local p=$1 ident=$2 want_start want_boot now= boot s grp= zombie=
  [ -n "$(sm_members "$p")" ] && grp=1
  if [ -z "$ident" ]; then
    if [ -n "$grp" ]; then echo alive; else echo dead; fi
    return 0
  fi
  set -- $ident; want_start=$1; want_boot=$2
  if s=$(cat /proc/"$p"/stat 2>/dev/null); then
    s=${s##*) }; set -- $s; now=${20}; [ "$1" = Z ] && zombie=1
  fi
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
  if [ -n "$now" ] && [ -z "$zombie" ]; then echo alive
  elif [ -n "$grp" ]; then echo orphans
  else echo dead; fi
}
"""


OURS = ("alive", "orphans")


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
    return records_in(host, servers_dir, where)


def records_in(host: Host, servers_dir: str, where: str) -> list[ServerRecord]:
    """:func:`server_records` with the machine-wide directory already resolved."""
    res = host.run(
        f"bash -c {shlex.quote(_RECORDS_SH)} records {shlex.quote(host.resolve(servers_dir))} {shlex.quote(where)}",
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
        if rec.state in OURS:
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
        _STATE_SH + f"i={shlex.quote(handle.identity or '')}; "
        f'if [ -z "$i" ] && [ "$(cat {shlex.quote(d + "/pid")} 2>/dev/null)" = {pid} ]; then '
        f"i=$(cat {shlex.quote(d + '/pid.identity')} 2>/dev/null); fi; "
        f'sm_state {pid} "$i"',
        timeout_s=30,
        idempotent=True,
        stream=False,
    )
    state = res.last_line
    if res.rc != 0 or not (state in (*OURS, "dead") or state.startswith("gone: ")):
        raise ServerError(
            f"on {host.name}: cannot tell whether server group {pid} is ours: "
            f"{res.tail(5) or 'no answer'}"
        )
    return state


def is_alive(host: Host, handle: ServerHandle) -> bool:
    """Whether the handle's process group is alive and still ours (:func:`server_state`)."""
    return server_state(host, handle) in OURS


def group_pids(host: Host, pgid: int) -> list[int]:
    """Processes still running in process group ``pgid`` on the host (zombies excluded: an
    exited process holds no memory, port or GPU; it only waits for its parent, or the host's
    init once orphaned, to reap it. Measured here: this machine's init reaps ~2 s after the
    exit, so a stop that counted zombies would hold the host that long; on a host whose
    init never reaps, as in a container without one, the stop would fail as "survived
    SIGKILL")."""
    res = host.run(
        _STATE_SH + f"sm_members {int(pgid)}",
        timeout_s=30,
        idempotent=True,
        stream=False,
    )
    return [int(x) for x in res.stdout.split() if x.isdigit()]
