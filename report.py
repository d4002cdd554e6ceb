"""
Routing reports and mode comparisons for the CLI: terminal tables, JSON, and PNG pictures.

    routing_table([("delta", stats), ("attnres", stats2)])   # stats from GPT.routing_stats
    draw_routing([...], "report.png")                        # mean-weight heatmaps + max weight per sublayer
    compare_rows(runs) / compare_table(rows) / draw_curves(runs, "curves.png")
"""
import json
import math
import statistics

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402


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
    return markdown(head, rows) + "\n\n" + summary


def draw_routing(reports, path):
    """One PNG: for each report a heatmap of the mean routing weight (routed sublayer by source, as in the
    Attention Residuals paper), and below them the mean max weight per sublayer against uniform 1/n."""
    n = len(reports)
    fig, axes = plt.subplots(2, n, figsize=(5.2 * n, 9), squeeze=False,
                             gridspec_kw=dict(height_ratios=[3, 2]))
    for col, (label, stats) in enumerate(reports):
        rows = stats["sublayers"]
        width = max(r["n"] for r in rows)
        grid = [[math.nan] * width for _ in rows]
        for i, r in enumerate(rows):
            grid[i][:r["n"]] = r["mean_weight"]
        ax = axes[0][col]
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{label}: mean routing weight")
        ax.set_xlabel("source (0 = embedding)")
        ax.set_ylabel("routed sublayer")
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[1][0]
    for label, stats in reports:
        rows = stats["sublayers"]
        ax.plot(range(1, len(rows) + 1), [r["max_weight"] for r in rows], marker="o", label=f"{label} max weight")
    profiles = {tuple(r["uniform"] for r in stats["sublayers"]): label for label, stats in reports}
    for k, (uniform, label) in enumerate(profiles.items()):
        name = "uniform 1/n" + (f" ({label})" if len(profiles) > 1 else "")
        ax.plot(range(1, len(uniform) + 1), uniform, "k" + ("--" if k == 0 else ":"), label=name)
    ax.set_xlabel("routed sublayer")
    ax.set_ylabel("mean max weight")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("routing sharpness")
    for extra in axes[1][1:]:
        extra.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=float)
        f.write("\n")


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None  # one seed: no spread


def compare_rows(runs):
    """runs: {mode: [summary per seed]} -> a row per mode: val loss and perplexity (mean, std over
    seeds), change against baseline in %, routing sharpness, tokens/s, parameters."""
    rows = []
    for mode, seeds in runs.items():
        loss, loss_sd = mean_std([s["val_loss"] for s in seeds])
        ppl, ppl_sd = mean_std([math.exp(s["val_loss"]) for s in seeds])
        sharp, _ = mean_std([s.get("max_weight") for s in seeds])
        tok_s, _ = mean_std([s.get("tokens_per_s") for s in seeds])
        rows.append(dict(mode=mode, seeds=len(seeds), val_loss=loss, val_loss_std=loss_sd, ppl=ppl, ppl_std=ppl_sd,
                         max_weight=sharp, tokens_per_s=tok_s, params=seeds[0].get("params")))
    base = next((r for r in rows if r["mode"] == "baseline"), None)
    for r in rows:
        r["ppl_change_pct"] = 100 * (r["ppl"] / base["ppl"] - 1) if base else None
    return rows


def compare_table(rows):
    head = ["mode", "seeds", "val loss", "perplexity", "vs baseline", "max weight", "tokens/s", "params"]
    body = [[r["mode"], r["seeds"], f"{fmt(r['val_loss'], '.4f')} ± {fmt(r['val_loss_std'], '.4f')}",
             f"{fmt(r['ppl'], '.3f')} ± {fmt(r['ppl_std'], '.3f')}",
             "-" if r["ppl_change_pct"] is None else f"{r['ppl_change_pct']:+.2f}%",
             fmt(r["max_weight"]), fmt(r["tokens_per_s"], ",.0f"), f"{r['params']:,}"] for r in rows]
    return markdown(head, body)


def draw_curves(curves, path):
    """curves: {mode: [[(step, val_loss), ...] per seed]} -> validation loss against step, the mean over
    seeds bold and each seed faint; the right panel zooms on the second half of training."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax in axes:
        for i, (mode, seeds) in enumerate(curves.items()):
            color = f"C{i}"
            for points in seeds:
                ax.plot(*zip(*points), color=color, alpha=0.25, lw=1)
            steps = sorted(set.intersection(*[{s for s, _ in pts} for pts in seeds]))
            mean = [statistics.fmean(dict(pts)[s] for pts in seeds) for s in steps]
            ax.plot(steps, mean, color=color, lw=2, marker="o", ms=3, label=f"{mode} (mean of {len(seeds)})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    axes[0].legend()
    last = max(s for seeds in curves.values() for pts in seeds for s, _ in pts)
    late = [v for seeds in curves.values() for pts in seeds for s, v in pts if s >= last / 2]
    if last > 0 and late:
        pad = 0.1 * (max(late) - min(late)) + 1e-3
        axes[1].set_xlim(last / 2 - 0.02 * last, last * 1.02)
        axes[1].set_ylim(min(late) - pad, max(late) + pad)
    axes[0].set_title("all steps")
    axes[1].set_title("second half, zoomed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_checkpoints(paths, out=None, batches=8, batch_size=8, data_dir=None, force=False):
    """Routing statistics of one or two routed checkpoints on the same fixed validation batches: returns the
    table and the files written (out/report.json and out/report.png; out defaults to beside the first).
    Every checkpoint is checked before anything is computed, and existing reports are kept unless force."""
    import sample as S
    import train as T
    from pathlib import Path
    if len(paths) > 2:
        raise T.ConfigError("report compares at most two checkpoints")
    if batches < 1 or batch_size < 1:
        raise T.ConfigError("--batches and --batch-size must be at least 1")
    out = Path(out) if out is not None else Path(paths[0]).parent / "report"
    written = [out / "report.json", out / "report.png"]
    if not force and any(p.exists() for p in written):
        raise T.ConfigError(f"{out} already holds a report; pass --force to replace it, or choose another --out")
    loaded = []
    for path in paths:
        model, ckpt = S.load_model(path)
        if model.config.residual == "baseline":
            raise T.ConfigError(f"{path} is a baseline model: it has no routing to report; train or convert a routed "
                                f"one (--residual attnres, delta or delta_block)")
        loaded.append((path, model, T.checkpoint_dataset(ckpt, path, data_dir=data_dir)))
    reports = []
    for path, model, ds in loaded:
        label = model.config.residual if len({str(p) for p in paths}) == len(paths) else str(path)
        if any(label == l for l, _ in reports):
            label = f"{label} ({Path(path).parent.name})"
        reports.append((label, T.routing_stats(model, ds, batches, batch_size)))
    out.mkdir(parents=True, exist_ok=True)
    save_json({label: dict(stats, checkpoint=str(p)) for (label, stats), p in zip(reports, paths)}, written[0])
    draw_routing(reports, written[1])
    return routing_table(reports), written
