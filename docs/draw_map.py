"""Draw docs/map.png from the map table in docs/results.md (one source for the numbers: the page itself).

    python docs/draw_map.py

The table is the one under "**The map, one seed**": a row per variant, a column per point of the map,
each cell the variant's final val loss minus the baseline's at the same point ("-" where it was not run).
Runs are not kept in the repository; the studies that made them are quoted in the page beside the table.
"""
from pathlib import Path

DOCS = Path(__file__).resolve().parent
HEADING = "**The map, one seed**"


def map_table(text):
    """(points, {variant: [gap or None per point]}) from the first Markdown table after HEADING."""
    lines = text[text.index(HEADING):].split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("*") for c in line.strip().strip("|").split("|")])
    points = rows[0][1:]
    gaps = {r[0]: [None if c == "-" else float(c) for c in r[1:]] for r in rows[2:]}
    return points, gaps


def draw(points, gaps, path):
    import matplotlib
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(gaps)
    for i, (variant, row) in enumerate(gaps.items()):
        xs = [p + (i - (len(gaps) - 1) / 2) * width for p, g in enumerate(row) if g is not None]
        ys = [g for g in row if g is not None]
        ax.bar(xs, ys, width, color=f"C{i}", label=variant, hatch="//" if "static" in variant else None,
               edgecolor="white")
    ax.axhline(0, color="black", lw=1)
    ax.set_xticks(range(len(points)), points)
    ax.set_ylabel("final val loss minus the baseline's\n(below 0: ahead of the baseline)")
    ax.set_title("Where routing pays: the pilot map, one seed per point, 4000 steps (hatched: static controls)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(*map_table((DOCS / "results.md").read_text()), DOCS / "map.png")
    print(f"wrote {DOCS / 'map.png'}")
