"""A headless Chromium for the page tests, driven by Playwright against the system's browser (Debian's
`chromium` package): nothing is downloaded at run time. Where either is missing the test is skipped
and says which and how to get it. Every page opened through `open_page` fails the test on a request
to any host but the one it came from, and on any console error."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    return os.environ.get("PAGEDRL_CHROMIUM") or next((p for b in BROWSERS if (p := shutil.which(b))), None)


@contextmanager
def open_page(url: str, allowed_origin: str | None = None) -> Iterator[tuple[Any, list[str]]]:
    """(page, problems): `problems` collects console errors, page errors and requests to other hosts;
    the caller asserts it is empty at the end."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; the browser comes from the system)")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium on PATH (Debian/Ubuntu: apt-get install chromium; or set PAGEDRL_CHROMIUM)")
    origin = allowed_origin or "{0.scheme}://{0.netloc}".format(urlsplit(url))
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            # The chat page's Content-Security-Policy forbids eval, which Playwright's wait_for_function
            # and evaluate use: the tests bypass it (its text is checked over HTTP) and catch any
            # request to another host themselves, below.
            page = browser.new_page(viewport={"width": 1200, "height": 900}, bypass_csp=True)
            page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

            def check(route: Any) -> None:
                target = route.request.url
                same = target.startswith(origin) or target.startswith("data:") or (
                    url.startswith("file:") and target.startswith("file:"))
                if not same:
                    problems.append(f"request to another host: {target}")
                    route.abort()
                else:
                    route.continue_()

            page.route("**/*", check)
            yield page, problems
        finally:
            browser.close()
