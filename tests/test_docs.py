"""README is a front page and every relative link in README.md and docs/*.md leads somewhere real."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 170
DEMO_START, DEMO_END = "<!-- demo-table:start -->", "<!-- demo-table:end -->"

FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_TARGET = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks: a bracket in a code sample is not a link."""
    out, fenced = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fenced is None or m.group(1) == fenced):
            fenced = None if fenced else m.group(1)
            continue
        if fenced is None:
            out.append(line)
    return out


def links(path: Path) -> list[str]:
    """Targets of inline, reference-style and HTML links and images, code spans left out."""
    found = []
    for line in prose_lines(path.read_text()):
        line = INLINE_CODE.sub("", line)
        found += LINK.findall(line) + REFERENCE.findall(line) + HTML_TARGET.findall(line)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, with GitHub's -1, -2 ... for repeated headings."""
    seen, out = {}, set()
    for line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in links(page) if not target.lower().startswith(EXTERNAL)]


def test_the_link_finder_sees_every_kind_of_link_and_skips_code(tmp_path):
    page = tmp_path / "links.md"
    text = ("[a](docs/data.md) ![b](docs/demo-grid.png) [c](../README.md#two-commands \"title\")\n"
            "`[not](a-link.md)` <img src=\"docs/demo-fid.png\">\n[ref]: docs/gpus.md\n```\n[no](code.md)\n```\n")
    page.write_text(text)
    assert links(page) == ["docs/data.md", "docs/demo-grid.png", "../README.md#two-commands", "docs/demo-fid.png",
                           "docs/gpus.md"]


def test_headings_get_githubs_anchors():
    assert slug("What happens when…") == "what-happens-when"
    assert slug("Batches, noise and memory") == "batches-noise-and-memory"
    assert slug("`train.compile` (speed_switch)") == "traincompile-speed_switch"
    assert slug("Your images in five minutes") == "your-images-in-five-minutes"


def test_there_are_docs_pages_and_they_have_links():
    assert len(PAGES) > 1 and relative_links()


@pytest.mark.parametrize("page,target", relative_links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_every_relative_link_resolves_to_a_file_and_its_anchor_to_a_heading(page, target):
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    where = f"{page.relative_to(REPO)}: link to {target}"
    assert dest.exists(), f"{where}: {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{where}: no heading with that anchor in {dest.name}"


def test_readme_is_a_front_page():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    assert "make demo" in text and "make test" in text
    assert text.count(DEMO_START) == 1 and text.count(DEMO_END) == 1, "README needs one pair of demo-table markers"
    table = text.split(DEMO_START, 1)[1].split(DEMO_END, 1)
    assert len(table) == 2, "the demo-table end marker must come after the start marker"
    assert any(line.startswith("|") for line in table[0].splitlines()), "no table between the demo-table markers"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    for page in PAGES[1:]:
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(REPO)}"
    assert (REPO / "docs" / "config.md").resolve() in linked, "README.md must link docs/config.md"
