"""Trigger planning without Airflow: new commits, order, cap, wheels, watermark, run ids."""

from __future__ import annotations

import re
import textwrap
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path

import pytest
from github_fake import FakeGitHub, load_history

from speedmatrix import recipes as recipes_mod
from speedmatrix.flows import triggers as T
from speedmatrix.upstream.github import Commit, CommitPage

NOW = datetime(2026, 11, 29, 23, 0, tzinfo=UTC)
HISTORY = [Commit.from_api(c) for c in load_history()]  # oldest first
RECIPES = [T.ScheduledRecipe("sim/a", host="local"), T.ScheduledRecipe("gpu/x/b", host="gpu-1")]
# Airflow's default [scheduler] allowed_run_id_pattern.
AIRFLOW_RUN_ID = re.compile(r"^[A-Za-z0-9_.~:+-]+$")


def page(n: int, etag: str | None = None) -> CommitPage:
    """The branch with the oldest n commits, as GitHub answers (newest first)."""
    return CommitPage(commits=list(reversed(HISTORY[:n])), etag=etag or f'W/"{n}"')


def plan(p: CommitPage, state: T.WatchState, **kw) -> T.CommitPlan:
    kw.setdefault("cap", 5)
    kw.setdefault("now", NOW)
    return T.plan_commit_triggers(p, state, RECIPES, **kw)


def shas(*idx: int) -> list[str]:
    return [HISTORY[i].sha for i in idx]


def test_first_poll_starts_from_the_head_only():
    out = plan(page(3), T.WatchState())
    assert out.commits == shas(2)
    assert [t["conf"]["recipe"] for t in out.triggers] == ["sim/a", "gpu/x/b"]
    assert out.state["sha"] == HISTORY[2].sha and out.state["etag"] == 'W/"3"'


def test_three_new_commits_trigger_oldest_first_per_recipe():
    out = plan(page(4), T.WatchState(sha=HISTORY[0].sha, etag='W/"1"'))
    assert out.status == "ok" and out.commits == shas(1, 2, 3)
    assert [t["trigger_run_id"] for t in out.triggers] == [
        T.commit_run_id(r, s) for s in shas(1, 2, 3) for r in ("sim/a", "gpu/x/b")
    ]
    assert out.triggers[0]["trigger_run_id"] == f"commit__sim~a__{HISTORY[1].sha}"
    assert out.triggers[1]["conf"] == {
        "recipe": "gpu/x/b",
        "engine_ref": HISTORY[1].sha,
        "ssh_conn_id": "gpu-1",
    }
    run_after = [datetime.fromisoformat(t["run_after"]) for t in out.triggers]
    assert run_after == sorted(run_after) and len(set(run_after)) == len(run_after)
    assert out.state["sha"] == HISTORY[3].sha and out.state["etag"] == 'W/"4"'
    assert out.skipped == [] and out.pending == []


def test_run_after_comes_from_the_commits_so_racing_polls_agree():
    state = T.WatchState(sha=HISTORY[0].sha)
    a = plan(page(4), state, now=NOW)
    b = plan(page(4), state, now=NOW + timedelta(seconds=7))  # another poll, a bit later
    assert [t["run_after"] for t in a.triggers] == [t["run_after"] for t in b.triggers]
    first = datetime.fromisoformat(a.triggers[0]["run_after"])
    assert first == datetime.fromisoformat(HISTORY[1].date.replace("Z", "+00:00"))
    early = plan(page(4), state, now=datetime(2026, 11, 29, 12, 0, tzinfo=UTC))
    times = [datetime.fromisoformat(t["run_after"]) for t in early.triggers]
    assert times[0] == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)  # never in the future
    assert times == sorted(times) and len(set(times)) == len(times)


def test_nothing_new_and_not_modified():
    state = T.WatchState(sha=HISTORY[3].sha, etag='W/"4"')
    same = plan(page(4), state)
    assert same.triggers == [] and same.state is None  # nothing to store
    nm = plan(CommitPage(not_modified=True, etag='W/"4"'), state)
    assert nm.status == "not_modified" and nm.triggers == [] and nm.state is None


def test_cap_keeps_the_newest_and_records_the_skipped():
    state = T.WatchState(sha=HISTORY[0].sha, skipped=[{"sha": "old", "reason": "earlier"}])
    out = plan(page(8), state, cap=2)
    assert out.commits == shas(6, 7)
    assert [s["sha"] for s in out.skipped] == shas(1, 2, 3, 4, 5)
    assert all(s["reason"] == "cap of 2 per poll" for s in out.skipped)
    assert out.skipped[0]["title"] == HISTORY[1].title
    assert [s["sha"] for s in out.state["skipped"]] == ["old", *shas(1, 2, 3, 4, 5)]
    assert out.state["sha"] == HISTORY[7].sha
    assert len(out.triggers) == 4


def test_watermark_not_in_page_treats_the_page_as_new_and_says_so():
    out = plan(page(3), T.WatchState(sha="f" * 40), cap=10)
    assert out.commits == shas(0, 1, 2)
    assert any("not among the newest" in n for n in out.notes)


def test_no_per_commit_recipes_triggers_nothing():
    out = T.plan_commit_triggers(page(3), T.WatchState(), [], cap=5, now=NOW)
    assert out.status == "no_recipes" and out.triggers == [] and out.state is None


def _wheel_recipes():
    return [T.ScheduledRecipe("gpu/w", wheel_index="https://wheels.example")]


def test_wheel_wait_keeps_order_and_retries_pending_commits():
    published = set(shas(1))
    out = T.plan_commit_triggers(
        page(4),
        T.WatchState(sha=HISTORY[0].sha, etag='W/"1"'),
        _wheel_recipes(),
        cap=5,
        now=datetime(2026, 11, 29, 18, 0, tzinfo=UTC),  # commits 2, 3 are young
        wheel_ready=lambda r, sha: sha in published,
    )
    assert out.commits == shas(1)
    assert out.pending == shas(2, 3)  # 3 waits for 2 even if its wheel were there
    assert out.state["sha"] == HISTORY[1].sha
    assert out.state["etag"] is None  # else a 304 would hide the pending commits


def test_wheel_that_never_comes_is_skipped_after_the_max_wait():
    out = T.plan_commit_triggers(
        page(3),
        T.WatchState(sha=HISTORY[0].sha),
        _wheel_recipes(),
        cap=5,
        now=NOW,
        wheel_ready=lambda r, sha: sha != HISTORY[1].sha,
        wheel_max_wait_s=3600,
    )
    assert out.commits == shas(2)
    assert [s["sha"] for s in out.skipped] == shas(1)
    assert out.skipped[0]["reason"].startswith("no wheel after")
    assert out.state["sha"] == HISTORY[2].sha


def test_wheel_check_only_asks_for_wheel_recipes():
    asked: list[str] = []
    T.plan_commit_triggers(
        page(2),
        T.WatchState(sha=HISTORY[0].sha),
        RECIPES,  # no wheel recipes
        cap=5,
        now=NOW,
        wheel_ready=lambda r, sha: asked.append(sha) or False,
    )
    assert asked == []


def test_make_wheel_check_against_a_loopback_index():
    fake = FakeGitHub().start()
    try:
        fake.wheels.add("a" * 40)
        check = T.make_wheel_check(fake.base_url + "/wheels/{sha}/{variant}/", timeout_s=2)
        r = T.ScheduledRecipe("gpu/w", wheel_index="unused", variant="cu130")
        assert check(r, "a" * 40) is True
        assert check(r, "b" * 40) is False
        assert fake.requests[-1].path == f"/wheels/{'b' * 40}/cu130/"
        dead = T.make_wheel_check("http://127.0.0.1:9/{sha}", timeout_s=1)
        assert dead(r, "a" * 40) is False  # unreachable: not published yet, no exception
    finally:
        fake.stop()


def test_wheel_url_template():
    r = T.ScheduledRecipe("gpu/w", wheel_index="https://wheels.vllm.ai/", variant="cu130")
    assert T.wheel_url("{wheel_index}/{sha}/vllm/", r, "c" * 40) == (
        f"https://wheels.vllm.ai/{'c' * 40}/vllm/"
    )


def test_run_ids_are_valid_airflow_run_ids_and_distinct():
    sha = HISTORY[0].sha
    ids = {
        T.commit_run_id("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", sha),
        T.commit_run_id("nvidia-rtxpro6k/moonshotai/kimi-k2.7-code-nvfp4", sha),
        T.nightly_run_id("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", date(2026, 11, 29)),
        T.nightly_run_id("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", date(2026, 11, 30)),
    }
    assert len(ids) == 4 and all(AIRFLOW_RUN_ID.match(i) and len(i) <= 250 for i in ids)
    with pytest.raises(ValueError, match="run id"):
        T.commit_run_id("bad recipe id", sha)


def test_nightly_plan_one_run_per_recipe_for_the_night():
    sha = HISTORY[5].sha
    out = T.plan_nightly_triggers(RECIPES, sha, date(2026, 11, 29), NOW)
    assert [t["trigger_run_id"] for t in out] == [
        "nightly__sim~a__2026-11-29",
        "nightly__gpu~x~b__2026-11-29",
    ]
    assert {t["conf"]["engine_ref"] for t in out} == {sha}
    again = T.plan_nightly_triggers(RECIPES, HISTORY[6].sha, date(2026, 11, 29), NOW)
    assert [t["trigger_run_id"] for t in again] == [t["trigger_run_id"] for t in out]


def test_night_of_uses_the_utc_date():
    new_york = datetime(2026, 11, 29, 20, 30, tzinfo=timezone(timedelta(hours=-5)))
    assert T.night_of(new_york, None) == date(2026, 11, 30)  # 01:30 UTC
    assert T.night_of(None, datetime(2026, 11, 29, 23, 59, tzinfo=UTC)) == date(2026, 11, 29)
    with pytest.raises(ValueError):
        T.night_of(None, None)


def test_schedule_config_defaults_file_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEEDMATRIX_GITHUB_API_URL", raising=False)
    missing = T.load_schedule_config(tmp_path / "none.yaml")
    assert missing.nightly.cron == "0 2 * * *" and missing.github.repo == "vllm-project/vllm"
    shipped = T.load_schedule_config(Path(recipes_mod.recipes_dir()) / "_schedule.yaml")
    assert shipped.nightly.cron == "0 2 * * *"
    f = tmp_path / "s.yaml"
    f.write_text("commit_watch:\n  max_commits_per_poll: 3\n")
    monkeypatch.setenv("SPEEDMATRIX_GITHUB_API_URL", "http://127.0.0.1:1")
    cfg = T.load_schedule_config(f)
    assert cfg.commit_watch.max_commits_per_poll == 3
    assert cfg.github.api_url == "http://127.0.0.1:1"
    f.write_text("commit_watch:\n  max_commits_per_pol: 3\n")
    with pytest.raises(ValueError, match="max_commits_per_pol"):
        T.load_schedule_config(f)


def test_scheduled_recipes_reads_the_recipe_flags(tmp_path, monkeypatch, caplog):
    src = (Path(recipes_mod.recipes_dir()) / "cpu" / "tiny" / "llama-tiny.yaml").read_text()
    (tmp_path / "t").mkdir()
    flags = {"both": (True, True), "night": (True, False), "none": (False, False)}
    for name, (nightly, per_commit) in flags.items():
        body = src.replace("nightly: false", f"nightly: {str(nightly).lower()}")
        body = body.replace("per_commit: false", f"per_commit: {str(per_commit).lower()}")
        (tmp_path / "t" / f"{name}.yaml").write_text(body)
    (tmp_path / "t" / "broken.yaml").write_text(textwrap.dedent("schedule: {nightly: true}\n"))
    (tmp_path / "_schedule.yaml").write_text("nightly: {cron: '0 3 * * *'}\n")  # not a recipe
    monkeypatch.setenv("SPEEDMATRIX_RECIPES", str(tmp_path))
    assert [r.id for r in T.scheduled_recipes("nightly")] == ["t/both", "t/night"]
    assert [r.id for r in T.scheduled_recipes("per_commit")] == ["t/both"]
    assert T.scheduled_recipes("per_commit")[0].host == "local"
    assert "t/broken" in caplog.text  # a broken recipe is named, not silently dropped


def test_a_run_conf_cannot_choose_the_github_api(monkeypatch):
    """The API base (and so where the token goes) is the deployment's: a conf's api_url is
    refused before anything is asked of anyone (issue #16 item 1)."""
    from airflow.sdk.exceptions import AirflowFailException

    evil = FakeGitHub().start()
    try:
        for body in (T.run_commit_poll, T.run_nightly_resolve):
            with pytest.raises(AirflowFailException, match="api_url"):
                body({"api_url": evil.base_url})
        assert evil.requests == []
    finally:
        evil.stop()
