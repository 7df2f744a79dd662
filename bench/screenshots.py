"""The README's pictures of pagedrl's two pages, taken with the Playwright code the page tests use
(the system's Chromium; `apt-get install chromium`):

- `docs/chat_page.png`: the chat page of a `pagedrl serve` process on the default model, after one
  question answered with the log-prob view on;
- `docs/demo_report.png`: the top of a demo's `report.html` (default `runs/demo/report.html`).

    .venv/bin/python bench/screenshots.py [--report runs/demo/report.html]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import open_page  # noqa: E402
from server_process import running_server  # noqa: E402


def chat_page(out: Path, log_dir: Path) -> None:
    from pagedrl.model.default import DEFAULT_MODEL

    with running_server(Path(DEFAULT_MODEL), log_dir, "--kv-cache-tokens", "4096") as server, \
            open_page(server.base_url + "/") as (page, problems):
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        page.fill("#system", "You are a concise assistant.")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "48")
        page.check("#show_logprobs")
        page.fill("#input", "What is the capital of France, and why is it famous?")
        page.press("#input", "Enter")
        page.wait_for_function("document.querySelector('.assistant .stats').textContent.includes('finish')")
        page.locator(".assistant .tok").nth(3).hover()
        page.screenshot(path=str(out))
        assert not problems, problems


def report_page(report: Path, out: Path) -> None:
    url = report.resolve().as_uri()
    with open_page(url) as (page, problems):
        page.goto(url)
        page.screenshot(path=str(out), full_page=False)
        assert not problems, problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default="runs/demo/report.html")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        chat_page(ROOT / "docs" / "chat_page.png", Path(tmp))
    print("wrote docs/chat_page.png")
    if Path(args.report).is_file():
        report_page(Path(args.report), ROOT / "docs" / "demo_report.png")
        print("wrote docs/demo_report.png")


if __name__ == "__main__":
    main()
