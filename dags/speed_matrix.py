"""speed_matrix: one speed test matrix = one recipe x one engine ref x one host.

resolve -> wait_for_host (lease; reschedules, holds no worker slot) -> setup_server (provision +
start) -> inspect -> plan -> prefill[8K…], decode[8K x 1…] -> stop_server (teardown: always,
stops the server, releases the lease) ; validate (Great Expectations) -> land (Assets; compares
the run with its baseline, once) -> report -> conclude (fails the run if a cell failed, after
everything measured has landed); land -> regressions (judges that comparison, beside report;
fails the run on a regression) -> verdicts (a teardown: emits the comparisons / noise Assets
whatever regressions decided); report and regressions -> site (a teardown: refreshes the
static site, SPEEDMATRIX_SITE_DIR, and links the run's page on it from the task, "Speed matrix
site"; its failure never fails the run).
A failed DAG run (a failed cell, a regression, anything else) calls RunNotifier: mail and chat
alerts where the deployment switched them on (speedmatrix.flows.notify). A run that succeeded
calls it too: a new change point of the recipe's history is alerted; a clean run sends nothing.

Cells run in the plan's order (plan.run_order), context by context: the context's prefill, then
its decode cells C ascending, so each prompt is prefilled once. `prefill` maps the prefill cells
at the head of that order, `decode` the rest, later contexts' prefill cells included (map index
`prefill 16K`); the scheduler starts each in map index order. Two instances of a cell task
run at once: the next one starts (process, DAG file, imports) while the previous cell measures,
then waits until that cell has left the host (it says so as its turn ends) before it touches the
host (flows/turn.py), so the host measures one cell at a time and a hand-off costs it a fraction
of a second, not a task start-up. The same holds where the two tasks meet: `decode`
is prefill's sibling, not its downstream, and its first instance starts beside the prefill
cells and waits for the last of them.

With `repeats` > 1, decode also maps the repeated cells after the matrix, one pass after
another (map index `8K x 1 #2`); they land in cell_repeats (plan.plan_matrix).

Orchestration only: the task bodies are functions of `speedmatrix.flows.matrix`, but for
`resolve` (flows.resolution), the cell lists (plan.task_cells), the cells' turn on the host
(flows.turn, around matrix.run_cell) and `site` (flows.site's operator).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Asset, PokeReturnValue, dag, get_current_context, task

from speedmatrix.flows import dagtest, lease_holder, matrix, resolution, turn
from speedmatrix.flows.contracts import INFO, LANDING, PLAN, RESOLVED, SERVER
from speedmatrix.flows.notifier import RunNotifier
from speedmatrix.flows.params import speed_matrix_params
from speedmatrix.flows.site import SiteOperator

ASSETS = [
    Asset(name=f"speedmatrix_{t}", uri=f"speedmatrix://warehouse/{t}", group="speedmatrix")
    for t in ("runs", "cells", "requests")
]
VERDICT_ASSETS = [
    Asset(name=f"speedmatrix_{t}", uri=f"speedmatrix://warehouse/{t}", group="speedmatrix")
    for t in ("comparisons", "noise")
]
CELL_TIMEOUT = timedelta(hours=2)  # a cell bounds itself (window + first-token timeouts)
# A cell task waits for the previous cell's turn (at most that cell's own bound), then measures.
CELL_TASK_TIMEOUT = 2 * CELL_TIMEOUT
HOST_STEP_TIMEOUT = timedelta(minutes=10)
# XCom carries each hand-off in its wire form, a plain JSON object (flows/contracts.py): a task
# reads what it takes with <CONTRACT>.from_wire, which names a missing or unknown key, and
# hands on <CONTRACT>.to_wire; the steps in between take the typed values.
# Every task returning a dict says multiple_outputs=False: from a `-> dict` annotation Airflow
# infers True and pushes each key as an XCom of its own beside return_value, one execution-API
# call per key that nothing reads (resolve: 21 calls, ~0.35 s; every cell 6).

# The trigger form and the first check of a conf: sections, titles, the recipes' values,
# `8K, 16K` or JSON lists (speedmatrix.flows.params).
PARAMS = speed_matrix_params()


def _cell(resolved: dict, cell: dict, after: str | None = None) -> dict:
    """A mapped cell task's body: its label for the map index, then its cell in its turn.

    `after`: the cell task whose cells come before this task's in the run order (flows/turn.py
    owns the turn). The server's handle is pulled here, not passed as an argument: an argument
    would make the cell task a direct downstream of the setup task (the setups reach it
    through its cell list, which comes after them)."""
    ctx = get_current_context()
    ctx["cell_label"] = cell["label"]
    server = SERVER.from_wire(ctx["ti"].xcom_pull(task_ids="setup_server"))
    return matrix.run_cell(RESOLVED.from_wire(resolved), server, cell, turn.of_cell_task(after))


@dag(
    dag_id=resolution.DAG_ID,
    description="Speed test matrix of one vLLM recipe x engine ref x host",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=32,  # hosts run in parallel; one run per host is the lease's job
    params=PARAMS,
    tags=["speedmatrix", "benchmark", "vllm"],
    default_args={
        "owner": "speedmatrix",
        "retries": 0,  # only idempotent steps retry (set per task below)
        "retry_delay": timedelta(seconds=30),
        "execution_timeout": timedelta(hours=1),
    },
    doc_md=__doc__,
    on_failure_callback=[RunNotifier()],
    on_success_callback=[RunNotifier(on="success")],  # a new change point (flows/notifier.py)
)
def speed_matrix():
    @task(multiple_outputs=False, retries=0, execution_timeout=timedelta(minutes=2))
    def resolve() -> dict:
        """Validate the conf against the recipe: a bad conf fails here, touching no host."""
        ctx = get_current_context()
        dag_run = ctx["dag_run"]
        return resolution.resolve(
            ctx["params"], dag_run_id=dag_run.run_id, run_after=dag_run.run_after
        )

    @task.sensor(
        poke_interval=15,
        timeout=int(timedelta(hours=24).total_seconds()),
        mode="reschedule",
        execution_timeout=HOST_STEP_TIMEOUT,
    )
    def wait_for_host(resolved: dict) -> PokeReturnValue:
        """Take the host lease; between attempts the task gives its worker slot back. Under
        dag.test one process runs the whole run: its PID goes with the lease, so a lease
        left by a killed `make demo` is taken over, not waited out; a lease whose DAG run of
        this deployment ended or no longer exists is taken over too."""
        # `airflow dags test`: cells in order, Ctrl-C cleans up (flows/dagtest)
        if turn.in_process():
            dagtest.install_for_process()
        got = lease_holder.take_lease_in_task(
            RESOLVED.from_wire(resolved), get_current_context()["ti"], in_process=turn.in_process()
        )
        return PokeReturnValue(is_done=got is not None, xcom_value=got)

    @task(multiple_outputs=False, retries=0, execution_timeout=timedelta(hours=4))
    def setup_server(resolved: dict, lease: dict) -> dict:
        """Provision the engine env (idempotent) and start the server; not retried."""
        return SERVER.to_wire(matrix.setup(RESOLVED.from_wire(resolved)))

    @task(multiple_outputs=False, retries=2, execution_timeout=HOST_STEP_TIMEOUT)
    def inspect(resolved: dict, server: dict) -> dict:
        return INFO.to_wire(matrix.inspect(RESOLVED.from_wire(resolved), SERVER.from_wire(server)))

    @task(multiple_outputs=False, retries=1, execution_timeout=timedelta(minutes=2))
    def plan(resolved: dict, info: dict) -> dict:
        return PLAN.to_wire(matrix.plan(RESOLVED.from_wire(resolved), INFO.from_wire(info)))

    @task(multiple_outputs=False)
    def runnable(planned: dict, phase: str) -> list[dict]:
        """The cells of one mapped task, in the plan's run order (plan.task_cells): prefill
        then decode per context, so every prompt is prefilled once."""
        from speedmatrix.plan import task_cells

        return task_cells(PLAN.from_wire(planned), phase)

    @task(
        multiple_outputs=False,
        max_active_tis_per_dagrun=turn.INSTANCES_AT_ONCE,
        map_index_template="{{ cell_label }}",
        execution_timeout=CELL_TASK_TIMEOUT,
        retries=0,
        # Queued before decode's instances when both are ready: decode's first cell waits
        # for prefill's last, so prefill must have its slot.
        priority_weight=turn.EARLIER_TASK_PRIORITY,
    )
    def prefill(resolved: dict, cell: dict) -> dict:
        return _cell(RESOLVED.from_wire(resolved), cell)

    @task(
        multiple_outputs=False,
        max_active_tis_per_dagrun=turn.INSTANCES_AT_ONCE,
        map_index_template="{{ cell_label }}",
        execution_timeout=CELL_TASK_TIMEOUT,
        retries=0,
    )
    def decode(resolved: dict, cell: dict) -> dict:
        # Beside prefill, not after it: its first cell starts while the last prefill cell
        # measures and waits for it (flows/turn.py), whatever became of it.
        return _cell(RESOLVED.from_wire(resolved), cell, after="prefill")

    @task(multiple_outputs=False, retries=2, execution_timeout=HOST_STEP_TIMEOUT)
    def stop_server(resolved: dict) -> dict:
        """Stop the server and release the lease, whatever failed before."""
        ti = get_current_context()["ti"]
        server = SERVER.from_wire_or_none(ti.xcom_pull(task_ids="setup_server"))
        return matrix.teardown(RESOLVED.from_wire(resolved), server)

    @task(multiple_outputs=False, trigger_rule="all_done", retries=1)
    def validate(resolved: dict) -> dict:
        ti = get_current_context()["ti"]
        # Every map index of both cell tasks (a list, in task then map-index order); a cell
        # whose task died left nothing and is recorded as failed by the pipeline.
        results = ti.xcom_pull(task_ids=["prefill", "decode"]) or []
        return matrix.validate(
            RESOLVED.from_wire(resolved),
            INFO.from_wire_or_none(ti.xcom_pull(task_ids="inspect")),
            SERVER.from_wire_or_none(ti.xcom_pull(task_ids="setup_server")),
            PLAN.from_wire_or_none(ti.xcom_pull(task_ids="plan")),
            results,
        )

    @task(multiple_outputs=False, retries=2, outlets=ASSETS)
    def land(resolved: dict, validated: dict) -> dict:
        """Idempotent: landing a run again replaces it, so a retry never duplicates."""
        landed = matrix.land(RESOLVED.from_wire(resolved), validated)
        events = get_current_context()["outlet_events"]
        for asset in ASSETS:
            events[asset].extra = {
                "run_id": landed["run_id"],
                "status": landed["status"],
                "warehouse": landed["warehouse"],
            }
        return LANDING.to_wire(landed)

    @task(multiple_outputs=False, retries=2)
    def report(resolved: dict, landed: dict) -> dict:
        return matrix.report(RESOLVED.from_wire(resolved), LANDING.from_wire(landed))

    @task(retries=0)
    def conclude(landed: dict, paths: dict) -> str:
        return matrix.conclude(LANDING.from_wire(landed))

    @task(multiple_outputs=False, retries=1)
    def regressions(resolved: dict, landed: dict) -> dict:
        """Compare with the baseline, land the verdicts; fails (so alerting fires) on a
        regression, naming the cells, the baseline and the commits between them. The retry
        is for a failed GitHub or warehouse read; a regression found fails at once (a retry
        would only say it again 30 s later)."""
        from airflow.sdk.exceptions import AirflowFailException

        from speedmatrix.analysis.verdict import RegressionError

        try:
            # the comparison `land` made
            return matrix.regressions(RESOLVED.from_wire(resolved), LANDING.from_wire(landed))
        except RegressionError as err:
            raise AirflowFailException(str(err)) from err

    @task(multiple_outputs=False, retries=1, outlets=VERDICT_ASSETS)
    def verdicts(resolved: dict) -> dict:
        """Emit the comparisons / noise Assets once `regressions` has landed them, also when
        it failed on a regression (a failed task emits no Asset event, and a consumer must not
        wait for a clean run to see a regressed one). A teardown, so its success never hides
        the failed regressions task from the DAG run's state. Skipped (no event) when the run
        landed neither table (e.g. regressions failed before landing)."""
        from airflow.sdk.exceptions import AirflowSkipException

        landed = matrix.verdicts_landed(RESOLVED.from_wire(resolved))
        if landed is None:
            raise AirflowSkipException("no comparisons or noise landed for this run")
        events = get_current_context()["outlet_events"]
        for asset in VERDICT_ASSETS:
            events[asset].extra = landed
        return landed

    resolved = resolve()
    lease = wait_for_host(resolved)
    server = setup_server(resolved, lease)
    info = inspect(resolved, server)
    planned = plan(resolved, info)
    pre_cells = runnable.override(task_id=turn.cells_task_id("prefill"))(planned, "prefill")
    dec_cells = runnable.override(task_id=turn.cells_task_id("decode"))(planned, "decode")
    # prefill's instances exist (and are queued, by weight) no later than decode's: the first
    # decode cell waits for the last prefill cell, which must not wait for a slot behind it.
    pre_cells >> dec_cells
    pre = prefill.partial(resolved=resolved).expand(cell=pre_cells)
    dec = decode.partial(resolved=resolved).expand(cell=dec_cells)
    stop = stop_server(resolved).as_teardown(setups=[lease, server], on_failure_fail_dagrun=True)
    # prefill and decode side by side, no Airflow edge between them: the first
    # decode cell starts while the last prefill cell measures and takes the host from it as
    # one cell takes it from the previous one (flows/turn.py). With `prefill >> decode` the host
    # would sit idle for a whole task start-up there (0.71-1.52 s, the run's largest hand-off).
    [pre, dec] >> stop
    checked = validate(resolved)
    # Validation needs the cells, not the host: it runs beside the stop, not after it.
    [pre, dec] >> checked
    landed = land(resolved, checked)
    # report and regressions side by side: both take the comparison `land` made
    paths = report(resolved, landed)
    conclude(landed, paths)
    judged = regressions(resolved, landed)
    judged >> verdicts(resolved).as_teardown()
    # The site, after the page's charts are kept and the verdicts landed (also when
    # regressions failed on one: the site must show it). A teardown, so that a failed site
    # build never fails the run's result.
    [paths, judged] >> SiteOperator(task_id="site", resolved=resolved, retries=1).as_teardown()


speed_matrix()
