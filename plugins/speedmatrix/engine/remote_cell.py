"""One cell measured on a remote host: the shipped load generator zipapp run there with the
host's python, its record and request rows read back.

The protocol, in one place:

- the config becomes the zipapp's argv through :func:`speedmatrix.loadgen.cli.config_to_argv`,
  the parser's own flag table, so the host's load generator builds the config a local cell
  would have been given (tests/unit/test_remote_cell.py holds that);
- the API key never reaches a command line (`ps` shows those): it goes to a 0600 file under
  :data:`KEY_DIR`, which the command reads into :data:`KEY_ENV` and removes before the load
  generator starts; with no key the variable is unset, so a value in the host's environment
  is never sent;
- the load generator writes its record and rows to files in a private temporary directory
  (removed on exit); the command then prints them after the markers :data:`CELL_MARK` and
  :data:`REQUESTS_MARK` on stdout, with the load generator's own output sent to stderr, so
  nothing it prints can be taken for them;
- every value that reaches the shell is quoted (shlex): the paths, the python, every flag.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Any

from speedmatrix.engine.hosts import Host
from speedmatrix.loadgen import BurstConfig, CellConfig, DecodeConfig
from speedmatrix.loadgen.cli import config_to_argv
from speedmatrix.records import REQUEST_FIELDS, CellRecord, from_wire

CELL_MARK = "@@CELL@@"
REQUESTS_MARK = "@@REQUESTS@@"
KEY_ENV = "SPEEDMATRIX_API_KEY"
KEY_DIR = "$HOME/.speedmatrix/keys"
SLACK_S = 300.0
"""Beyond the cell's own first-token timeout and window: the idle waits, the prompts' set-up."""


class RemoteCellFailed(RuntimeError):
    """The load generator left no record (it exited non-zero, or printed none): the reason
    and its output's tail, for the cell's failed record."""


def cell_command(python: str, zipapp: str, argv: Sequence[str], key_path: str | None) -> str:
    """The shell command that runs one cell with the zipapp and prints its output framed by
    the markers; exits with the load generator's exit code."""
    if key_path:
        key = f'export {KEY_ENV}="$(cat {shlex.quote(key_path)})"; rm -f {shlex.quote(key_path)}; '
        argv = [*argv, "--api-key-env", KEY_ENV]
    else:
        key = f"unset {KEY_ENV}; "
    return (
        f"d=$(mktemp -d); trap 'rm -rf \"$d\"' EXIT; {key}"
        f"{shlex.quote(python)} {shlex.quote(zipapp)} {shlex.join(argv)} "
        '--json "$d/cell.json" --requests "$d/requests.jsonl" >&2; rc=$?; '
        f'echo {CELL_MARK}; cat "$d/cell.json" 2>/dev/null; echo; echo {REQUESTS_MARK}; '
        'cat "$d/requests.jsonl" 2>/dev/null; exit $rc'
    )


def read_cell_output(stdout: str, rc: int, tail: str) -> tuple[CellRecord, list[dict[str, Any]]]:
    """The record and rows the command printed after its markers (whatever a login shell
    printed before them is ignored); RemoteCellFailed when there is no record."""
    _, _, after = stdout.partition(CELL_MARK)
    cell_text, _, rows_text = after.partition(REQUESTS_MARK)
    if rc != 0 or not cell_text.strip():
        raise RemoteCellFailed(f"load generator exit {rc}: {tail}")
    record = from_wire(json.loads(cell_text))
    rows = [
        from_wire(json.loads(line), REQUEST_FIELDS)
        for line in rows_text.splitlines()
        if line.strip()
    ]
    return record, rows


def time_budget_s(cfg: CellConfig) -> float:
    """How long the command may take: the first-token timeout for every stream, the window
    (a burst's: its time limit), and SLACK_S."""
    concurrency = cfg.concurrency if isinstance(cfg, DecodeConfig | BurstConfig) else 1
    window = cfg.window_s if isinstance(cfg, DecodeConfig) else 0.0
    if isinstance(cfg, BurstConfig):  # no window: the burst's own limit
        window = cfg.max_burst_s / cfg.time_scale
    return cfg.first_token_timeout(concurrency) + SLACK_S + float(window)


def measure_remote(
    host: Host, cfg: CellConfig, *, python: str, zipapp: str, key_name: str
) -> tuple[CellRecord, list[dict[str, Any]]]:
    """Measure `cfg` on `host` with the zipapp at `zipapp` run by `python` there.

    `key_name` names the key's file under KEY_DIR (the run's tag: a cell that never ran
    leaves at most one, which the run's next cell overwrites). Raises RemoteCellFailed when
    the load generator left no record; a host error (connection, timeout) as the host
    raises it."""
    key_path = None
    if cfg.api_key:
        key_file = f"{KEY_DIR}/{key_name}.key"
        host.put_text(cfg.api_key, key_file, mode=0o600)
        key_path = host.resolve(key_file)
    cmd = cell_command(python, zipapp, config_to_argv(cfg), key_path)
    res = host.run(cmd, timeout_s=time_budget_s(cfg), stream=False)
    return read_cell_output(res.stdout, res.rc, res.tail(5))
