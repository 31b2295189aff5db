"""Headless Chromium for tests that look at a page: console messages, screenshots, links.

Debian's `chromium` package (``apt-get install -y chromium``; `make test-deps` installs it).
One call is one short browser process with a profile of its own (no state between calls, no
server to keep alive): ``open_page`` loads a page (``file://`` or ``http://``), waits until it
settled, and returns what the page wrote to its console and, when asked, a screenshot.

The console is read from Chromium's own log (``--enable-logging=stderr --v=0``), where every
``console.*`` call and every uncaught exception appears as a ``:CONSOLE`` line (this build logs
them all at INFO, whatever their level): our pages write nothing to the console, so any such
line is a defect. A resource that fails to load is not a console line in this log: check the
files a page names with ``local_links`` instead.

Use it through the ``browser`` fixture (tests/conftest.py), which fails, not skips, when the
package is missing: a page test that did not run is not a passed one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
_CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\]?\s*(.*)$")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageLoad:
    url: str
    console: list[str] = field(default_factory=list)
    screenshot: Path | None = None
    log: str = ""
    dom: str = ""  # the page's DOM after load (only without a screenshot: --dump-dom)


@dataclass
class Browser:
    binary: str

    def open_page(
        self,
        target: str | os.PathLike[str],
        *,
        screenshot: str | os.PathLike[str] | None = None,
        width: int = 1280,
        height: int = 1600,
        timeout: float = 90.0,
    ) -> PageLoad:
        """Load `target` (a path or a URL) headless; its console lines, and a PNG of the first
        `width` x `height` pixels at `screenshot` when given."""
        url = (
            target
            if isinstance(target, str) and "://" in target
            else Path(target).resolve().as_uri()
        )
        with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
            cmd = [
                self.binary,
                "--headless",
                "--no-sandbox",  # root in a container: the setuid sandbox is not available
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--hide-scrollbars",
                "--enable-logging=stderr",
                "--v=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--virtual-time-budget=3000",  # settle timers without waiting for them
            ]
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                cmd.append(f"--screenshot={Path(screenshot).resolve()}")
            else:
                cmd.append("--dump-dom")
            proc = subprocess.run(
                [*cmd, url], capture_output=True, text=True, timeout=timeout, check=False
            )
        log = proc.stderr
        console = [m.group(1) for line in log.splitlines() if (m := _CONSOLE.search(line))]
        if proc.returncode != 0:
            raise RuntimeError(f"chromium exited {proc.returncode} on {url}: {log[-2000:]}")
        shot = Path(screenshot) if screenshot is not None else None
        if shot is not None and not shot.exists():
            raise RuntimeError(f"chromium wrote no screenshot of {url}: {log[-2000:]}")
        dom = proc.stdout if shot is None else ""
        return PageLoad(url=url, console=console, screenshot=shot, log=log, dom=dom)

    def layout(self, page: str, folder: Path, fields: str, *, height: int = 800) -> dict:
        """Where things are on `page` (HTML text) once loaded, 1280 px wide: `fields` is the
        body of a JavaScript object literal, with `t(selector)` an element's bounding rect
        and `width` the document's scroll width. A probe script is added to a copy of the
        page (our pages have no script) that writes the object into the DOM, read back here."""
        import json

        probe = (
            "<script>addEventListener('load',()=>{const t=s=>document.querySelector(s)"
            ".getBoundingClientRect();const width=document.documentElement.scrollWidth;"
            f"document.body.dataset.layout=JSON.stringify({{{fields}}})}})</script>"
        )
        probed = Path(folder) / "probe.html"
        probed.write_text(page.replace("</body>", probe + "</body>"), encoding="utf-8")
        dom = self.open_page(probed, height=height).dom
        found = re.search(r'data-layout="([^"]*)"', dom)
        if found is None:
            raise RuntimeError(f"the probe wrote no layout into {probed}")
        return json.loads(found.group(1).replace("&quot;", '"'))


class _Refs(HTMLParser):
    """Every URL a page names: a/link href, img/script/iframe/source src (SVG <a href> too)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is not None and name in ("href", "src", "xlink:href"):
                self.refs.append((tag, value))

    handle_startendtag = handle_starttag


def page_refs(page: Path) -> list[tuple[str, str]]:
    parser = _Refs()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.refs


def local_links(page: Path) -> tuple[list[Path], list[str]]:
    """(files the page's relative references resolve to, references to elsewhere).

    Fragments (``#id``) and ``data:`` URIs (inline content) are dropped; an absolute path (``/x``) counts as elsewhere, since a
    page that must open from ``file://`` cannot use one."""
    files, elsewhere = [], []
    for _tag, ref in page_refs(page):
        target, _frag = urldefrag(ref)
        if not target or target.startswith("data:"):  # in the page itself
            continue
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or target.startswith("/"):
            elsewhere.append(ref)
            continue
        files.append((page.parent / unquote(parts.path)).resolve())
    return files, elsewhere


def walk_site(index: Path) -> tuple[set[Path], list[tuple[Path, Path]], list[tuple[Path, str]]]:
    """Follow every relative link from `index`: (pages and files reached, broken links as
    (page, missing file), references outside the site as (page, reference))."""
    seen: set[Path] = set()
    broken: list[tuple[Path, Path]] = []
    outside: list[tuple[Path, str]] = []
    todo = [index.resolve()]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        if page.suffix != ".html":
            continue
        files, elsewhere = local_links(page)
        outside += [(page, ref) for ref in elsewhere]
        for f in files:
            if not f.exists():
                broken.append((page, f))
            elif f not in seen:
                todo.append(f)
    return seen, broken, outside
