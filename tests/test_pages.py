"""The pages' links resolve: every relative link of README.md and docs/*.md names a file of the repository and,
after a '#', a heading of that file (GitHub's anchors: lowercase, punctuation dropped, spaces to '-')."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page):
    """GitHub's anchor of every heading of a Markdown page (code blocks left out)."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            text = re.sub(r"[^\w\- ]", "", m[1].strip().lower().replace("`", ""))
            found.add(text.replace(" ", "-"))
    return found


def links(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are not links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs():
    page = ROOT / "docs" / "results.md"
    assert "the-papers-numbers-for-reference-theirs-not-measured-here" in anchors(page)
    assert "delta-blocks-block-count-at-8-layers" in anchors(page)


def test_check_pages_masks_the_clock_and_a_studys_finished_count():
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_pages", ROOT / "tests" / "check_pages.py")
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    quoted = ["study s: 2 runs (2 variants x 1 seed), 0 finished, 2 to train, about 29 min at 2 at a time (an estimate)",
              "| variant | val loss | tokens/s |", "|---|---|---|", "| baseline | 1.6436 | 3,227 |"]
    printed = ["study s: 2 runs (2 variants x 1 seed), 2 finished, 0 to train",
               "| variant | val loss | tokens/s |", "|---|---|---|", "| baseline | 1.6436 | 3,640 |"]
    assert cp.check(quoted, printed) == []
    assert cp.check(["| variant | val loss | tokens/s |", "|---|---|---|", "| baseline | 1.6435 | 3,227 |"],
                    printed) == ["| baseline | 1.6435 | ~ |"]
    pairs = ["| pair | val loss difference | beat | equal CPU time |", "|---|---|---|---|"]  # a study's table of pairs
    assert cp.check(pairs + ["| a - b | -0.0370 ± 0.0050 | 3/3 | -0.0207 ± 0.0052 |"],
                    pairs + ["| a - b | -0.0370 ± 0.0050 | 3/3 | -0.0199 ± 0.0049 |"]) == []
