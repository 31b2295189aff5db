"""The speed_matrix trigger form (#34 item 9): Params in titled sections, the recipes' own
values shown where Airflow lets a form show them, contexts and concurrencies typed as
`8K, 16K` as well as JSON lists, and a bad conf still refused by the Params before any task."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from test_dag_validation import GOOD, _check, dagbag  # noqa: F401 - the module's fixture

from speedmatrix.flows import params as form
from speedmatrix.flows.resolution import ResolveError, resolve
from speedmatrix.flows.runconf import CONF_KEYS, conf_problems, normalise_conf
from speedmatrix.recipes import list_recipe_ids, load_recipe_id
from speedmatrix.records import split_list_text


def test_every_param_has_a_title_and_a_section_in_the_forms_order(dagbag):  # noqa: F811
    params = dagbag.dags["speed_matrix"].params
    assert set(params.keys()) == set(CONF_KEYS)
    sections = []
    for name in params:
        schema = params.get_param(name).schema
        assert schema.get("title") and schema.get("section"), name
        if schema["section"] not in sections:
            sections.append(schema["section"])
    assert sections == [form.RUN, form.HOST, form.MATRIX, form.PROMPTS, form.NOISE, form.OUTPUT]
    # grouped: each section's params side by side (the form lays them out in dict order)
    order = [params.get_param(n).schema["section"] for n in params]
    assert order == sorted(order, key=sections.index)


def test_sections_titles_and_markdown_survive_serialization(dagbag):  # noqa: F811
    """The UI reads the serialized DAG: what the form shows must be in it."""
    from airflow.serialization.serialized_objects import DagSerialization

    dag = dagbag.dags["speed_matrix"]
    again = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).params
    for name in dag.params:
        mine, theirs = dag.params.get_param(name).schema, again.get_param(name).schema
        for key in ("section", "title", "description_md", "pattern"):
            assert theirs.get(key) == mine.get(key), (name, key)
    assert again.get_param("recipe").schema["description_md"].count("\n- **") >= 7


def test_the_recipe_field_lists_every_recipe_with_its_values(dagbag):  # noqa: F811
    schema = dagbag.dags["speed_matrix"].params.get_param("recipe").schema
    listing = schema["description_md"]
    for rid in list_recipe_ids():
        assert f"- **{rid}**: " in listing, rid
    kimi = load_recipe_id("sim/kimi-k2.7-nvfp4-rtxpro6k-x8")
    line = next(x for x in listing.splitlines() if "**sim/kimi-k2.7-nvfp4-rtxpro6k-x8**" in x)
    assert line.endswith(form.recipe_summary(kimi))
    assert "decode 8K–251K (6) × 1–128 (8) requests" in line
    assert "30 s window" in line and "max output 4,096 tokens" in line
    assert schema["examples"] == list_recipe_ids()
    # a field that defaults to the recipe says so and where to look
    contexts = dagbag.dags["speed_matrix"].params.get_param("contexts")
    assert "Empty: the recipe's value (listed under Recipe above)" in contexts.description


@pytest.mark.parametrize(
    "conf",
    [
        {**GOOD, "contexts": "8K, 16K"},
        {**GOOD, "contexts": "8K 16k,65536", "prefill_contexts": "8K"},
        {**GOOD, "concurrencies": "1, 2, 4"},
        {**GOOD, "concurrencies": "8"},
        {**GOOD, "contexts": ["8K", 16384], "concurrencies": [1, 2]},
    ],
    ids=lambda c: json.dumps(c)[:70],
)
def test_params_accept_lists_as_text(dagbag, conf):  # noqa: F811
    _check(dagbag.dags["speed_matrix"], conf)


@pytest.mark.parametrize(
    "conf",
    [
        {**GOOD, "contexts": "8K; 16K"},
        {**GOOD, "contexts": "8.5K"},
        {**GOOD, "contexts": ""},
        {**GOOD, "contexts": "4,096 tokens"},
        {**GOOD, "concurrencies": "1, 2K"},
        {**GOOD, "concurrencies": "one"},
        {**GOOD, "prefill_contexts": "8K,,"},
    ],
    ids=lambda c: json.dumps(c)[:70],
)
def test_params_refuse_bad_text_before_any_task(dagbag, conf):  # noqa: F811
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=r"Invalid input for param"):
        _check(dagbag.dags["speed_matrix"], conf)


def test_split_list_text_reads_what_the_form_lets_through():
    assert split_list_text("8K, 16K") == ["8K", "16K"]
    assert split_list_text(" 8K 16k,65536 ") == ["8K", "16k", "65536"]
    assert split_list_text('["8K", "16K"]') == ["8K", "16K"]
    assert split_list_text("1,2,4") == ["1", "2", "4"]
    assert split_list_text("") == []


def test_resolve_reads_text_as_the_same_matrix_as_a_list():
    when = dt.datetime(2026, 12, 4, tzinfo=dt.UTC)
    base = {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"}
    as_text = resolve(
        {**base, "contexts": "8K, 16K", "concurrencies": "1, 2, 4", "prefill_contexts": "8K"},
        dag_run_id="manual__x",
        run_after=when,
    )
    as_list = resolve(
        {**base, "contexts": ["8K", 16384], "concurrencies": [1, 2, 4], "prefill_contexts": [8192]},
        dag_run_id="manual__x",
        run_after=when,
    )
    assert as_text["matrix"] == as_list["matrix"]
    assert as_text["matrix"]["contexts"] == [8192, 16384]
    assert as_text["matrix"]["concurrencies"] == [1, 2, 4]
    # text that does not read is named by resolve too (the REST API skips the Params)
    with pytest.raises(ResolveError, match=r"contexts.*text like `8K, 16K`"):
        resolve({**base, "contexts": "8K; banana"}, dag_run_id="manual__x", run_after=when)


def test_normalise_conf_leaves_what_it_cannot_read_for_conf_problems():
    conf = normalise_conf({"recipe": "x", "concurrencies": "1, two", "contexts": "8K"})
    assert conf["contexts"] == [8192] and conf["concurrencies"] == "1, two"
    assert any("concurrencies" in p for p in conf_problems(conf))
