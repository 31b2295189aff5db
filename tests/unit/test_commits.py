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
    assert commit_label({"engine_version": "0.1.dev1+g9fedd24fa"}) == "9fedd24fa"
    assert commit_label({"engine_commit": FULL}) == FULL[:12]
    assert commit_label({"engine_version": "0.32.0"}) == "0.32.0"
    # the page's Commit line: the run's ref when it names the landed prefix more completely
    assert commit_text({"engine_commit": "9fedd24fa", "engine_ref": "9fedd24fa864"}) == (
        "9fedd24fa864"
    )
    assert commit_text({"engine_commit": FULL, "engine_ref": "9fedd24fa864"}) == FULL
    assert same_commit("9fedd24fa", FULL) and not same_commit("9fedd24fb", FULL)
