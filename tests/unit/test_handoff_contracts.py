"""The typed hand-offs (flows/contracts.py): each round-trips through its wire form and JSON
unchanged, and a value that is not the hand-off fails where it is read, naming what is wrong."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from speedmatrix.flows import matrix, resolution
from speedmatrix.flows.contracts import INFO, LANDING, PLAN, SERVER, HandoffError
from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)

SERVER_VALUE = {
    "handle": {"host": "local", "pid": 4242, "base_url": "http://127.0.0.1:8000"},
    "base_url": "http://127.0.0.1:8000",
    "python": "/home/u/.speedmatrix/envs/x/bin/python",
    "loadgen": None,
    "engine_version": "0.1.dev1+g9fedd24fa",
    "engine_commit": "9fedd24fa864" + "0" * 28,
    "provision_s": 1.25,
    "start_s": 3.5,
}
INFO_VALUE = {
    "version": "0.1.dev1+g9fedd24fa",
    "commit": None,
    "kv_num_blocks": 16498,
    "kv_block_size": 16,
    "kv_cache_tokens": 263968,
    "max_model_len": 262144,
    "gpu": "NVIDIA RTX PRO 6000",
    "gpu_count": 8,
    "launch_command": "vllm serve m --api-key <redacted>",
    "hardware": {"gpus": [{"name": "NVIDIA RTX PRO 6000"}], "gpu_count": 8},
    "sim_profile": "kimi-k2.7-nvfp4-rtxpro6k-x8",
}
LANDING_VALUE = {
    "run_id": "sim__v0.29.0__manual__20261129T203005Z__a1",
    "status": "failed",
    "warehouse": "/tmp/wh",
    "cells": 18,
    "requests": 240,
    "repeats": 0,
    "quarantined": [],
    "failed": ["decode 64K x 16: server not healthy before the cell: refused"],
    "failed_repeats": [],
}


def _plan_value() -> dict:
    spec = MatrixSpec.build(
        prefill_contexts=[8192],
        contexts=[8192, 16384],
        concurrencies=[1, 2],
        max_output_tokens=64,
        window_s=5.0,
        prompt_mode="distinct",
        workload="article",
    )
    return plan_matrix(spec, KvCapacity(num_blocks=1500, block_size=16)).as_dict()


CASES = [
    (SERVER, SERVER_VALUE),
    (INFO, INFO_VALUE),
    (PLAN, None),  # made by the planner itself
    (LANDING, LANDING_VALUE),
]


def _value(contract, value):
    return _plan_value() if value is None else dict(value)


@pytest.mark.parametrize(("contract", "value"), CASES, ids=lambda c: getattr(c, "name", ""))
def test_round_trip_through_json(contract, value):
    typed = _value(contract, value)
    wire = contract.to_wire(typed)
    assert json.loads(json.dumps(wire)) == wire  # what XCom stores is plain JSON
    assert contract.from_wire(json.loads(json.dumps(wire))) == typed


@pytest.mark.parametrize(("contract", "value"), CASES, ids=lambda c: getattr(c, "name", ""))
def test_a_missing_key_fails_naming_it(contract, value):
    wire = contract.to_wire(_value(contract, value))
    key = sorted(contract.required)[0]
    del wire[key]
    with pytest.raises(HandoffError) as err:
        contract.from_wire(wire)
    assert str(err.value) == f"{contract.name}: missing ['{key}']"


@pytest.mark.parametrize(("contract", "value"), CASES, ids=lambda c: getattr(c, "name", ""))
def test_an_unknown_key_fails_naming_it(contract, value):
    wire = {**contract.to_wire(_value(contract, value)), "surprise": 1}
    with pytest.raises(HandoffError, match=r"unknown \['surprise'\]"):
        contract.from_wire(wire)
    with pytest.raises(HandoffError, match="surprise"):
        contract.to_wire(wire)


def test_another_tasks_value_is_refused():
    """The shapes are apart: a task fed the wrong XCom (the landing for the server) says so."""
    with pytest.raises(HandoffError, match=r"server hand-off \(setup_server\): missing"):
        SERVER.from_wire(LANDING_VALUE)
    with pytest.raises(HandoffError, match="expected an object, got list"):
        PLAN.from_wire([])
    assert SERVER.from_wire_or_none(None) is None


def test_optional_keys_may_be_absent_or_present():
    """`existing` marks only a server already running; `order` is absent from older plans."""
    assert "existing" not in SERVER.from_wire(SERVER_VALUE)
    assert SERVER.from_wire({**SERVER_VALUE, "existing": True})["existing"] is True
    older = {k: v for k, v in _plan_value().items() if k != "order"}
    assert PLAN.from_wire(older) == older


def test_to_wire_refuses_what_json_cannot_carry():
    with pytest.raises(HandoffError, match="not JSON"):
        LANDING.to_wire({**LANDING_VALUE, "warehouse": object()})


def test_the_plan_step_returns_its_contract():
    """What `plan` makes from a ServerInfo is a Planned, whole (its wire form is unchanged)."""
    resolved = resolution.resolve(
        {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "contexts": ["8K"], "concurrencies": [1]},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=WHEN,
    )
    planned = matrix.plan(resolved, INFO.from_wire(INFO_VALUE))
    assert PLAN.from_wire(PLAN.to_wire(planned)) == planned
    assert set(planned) == PLAN.keys
