"""Every hand-off checks the values it carries, not only its keys (issue #41): a wrong value is
refused where the next task reads it, and the error names the hand-off, the field and the
value. One case per contract: a value of the right key and the wrong kind or range."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from test_handoff_contracts import INFO_VALUE, LANDING_VALUE, SERVER_VALUE, _plan_value

from speedmatrix.flows import resolution
from speedmatrix.flows.bisect_steps import BISECT_JOB, BISECT_STEP
from speedmatrix.flows.contracts import (
    CELL_RESULT,
    INFO,
    LANDING,
    PLAN,
    RESOLVED,
    SERVER,
    TEARDOWN,
    VALIDATED,
    HandoffError,
)

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)


def resolved_value() -> dict:
    return resolution.resolve(
        {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "contexts": ["8K"], "concurrencies": [1]},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=WHEN,
    )


CELL_RESULT_VALUE = {"cell": {"phase": "decode"}, "requests": [], "repeat": 0}
# what engine.vllm_server.stop_server returns (as a DAG run's teardown lands it)
_STOP = {"pid": 22999, "was_running": False, "gone": None, "killed": False, "left": []}
TEARDOWN_VALUE = {
    "stopped": _STOP,
    "all_stopped": [_STOP],
    "from_records": [],
    "lease": "released",
}
VALIDATED_VALUE = {
    "run": {"run_id": "r1"},
    "cells": [],
    "requests": [],
    "repeats": [],
    "quarantined": [],
    "gx_results": "/wh/artifacts/r1/validation/gx-results.json",
}
STATE = {"commits": ["a" * 40, "b" * 40], "candidates": ["a" * 40, "b" * 40], "no_wheel": [], "lo": 0, "hi": 1,
         "measured": [], "skipped": []}  # fmt: skip
JOB_VALUE = {
    "recipe": "sim/x", "host": "local", "good": "0" * 40, "bad": "b" * 40, "cells": ["8Kx1"],
    "good_run_id": "r0", "threshold": 0.03, "warehouse": None, "conf": {"recipe": "sim/x"},
    "state": STATE,
}  # fmt: skip
STEP_VALUE = {"job": JOB_VALUE, "commit": "a" * 40, "conf": {"engine_ref": "a" * 40},
              "trigger_run_id": "bisect__x__01"}  # fmt: skip

# (contract, a good value, the field made wrong, the wrong value, what the error must say)
CASES = [
    (SERVER, SERVER_VALUE, "provision_s", "slow", "provision_s"),
    (SERVER, SERVER_VALUE, "start_s", -1.0, "start_s"),
    (INFO, INFO_VALUE, "kv_num_blocks", "16498", "kv_num_blocks"),
    (INFO, INFO_VALUE, "kv_block_size", -16, "kv_block_size"),
    (PLAN, None, "prefill", "8K", "prefill"),
    (LANDING, LANDING_VALUE, "status", "great", "status"),
    (LANDING, LANDING_VALUE, "cells", -1, "cells"),
    (RESOLVED, "resolved", "port", 70000, "port"),
    (RESOLVED, "resolved", "trigger", "whenever", "trigger"),
    (RESOLVED, "resolved", "repeats", 0, "repeats"),
    (RESOLVED, "resolved", "recipe_sha256", "not-a-hash", "recipe_sha256"),
    (RESOLVED, "resolved", "matrix", {"contexts": "8K"}, "matrix"),
    (VALIDATED, VALIDATED_VALUE, "cells", {"phase": "decode"}, "cells"),
    (CELL_RESULT, CELL_RESULT_VALUE, "repeat", -1, "repeat"),
    (CELL_RESULT, CELL_RESULT_VALUE, "cell", None, "cell"),
    (TEARDOWN, TEARDOWN_VALUE, "all_stopped", "stopped", "all_stopped"),
    (BISECT_JOB, JOB_VALUE, "threshold", "3%", "threshold"),
    (BISECT_JOB, JOB_VALUE, "cells", "8Kx1", "cells"),
    (BISECT_STEP, STEP_VALUE, "commit", "not a commit", "commit"),
]


def good(value):
    if value is None:
        return _plan_value()
    if value == "resolved":
        return resolved_value()
    return json.loads(json.dumps(value))


@pytest.mark.parametrize(
    ("contract", "value", "field", "wrong", "named"),
    CASES,
    ids=[f"{c.name.split(' (')[0]}-{f}" for c, _, f, _, _ in CASES],
)
def test_a_wrong_value_is_refused_naming_the_field(contract, value, field, wrong, named):
    right = good(value)
    assert contract.from_wire(right) == right  # the good value passes, on both sides
    assert contract.to_wire(right) == right
    bad = {**right, field: wrong}
    for way in (contract.from_wire, contract.to_wire):
        with pytest.raises(HandoffError) as err:
            way(bad)
        said = str(err.value)
        assert said.startswith(contract.name + ": "), said
        assert named in said and repr(wrong)[:20] in said, said


def test_a_wrong_value_deep_inside_is_named_by_its_path():
    job = {**good(JOB_VALUE), "state": {**STATE, "lo": "zero"}}
    with pytest.raises(HandoffError, match=r"state\.lo: .*integer \(got 'zero'\)"):
        BISECT_JOB.from_wire(job)
    resolved = good("resolved")
    resolved["matrix"] = {**resolved["matrix"], "concurrencies": [1, 0]}
    with pytest.raises(HandoffError, match=r"matrix\.concurrencies\[1\]: .*(got 0)"):
        RESOLVED.from_wire(resolved)


def test_the_resolve_step_returns_a_checked_run_description():
    r = resolved_value()
    assert RESOLVED.from_wire(json.loads(json.dumps(RESOLVED.to_wire(r)))) == r
