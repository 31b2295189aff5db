"""Is a wheel published for this commit? One rule (upstream.wheels), asked by provisioning,
bisection and the commit watch, against a loopback HTTP server standing in for vLLM's
per-commit PEP 503 wheel index (no network)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from wheel_index import serve_index, wheel_link

from speedmatrix.engine.provision import ProvisionError, WheelNotFound, plan_install
from speedmatrix.flows import triggers as T
from speedmatrix.flows.bisect_steps import wheel_check
from speedmatrix.recipes import ENV_WHEEL_INDEX, load_recipe
from speedmatrix.upstream import wheels
from speedmatrix.upstream.schedule import CommitWatchConfig

READY = "a" * 40  # the page lists a wheel (under the variant, as vLLM publishes cu130 builds)
UPLOADING = "b" * 40  # the page exists but lists no wheel yet: HEAD said 200 all the same
NO_VARIANT = "c" * 40  # a wheel only at <sha>/vllm/, none under the recipe's variant
MISSING = "d" * 40  # 404
BROKEN = "e" * 40  # 500
PAGES = {
    f"/{READY}/cu130/vllm/": wheel_link(READY),
    f"/{UPLOADING}/cu130/vllm/": "<html><body></body></html>",
    f"/{NO_VARIANT}/vllm/": wheel_link(NO_VARIANT),
}


def _route(path: str) -> tuple[int, str]:
    if path.startswith(f"/{BROKEN}/"):
        return 500, "oops"
    return (200, PAGES[path]) if path in PAGES else (404, "not found")


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    with serve_index(_route) as url:
        yield url


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_urls_with_and_without_variant():
    assert wheels.index_url("https://w.example/", READY) == f"https://w.example/{READY}"
    assert wheels.index_url("https://w.example", READY, "cpu") == f"https://w.example/{READY}/cpu"
    assert wheels.page_url(f"https://w.example/{READY}/") == f"https://w.example/{READY}/vllm/"


def test_a_page_listing_a_wheel_is_published(index):
    base = wheels.index_url(index, READY, "cu130")
    assert wheels.check_wheel(base) == f"{base}/vllm/"
    assert wheels.wheel_published(index, READY, "cu130") is True


def test_an_empty_page_or_a_404_is_not_published(index):
    with pytest.raises(wheels.WheelNotFound, match="lists no vllm wheel"):
        wheels.check_wheel(wheels.index_url(index, UPLOADING, "cu130"))
    with pytest.raises(wheels.WheelNotFound, match=r"HTTP 404.*not finished"):
        wheels.check_wheel(wheels.index_url(index, MISSING, "cu130"))
    assert wheels.wheel_published(index, UPLOADING, "cu130") is False
    assert wheels.wheel_published(index, MISSING, "cu130") is False


def test_a_broken_or_unreachable_index_is_an_error_not_a_missing_wheel(index):
    with pytest.raises(wheels.WheelIndexError, match="HTTP 500") as exc:
        wheels.check_wheel(wheels.index_url(index, BROKEN, "cu130"))
    assert not isinstance(exc.value, wheels.WheelNotFound)
    with pytest.raises(wheels.WheelIndexError, match="unreachable"):
        wheels.check_wheel(f"{_dead_url()}/{READY}", timeout_s=5)
    # pollers ask again next time: not published, and no exception
    assert wheels.wheel_published(index, BROKEN, "cu130") is False
    assert wheels.wheel_published(_dead_url(), READY, timeout_s=2) is False


def _wheel_recipe(index: str):
    r = load_recipe("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash")
    inst = r.engine.install.model_copy(update={"kind": "wheel", "wheel_index": index})
    return r.model_copy(update={"engine": r.engine.model_copy(update={"install": inst})})


def _provisioning_accepts(recipe, commit: str) -> bool:
    try:
        plan_install(recipe, commit)
    except WheelNotFound:
        return False
    return True


def test_bisection_commit_watch_and_provisioning_agree(index, monkeypatch):
    """The defect: bisection and the watch did a HEAD on <sha>/vllm/ (no variant), so they
    took an empty page for a wheel and missed a variant's wheel; provisioning then refused the
    commit bisection had chosen. Now all three give one answer per commit."""
    monkeypatch.delenv(ENV_WHEEL_INDEX, raising=False)
    recipe = _wheel_recipe(index)
    assert recipe.engine.variant == "cu130"
    bisect_has = wheel_check(recipe)
    scheduled = T.ScheduledRecipe(recipe.id, wheel_index=index, variant=recipe.engine.variant)
    watch_has = T.make_wheel_check(CommitWatchConfig().wheel_url, timeout_s=5)
    for commit, want in ((READY, True), (UPLOADING, False), (NO_VARIANT, False), (MISSING, False)):
        got = (
            _provisioning_accepts(recipe, commit),
            bisect_has(commit),
            watch_has(scheduled, commit),
        )
        assert got == (want, want, want), commit
    with pytest.raises(ProvisionError, match="HTTP 500") as exc:
        plan_install(recipe, BROKEN)
    assert not isinstance(exc.value, WheelNotFound)
    assert bisect_has(BROKEN) is False and watch_has(scheduled, BROKEN) is False


def test_a_deployment_template_is_checked_by_the_same_rule(index):
    r = T.ScheduledRecipe("gpu/w", wheel_index=index, variant="cu130")
    check = T.make_wheel_check("{wheel_index}/{sha}/{variant}/vllm/", timeout_s=5)
    assert check(r, READY) is True
    assert check(r, UPLOADING) is False  # 200, but no wheel on the page
