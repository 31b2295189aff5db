"""The deployment's settings: every environment variable speedmatrix reads, in one object.

Why one object: a variable read where it is used is read in many places with as many defaults
and parsers, and nobody can say which variables exist, which one a worker sees, or that a bad
value (``SPEEDMATRIX_LEASE_TTL_S=abc``) is wrong until the code that reads it runs. Here each
variable is one field of :class:`Settings` with its type, default and description; a bad
value is refused when the settings are built, naming the variable; ``speedmatrix config``
prints them all with their source (env or default), secrets redacted (``speedmatrix.redact``'s
mark); docs/settings.md is the same table, held equal to this one by a test.

How to read them: :func:`settings` (the process environment, built once for a given set of
values) or ``Settings.from_env(mapping)`` (a test's, a child's). Modules take a value from
here or a parameter passed down from here; they never read ``os.environ`` themselves. An
empty (or blank) variable counts as unset, as it always has for these variables.

What is not here, on purpose:

- the environment of another machine: the scripts speedmatrix runs on a GPU host
  (engine/provision/scripts.py, engine/vllm_server/inspection.py and ready.py, the lease's
  shell) are text that reads *that host's* environment (``SPEEDMATRIX_PROBE_KEY``,
  ``SPEEDMATRIX_LEASE_DIR`` there), not this process's settings;
- the load generator (loadgen/), which ships alone in a zipapp and reads the key its
  ``--api-key-env`` names itself;
- ``speedmatrix demo``'s ``AIRFLOW_*`` variables, which it sets for Airflow and its children;
- what comes from Airflow connections (SSH hosts, the GitHub token, SMTP): Airflow's, not ours;
- the rest of the AWS environment (credentials): delta-rs and pyarrow read it themselves.

Standard library only (plus ``redact``, also stdlib), so every layer may import it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.redact import REDACTED, redact

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout (plugins/speedmatrix/settings.py is two levels below it)."""

UNSET = "(unset)"
"""How an unset optional setting prints in ``speedmatrix config``."""


class SettingsError(InputError):
    """A variable holds a value its setting cannot take; the message names the variable.
    An InputError, so the command line prints it as one line and exits 2."""


# ---------------------------------------------------------------------------- value parsers


def _text(raw: str) -> str:
    return raw


def _path(raw: str) -> Path:
    return Path(raw)


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a finite number > 0")
    return value


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("not a whole number") from None
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _addresses(raw: str) -> tuple[str, ...]:
    return tuple(a for a in (p.strip() for p in raw.split(",")) if a)


_KINDS: dict[Callable[[str], Any], str] = {
    _text: "text",
    _path: "path",
    _positive_float: "number > 0",
    _positive_int: "whole number > 0",
    _addresses: "comma-separated list",
}
"""What each parser takes, as the table of settings says it."""


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError("must be one of " + ", ".join(allowed))
        return raw

    _KINDS[parse] = " or ".join(allowed)
    return parse


def _setting(
    env: str | tuple[str, ...],
    doc: str,
    *,
    parse: Callable[[str], Any] = _text,
    default: Any = None,
    default_doc: str | None = None,
    secret: bool = False,
) -> Any:
    """One setting: the variable(s) it is read from (the first one set wins), its description,
    its parser (raises ValueError with the reason), its default (None: unset) and, for a
    default computed when the settings are built, what it is (``default_doc``)."""
    names = (env,) if isinstance(env, str) else env
    if default_doc is None:
        default_doc = UNSET if default in (None, ()) else str(default)
    meta = {
        "env": names,
        "doc": doc,
        "parse": parse,
        "kind": _KINDS[parse],
        "default_doc": default_doc,
        "secret": secret,
    }
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Every setting of a speedmatrix process (see the module docstring). A field's metadata
    holds its variable names, description and parser; ``secret`` fields never print."""

    # The warehouse and where its pages go
    warehouse: str = _setting(
        "SPEEDMATRIX_WAREHOUSE",
        "The warehouse root: a local path or s3://bucket/prefix. --warehouse and a run's "
        "conf override it.",
        default_doc="warehouse/ in the checkout (else in the working directory)",
    )
    object_store_endpoint: str | None = _setting(
        ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        "The S3-compatible endpoint of an s3:// warehouse (AWS's variables; an http:// "
        "endpoint is allowed). Unset: AWS's own.",
    )
    object_store_region: str | None = _setting(
        ("AWS_REGION", "AWS_DEFAULT_REGION"),
        "The region of an s3:// warehouse (AWS's variables). Unset: us-east-1, as the AWS "
        "CLI's default.",
    )
    site_dir: str | None = _setting(
        "SPEEDMATRIX_SITE_DIR",
        "Where the static site is written (a local path every worker mounts). Unset: site/ "
        "beside the warehouse directory; a warehouse on s3:// needs it set.",
    )
    site_url: str | None = _setting(
        "SPEEDMATRIX_SITE_URL",
        "Where the site directory is published (a static web server); the site task's link "
        "is URL/runs/RUN.html. Unset: the page's file:// URL.",
    )
    site_max_run_pages: int = _setting(
        "SPEEDMATRIX_SITE_MAX_RUN_PAGES",
        "Run pages one site task renders at most, newest first (the rest in later runs).",
        parse=_positive_int,
        default=200,
    )
    report_base_url: str | None = _setting(
        "SPEEDMATRIX_REPORT_BASE_URL",
        "Where the warehouse's artifacts/ directory is published; alerts link "
        "URL/RUN/report.html. Unset: the report's path.",
    )
    gpu_prices: Path | None = _setting(  # noqa: RUF009 (a field specifier: it returns field())
        "SPEEDMATRIX_GPU_PRICES",
        "A YAML or JSON file of GPU prices per hour (per_gpu_hour: {GPU: price}, currency) "
        "for cost per million tokens. Unset: no cost is shown.",
        parse=_path,
    )

    # Recipes, the schedule and the upstream sources (trusted: never a run's conf)
    recipes_dir: Path = _setting(  # noqa: RUF009 (a field specifier: it returns field())
        "SPEEDMATRIX_RECIPES",
        "The recipes folder; a recipe id is looked up inside it only.",
        parse=_path,
        default_doc="include/recipes in the checkout",
    )
    schedule: Path = _setting(  # noqa: RUF009 (a field specifier: it returns field())
        "SPEEDMATRIX_SCHEDULE",
        "The schedule config (nightly cron, commit watch, the GitHub API).",
        parse=_path,
        default_doc="_schedule.yaml in the recipes folder",
    )
    github_api_url: str | None = _setting(
        "SPEEDMATRIX_GITHUB_API_URL",
        "The GitHub API the token of github_default goes to (GitHub Enterprise, a fake in "
        "tests). Unset: github.api_url of the schedule config, else api.github.com.",
    )
    wheel_index: str | None = _setting(
        "SPEEDMATRIX_WHEEL_INDEX",
        "The per-commit vLLM wheel index for every recipe (a mirror). Unset: the recipe's "
        "engine.install.wheel_index, else https://wheels.vllm.ai.",
    )
    vllm_repo_url: str | None = _setting(
        "SPEEDMATRIX_VLLM_REPO_URL",
        "The vLLM git repository PR refs are resolved in and built from (a mirror). Unset: "
        "https://github.com/vllm-project/vllm.git.",
    )

    # Hosts and the lease
    lease_ttl_s: float = _setting(
        "SPEEDMATRIX_LEASE_TTL_S",
        "Seconds a host lease lasts without being renewed (its holder died): the deployment's, "
        "never a run's conf.",
        parse=_positive_float,
        default=900.0,
    )
    lease_dir: str | None = _setting(
        "SPEEDMATRIX_LEASE_DIR",
        "The machine-wide lease directory for hosts whose own environment names none. "
        "Unset: /var/tmp/speedmatrix.",
    )
    deployment: str | None = _setting(
        "SPEEDMATRIX_DEPLOYMENT",
        "This Airflow deployment's name in a host's lease (two deployments sharing a host "
        "tell their runs apart by it). Unset: a digest of the execution API's URL.",
    )
    bisect_poll_s: float = _setting(
        "SPEEDMATRIX_BISECT_POLL_S",
        "Seconds between the bisection DAG's checks of a step's speed_matrix run (read when "
        "the DAG file is parsed: the DAG processor's environment).",
        parse=_positive_float,
        default=30.0,
    )

    # Alerts (the scheduler's / DAG processor's environment)
    notify_email_to: tuple[str, ...] = _setting(
        "SPEEDMATRIX_NOTIFY_EMAIL_TO",
        "Comma-separated recipients of run alerts; mail is on when set.",
        parse=_addresses,
        default=(),
    )
    notify_email_from: str | None = _setting(
        "SPEEDMATRIX_NOTIFY_EMAIL_FROM",
        "The alerts' sender. Unset: the SMTP connection's from_email.",
    )
    notify_smtp_conn_id: str = _setting(
        "SPEEDMATRIX_NOTIFY_SMTP_CONN_ID",
        "The Airflow connection alerts are mailed through.",
        default="smtp_default",
    )
    notify_webhook_url: str | None = _setting(
        "SPEEDMATRIX_NOTIFY_WEBHOOK_URL",
        "A Slack-compatible incoming webhook for run alerts (the URL is a credential).",
        secret=True,
    )
    notify_webhook_conn_id: str | None = _setting(
        "SPEEDMATRIX_NOTIFY_WEBHOOK_CONN_ID",
        "An Airflow connection holding the webhook URL in its password (or host), instead.",
    )

    # Keys and the simulator
    api_key: str | None = _setting(
        "SPEEDMATRIX_API_KEY",
        "The vLLM API key of recipes that name no other variable (serve.api_key_secret) and "
        "of `speedmatrix run --base-url`'s default --api-key-env.",
        secret=True,
    )
    vllm_api_key: str | None = _setting(
        "VLLM_API_KEY",
        "The key `speedmatrix sim serve` requires when given neither --api-key nor "
        "--api-key-env (every server speedmatrix starts reads its key from here).",
        secret=True,
    )
    sim_loop: str = _setting(
        "SPEEDMATRIX_SIM_LOOP",
        "The simulator's event loop: uvloop (where importable) or asyncio.",
        parse=_choice("uvloop", "asyncio"),
        default="uvloop",
    )

    _environ: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    _sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    # ----------------------------------------------------------------------------- building

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``env`` (None: this process's environment), or SettingsError naming
        the first variable whose value its setting cannot take."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for f in _fields():
            meta = f.metadata
            name = next((n for n in meta["env"] if (env.get(n) or "").strip()), None)
            if name is None:
                continue
            raw = env[name]
            try:
                values[f.name] = meta["parse"](raw)
            except ValueError as exc:
                shown = REDACTED if meta["secret"] else repr(redact(raw))
                raise SettingsError(f"{name}={shown}: {exc}. {name}: {meta['doc']}") from None
            sources[f.name] = name
        values.setdefault("warehouse", _default_warehouse())
        values.setdefault("recipes_dir", REPO_ROOT / "include" / "recipes")
        values.setdefault("schedule", Path(values["recipes_dir"]) / "_schedule.yaml")
        return cls(**values, _environ=env, _sources=sources)

    def __repr__(self) -> str:
        shown = ", ".join(f"{r.field}={r.value!r}" for r in self.rows())
        return f"Settings({shown})"

    # ------------------------------------------------------------------------------ reading

    def secret_named(self, name: str) -> str | None:
        """The value of the variable ``name`` when a recipe or an option chooses which one
        holds a key (``serve.api_key_secret``, ``--api-key-env``), or None when unset. Read
        now, from the environment these settings came from: `speedmatrix run` gives a
        simulated recipe a fresh key in its own environment before the server starts."""
        return self._environ.get(name) or None

    def source(self, name: str) -> str | None:
        """The variable a field's value came from, or None for its default."""
        return self._sources.get(name)

    def rows(self) -> list[SettingRow]:
        """Every setting as ``speedmatrix config`` prints it: secrets redacted."""
        out = []
        for f in _fields():
            value = getattr(self, f.name)
            source = self._sources.get(f.name)
            out.append(
                SettingRow(
                    field=f.name,
                    env=f.metadata["env"],
                    value=_shown(value, f.metadata["secret"]),
                    source=f"env {source}" if source else "default",
                    secret=f.metadata["secret"],
                    kind=f.metadata["kind"],
                    default=f.metadata["default_doc"],
                    doc=f.metadata["doc"],
                )
            )
        return out


@dataclass(frozen=True)
class SettingRow:
    """One setting as shown: its field, variable(s), redacted value, source, what it takes,
    its default and its description."""

    field: str
    env: tuple[str, ...]
    value: str
    source: str
    secret: bool
    kind: str
    default: str
    doc: str

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "env": list(self.env)}


def _fields() -> Iterator[dataclasses.Field]:
    return (f for f in dataclasses.fields(Settings) if "env" in f.metadata)


def _shown(value: Any, secret: bool) -> str:
    """A value as printed: unset, a secret's mark, or the value with anything that looks like
    a credential redacted (a URL with a token in it)."""
    if value is None or value == ():
        return UNSET
    if secret:
        return REDACTED
    if isinstance(value, tuple):
        value = ",".join(value)
    return redact(str(value)) or ""


def _default_warehouse() -> str:
    if (REPO_ROOT / "pyproject.toml").exists():
        return str(REPO_ROOT / "warehouse")
    return str(Path.cwd() / "warehouse")


ENV_NAMES: tuple[str, ...] = tuple(n for f in _fields() for n in f.metadata["env"])
"""Every variable the settings read, in the order of the fields."""

_cache: tuple[tuple[str | None, ...], Settings] | None = None


def settings() -> Settings:
    """This process's settings. Built once for a given set of values of :data:`ENV_NAMES`:
    a process whose environment does not change builds them once, and one that changes it (a
    test's monkeypatch, the demo setting its key before Airflow starts) gets settings of the
    new values, never stale ones."""
    global _cache
    key = tuple(os.environ.get(n) for n in ENV_NAMES)
    cached = _cache
    if cached is not None and cached[0] == key:
        return cached[1]
    built = Settings.from_env()
    _cache = (key, built)
    return built


def child_environ(**extra: str) -> dict[str, str]:
    """This process's environment with ``extra`` added, for a child process that must not
    inherit it unchanged (git asked never to prompt)."""
    return {**os.environ, **extra}
