"""`speedmatrix run` runs the DAG's steps, all of them (issue #34 item 1): one code path.

Read from the sources (no Airflow import): every `matrix.<step>(…)` the speed_matrix DAG's
tasks call is called by the command too, so a step added to the DAG and not to the command
(as `regressions` once was: CLI runs landed no comparisons) fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What only the DAG needs: the verdict Assets' payload (an Airflow event, nothing landed).
DAG_ONLY = {"verdicts_landed"}


def _matrix_calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "matrix"
    }


def test_the_command_calls_every_step_the_dag_calls() -> None:
    dag = _matrix_calls(ROOT / "dags" / "speed_matrix.py")
    cli = _matrix_calls(ROOT / "plugins" / "speedmatrix" / "cli" / "run.py")
    assert {"land", "report", "regressions", "teardown"} <= dag  # the reading works
    assert dag - DAG_ONLY <= cli, f"steps of the DAG the command skips: {dag - DAG_ONLY - cli}"


def test_the_command_measures_cells_in_the_dags_order() -> None:
    """The DAG maps plan.task_cells(planned, "prefill") then (…, "decode"): a context's
    prefill, then its decode cells. The command measures the same list, not all prefills first."""
    tree = ast.parse((ROOT / "plugins" / "speedmatrix" / "cli" / "run.py").read_text())
    calls = [
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "task_cells"
        and isinstance(node.args[1], ast.Constant)
    ]
    assert calls == ["prefill", "decode"]
