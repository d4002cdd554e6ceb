"""
Routing reports and mode comparisons for the CLI: statistics, terminal tables, JSON, and PNG pictures.

    stats = routing_stats(model, idx)                        # per routed sublayer: sharpness, entropy, ...
    routing_table([("delta", stats), ("attnres", stats2)])   # the table, its averages and a legend
    draw_routing([...], "report.png")                        # mean-weight heatmaps + max weight per sublayer
    study_rows(summaries, reference) / study_table(rows, reference) / draw_study(...)   # compare and studies

The statistics themselves (routing_stats) live in plumbing/routing_stats.py, which train.py uses at each
evaluation; matplotlib is imported inside the draw functions, so importing this module stays light.
Written JSON is strict: a statistic with no value (one source) is null, not NaN.
"""
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

import data
from errors import ConfigError
from plumbing.checkpoint import checkpoint_dataset, load_model
from plumbing.config import ARCH_FIELDS, at_least_one, mode_label
from plumbing.routing_stats import routing_stats
from plumbing.rundir import check_folder, jsonable

TABLE_LEGEND = """\
n: the sublayer's number of sources; 1/n: the weight of each under uniform routing.
max w (max weight): a token's largest routing weight, averaged over tokens (1/n uniform, 1: one source takes all).
entropy (/ log n): the entropy of a token's routing weights over log n, averaged (1 uniform, 0: one source takes all).
adj cos: the cosine similarity of adjacent sources, averaged (near 1: they point the same way).
deeper half: the sublayers past the middle of the model. Averages leave out sublayers with one source."""


def fmt(x, spec=".3f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(head, rows):
    """A Markdown table (it reads as a plain table in the terminal too)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def routing_table(reports):
    """Per routed sublayer: sources n, uniform weight 1/n, then for each (label, stats): mean max weight,
    normalised entropy and adjacent-source cosine; then the averages over all and the deeper half.
    Runs whose source counts differ (attnres with N blocks against delta, say) get an n column each."""
    labels = [label for label, _ in reports]
    by_name = [{r["name"]: r for r in stats["sublayers"]} for _, stats in reports]  # per run: name -> stats
    names = list(dict.fromkeys(name for run in by_name for name in run))  # in order, attnres's final last
    counts = [{name: r["n"] for name, r in run.items()} for run in by_name]
    shared_n = all(c == counts[0] for c in counts)
    cols = ("max w", "entropy", "adj cos") if shared_n else ("n", "max w", "entropy", "adj cos")
    head = ["sublayer"] + (["n", "1/n"] if shared_n else []) + [
        f"{col} {label}" if len(reports) > 1 else col for label in labels for col in cols]
    rows = []
    for name in names:
        row = [name] + ([by_name[0][name]["n"], fmt(by_name[0][name]["uniform"])] if shared_n else [])
        for run in by_name:
            s = run.get(name, {})
            row += ([s.get("n", "-")] if not shared_n else []) + [
                fmt(s.get("max_weight")), fmt(s.get("entropy")), fmt(s.get("adj_cos"))]
        rows.append(row)
    summary = markdown(["average"] + labels, [
        ["max weight, all (n > 1)"] + [fmt(s["mean_max_weight"]) for _, s in reports],
        ["max weight, deeper half"] + [fmt(s["deep_max_weight"]) for _, s in reports],
        ["entropy / log n, all"] + [fmt(s["mean_entropy"]) for _, s in reports],
        ["entropy / log n, deeper half"] + [fmt(s["deep_entropy"]) for _, s in reports],
        ["adjacent-source cosine"] + [fmt(s["mean_adj_cos"]) for _, s in reports],
    ])
    return markdown(head, rows) + "\n\n" + summary + "\n\n" + TABLE_LEGEND


def draw_routing(reports, path):
    """One PNG: for each report a heatmap of the mean routing weight (routed sublayer by source, as in the
    Attention Residuals paper), and below them, across the figure, the mean max weight per sublayer
    against uniform 1/n."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt
    n = len(reports)
    fig = plt.figure(figsize=(5.2 * n + 1, 9))
    grid = fig.add_gridspec(2, n, height_ratios=[3, 2])
    for col, (label, stats) in enumerate(reports):
        rows = stats["sublayers"]
        width = max(r["n"] for r in rows)
        weights = [r["mean_weight"] + [math.nan] * (width - r["n"]) for r in rows]  # (sublayers, width)
        ax = fig.add_subplot(grid[0, col])
        im = ax.imshow(weights, cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{label}: mean routing weight")
        ax.set_xticks(range(width), stats["source_names"][:width], fontsize=7)
        ax.set_xlabel("source (e = embedding)")
        ax.set_ylabel("routed sublayer")
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046).set_label("mean routing weight alpha")
    ax = fig.add_subplot(grid[1, :])
    names = list(dict.fromkeys(r["name"] for _, stats in reports for r in stats["sublayers"]))  # attnres's final last
    x = {name: i for i, name in enumerate(names)}
    for label, stats in reports:
        rows = stats["sublayers"]
        ax.plot([x[r["name"]] for r in rows], [r["max_weight"] for r in rows], marker="o", label=f"{label} max weight")
    profiles = {}  # each distinct uniform profile 1/n, with the first run that has it
    for label, stats in reports:
        profiles.setdefault(tuple((x[r["name"]], r["uniform"]) for r in stats["sublayers"]), label)
    for k, (points, label) in enumerate(profiles.items()):
        ax.plot(*zip(*points), "k" + ("--" if k == 0 else ":"),
                label="uniform 1/n" + (f" ({label})" if len(profiles) > 1 else ""))
    ax.set_xticks(range(len(names)), names, fontsize=7, rotation=45)
    ax.set_xlabel("routed sublayer")
    ax.set_ylabel("mean max weight")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("routing sharpness")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(obj, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=2, default=float, allow_nan=False)
        f.write("\n")


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None  # one seed: no spread


def compare_rows(runs, reference="baseline"):
    """runs: {mode: [summary per seed]} -> a row per mode: val loss and perplexity (mean, std over
    seeds), change against the reference in %, routing sharpness, tokens/s, parameters."""
    rows = []
    for mode, seeds in runs.items():
        loss, loss_sd = mean_std([s["val_loss"] for s in seeds])
        ppl, ppl_sd = mean_std([math.exp(s["val_loss"]) for s in seeds])
        sharp, _ = mean_std([s.get("max_weight") for s in seeds])
        tok_s, _ = mean_std([s.get("tokens_per_s") for s in seeds])
        rows.append(dict(mode=mode, seeds=len(seeds), val_loss=loss, val_loss_std=loss_sd, ppl=ppl, ppl_std=ppl_sd,
                         max_weight=sharp, tokens_per_s=tok_s, params=seeds[0].get("params")))
    base = next((r for r in rows if r["mode"] == reference), None)
    for r in rows:
        r["ppl_change_pct"] = 100 * (r["ppl"] / base["ppl"] - 1) if base else None
    return rows


def draw_curves(curves, path, title=None, clock="wall", cost=None):
    """curves: {label: [[(step, val_loss, elapsed s or None), ...] per seed]} -> validation loss against step (the
    mean over seeds bold, each seed thin), the second half zoomed, and against compute where cost ({label: the
    reference's steps per step, one over the timed speed}) gives every label's, else, where every point has its
    time, against that time (clock: wall or CPU). title: the figure's title (the caller names what was run)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt
    cost = cost if cost and all(label in cost for label in curves) else None
    timed = cost is not None or all(len(p) == 3 and p[2] is not None for seeds in curves.values()
                                    for pts in seeds for p in pts)
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(18 if timed else 12, 4.8))
    if timed:
        for i, (mode, seeds) in enumerate(curves.items()):
            for k, points in enumerate(seeds):
                x = [p[0] * cost[mode] for p in points] if cost else [p[2] / 60 for p in points]
                axes[2].plot(x, [p[1] for p in points], color=f"C{i}", lw=1.5, marker="o", ms=2,
                             label=mode if k == 0 else None)
        if cost:
            axis, unit = "compute", "the reference's training steps, at the timed speed"
        else:
            axis, unit = "wall time" if clock == "wall" else "CPU time", "minutes, each run's own"
        axes[2].set_xlabel(f"{axis} ({unit})")
        axes[2].set_ylabel("validation loss")
        axes[2].set_title(f"against {axis}")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=8)
    curves = {mode: [[(step, v) for step, v, *_ in pts] for pts in seeds] for mode, seeds in curves.items()}
    for ax in axes[:2]:
        for i, (mode, seeds) in enumerate(curves.items()):
            color = f"C{i}"
            for points in seeds:
                ax.plot(*zip(*points), color=color, alpha=0.25, lw=1)
            steps = sorted(set.intersection(*[{s for s, _ in pts} for pts in seeds]))
            mean = [statistics.fmean(dict(pts)[s] for pts in seeds) for s in steps]
            ax.plot(steps, mean, color=color, lw=2, marker="o", ms=3, label=f"{mode} (mean of {len(seeds)})")
        ax.plot([], [], color="gray", alpha=0.5, lw=1, label="thin lines: one seed each")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    last = max(s for seeds in curves.values() for pts in seeds for s, _ in pts)
    late = [v for seeds in curves.values() for pts in seeds for s, v in pts if s >= last / 2]
    if last > 0 and late:
        pad = 0.1 * (max(late) - min(late)) + 1e-3
        axes[1].set_xlim(last / 2 - 0.02 * last, last * 1.02)
        axes[1].set_ylim(min(late) - pad, max(late) + pad)
    axes[0].set_title("all steps")
    axes[1].set_title("second half, zoomed")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_checkpoints(paths, out=None, batches=8, batch_size=8, data_dir=None, force=False):
    """Routing statistics of one or two routed checkpoints on the same fixed validation batches: returns the
    table and the files written (out/report.json and out/report.png; out defaults to beside the first).
    Every checkpoint is checked before anything is computed, and existing reports are kept unless force."""
    if len(paths) > 2:
        raise ConfigError("report compares at most two checkpoints")
    at_least_one(batches=batches, batch_size=batch_size)
    out = Path(out) if out is not None else Path(paths[0]).parent / "report"
    check_folder(out, "--out")
    written = [out / "report.json", out / "report.png"]
    if not force and any(p.exists() for p in written):
        raise ConfigError(f"{out} already holds a report; pass --force to replace it, or choose another --out")
    loaded = []
    for path in paths:
        model, ckpt = load_model(path)
        if model.config.residual == "baseline":
            raise ConfigError(f"{path} is a baseline model: it has no routing to report; train or convert a routed "
                              f"one (--residual attnres, delta or delta_block)")
        loaded.append((path, model, checkpoint_dataset(ckpt, path, data_dir=data_dir)))
    labels = [mode_label(model.config) for _, model, _ in loaded]
    if len(labels) == 2 and labels[0] == labels[1]:  # one mode twice: what differs between them, else their paths
        a, b = (asdict(model.config) for _, model, _ in loaded)
        differ = [k for k in ARCH_FIELDS if a[k] != b[k]]
        labels = [f"{label} ({', '.join(f'{k}={c[k]}' for k in differ)})" for label, c in zip(labels, (a, b))]
        if not differ:
            labels = [str(p) for p in paths]
    reports = []
    for (path, model, ds), label in zip(loaded, labels):
        device = model.lm_head.weight.device
        X = torch.cat([data.eval_batch(ds, "val", k, batch_size, model.config.block_size, device)[0] for k in range(batches)])
        reports.append((label, routing_stats(model, X)))
    out.mkdir(parents=True, exist_ok=True)
    save_json({label: dict(stats, checkpoint=str(p)) for (label, stats), p in zip(reports, paths)}, written[0])
    draw_routing(reports, written[1])
    return routing_table(reports), written


# ------------------------------------------------------------------------------------------------
# studies: paired statistics per sweep value, their table and pictures

def paired(values, refs):
    """values, refs: {seed: x} -> (mean of x - ref over the seeds both have, its standard error (std of the
    differences / sqrt(n); None for one seed), seeds where x < ref, n)."""
    seeds = [s for s in values if s in refs and values[s] is not None and refs[s] is not None]
    diffs = [values[s] - refs[s] for s in seeds]
    if not diffs:
        return None, None, 0, 0
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return statistics.fmean(diffs), se, sum(d < 0 for d in diffs), len(diffs)


def loss_at(curve, t):
    """The val loss of a curve [(step, val loss, elapsed s), ...] at wall time t, linearly interpolated
    between evaluations (the first and last values outside them)."""
    points = sorted((e, v) for _, v, e in curve if e is not None)
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / max(t1 - t0, 1e-12)
    return points[-1][1]


def equal_time(runs, refs):
    """runs, refs: {seed: run summary} -> paired() of the val loss curves, per seed both read at the shorter
    run's total time (wall or CPU, as the summaries' clock recorded it)."""
    at = {k: min(s["elapsed"], refs[k]["elapsed"]) for k, s in runs.items()
          if k in refs and s["elapsed"] is not None and refs[k]["elapsed"] is not None}
    return paired({k: loss_at(runs[k]["curve"], t) for k, t in at.items()},
                  {k: loss_at(refs[k]["curve"], t) for k, t in at.items()})


# ------------------------------------------------------------------------------------------------
# per minute, from the curves and a measured speed ratio (workbench/speed.py): readings that a busy machine
# cannot move, since the losses reproduce to the digit and the ratio is timed with the shapes interleaved

def loss_at_length(steps, lengths):
    """The final val loss a run of `steps` steps on its own, fully annealed schedule would reach, from runs of
    other lengths [(steps, final loss), ...]: a run of that length's own loss, else linear in log(steps)
    between the two lengths that bracket it (lower than the straight chord: the reading that does not
    flatter a run compared against it); None outside them."""
    points = sorted(lengths)
    exact = [loss for s, loss in points if s == steps]
    if exact:
        return exact[0]
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 < steps < s1:
            return l0 + (l1 - l0) * math.log(steps / s0) / math.log(s1 / s0)
    return None


def length_for_loss(loss, lengths):
    """(steps, bound): the training length whose final loss would be `loss`, the inverse of loss_at_length;
    bound '' inside the lengths, '>' past the longest (steps is then the longest), '<' before the shortest."""
    points = sorted(lengths)
    if loss > points[0][1]:
        return points[0][0], "<"
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l1 <= loss <= l0 and s1 > s0:
            return s0 * (s1 / s0) ** ((l0 - loss) / max(l0 - l1, 1e-12)), ""
    return points[-1][0], "" if loss == points[-1][1] else ">"


def per_minute(runs, lengths, speed):
    """runs: {seed: run summary} of a variant; lengths: {seed: [(steps, final val loss)]} of its reference's
    runs of every schedule length; speed: the variant's measured speed ratio to the reference, or None.
    Returns the break-even speed per seed (the ratio at which it would be level at equal compute, one over the
    step multiplier: from the losses alone; with '<' or '>' where the lengths do not reach) and the paired
    difference at equal compute (the reference given steps / speed steps on its own schedule)."""
    break_even, mine, refs, short = {}, {}, {}, []
    for seed, run in runs.items():
        if not lengths.get(seed):
            continue
        needed, bound = length_for_loss(run["val_loss"], lengths[seed])
        break_even[seed] = ({"<": ">", ">": "<"}.get(bound, ""), run["steps"] / needed)
        at = loss_at_length(run["steps"] / speed, lengths[seed]) if speed else None
        if at is None and speed:
            short.append(round(run["steps"] / speed))
        elif at is not None:
            mine[seed], refs[seed] = run["val_loss"], at
    diff, se, wins, n = paired(mine, refs)
    return dict(break_even=break_even, equal_compute_diff=diff, equal_compute_se=se, equal_compute_wins=wins,
                equal_compute_paired=n, equal_compute_needs=max(short) if short else None)


def break_even_text(per_seed):
    """The break-even speeds of the seeds, as 'min-max' (a bound where the lengths did not reach: '<1.00->1.00x'
    says one seed is level only below 1.00x, another only above)."""
    if not per_seed:
        return "-"
    values = sorted(per_seed.values(), key=lambda bx: (bx[1], "<=>".index(bx[0] or "=")))
    (b0, x0), (b1, x1) = values[0], values[-1]
    return f"{b0}{x0:.2f}x" if len(values) == 1 or f"{b0}{x0:.2f}" == f"{b1}{x1:.2f}" else \
        f"{b0}{x0:.2f}-{b1}{x1:.2f}x"


def compute_text(r):
    if r.get("equal_compute_diff") is not None:
        return signed(r["equal_compute_diff"], r["equal_compute_se"])
    return f"needs {r['equal_compute_needs']:,} ref steps" if r.get("equal_compute_needs") else "-"


def speed_name(variant, option=None, value=None):
    """A variant's name in compare.json's measured speeds: with a sweep, at one value of it."""
    return variant if option is None else f"{variant} {option}={value}"


def readings(runs, by_variant, b, family, option, value, times):
    """The per-minute readings of runs (a variant's, {seed: summary}) against variant b: the measured speed
    ratio (best, median) and per_minute's, where b's family (b and the runs like it but for their length) has
    runs; {} for b's family itself."""
    a = next(iter(runs.values()))["variant"] if runs else None
    if not runs or a in family:
        return {}
    lengths = {}
    for name in family:
        for seed, s in by_variant.get(name, {}).items():
            lengths.setdefault(seed, []).append((s["steps"], s["val_loss"]))
    best = median = None
    times = times or {}
    if speed_name(a, option, value) in times and speed_name(b, option, value) in times:
        best, median = speed_ratio(times[speed_name(a, option, value)], times[speed_name(b, option, value)])
    return dict(speed_best=best, speed_median=median, **per_minute(runs, lengths, median))


def speed_ratio(mine, ref):
    """(best, median) speed ratio of a shape to a reference from their per-round seconds per step."""
    return min(ref) / min(mine), statistics.median(r / m for r, m in zip(ref, mine))


def by_sweep(summaries):
    """(sweep value, {variant: {seed: summary}}) for each sweep value of the runs, in their order."""
    for value in dict.fromkeys(s["sweep"] for s in summaries):
        runs = {}
        for s in summaries:
            if s["sweep"] == value:
                runs.setdefault(s["variant"], {})[s["seed"]] = s
        yield value, runs


def study_rows(summaries, reference, option=None, families=None, times=None):
    """summaries: one dict per run (variant, sweep, seed, val_loss, tokens_per_s, routing stats, elapsed,
    curve) -> a row per sweep value and variant: compare_rows' figures, the paired difference to the
    reference (mean, standard error, seeds beaten), sharpness, speed relative to the reference from the runs'
    clocks, and the paired difference at equal time: per seed both curves read at the shorter run's total
    time. With families ({variant: the variants like it but for their schedule length}) and times ({speed
    name: per-round seconds per step}, workbench/speed.py): the per-minute readings (readings())."""
    rows = []
    for value, by_variant in by_sweep(summaries):
        group = {variant: list(runs.values()) for variant, runs in by_variant.items()}
        ref = by_variant[reference]
        for row in compare_rows(group, reference):
            variant = row.pop("mode")
            runs, other = by_variant[variant], variant != reference
            diff, se, wins, n = paired({k: s["val_loss"] for k, s in runs.items()},
                                       {k: s["val_loss"] for k, s in ref.items()})
            t_diff, t_se, _, _ = equal_time(runs, ref)
            speed, ref_speed = (mean_std([s["tokens_per_s"] for s in g.values()])[0] for g in (runs, ref))
            rows.append(dict(row, variant=variant, sweep=value, option=option,
                             diff=diff if other else None, diff_se=se if other else None, wins=wins, paired=n,
                             deep_max_weight=mean_std([s.get("deep_max_weight") for s in runs.values()])[0],
                             entropy=mean_std([s.get("entropy") for s in runs.values()])[0],
                             deep_entropy=mean_std([s.get("deep_entropy") for s in runs.values()])[0],
                             speed_ratio=speed / ref_speed if speed and ref_speed else None,
                             equal_time_diff=t_diff if other else None, equal_time_se=t_se if other else None,
                             elapsed=mean_std([s.get("elapsed") for s in runs.values()])[0],
                             **(readings(runs, by_variant, reference, families.get(reference, [reference]),
                                         option, value, times) if families is not None else {})))
    return rows


def signed(x, se, spec=".4f"):
    return "-" if x is None else f"{x:+{spec}} ± {fmt(se, spec)}"


def speed_text(r):
    return "-" if r.get("speed_median") is None else f"{r['speed_median']:.3f}x ({r['speed_best']:.3f})"


def time_head(clock):
    return "equal time (wall, unannealed)" if clock == "wall" else "equal CPU time (unannealed)"


def study_table(rows, reference, option=None, clock="wall"):
    """The study's Markdown table: a row per sweep value and variant."""
    head = ([option] if option else []) + [
        "variant", "seeds", "val loss", f"vs {reference}", "beat", "perplexity", "max weight", "deep max",
        "entropy", "tokens/s", "speed (timed)", "break-even", "vs ref, equal compute",
        f"vs ref, {time_head(clock)}", "params"]
    body = [([str(r["sweep"])] if option else []) + [
        r["variant"], r["seeds"], f"{fmt(r['val_loss'], '.4f')} ± {fmt(r['val_loss_std'], '.4f')}",
        signed(r["diff"], r["diff_se"]), "-" if r["variant"] == reference else f"{r['wins']}/{r['paired']}",
        "-" if r["ppl_change_pct"] is None else f"{r['ppl_change_pct']:+.2f}%",
        fmt(r["max_weight"]), fmt(r["deep_max_weight"]), fmt(r["entropy"]), fmt(r["tokens_per_s"], ",.0f"),
        speed_text(r), break_even_text(r.get("break_even")), compute_text(r),
        signed(r["equal_time_diff"], r["equal_time_se"]), f"{r['params']:,}"] for r in rows]
    return markdown(head, body)


def pair_rows(summaries, pairs, option=None, families=None, times=None):
    """The paired difference of each pair [a, b] of variants (a minus b, seed by seed) at every sweep value,
    at the end and at equal time, and with families and times (as study_rows) a's per-minute readings
    against b."""
    rows = []
    for value, runs in by_sweep(summaries):
        for a, b in pairs:
            ra, rb = runs.get(a, {}), runs.get(b, {})
            diff, se, wins, n = paired({k: s["val_loss"] for k, s in ra.items()},
                                       {k: s["val_loss"] for k, s in rb.items()})
            t_diff, t_se, _, _ = equal_time(ra, rb)
            rows.append(dict(sweep=value, a=a, b=b, diff=diff, diff_se=se, wins=wins, paired=n,
                             equal_time_diff=t_diff, equal_time_se=t_se,
                             **(readings(ra, runs, b, families.get(b, [b]), option, value, times)
                                if families is not None else {})))
    return rows


def pair_table(rows, option=None, clock="wall"):
    """The pairs' Markdown table: a row per sweep value and pair."""
    head = ([option] if option else []) + ["pair", "val loss difference", "beat", "speed (timed)",
                                           "break-even", "equal compute", time_head(clock)]
    return markdown(head, [([str(r["sweep"])] if option else [])
                           + [f"{r['a']} - {r['b']}", signed(r["diff"], r["diff_se"]), f"{r['wins']}/{r['paired']}",
                              speed_text(r), break_even_text(r.get("break_even")), compute_text(r),
                              signed(r["equal_time_diff"], r["equal_time_se"])] for r in rows])


def lead_rows(summaries, reference, pairs, every):
    """The paired difference by step: for each variant on the reference's schedule (against the reference) and
    each pair [a, b] (a minus b), at every evaluation step both have on every seed that is a multiple of
    `every` (step 0 left out), of the val loss and of the train loss: a row per sweep value, comparison and
    loss, its cells {step: (mean, standard error, seeds where a is lower, seeds)} and its epochs {step: passes
    over the training split} (None where a's runs did not record their tokens per step)."""
    rows = []
    for value, runs in by_sweep(summaries):
        steps_of = {v: {s["steps"] for s in r.values()} for v, r in runs.items()}
        compared = [(v, reference) for v in runs if v != reference and steps_of[v] == steps_of.get(reference)]
        for a, b in compared + [tuple(pair) for pair in pairs if tuple(pair) not in compared]:
            seeds = runs.get(a, {}).keys() & runs.get(b, {}).keys()
            for loss in ("val_loss", "train_loss"):
                curves = {seed: [{e["step"]: e[loss] for e in runs[v][seed]["evals"]} for v in (a, b)]
                          for seed in seeds}  # {seed: [a's {step: loss}, b's]}
                shared = set.intersection(*(set(ca) & set(cb) for ca, cb in curves.values())) if seeds else set()
                cells = {step: paired(*({s: c[i][step] for s, c in curves.items()} for i in (0, 1)))
                         for step in sorted(shared) if step > 0 and step % every == 0}
                per_step = {runs[a][seed].get("epochs_per_step") for seed in seeds}
                epochs = {step: step * min(per_step) for step in cells} if None not in per_step else None
                if cells:
                    rows.append(dict(sweep=value, a=a, b=b, loss=loss.split("_")[0], cells=cells, epochs=epochs))
    return rows


def lead_table(rows, option=None):
    """The lead-by-step Markdown table: a row per lead_rows row, a column per step, each cell the mean
    difference and the seeds where a is lower."""
    steps = sorted({step for r in rows for step in r["cells"]})
    head = ([option] if option else []) + ["lead (a - b), loss"] + [str(s) for s in steps]
    body = [([str(r["sweep"])] if option else []) + [f"{r['a']} - {r['b']}, {r['loss']}"]
            + ["" if s not in r["cells"] else f"{r['cells'][s][0]:+.4f} ({r['cells'][s][2]}/{r['cells'][s][3]})"
               for s in steps] for r in rows]
    # past one pass over the training text, a lead in train loss may not carry over to val loss; results
    # written before runs recorded their tokens per step, or rows that pass the text at other rates: no row
    known = all(r.get("epochs") is not None for r in rows)
    passes = {s: {f"{r['epochs'][s]:.2f}" for r in rows if s in r["cells"]} for s in steps} if known else {}
    if known and all(len(p) == 1 for p in passes.values()):
        body.insert(0, ([""] if option else []) + ["epochs (passes over the training split)"]
                    + [min(passes[s]) for s in steps])
    return markdown(head, body)


def study_notes(reference, pairs=False, clock="wall"):
    """What the study table's columns mean (written under it in compare.md), and the pairs' table's."""
    clock_word = "wall" if clock == "wall" else "CPU"
    return (f"val loss: the last evaluation's, mean ± std over seeds. vs {reference}: the mean over seeds of each "
            f"seed's difference to {reference} (the same batches), ± its standard error (std of the differences "
            f"/ sqrt(n)); a difference within about two standard errors is no measurable difference. beat: seeds "
            f"with a lower loss than {reference}. perplexity: the change of the mean perplexity. max weight, deep "
            f"max: mean largest routing weight over routed sublayers with more than one source, and over the "
            f"deeper half; entropy: normalised routing entropy H / log n (1 is uniform); all at the last "
            f"evaluation. tokens/s: median training speed on the runs' own clocks. speed (timed): the variant's "
            f"speed relative to {reference}, a whole training step at the study's shape timed with the shapes "
            f"interleaved in one process (compare.json's speed): the median over rounds (the best rounds' ratio). "
            f"break-even: the speed ratio at which the variant would be level with {reference} at equal compute, "
            f"the variant's steps over the steps {reference} needs on its own schedule to reach its loss (one "
            f"over the step multiplier), per seed "
            f"(min-max), read from the final losses of {reference}'s runs of different lengths, linear in "
            f"log(steps) between the two that bracket it (> or < where they do not reach): from the losses alone. "
            f"vs ref, equal compute: the paired difference to {reference} given the variant's steps over the "
            f"timed speed on its own, fully annealed schedule, read from the same lengths (or 'needs N ref steps' "
            f"where no run is that long). vs ref, {time_head(clock)}: a secondary reading on the runs' own "
            f"{clock_word} clocks (another job moves them): the val loss curves (interpolated between evaluations) "
            f"read at the shorter run's total time, the slower run's mid-way through its schedule, which biases "
            f"against it."
            + (" pair a - b: the mean over seeds of a's val loss minus b's (the same batches), ± its standard "
               "error; beat: seeds where a is lower; speed, break-even and equal compute: a's against b's runs "
               "of every length, as in the rows; equal time: as in the column vs ref." if pairs else ""))


def step_costs(variants, times, reference, option=None, value=None):
    """{variant: its training step's cost in the reference's steps, one over the timed speed (the median over
    rounds, as the tables' speed)} for the variants timed beside the reference; {} without a timing."""
    ref = (times or {}).get(speed_name(reference, option, value))
    return {v: 1 / speed_ratio(times[speed_name(v, option, value)], ref)[1] for v in variants
            if ref and speed_name(v, option, value) in times}


def draw_study(rows, summaries, reference, option, out, title=None, clock="wall", times=None):
    """The study's pictures in folder out; returns their paths. With a sweep: loss.png (val loss ± std, and
    the paired difference to the reference ± standard error, against the swept option) and sharpness.png
    (max weight and entropy against it, routed variants); always the curves: one picture per sweep value, or
    one picture with a line per value when the study has one variant. With times (compare.json's timed
    seconds per step), the curves' third panel is against compute, else against the runs' own clocks."""
    out, written = Path(out), []
    if option is not None and len({s["variant"] for s in summaries}) == 1:  # one variant: its values side by side
        curves = {}
        for s in summaries:
            curves.setdefault(f"{option} = {s['sweep']}", []).append(s["curve"])
        draw_curves(curves, out / "curves.png", title, clock)
        written.append(out / "curves.png")
    values = dict.fromkeys(s["sweep"] for s in summaries) if not written else {}  # else: a picture per value
    for value in values:
        curves = {}
        for s in summaries:
            if s["sweep"] == value:
                curves.setdefault(s["variant"], []).append(s["curve"])
        path = out / ("curves.png" if option is None else f"curves-{option}={value}.png")
        draw_curves(curves, path, title if option is None else f"{title}; {option} = {value}", clock,
                    step_costs(curves, times, reference, option, value))
        written.append(path)
    if option is not None:
        written.append(draw_sweep(rows, option, [("val_loss", "val_loss_std", "validation loss (mean ± std)"),
                                                 ("diff", "diff_se", f"val loss - {reference} (± s.e.)")],
                                  out / "loss.png", title=title))
        if any(r["max_weight"] is not None for r in rows):
            written.append(draw_sweep(rows, option, [("max_weight", None, "mean max routing weight"),
                                                     ("entropy", None, "normalised routing entropy")],
                                      out / "sharpness.png", deep=True, title=title))
    return written


def draw_sweep(rows, option, panels, path, deep=False, title=None):
    """One panel per (key, error key, label): each variant's value against the swept option, with error
    bars; with deep, the deeper half's figure dashed beside it. Log x for positive values spanning 4x or more."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    values = list(dict.fromkeys(r["sweep"] for r in rows))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    xs = {v: v if numeric else i for i, v in enumerate(values)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (key, err, label) in zip(axes[0], panels):
        for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
            mine = [r for r in rows if r["variant"] == variant and r[key] is not None]
            if not mine:
                continue
            ax.errorbar([xs[r["sweep"]] for r in mine], [r[key] for r in mine], marker="o", capsize=3,
                        color=f"C{i}", label=variant, yerr=[r[err] or 0 for r in mine] if err else None)
            deep_key = {"max_weight": "deep_max_weight", "entropy": "deep_entropy"}.get(key)
            if deep and deep_key:
                ax.plot([xs[r["sweep"]] for r in mine], [r[deep_key] for r in mine], "--", color=f"C{i}", alpha=0.7)
        if key == "diff":
            ax.axhline(0, color="k", lw=0.8)
        if numeric and min(values) > 0 and max(values) >= 4 * min(values):
            ax.set_xscale("log")
        ax.set_xticks([xs[v] for v in values], [str(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(option)
        ax.set_ylabel(label + (" (dashed: deeper half)" if deep else ""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a study of the reference alone has no difference to draw
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def study_best(rows, option, unswept=(), tuning=True):
    """For a numeric sweep of three values or more, one line: each swept variant's value with the lowest mean
    val loss; in a sweep that tunes a training setting (tuning, not the model's shape such as n_layer),
    flagged when it lies at either end of the sweep (then widen the sweep); else ''."""
    values = sorted(dict.fromkeys(r["sweep"] for r in rows)) if option else []
    if len(values) < 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return ""
    parts = []
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] not in unswept):
        best = min((r for r in rows if r["variant"] == variant), key=lambda r: r["val_loss"])
        edge = tuning and best["sweep"] in (values[0], values[-1])
        parts.append(f"{variant} {best['sweep']}" + (" (at the sweep's edge: widen it)" if edge else ""))
    return f"lowest mean val loss by {option}: " + ", ".join(parts)
