"""report.py's claims: routing statistics in range and uniform at zero init, the table explains its
columns, the pictures are written with named sources, and importing report leaves matplotlib alone."""
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from plumbing import routing_stats as RS
from workbench import report
from delta_gpt import GPT, GPTConfig, RESIDUALS

ROUTED = [m for m in RESIDUALS if m != "baseline"]


def model_of(residual, queries=0.0, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=37, n_layer=2, n_head=2, n_embd=32, residual=residual, **kw))
    with torch.no_grad():
        for router in model.routers:
            router.query.normal_(0, queries)
    return model.eval()


def idx_batch(B=2, T=16):
    return torch.randint(0, 37, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("residual", ROUTED)
def test_routing_stats_in_range(residual):
    model = model_of(residual, queries=2.0)
    stats = RS.routing_stats(model, idx_batch())
    assert [r["n"] for r in stats["sublayers"]] == model.sources_per_router()
    assert [r["name"] for r in stats["sublayers"]][:2] == ["h.0.attn", "h.0.mlp"]
    for r in stats["sublayers"]:
        assert 1 / r["n"] - 1e-6 <= r["max_weight"] <= 1 + 1e-6
        assert len(r["mean_weight"]) == r["n"] and abs(sum(r["mean_weight"]) - 1) < 1e-5
        if r["n"] > 1:
            assert 0 <= r["entropy"] <= 1 + 1e-6 and -1 <= r["adj_cos"] <= 1
    assert 0 < stats["mean_max_weight"] <= 1 and 0 < stats["deep_max_weight"] <= 1
    assert len(stats["source_names"]) >= max(r["n"] for r in stats["sublayers"])


def test_routing_stats_uniform_at_zero_init():
    stats = RS.routing_stats(model_of("delta"), idx_batch())
    for r in stats["sublayers"]:
        assert abs(r["max_weight"] - 1 / r["n"]) < 1e-6
        if r["n"] > 1:
            assert abs(r["entropy"] - 1) < 1e-5


def test_routing_stats_refuse_baseline():
    with pytest.raises(ValueError, match="a baseline model has no routing to report; train or convert a routed model"):
        RS.routing_stats(model_of("baseline"), idx_batch())


@pytest.mark.parametrize("residual,kw,names", [
    ("delta", {}, ["e", "v1", "v2", "v3", "v4"]),
    ("attnres", dict(n_route_blocks=2), ["e", "b1", "b2"]),
    ("delta_block", dict(n_route_blocks=2, route_sources="cumulative"), ["e", "x_b1", "x_b2"]),
    ("attnres", dict(n_route_blocks=4, route_sources="cumulative"), ["e", "x1", "x2", "x3", "x4"]),
])
def test_sources_are_named_by_what_they_are(residual, kw, names):
    assert RS.source_names(model_of(residual, **kw).config) == names


def test_table_has_a_legend_for_every_column():
    stats = RS.routing_stats(model_of("delta", queries=1.0), idx_batch())
    table = report.routing_table([("delta", stats)])
    legend = table.split("\n\n")[-1]
    assert legend == report.TABLE_LEGEND
    for term in ("n:", "1/n:", "max w (max weight):", "entropy (/ log n):", "adj cos:", "deeper half:"):
        assert re.search(rf"(^|; ){re.escape(term)} ", legend, flags=re.M), term


def test_results_page_shows_the_legend_report_prints():
    results = (Path(report.__file__).parent.parent / "docs" / "results.md").read_text()
    assert report.TABLE_LEGEND in results


def test_draw_routing_writes_one_and_two_report_pictures(tmp_path):
    delta = RS.routing_stats(model_of("delta", queries=1.0), idx_batch())
    attnres = RS.routing_stats(model_of("attnres", queries=1.0, n_route_blocks=2), idx_batch())
    report.draw_routing([("delta", delta)], tmp_path / "one.png")
    report.draw_routing([("delta", delta), ("attnres", attnres)], tmp_path / "two.png")
    assert (tmp_path / "one.png").stat().st_size > 10_000 and (tmp_path / "two.png").stat().st_size > 10_000


def test_draw_curves_writes_a_picture_with_a_title(tmp_path):
    curves = {"baseline": [[(0, 3.0), (10, 2.5)], [(0, 3.1), (10, 2.4)]], "delta": [[(0, 3.0), (10, 2.3)]]}
    report.draw_curves(curves, tmp_path / "curves.png", title="cpu preset, tiny, seeds 1, 2")
    report.draw_curves(curves, tmp_path / "untitled.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and (tmp_path / "untitled.png").exists()
    # with each point's wall time, a third panel: the loss against wall time
    timed = {k: [[(step, v, 6.0 * step) for step, v in pts] for pts in seeds] for k, seeds in curves.items()}
    report.draw_curves(timed, tmp_path / "timed.png")
    assert matplotlib.image.imread(tmp_path / "timed.png").shape[1] > 1.4 * matplotlib.image.imread(tmp_path / "curves.png").shape[1]


def test_the_curves_against_compute_take_each_step_at_its_timed_cost(tmp_path):
    # seconds per step in each round: the routed step 1.25x the baseline's, the longer baseline the same shape
    times = {"baseline": [0.20, 0.22, 0.21], "baseline-8000": [0.20, 0.22, 0.21], "attnres": [0.25, 0.275, 0.2625]}
    assert report.step_costs(["baseline", "baseline-8000", "attnres", "untimed"], times, "baseline") == {
        "baseline": 1.0, "baseline-8000": 1.0, "attnres": pytest.approx(1.25)}
    assert report.step_costs(["attnres"], None, "baseline") == {}
    assert report.step_costs(["attnres"], {"attnres n_layer=4": [0.25], "baseline n_layer=4": [0.2]}, "baseline",
                             "n_layer", 4) == {"attnres": pytest.approx(1.25)}
    curves = {"baseline": [[(0, 3.0), (10, 2.5)]], "attnres": [[(0, 3.0), (10, 2.3)]]}  # no clock: compute alone
    report.draw_curves(curves, tmp_path / "compute.png", cost={"baseline": 1.0, "attnres": 1.25})
    report.draw_curves(curves, tmp_path / "steps.png", cost={"baseline": 1.0})  # a label without its cost
    width = [matplotlib.image.imread(tmp_path / f).shape[1] for f in ("compute.png", "steps.png")]
    assert width[0] > 1.4 * width[1]


def test_a_sweep_of_one_variant_draws_one_curves_picture(tmp_path):
    summaries = [dict(variant="baseline", sweep=n, seed=1, val_loss=3.0 - n / 10, tokens_per_s=100.0 / n, params=n, elapsed=5.0 * n,
                      curve=[(0, 4.0, 0.0), (10, 3.0 - n / 10, 5.0 * n)]) for n in (4, 8)]
    rows = report.study_rows(summaries, "baseline", "n_layer")
    written = report.draw_study(rows, summaries, "baseline", "n_layer", tmp_path, title="pilot")
    assert tmp_path / "curves.png" in written and not list(tmp_path.glob("curves-*.png"))


@pytest.mark.slow
def test_importing_report_does_not_import_matplotlib():
    code = "import sys, train; from workbench import report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(report.__file__).parent.parent)


def test_the_map_picture_is_drawn_from_the_pages_table(tmp_path):
    """docs/draw_map.py reads the map table of docs/results.md: every row a number or '-' per point, bold kept out."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "docs" / "draw_map.py"
    spec = importlib.util.spec_from_file_location("draw_map", path)
    draw_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw_map)
    text = ("intro\n**The map, one seed** (notes)\n\n| variant | a | b |\n|---|---|---|\n"
            "| x | +0.010 | **-0.043** |\n| y | - | +0.020 |\n\nafter\n")
    assert draw_map.map_table(text) == (["a", "b"], {"x": [0.01, -0.043], "y": [None, 0.02]})
    points, gaps = draw_map.map_table((path.parent / "results.md").read_text())
    assert len(points) >= 3 and gaps and all(len(row) == len(points) for row in gaps.values())
    draw_map.draw(points, gaps, tmp_path / "map.png")
    assert matplotlib.image.imread(tmp_path / "map.png").shape[1] > 500


# ---------------------------------------------------------------- per minute: from the curves and a timed speed

def test_length_interpolation_is_linear_in_log_steps():
    lengths = [(8000, 1.52), (4000, 1.64)]
    assert report.loss_at_length(4000, lengths) == 1.64 and report.loss_at_length(8000, lengths) == 1.52
    assert report.loss_at_length(4000 * 2 ** 0.5, lengths) == pytest.approx(1.58)  # halfway in log(steps)
    assert report.loss_at_length(2000, lengths) is None and report.loss_at_length(9000, lengths) is None
    assert report.length_for_loss(1.58, lengths) == (pytest.approx(4000 * 2 ** 0.5), "")
    assert report.length_for_loss(1.70, lengths) == (4000, "<") and report.length_for_loss(1.50, lengths) == (8000, ">")
    # fewer steps than the straight chord (6000): the reading that does not flatter the faster learner
    assert report.length_for_loss(1.58, lengths)[0] < 6000


def test_break_even_and_equal_compute_by_hand():
    lengths = {1: [(4000, 1.64), (8000, 1.52)], 2: [(4000, 1.60), (8000, 1.50)]}
    runs = {1: dict(variant="v", steps=4000, val_loss=1.58), 2: dict(variant="v", steps=4000, val_loss=1.49)}
    got = report.per_minute(runs, lengths, 0.8)
    # seed 1: the reference needs 4000 * sqrt(2) steps for 1.58, so level at 4000 / 5657 = 0.707x; seed 2 beats
    # the longest reference run: level only below 4000 / 8000
    assert got["break_even"][1] == ("", pytest.approx(2 ** -0.5)) and got["break_even"][2] == ("<", 0.5)
    # at 0.8x the reference gets 5000 steps: 1.64 - 0.12 * log2(1.25) and 1.60 - 0.10 * log2(1.25)
    diffs = [1.58 - (1.64 - 0.12 * math.log2(1.25)), 1.49 - (1.60 - 0.10 * math.log2(1.25))]
    assert got["equal_compute_diff"] == pytest.approx(sum(diffs) / 2)
    assert got["equal_compute_se"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2)
    assert (got["equal_compute_wins"], got["equal_compute_paired"], got["equal_compute_needs"]) == (2, 2, None)
    assert report.break_even_text(got["break_even"]) == "<0.50-0.71x"
    # one seed behind the only reference length, one ahead of it: both bounds at 1.00x, the lower one first
    assert report.break_even_text({1: (">", 1.0), 2: ("<", 1.0)}) == "<1.00->1.00x"
    slow = report.per_minute(runs, lengths, 0.4)  # 10,000 reference steps: longer than any run
    assert slow["equal_compute_diff"] is None and slow["equal_compute_needs"] == 10000
    assert report.compute_text(slow) == "needs 10,000 ref steps"


def test_timed_speed_ratio_best_and_median():
    mine, ref = [0.30, 0.25, 0.26], [0.20, 0.21, 0.22]
    best, median = report.speed_ratio(mine, ref)
    assert best == pytest.approx(0.20 / 0.25) and median == pytest.approx(statistics.median([0.2 / 0.3, 0.84, 0.22 / 0.26]))
