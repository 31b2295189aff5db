"""The bash every command runs under on a host, and the bash that ends one whose connection dropped.

One job: the command wrapper, shared by both transports. It tells "the total timeout fired"
from a command that exited 124 or 137 by itself, and (SSH) records the command's session so
that :data:`ENDER` can end it whole after its connection dropped or its idle timeout fired.
"""

from __future__ import annotations

import shlex

# Seconds between timeout's TERM and its KILL when the total timeout fires (`timeout -k`).
_KILL_AFTER_S = 10


# Where an SSH command records its session (relative to $HOME on the host, see the docstring).
CMD_DIR = ".speedmatrix/run/commands"


# How long a dropped or idle command gets between TERM and KILL.
END_GRACE_S = 2


# Every command runs as `bash -c _WRAPPER speedmatrix SCRIPT TOTAL MARKER REGFILE KILL_AFTER`.
# Why a wrapper: the exit code alone cannot say "the total timeout fired". coreutils `timeout`
# exits 124 then, or dies by its own SIGKILL (137) when the command outlived TERM by
# KILL_AFTER s; but a command can exit 124 itself, and one killed by the OOM killer reads 137
# too. `timeout --verbose` says "sending signal ..." on its own stderr exactly when it fires: the
# wrapper gives that stderr a pipe of its own (the command gets the real stderr back via fd 3),
# and only when timeout said something and exited 124/137 does it print MARKER, a line unique
# to this call. The command is never exec'd by the wrapper, so a command killed by a signal is
# reported as 128+N on both transports (bash's own "Killed" notice about it goes to /dev/null).
# REGFILE (SSH only; relative paths are under $HOME): where the wrapper, the leader of the
# command's session under `setsid`, records "<session id> <start time>" (created exclusively:
# if ENDER claimed it first, the connection dropped before the command started, and it does
# not start). Removed when the command ends.
_WRAPPER = r"""
r=$4
if [ -n "$r" ]; then
  case $r in /*) ;; *) r=$HOME/$r ;; esac
  mkdir -p "${r%/*}" 2>/dev/null
  read -r st < /proc/$$/stat; st=${st##*) }; f=($st)
  if ! (set -C; printf '%s %s\n' "$$" "${f[19]}" > "$r") 2>/dev/null; then
    if [ "$(cat "$r" 2>/dev/null)" = cancelled ]; then
      echo "speedmatrix-hosts: not started: its connection dropped first" >&2; exit 1
    fi
    r=
  fi
fi
if [ -z "$2" ]; then
  { bash -c "$1" 2>&3 3>&-; } 3>&2 2>/dev/null
  rc=$?
else
  exec 3>&2
  { m=$(timeout --verbose -k "$5" "$2" bash -c 'exec 2>&3 3>&-; exec bash -c "$1"' sm "$1" 2>&1 >&4 4>&-); } 4>&1
  rc=$?
  exec 3>&-
  [ -n "$m" ] && printf '%s\n' "$m" >&2
  case $rc in 124|137) [ -n "$m" ] && printf '\n%s\n' "$3" >&2 ;; esac
fi
[ -n "$r" ] && rm -f "$r"
exit $rc
"""


# Ends the command registered at $1 (see _WRAPPER) after its connection dropped or its idle
# timeout fired; $2 the grace in tenths of a second between TERM and KILL. Prints one word:
# NOTSTARTED (claimed before the command could start: it never will), GONE (already ended),
# TERM / KILL (ended by that signal), LEFT <pids> (still there after KILL, exit 1).
# The session is ours while its leader has the start time recorded or, the leader gone, while
# it has members (Linux hands out no PID that is still a session's id). Zombies are not counted.
ENDER = r"""
r=$1; case $r in /*) ;; *) r=$HOME/$r ;; esac
mkdir -p "${r%/*}" 2>/dev/null
if (set -C; echo cancelled > "$r") 2>/dev/null; then echo NOTSTARTED; exit 0; fi
read -r s st _ < "$r" 2>/dev/null
case $s in cancelled) echo NOTSTARTED; exit 0 ;; ''|*[!0-9]*) echo "UNREADABLE $r"; exit 3 ;; esac
if x=$(cat /proc/$s/stat 2>/dev/null); then
  x=${x##*) }; f=($x)
  if [ "${f[3]}" = "$s" ] && [ "${f[19]}" != "$st" ]; then rm -f "$r"; echo GONE; exit 0; fi
fi
members() { ps -eo pid=,sid=,stat= | awk -v s="$s" '$2 == s && $3 !~ /^Z/ {print $1}'; }
p=$(members)
if [ -z "$p" ]; then rm -f "$r"; echo GONE; exit 0; fi
kill -TERM $p 2>/dev/null
for i in $(seq "$2"); do
  sleep 0.1; p=$(members); if [ -z "$p" ]; then rm -f "$r"; echo TERM; exit 0; fi
done
for i in $(seq 20); do
  kill -KILL $p 2>/dev/null; sleep 0.1
  p=$(members); if [ -z "$p" ]; then rm -f "$r"; echo KILL; exit 0; fi
done
echo LEFT $p; exit 1
"""


ENDED = {
    "NOTSTARTED": "it had not started on the host, and will not",
    "GONE": "it had already ended on the host",
    "TERM": "it was ended on the host (SIGTERM to its session)",
    "KILL": "it was ended on the host (SIGKILL to its session, which outlived SIGTERM)",
}


def wrap_command(script: str, timeout_s: float | None, marker: str, reg: str = "") -> str:
    """The command line a transport runs: ``script`` under :data:`_WRAPPER`."""
    total = "" if timeout_s is None else str(max(1, int(timeout_s + 0.999)))
    args = (_WRAPPER, "speedmatrix", script, total, marker, reg, str(_KILL_AFTER_S))
    return "bash -c " + " ".join(shlex.quote(a) for a in args)
