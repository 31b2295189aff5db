"""Every recipe value that reaches a host's shell is quoted (issue #16 items 3 and 5).

What this proves, and how. Every string field of a recipe (found by walking the recipe model,
so a field added later is covered without touching this file: plain strings, optional
strings, each element of a string tuple, each key and value of a string mapping) is set to a
hostile value, and $HOME (a run's host_home) is a hostile directory name too: command substitution, backticks, `;`, both quotes, a newline. A field the
loader refuses with that value (a slug's pattern, the ref's kinds, the API key's variable
name: `load_recipe` would not return such a recipe) is listed as refused; every other field
is set hostile all at once, and the real host functions run against this machine (the local
host, a temporary HOME, a PATH whose python/uv/git are stubs that record their arguments and
make what the real tools make, so each script runs to its end):

- provisioning: the attempt's wrapper and body (`provision.scripts.attempt_scripts`, run by
  the real `provision.orchestrate.run_attempt`) for the install kinds pip, release, wheel (a commit) and pr, and the
  re-shipping script (`refresh_shipped`);
- the server: `start_server` (the alive-servers and port-holder checks, the run directory,
  launch.sh and its launcher), `wait_ready`, `inspect_server` and `stop_server`;
- a cell on a remote host (`engine.remote_cell`: every config value, the API key and its
  file's name, the python and zipapp paths) and the health probe (`engine.health`: the URL and
  the python), each hostile.

Each provisioning attempt must exit 0 (every line ran) and the server's launch must have run
its command (the engine program, hostile too, is "not found" in the server log). The canary
file that each payload would create must never appear. Not covered by design: the recipe's
`engine.install.post_install` and `model.setup`, which are commands and run as written. The
lease's values are not a recipe's: its holder is refused unless it matches a safe pattern.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import sys
import tarfile
import threading
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError
from speed_matrix_helpers import free_port

from speedmatrix.engine import provision as P
from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.provision.orchestrate import run_attempt
from speedmatrix.engine.provision.scripts import Build
from speedmatrix.engine.vllm_server import (
    ServerError,
    inspect_server,
    server_state,
    start_server,
    stop_server,
    wait_ready,
)
from speedmatrix.recipes import Recipe, load_recipe_id

pytestmark = pytest.mark.integration

CPU = "cpu/tiny/llama-tiny"
PAYLOADS = {
    "substitution": "$(touch {c})",
    "backticks": "`touch {c}`",
    "semicolon": "x; touch {c}",
    "single quote": "x'; touch {c}; '",
    "double quote": 'x"; touch {c}; "',
    "newline": "x\ntouch {c}\n",
    "all at once": "$(touch {c})'\"`touch {c}`;touch {c}\n",
}
COMMANDS_BY_DESIGN = {("engine", "install", "post_install"), ("model", "setup")}

Path_ = tuple  # a leaf's path: field names, then an index or ("key"|"value"|"new", key)


def _allows_str(annotation) -> bool:
    if typing.get_origin(annotation) is typing.Literal:
        return False
    return annotation is str or str in typing.get_args(annotation)


def _is_str_tuple(annotation) -> bool:
    for a in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(a) is tuple and typing.get_args(a)[:1] == (str,):
            return True
    return False


def string_leaves(model: BaseModel, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every place a string lives in the model (see the module docstring)."""
    for name, info in type(model).model_fields.items():
        value, here = getattr(model, name), (*prefix, name)
        if isinstance(value, BaseModel):
            yield from string_leaves(value, here)
        elif isinstance(value, dict):
            for k in value:
                yield (*here, ("key", k))
                yield (*here, ("value", k))
            if not value:
                yield (*here, ("new", None))
        elif isinstance(value, tuple) and _is_str_tuple(info.annotation):
            yield from ((*here, i) for i in range(max(1, len(value))))
        elif _allows_str(info.annotation) and (value is None or isinstance(value, str)):
            yield here


def with_leaf(model: BaseModel, path: Path_, text: str) -> BaseModel:
    """A copy of `model` with the string at `path` replaced by `text` (no validation)."""
    name, rest = path[0], path[1:]
    value = getattr(model, name)
    if not rest:
        new = text
    elif isinstance(value, BaseModel):
        new = with_leaf(value, rest, text)
    elif isinstance(value, tuple):
        items = list(value)
        items[rest[0] : rest[0] + 1] = [text]
        new = tuple(items)
    else:
        kind, key = rest[0]
        new = dict(value)
        if kind == "value":
            new[key] = text
        elif kind == "key":
            new = {(text if k == key else k): v for k, v in new.items()}
        else:
            new[text] = text
    return model.model_copy(update={name: new})


def refused_at_load(base: Recipe, path: Path_, text: str) -> bool:
    """Whether `load_recipe` would refuse the recipe with this one value hostile."""
    changed = with_leaf(base, path, text)
    try:
        Recipe.model_validate(changed.model_dump())
    except ValidationError:
        return True
    return bool(set(changed.problems()) - set(base.problems()))


STUB = r"""#!/bin/bash
# A stand-in for python/uv/git: records its argv, makes what the real tool makes.
{ printf '%s\0' "$(basename "$0")" "$@"; printf '\n'; } >> "$STUB_LOG"
case "$(basename "$0")" in
  python*|uv)
    if [ "${1-}" = -m ] && [ "${2-}" = venv ]; then d=$3
    elif [ "${1-}" = venv ]; then d=${!#}
    else exit 0; fi
    mkdir -p "$d/bin" && ln -sf "$STUB_DIR/python3" "$d/bin/python" ;;
  git)
    case "${1-}" in
      init) mkdir -p "${!#}/.git" ;;
      rev-parse) echo "$STUB_HEAD" ;;
      merge-base) echo "$STUB_BASE" ;;
    esac ;;
esac
exit 0
"""


# A run's host_home (a conf value: absolute, no control characters, anything else allowed)
# becomes $HOME on the host: a name that would run `touch CANARY_HOME` in the command's
# working directory (the test's tmp_path) if it were ever unquoted.
HOSTILE_HOME = "home $(touch CANARY_HOME) `touch CANARY_HOME`; touch CANARY_HOME '\""


@pytest.fixture
def stubbed(tmp_path, monkeypatch):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in ("python3", "uv", "git"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    home = tmp_path / HOSTILE_HOME
    home.mkdir()
    monkeypatch.chdir(tmp_path)  # where a relative canary would land
    env = {
        "HOME": str(home),
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_LOG": str(tmp_path / "argv.log"),
        "STUB_DIR": str(stubs),
        "STUB_HEAD": "b" * 40,
        "STUB_BASE": "c" * 40,
    }
    return get_host("local", env=env), tmp_path


def _shipment() -> P.Shipment:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("sim-profiles/x.yaml")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    return P.Shipment(b"PK", buf.getvalue(), {"loadgen": "l", "include": "i"})


def _provision_scripts(host, recipe: Recipe, kind: str, ref: str) -> list[str]:
    """Run every provisioning script for `recipe` as install `kind` at `ref`; return the
    argv each stub saw."""
    inst = recipe.engine.install.model_copy(update={"kind": kind})
    recipe = recipe.model_copy(
        update={"engine": recipe.engine.model_copy(update={"install": inst})}
    )
    plan = P.plan_install(recipe, ref, check=False, resolver=lambda r: "b" * 40)
    env_dir = host.resolve(recipe.env_dir(ref))
    model_path = host.resolve(recipe.model_location(ref)) if recipe.model.path else None
    ship = _shipment()
    # forced after the first kind: the stub python would pass the under-lock marker check
    build = Build(recipe, ref, plan, "h", ship, env_dir, model_path, kind != "pip")
    host.run(f"mkdir -p {shlex.quote(build.state_dir)}", 60, check=True)
    rc = run_attempt(host, build, time.monotonic() + 120, 120, 0.2)
    log = Path(build.state_dir, "provision.log")
    assert not Path(os.environ["SM_CANARY"]).exists(), f"provisioning ({kind}) ran a value"
    assert rc == 0, f"{kind}: the attempt stopped early (rc {rc}): {log.read_text()[-2000:]}"
    P.refresh_shipped(host, build.state_dir, ship.__class__(ship.loadgen, ship.include, {"x": "y"}))
    # The stub python writes no marker, so the env it made is not ours by provisioning's rule
    # (no marker, and the attempt record is gone once the attempt ended): the next kind would
    # rightly refuse to touch it. Each kind starts from an empty env path, as a first install.
    shutil.rmtree(env_dir, ignore_errors=True)
    return [plan.script]


def _host_processes(tmp: Path) -> list[int]:
    """The live processes started by this test's host commands, whatever their group or
    session: the ones whose environment holds the `stubbed` host's STUB_LOG (unique per test).
    A zombie's environment reads empty: it runs nothing more."""
    marker = b"\0STUB_LOG=" + str(tmp / "argv.log").encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if marker in env:
                found.append(int(entry))
    return found


def _wait_for_no_host_processes(tmp: Path, timeout_s: float) -> list[int]:
    """Wait (polling /proc) until no process of this test's host commands is left; returns
    those still there at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := _host_processes(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_no_recipe_value_runs_on_the_host(stubbed, payload, monkeypatch):
    host, tmp = stubbed
    canary = tmp / "CANARY"
    monkeypatch.setenv("SM_CANARY", str(canary))
    text = PAYLOADS[payload].format(c=canary)
    monkeypatch.setenv("SPEEDMATRIX_API_KEY", text)  # the key is written to secrets.env
    base = load_recipe_id(CPU)
    leaves = [p for p in string_leaves(base) if p[:3] not in COMMANDS_BY_DESIGN]
    leaves = [p for p in leaves if p[:2] not in COMMANDS_BY_DESIGN]
    refused = [p for p in leaves if refused_at_load(base, p, text)]
    accepted = [p for p in leaves if p not in refused]
    # the two values found unquoted by the audit must be among those exercised
    assert ("engine", "python") in accepted and ("serve", "host") in accepted
    assert len(accepted) > 30, accepted
    hostile = base
    for p in accepted:
        hostile = with_leaf(hostile, p, text)

    for kind, ref in (
        ("pip", "v0.32.0"),
        ("release", "v0.32.0"),
        ("wheel", "a" * 40),
        ("pr", "pr/123"),
    ):
        _provision_scripts(host, hostile, kind, ref)
        assert not canary.exists(), f"provisioning ({kind}) ran a recipe value: {payload}"
    argv = Path(tmp / "argv.log").read_text()
    assert text in argv  # the pip spec reached pip whole, as one argument

    prov = P.ProvisionResult(
        env_dir=host.resolve(hostile.env_dir()),
        python=sys.executable,
        version=None,
        commit=None,
        reused=True,
        include_dir=str(tmp / "include"),
    )
    handle = start_server(hostile, prov, host, port=free_port(), wait=False)
    deadline = time.monotonic() + 30
    while server_state(host, handle) != "dead" and time.monotonic() < deadline:
        time.sleep(0.2)
    launched = Path(handle.log_path).read_text()
    assert "No such file" in launched or "not found" in launched, launched
    with pytest.raises(ServerError):
        wait_ready(handle, 5, host=host, poll_s=0.2)
    inspect_server(handle, host=host)
    stop_server(handle, host=host, grace_s=1, gpu_wait_s=0)
    # every process the host commands started (setsid'ed attempts, background deletes, the
    # server) has ended before the canary is looked for: a late one could still run a value
    # (a fixed 0.5 s sleep let one through, issue #33)
    left = _wait_for_no_host_processes(tmp, 60)
    assert left == [], f"host processes still running after 60 s: {left}"
    assert not canary.exists(), f"the server's scripts ran a recipe value: {payload}"
    assert not (tmp / "CANARY_HOME").exists(), "a script ran the host_home"


def test_serve_env_reference_reaches_the_server_from_the_host_env_and_no_log(stubbed, monkeypatch):
    """`HF_TOKEN: $SM_TEST_HF_TOKEN` in serve.env: the server process sees the host's value
    (issue #16 item 5); the value is in no log, no launch file and not in the rendered command."""
    host, tmp = stubbed
    secret = "hf_host-only-" + os.urandom(6).hex()
    monkeypatch.setenv("SM_TEST_HF_TOKEN", secret)  # the local host's environment
    seen = tmp / "seen"
    base = load_recipe_id(CPU)
    serve = base.serve.model_copy(
        update={
            "env": {"HF_TOKEN": "$SM_TEST_HF_TOKEN"},
            "command": ("/bin/sh", "-c", f'printf %s "$HF_TOKEN" > {seen}; exec sleep 30'),
            "args": ("{port}",),
        }
    )
    recipe = base.model_copy(update={"serve": serve})
    prov = P.ProvisionResult(
        env_dir=None, python=sys.executable, version=None, commit=None, reused=True
    )
    handle = start_server(recipe, prov, host, port=free_port(), wait=False)
    try:
        deadline = time.monotonic() + 30
        while not (seen.exists() and seen.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert seen.read_text() == secret
    finally:
        stop_server(handle, host=host, grace_s=2, gpu_wait_s=0)
    assert secret not in handle.command
    for f in Path(handle.run_dir).iterdir():
        assert secret not in f.read_text(errors="replace"), f.name


# ---------------------------------------------------------- a remote cell, the health probe

# Every value a cell sends to its host's shell, hostile, and no `/` so it is allowed where a
# run tag is: each would `touch CANARY` in the command's working directory if ever unquoted.
HOSTILE = "x $(touch CANARY) `touch CANARY`; touch CANARY '\"\ntouch CANARY"

# Stands in for the zipapp: keeps what it was run with, writes a record where --json says.
FAKE_LOADGEN = r"""
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["SEEN"], "w") as fh:
    json.dump({"argv": argv, "key": os.environ.get("SPEEDMATRIX_API_KEY")}, fh)
with open(argv[argv.index("--json") + 1], "w") as fh:
    json.dump({"phase": argv[0], "status": "valid", "error": None}, fh)
with open(argv[argv.index("--requests") + 1], "w") as fh:
    fh.write(json.dumps({"phase": argv[0], "output_tokens": 3}) + "\n")
print("the load generator's own output")
"""


@pytest.fixture
def hostile_host(tmp_path, monkeypatch):
    """The local host with a hostile $HOME, and a python and a zipapp at hostile paths."""
    monkeypatch.chdir(tmp_path)  # where CANARY would land
    home = tmp_path / HOSTILE_HOME
    tools = tmp_path / HOSTILE.replace("\n", " ")
    for d in (home, tools):
        d.mkdir()
    python = tools / "python"
    python.symlink_to(sys.executable)
    zipapp = tools / "loadgen.pyz"
    zipapp.write_text(FAKE_LOADGEN)
    host = get_host("local", env={"HOME": str(home), "SEEN": str(tmp_path / "seen.json")})
    return host, str(python), str(zipapp), tmp_path


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_no_cell_value_runs_on_the_host_and_the_host_gets_the_config(hostile_host, phase):
    """engine.remote_cell's command, run for real: the load generator is given the config
    whole (its flags parsed back build it again, the key from the environment) and no value
    runs in the shell."""
    from speedmatrix.engine.remote_cell import measure_remote
    from speedmatrix.loadgen import DecodeConfig, PrefillConfig
    from speedmatrix.loadgen.cli import add_parsers, build_config

    host, python, zipapp, tmp = hostile_host
    common = {"base_url": HOSTILE, "model": HOSTILE, "context": 1024, "api_key": HOSTILE,
              "run_tag": HOSTILE.replace("\n", " "), "extra_body": {HOSTILE: HOSTILE},
              "measurement_profile": "published", "global_warmup_context": 4096}  # fmt: skip
    cfg = (
        PrefillConfig(**common)
        if phase == "prefill"
        else DecodeConfig(**common, concurrency=3, prompt_mode="shared", max_loop_fraction=0.5)
    )
    cfg.validate()
    record, rows = measure_remote(host, cfg, python=python, zipapp=zipapp, key_name=HOSTILE)
    assert not (tmp / "CANARY").exists(), "a cell value ran in the host's shell"
    assert not (tmp / "CANARY_HOME").exists(), "the host's HOME ran in its shell"
    assert (record["phase"], record["status"]) == (phase, "valid")
    assert [r["output_tokens"] for r in rows] == [3]
    seen = json.loads((tmp / "seen.json").read_text())
    assert seen["key"] == HOSTILE
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(seen["argv"])
    os.environ[args.api_key_env] = seen["key"]
    try:
        assert build_config(args) == cfg
    finally:
        del os.environ[args.api_key_env]
    keys = Path(host.resolve("$HOME/.speedmatrix/keys"))
    assert list(keys.iterdir()) == [], "the key's file outlived the cell"


def test_no_health_probe_value_runs_on_the_host(hostile_host):
    """engine.health on a host: the server's URL and the python reach the shell quoted; a real
    /health answers through them."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from speedmatrix.engine.health import server_health

    host, python, _, tmp = hostile_host

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert server_health(url, host, python) is None
        why = server_health(url + "/" + HOSTILE, host, python)
    finally:
        server.shutdown()
        server.server_close()
    assert why is not None and why.startswith("/health: ")
    assert not (tmp / "CANARY").exists(), "a health probe value ran in the host's shell"
