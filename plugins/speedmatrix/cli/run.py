"""`speedmatrix run`: measure a matrix from the command line, without Airflow.

`speedmatrix run RECIPE` provisions and starts the recipe's server on this machine, measures
its matrix, lands it in the warehouse and renders its page; `speedmatrix run --base-url URL
--model M` does the same against a server already running (nothing provisioned, started or
stopped). The matrix options are the speed_matrix conf keys (`--contexts 8K 16K`,
`--concurrencies 1 2`, ...), and override the recipe's.

Why no code of its own for measuring, validating or landing: every step is the DAG's task body
in :mod:`speedmatrix.flows.matrix`, called in the DAG's order (resolve, take_lease, setup,
inspect, plan, the prefill then decode cells, teardown, validate, land, report, regressions,
conclude), so a run from here lands exactly what the DAG would, verdicts included
(tests/unit/test_run_steps.py holds the two lists of steps to one another). What is here: the command line, the in-memory
recipe of a server already running, and the live progress display.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from speedmatrix.cli import CliError
from speedmatrix.cli.eta import CellCosts
from speedmatrix.cli.interrupts import finishing, terminate_as_interrupt
from speedmatrix.cli.verdict import EXIT_REGRESSION, run_verdict, verdict_text
from speedmatrix.flows.contracts import Landing, Planned, ServerHandoff, ServerInfo
from speedmatrix.flows.resolved import Resolved
from speedmatrix.renames import add_window_option
from speedmatrix.settings import settings

# The matrix of a server already running when the command line names none: the published
# reports' smallest contexts (those that fit the model), a few concurrencies.
EXISTING_DEFAULTS = {
    "prefill_contexts": ["8K", "16K", "32K"],
    "contexts": ["8K", "16K", "32K"],
    "concurrencies": [1, 2, 4, 8],
}
USAGE = """Measure a whole matrix now, without Airflow: land it in the warehouse, render its page,
and print its verdict against the previous run.

  speedmatrix run RECIPE                       the recipe's server on this machine:
                                               provision, start, measure, stop
  speedmatrix run --base-url URL --model M     a server already running (vLLM or
                                               `speedmatrix sim serve`): nothing started

The matrix options override the recipe's. Exit codes: 0 landed, 1 landed as failed,
2 bad input, 3 a figure regressed beyond noise (only with --fail-on-regression).
"""


def _concurrency(value: str) -> int:
    """argparse's type for --concurrencies: records.parse_concurrency (ASCII digits only), its
    error as the flag's."""
    from speedmatrix.records import parse_concurrency

    try:
        return parse_concurrency(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction, name: str) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        name,
        help="measure a matrix now, without Airflow, and land it",
        description=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "recipe", nargs="?", help="recipe id (e.g. cpu/tiny/llama-tiny): its server on this host"
    )
    g = p.add_argument_group("a server already running (instead of a recipe)")
    g.add_argument("--base-url", help="the server's root, e.g. http://127.0.0.1:8000")
    g.add_argument(
        "--model",
        help="its served model name (default: the one model it serves); the model id is "
        "read from its /v1/models (root) and recorded as the run's model",
    )
    g.add_argument(
        "--api-key-env",
        default="SPEEDMATRIX_API_KEY",
        metavar="NAME",
        help="environment variable holding its API key (unset or empty: no key)",
    )
    g = p.add_argument_group("matrix (the speed_matrix conf keys; default: the recipe's)")
    g.add_argument("--contexts", nargs="+", metavar="N", help="decode contexts, e.g. 8K 16K")
    g.add_argument("--concurrencies", nargs="+", type=_concurrency, metavar="C", help="e.g. 1 2 4")
    g.add_argument(
        "--burst",
        nargs="+",
        type=_concurrency,
        metavar="N",
        help="burst cells: at each decode context, N requests sent at once and measured to "
        "their completion (latency, per-user end-to-end tok/s), e.g. 4 16; never compared "
        "with the decode cells",
    )
    g.add_argument("--prefill-contexts", nargs="+", metavar="N", help="prefill contexts")
    add_window_option(g, "--duration-s", help="decode window, seconds")
    g.add_argument(
        "--adaptive",
        action="store_true",
        default=None,
        help="adaptive windows: a decode cell stops once its throughput's interval is tight "
        "enough for its verdict (after the recipe's adaptive_min_s), --window-s being the "
        "cap (docs/measurement.md, 'Adaptive windows')",
    )
    g.add_argument(
        "--adaptive-min-s",
        type=float,
        metavar="S",
        help="adaptive: a window's least length in seconds (default the recipe's, 5)",
    )
    g.add_argument("--max-output-tokens", type=int, metavar="T", help="output tokens per request")
    g.add_argument("--prompt-mode", choices=("distinct", "shared"))
    g.add_argument("--workload", choices=("article", "continuation"))
    g.add_argument(
        "--profile",
        dest="measurement_profile",
        choices=("default", "published"),
        help="whose definitions measure the run: default (ours) or published (the published "
        "tool's: docs/measurement.md, 'The published profile'); recorded per run and cell",
    )
    g.add_argument(
        "--kv-budget",
        metavar="TOKENS",
        help="a manual KV cache size in tokens (983040 or 960K) for a server whose /metrics "
        "cannot tell its capacity (context parallelism, DCP): the over-capacity rule uses it; "
        "recorded with the run",
    )
    g.add_argument(
        "--engine-ref",
        help="recipe: the engine ref to install (default the recipe's); a server already "
        "running: the ref it was built from (default: read from its /version, else main)",
    )
    g.add_argument("--port", type=int, help="recipe: the port its server listens on")
    g.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help="measure the cells to repeat N times in the run (1-10), each pass after the whole "
        "matrix; the first lands in cells, the others in cell_repeats (default: the recipe's)",
    )
    g.add_argument(
        "--repeat-cells",
        nargs="+",
        metavar="CELL",
        help="the cells to repeat, named as `trend --cell` names them: 64Kx16, 'prefill 64K' "
        "(default: every cell)",
    )
    g.add_argument(
        "--warehouse",
        metavar="W",
        help="default $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/",
    )
    p.add_argument(
        "--fail-on-regression",
        action="store_true",
        help=f"exit {EXIT_REGRESSION} when a figure regressed beyond noise against the baseline "
        "(to gate a CI job)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every step")
    p.set_defaults(func=_run)


# ------------------------------------------------------------------------------- the run


def _run(args: argparse.Namespace) -> int:
    from speedmatrix.flows import matrix, progress, resolution
    from speedmatrix.plan import task_cells

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("great_expectations").setLevel(logging.WARNING)
    conf, extra = _conf(args)
    now = dt.datetime.now(dt.UTC)
    try:
        resolved = resolution.resolve(
            conf,
            dag_run_id=f"cli__{now.strftime('%Y%m%dT%H%M%S%fZ')}",
            run_after=now,
            **extra,
        )
    except resolution.ResolveError as exc:
        raise CliError(str(exc)) from None
    terminate_as_interrupt()
    show = Display.make(resolved)
    with progress.listening(show):  # the lease's word on a holder gone (flows/progress.py)
        lease = matrix.take_lease(resolved, one_process=True)
    if lease is None:
        raise CliError(f"host {resolved['host']} is busy: another run holds its lease")
    # the steps' typed hand-offs, in memory here (no XCom between them)
    server: ServerHandoff | None = None
    info: ServerInfo | None = None
    planned: Planned | None = None
    results: list[dict[str, Any]] = []
    interrupted = False
    try:
        try:
            show.note("starting the server" if not resolved["base_url"] else "inspecting")
            server = matrix.setup(resolved)
            info = matrix.inspect(resolved, server)
            planned = matrix.plan(resolved, info)
        except Exception as exc:
            raise CliError(f"{type(exc).__name__}: {exc}") from None
        # the DAG's order: its two mapped tasks' cells (a context's prefill, then its decode)
        cells = [*task_cells(planned, "prefill"), *task_cells(planned, "decode")]
        show.begin(cells, server["base_url"])
        for cell in cells:
            show.cell_started(cell)
            result = matrix.run_cell(resolved, server, cell)
            results.append(result)
            show.cell_done(cell, result["cell"])
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        show.end()
        with finishing(show.note):
            matrix.teardown(resolved, server)
        if interrupted:
            what = "stopped the server" if not resolved["base_url"] else "left the server running"
            show.note(
                f"interrupted: {what}, released the lease on {resolved['host']}; nothing landed"
            )
    show.note("validating, landing, comparing with the baseline and rendering the page")
    validated = matrix.validate(resolved, info, server, planned, results)
    landed = matrix.land(resolved, validated)
    paths = matrix.report(resolved, landed)
    regressed = judge(resolved, landed)
    print(_summary(landed, paths, len(planned["over_capacity"])))
    print(verdict_text(run_verdict(matrix.warehouse_of(resolved), landed["run_id"])))
    try:
        matrix.conclude(landed)
    except RuntimeError as exc:
        print(f"speedmatrix run: {exc}", file=sys.stderr)
        return 1
    if regressed and args.fail_on_regression:
        return EXIT_REGRESSION
    return 0


def judge(resolved: Resolved, landed: Landing) -> bool:
    """The DAG's `regressions` task: the comparisons and noise rows land exactly as the DAG
    lands them. True when a figure regressed beyond noise (the DAG's task fails then; here
    the verdict is printed and `--fail-on-regression` decides the exit code)."""
    from speedmatrix.analysis.verdict import RegressionError
    from speedmatrix.flows import matrix

    try:
        matrix.regressions(resolved, landed)
    except RegressionError:
        return True
    return False


def _conf(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the speed_matrix conf, resolve's keywords for a server already running)."""
    if bool(args.recipe) == bool(args.base_url):
        raise CliError("name a RECIPE, or a server already running with --base-url and --model")
    from speedmatrix.flows.runconf import CONF_KEYS

    # the conf keys this command takes as options (recipe and host are set below)
    conf: dict[str, Any] = {
        key: value for key in CONF_KEYS if (value := getattr(args, key, None)) is not None
    }
    conf["ssh_conn_id"] = "local"
    if args.recipe:
        if args.model:
            raise CliError("--model is for --base-url (a recipe names its model)")
        conf["recipe"] = args.recipe
        _sim_key(args.recipe)
        return conf, {"source": "cli:speedmatrix run"}
    if args.port is not None:
        raise CliError("--port is for a recipe's server (--base-url names the server's)")
    url = args.base_url.rstrip("/")
    key = settings().secret_named(args.api_key_env)
    version, max_len, served, model_id = server_facts(url, args.model, key)
    ref = args.engine_ref or ref_of(version)
    recipe = existing_recipe(
        url, served, ref, max_len, args.api_key_env if key else None, model_id=model_id
    )
    conf["recipe"] = recipe.id
    for k, default in EXISTING_DEFAULTS.items():
        if k not in conf:
            conf[k] = [c for c in default if k == "concurrencies" or _fits(c, conf, max_len, k)]
    return conf, {"recipe": recipe, "base_url": url, "source": f"cli:speedmatrix run {url}"}


def _fits(context: str, conf: Mapping[str, Any], max_len: int, key: str) -> bool:
    from speedmatrix.plan import fits_model
    from speedmatrix.records import parse_context

    out = 1 if key == "prefill_contexts" else int(conf.get("max_output_tokens") or 4096)
    return fits_model(parse_context(context), out, max_len)


def _sim_key(recipe_id: str) -> None:
    """A simulated engine needs the API key its recipe names; like `make demo`, a run of one
    gets a fresh key when the environment has none (it guards nothing but the simulator)."""
    from speedmatrix.recipes import RecipeError, load_recipe_id

    try:
        recipe = load_recipe_id(recipe_id)
    except (RecipeError, FileNotFoundError):
        return  # resolve says why, in the DAG's words
    name = recipe.serve.api_key_secret
    if (
        recipe.engine.install.kind == "sim"
        and recipe.has_api_key
        and not settings().secret_named(name)
    ):
        os.environ[name] = "sk-run-" + secrets.token_hex(12)


# --------------------------------------------------------------- a server already running


def server_facts(url: str, model: str | None, key: str | None) -> tuple[str | None, int, str, str]:
    """(its /version, the model's max_model_len, its served name, its model id) from the
    server, or CliError saying why not: unreachable, not a vLLM server, or not serving
    `model`. No `model`: the one model the server serves. The model id is /v1/models' `root`
    (what the server loaded: `nvidia/Kimi-K2.7-Code-NVFP4`), so a run against a server
    already running names its model as a recipe run does, the served name kept apart."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"--base-url must be an http(s) URL such as http://127.0.0.1:8000: {url!r}")

    def get(path: str) -> Any:
        req = urllib.request.Request(url + path)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)

    try:
        models = get("/v1/models").get("data") or []
    except urllib.error.HTTPError as exc:
        raise CliError(
            f"{url}/v1/models answered HTTP {exc.code} (API key? --api-key-env)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot reach a server at {url}: {getattr(exc, 'reason', exc)}") from None
    served = {m.get("id"): m for m in models if isinstance(m, dict)}
    if model is None:
        if len(served) != 1:
            raise CliError(
                f"{url} serves {len(served)} models ({', '.join(map(str, served))}): "
                "name one with --model"
            )
        model = str(next(iter(served)))
    if model not in served:
        raise CliError(f"{url} does not serve {model!r} (it serves: {', '.join(map(str, served))})")
    root = served[model].get("root")
    model_id = root if isinstance(root, str) and root else model
    try:
        version = get("/version").get("version")
    except (OSError, ValueError, AttributeError):
        version = None
    return version, int(served[model].get("max_model_len") or 0) or 1 << 30, model, model_id


def ref_of(version: str | None) -> str:
    """The engine ref a reported version names: `0.11.0` -> v0.11.0, a dev build's
    `…+g9fedd24fa` -> its commit; else main (what the run row then says it is)."""
    if not version:
        return "main"
    if m := re.search(r"\+g([0-9a-f]{7,40})", version):
        return m.group(1)
    if re.fullmatch(r"\d+\.\d+\.\d+", version):
        return f"v{version}"
    return "main"


def existing_recipe(
    url: str,
    model: str,
    ref: str,
    max_model_len: int,
    key_env: str | None,
    *,
    model_id: str | None = None,
):
    """The in-memory recipe of a server already running: what the run row needs (model,
    engine ref, max_model_len), its id `external/<host-port>/<model>` (one recipe per server
    and model, so its runs compare with each other), hardware unknown (the run row takes
    what `inspect` reads from this machine). Never provisioned: its install kind and launch
    command are placeholders that `setup` does not reach for a run with a base URL."""
    from speedmatrix.recipes import (
        UNKNOWN_HARDWARE,
        Engine,
        Hardware,
        Install,
        Model,
        Recipe,
        Serve,
    )
    from speedmatrix.refs import classify_ref

    try:
        classify_ref(ref)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    where = re.sub(r"[^A-Za-z0-9.+-]+", "-", urlsplit(url).netloc).strip("-.") or "server"
    slug = re.sub(r"[^a-z0-9.-]+", "-", model.lower()).strip("-.") or "model"
    return Recipe(
        id=f"external/{where}/{slug}",
        description=f"a server already running at {url}",
        hardware=Hardware(
            type=UNKNOWN_HARDWARE,
            gpu="unknown",
            gpu_count=0,  # the row records NULL for unknown hardware (Hardware.known)
            vram_gb=0,
            backend="unknown",
            slug="ext",
        ),
        engine=Engine(ref=ref, install=Install(kind="release")),
        model=Model(
            id=model_id or model, served_name=model, slug=slug, max_model_len=max_model_len
        ),
        serve=Serve(
            command=("(already running)", "{model}"),
            args=("--port", "{port}", *(("--api-key", "{api_key}") if key_env else ())),
            api_key_secret=key_env,
        ),
        matrix={},
    )


# -------------------------------------------------------------------------------- output


def _summary(landed: Landing, paths: Mapping[str, str], over: int) -> str:
    lines = [
        f"run {landed['run_id']}: {landed['status']} ({landed['cells']} cells, "
        f"{over} over capacity, {len(landed.get('failed') or [])} failed, "
        f"{len(landed.get('quarantined') or [])} quarantined)",
        f"  page:      {paths['html']}",
        f"  markdown:  {paths['md']}",
        f"  warehouse: {landed['warehouse']}",
    ]
    lines += [f"  failed:    {f}" for f in landed.get("failed") or []]
    return "\n".join(lines)


def shown_label(cell: Mapping[str, Any]) -> str:
    """A cell as the run shows it: a prefill cell says so (`prefill 8K`; the plan labels the
    first context's `8K`, which read as a decode cell)."""
    label = str(cell.get("label") or "")
    if cell.get("phase") == "prefill" and not label.startswith("prefill"):
        return f"prefill {label}"
    return label


def rate_text(phase: str, rate: float | None) -> str:
    """The live tok/s of the current cell: a decode cell's warm-up (its prompts prefilled,
    no token generated yet) says warm-up, not 0 tok/s."""
    if phase in ("decode", "burst") and not rate:
        return "warm-up"
    return f"{rate:,.0f} tok/s" if rate is not None else ""


def _figure(cell: Mapping[str, Any]) -> str:
    tok = cell.get("total_tok_s")
    what = f"{tok:,.1f} tok/s" if isinstance(tok, int | float) else "-"
    status = cell.get("status")
    return what if status == "valid" else f"{what} {status}: {cell.get('error') or ''}".strip()


class Display:
    """Cells done, the current cell's tok/s (live, from the server's /metrics counters), ETA.

    On a terminal: a `rich` live progress bar on stderr; off a terminal: one plain line per
    cell (a log, a CI job). The tok/s is read beside the load generator, never from it, so
    the measurement is the DAG's to the byte."""

    def __init__(
        self,
        resolved: Resolved,
        out: Any = None,
        prog: str = "speedmatrix run",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.window_s = float(resolved["matrix"]["window_s"])
        self.out = out or sys.stderr
        self.prog = prog
        self.cells: list[Mapping[str, Any]] = []
        self.done = 0
        self.took: dict[str, list[float]] = {"prefill": [], "decode": [], "burst": []}
        self.costs = CellCosts(self.window_s)
        self.started = 0.0
        self.meter: RateMeter | None = None

    @staticmethod
    def make(resolved: Resolved, out: Any = None, prog: str = "speedmatrix run") -> Display:
        """The live bar on a terminal (`out`, default stderr), one line per cell elsewhere."""
        out = out or sys.stderr
        tty = getattr(out, "isatty", lambda: False)()
        return (RichDisplay if tty else Display)(resolved, out=out, prog=prog)

    def eta_s(self, now: float | None = None) -> float:
        """What is left: each cell not done at what it will cost (cli/eta.py: its warm-up,
        window and prefill time by context, learnt from the cells done), the current one's
        rest."""
        elapsed = ((now or self.clock()) - self.started) if self.started else 0.0
        return self.costs.left(self.cells[self.done :], elapsed)

    def step(self, text: str) -> None:
        """What a step says it is doing (flows/progress.py), said as a note."""
        self.note(text)

    def note(self, text: str) -> None:
        if getattr(self, "progress", None) is not None:  # above the live bar
            self.progress.console.print(f"{self.prog}: {text}", markup=False, highlight=False)
            return
        print(f"{self.prog}: {text}", file=self.out, flush=True)

    def begin(self, cells: Sequence[Mapping[str, Any]], base_url: str) -> None:
        self.cells = list(cells)
        self.costs.plan(self.cells)
        self.meter = RateMeter(base_url)
        self.note(f"{len(self.cells)} cells to measure at {base_url}")

    def cell_started(self, cell: Mapping[str, Any]) -> None:
        self.started = self.clock()
        if self.meter:
            self.meter.start(cell["phase"])

    def _count_done(self, cell: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """The bookkeeping of a finished cell (its time for the ETA, the meter stopped),
        shared by both displays; what they print differs."""
        took = self.clock() - self.started
        self.took[cell["phase"]].append(took)
        if not self.costs.new:  # cells set without begin (tests): their warm-ups, in order
            self.costs.plan(self.cells)
        self.costs.observe(cell, record, took)
        self.done += 1
        self.started = 0.0
        if self.meter:
            self.meter.stop()

    def cell_done(self, cell: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        self._count_done(cell, record)
        print(
            f"[{self.done}/{len(self.cells)}] {shown_label(cell)}: {_figure(record)} "
            f"(ETA {_clock(self.eta_s())})",
            file=self.out,
            flush=True,
        )

    def end(self) -> None:
        if self.meter:
            self.meter.stop()


class RichDisplay(Display):
    """The terminal's: one bar over the cells, the current cell and its live tok/s."""

    def __init__(self, resolved: Resolved, out: Any = None, prog: str = "speedmatrix run") -> None:
        super().__init__(resolved, out=out, prog=prog)
        self.progress: Any = None
        self.task: Any = None

    def begin(self, cells: Sequence[Mapping[str, Any]], base_url: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        super().begin(cells, base_url)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA {task.fields[eta]}"),
            console=Console(file=self.out),
            refresh_per_second=2,
            # the process's own output (a log) stays where it goes: `make demo` sends Airflow's
            # to a file, which the bar must not pull back onto the terminal
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.task = self.progress.add_task("cells", total=len(self.cells), rate="", eta="")
        self.progress.start()
        threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while self.progress is not None and self.progress.live.is_started:
            rate = self.meter.rate() if self.meter else None
            self.progress.update(
                self.task,
                rate=rate_text(getattr(self, "phase", ""), rate),
                eta=_clock(self.eta_s()),
            )
            time.sleep(0.5)

    def cell_started(self, cell: Mapping[str, Any]) -> None:
        super().cell_started(cell)
        self.progress.update(self.task, description=shown_label(cell))
        self.phase = str(cell.get("phase"))

    def cell_done(self, cell: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        self._count_done(cell, record)
        self.progress.console.print(f"{shown_label(cell)}: {_figure(record)}")
        self.progress.update(self.task, completed=self.done)

    def end(self) -> None:
        super().end()
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class RateMeter:
    """The server's token rate now: its /metrics counter (generated tokens for a decode
    cell, prompt tokens for a prefill) read once a second in a thread of its own."""

    COUNTERS: ClassVar[dict[str, str]] = {
        "decode": "vllm:generation_tokens_total",
        "burst": "vllm:generation_tokens_total",
        "prefill": "vllm:prompt_tokens_total",
    }

    def __init__(self, base_url: str, read: Callable[[], str] | None = None) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.read = read or self._read
        self._last: tuple[float, float] | None = None
        self._rate: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> str:
        with urllib.request.urlopen(self.url, timeout=2) as resp:
            return resp.read().decode("utf-8", "replace")

    def start(self, phase: str) -> None:
        self.stop()
        self._stop = threading.Event()
        self._last, self._rate = None, None
        self._thread = threading.Thread(target=self._poll, args=(phase,), daemon=True)
        self._thread.start()

    def _poll(self, phase: str) -> None:
        from speedmatrix.loadgen.prometheus import parse_metrics

        while not self._stop.is_set():
            try:
                value = parse_metrics(self.read()).get(self.COUNTERS[phase])
            except (OSError, ValueError):
                value = None
            now = time.monotonic()
            if value is not None:
                if self._last is not None and now > self._last[0]:
                    self._rate = max(0.0, (value - self._last[1]) / (now - self._last[0]))
                self._last = (now, value)
            self._stop.wait(1.0)

    def rate(self) -> float | None:
        return self._rate

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3)
            self._thread = None


def _clock(seconds: float) -> str:
    s = round(seconds)
    return (
        f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )
