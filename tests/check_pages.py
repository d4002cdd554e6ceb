"""Rerun the commands the pages quote and check the outputs they quote, so that a page cannot go stale silently.
Minutes of CPU (about 65 on two idle cores), outside the test suite:

    python tests/check_pages.py                          # README's quick start, exercises.md, then answers.md
    python tests/check_pages.py --keep /tmp/pages         # keep the clone it ran in
    python tests/check_pages.py --runs /tmp/finished      # reuse finished runs: DIR/exercise-lab/baseline-s1, ...

It clones this checkout (committed files only) into a scratch folder, runs `make train` there (the quick start
the pages assume), then every fenced block of commands of docs/exercises.md and docs/answers.md in order, as
one bash script each with the project's .venv first on PATH. The fenced block that follows a block of
commands, before the next one, is what it must print: every quoted line has to appear in the output, in
order (`...` skips), with the clock's numbers masked (tokens/s, speed and equal-time columns, durations,
estimates). A page's edits to the code are HTML comments `<!-- check: COMMAND -->`, run before the next block.
The pages' numbers hold for PyTorch's default threads on two idle cores: run it on an idle machine. `--runs DIR`
copies DIR's run folders into the clone's runs/ first: `compare` reuses a finished run whose settings are the
ones asked for (and refuses one with other settings), so a long study's table is checked without training it
again (exercise 8's 35 minutes, from the same runs of larger studies).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/exercises.md", "docs/answers.md")
COMMAND = re.compile(r"(\w+=\S+ )*(python|git|make|for|source) ")  # a command, maybe after VAR=value
CLOCK_COLUMNS = {"tokens/s", "speed", "vs ref, equal time", "vs baseline, equal time", "vs ref, equal CPU time",
                 "vs baseline, equal CPU time", "x time", "equal time", "equal CPU time",  # the last two: pairs' tables
                 # the timed speed ratio moves by a point or two from one timing to the next, and equal compute with it
                 "speed (timed)", "vs ref, equal compute", "equal compute", "vs ref, equal CPU time (unannealed)",
                 "vs ref, equal time (wall, unannealed)", "equal CPU time (unannealed)", "equal time (wall, unannealed)"}
CLOCK = [(re.compile(r"about [\d.]+ (s|min|h)\b"), "about ~"), (re.compile(r"\bin [\d.]+s\b"), "in ~s"),
         (re.compile(r"[\d,]+ tokens/s"), "~ tokens/s"), (re.compile(r"\(\d+:\d+:\d+\)"), ""),
         (re.compile(r", \d+ deselected"), ""),  # pytest's count of the tests a -k leaves out grows with the suite
         (re.compile(r"\d+ finished, \d+ to train\b.*"), "~ finished")]  # a study's plan: --runs finishes runs ahead


def blocks(text):
    """[(kind, lines)] in page order: 'run' for a fenced block of commands, 'out' for another fenced block without
    an info string, 'edit' for a check comment. Fences with an info string (```toml) are neither."""
    found, fence = [], None
    for line in text.split("\n"):
        if fence is None:
            if line.startswith("```"):
                fence = (line[3:].strip(), [])
            elif (m := re.fullmatch(r"<!-- check: (.*) -->", line.strip())):
                found.append(("edit", [m[1]]))
        elif line.startswith("```"):
            info, lines = fence
            if not info:
                first = next((l for l in lines if not l.startswith("#")), "")
                found.append(("run" if COMMAND.match(first) else "out", lines))
            fence = None
        else:
            fence[1].append(line)
    return found


def masked(lines):
    """The lines with the clock's numbers replaced by ~ (whole cells in a Markdown table's clock columns)."""
    out, clock = [], set()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            clock = {j for j, c in enumerate(cells) if c in CLOCK_COLUMNS}
        elif cells and not line.startswith("|---"):
            line = "| " + " | ".join("~" if j in clock else c for j, c in enumerate(cells)) + " |"
        for pattern, mask in CLOCK:
            line = pattern.sub(mask, line)
        out.append(line.rstrip())
    return out


def check(expected, actual):
    """The quoted lines not found in the output in order (after masking), as messages."""
    want, got, at, missing = masked(expected), masked(actual), 0, []
    for line in want:
        if line.strip() in ("...", ""):
            continue
        try:
            at = got.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a scratch folder, removed)")
    ap.add_argument("--runs", type=Path, help="copy the finished runs in this folder into the clone's runs/ first")
    args = ap.parse_args(argv)
    if args.runs is not None and not args.runs.is_dir():
        sys.exit(f"error: --runs {args.runs} is not a folder; give the folder that holds the studies' run folders")
    where = args.keep or Path(tempfile.mkdtemp(prefix="pages-"))
    clone = where / "clone"
    if clone.exists():
        shutil.rmtree(clone)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    if (ROOT / ".venv").exists():  # the installed environment, rather than a second install
        (clone / ".venv").symlink_to(ROOT / ".venv")
    if args.runs is not None:
        shutil.copytree(args.runs, clone / "runs", dirs_exist_ok=True)
    env = dict(os.environ, PATH=f"{clone / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(clone / ".venv"))
    env.pop("OMP_NUM_THREADS", None)
    failures = 0

    def run(script):
        return subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True).stdout

    print("make train (the quick start)", flush=True)
    run("exec 2>&1\nmake train")
    for page in PAGES:
        pending = None  # the output of the last block of commands, until its quoted output is met
        for kind, lines in blocks((clone / page).read_text()):
            if kind == "edit":
                run(lines[0])
            elif kind == "run":
                print(f"{page}: {lines[0][:100]}", flush=True)
                pending = (lines[0], run("exec 2>&1\n" + "\n".join(lines)).splitlines())
            elif pending is not None:
                missing = check(lines, pending[1])
                if missing:
                    failures += 1
                    print(f"  STALE after `{pending[0][:80]}`: {len(missing)} quoted line(s) not printed, the first:\n"
                          f"    {missing[0]}\n  the output was:\n" + "\n".join("    " + l for l in pending[1][-40:]))
                pending = None
    if not args.keep:
        shutil.rmtree(where, ignore_errors=True)
    print(f"{failures} stale quote(s)" if failures else "every quoted output was printed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
