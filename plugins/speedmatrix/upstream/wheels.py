"""Is a vLLM wheel published for this commit? The one rule, for provisioning, bisection and
the commit watch.

vLLM's per-commit wheel index is PEP 503 "simple": `<index>/<commit>[/<variant>]/vllm/` lists
the wheels of that build. A commit has a wheel when that page answers 200 AND lists a
`vllm-*.whl`: the index serves an empty page while a build is still uploading, so a HEAD (or a
GET that only looks at the status) says yes too early. The three checks that existed disagreed
on exactly that (provisioning: GET and a `.whl` on the page; bisection and the commit watch:
HEAD only, and without the variant), so bisection could pick a commit that provisioning then
refused. The page is the one provisioning installs from (`index_url` is its
`--extra-index-url`).
"""

from __future__ import annotations

import logging
import re

import requests

log = logging.getLogger("speedmatrix.wheels")

_WHEEL_LINK = re.compile(r"vllm-[^\"'<>/]*\.whl")


class WheelIndexError(RuntimeError):
    """The index could not say (unreachable, or an HTTP status other than 200 / 404)."""


class WheelNotFound(WheelIndexError):
    """The index has no vLLM wheel (yet) for that commit and variant."""


def index_url(wheel_index: str, commit: str, variant: str | None = None) -> str:
    """`<index>/<commit>[/<variant>]`: the extra index that holds that commit's wheels."""
    base = f"{wheel_index.rstrip('/')}/{commit}"
    return f"{base}/{variant}" if variant else base


def page_url(base_url: str) -> str:
    """The PEP 503 project page of vLLM under an index: `<base>/vllm/`."""
    return f"{base_url.rstrip('/')}/vllm/"


def check_page(url: str, timeout_s: float = 30, session: requests.Session | None = None) -> str:
    """Make sure the index page at `url` lists a vLLM wheel; return `url`.

    WheelNotFound: 404, or a 200 page without any `vllm-*.whl` (the build has not finished or
    never ran). WheelIndexError: unreachable, or any other status (the index is broken, which
    a human should hear about rather than read as "not yet").
    """
    get = session.get if session is not None else requests.get
    try:
        resp = get(url, timeout=timeout_s)
    except requests.RequestException as exc:
        raise WheelIndexError(f"wheel index unreachable at {url}: {exc}") from exc
    if resp.status_code == 404:
        raise WheelNotFound(
            f"no vLLM wheel at {url} (HTTP 404): the per-commit build has not finished or "
            "never ran for this commit/variant; try again later or pick another commit"
        )
    if resp.status_code != 200:
        raise WheelIndexError(f"wheel index answered HTTP {resp.status_code} for {url}")
    if not _WHEEL_LINK.search(resp.text):
        raise WheelNotFound(f"the wheel index page {url} lists no vllm wheel (yet)")
    return url


def check_wheel(base_url: str, timeout_s: float = 30) -> str:
    """`check_page` of the vLLM page under the index `base_url` (see `index_url`)."""
    return check_page(page_url(base_url), timeout_s)


def is_published(url: str, timeout_s: float = 10, session: requests.Session | None = None) -> bool:
    """`check_page` as a yes/no for pollers: an index that cannot say is logged and counts as
    "not yet" (the next poll asks again), never as published."""
    try:
        check_page(url, timeout_s, session)
    except WheelNotFound:
        return False
    except WheelIndexError as exc:
        log.warning("wheel check %s failed: %s (treated as not yet published)", url, exc)
        return False
    return True


def wheel_published(
    wheel_index: str, commit: str, variant: str | None = None, timeout_s: float = 10
) -> bool:
    """Is a wheel published for `commit` (and `variant`) on `wheel_index`?"""
    return is_published(page_url(index_url(wheel_index, commit, variant)), timeout_s)
