"""mkdocs hooks: bench/RESULTS.md becomes the site's `results.md` page.

The pages link to `../bench/RESULTS.md#section` so that the links work where the Markdown is read
as files (a checkout, a forge's file view); in the site those links point at the page made here, so
`mkdocs build --strict` checks every section anchor they name.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "RESULTS.md"
RESULTS_LINK = "](../bench/RESULTS.md"


def on_files(files, config):
    # RESULTS.md's own pictures live in docs/, which is the site's root.
    text = RESULTS.read_text(encoding="utf-8").replace("](../docs/", "](")
    files.append(File.generated(config, "results.md", content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(RESULTS_LINK, "](results.md")
