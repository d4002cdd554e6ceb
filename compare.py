"""
Compare residual modes: train each mode and seed on the same batches, then tabulate and draw them.

    python cli.py compare --residual baseline,delta --seeds 1,2,3 --max-iters 2000

Every run lives in OUT/MODE-sSEED. A finished run is reused and an unfinished one resumed, but only
when the settings it recorded are the ones asked for now; otherwise the command refuses, naming the
settings that differ, so a table never shows numbers of a run other than the one asked for.
"""
import json
from dataclasses import asdict, replace
from pathlib import Path

import report as R
import train as T


def run_settings(cfg):
    """The settings that decide a run's numbers, with the model's defaults filled in as the run records them."""
    model = T.model_config(cfg, vocab_size=1)
    cfg = replace(cfg, **{k: getattr(model, k) for k in T.MODEL_FIELDS})
    return {k: v for k, v in asdict(cfg).items() if k not in T.BOOKKEEPING_FIELDS}


def settings_diff(recorded, asked):
    """'name (X in the run, Y asked)' for each setting that differs between two settings dicts."""
    return [f"{k} ({recorded.get(k)!r} in the run, {v!r} asked)" for k, v in asked.items() if recorded.get(k, v) != v]


def recorded_settings(out_dir):
    """The settings the run in out_dir recorded (last.pt, else config.json), or None when it holds no run."""
    out_dir = Path(out_dir)
    if (out_dir / "last.pt").exists():
        return T.load_checkpoint(out_dir / "last.pt", mmap=True)["config"], True
    if (out_dir / "config.json").exists():
        return json.loads((out_dir / "config.json").read_text())["config"], False
    return None, False


def train_or_reuse(cfg, overwrite=False, echo=print):
    """Train the run cfg asks for, resume it, or reuse it when it is finished; with overwrite, train it afresh.
    Refuses a run directory whose recorded settings differ from cfg's."""
    recorded, has_checkpoint = recorded_settings(cfg.out_dir)
    if recorded is None or overwrite:
        return T.train(replace(cfg, overwrite=recorded is not None))
    diff = settings_diff(run_settings(T.TrainConfig(**{k: v for k, v in recorded.items() if hasattr(cfg, k)})),
                         run_settings(cfg))
    if diff:
        raise T.ConfigError(f"{cfg.out_dir} holds a run with other settings: {'; '.join(diff)}; choose another "
                            f"--out, or pass --overwrite to train it again")
    if not has_checkpoint:  # started with these settings but stopped before its first checkpoint
        return T.train(replace(cfg, overwrite=True))
    done = T.load_checkpoint(Path(cfg.out_dir) / "last.pt", mmap=True)["iter_num"]
    if done >= cfg.max_iters:
        echo(f"{cfg.residual} seed {cfg.seed}: reusing the finished run in {cfg.out_dir}")
        return None
    return T.train(replace(cfg, resume=True))


def run_summary(out_dir, seed):
    """What the table needs of one finished run, read from its metrics.jsonl and config.json."""
    rows = T.read_metrics(out_dir)
    evals = [r for r in rows if r["kind"] == "eval"]
    speeds = sorted(r["tokens_per_s"] for r in rows if r["kind"] == "train")
    return dict(seed=seed, val_loss=evals[-1]["val_loss"], tokens_per_s=speeds[len(speeds) // 2] if speeds else None,
                max_weight=(evals[-1].get("routing") or {}).get("mean_max_weight"),
                params=json.loads((Path(out_dir) / "config.json").read_text())["params"],
                curve=[(r["step"], r["val_loss"]) for r in evals])


def compare(modes, seeds, preset=None, overrides=None, out="runs/compare", overwrite=False, echo=print):
    """Train (or reuse) every mode x seed, then write OUT/compare.json, compare.md and curves.png.
    Returns the table (Markdown). Options in `overrides` apply to every run; routing options to the routed
    modes only."""
    if not modes or any(m not in T.RESIDUALS for m in modes):
        bad = next((m for m in modes if m not in T.RESIDUALS), "")
        raise T.ConfigError(f"unknown mode {bad!r}; choose from {', '.join(T.RESIDUALS)}")
    if not seeds:
        raise T.ConfigError("--seeds needs at least one seed")
    overrides, out = dict(overrides or {}), Path(out)
    for key in ("residual", "seed", "out_dir", "resume", "overwrite"):
        if key in overrides:
            raise T.ConfigError(f"compare sets --{T.flag(key)} itself; leave it out")
    configs = [T.make_config(preset, **{k: v for k, v in overrides.items() if mode != "baseline" or k not in T.ROUTE_FIELDS},
                             residual=mode, seed=seed, out_dir=str(out / f"{mode}-s{seed}"))
               for mode in modes for seed in seeds]  # every setting checked before anything trains
    runs = {}
    for cfg in configs:
        train_or_reuse(cfg, overwrite, echo)
        runs.setdefault(cfg.residual, []).append(run_summary(cfg.out_dir, cfg.seed))
    curves = {mode: [run.pop("curve") for run in seed_runs] for mode, seed_runs in runs.items()}
    rows = R.compare_rows(runs)
    table = R.compare_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    R.save_json(dict(rows=rows, runs=runs), out / "compare.json")
    (out / "compare.md").write_text(table + "\n")
    cfg = configs[0]
    R.draw_curves(curves, out / "curves.png", title=f"validation loss: preset {cfg.preset}, {cfg.dataset}, "
                                                    f"{cfg.max_iters} steps, seeds {', '.join(map(str, seeds))}")
    return table
