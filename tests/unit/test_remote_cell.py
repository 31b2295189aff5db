"""A cell on a remote host is configured as a local one: the load generator's flags are written
from the parser's own table (loadgen.cli.config_to_argv), its defaults are the config's, and
the config a remote host's zipapp builds from the command engine.remote_cell sends equals the
one a local cell runs with."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import re
import shlex
from typing import Any

import pytest

from speedmatrix.engine import remote_cell
from speedmatrix.engine.hosts.base import CommandResult
from speedmatrix.flows import matrix, resolution
from speedmatrix.loadgen import BurstConfig, CellConfig, DecodeConfig, PrefillConfig, cli
from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix
from speedmatrix.records import REQUEST_FIELDS, to_wire

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)

# A value other than the config's default for every field a flag carries.
NON_DEFAULT: dict[str, Any] = {
    "base_url": "http://gpu7:8123/v1",
    "model": "org/model name",
    "context": 12345,
    "workload": "continuation",
    "measurement_profile": "published",
    "global_warmup_context": 65536,
    "largest_context": 131072,
    "run_tag": "tag0r1c",
    "cache_salt": False,
    "extra_body": {"temperature": 0, "stop": ["'; $(x)"]},
    "connect_timeout_s": 3.5,
    "first_token_timeout_s": 61.25,
    "first_token_s_per_1k": 0.1 + 0.2,  # a float whose shortest text has every digit
    "stall_timeout_s": 7.0,
    "idle_timeout_s": 0.5,
    "time_scale": 5.0,
    "progress": False,
    "concurrency": 7,
    "window_s": 4.5,
    "max_output_tokens": 333,
    "prompt_mode": "shared",
    "warm_cache": False,
    "token_tolerance": 0.0,
    "max_loop_lag_ms": 12.5,
    "max_client_cpu_pct": 99.9,
    "max_blind_fraction": 0.2,
    "repetition_check": False,
    "max_loop_fraction": 0.5,
    "copy_check": False,
    "max_copy_share": 0.75,
    "samples": 5,
    "ttft_probes": 4,
    "metrics_interval_s": 0.1,
    "max_active_deviation": 0.3,
    "min_window_readings": 3,
    "adaptive": True,
    "adaptive_target_pct": 0.4,
    "adaptive_min_s": 2.5,
    "window_check_s": 0.125,
    "max_burst_s": 90.5,
}


def parse(argv: list[str]) -> CellConfig:
    """What the load generator's command line builds from `argv`."""
    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers())
    return cli.build_config(parser.parse_args(argv))


def flagged(cls: type[CellConfig]) -> set[str]:
    return {flag.field for flag in cli.flags_of(cls)}


def non_default(cls: type[CellConfig], **changes: Any) -> CellConfig:
    values = {k: v for k, v in NON_DEFAULT.items() if k in flagged(cls)}
    return cls(**{**values, **changes})


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    monkeypatch.delenv("SPEEDMATRIX_API_KEY", raising=False)


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, BurstConfig])
def test_every_flagged_field_round_trips_through_argv(cls):
    assert flagged(cls) <= set(NON_DEFAULT), "a new flag needs a value in NON_DEFAULT"
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    same = [k for k in flagged(cls) if NON_DEFAULT[k] == defaults[k]]
    assert same == [], f"not different from the default: {same}"
    for progress in (False, True):
        cfg = non_default(cls, progress=progress)
        assert parse(cli.config_to_argv(cfg)) == cfg


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, BurstConfig])
def test_a_default_config_round_trips_with_only_the_required_flags(cls):
    cfg = cls(base_url="http://h", model="m", context=512)
    argv = cli.config_to_argv(cfg)
    flags = [a for a in argv if a.startswith("-")]
    want = ["--base-url", "--model", "--context", "--run-tag"]
    assert flags == want + ([] if cls is PrefillConfig else ["--concurrency"])
    assert parse(argv) == cfg


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, BurstConfig])
def test_the_command_line_defaults_are_the_config_defaults(cls):
    argv = [cli.config_to_argv(cls(base_url="h", model="m", context=8))[0]]
    argv += ["--base-url", "h", "--model", "m", "--context", "8", "--run-tag", "t"]
    argv += [] if cls is PrefillConfig else ["-c", "1"]
    assert parse(argv) == cls(base_url="h", model="m", context=8, run_tag="t")


def test_only_the_in_process_fields_have_no_flag():
    """A field added to the config without a flag fails here, not silently on remote hosts
    (the zipapp would measure with its default)."""
    in_process = {"api_key", "on_window", "keep_requests"}
    assert set(cli.IN_PROCESS_ONLY) == in_process
    for cls in (PrefillConfig, DecodeConfig, BurstConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        assert names - flagged(cls) == in_process & names, cls.__name__
        assert flagged(cls) <= names


def test_the_api_key_never_reaches_the_argv(monkeypatch):
    cfg = non_default(DecodeConfig, api_key="sk-secret")
    argv = cli.config_to_argv(cfg)
    assert "sk-secret" not in " ".join(argv)
    monkeypatch.setenv("SPEEDMATRIX_API_KEY", "sk-secret")
    assert parse(argv) == cfg


# ------------------------------------------------------------------- the remote cell's command


class RecordingHost:
    """A remote host that keeps what it is given and answers as the command would."""

    name = "gpu7"

    def __init__(self, stdout: str, rc: int = 0) -> None:
        self.files: dict[str, str] = {}
        self.commands: list[str] = []
        self.stdout, self.rc = stdout, rc

    def resolve(self, path: str) -> str:
        return path.replace("$HOME", "/home/bench", 1)

    def put_text(self, text: str, remote: str, mode: int = 0o600) -> None:
        assert mode == 0o600
        self.files[self.resolve(remote)] = text

    def run(self, cmd: str, **kw: Any) -> CommandResult:
        self.commands.append(cmd)
        return CommandResult(self.rc, self.stdout, "zipapp stderr")


def framed(record: dict, rows: list[dict]) -> str:
    lines = "".join(json.dumps(to_wire(r, REQUEST_FIELDS)) + "\n" for r in rows)
    return f"motd\n{remote_cell.CELL_MARK}\n{json.dumps(to_wire(record))}\n{remote_cell.REQUESTS_MARK}\n{lines}"


def sent_config(host: RecordingHost, zipapp: str, monkeypatch) -> CellConfig:
    """The config the host's load generator builds from the command it was sent (the key
    read from the file the command reads it from)."""
    tokens = shlex.split(host.commands[-1])
    argv = tokens[tokens.index(zipapp) + 1 : tokens.index("--json")]
    key_file = re.search(r'"\$\(cat ([^)]*)\)"', host.commands[-1])
    if key_file:
        monkeypatch.setenv("SPEEDMATRIX_API_KEY", host.files[shlex.split(key_file.group(1))[0]])
    else:
        assert "unset SPEEDMATRIX_API_KEY;" in host.commands[-1]
    return parse(argv)


@pytest.mark.parametrize("key", [None, "sk-'$(touch x)"])
@pytest.mark.parametrize("profile", ["default", "published"])
def test_a_remote_cell_gets_the_config_a_local_cell_gets(monkeypatch, key, profile):
    if key:
        monkeypatch.setenv("SPEEDMATRIX_API_KEY", key)
    resolved = resolution.resolve(
        {"recipe": "cpu/tiny/llama-tiny", "ssh_conn_id": "gpu7", "measurement_profile": profile,
         "contexts": ["1K", 2048], "concurrencies": [1, 2], "prefill_contexts": [512]},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=WHEN,
    )  # fmt: skip
    m = resolved["matrix"]
    spec = MatrixSpec.build(**m)
    planned = plan_matrix(spec, KvCapacity(num_blocks=4096, block_size=16))
    cells = planned.order
    assert {c["phase"] for c in cells} == {"prefill", "decode"}
    if profile == "published":
        assert cells[0].get("global_warmup_context")
    zipapp = "/home/bench/envs/x.speedmatrix/loadgen.pyz"
    server = {"base_url": "http://127.0.0.1:8123", "loadgen": zipapp, "python": "/env/bin/python"}
    for cell in cells:
        local = matrix._loadgen_config(resolved, server, cell)
        local.validate()
        assert local.measurement_profile == profile and local.api_key == key
        record = {"phase": cell["phase"], "status": "valid", "error": None}
        host = RecordingHost(framed(record, []))
        monkeypatch.setattr(matrix, "host_of", lambda resolved, host=host: host)
        got, rows = matrix.measure(resolved, server, cell)
        assert (got["status"], rows) == ("valid", [])
        if key:
            monkeypatch.delenv("SPEEDMATRIX_API_KEY")
        assert sent_config(host, zipapp, monkeypatch) == local, cell
        if key:
            monkeypatch.setenv("SPEEDMATRIX_API_KEY", key)
            assert key not in host.commands[-1]


def test_the_records_are_read_after_the_markers_and_a_missing_one_fails():
    rows = [{f.name: None for f in REQUEST_FIELDS} | {"phase": "decode", "output_tokens": 5}]
    record, got = remote_cell.read_cell_output(framed({"status": "valid"}, rows), 0, "")
    assert record["status"] == "valid" and [r["output_tokens"] for r in got] == [5]
    with pytest.raises(remote_cell.RemoteCellFailed, match="exit 2: bad flag"):
        remote_cell.read_cell_output(framed({"status": "valid"}, []), 2, "bad flag")
    with pytest.raises(remote_cell.RemoteCellFailed, match="exit 0"):
        remote_cell.read_cell_output(f"{remote_cell.CELL_MARK}\n\n", 0, "")


def test_a_load_generator_that_left_no_record_gives_a_failed_cell(monkeypatch):
    resolved = resolution.resolve(
        {"recipe": "cpu/tiny/llama-tiny", "ssh_conn_id": "gpu7"},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=WHEN,
    )
    cell = plan_matrix(MatrixSpec.build(**resolved["matrix"]), KvCapacity(4096, 16)).order[0]
    host = RecordingHost("@@CELL@@\n\n@@REQUESTS@@\n", rc=3)
    monkeypatch.setattr(matrix, "host_of", lambda resolved: host)
    server = {"base_url": "http://127.0.0.1:1", "loadgen": "/x/loadgen.pyz"}
    record, rows = matrix.measure(resolved, server, cell)
    assert record["status"] == "failed" and rows == []
    assert "load generator exit 3" in record["error"] and "zipapp stderr" in record["error"]
    record, _ = matrix.measure(resolved, {**server, "loadgen": None}, cell)
    assert record["error"] == "no load generator zipapp was shipped to the host"
