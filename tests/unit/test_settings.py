"""The deployment's settings (speedmatrix.settings): one object, typed and validated, printed
by `speedmatrix config` with secrets redacted, documented in docs/settings.md, and the only
reader of the process environment but for the few modules named below."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from speedmatrix.cli import main
from speedmatrix.redact import REDACTED, is_secret_name
from speedmatrix.settings import ENV_NAMES, Settings, SettingsError, settings

ROOT = Path(__file__).resolve().parents[2]
CANARY = "sk-canary-7f3a9c2e5b1d"


def test_values_come_from_the_mapping_typed_and_defaults_as_before(tmp_path):
    s = Settings.from_env(
        {
            "SPEEDMATRIX_LEASE_TTL_S": "60",
            "SPEEDMATRIX_SITE_MAX_RUN_PAGES": "7",
            "SPEEDMATRIX_RECIPES": str(tmp_path),
            "SPEEDMATRIX_NOTIFY_EMAIL_TO": " a@x.test, b@x.test ,",
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
            "SPEEDMATRIX_SIM_LOOP": "asyncio",
            "SPEEDMATRIX_DEPLOYMENT": "",  # empty is unset
        }
    )
    assert s.lease_ttl_s == 60.0 and s.site_max_run_pages == 7
    assert s.recipes_dir == tmp_path and s.schedule == tmp_path / "_schedule.yaml"
    assert s.notify_email_to == ("a@x.test", "b@x.test")
    assert s.object_store_endpoint == "http://127.0.0.1:9000"
    assert s.source("object_store_endpoint") == "AWS_ENDPOINT_URL"
    assert s.sim_loop == "asyncio" and s.deployment is None and s.source("deployment") is None
    d = Settings.from_env({})
    assert (d.lease_ttl_s, d.bisect_poll_s, d.site_max_run_pages) == (900.0, 30.0, 200)
    assert d.notify_smtp_conn_id == "smtp_default" and d.sim_loop == "uvloop"
    assert d.recipes_dir == ROOT / "include" / "recipes"
    assert d.warehouse == str(ROOT / "warehouse")
    assert d.api_key is None and d.notify_email_to == ()


def test_the_first_variable_of_a_setting_that_is_set_wins():
    both = {"AWS_ENDPOINT_URL_S3": "http://s3.test", "AWS_ENDPOINT_URL": "http://other.test"}
    assert Settings.from_env(both).object_store_endpoint == "http://s3.test"
    assert Settings.from_env({"AWS_DEFAULT_REGION": "eu-west-1"}).object_store_region == (
        "eu-west-1"
    )


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("SPEEDMATRIX_LEASE_TTL_S", "abc", "not a number"),
        ("SPEEDMATRIX_LEASE_TTL_S", "-5", "> 0"),
        ("SPEEDMATRIX_BISECT_POLL_S", "nan", "finite"),
        ("SPEEDMATRIX_SITE_MAX_RUN_PAGES", "1.5", "not a whole number"),
        ("SPEEDMATRIX_SITE_MAX_RUN_PAGES", "0", "> 0"),
        ("SPEEDMATRIX_SIM_LOOP", "trio", "uvloop, asyncio"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name, value, reason):
    with pytest.raises(SettingsError, match=name) as caught:
        Settings.from_env({name: value})
    assert reason in str(caught.value) and repr(value) in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_secrets_never_show_in_repr_rows_or_errors():
    s = Settings.from_env(
        {
            "SPEEDMATRIX_API_KEY": CANARY,
            "VLLM_API_KEY": CANARY + "v",
            "SPEEDMATRIX_NOTIFY_WEBHOOK_URL": f"https://hooks.example.test/{CANARY}",
        }
    )
    assert s.api_key == CANARY  # the code gets the value; nothing that prints it does
    assert CANARY not in repr(s) and CANARY not in str(s)
    rows = {r.field: r for r in s.rows()}
    assert CANARY not in json.dumps([r.as_dict() for r in rows.values()])
    assert rows["api_key"].value == REDACTED and rows["notify_webhook_url"].value == REDACTED
    assert rows["api_key"].source == "env SPEEDMATRIX_API_KEY"


def test_a_variable_whose_name_says_secret_is_a_secret_setting():
    """A key added later cannot print: a name the redaction rule calls secret must be marked."""
    for row in Settings.from_env({}).rows():
        if any(is_secret_name(n) for n in row.env):
            assert row.secret, row.env


def test_a_named_secret_is_read_from_the_settings_environment():
    """A recipe names the variable of its key (serve.api_key_secret): looked up by name."""
    s = Settings.from_env({"MY_VLLM_KEY": "k1", "EMPTY_KEY": ""})
    assert s.secret_named("MY_VLLM_KEY") == "k1"
    assert s.secret_named("EMPTY_KEY") is None and s.secret_named("NOT_SET") is None


def test_settings_are_built_once_per_environment(monkeypatch):
    monkeypatch.setenv("SPEEDMATRIX_LEASE_TTL_S", "61")
    first = settings()
    assert settings() is first and first.lease_ttl_s == 61.0
    monkeypatch.setenv("SPEEDMATRIX_LEASE_TTL_S", "62")  # a changed environment is seen
    assert settings() is not first and settings().lease_ttl_s == 62.0
    monkeypatch.setenv("SPEEDMATRIX_LEASE_TTL_S", "abc")
    with pytest.raises(SettingsError, match="SPEEDMATRIX_LEASE_TTL_S"):
        settings()


# ------------------------------------------------------------------- speedmatrix config


def test_config_prints_values_sources_and_descriptions(monkeypatch, capsys):
    monkeypatch.setenv("SPEEDMATRIX_LEASE_TTL_S", "123")
    monkeypatch.setenv("SPEEDMATRIX_SITE_URL", "https://perf.example.test/sm")
    monkeypatch.setenv("SPEEDMATRIX_API_KEY", CANARY)
    monkeypatch.setenv("SPEEDMATRIX_NOTIFY_WEBHOOK_URL", f"https://hooks.example.test/{CANARY}")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "SPEEDMATRIX_LEASE_TTL_S = 123.0  [env SPEEDMATRIX_LEASE_TTL_S]" in out
    assert "SPEEDMATRIX_SITE_URL = https://perf.example.test/sm  [env" in out
    assert "SPEEDMATRIX_BISECT_POLL_S = 30.0  [default]" in out
    assert f"SPEEDMATRIX_API_KEY = {REDACTED}  [env SPEEDMATRIX_API_KEY]" in out
    assert "Seconds a host lease lasts" in out  # the description
    assert CANARY not in out
    for name in ENV_NAMES:
        assert name in out


def test_config_json_is_for_machines_and_redacts_too(monkeypatch, capsys):
    monkeypatch.setenv("SPEEDMATRIX_API_KEY", CANARY)
    monkeypatch.setenv("VLLM_API_KEY", CANARY)
    monkeypatch.setenv("SPEEDMATRIX_GPU_PRICES", "/etc/speedmatrix/prices.yaml")
    assert main(["config", "--json"]) == 0
    out = capsys.readouterr().out
    assert CANARY not in out
    rows = {r["field"]: r for r in json.loads(out)}
    assert rows["gpu_prices"]["value"] == "/etc/speedmatrix/prices.yaml"
    assert rows["gpu_prices"]["source"] == "env SPEEDMATRIX_GPU_PRICES"
    assert rows["vllm_api_key"] == rows["vllm_api_key"] | {"value": REDACTED, "secret": True}
    assert rows["lease_ttl_s"]["source"] == "default" and rows["lease_ttl_s"]["value"] == "900.0"
    assert set(rows["lease_ttl_s"]) >= {"env", "kind", "default", "doc"}


def test_config_with_a_bad_value_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("SPEEDMATRIX_LEASE_TTL_S", "abc")
    assert main(["config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("speedmatrix config: SPEEDMATRIX_LEASE_TTL_S='abc': not a number")


# ----------------------------------------------------------------- who reads the environment

# The modules that touch the process environment themselves, and why each must:
ENV_READERS = {
    # the one reader of the deployment's settings
    "plugins/speedmatrix/settings.py",
    # ships alone in a zipapp (imports only records): reads the key --api-key-env names
    "plugins/speedmatrix/loadgen/cli.py",
    # sets Airflow's own variables (AIRFLOW_HOME, …) for itself and its children, reads them back
    "plugins/speedmatrix/cli/demo.py",
    # gives a simulated recipe's server a fresh key in the environment (a write, like the demo's)
    "plugins/speedmatrix/cli/run.py",
}
_ENV_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def env_uses(source: str) -> list[int]:
    """Lines where the code itself touches the process environment: `os.environ`, `os.getenv`
    (and their kin) as names the code uses, or imported from os. Code inside a string (a
    script run on another host) is text, not a use: `ast` never looks into it."""

    def os_attribute(node: ast.AST) -> bool:  # os.environ, os.getenv, …
        return (
            isinstance(node, ast.Attribute)
            and node.attr in _ENV_ATTRS
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )

    def from_os(node: ast.AST) -> bool:  # from os import environ
        return (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in _ENV_ATTRS for a in node.names)
        )

    return sorted(n.lineno for n in ast.walk(ast.parse(source)) if os_attribute(n) or from_os(n))


def test_at_most_four_modules_touch_the_environment_and_they_are_named():
    found = {}
    for top in ("plugins", "dags"):
        for path in sorted((ROOT / top).rglob("*.py")):
            uses = env_uses(path.read_text(encoding="utf-8"))
            if uses:
                found[str(path.relative_to(ROOT))] = uses
    assert set(found) == ENV_READERS, found
    assert len(ENV_READERS) <= 4


# The modules that read the deployment's settings object (`settings()`, `Settings.from_env`),
# each where the deployment's value is a default a caller may override (a root, a directory, a
# secret by name, a URL, a poll interval). Held so that a new reader is a choice, and so that
# analysis/ stays free of the deployment: its one reader is cost.py's price file.
SETTINGS_READERS = {
    "plugins/speedmatrix/settings.py",  # defines them
    # the top: commands and task bodies
    "plugins/speedmatrix/cli/config.py",
    "plugins/speedmatrix/cli/demo.py",
    "plugins/speedmatrix/cli/run.py",
    "plugins/speedmatrix/cli/sim.py",
    "plugins/speedmatrix/flows/bisect_steps.py",
    "plugins/speedmatrix/flows/lease_holder.py",
    "plugins/speedmatrix/flows/notify.py",
    "plugins/speedmatrix/flows/server.py",
    "plugins/speedmatrix/flows/site.py",
    # a deployment default where a caller names none
    "plugins/speedmatrix/analysis/cost.py",  # the price file
    "plugins/speedmatrix/engine/lease.py",  # the lease directory and TTL
    "plugins/speedmatrix/engine/provision/resolve.py",  # the vLLM repository URL
    "plugins/speedmatrix/engine/vllm_server/launch.py",  # a server's API key by its name
    "plugins/speedmatrix/recipes.py",  # the recipes directory, the wheel index
    "plugins/speedmatrix/report/site.py",  # the site directory
    "plugins/speedmatrix/sim/runner.py",  # the simulator's event loop
    "plugins/speedmatrix/store/delta.py",  # the object store's endpoint and region
    "plugins/speedmatrix/store/layout.py",  # the warehouse root
    "plugins/speedmatrix/upstream/schedule.py",  # the schedule file, the GitHub API URL
}


def settings_uses(source: str) -> list[int]:
    """Lines calling `settings()`, `deployment_settings()` or `Settings.from_env(...)`."""

    def reads(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Name):
            return f.id in ("settings", "deployment_settings") and not node.args
        return (
            isinstance(f, ast.Attribute)
            and f.attr == "from_env"
            and (isinstance(f.value, ast.Name) and f.value.id == "Settings")
        )

    return sorted(n.lineno for n in ast.walk(ast.parse(source)) if reads(n))


def test_the_settings_are_read_by_the_named_modules_only():
    found = {}
    for top in ("plugins", "dags"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if uses := settings_uses(path.read_text(encoding="utf-8")):
                found[str(path.relative_to(ROOT))] = uses
    assert set(found) == SETTINGS_READERS, sorted(set(found) ^ SETTINGS_READERS)
    assert not [m for m in found if "/analysis/" in m and not m.endswith("cost.py")]


def test_the_settings_counter_sees_calls_only():
    code = "from x import settings\na = settings()\nb = Settings.from_env({})\nsettings = 1\n"
    assert settings_uses(code) == [2, 3]


def test_the_counter_sees_uses_and_not_strings():
    code = (
        "import os\nfrom os import getenv\nx = os.environ.get('A')\n"
        "SCRIPT = '''key = os.environ.get(\"SPEEDMATRIX_PROBE_KEY\")'''\n"
    )
    assert env_uses(code) == [2, 3]
    assert env_uses("SCRIPT = 'os.environ[\"X\"]'\n") == []


# ------------------------------------------------------------------------------- the docs


def settings_table() -> str:
    """docs/settings.md's table, as the settings object has it."""
    lines = [
        "| variable | takes | default | what it does |",
        "|---|---|---|---|",
    ]
    for row in Settings.from_env({}).rows():
        names = ", ".join(f"`{n}`" for n in row.env)
        secret = " **Secret**: printed as `<redacted>`." if row.secret else ""
        doc = row.doc.replace("|", "\\|")
        lines.append(f"| {names} | {row.kind} | {row.default} | {doc}{secret} |")
    return "\n".join(lines)


def test_docs_settings_md_has_the_table_of_every_setting():
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    table = settings_table()
    assert table in text, "docs/settings.md's table differs from the settings; it is:\n" + table


def test_the_docs_link_the_settings_page_and_the_config_command():
    assert "docs/settings.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "speedmatrix config" in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "settings.md" in (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")


# Variables of the scripts speedmatrix runs on a GPU host (engine/provision/scripts.py, the
# server's probes): that host's environment, not this process's settings.
HOST_SCRIPT_VARIABLES = {
    "SPEEDMATRIX_PROBE_KEY",
    "SPEEDMATRIX_FORCE",
    "SPEEDMATRIX_INSTALL_HASH",
    "SPEEDMATRIX_MARKER",
    "SPEEDMATRIX_MARKER_NAME",
    "SPEEDMATRIX_REF",
}
# Read by the deployment's shell scripts and its tests' probe, not by the library.
DEPLOYMENT_SCRIPT_VARIABLES = {"SPEEDMATRIX_AIRFLOW_ENV", "SPEEDMATRIX_WORKER_NAME"}
_NAME = re.compile(r"(?<![A-Z0-9_])SPEEDMATRIX_[A-Z0-9_]+")


def test_every_variable_the_code_and_the_env_files_name_is_a_setting():
    """A variable added where it is used, not here, is found: the code and deploy/'s env files
    name only settings (and the host scripts' and deployment scripts' own variables)."""
    named_in_code = {
        m
        for top in ("plugins", "dags")
        for p in (ROOT / top).rglob("*.py")
        for m in _NAME.findall(p.read_text(encoding="utf-8"))
    }
    assert named_in_code - set(ENV_NAMES) - HOST_SCRIPT_VARIABLES == set()
    named_in_env_files = {
        m for p in (ROOT / "deploy").glob("*.env.example") for m in _NAME.findall(p.read_text())
    }
    assert named_in_env_files - set(ENV_NAMES) - DEPLOYMENT_SCRIPT_VARIABLES == set()
