"""One engine_commit per vLLM commit, whichever path landed the run (issue #34 item 3), and a
commit shown whole enough to tell commits apart."""

from __future__ import annotations

import pytest
from github_fake import FakeGitHub

from speedmatrix.commits import commit_label, commit_text, same_commit
from speedmatrix.upstream.github_commits import engine_commit

FULL = "9fedd24fa8641f3c2b7d6e5a4c3b2a1908f7e6d5"


def _refused(name: str) -> str:
    raise ConnectionError("GitHub unreachable")


# (what the DAG's sim run knows, what `speedmatrix run --base-url` knows, an ingested page)
PATHS = {
    "dag": {"ref": "9fedd24fa864", "version": "0.1.dev1+g9fedd24fa"},
    "cli": {"ref": "9fedd24fa", "version": "0.1.dev1+g9fedd24fa"},
    "ingest": {"recorded": "9fedd24fa864", "version": "0.1.dev1+g9fedd24fa"},
}


def test_every_path_lands_one_prefix_when_only_a_prefix_is_known() -> None:
    got = {path: engine_commit(**facts, lookup=_refused) for path, facts in PATHS.items()}
    assert set(got.values()) == {"9fedd24fa"}, got


def test_every_path_lands_the_full_sha_when_github_tells_it() -> None:
    asked = []

    def github(name: str) -> str:
        asked.append(name)
        return FULL

    got = {path: engine_commit(**facts, lookup=github) for path, facts in PATHS.items()}
    assert set(got.values()) == {FULL} and asked


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        ({"recorded": FULL, "ref": "v0.32.0"}, FULL),  # provisioning / __commit_id__
        ({"ref": FULL, "version": "0.1.dev1+g0123456789"}, FULL),  # a 40-hex ref names it
        ({"ref": "main", "version": "0.32.0"}, None),  # a release GitHub cannot resolve
        ({"ref": "main", "version": "0.32.0rc1"}, None),
    ],
)
def test_what_each_source_knows(facts, expected) -> None:
    assert engine_commit(**facts, lookup=_refused) == expected


def test_an_answer_that_contradicts_the_prefix_is_not_taken() -> None:
    other = "0" * 40
    assert engine_commit(ref="9fedd24fa864", lookup=lambda _: other) == "9fedd24fa"


def test_github_resolves_a_prefix_and_a_release_tag_over_http(monkeypatch) -> None:
    fake = FakeGitHub(head=4).start()
    try:
        monkeypatch.setenv("SPEEDMATRIX_GITHUB_API_URL", fake.base_url)
        sha = fake.history[2]["sha"]
        fake.tags["v0.32.0"] = sha
        assert engine_commit(ref=sha[:9]) == sha
        assert engine_commit(version=f"0.1.dev1+g{sha[:9]}") == sha
        assert engine_commit(ref="v0.32.0", version="0.32.0") == sha  # real vLLM v0.32.0
    finally:
        fake.stop()


def test_a_commit_is_shown_whole_enough_to_tell_commits_apart() -> None:
    # the site's axes read `0.1.dev1+g` for every run of a server already running
    # only 9 hex are known: shown as they are, marked as abbreviated (no digit made up)
    assert commit_label({"engine_version": "0.1.dev1+g9fedd24fa"}) == "9fedd24fa…"
    assert commit_label({"engine_commit": FULL}) == FULL[:12]
    assert commit_label({"engine_version": "0.32.0"}) == "0.32.0"
    # the page's Commit line: the run's ref when it names the landed prefix more completely
    assert commit_text({"engine_commit": "9fedd24fa", "engine_ref": "9fedd24fa864"}) == (
        "9fedd24fa864"
    )
    assert commit_text({"engine_commit": FULL, "engine_ref": "9fedd24fa864"}) == FULL[:12]
    assert same_commit("9fedd24fa", FULL) and not same_commit("9fedd24fb", FULL)


# ------------------------------------------------------ one commit length wherever one is shown

PREFIX = "9fedd24fa"  # what a dev build's version (0.1.dev123+g9fedd24fa) carries


def test_a_commit_is_shown_with_12_hex_or_marked_as_abbreviated() -> None:
    from speedmatrix.commits import LABEL_LEN, shown_commit

    assert LABEL_LEN == 12
    assert shown_commit(FULL) == FULL[:12]
    assert shown_commit("9fedd24fa864") == "9fedd24fa864"
    assert shown_commit(PREFIX) == PREFIX + "…"  # 9 known: said so, never padded
    assert shown_commit(None) is None and shown_commit("v0.32.0") is None
    # a run asked for a longer ref of the landed prefix shows the longer one
    assert commit_label({"engine_commit": PREFIX, "engine_ref": "9fedd24fa864"}) == "9fedd24fa864"
    # the mark reads back: a page showing `9fedd24fa…` names the prefix
    assert same_commit(PREFIX + "…", FULL)
    assert engine_commit(recorded=PREFIX + "…", lookup=_refused) == PREFIX


def test_a_prefix_is_resolved_when_the_commit_list_is_at_hand() -> None:
    from speedmatrix.commits import resolved

    other = "0" * 40
    assert resolved(PREFIX, [other, FULL]) == FULL
    assert resolved(PREFIX, [other]) == PREFIX  # not in the list: as it was
    assert resolved(PREFIX, [FULL, PREFIX + "0" * 31]) == PREFIX  # two match: not guessed
    assert resolved(FULL, []) == FULL and resolved(None, [FULL]) is None


@pytest.mark.parametrize("commit", [FULL, PREFIX])
def test_every_place_shows_the_commit_one_way(commit) -> None:
    """The change-point range, the comparison's side label, the verdict's and the report's
    engine lines, the Pareto view's by-commit label: 12 hex, or the 9 known marked."""
    from speedmatrix.analysis.changepoints import ChangePoint
    from speedmatrix.analysis.display import comparison_markdown
    from speedmatrix.analysis.pareto import choose_series
    from speedmatrix.analysis.verdict import summarize
    from speedmatrix.commits import shown_commit
    from speedmatrix.report.versus import side_label

    shown = shown_commit(commit)
    assert shown in (FULL[:12], PREFIX + "…")
    cp = ChangePoint("r2", "r1", commit, commit, None, 1.0, 2.0, 100.0, 0.01, "improvement")
    assert cp.commit_range() == f"{shown}..{shown}"
    run = {"run_id": "r2", "recipe_id": "x", "engine_commit": commit, "status": "success",
           "model": "m", "hardware_gpu": "g", "hardware_gpu_count": 1}  # fmt: skip
    base = {**run, "run_id": "r1"}
    assert side_label(run).endswith(f"engine {shown}")
    assert f"(engine {shown})" in comparison_markdown([], run, base)
    assert f"engine: baseline {shown} -> this run {shown}" in summarize([], run, base)
    [series] = choose_series([run], "m", by_commit=True)
    assert series.label.endswith(f"· {shown}")
    for text in (side_label(run), comparison_markdown([], run, base), summarize([], run, base)):
        assert FULL not in text  # never the 40 hex where a commit is shown


def test_the_verdict_resolves_this_runs_prefix_from_the_commits_between() -> None:
    from speedmatrix.analysis.verdict import summarize

    run = {"run_id": "r2", "engine_commit": PREFIX}
    base = {"run_id": "r1", "engine_commit": "1" * 40}
    text = summarize([], run, base, commits=["2" * 40, FULL])
    assert f"this run {FULL[:12]}" in text
