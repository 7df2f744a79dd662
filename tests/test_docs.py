"""The documentation: the site builds with mkdocs in strict mode (so a broken link or anchor between
pages fails) and offline, with its API reference read from the docstrings; every relative link and
#anchor in README.md and docs/*.md resolves, and every `pagedrl <command>` the pages name is a command
`pagedrl --help` lists. tests/test_docs_examples.py runs the pages' examples."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

from pagedrl.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
COMMAND = re.compile(r"(?<![\w.-])(?<!from )(?<!import )pagedrl(?:\.cli)?\s+([a-z][\w-]*)")


def prose(text: str) -> str:
    """The text outside fenced blocks and code spans: where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """Fenced blocks (less their comments) and code spans: where a command is written."""
    fenced = [re.sub(r"(^|\s)#.*$", "", m.group(0), flags=re.M) for m in FENCE.finditer(text)]
    return fenced + [m.group(2) for m in CODE_SPAN.finditer(FENCE.sub("", text))]


def heading_text(heading: str) -> str:
    """A heading as rendered text: code spans and emphasis unwrapped, links reduced to their text."""
    heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return heading.replace("`", "").replace("**", "").replace("*", "")


def slug_site(text: str) -> str:
    """Python-Markdown's toc slug, which mkdocs uses: ASCII, punctuation dropped, runs of spaces and
    hyphens made one hyphen."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def slug_forge(text: str) -> str:
    """GitHub's slug, for README.md and a page read as a file: punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """A page's heading anchors as the site names them (a repeat gets `_1`) and as a forge does (`-1`)."""
    site, forge = set(), set()
    seen_site, seen_forge = Counter(), Counter()
    for m in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        text = heading_text(m.group(1))
        for slug, seen, out, sep in ((slug_site(text), seen_site, site, "_"),
                                     (slug_forge(text), seen_forge, forge, "-")):
            out.add(slug if not seen[slug] else f"{slug}{sep}{seen[slug]}")
            seen[slug] += 1
    return site, forge


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor:
            if dest.suffix != ".md":
                problems.append(f"{target}: an anchor into a file that is not Markdown")
                continue
            site, forge = anchors(dest)
            if anchor not in site or anchor not in forge:
                problems.append(f"{target}: no heading with that anchor (on the site and on a forge alike)")
    return problems


def help_commands(capsys) -> set[str]:
    assert main(["--help"]) == 0
    usage = re.search(r"usage: pagedrl \{([^}]*)\}", capsys.readouterr().out)
    assert usage, "pagedrl --help no longer starts with `usage: pagedrl {...}`"
    return set(usage.group(1).split(","))


def test_site_builds_strict(tmp_path):
    """mkdocs.yml's nav, every page, every link and anchor between pages and into bench/RESULTS.md."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "results" / "index.html").exists()
    reference = (tmp_path / "site" / "reference" / "index.html").read_text(encoding="utf-8")
    for name in ("LLM", "SamplingParams", "LoRARequest", "EngineArgs", "LLMEngine", "GRPOConfig"):
        assert re.search(rf'id="pagedrl\.[\w.]*\.{name}"', reference), f"the API reference lacks {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_commands_named_exist(capsys):
    commands = help_commands(capsys)
    named = {}
    for page in PAGES:
        for snippet in code(page.read_text(encoding="utf-8")):
            for name in COMMAND.findall(snippet):
                named.setdefault(name, page.relative_to(ROOT).as_posix())
    unknown = {name: page for name, page in named.items() if name not in commands}
    assert unknown == {}, f"commands not in `pagedrl --help`: {unknown}"
    assert commands <= set(named), f"commands no page names: {sorted(commands - set(named))}"


def test_link_checker_catches_what_it_should(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing anchor and a repeated heading's anchor, which the
    site (`_1`) and a forge (`-1`) spell differently, are reported; links in code are not links."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Top\n## Same (`x`)\n## Same (`x`)\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#same-x) [gone](c.md) [no](b.md#nope) [dup](b.md#same-x_1) "
                    "[self](#here)\n# Here\n`[code](c.md)`\n```\n[fenced](c.md)\n```\n", encoding="utf-8")
    assert [p.split(":")[0] for p in broken_links(page)] == ["c.md", "b.md#nope", "b.md#same-x_1"]
