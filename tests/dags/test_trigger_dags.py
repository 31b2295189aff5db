"""DAG validation for speed_matrix_nightly and vllm_commit_watch (parsed by a real DagBag)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import requests
from airflow.dag_processing.dagbag import DagBag

REPO = Path(__file__).resolve().parents[2]
FILES = {
    "speed_matrix_nightly": REPO / "dags" / "speed_matrix_nightly.py",
    "vllm_commit_watch": REPO / "dags" / "vllm_commit_watch.py",
}


def _parse(dag_id: str):
    bag = DagBag(dag_folder=str(FILES[dag_id]))
    assert bag.import_errors == {}, bag.import_errors
    return bag.dags[dag_id]  # no DB: validation needs no metadata database


@pytest.fixture
def no_network(monkeypatch):
    """Parsing a DAG file must not call GitHub (the scheduler parses every few seconds)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network call while parsing a DAG: {args[1:3]}")

    monkeypatch.setattr(requests.Session, "request", refuse)


@pytest.mark.parametrize("dag_id", sorted(FILES))
def test_dag_parses_without_io_and_follows_the_house_rules(dag_id, no_network):
    dag = _parse(dag_id)
    assert dag is not None
    assert "speedmatrix" in dag.tags and "trigger" in dag.tags
    assert dag.catchup is False
    assert dag.max_active_runs == 1
    assert dag.doc_md
    for task in dag.tasks:
        assert task.owner == "speedmatrix", task.task_id
        assert task.retries >= 1, task.task_id  # every task here is idempotent
        assert task.execution_timeout is not None, task.task_id
        assert task.execution_timeout <= timedelta(minutes=10), task.task_id


@pytest.mark.parametrize("dag_id", sorted(FILES))
def test_trigger_task_targets_speed_matrix_and_skips_existing_runs(dag_id):
    dag = _parse(dag_id)
    trigger = dag.get_task("trigger_speed_matrix")
    assert type(trigger).__name__ == "MappedOperator"
    assert trigger.operator_class.__name__ == "TriggerDagRunOperator"
    partial = trigger.partial_kwargs
    assert partial["trigger_dag_id"] == "speed_matrix"
    assert partial["skip_when_already_exists"] is True
    assert not partial.get("reset_dag_run")  # never clear and re-run a benchmark
    assert not partial.get("wait_for_completion")  # triggering never holds a worker slot


def test_nightly_schedule_is_02_utc_by_default():
    dag = _parse("speed_matrix_nightly")
    assert type(dag.timetable).__name__ == "CronTriggerTimetable"
    assert dag.timetable.expression == "0 2 * * *"
    assert str(dag.timetable.timezone) in ("UTC", "Timezone('UTC')")
    assert [t.task_id for t in dag.topological_sort()] == [
        "resolve_head",
        "plan",
        "trigger_speed_matrix",
    ]


def test_commit_watch_saves_state_only_after_the_triggers():
    dag = _parse("vllm_commit_watch")
    save = dag.get_task("save_state")
    assert "trigger_speed_matrix" in save.upstream_task_ids
    assert save.trigger_rule == "none_failed_min_one_success"
    # no api_url: the GitHub API is the deployment's, never a conf's (issue #16 item 1)
    assert set(dag.params.keys()) == {"max_commits", "wait_for_wheel"}
    assert "api_url" not in _parse("speed_matrix_nightly").params
    bisect = DagBag(dag_folder=str(REPO / "dags" / "speed_matrix_bisect.py"))
    assert "api_url" not in bisect.dags["speed_matrix_bisect"].params


def test_schedules_come_from_the_recipe_set_config(tmp_path, monkeypatch):
    cfg = tmp_path / "_schedule.yaml"
    cfg.write_text("nightly: {cron: '30 3 * * *'}\ncommit_watch: {cron: '*/5 * * * *'}\n")
    monkeypatch.setenv("SPEEDMATRIX_SCHEDULE", str(cfg))
    assert _parse("speed_matrix_nightly").timetable.expression == "30 3 * * *"
    assert _parse("vllm_commit_watch").timetable.expression == "*/5 * * * *"
