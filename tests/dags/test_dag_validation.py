"""DAG validation: every DAG imports cleanly and light, is owned, tagged, has a retries policy
and execution timeouts; speed_matrix's shape (lease, setup/teardown, serial mapped cells,
Assets) and its Params reject a bad conf before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
DAG_FILES = sorted(p for p in DAGS.glob("*.py") if not p.name.startswith("_"))
# Modules a DAG file must not import at parse time: they cost seconds on every parse loop.
HEAVY = ("great_expectations", "pandas", "pyarrow", "duckdb", "matplotlib", "aiohttp", "jinja2.ext")
HOST_TASKS = {"wait_for_host", "setup_server", "inspect", "prefill", "decode", "stop_server"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_dag_files_exist():
    assert {p.stem for p in DAG_FILES} >= {"speed_matrix"}


def test_every_dag_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert "speed_matrix" in dagbag.dag_ids


# One process parses every DAG file, each in a child forked from it after Airflow's SDK is
# imported (and checked light): each file starts from the same clean state, as in a process of
# its own, without paying for a new interpreter and Airflow's import per file.
_PARSE_EACH = """
import json, os, runpy, sys, traceback
HEAVY = json.loads(sys.argv[1])
import airflow.sdk  # every DAG file's first import; checked light below
result = {"<base>": sorted(m for m in HEAVY if m in sys.modules)}
for path in sys.argv[2:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            runpy.run_path(path)
            out = {"heavy": sorted(m for m in HEAVY if m in sys.modules)}
        except BaseException:
            out = {"error": traceback.format_exc()[-2000:]}
        with os.fdopen(w, "w") as fh:
            fh.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    result[path] = json.loads(text) if text else {"error": f"child ended with status {status}"}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def parsed_alone() -> dict:
    """Per DAG file, the heavy modules its parse imported (or its error); ``"<base>"``: those
    that Airflow's SDK import alone brought."""
    out = subprocess.run(
        [sys.executable, "-c", _PARSE_EACH, json.dumps(HEAVY), *map(str, DAG_FILES)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_parse_base_imports_nothing_heavy(parsed_alone):
    # what each file is checked against: were the SDK heavy, every file would look heavy-free
    assert parsed_alone["<base>"] == []


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_parses_without_heavy_imports(path, parsed_alone):
    # Fast parsing, checked without a clock: the file must not pull the heavy libraries
    # (they are imported inside the tasks that use them).
    got = parsed_alone[str(path)]
    assert "error" not in got, got.get("error")
    assert got["heavy"] == []


def test_every_dag_is_owned_tagged_with_a_retries_policy(dagbag):
    for dag in dagbag.dags.values():
        assert dag.tags, dag.dag_id
        assert dag.owner and dag.owner != "airflow", dag.dag_id
        assert "retries" in dag.default_args, f"{dag.dag_id}: no retries policy"


def test_tasks_touching_a_host_have_execution_timeouts(dagbag):
    # speed_matrix: every task (most touch the host; the rest are bounded anyway); elsewhere,
    # any SSH operator or sensor.
    for dag in dagbag.dags.values():
        for t in dag.tasks:
            touches = dag.dag_id == "speed_matrix" or "SSH" in type(t).__name__
            if touches:
                assert t.execution_timeout is not None, f"{dag.dag_id}.{t.task_id}: no timeout"


def test_speed_matrix_tasks_touching_the_host(dagbag):
    dag = dagbag.dags["speed_matrix"]
    tasks = dag.task_dict
    assert set(tasks) >= HOST_TASKS
    for tid in HOST_TASKS:
        assert tasks[tid].execution_timeout <= timedelta(hours=4), tid
    # retries only where a step is idempotent
    for tid in ("setup_server", "prefill", "decode", "resolve", "conclude"):
        assert tasks[tid].retries == 0, tid
    for tid in ("inspect", "land", "report", "stop_server"):
        assert tasks[tid].retries >= 1, tid


def test_speed_matrix_shape(dagbag):
    dag = dagbag.dags["speed_matrix"]
    t = dag.task_dict
    assert dag.schedule is None or str(dag.timetable.summary) in ("None", "Never")
    sensor = t["wait_for_host"]
    assert sensor.mode == "reschedule"  # waits without holding a worker slot
    assert sensor.is_setup and t["setup_server"].is_setup
    assert t["stop_server"].is_teardown
    assert {"wait_for_host", "setup_server"} <= t["stop_server"].upstream_task_ids
    for tid in ("prefill", "decode"):
        # one cell measuring, the next one starting; flows/turn.py keeps the host to one
        assert t[tid].max_active_tis_per_dagrun == 2
        assert t[tid].map_index_template == "{{ cell_label }}"
    # decode beside prefill, not after it: its first cell waits for the last prefill cell
    # (flows/turn.py), so the hand-off between them costs no task start-up (#19). No gate task,
    # no edge; the setups reach decode through its cell list, which comes after prefill's, and
    # prefill weighs more, so the scheduler queues prefill's instances first.
    assert t["decode"].upstream_task_ids == {"resolve", "decode_cells"}
    assert "prefill_done" not in t
    assert "setup_server" in t["decode_cells"].get_flat_relative_ids(upstream=True)
    assert t["decode_cells"].upstream_task_ids == {"plan", "prefill_cells"}
    # the scheduler queues by weight; Airflow's default rule: own + every downstream task's
    weight = {
        tid: t[tid].priority_weight
        + sum(t[x].priority_weight for x in t[tid].get_flat_relative_ids(upstream=False))
        for tid in ("prefill", "decode")
    }
    assert weight["prefill"] > weight["decode"], weight
    assert {"prefill", "decode"} <= t["stop_server"].upstream_task_ids
    assert t["validate"].trigger_rule == "all_done"
    # validation needs the cells, not the host: beside the stop, not after it (#19)
    assert t["validate"].upstream_task_ids == {"resolve", "prefill", "decode"}
    assert {a.uri for a in t["land"].outlets} == {
        "speedmatrix://warehouse/runs",
        "speedmatrix://warehouse/cells",
        "speedmatrix://warehouse/requests",
    }
    assert t["conclude"].downstream_task_ids == set()
    # report and regressions side by side, both after land (which hands on the comparison)
    assert t["report"].upstream_task_ids == {"resolve", "land"}
    assert t["regressions"].upstream_task_ids == {"resolve", "land"}


def test_speed_matrix_maps_cells_in_the_plans_run_order(dagbag):
    """Issue #19: the scheduler starts a mapped task's instances in map index order, and
    decode's first cell waits for prefill's last (flows/turn.py), so the lists the two cell
    tasks map over, one after the other, must be the plan's run order (prefill then decode
    per context: each prompt prefilled once)."""
    from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix

    t = dagbag.dags["speed_matrix"].task_dict
    spec = MatrixSpec.build(
        prefill_contexts=["8K", "16K", "256K"],
        contexts=["8K", "16K"],
        concurrencies=[1, 2],
        max_output_tokens=512,
        window_s=2,
    )
    planned = plan_matrix(spec, KvCapacity(40_000, 16), repeats=2).as_dict()
    planned = json.loads(json.dumps(planned))  # as XCom hands it over
    mapped = {tid: t[f"{tid}_cells"].python_callable(planned, tid) for tid in ("prefill", "decode")}
    assert t["prefill_cells"].downstream_task_ids == {"prefill", "decode_cells"}
    assert t["decode_cells"].downstream_task_ids == {"decode"}
    labels = [c["label"] for c in [*mapped["prefill"], *mapped["decode"]]]
    assert labels[:6] == ["256K", "8K", "8K x 1", "8K x 2", "prefill 16K", "16K x 1"]
    assert [
        c["label"].removeprefix("prefill ") for c in [*mapped["prefill"], *mapped["decode"]]
    ] == [c["label"] for c in planned["order"]]


def _check(dag, conf: dict) -> None:
    """What the scheduler / API do with a trigger's conf: the serialized DAG's Params,
    deep-merged with the conf, validated (before any task runs)."""
    from airflow.serialization.serialized_objects import DagSerialization

    serialized = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    serialized.params.deep_merge(conf).validate()


GOOD = {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"}


@pytest.mark.parametrize(
    "conf",
    [
        {},
        {"recipe": ""},
        {**GOOD, "concurrencies": [0]},
        {**GOOD, "concurrencies": [1, 1]},
        {**GOOD, "contexts": ["64M"]},
        {**GOOD, "contexts": []},
        {**GOOD, "window_s": -1},
        {**GOOD, "max_output_tokens": 1},
        {**GOOD, "prompt_mode": "weird"},
        {**GOOD, "engine_ref": "banana"},
        {**GOOD, "port": 70000},
        {**GOOD, "repeats": 0},
        {**GOOD, "repeats": 11},
        {**GOOD, "repeats": 2.5},
        {**GOOD, "repeat_cells": []},
        {**GOOD, "repeat_cells": "8Kx1"},
        {**GOOD, "repeat_cells": ["8Kx1", "8Kx1"]},
    ],
    ids=lambda c: json.dumps(c)[:60],
)
def test_params_reject_bad_conf(dagbag, conf):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=r"Invalid input for param"):
        _check(dagbag.dags["speed_matrix"], conf)


@pytest.mark.parametrize(
    "conf",
    [
        GOOD,
        {
            **GOOD,
            "engine_ref": "9fedd24fa864",
            "contexts": ["8K", 65536],
            "concurrencies": [1, 16],
            "prefill_contexts": ["8K"],
            "window_s": 5,
            "max_output_tokens": 4096,
            "prompt_mode": "shared",
            "ssh_conn_id": "gpu7",
            "warehouse": "s3://bucket/wh",
        },
        {**GOOD, "engine_ref": "pr/12345"},
        {**GOOD, "engine_ref": "v0.29.0"},
        {**GOOD, "repeats": 3, "repeat_cells": ["8Kx1", "prefill 8K"]},
        {**GOOD, "repeats": 10},
    ],
)
def test_params_accept_good_conf(dagbag, conf):
    _check(dagbag.dags["speed_matrix"], conf)


def test_params_are_documented(dagbag):
    """Every conf key resolve takes (runconf.CONF_KEYS: workload, host_home and port too) is a
    Param of the loaded DAG, and none is undocumented (issue #33: the list here was written by
    hand and missed three)."""
    from speedmatrix.flows.runconf import CONF_KEYS

    params = dagbag.dags["speed_matrix"].params
    assert set(params.keys()) == set(CONF_KEYS)
    for name in CONF_KEYS:  # plain, or Markdown (the form shows one or the other)
        param = params.get_param(name)
        assert (param.description or param.schema.get("description_md") or "").strip(), name


def test_a_regression_fails_its_task_without_a_retry(dagbag, monkeypatch):
    """regressions retries once for a failed GitHub or warehouse read; a regression found
    must fail at once (seen in the deployment: the alert came again 30 s later, by retry)."""
    from airflow.sdk.exceptions import AirflowFailException

    import speedmatrix.analysis.compare as compare
    from speedmatrix.analysis.verdict import RegressionError

    def found(*args, **kwargs):
        raise RegressionError("8Kx1 total_tok_s -30% vs baseline run-a")

    monkeypatch.setattr(compare, "judge_regressions", found)
    task = dagbag.dags["speed_matrix"].get_task("regressions")
    assert task.retries == 1
    # `land`'s XCom as the task reads it: a whole Landing (flows/contracts.py)
    landed = {"run_id": "run-b", "status": "success", "warehouse": "/nonexistent", "cells": 1,
              "requests": 0, "repeats": 0, "quarantined": [], "failed": [],
              "failed_repeats": []}  # fmt: skip
    # `resolve`'s XCom as the task reads it: a whole run description (values checked)
    import datetime as dt

    from speedmatrix.flows.resolution import resolve

    resolved = resolve(
        {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "warehouse": "/nonexistent"},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=dt.datetime(2026, 11, 29, tzinfo=dt.UTC),
    )
    with pytest.raises(AirflowFailException, match="8Kx1 total_tok_s"):
        task.python_callable(resolved, landed)

    def transient(*args, **kwargs):
        raise ConnectionError("GitHub unreachable")

    monkeypatch.setattr(compare, "judge_regressions", transient)
    with pytest.raises(ConnectionError):  # left to the retry
        task.python_callable(resolved, landed)


def test_speed_matrix_alerts_and_verdict_assets(dagbag):
    """A failed run calls the alert notifier; the verdict Assets come from a teardown after
    `regressions`, so they are emitted for a regressed run too and its success never makes a
    regressed run look clean (regressions stays a leaf for the run's state)."""
    from airflow.sdk import BaseNotifier

    from speedmatrix.flows.notifier import RunNotifier

    dag = dagbag.dags["speed_matrix"]
    callbacks = dag.on_failure_callback
    assert isinstance(callbacks, list) and any(isinstance(c, RunNotifier) for c in callbacks)
    assert all(isinstance(c, BaseNotifier) for c in callbacks)
    # a run that succeeded calls it too (issue 40): a new change point fails no run, and is
    # alerted; a clean run sends nothing (notify.deliver: only an alarming summary is sent)
    success = dag.on_success_callback
    assert isinstance(success, list) and any(isinstance(c, RunNotifier) for c in success)
    assert [c.on for c in success] == ["success"] and {c.on for c in callbacks} == {"failure"}
    t = dag.task_dict
    assert t["verdicts"].upstream_task_ids == {"regressions", "resolve"}
    assert t["verdicts"].is_teardown and not t["verdicts"].on_failure_fail_dagrun
    assert {a.uri for a in t["verdicts"].outlets} == {
        "speedmatrix://warehouse/comparisons",
        "speedmatrix://warehouse/noise",
    }


def test_example_consumer_is_paused_and_follows_the_verdicts(dagbag):
    """The example consumer is harmless (paused when created, reads only) and scheduled on
    the Asset speed_matrix's `verdicts` emits, not on cells (which land before verdicts)."""
    dag = dagbag.dags["example_consumer_verdicts"]
    assert dag.is_paused_upon_creation is True
    names = {getattr(a, "name", None) for a in dag.timetable.asset_condition.objects}
    assert names == {"speedmatrix_comparisons"}
    emitted = {a.name for a in dagbag.dags["speed_matrix"].task_dict["verdicts"].outlets}
    assert names <= emitted


def test_site_task_refreshes_the_site_after_the_verdicts_and_never_fails_the_run(dagbag):
    """`site` runs after `report` (the run's kept charts) and `regressions` whatever it
    decided (a teardown: also after a regression, which the site must show) and its failure does not fail the DAG run; its extra
    link is serialized as an XCom link, which the API server reads with no plugin."""
    from airflow.serialization.serialized_objects import DagSerialization

    from speedmatrix.flows.site import LINK_NAME, SiteOperator

    dag = dagbag.dags["speed_matrix"]
    site = dag.task_dict["site"]
    assert isinstance(site, SiteOperator)
    assert site.upstream_task_ids == {"report", "regressions", "resolve"}
    assert site.is_teardown and not site.on_failure_fail_dagrun
    assert site.downstream_task_ids == set()
    data = DagSerialization.to_dict(dag)
    task = next(t["__var"] for t in data["dag"]["tasks"] if t["__var"]["task_id"] == "site")
    assert task["_operator_extra_links"] == {LINK_NAME: "_link_SiteLink"}


def test_speed_matrix_pushes_no_xcom_per_key(dagbag):
    """Issue #19: a task returning a dict would push every key as an XCom of its own (Airflow
    infers multiple_outputs from a `-> dict` annotation), one execution-API call per key that
    nothing reads, in the hand-offs the host waits through. Each pushes its return_value only."""
    dag = dagbag.dags["speed_matrix"]
    splitting = [t.task_id for t in dag.tasks if getattr(t, "multiple_outputs", False)]
    assert splitting == []
    # the check sees the flag: the cells are mapped tasks, and resolve returns a dict
    assert dag.task_dict["decode"].multiple_outputs is False
    assert dag.task_dict["resolve"].python_callable.__annotations__["return"] in (dict, "dict")


def test_hand_offs_cross_xcom_as_plain_json_and_are_checked_as_read(dagbag):
    """A task reads what it takes through its contract and hands on the wire form
    (flows/contracts.py): `plan` given `inspect`'s XCom returns a plain JSON Planned; a task
    given another task's value fails there, naming the hand-off and the keys."""
    import datetime as dt
    import json

    from speedmatrix.flows import resolution
    from speedmatrix.flows.contracts import PLAN, HandoffError

    resolved = resolution.resolve(
        {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "contexts": ["8K"], "concurrencies": [1]},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC),
    )
    info = {"version": "0.1.0", "commit": None, "kv_num_blocks": 1500, "kv_block_size": 16,
            "kv_cache_tokens": 24000, "max_model_len": 262144, "gpu": None, "gpu_count": None,
            "launch_command": "vllm serve m", "hardware": {}, "sim_profile": None}  # fmt: skip
    dag = dagbag.dags["speed_matrix"]
    planned = dag.get_task("plan").python_callable(resolved, json.loads(json.dumps(info)))
    assert json.loads(json.dumps(planned)) == planned
    assert PLAN.from_wire(planned)["prefill"]
    with pytest.raises(HandoffError, match=r"server info \(inspect\): missing \['commit'"):
        dag.get_task("plan").python_callable(resolved, {"run_id": "x"})
    with pytest.raises(HandoffError, match=r"server hand-off \(setup_server\)"):
        dag.get_task("inspect").python_callable(resolved, info)
