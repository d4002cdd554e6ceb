"""The pages' links resolve: every relative link of README.md and docs/*.md names a file of the repository and,
after a '#', a heading of that file (GitHub's anchors: lowercase, punctuation dropped, spaces to '-'). And every
table of a study's results that a page quotes under a `<!-- reprint: COMMAND -->` comment is what COMMAND (a
`compare --study FILE --reprint`, training nothing) prints: the columns the page keeps, cell for cell."""
import re
import subprocess
import sys
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


REPRINT = re.compile(r"<!-- reprint: (python cli\.py compare --study \S+ --reprint[^>]*?) -->")


def quoted_reprints(page):
    """[(command, table lines)]: each reprint comment of a page and the Markdown table after it."""
    found, lines = [], page.read_text().splitlines()
    for i, line in enumerate(lines):
        if (m := REPRINT.search(line)):
            rest = lines[i + 1:]
            start = next(j for j, l in enumerate(rest) if l.startswith("|"))
            end = next((j for j in range(start, len(rest)) if not rest[j].startswith("|")), len(rest))
            found.append((m[1], rest[start:end]))
    return found


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(lines):
    """The Markdown tables of a command's output: [(header cells, [row cells, ...])]."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            found.append((cells(line), rows))
    return found


def mismatches(quoted, printed):
    """The rows of a quoted table (a header of printed column names, then rows) that no printed table with those
    columns prints, cell for cell in those columns (the printed row named alike beside each)."""
    head = cells(quoted[0])
    for names, rows in tables(printed):
        if set(head) <= set(names):
            at = [names.index(h) for h in head]
            shown = [[row[j] for j in at] for row in rows]
            wrong = []
            for line in quoted[2:]:
                if cells(line) not in shown:
                    alike = [" | ".join(s) for s in shown if s[:2] == cells(line)[:2]] or ["no such row"]
                    wrong.append(f"{line.strip()} (printed: {alike[0]})")
            return wrong
    return [f"no printed table has the columns {head}"]


QUOTING = [page for page in PAGES if quoted_reprints(page)]


@pytest.mark.parametrize("page", QUOTING, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_quoted_study_table_is_what_its_reprint_prints(page, tmp_path):
    printed = {}  # a command quoted twice runs once
    for command, quoted in quoted_reprints(page):
        if command not in printed:
            args = command.split()[1:] + ["--out", str(tmp_path / "reprint")]
            done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
            assert done.returncode == 0, f"{command}: {done.stdout[-300:]}{done.stderr[-300:]}"
            printed[command] = done.stdout.splitlines()
        wrong = mismatches(quoted, printed[command])
        assert not wrong, f"{page.relative_to(ROOT)}, under `{command}`: " + "; ".join(wrong)


def test_a_quoted_table_is_checked_column_by_column():
    printed = ["| variant | val loss | speed | params |", "|---|---|---|---|", "| a | 1.5 | 0.8x | 10 |",
               "| b | 1.4 | 0.9x | 10 |"]
    assert mismatches(["| variant | speed |", "|---|---|", "| b | 0.9x |"], printed) == []
    assert mismatches(["| variant | speed |", "|---|---|", "| b | 0.8x |"], printed) == ["| b | 0.8x | (printed: no such row)"]
    assert mismatches(["| variant | val loss | speed |", "|---|---|---|", "| b | 1.4 | 0.8x |"], printed) == [
        "| b | 1.4 | 0.8x | (printed: b | 1.4 | 0.9x)"]
    swept = ["| layers | variant | val loss |", "|---|---|---|", "| 4 | a | 1.5 |", "| 8 | a | 1.3 |"]
    assert mismatches(["| layers | variant | val loss |", "|---|---|---|", "| 8 | a | 1.3 |"], swept) == []
    assert mismatches(["| variant | x |", "|---|---|"], printed) == ["no printed table has the columns ['variant', 'x']"]
    assert mismatches(["| variant | speed |", "|---|---|", "| c | 1x |"], printed)[0].endswith("(printed: no such row)")

