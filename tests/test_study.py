"""Studies as files: the loader and its every bad input, the crossing of sweep and variants, paired statistics
against a hand computation, a tiny study end to end, and the resume of an interrupted one."""
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train as T
from conftest import ok, refused, run
from plumbing import checkpoint as CK, rundir as RD
from workbench import compare as C, report as R, speed as SP, study as S

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, max_iters=4, warmup_iters=2,
            eval_interval=2, eval_iters=2, log_interval=1, ckpt_interval=2, progress=False, dataset="tiny")


def toml(value):
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()  # JSON scalars are TOML's


def study_file(path, tiny_data=None, seeds=(1, 2), train=None, sweep=None, variants=None, top=""):
    """A study file: [train] (TINY on the tiny dataset when tiny_data is given), [sweep] and [variants]."""
    train = {**(dict(TINY, data_dir=str(tiny_data)) if tiny_data else {}), **(train or {})}
    lines = [f"seeds = {list(seeds)}", top, "[train]"] + [f"{k} = {toml(v)}" for k, v in train.items()]
    if sweep:
        lines += ["[sweep]"] + [f"{k} = {json.dumps(v)}" for k, v in sweep.items()]
    for name, options in (variants if variants is not None else
                          {"baseline": {"residual": "baseline"}, "delta": {"residual": "delta"}}).items():
        lines += [f"[variants.{name}]"] + [f"{k} = {toml(v)}" for k, v in options.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- the loader and its bad input

def test_every_bad_study_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    cases = [
        ("does not exist", tmp_path / "nope.toml"),
        ("is a folder", tmp_path),
        ("is not valid TOML: Invalid value (at line 2, column 7)", "seeds = [1]\nbad = \n"),
        ("has no [variants]", "seeds = [1]\n[train]\nn_layer = 2\n"),
        ("variant 'v' has unknown mode 'resnet'", dict(variants={"v": {"residual": "resnet"}})),
        ("variant 'v' sets no residual", dict(variants={"v": {"n_layer": 2}})),
        ("variant 'v': unknown option 'n_layers'; did you mean n_layer?",
         dict(variants={"v": {"residual": "delta", "n_layers": 2}})),
        ("variant 'v': n_layer expects an integer", dict(variants={"v": {"residual": "delta", "n_layer": "two"}})),
        ("[sweep] must hold exactly one option (it has n_layer, learning_rate)",
         dict(sweep={"n_layer": [2, 4], "learning_rate": [1e-3]})),
        ("variant 'delta' sets n_layer, which [sweep] sweeps",
         dict(sweep={"n_layer": [2, 4]}, variants={"baseline": {"residual": "baseline"},
                                                   "delta": {"residual": "delta", "n_layer": 2}})),
        ("n_layer is both swept and set in [train]", dict(train={"n_layer": 2}, sweep={"n_layer": [2, 4]})),
        ("reference 'base' is not a variant; choose one of baseline, delta", dict(top='reference = "base"')),
        ("[sweep]: n_layer=2 is listed twice", dict(sweep={"n_layer": [2, 4, 2]})),
        ("variants 'delta' and 'Delta' differ only in case",
         dict(variants={"delta": {"residual": "delta"}, "Delta": {"residual": "delta", "n_layer": 4}},
              top='reference = "delta"')),
        ("variants 'delta' and 'again' train the same model with the same settings",
         dict(variants={"delta": {"residual": "delta"}, "again": {"residual": "delta", "route_sources": "delta"}},
              top='reference = "delta"')),
        ("variant 'delta' at n_layer=2: n_route_blocks=2 but residual='delta' routes per sublayer",
         dict(sweep={"n_layer": [2]}, variants={"delta": {"residual": "delta", "n_route_blocks": 2}},
              top='reference = "delta"')),
        ("compare sets seed of each run itself", dict(train={"seed": 3})),
        ("unknown key 'variant'", dict(top='[variant.x]\nresidual = "delta"')),
        ("pairs ['delta', 'static'] names 'static', which is not a variant", dict(top='pairs = [["delta", "static"]]')),
        ("pairs ['delta', 'delta'] pairs a variant with itself", dict(top='pairs = [["delta", "delta"]]')),
        ("pairs must be a list of two-variant lists", dict(top='pairs = ["delta", "baseline"]')),
    ]
    for i, (message, spec) in enumerate(cases):
        path = tmp_path / f"s{i}.toml"
        if isinstance(spec, str):
            path.write_text(spec)
        elif isinstance(spec, dict):
            study_file(path, **spec)
        else:
            path = spec
        refused(message, "compare", "--study", path, "--out", out)
        assert not out.exists(), message
    good = study_file(tmp_path / "good.toml")
    refused("--study sets its own variants and seeds", "compare", "--study", good, "--seeds", "1")
    refused("--n-layer is swept by", "compare", "--study", study_file(tmp_path / "sw.toml", sweep={"n_layer": [2, 4]}),
            "--n-layer", "3", "--out", out)
    assert not out.exists()


def test_a_folder_of_another_study_is_refused_and_kept(tmp_path):
    out = tmp_path / "out"
    first = S.load_study(study_file(tmp_path / "a.toml", train={"n_layer": 2}))
    S.claim_folder(first, out)
    (out / "baseline-s1").mkdir()
    (out / "baseline-s1" / "metrics.jsonl").write_text("mine\n")
    before = (out / "study.json").read_text()
    refused("holds the runs of another study (it differs in train.n_layer (2 there, 4 here))", "compare", "--study",
            study_file(tmp_path / "b.toml", train={"n_layer": 4}), "--out", out)
    refused('it differs in variants.delta.route_sources (null there, "cumulative" here)', "compare", "--study",
            study_file(tmp_path / "c.toml", train={"n_layer": 2}, variants={
                "baseline": {"residual": "baseline"}, "delta": {"residual": "delta", "route_sources": "cumulative"}}),
            "--out", out)
    refused('sweep ([] there, ["learning_rate"] here)', "compare", "--study",
            study_file(tmp_path / "d.toml", train={"n_layer": 2}, sweep={"learning_rate": [1e-3]}), "--out", out)
    assert (out / "study.json").read_text() == before
    assert (out / "baseline-s1" / "metrics.jsonl").read_text() == "mine\n"
    S.claim_folder(first, out)  # the same study again: accepted, and with other bookkeeping options
    S.claim_folder(S.load_study(tmp_path / "a.toml", overrides={"threads": 1, "log_interval": 5}), out)
    more = S.load_study(study_file(tmp_path / "e.toml", seeds=[1, 2, 3], train={"n_layer": 2}, variants={
        "baseline": {"residual": "baseline"}, "delta": {"residual": "delta"}, "attnres": {"residual": "attnres"}}))
    S.claim_folder(more, out)  # more seeds and another variant extend the study
    assert json.loads((out / "study.json").read_text())["study"]["seeds"] == [1, 2, 3]


# ---------------------------------------------------------------- the crossing of sweep and variants

def test_sweep_crossed_with_variants(tmp_path):
    path = study_file(tmp_path / "s.toml", train={"route_lr_mult": 0.5, "learning_rate": 1e-3}, sweep={"n_layer": [2, 4]},
                      variants={"baseline": {"residual": "baseline"}, "full": {"residual": "attnres", "n_route_blocks": "S"},
                                "fast": {"residual": "delta", "learning_rate": 0.01}})
    study = S.load_study(path, overrides={"learning_rate": 2e-3, "max_iters": 7})
    runs = S.cross(study, tmp_path / "out")
    got = {(r.variant, r.value, r.seed): r.cfg for r in runs}
    assert len(runs) == 12 and len(got) == 12
    for (variant, n_layer, seed), cfg in got.items():
        assert cfg.out_dir == str(tmp_path / "out" / f"n_layer={n_layer}" / f"{variant}-s{seed}")
        assert (cfg.n_layer, cfg.seed, cfg.max_iters) == (n_layer, seed, 7)  # the command line's max_iters
        assert cfg.learning_rate == (0.01 if variant == "fast" else 2e-3)  # a variant keeps its own options
        assert cfg.route_lr_mult == (1.0 if variant == "baseline" else 0.5)  # routing options: routed variants only
    assert got["full", 2, 1].n_route_blocks == 4 and got["full", 4, 1].n_route_blocks == 8  # "S": every sublayer
    # a sweep over a routing option trains the baseline once per seed, paired at every value
    study = S.load_study(study_file(tmp_path / "r.toml", seeds=[1], sweep={"route_lr_mult": [0.1, 0.3]}))
    dirs = {(r.variant, r.value): r.cfg.out_dir for r in S.cross(study, tmp_path / "out")}
    assert dirs["baseline", 0.1] == dirs["baseline", 0.3] == str(tmp_path / "out" / "baseline-s1")
    assert dirs["delta", 0.3] == str(tmp_path / "out" / "route_lr_mult=0.3" / "delta-s1")


def test_shipped_studies_cross_into_valid_runs(tmp_path):
    from conftest import ROOT
    paths = sorted((ROOT / "studies").glob("*.toml"))
    assert {p.stem for p in paths} >= {"depth", "grid", "blocks", "depth-lr-4", "depth-lr-16", "route-lr"}
    for path in paths:
        study = S.load_study(path)
        runs = S.cross(study, tmp_path / path.stem)  # every run's settings checked, nothing trained
        values = len(study.sweep[1]) if study.sweep else 1
        once = [v for v in study.variants if study.sweep and not S.sweep_applies(study, v)]
        unique = {r.cfg.out_dir for r in runs}
        assert len(unique) == len(study.seeds) * (values * (len(study.variants) - len(once)) + len(once)), path
        # the exercises and the lab studies use the cpu preset's width; the map's width point and its studies
        # (-w128) and the 32-layer studies (depth32-) are 128 wide too
        width = 128 if path.stem.startswith(("exercise", "lab", "depth32")) or "w128" in path.stem else 64
        assert all(r.cfg.n_embd == width and r.cfg.dataset == "shakespeare_char" for r in runs), path


def test_compare_residual_is_a_study_in_memory():
    study = S.study_from_modes(["attnres", "delta"], [1, 2], overrides={"n_route_blocks": 8})
    assert study.reference == "attnres" and study.variants == {"attnres": {"residual": "attnres"},
                                                                "delta": {"residual": "delta"}}
    assert S.study_from_modes(["delta", "baseline"], [1]).reference == "baseline"


# ---------------------------------------------------------------- paired statistics

def summary(variant, seed, val_loss, tokens_per_s, curve, max_weight=None):
    return dict(variant=variant, sweep=None, seed=seed, val_loss=val_loss, tokens_per_s=tokens_per_s,
                max_weight=max_weight, deep_max_weight=max_weight, entropy=None, deep_entropy=None,
                elapsed=curve[-1][2], params=100, curve=curve)


def test_paired_statistics_by_hand():
    ref = [summary("base", s, v, 500.0, [(0, 3.0, 0.0), (10, v, 100.0)]) for s, v in ((1, 2.0), (2, 2.1), (3, 2.2))]
    var = [summary("new", s, v, 1000.0, [(0, 3.0, 0.0), (10, v, 200.0)], 0.5) for s, v in ((1, 1.9), (2, 2.05), (3, 2.25))]
    rows = R.study_rows(ref + var, "base")
    base, new = rows
    # differences -0.1, -0.05, +0.05: mean -1/30; deviations -1/15, -1/60, 1/12, so the std is
    # sqrt((1/225 + 1/3600 + 1/144) / 2) = sqrt(7/1200) and the standard error sqrt(7/1200) / sqrt(3)
    assert new["diff"] == pytest.approx(-1 / 30) and new["diff_se"] == pytest.approx(math.sqrt(7 / 1200 / 3))
    assert (new["wins"], new["paired"], new["seeds"]) == (2, 3, 3)
    assert new["val_loss"] == pytest.approx(2.0666666) and base["val_loss"] == pytest.approx(2.1)
    assert new["speed_ratio"] == 2.0 and base["speed_ratio"] == 1.0 and base["diff"] is None
    # equal wall time: the shorter run's 100 s; the variant's curve is then halfway, 3 - (3 - v) / 2
    halfway = [3 - (3 - v) / 2 - r for v, r in ((1.9, 2.0), (2.05, 2.1), (2.25, 2.2))]
    assert new["equal_time_diff"] == pytest.approx(sum(halfway) / 3)
    assert new["max_weight"] == 0.5 and base["max_weight"] is None
    table = R.study_table(rows, "base")
    assert "| new | 3 | 2.0667 ± 0.1756 | -0.0333 ± 0.0441 | 2/3 |" in table
    assert R.paired({1: 1.0}, {1: 1.5, 2: 2.0}) == (-0.5, None, 1, 1)  # one seed: no standard error
    sweep = [dict(variant=v, sweep=lr, val_loss=loss) for v, losses in (("a", (3, 2, 1)), ("b", (3, 1, 2)))
             for lr, loss in zip((1e-3, 3e-3, 1e-2), losses)]
    assert R.study_best(sweep, "learning_rate") == ("lowest mean val loss by learning_rate: a 0.01 (at the "
                                                    "sweep's edge: widen it), b 0.003")
    assert R.study_best(sweep, "learning_rate", unswept=["a"]) == "lowest mean val loss by learning_rate: b 0.003"
    assert R.study_best(sweep[:2] + sweep[3:5], "learning_rate") == ""  # two values: no inside
    assert R.study_best(sweep, "n_layer", tuning=False) == "lowest mean val loss by n_layer: a 0.01, b 0.003"


def test_the_lead_by_step_by_hand():
    def run(variant, seed, losses, steps=None):
        evals = [dict(step=s, val_loss=v, train_loss=v - 0.1) for s, v in zip(steps or (0, 10, 20), losses)]
        return dict(variant=variant, sweep=None, seed=seed, steps=evals[-1]["step"], evals=evals, epochs_per_step=0.01)
    runs = [run("base", 1, (3.0, 2.5, 2.0)), run("base", 2, (3.0, 2.6, 2.1)),
            run("new", 1, (3.0, 2.3, 1.9)), run("new", 2, (3.0, 2.5, 2.2)),
            run("long", 1, (3.0, 2.4, 2.2, 1.8), (0, 10, 20, 30)), run("long", 2, (3.0, 2.4, 2.1, 1.8), (0, 10, 20, 30))]
    rows = R.lead_rows(runs, "base", [["long", "new"]], 10)
    # new on the reference's schedule, then the pair; long (another length) only as the pair names it; step 0 left out
    assert [(r["a"], r["b"], r["loss"]) for r in rows] == [("new", "base", "val"), ("new", "base", "train"),
                                                           ("long", "new", "val"), ("long", "new", "train")]
    new = rows[0]["cells"]
    assert sorted(new) == [10, 20] and new[10][:1] == pytest.approx((-0.15,)) and new[10][2:] == (2, 2)
    assert new[20][0] == pytest.approx(0.0) and new[20][1] == pytest.approx(0.1) and new[20][2] == 1
    assert rows[1]["cells"][10][0] == pytest.approx(-0.15)  # the train loss's lead, here the same shift
    assert sorted(rows[2]["cells"]) == [10, 20] and rows[2]["cells"][20][0] == pytest.approx(0.1)  # shared steps only
    assert sorted(R.lead_rows(runs, "base", [], 20)[0]["cells"]) == [20]  # multiples of 20
    table = R.lead_table(rows)
    assert table.splitlines()[0] == "| lead (a - b), loss | 10 | 20 |"
    assert "| new - base, val | -0.1500 (2/2) | +0.0000 (1/2) |" in table
    assert table.splitlines()[2] == "| epochs (passes over the training split) | 0.10 | 0.20 |"  # step x 0.01
    assert R.lead_rows(runs, "base", [], 7) == []
    del runs[2]["epochs_per_step"]  # results of runs that did not record it: no epochs row
    assert "epochs" not in R.lead_table(R.lead_rows(runs, "base", [], 10))


# ---------------------------------------------------------------- tiny studies end to end

@pytest.mark.slow
def test_tiny_study_end_to_end(tiny_data, tmp_path, monkeypatch):
    path = study_file(tmp_path / "tiny.toml", tiny_data, sweep={"learning_rate": [1e-3, 3e-3]},
                      top='pairs = [["delta", "baseline"], ["baseline", "delta"]]')
    out = tmp_path / "out"
    plan = ok("compare", "--study", path, "--out", out, "--dry-run")
    assert "study tiny: 8 runs (2 learning_rate values x 2 variants x 2 seeds), 0 finished, 8 to train" in plan
    assert "estimate" in plan and not out.exists()
    table = ok("compare", "--study", path, "--out", out)
    result = json.loads((out / "compare.json").read_text())
    assert result["study"]["sweep"] == {"learning_rate": [1e-3, 3e-3]}
    runs = {(r["variant"], r["sweep"], r["seed"]): r for r in result["runs"]}
    assert sorted(runs) == sorted((v, lr, s) for v in ("baseline", "delta") for lr in (1e-3, 3e-3) for s in (1, 2))
    for (variant, lr, seed), r in runs.items():
        run_dir = out / f"learning_rate={lr}" / f"{variant}-s{seed}"
        config = json.loads((run_dir / "config.json").read_text())["config"]
        assert (config["residual"], config["learning_rate"], config["seed"]) == (variant, lr, seed)
        evals = [m for m in RD.read_metrics(run_dir) if m["kind"] == "eval"]
        assert r["val_loss"] == evals[-1]["val_loss"] and r["steps"] == 4
        assert (r["max_weight"] is None) == (variant == "baseline")
    for lr in (1e-3, 3e-3):
        row = next(r for r in result["rows"] if r["variant"] == "delta" and r["sweep"] == lr)
        diffs = [runs["delta", lr, s]["val_loss"] - runs["baseline", lr, s]["val_loss"] for s in (1, 2)]
        assert row["diff"] == pytest.approx(sum(diffs) / 2) and row["wins"] == sum(d < 0 for d in diffs)
        assert f"| {lr} | delta | 2 | {row['val_loss']:.4f} ± {row['val_loss_std']:.4f} | {row['diff']:+.4f}" in table
        assert (out / f"curves-learning_rate={lr}.png").exists()
        pair, back = (p for p in result["pairs"] if p["sweep"] == lr)  # delta - baseline is the reference's column
        assert (pair["diff"], pair["diff_se"], pair["wins"]) == (row["diff"], row["diff_se"], row["wins"])
        assert (pair["equal_time_diff"], pair["equal_time_se"]) == (row["equal_time_diff"], row["equal_time_se"])
        assert back["diff"] == pytest.approx(-row["diff"]) and back["wins"] == 2 - row["wins"]
        assert back["equal_time_diff"] == pytest.approx(-row["equal_time_diff"])
        line = next(l for l in table.splitlines() if l.startswith(f"| {lr} | delta - baseline |"))
        assert line.startswith(f"| {lr} | delta - baseline | {row['diff']:+.4f} ± {row['diff_se']:.4f} | "
                               f"{row['wins']}/2 | {row['speed_median']:.3f}x ({row['speed_best']:.3f}) | ")
        assert line.endswith(f"| {row['equal_time_diff']:+.4f} ± {row['equal_time_se']:.4f} |")
        # the timed speed: every variant at every rate, the pair's ratio the row's
        times = result["speed"]["times"]
        assert set(times) == {f"{v} learning_rate={lr}" for v in ("baseline", "delta") for lr in (1e-3, 3e-3)}
        assert len(times[f"delta learning_rate={lr}"]) == result["speed"]["rounds"] == 10
        assert (pair["speed_median"], pair["break_even"]) == (row["speed_median"], row["break_even"])
        # one baseline length: the break-even speed is a bound, and equal compute needs a run of another length
        assert all(bound in "<>" and bound for bound, _ in row["break_even"].values())
        assert row["equal_compute_diff"] is None and row["equal_compute_needs"] > 0
    assert (out / "compare.md").read_text().split("\n\n")[0] in table and (out / "loss.png").exists()
    train = T.train
    monkeypatch.setattr(T, "train", lambda cfg: pytest.fail(f"retrained {cfg.out_dir}"))
    again = ok("compare", "--study", path, "--out", out)
    assert "8 finished, 0 to train" in again and again.count("reusing the finished run") == 8
    # nothing trained: the timing kept with the results stays, so the table does not move
    assert "speed: the timing of" in again and "timing a training step" not in again
    assert [l for l in again.splitlines() if l.startswith("|")] == [l for l in table.splitlines() if l.startswith("|")]
    # --clock cpu reads equal time on each run's own CPU time, which train records beside its wall time
    cpu = ok("compare", "--study", path, "--out", out, "--clock", "cpu", "--speed-rounds", 2)
    assert "vs ref, equal CPU time (unannealed)" in cpu and "own CPU clocks" in (out / "compare.md").read_text()
    assert ("| learning_rate | pair | val loss difference | beat | speed (timed) | break-even | equal compute | "
            "equal CPU time (unannealed) |") in cpu
    # the results beside the study file: --reprint prints the same tables from them, training nothing
    results = json.loads((tmp_path / "results" / "tiny.json").read_text())
    assert results["speed"]["rounds"] == 2 and "out_dir" not in results["runs"][0]
    again = ok("compare", "--study", path, "--out", tmp_path / "again", "--clock", "cpu", "--reprint")
    assert [l for l in cpu.splitlines() if l.startswith("|")] == [l for l in again.splitlines() if l.startswith("|")]
    assert (tmp_path / "again" / "loss.png").exists() and not list((tmp_path / "again").glob("*-s1"))
    # the lead by step, from the same results: each rate's delta against the baseline at every evaluation
    by_step = ok("compare", "--study", path, "--out", tmp_path / "again", "--reprint", "--by-step", 1)
    leads = json.loads((tmp_path / "again" / "compare.json").read_text())["leads"]
    runs = {(r["variant"], r["sweep"], r["seed"]): {e["step"]: e["val_loss"] for e in r["evals"]} for r in results["runs"]}
    lead = next(l for l in leads if l["a"] == "delta" and l["b"] == "baseline" and l["loss"] == "val")
    step, cell = max(lead["cells"].items(), key=lambda kv: int(kv[0]))
    diffs = [runs["delta", lead["sweep"], s][int(step)] - runs["baseline", lead["sweep"], s][int(step)] for s in (1, 2)]
    assert cell[0] == pytest.approx(sum(diffs) / 2) and f"| {lead['sweep']} | delta - baseline, val | " in by_step
    assert "(no evaluation at a multiple of 1000 steps" in ok("compare", "--study", path, "--out", tmp_path / "again",
                                                                "--reprint", "--by-step", 1000)
    refused("--by-step -1 must be a number of steps", "compare", "--study", path, "--reprint", "--by-step", -1)
    refused("--reprint reads a study's results: give --study FILE", "compare", "--residual", "baseline",
            "--reprint")
    refused("--reprint trains and times nothing: leave out --jobs", "compare", "--study", path, "--reprint",
            "--jobs", 2)
    other = study_file(tmp_path / "tiny2.toml", tiny_data, sweep={"learning_rate": [1e-3]})
    (tmp_path / "results" / "tiny2.json").write_text((tmp_path / "results" / "tiny.json").read_text())
    refused("holds the results of another definition of 'tiny'", "compare", "--study", other, "--reprint")
    # options beside --study make another study: its results are not the file's
    monkeypatch.setattr(T, "train", train)
    kept = (tmp_path / "results" / "tiny.json").read_text()
    short = ok("compare", "--study", path, "--out", tmp_path / "short", "--max-iters", 2, "--speed-rounds", 0)
    assert "is left as it is" in short and (tmp_path / "results" / "tiny.json").read_text() == kept
    summaries = json.loads((out / "compare.json").read_text())["runs"]
    for r in summaries:
        evals = [m for m in RD.read_metrics(r["out_dir"]) if m["kind"] == "eval"]
        assert r["elapsed"] == evals[-1]["cpu_s"] and 0 < evals[-1]["cpu_s"]
    refused("unknown --clock 'sundial'; choose wall or cpu", "compare", "--study", path, "--out", out, "--clock", "sundial")


@pytest.mark.slow
def test_interrupted_study_resumes_where_it_stopped(tiny_data, tmp_path, monkeypatch):
    path = study_file(tmp_path / "blocks.toml", tiny_data, seeds=[1], sweep={"n_route_blocks": [1, 2]},
                      variants={"baseline": {"residual": "baseline"}, "db": {"residual": "delta_block"}})
    out = tmp_path / "out"
    train = T.train

    class SignalAtStep2:  # as Ctrl-C would: the loop reads the flag once a step, and sees the signal at step 2
        reads = 0

        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        @property
        def signal(self):
            self.reads += 1
            return signal.SIGINT if self.reads > 2 else None

    def interrupted_run(cfg):
        with monkeypatch.context() as m:
            if cfg.out_dir.endswith("n_route_blocks=1/db-s1"):
                m.setattr(T, "StopFlag", SignalAtStep2)
            return train(cfg)

    monkeypatch.setattr(T, "train", interrupted_run)
    stopped = run("compare", "--study", path, "--out", out)
    assert stopped.exit_code == 130 and "run the same command again" in stopped.output and "--resume to" not in stopped.output
    monkeypatch.setattr(T, "train", train)
    interrupted = out / "n_route_blocks=1" / "db-s1" / "last.pt"
    assert CK.load_checkpoint(interrupted)["iter_num"] == 2 and not (out / "n_route_blocks=2").exists()
    finished = (out / "baseline-s1" / "last.pt").stat().st_mtime_ns
    trained = []
    monkeypatch.setattr(T, "train", lambda cfg: trained.append((cfg.out_dir, cfg.resume)) or train(cfg))
    again = ok("compare", "--study", path, "--out", out)
    assert "3 runs (2 n_route_blocks values x 1 variant x 1 seed, baseline once per seed), 1 finished, " \
           "2 to train (1 resumed)" in again
    assert trained == [(str(out / "n_route_blocks=1" / "db-s1"), True), (str(out / "n_route_blocks=2" / "db-s1"), False)]
    assert (out / "baseline-s1" / "last.pt").stat().st_mtime_ns == finished
    assert "baseline seed 1: reusing the finished run" in again  # the sweep of block counts does not apply to it
    assert CK.load_checkpoint(interrupted)["iter_num"] == 4
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [(r["sweep"], r["variant"]) for r in rows] == [(1, "baseline"), (1, "db"), (2, "baseline"), (2, "db")]
    resumed = [m for m in RD.read_metrics(interrupted.parent) if m["kind"] == "resume"]
    assert resumed == []  # no change recorded: the mode's defaults, filled in, are what the run recorded
    assert "3 finished, 0 to train" in ok("compare", "--study", path, "--out", out)  # and the resumed run is reused
    with open(interrupted.parent / "metrics.jsonl", "a") as f:  # as resumes recorded a mode's defaults before 2026-12-05
        f.write(json.dumps(dict(kind="resume", step=2, changed={"route_partial": [False, None]})) + "\n")
    assert "3 finished, 0 to train" in ok("compare", "--study", path, "--out", out)


@pytest.mark.slow
def test_two_runs_at_a_time_give_the_numbers_of_one_at_a_time(tiny_data, tmp_path):
    path = study_file(tmp_path / "pair.toml", tiny_data, seeds=[1, 2])
    ok("compare", "--study", path, "--out", tmp_path / "one", "--threads", 1)
    two = ok("compare", "--study", path, "--out", tmp_path / "two", "--threads", 1, "--jobs", 2)
    assert "at 2 at a time" in two and two.count("train.log there") == 4 and two.count("finished at step 4") == 4
    started = [line.split(":")[0] for line in two.splitlines() if line.endswith("(its output: train.log there)")]
    assert started == ["baseline seed 1", "delta seed 1", "baseline seed 2", "delta seed 2"]  # a seed's pair side by side
    runs = {folder: {(r["variant"], r["seed"]): r["val_loss"] for r in
                     json.loads((tmp_path / folder / "compare.json").read_text())["runs"]} for folder in ("one", "two")}
    assert runs["one"] == runs["two"] and len(runs["two"]) == 4
    assert "finished at step 4" in (tmp_path / "two" / "delta-s2" / "train.log").read_text()
    assert "delta seed 2: reusing the finished run in" in ok("compare", "--study", path, "--out", tmp_path / "two", "--jobs", 2)
    refused("--jobs 0 must be at least 1", "compare", "--study", path, "--out", tmp_path / "three", "--jobs", 0)


@pytest.mark.slow
def test_a_signal_stops_the_runs_side_by_side_at_a_checkpoint_and_compare_resumes_them(tiny_data, tmp_path):
    path = study_file(tmp_path / "long.toml", tiny_data, seeds=[1], train=dict(max_iters=1500, eval_interval=500,
                                                                                 ckpt_interval=500))
    out = tmp_path / "out"
    cli = Path(__file__).resolve().parent.parent / "cli.py"
    p = subprocess.Popen([sys.executable, str(cli), "compare", "--study", str(path), "--out", str(out), "--jobs", "2",
                          "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [out / f"{v}-s1" / "train.log" for v in ("baseline", "delta")]
    try:
        deadline = time.time() + 120
        while not all(log.exists() and "step 0:" in log.read_text() for log in logs):
            assert time.time() < deadline and p.poll() is None, "the runs did not start"
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        output, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in output, output
    steps = [CK.load_checkpoint(log.parent / "last.pt")["iter_num"] for log in logs]
    assert all(s < 1500 for s in steps) and output.count("stopped by signal") == 2, output
    assert output.rstrip().splitlines()[-1].startswith("compare stopped:") and "run the same command again" in output
    assert not any("Traceback" in log.read_text() for log in logs)
    again = ok("compare", "--study", path, "--out", out, "--jobs", 2)
    assert again.count("resuming in") == 2 and again.count("finished at step 1500") == 2


@pytest.mark.slow
def test_a_run_that_fails_side_by_side_is_named_starts_no_other_and_no_table_is_made(tiny_data, tmp_path):
    path = study_file(tmp_path / "three.toml", tiny_data, seeds=[1, 2, 3])
    out = tmp_path / "out"
    S.claim_folder(S.load_study(path), out)
    (out / "delta-s1").mkdir()  # a lock delta-gpt did not write: delta seed 1 fails to start
    (out / "delta-s1" / "run.lock").write_text("someone else's\n")
    refused("1 run(s) did not finish: " + str(out / "delta-s1"), "compare", "--study", path, "--out", out,
            "--jobs", 2, "--threads", 1)
    assert not (out / "compare.md").exists()
    assert "error: " in (out / "delta-s1" / "train.log").read_text() and "Traceback" not in (out / "delta-s1" / "train.log").read_text()
    started = sum((out / f"{v}-s{s}").exists() for v in ("baseline", "delta") for s in (1, 2, 3))
    assert started < 6  # no new run started after the failure


@pytest.mark.slow
def test_a_variant_that_cannot_be_timed_is_said_in_one_line_and_the_study_still_trains(tiny_data, tmp_path, monkeypatch):
    """As where no C++ compiler works for --compile: the timing says so in one line, the runs train and the
    table is printed without the timed columns."""
    path = study_file(tmp_path / "untimed.toml", tiny_data, seeds=[1])
    setup = SP.setup

    def no_compiler(model_config, cfg, seed=0):
        if model_config["residual"] == "delta":
            raise RuntimeError("no working C++ compiler\nmore lines of a compiler's error")
        return setup(model_config, cfg, seed)

    monkeypatch.setattr(SP, "setup", no_compiler)
    out = ok("compare", "--study", path, "--out", tmp_path / "out")
    said = [l for l in out.splitlines() if l.startswith("speed: ")]
    assert said == ["speed: delta cannot be timed on this machine (RuntimeError: no working C++ compiler); the "
                    "table's timed speed and equal-compute columns show '-' (break-even needs no timing)"]
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert result["speed"] is None and len(result["runs"]) == 2 and "| delta | 1 |" in out


def test_the_speed_command_times_a_studys_variants_as_compare_does(tiny_data, tmp_path, monkeypatch, capsys):
    """python -m workbench.speed --study FILE: every variant's step at its own shape (here another depth), in
    one process with malloc keeping freed memory as compare's timing and the runs do, relative to the reference."""
    path = study_file(tmp_path / "timed.toml", tiny_data, seeds=[1], variants={
        "baseline": {"residual": "baseline"}, "deep": {"residual": "delta", "n_layer": 4}})
    kept = []
    monkeypatch.setattr(SP, "keep_freed_memory", lambda: kept.append(True))
    SP.main(["--study", str(path), "--rounds", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert kept and lines[0].startswith("timed: a training step of each variant, 2 interleaved rounds, 1 thread(s)")
    assert lines[3].startswith("| baseline | ") and lines[3].endswith(" | 1.000x | 1.000x |")
    assert lines[4].startswith("| deep | ") and all(float(l.split(" | ")[1]) > 0 for l in lines[3:5])  # ms per step


def test_a_reference_family_is_its_runs_of_other_lengths_annealed_to_their_end():
    study = S.study_from_dict(dict(seeds=[1], train=dict(max_iters=100), variants={
        "baseline": dict(residual="baseline"), "baseline-200": dict(residual="baseline", max_iters=200),
        "baseline-cut": dict(residual="baseline", max_iters=200, lr_decay_iters=400),
        "baseline-hi": dict(residual="baseline", learning_rate=3e-3), "delta": dict(residual="delta")}), "f")
    families = C.families(study)
    assert families["baseline"] == ["baseline", "baseline-200"] and families["baseline-cut"] == ["baseline-cut"]
    assert families["baseline-hi"] == ["baseline-hi"] and families["delta"] == ["delta"]


@pytest.mark.parametrize("variant, words", [
    ({"residual": "attnres", "route_heads": 3}, "route_heads=3 must be a whole number that divides n_embd=32"),
    ({"residual": "delta", "n_layer": 0}, "n_layer=0 must be a positive integer"),
    ({"residual": "delta_block", "n_route_blocks": 3}, "n_route_blocks=3 must divide 2*n_layer=4 sublayers"),
    ({"residual": "delta", "n_head": 3}, "n_embd=32 is not divisible by n_head=3"),
])
def test_a_shape_the_model_refuses_is_one_line_before_any_run(tiny_data, tmp_path, variant, words):
    """compare --dry-run checks every run's model as the study asks for it: a depth, width or head count the
    model refuses is one line, and nothing is written."""
    path = study_file(tmp_path / "deep.toml", tiny_data, seeds=[1],
                      variants={"baseline": {"residual": "baseline"}, "v": variant})
    refused(words, "compare", "--study", path, "--out", tmp_path / "out", "--dry-run")
    assert not (tmp_path / "out").exists()
