"""One benchmark per machine: a lease kept on the host itself, machine-wide.

Why on the host: Airflow pools and `max_active_tis_per_dagrun` cap tasks running at one moment,
not the span from server start to server stop, and `max_active_runs` would serialise every host.
A lease file on the machine being measured is seen by every worker, every scheduler and every
SSH connection id that points at that machine.

Why machine-wide, not under $HOME: the GPUs are the machine's. Two runs with a different
`host_home`, or two SSH users of one box, must see one lease. It lives in one directory every
user of the tool shares (:data:`MACHINE_DIR`, ``/var/tmp/speedmatrix``): /var/tmp is sticky
1777 on every Linux and shared by all users' sessions. (/dev/shm loses a user's files when
logind's RemoveIPC runs at their logout; /tmp is often a per-service or per-user namespace;
/run/lock is 1777 on Debian/Ubuntu only.) /var/tmp survives a reboot, the runs and servers do
not: every record carries the kernel's boot id, and a record of another boot is void at once.
The first user makes the directory sticky 1777: anyone may add a record, no one may remove or
rewrite another user's. Each user writes a record file of its own (``holder.<uid>``, 0644,
readable by all); the lease's holder is the record with the latest expiry, so a second user
reads the holder, takes the lease once it expired (its own record beside the stale one), and
cannot remove a live one. Where /var/tmp is not shared (pam_namespace, PrivateTmp), the host
names another directory in its own environment (``SPEEDMATRIX_LEASE_DIR``: sshd's SetEnv or
/etc/environment, machine-wide, never per user), and the deployment's ``SPEEDMATRIX_LEASE_DIR``
(the Airflow workers' env) is the default for hosts that do not say.

How: one small bash script per operation, run through `Host.run`, holding `flock` on
`<dir>/lock` while it reads the records and rewrites its own (one line: holder, expiry,
taken-at, all epoch seconds of the host's own clock, so worker clocks never matter, then the
boot id). Taking is atomic; a lease past its expiry is free to take (its holder died);
renewing or releasing a lease someone else now holds is refused and said so. The run renews the
lease while its tasks work (a background thread, `Renewer`), the host itself extends it while
the run's server lives (between tasks too: `keep_while_group`), and the teardown releases it; a
run that disappears with its server stops renewing and its lease expires after `ttl_s`.
"""

from __future__ import annotations

import logging
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from speedmatrix.engine.hosts import Host
from speedmatrix.settings import settings

log = logging.getLogger("speedmatrix.lease")

MACHINE_DIR = "/var/tmp/speedmatrix"
DIR_ENV = "SPEEDMATRIX_LEASE_DIR"
_SAFE = re.compile(r"[^A-Za-z0-9._:+@=/~-]")
HOLDER_MAX = 200  # a holder id's length at most (holder_id cuts a longer one)

# sm_machine_dir EXPLICIT DEFAULT: sets $d to the machine-wide directory (EXPLICIT when given,
# else the host's own $SPEEDMATRIX_LEASE_DIR, else DEFAULT, the deployment's), made sticky
# 1777 by whoever makes it; fails, saying why, when this user cannot write there.
MACHINE_DIR_SH = r"""
sm_machine_dir() {
  d=${1:-${SPEEDMATRIX_LEASE_DIR:-$2}}
  if [ ! -d "$d" ]; then
    mkdir -p -m 1777 -- "$d" 2>/dev/null || [ -d "$d" ] || {
      echo "cannot create the machine-wide lease directory $d as $(id -un)" >&2; return 1; }
  fi
  if [ ! -w "$d" ] || [ ! -x "$d" ]; then
    echo "the machine-wide lease directory $d is not writable by $(id -un): every user of" \
      "speedmatrix on this host must share it (chmod 1777 $d), or set SPEEDMATRIX_LEASE_DIR" \
      "to a directory they all may write" >&2
    return 1
  fi
}
"""

# $1 op, $2 explicit dir ("" for the machine-wide one), $3 the deployment's default dir,
# $4 holder, $5 ttl, $6 (acquire) the PID on this host whose life is the holder's, or "-",
# $7 (acquire) the holder's origin (where its run can be looked up), or "-", $8 (acquire) a
# holder the caller proved gone (its run has ended or no longer exists), or "-".
# Prints one status line: WORD holder expiry now [previous-holder previous-expiry gone-holder
# holder-origin].
_SCRIPT = (
    MACHINE_DIR_SH
    + r"""
set -u
op=$1; me=$4; ttl=$5; owner=${6:--}; origin=${7:--}; void=${8:--}
sm_machine_dir "$2" "$3" || { echo "LOCKFAIL - 0 0"; exit 3; }
# the lock file is read-only for all but its maker: flock needs no write access
[ -e "$d/lock" ] || ( umask 022; : >> "$d/lock" ) 2>/dev/null
exec 9< "$d/lock" || { echo "LOCKFAIL - 0 0"; exit 3; }
flock -w 60 9 || { echo "LOCKFAIL - 0 0"; exit 3; }
now=$(date +%s)
boot=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null || true)
uid=$(id -u)
mine="$d/holder.$uid"
# A holder taken by one process of this host (`speedmatrix run`, dag.test) recorded that
# process (owner.<holder>: PID, its start time, boot id); once it no longer runs, the holder is
# provably gone and its record void, whatever its expiry.
owner_file() { printf '%s/owner.%s' "$d" "$(printf %s "$1" | tr -c 'A-Za-z0-9._-' '_')"; }
# A holder's origin (origin.<holder>): a token naming the deployment whose run it is, so that a
# run of the same deployment can look the holder's run up and prove it gone.
origin_file() { printf '%s/origin.%s' "$d" "$(printf %s "$1" | tr -c 'A-Za-z0-9._-' '_')"; }
origin_of() { o=""; [ -s "$(origin_file "$1")" ] && read -r o < "$(origin_file "$1")"; printf %s "${o:--}"; }
started() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20; }
# Gone only on positive evidence, recorded in $seen: its PID runs another process (a start
# time other than the recorded one), or the kernel says no such process. A /proc that does not
# show it (hidepid, another user's) is no proof: kill -0 then says EPERM, and it is kept.
seen=""
owner_gone() {
  o=$(owner_file "$1"); [ -s "$o" ] || return 1
  op_=""; os_=""; ob_=""; read -r op_ os_ ob_ < "$o" || true
  [ -n "$op_" ] && [ "$ob_" = "$boot" ] || return 1
  st=$(started "$op_")
  if [ -n "$st" ]; then
    [ "$st" != "$os_" ] || return 1
    seen="reused:$op_:$st:$os_"; return 0
  fi
  err=$( (export LC_ALL=C; kill -0 "$op_") 2>&1 ) && return 1
  case "$err" in *"No such process"*) seen="nosuch:$op_"; return 0 ;; esac
  return 1
}
# The holder: the record with the latest expiry, among those of this boot.
holder=""; exp=0; from=""; gone=""
for f in "$d"/holder.*; do
  [ -f "$f" ] && [ -s "$f" ] || continue
  h=""; e=0; b=""
  read -r h e _ b < "$f" || true
  case "$e" in ''|*[!0-9]*) e=0 ;; esac
  [ -n "$h" ] || continue
  if [ -n "$b" ] && [ -n "$boot" ] && [ "$b" != "$boot" ]; then continue; fi
  if [ "$h" != "$me" ] && [ "$e" -gt "$now" ] && owner_gone "$h"; then gone=$h; continue; fi
  if [ "$op" = acquire ] && [ "$h" = "$void" ] && [ "$h" != "$me" ]; then gone=$h; continue; fi
  if [ "$e" -gt "$exp" ] || [ -z "$holder" ]; then holder=$h; exp=$e; from=$f; fi
done
live=0
if [ -n "$holder" ] && [ "$exp" -gt "$now" ]; then live=1; fi
write() {
  ( umask 022; printf '%s %s %s %s\n' "$me" $((now + ttl)) "$now" "$boot" > "$d/.tmp.holder.$uid" ) &&
    mv -f "$d/.tmp.holder.$uid" "$mine"
}
case "$op" in
  acquire)
    if [ $live -eq 0 ] || [ "$holder" = "$me" ]; then
      if [ "$owner" != "-" ] && [ -n "$(started "$owner")" ]; then
        ( umask 022; printf '%s %s %s\n' "$owner" "$(started "$owner")" "$boot" > "$(owner_file "$me")" )
      fi
      if [ "$origin" != "-" ]; then ( umask 022; printf '%s\n' "$origin" > "$(origin_file "$me")" ); fi
      write && echo "ACQUIRED $me $((now + ttl)) $now ${holder:--} $exp ${gone:--} - ${seen:--}"
    else echo "HELD $holder $exp $now - - - $(origin_of "$holder")"; fi ;;
  renew)
    if [ "$holder" = "$me" ] && [ $live -eq 1 ]; then write && echo "RENEWED $me $((now + ttl)) $now"
    elif [ $live -eq 0 ]; then write && echo "RETAKEN $me $((now + ttl)) $now"
    else echo "LOST $holder $exp $now"; fi ;;
  release)
    if [ "$holder" = "$me" ] && [ "$from" = "$mine" ]; then
      rm -f "$mine" "$(owner_file "$me")" "$(origin_file "$me")" && echo "RELEASED $me 0 $now"
    elif [ "$holder" = "$me" ]; then
      echo "the lease of $me is recorded by another user ($from); not released by $(id -un)" >&2
      echo "NOTMINE $holder $exp $now"
    elif [ $live -eq 0 ]; then echo "FREE ${holder:--} $exp $now"
    else echo "NOTMINE $holder $exp $now"; fi ;;
  extend)
    if [ "$holder" = "$me" ] && [ $live -eq 1 ]; then write && echo "RENEWED $me $((now + ttl)) $now"
    else echo "GONE ${holder:--} $exp $now"; exit 4; fi ;;
  show) echo "SHOW ${holder:--} $exp $now" ;;
esac
"""
)

# Detached on the host by `keep_while_group`: $1 the script above, $2 pgid, $3 interval, then
# the script's arguments after the op (explicit dir, default dir, holder, ttl). Extends (never retakes) the lease every interval while the
# group lives; looks at the group every second or so, so it ends soon after the group is gone
# (or as soon as the lease is no longer this holder's: released, or taken over).
_KEEPER = r"""
script=$1; pg=$2; every=$3; shift 3
look=$(awk -v e="$every" 'BEGIN { print (e < 1 ? e : 1) }')
next=0
while kill -0 -- "-$pg" 2>/dev/null; do
  now=$(date +%s%N)
  if [ "$now" -ge "$next" ]; then
    bash -c "$script" lease extend "$@" > /dev/null 2>&1 || exit 0
    next=$(awk -v n="$now" -v e="$every" 'BEGIN { printf "%d", n + e * 1e9 }')
  fi
  sleep "$look"
done
"""


class LeaseError(RuntimeError):
    """The lease could not be read or written on the host."""


class LeaseLost(LeaseError):
    """Another run holds the lease this run thought it held."""


@dataclass(frozen=True)
class LeaseState:
    """The host's answer: what happened and who holds the lease until when (host clock)."""

    status: str
    holder: str | None
    expires_at: int
    host_now: int
    gone: str | None = None  # a holder provably gone, whose lease was taken over
    origin: str | None = None  # HELD: the holder's origin, when it recorded one
    why: str | None = None  # why `gone` is provably gone

    @property
    def seconds_left(self) -> int:
        return max(0, self.expires_at - self.host_now)


def _seen_text(seen: str) -> str | None:
    """What the host saw of a holder it judged gone (the script's `seen`), as a sentence."""
    kind, _, rest = seen.partition(":")
    if kind == "nosuch":
        return f"no process {rest} on the host (kill -0: no such process)"
    if kind == "reused":
        pid, now_started, recorded = [*rest.split(":"), "", ""][:3]
        return (
            f"process {pid} is another one now (started at tick {now_started}, "
            f"the holder's at {recorded})"
        )
    return None


def _shell_path(path: str) -> str:
    """Quote a path for bash, leaving a leading $HOME to expand on the host."""
    if path.startswith("$HOME/"):
        return '"$HOME"/' + shlex.quote(path[len("$HOME/") :])
    return shlex.quote(path)


def deployment_dir() -> str:
    """The machine-wide directory a host uses when its own environment names none: the
    deployment's ``SPEEDMATRIX_LEASE_DIR`` (the workers' env), else :data:`MACHINE_DIR`."""
    return settings().lease_dir or MACHINE_DIR


def dir_args(lease_dir: str | None = None) -> str:
    """The two shell words :data:`MACHINE_DIR_SH` takes: an explicit directory (``''`` for
    the machine-wide one) and the deployment's default."""
    explicit = _shell_path(lease_dir) if lease_dir else "''"
    return f"{explicit} {shlex.quote(deployment_dir())}"


def machine_dir(host: Host, lease_dir: str | None = None) -> tuple[str, int]:
    """The machine-wide directory on ``host`` (made when missing) and the SSH user's uid."""
    res = host.run(
        MACHINE_DIR_SH + f'sm_machine_dir {dir_args(lease_dir)} && printf "%s\\n" "$d" "$(id -u)"',
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    lines = res.stdout.splitlines()
    if res.rc != 0 or len(lines) < 2 or not lines[1].isdigit():
        raise LeaseError(f"on {host.name}: {res.tail() or 'no machine-wide lease directory'}")
    return lines[0], int(lines[1])


def holder_id(*parts: str) -> str:
    """A holder name safe for the lease file: the run's identity, e.g. dag id + run id."""
    return _SAFE.sub("_", "/".join(p for p in parts if p))[:HOLDER_MAX]


class HostLease:
    """The lease of one host, as seen by one holder (a DAG run)."""

    def __init__(
        self,
        host: Host,
        holder: str,
        ttl_s: float | None = None,
        lease_dir: str | None = None,
        owner_pid: int | None = None,
        origin: str | None = None,
    ):
        """``ttl_s`` None: the deployment's (the ``lease_ttl_s`` setting, never a run's conf).
        ``lease_dir`` None: the machine-wide directory (see the module docstring).
        ``owner_pid``: the process on the host whose life is the holder's (one process runs the
        whole run: `speedmatrix run`, dag.test); once it is gone, the lease is void.
        ``origin``: a token naming where this holder's run can be looked up (an Airflow
        deployment), recorded with the lease: a later run of the same origin may look the
        holder up and take over once it proves the run gone (:meth:`try_acquire`)."""
        if not holder or _SAFE.search(holder):
            raise ValueError(f"holder must match [A-Za-z0-9._:+@=/~-]+, got {holder!r}")
        self.host = host
        self.holder = holder
        self.ttl_s = int(max(1, settings().lease_ttl_s if ttl_s is None else ttl_s))
        self.lease_dir = lease_dir
        self.owner_pid = owner_pid
        if origin is not None and (not origin or _SAFE.search(origin)):
            raise ValueError(f"origin must match [A-Za-z0-9._:+@=/~-]+, got {origin!r}")
        self.origin = origin

    def _call(self, op: str, void: str | None = None) -> LeaseState:
        cmd = " ".join(
            [
                "bash -c",
                shlex.quote(_SCRIPT),
                "lease",
                op,
                dir_args(self.lease_dir),
                shlex.quote(self.holder),
                str(self.ttl_s),
                str(int(self.owner_pid)) if self.owner_pid else "-",
                shlex.quote(self.origin) if self.origin else "-",
                shlex.quote(void) if void else "-",
            ]
        )
        # Every op is safe to repeat after a dropped connection: acquire is re-entrant (the
        # holder takes its own lease again), and the dropped attempt is ended first (hosts.py).
        res = self.host.run(cmd, timeout_s=90, idempotent=True, stream=False)
        lines = res.stdout.strip().splitlines()
        if res.rc != 0 or not lines:
            raise LeaseError(f"lease {op} on {self.host.name} failed (rc {res.rc}): {res.tail()}")
        fields = [*lines[-1].split(), *["-"] * 9]
        word, holder, expiry, now, _, _, gone, origin, seen = fields[:9]
        return LeaseState(
            word,
            None if holder == "-" else holder,
            int(expiry if expiry != "-" else 0),
            int(now if now != "-" else 0),
            None if gone == "-" else gone,
            None if origin == "-" else origin,
            _seen_text(seen) if gone != "-" else None,
        )

    def try_acquire(self, gone_why: Callable[[str], str | None] | None = None) -> LeaseState:
        """One attempt; `status` is ACQUIRED (ours now; also when ours already) or HELD.

        ``gone_why(holder)``: asked about a live holder of this lease's own origin (the same
        deployment, so its run is one the caller can look up); it returns why that holder is
        provably gone (its run ended or no longer exists), or None while it may still run. A
        holder proved gone is taken over at once instead of being waited out. Holders of
        another origin, or of none (a `speedmatrix run`), are never asked about: their runs
        cannot be looked up from here, and a run not found there is not a run gone."""
        state = self._call("acquire")
        if (
            state.status == "HELD"
            and gone_why is not None
            and self.origin is not None
            and state.holder
            and state.origin == self.origin
            and (why := gone_why(state.holder))
        ):
            voided = state.holder
            state = self._call("acquire", void=voided)
            if state.gone == voided:
                state = LeaseState(**{**state.__dict__, "why": why})
        if state.status == "ACQUIRED" and state.gone:
            log.warning(
                "lease on %s: its holder %s is gone (%s): taken over by %s",
                self.host.name,
                state.gone,
                state.why or "the process that held it no longer runs",
                self.holder,
            )
        elif state.status == "ACQUIRED":
            log.info("lease on %s taken by %s for %d s", self.host.name, self.holder, self.ttl_s)
        else:
            log.info(
                "lease on %s held by %s for %d s more",
                self.host.name,
                state.holder,
                state.seconds_left,
            )
        return state

    def acquire(self, wait_s: float, poll_s: float = 5.0) -> LeaseState:
        """Block until taken (for scripts and tests; the DAG waits in a rescheduling sensor)."""
        deadline = time.monotonic() + wait_s
        while True:
            state = self.try_acquire()
            if state.status == "ACQUIRED":
                return state
            if time.monotonic() >= deadline:
                raise LeaseError(
                    f"host {self.host.name} still leased by {state.holder} after {wait_s:g} s"
                )
            time.sleep(poll_s)

    def renew(self) -> LeaseState:
        """Push the expiry out by ttl_s. Raises LeaseLost when another run holds the lease."""
        state = self._call("renew")
        if state.status == "LOST":
            raise LeaseLost(
                f"lease on {self.host.name} is held by {state.holder}, not {self.holder}: this "
                "run's lease expired and was taken over; its results may be disturbed"
            )
        if state.status == "RETAKEN":
            log.warning("lease on %s had expired; retaken by %s", self.host.name, self.holder)
        return state

    def release(self) -> LeaseState:
        """Give the lease back; never removes another holder's lease."""
        state = self._call("release")
        if state.status == "NOTMINE":
            log.warning(
                "lease on %s is held by %s; not released by %s",
                self.host.name,
                state.holder,
                self.holder,
            )
        else:
            log.info("lease on %s released by %s (%s)", self.host.name, self.holder, state.status)
        return state

    def show(self) -> LeaseState:
        return self._call("show")

    def keep_while_group(self, pgid: int, interval_s: float | None = None) -> None:
        """Keep the lease extended *on the host* for as long as process group ``pgid`` (the
        run's server) lives.

        Why: the run's own renewals happen inside its tasks, and between two tasks (a cell
        queued behind other runs' tasks for longer than the TTL) nothing would renew, so
        another run could take a host whose server is still up. The server is what occupies
        the host, so its life is what the lease follows between tasks: a detached loop on the
        host extends the lease while the group is alive and stops by itself once the group is
        gone (then the lease expires after ``ttl_s``) or the lease is no longer this holder's.
        It only extends, never retakes: after the teardown's release it does nothing.
        """
        every = interval_s or max(1.0, self.ttl_s / 4)
        args = [
            shlex.quote(_KEEPER),
            "keeper",
            shlex.quote(_SCRIPT),
            str(int(pgid)),
            f"{every:g}",
            dir_args(self.lease_dir),
            shlex.quote(self.holder),
            str(self.ttl_s),
        ]
        self.host.run(
            f"(exec setsid bash -c {' '.join(args)}) > /dev/null 2>&1 < /dev/null &",
            timeout_s=60,
            check=True,
            stream=False,
        )
        log.info(
            "lease on %s kept by the host while server group %d lives (every %g s)",
            self.host.name,
            pgid,
            every,
        )

    def renewing(self, interval_s: float | None = None, *, renewed: bool = False) -> Renewer:
        """`with lease.renewing(): long_work()` keeps the lease fresh while the work runs.

        It renews on entry, unless the caller says it has just `renewed` (each cell renews before
        its health check, to fail before touching the server: renewing again at once would cost a
        host command per cell, an SSH round trip on a remote host, while the host waits)."""
        return Renewer(self, interval_s or max(1.0, self.ttl_s / 4), renewed=renewed)


class Renewer:
    """Renews a lease from a background thread while a task works; stops on exit.

    Give the lease its own `Host` object (a second `get_host(name)`), not the one the task runs
    its commands on: an SSH connection reset by one thread must not cut the other's command. A lost lease is logged and remembered in `lost` (the task decides
    what that means for its cell); renewal failures from a flaky connection are retried at the
    next interval.
    """

    def __init__(self, lease: HostLease, interval_s: float, *, renewed: bool = False):
        self.lease = lease
        self.interval_s = interval_s
        self.renewed = renewed
        self.lost: LeaseLost | None = None
        self._stop = threading.Event()
        # how the thread waits for its next renewal (True: stop): the stop event's timed wait;
        # a test drives it tick by tick instead of racing real seconds (tests/unit/test_lease.py)
        self.wait: Callable[[float], bool] = self._stop.wait
        self._thread = threading.Thread(target=self._loop, name="lease-renewer", daemon=True)

    def _loop(self) -> None:
        while not self.wait(self.interval_s):
            try:
                self.lease.renew()
            except LeaseLost as exc:
                self.lost = exc
                log.error("%s", exc)
                return
            except Exception as exc:  # keep trying: the next interval may reconnect
                log.warning("lease renewal on %s failed: %s", self.lease.host.name, exc)

    def __enter__(self) -> Renewer:
        if not self.renewed:
            self.lease.renew()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
