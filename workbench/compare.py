"""
Compare residual modes: train each variant and seed on the same batches, then tabulate and draw them.

    python cli.py compare --residual baseline,delta --seeds 1,2,3 --max-iters 2000
    python cli.py compare --study studies/depth.toml --out runs/depth

How runs are laid out, reused, refused and paired: docs/usage.md, "Studies and study files".
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

import data
from delta_gpt import GPT, RESIDUALS
from errors import ConfigError, DeltaGPTError
import train as T
from plumbing import config as O
from plumbing.checkpoint import load_checkpoint
from plumbing.rundir import StopFlag, check_same_data, read_metrics
from plumbing import system as SY
from plumbing.system import apply_process_settings, pick_device
from workbench import report as R
from workbench import speed as SP
from workbench import study as S


def settings_diff(recorded, asked):
    """'name (X in the run, Y asked)' for each setting that differs between two settings dicts."""
    return [f"{k} ({recorded.get(k)!r} in the run, {v!r} asked)" for k, v in asked.items() if recorded.get(k, v) != v]


def recorded_settings(out_dir):
    """(settings, step) of the run in out_dir: from last.pt, else config.json (step None: no checkpoint yet),
    or (None, None) when it holds no run."""
    out_dir = Path(out_dir)
    if (out_dir / "last.pt").exists():
        ckpt = load_checkpoint(out_dir / "last.pt", mmap=True)
        return ckpt["config"], ckpt["iter_num"]
    if (out_dir / "config.json").exists():
        return json.loads((out_dir / "config.json").read_text())["config"], None
    return None, None


def changed_midway(out_dir):
    """'name (a -> b at step N)' for each setting that decides a run's numbers and that a resume of the run in
    out_dir changed (its metrics.jsonl records them)."""
    return [f"{k} ({a!r} -> {b!r} at step {row['step']})" for row in read_metrics(out_dir) if row["kind"] == "resume"
            for k, (a, b) in row.get("changed", {}).items() if k not in O.BOOKKEEPING_FIELDS
            and not (k in O.ARCH_FIELDS and b is None)]  # a mode's default, recorded as a change before 2026-12-05


def run_state(cfg, overwrite=False):
    """(state, steps done) of the run cfg asks for: 'new' (nothing there), 'restart' (to train afresh),
    'resume' or 'finished'. Refuses a run directory whose recorded settings differ from cfg's."""
    recorded, step = recorded_settings(cfg.out_dir)
    if recorded is None or overwrite:
        return ("new" if recorded is None else "restart"), 0
    diff = settings_diff(S.run_settings(type(cfg)(**{k: v for k, v in recorded.items() if hasattr(cfg, k)})),
                         S.run_settings(cfg))
    if diff:
        raise ConfigError(f"{cfg.out_dir} holds a run with other settings: {'; '.join(diff)}; choose another "
                          f"--out, or pass --overwrite to train it again")
    midway = changed_midway(cfg.out_dir)
    if midway:
        raise ConfigError(f"{cfg.out_dir} holds a run resumed with other settings ({'; '.join(midway)}), not one "
                          f"run with the settings asked for; choose another --out, or pass --overwrite to train "
                          f"it again")
    check_same_data(cfg.out_dir, data.prepared_meta(cfg.dataset, cfg.data_dir) or {},  # not prepared (yet): training deals with it
                    "choose another --out, or pass --overwrite to train it again")
    if step is None:  # started with these settings but stopped before its first checkpoint
        return "restart", 0
    if step >= cfg.max_iters:
        run_summary(cfg.out_dir, cfg.seed)  # a finished run holds what the table is made of
        return "finished", step
    return "resume", step


def train_or_reuse(cfg, state, label, echo=print):
    """Train the run cfg asks for afresh, resume it, or reuse it when finished, as its run_state says."""
    if state == "finished":
        echo(f"{label}: reusing the finished run in {cfg.out_dir}")
        return None
    return T.train(replace(cfg, resume=state == "resume", overwrite=state == "restart"))


def train_side_by_side(todo, jobs, echo=print):
    """Train the (Run, state) pairs of todo `jobs` at a time, each in a process of its own (cores / jobs threads
    unless --threads says) in a session of its own, its output in RUN_DIR/train.log. A signal (Ctrl-C,
    SIGTERM) is passed on once to the runs, which checkpoint and stop (a second one leaves compare at once,
    the runs still checkpointing); a failed run starts no new ones, lets the others finish and is named."""
    for name, data_dir, block_size in {(r.cfg.dataset, r.cfg.data_dir, r.cfg.block_size) for r, _ in todo}:
        data.load_or_prepare(name, data_dir=data_dir, block_size=block_size)  # once: not by two runs at a time
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    pending, running, failed, passed_on = list(todo), [], [], False
    with StopFlag(master=False) as stop:  # compare says itself what a signal does
        while running or pending and not failed and stop.signal is None:
            while pending and len(running) < jobs and not failed and stop.signal is None:
                r, state = pending.pop(0)
                if state == "finished":
                    train_or_reuse(r.cfg, state, run_label(r), echo)
                    continue
                cfg = r.cfg if r.cfg.threads else replace(r.cfg, threads=max(1, (os.cpu_count() or 1) // jobs))
                log = Path(cfg.out_dir) / "train.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, "a") as out:  # a session of its own: Ctrl-C at the terminal reaches it only through us
                    p = subprocess.Popen([sys.executable, "-u", "-m", "workbench.compare", json.dumps(asdict(cfg)), state],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
                running.append((p, r, log))
                echo(f"{run_label(r)}: {'resuming' if state == 'resume' else 'training'} in {r.cfg.out_dir} "
                     f"(its output: train.log there)")
            if stop.signal is not None and not passed_on:
                for p, _, _ in running:
                    p.send_signal(signal.SIGTERM)
                passed_on = True
            time.sleep(0.2)
            for p, r, log in [x for x in running if x[0].poll() is not None]:
                running.remove((p, r, log))
                last = (log.read_text().strip().splitlines() or ["(no output)"])[-1]
                echo(f"{run_label(r)}: {last}")
                if p.returncode != 0 and not (p.returncode == 130 and stop.signal is not None):
                    failed.append(f"{r.cfg.out_dir} (exit {p.returncode}: {last})")
    if failed:
        raise S.StudyError(f"{len(failed)} run(s) did not finish: {'; '.join(failed)}; the others are finished or "
                           f"checkpointed, and the same command resumes them")
    if stop.signal is not None:
        raise KeyboardInterrupt


def train_logged(cfg, state):
    """One run of train_side_by_side, in its own process: the threads cfg names, and SIGTERM stopping it from
    the start (the training loop then checkpoints on it). Prints a last line for compare to show."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    apply_process_settings(cfg)
    try:
        result = train_or_reuse(cfg, state, cfg.out_dir)
        print(f"finished at step {result['iter_num']}, val loss {result['val_loss']:.4f}")
    except KeyboardInterrupt:
        sys.exit(130)
    except DeltaGPTError as e:
        print(f"error: {e}")
        sys.exit(1)


def run_label(r):
    return f"{r.variant}{f' {S.value_label(r.value)}' if r.swept and r.value is not None else ''} seed {r.seed}"


def run_summary(out_dir, seed):
    """What the table needs of one finished run, read from its metrics.jsonl and config.json: the last
    evaluation's val loss and routing sharpness, the median training tokens/s, the passes over the training
    split a step makes and every evaluation (step, train and val loss, wall and CPU seconds); on_clock reads
    its curve and total time on one clock."""
    rows = read_metrics(out_dir)
    evals = [r for r in rows if r["kind"] == "eval"]
    if not evals or not (Path(out_dir) / "config.json").exists():
        raise S.StudyError(f"{out_dir} has a checkpoint but no {'evaluation in metrics.jsonl' if not evals else 'config.json'}"
                           f", which the table is made from; pass --overwrite to train the study's runs again, "
                           f"or move {out_dir} away")
    recorded = json.loads((Path(out_dir) / "config.json").read_text())
    c, train_tokens = recorded["config"], (recorded.get("dataset") or {}).get("train_tokens")
    tokens_per_step = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"] * recorded.get("world_size", 1)
    speeds = sorted(r["tokens_per_s"] for r in rows if r["kind"] == "train")
    routing = {k: v for k, v in (evals[-1].get("routing") or {}).items()
               if not (isinstance(v, float) and math.isnan(v))}  # NaN: no sublayer with more than one source
    return dict(
        seed=seed, val_loss=evals[-1]["val_loss"], tokens_per_s=speeds[len(speeds) // 2] if speeds else None,
        max_weight=routing.get("mean_max_weight"), deep_max_weight=routing.get("deep_max_weight"),
        entropy=routing.get("mean_entropy"), deep_entropy=routing.get("deep_entropy"), steps=evals[-1]["step"],
        params=recorded["params"], epochs_per_step=tokens_per_step / train_tokens if train_tokens else None,
        evals=[{k: r.get(k) for k in ("step", "train_loss", "val_loss", "elapsed", "cpu_s")} for r in evals])


def on_clock(summary, clock="wall"):
    """The summary with its curve [(step, val loss, seconds)] and total time on `clock`: wall time, or the
    training process's CPU time (runs trained before it was recorded have none)."""
    when = "elapsed" if clock == "wall" else "cpu_s"
    return dict(summary, elapsed=summary["evals"][-1][when],
                curve=[(e["step"], e["val_loss"], e[when]) for e in summary["evals"]])


def families(study):
    """{variant: the variants that train as it does but for their schedule's length, itself included}; a
    variant whose cosine ends before or after its last step is in none but its own (it is not annealed)."""
    def but_length(options):
        return {k: v for k, v in options.items() if k not in ("max_iters", "lr_decay_iters")}

    def annealed(options):
        options = {**study.train, **options}
        return options.get("lr_decay_iters") in (None, options.get("max_iters"))
    return {a: [b for b, o in study.variants.items() if b == a or annealed(o) and annealed(study.variants[a])
                and but_length(o) == but_length(study.variants[a])] for a in study.variants}


def timed_speeds(study, runs, jobs, rounds, echo=print):
    """compare.json's speed: every variant's seconds per training step at its shape (workbench/speed.py), one
    seed's run each, with the threads each run trained with; None where it cannot be timed (said in a line)."""
    shapes = {}
    for r in runs:
        name = R.speed_name(r.variant, study.sweep[0] if study.sweep else None, r.value)
        if name not in shapes:
            recorded = json.loads((Path(r.cfg.out_dir) / "config.json").read_text())["model_config"]
            shapes[name] = (recorded, r.cfg)
    cfg = runs[0].cfg
    threads = cfg.threads or (max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else torch.get_num_threads())
    echo(f"timing a training step of each of the {len(shapes)} variants at the study's shape, interleaved "
         f"({rounds} rounds, {threads} thread{'s' if threads > 1 else ''})")
    try:
        times = SP.measure(shapes, rounds, threads)
    except DeltaGPTError as e:
        echo(f"speed: {e}; the table's timed speed and equal-compute columns show '-' (break-even needs no "
             f"timing)")
        return None
    return dict(rounds=rounds, threads=threads, cpu=SY.cpu_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), times=times)


def study_of(study_file=None, residual=None, seeds=None, argv=()):
    """The Study that `compare` runs: the study file's, or one built from --residual and --seeds; train
    options in argv (--preset P, --max-iters N, ...) go on top of its [train]."""
    if study_file is not None and (residual is not None or seeds is not None):
        raise S.StudyError("--study sets its own variants and seeds; leave out --residual and --seeds")
    preset, overrides = O.parse_args(argv, T.TrainConfig)
    if study_file is not None:
        return S.load_study(study_file, overrides, preset)
    try:
        seed_list = [int(s) for s in (seeds or "1,2,3").split(",") if s]
    except ValueError:
        raise S.StudyError(f"--seeds takes comma-separated integers, got {seeds!r}") from None
    modes = [m for m in (residual or ",".join(RESIDUALS)).split(",") if m]
    return S.study_from_modes(modes, seed_list, preset, overrides)


def process_config(study):
    """A TrainConfig holding the process-wide settings (threads, device, malloc) the study's runs ask for."""
    return T.make_config(study.preset, **{k: v for k, v in study.train.items() if k in O.PROCESS_FIELDS})


def run_study(study, out, overwrite=False, echo=print, dry_run=False, jobs=1, clock="wall", speed_rounds=0,
              results=None, by_step=0):
    """Train (or reuse, or resume) every run of the study, `jobs` at a time, time a training step of each
    variant (speed_rounds rounds; 0: no timing; None: 10, or where nothing trained the timing the results
    file keeps), then write OUT/compare.json (every run's numbers and the timed speeds), compare.md (the
    table), the pictures and, given a path, the same JSON as the study's results (which reprint reads;
    not written over with an untimed study's). Every setting, every existing run and the folder are
    checked and the plan printed before anything trains. Returns the table (Markdown), or None for a dry
    run. clock: what "equal time" reads, wall time or each run's CPU time; by_step: N adds the lead at every
    evaluation at a multiple of N steps (0: not)."""
    out = Path(out)
    runs = S.cross(study, out)
    S.claim_folder(study, out, overwrite, write=False)
    unique = list({r.cfg.out_dir: r for r in runs}.values())  # a run the sweep does not apply to, once
    states = [run_state(r.cfg, overwrite) for r in unique]  # refuses runs with other settings before training
    echo(study_plan(study, unique, states, jobs))
    if dry_run:
        return None
    S.claim_folder(study, out, overwrite)
    try:
        if jobs > 1:
            # a seed's runs side by side, so that the runs read at equal time share the machine's state
            todo = sorted(zip(unique, (state for state, _ in states)), key=lambda pair: pair[0].seed)
            train_side_by_side(todo, jobs, echo)
        else:
            for r, (state, _) in zip(unique, states):
                train_or_reuse(r.cfg, state, run_label(r), echo)
    except KeyboardInterrupt:
        echo("compare stopped: the finished runs are kept and the stopped ones checkpointed; run the same command "
             "again to go on (compare resumes them itself, without --resume)")
        raise
    summaries = [dict(variant=r.variant, sweep=r.value, out_dir=r.cfg.out_dir, **run_summary(r.cfg.out_dir, r.seed))
                 for r in runs]
    saved = saved_result(study, results)
    if speed_rounds is None and saved and saved.get("speed") and all(st == "finished" for st, _ in states):
        speed = saved["speed"]  # nothing trained: the figures stay those of the timing kept with the results
        echo(f"speed: the timing of {speed['date']} kept in {results} (--speed-rounds N times again)")
    else:
        speed = timed_speeds(study, runs, jobs, speed_rounds or 10, echo) if speed_rounds != 0 else None
    result = dict(name=study.name, study=study.definition(), speed=speed, runs=summaries)
    if results is not None and (speed is not None or saved is None):
        # the runs' folders are this machine's: the results in the repository do without them
        R.save_json(dict(result, runs=[{k: v for k, v in s.items() if k != "out_dir"} for s in summaries]),
                    results)
        echo(f"wrote {results} (the study's results: `compare --study FILE --reprint` prints its tables from it)")
    return tabulate(study, result, out, echo, clock, runs[0].cfg, by_step)


def same_study(a, b):
    """The differences [(key, a's, b's)] of two study definitions, bookkeeping options (--threads, ...) aside."""
    def definition(d):
        d = json.loads(json.dumps(d or {}, default=str))
        return dict(d, train={k: v for k, v in (d.get("train") or {}).items() if k not in O.BOOKKEEPING_FIELDS})
    return S.differences(definition(a), definition(b))


def saved_result(study, results):
    """The study's results file when it holds this very study (its name and definition), else None."""
    try:
        saved = json.loads(Path(results).read_text()) if results is not None else None
    except (OSError, ValueError):
        return None
    if saved and saved.get("name") == study.name and not same_study(saved.get("study"), study.definition()):
        return saved
    return None


def reprint(study, results, out, echo=print, clock="wall", by_step=0):
    """The study's tables and pictures from its results file (run_study's), training nothing: refused when the
    file is another study's or another definition's."""
    try:
        result = json.loads(Path(results).read_text())
    except (OSError, ValueError) as e:
        raise S.StudyError(f"cannot read the results {results} ({type(e).__name__}); run the study's compare "
                           f"first, which writes them") from None
    diff = same_study(result.get("study"), study.definition())
    if result.get("name") != study.name or diff:
        said = "; ".join(f"{k} ({json.dumps(a)} there, {json.dumps(b)} here)" for k, a, b in diff[:3])
        raise S.StudyError(f"{results} holds the results of another definition of {result.get('name')!r}"
                           f"{f' (it differs in {said})' if said else ''}; run the study's compare again")
    Path(out).mkdir(parents=True, exist_ok=True)
    return tabulate(study, result, out, echo, clock, S.cross(study, out)[0].cfg, by_step)


def tabulate(study, result, out, echo, clock, cfg, by_step=0):
    """compare.json, compare.md and the pictures in out from a study's result (its runs' summaries and timed
    speeds), with by_step the lead at every evaluation at a multiple of by_step steps; returns the tables."""
    summaries = [on_clock(s, clock) for s in result["runs"]]
    option = study.sweep[0] if study.sweep else None
    times = (result.get("speed") or {}).get("times")
    rows = R.study_rows(summaries, study.reference, option, families(study), times)
    table = R.study_table(rows, study.reference, option, clock)
    pairs = R.pair_rows(summaries, study.pairs, option, families(study), times)
    if pairs:  # a pair's difference, seed by seed: a minus b on the same batches (the reference's, for both)
        table += "\n\n" + R.pair_table(pairs, option, clock)
    leads = R.lead_rows(summaries, study.reference, study.pairs, by_step) if by_step else []
    if by_step:  # the lead by step: where a head start shows, and where it fades
        table += "\n\n" + (R.lead_table(leads, option) if leads else
                            f"(no evaluation at a multiple of {by_step} steps that the runs compared share)")
    out = Path(out)
    R.save_json(dict(result, rows=rows, pairs=pairs, leads=leads, runs=summaries), out / "compare.json")
    best = R.study_best(rows, option, [v for v in study.variants if not S.sweep_applies(study, v)],
                        tuning=option not in O.ARCH_FIELDS)
    notes = (best, R.study_notes(study.reference, pairs=bool(pairs), clock=clock))
    (out / "compare.md").write_text(table + "".join(f"\n\n{t}" for t in notes if t) + "\n")
    shape = f"width {cfg.n_embd}" + (f", {cfg.n_layer} layers" if option != "n_layer" else "")
    title = (f"{study.name}: preset {cfg.preset}, {cfg.dataset}, {shape}, {cfg.max_iters} steps, "
             f"seeds {', '.join(map(str, study.seeds))}")
    for path in R.draw_study(rows, summaries, study.reference, option, out, title, clock, times):
        echo(f"wrote {path}")
    return table + (f"\n\n{best}" if best else "")


def study_plan(study, runs, states, jobs=1):
    """One line: how many runs the study has, how many are finished, and an estimate of the time left (of
    `jobs` runs at a time)."""
    done = sum(s == "finished" for s, _ in states)
    per_run = {}  # (variant, sweep value) -> seconds of a whole run: a finished one's, else one timed step's
    for r, (state, _) in zip(runs, states):
        if state == "finished" and (r.variant, S.value_label(r.value)) not in per_run:
            per_run[r.variant, S.value_label(r.value)] = run_summary(r.cfg.out_dir, r.seed)["evals"][-1]["elapsed"]
    seconds = 0.0
    for r, (state, step) in zip(runs, states):
        if state == "finished":
            continue
        key = (r.variant, S.value_label(r.value))
        if per_run.get(key) is None:
            per_run[key] = estimated_run_seconds(r.cfg)
        seconds += per_run[key] * (r.cfg.max_iters - step) / max(1, r.cfg.max_iters)
    resumed = sum(s == "resume" for s, _ in states)
    once = [v for v in study.variants if study.sweep and not S.sweep_applies(study, v)]
    shape = " x ".join(([count(len(study.sweep[1]), f"{study.sweep[0]} value")] if study.sweep else [])
                       + [count(len(study.variants) - len(once), "variant"), count(len(study.seeds), "seed")])
    shape += "".join(f", {v} once per seed" for v in once)
    left = (f"{len(runs) - done} to train" + (f" ({resumed} resumed)" if resumed else "")
            + (f", about {duration(seconds / jobs)}{f' at {jobs} at a time' if jobs > 1 else ''} (an estimate: "
               f"finished runs' wall time, else a few timed training steps of each model plus its evaluations)"
               if len(runs) > done else ""))
    return f"study {study.name}: {len(runs)} runs ({shape}), {done} finished, {left}"


def estimated_run_seconds(cfg):
    """Seconds a whole run of cfg takes, from the fastest of three timed training steps on random tokens
    (after one untimed; the fastest, as others' work on a shared machine only slows a step down) and its
    evaluations counted as forward passes at a third of a step each: a rough estimate."""
    import torch
    ds, device = data.load_or_prepare(cfg.dataset, data_dir=cfg.data_dir, block_size=cfg.block_size), pick_device(cfg)
    model = GPT(O.model_config(cfg, ds.vocab_size)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    X = torch.randint(ds.vocab_size, (cfg.batch_size, cfg.block_size), device=device)
    times = []
    for _ in range(4):  # the first step warms up the allocator and kernels
        t0 = time.perf_counter()
        for _ in range(cfg.gradient_accumulation_steps):
            model(X, X)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = min(times[1:])
    evals = cfg.max_iters // cfg.eval_interval + 1
    eval_s = evals * 2 * cfg.eval_iters * step_s / (3 * cfg.gradient_accumulation_steps)
    return cfg.max_iters * step_s + eval_s


def duration(seconds):
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def count(n, word):
    return f"{n} {word}{'s' if n != 1 else ''}"


if __name__ == "__main__":  # one run of compare --jobs: python -m workbench.compare CONFIG_JSON STATE
    train_logged(T.TrainConfig(**json.loads(sys.argv[1])), sys.argv[2])
