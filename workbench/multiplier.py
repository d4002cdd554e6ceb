"""The compute multiplier, as the papers report theirs: how many steps, and how much time, the baseline needs
to reach the loss a routed variant reaches at the end of its own schedule, per seed.

    python -m workbench.multiplier runs/heads-w128-long/compare.json
    python -m workbench.multiplier runs/heads-w128-long/compare.json --variant attnres-h4 --baselines baseline,baseline-6000,baseline-8000

The baselines are runs whose schedules end at different lengths (4000, 6000 and 8000 steps in
studies/heads-w128-long.toml): their final losses, against their lengths, are the baseline's loss as a
function of its training length; the steps it needs for the variant's loss are read off that curve by
linear interpolation between the two lengths that bracket it (beyond the longest: "more than"). The time
is those steps at the baseline's own time per step (the median over the seed's baseline runs, so that one run
slowed by another job does not move it) over the variant's whole time, on the clock compare read (wall time,
or with `compare --clock cpu` each run's CPU time). Runs are not kept in the repository: the
command reads the compare.json that `compare` wrote.
"""
import argparse
import json
import statistics
import sys

from workbench.report import markdown


def runs_by_seed(result, variant):
    """{seed: run summary} of one variant of a compare.json."""
    return {r["seed"]: r for r in result["runs"] if r["variant"] == variant}


def steps_to_reach(loss, curve):
    """The training length at which the baseline's final loss would be `loss`, from curve [(steps, final
    loss), ...] (longer runs end lower), interpolated between the bracketing lengths: (steps, "") inside the
    curve, (the shortest, "less than ") above it, (the longest, "more than ") below it."""
    curve = sorted(curve)
    if loss > curve[0][1]:
        return curve[0][0], "less than "
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= loss <= l0:
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1), ""
    return curve[-1][0], "more than "


def multipliers(result, variant, baselines):
    """Rows per seed: the variant's steps and loss; the steps the baseline needs for that loss, and that and
    its time as multiples of the variant's steps and time (bounds where the curve does not reach)."""
    ref = {name: runs_by_seed(result, name) for name in baselines}
    rows = []
    for seed, run in sorted(runs_by_seed(result, variant).items()):
        mine = [ref[name][seed] for name in baselines if seed in ref[name]]
        curve = [(r["steps"], r["val_loss"]) for r in mine]
        steps, bound = steps_to_reach(run["val_loss"], curve)
        per_step = statistics.median(r["curve"][-1][2] / r["steps"] for r in mine)  # the baseline's s per step
        rows.append(dict(seed=seed, steps=run["steps"], val_loss=run["val_loss"], curve=curve, bound=bound,
                         baseline_steps=steps, step_x=steps / run["steps"],
                         time_x=steps * per_step / run["curve"][-1][2]))
    return rows


def table(rows, variant):
    """The rows as Markdown."""
    lengths = ", ".join(str(s) for s, _ in rows[0]["curve"])
    head = ["seed", f"{variant}: steps", "its val loss", f"the baseline's final loss at {lengths} steps",
            "baseline steps for that loss", "x steps", "x time"]
    return markdown(head, [[r["seed"], r["steps"], f"{r['val_loss']:.4f}",
                            ", ".join(f"{loss:.4f}" for _, loss in r["curve"]), f"{r['bound']}{r['baseline_steps']:.0f}",
                            f"{r['bound']}{r['step_x']:.2f}", f"{r['bound']}{r['time_x']:.2f}"] for r in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compare_json")
    ap.add_argument("--variant", default="attnres-h4")
    ap.add_argument("--baselines", default="baseline,baseline-6000,baseline-8000")
    args = ap.parse_args(argv)
    try:
        result = json.loads(open(args.compare_json).read())
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read {args.compare_json} ({e}); run the study's compare first")
    names = {r["variant"] for r in result.get("runs", [])}
    missing = [n for n in [args.variant, *args.baselines.split(",")] if n not in names]
    if missing:
        sys.exit(f"error: {args.compare_json} has no runs of {', '.join(missing)}; its variants are "
                 f"{', '.join(sorted(names))}")
    if any(r["curve"][-1][2] is None for r in result["runs"]):
        sys.exit(f"error: a run in {args.compare_json} has no time on the clock compare read; run compare again "
                 f"with the clock its runs recorded (--clock wall)")
    rows = multipliers(result, args.variant, args.baselines.split(","))
    print(table(rows, args.variant))


if __name__ == "__main__":
    main()
