"""The compute multiplier at one model size: how many steps the baseline needs, on its own fully annealed
schedule, to reach the loss a routed variant reaches at the end of its schedule, per seed, and how much time
that is at the timed speed. (Kimi's 1.25x is another reading: it comes from scaling-law fits across model
sizes.)

    python -m workbench.multiplier runs/heads-w128-long/compare.json
    python -m workbench.multiplier studies/results/heads-w128-long.json --variant attnres-h4 --baselines baseline,baseline-6000,baseline-8000

The baselines are runs whose schedules end at different lengths (4000, 6000 and 8000 steps in
studies/heads-w128-long.toml): their final losses against their lengths are the baseline's loss as a function
of its training length, and the steps it needs for the variant's loss are read off that curve linear in
log(steps) between the two lengths that bracket it (beyond the longest: "more than"), as compare's
break-even column reads it. x time is x steps times the variant's speed relative to the baseline, timed with
the two interleaved (compare.json's speed, workbench/speed.py): the baseline's time to reach the variant's
loss over the variant's own time. Reads a compare.json or a study's results file.
"""
import argparse
import json
import sys

from workbench.report import length_for_loss, markdown, speed_name, speed_ratio


def runs_by_seed(result, variant):
    """{seed: run summary} of one variant of a compare.json."""
    return {r["seed"]: r for r in result["runs"] if r["variant"] == variant}


def multipliers(result, variant, baselines):
    """Rows per seed: the variant's steps and loss; the steps the baseline needs for that loss, and that and
    its time as multiples of the variant's steps and time (bounds where the curve does not reach)."""
    times = result["speed"]["times"]
    _, speed = speed_ratio(times[speed_name(variant)], times[speed_name(baselines[0])])  # the median
    ref = {name: runs_by_seed(result, name) for name in baselines}
    rows = []
    for seed, run in sorted(runs_by_seed(result, variant).items()):
        curve = sorted((ref[name][seed]["steps"], ref[name][seed]["val_loss"]) for name in baselines
                       if seed in ref[name])
        if not curve:  # no baseline run of this seed
            continue
        steps, bound = length_for_loss(run["val_loss"], curve)
        bound = {"<": "less than ", ">": "more than "}.get(bound, "")
        rows.append(dict(seed=seed, steps=run["steps"], val_loss=run["val_loss"], curve=curve, bound=bound,
                         baseline_steps=steps, step_x=steps / run["steps"], speed=speed,
                         time_x=steps / run["steps"] * speed))
    return rows


def table(rows, variant):
    """The rows as Markdown."""
    lengths = ", ".join(str(s) for s, _ in rows[0]["curve"])
    head = ["seed", f"{variant}: steps", "its val loss", f"the baseline's final loss at {lengths} steps",
            "baseline steps for that loss", "x steps", "timed speed", "x time"]
    return markdown(head, [[r["seed"], r["steps"], f"{r['val_loss']:.4f}",
                            ", ".join(f"{loss:.4f}" for _, loss in r["curve"]), f"{r['bound']}{r['baseline_steps']:.0f}",
                            f"{r['bound']}{r['step_x']:.2f}", f"{r['speed']:.3f}x",
                            f"{r['bound']}{r['time_x']:.2f}"] for r in rows])


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
    times = (result.get("speed") or {}).get("times") or {}
    if speed_name(args.variant) not in times or speed_name(args.baselines.split(",")[0]) not in times:
        sys.exit(f"error: {args.compare_json} has no timed speed of {args.variant} and the baseline; run the "
                 f"study's compare again (its --speed-rounds times them)")
    rows = multipliers(result, args.variant, args.baselines.split(","))
    print(table(rows, args.variant))


if __name__ == "__main__":
    main()
