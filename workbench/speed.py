"""The speed ratio of each routed variant of a study to its reference, measured so that a busy machine
cannot move it: at the study's own shape (the model each run trained, its batch, fast path, precision and
compile setting), for a whole training step (forward, backward, gradient clipping and the AdamW step), the
shapes timed in turn inside every round of one process, in that process's CPU time, so that a neighbour slows
them alike, with malloc keeping freed memory as the runs do (plumbing/system.py). `compare --study` measures
it after its runs and keeps it in compare.json; docs/speed.md shows how far another job moves it.

    ratio = (the reference's seconds per step) / (the variant's): 0.82 means the variant trains at 0.82x
    the reference's speed. best: the ratio of the best rounds; median: the median over rounds of the two
    shapes' ratio in that round (the steadier figure on a shared machine).
"""
import argparse
import json
import math
import statistics
import time
from dataclasses import asdict

import torch

import data
from delta_gpt import GPT, GPTConfig
from errors import DeltaGPTError
from plumbing.checkpoint import model_vocab
from plumbing.config import model_config
from plumbing.system import keep_freed_memory, precision
from workbench import study as S
from workbench.report import markdown, speed_name, speed_ratio

ROUND_S = 0.5  # seconds of the first shape's steps in each round (the tests shorten it)


def shape_key(recorded, cfg):
    """What decides a run's time per step: its model (dropout included) and the step's settings."""
    step = dict(batch_size=cfg.batch_size, accum=cfg.gradient_accumulation_steps, dtype=cfg.dtype,
                compile=bool(cfg.compile), grad_clip=cfg.grad_clip, recompute=cfg.activation_checkpointing)
    return json.dumps(dict(recorded, **step), sort_keys=True)


def train_step(model, optimizer, idx, ctx, accum, grad_clip):
    """One training step as train.py takes it, on the tokens idx (their own targets)."""
    for _ in range(accum):
        with ctx:
            _, loss = model(idx, idx)
        (loss / accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def setup(recorded, cfg, seed=0):
    """(step function) of one shape: its model as the run built it, AdamW as the run's, fixed random tokens."""
    torch.manual_seed(seed)
    config = GPTConfig(**recorded)
    raw = GPT(config)
    for block in raw.transformer.h:
        block.recompute = cfg.activation_checkpointing
    optimizer = raw.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), "cpu",
                                         route_lr_mult=cfg.route_lr_mult)
    model = torch.compile(raw) if cfg.compile else raw
    _, ctx, _ = precision(cfg, torch.device("cpu"), master=False)
    idx = torch.randint(0, config.vocab_size, (cfg.batch_size, config.block_size))
    return lambda: train_step(model, optimizer, idx, ctx, cfg.gradient_accumulation_steps, cfg.grad_clip)


def step_times(steps, rounds, round_s, iters=None):
    """steps: {key: step function}, each warmed up (a compiled model compiles there) -> {key: [CPU seconds per
    step in each round]}, the keys timed in turn in every round, `iters` steps each (default: about round_s
    seconds of the first key's steps). `bench` times its modes with it too."""
    if iters is None:
        first = next(iter(steps.values()))
        t0 = time.process_time()
        first()
        iters = max(1, round(round_s / max(time.process_time() - t0, 1e-6)))
    times = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            t0 = time.process_time()
            for _ in range(iters):
                step()
            times[key].append((time.process_time() - t0) / iters)
    return times


def measure(shapes, rounds=10, threads=1):
    """shapes: {name: (model config dict, TrainConfig)} -> {name: [CPU seconds per step in each round]}, each
    distinct shape built and timed once (names that share one share its times), all in one interleaved set of
    rounds with `threads` torch threads. A shape that cannot be built or run raises DeltaGPTError naming it."""
    keys = {name: shape_key(*shape) for name, shape in shapes.items()}
    # one compiled model per shape: past dynamo's default of 8, the later ones would run eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(keys))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps = {}
        for name, (recorded, cfg) in shapes.items():
            if keys[name] in steps:
                continue
            try:
                steps[keys[name]] = setup(recorded, cfg)
                steps[keys[name]]()  # warm-up: a mode or compiler this machine cannot run fails here
            except Exception as e:  # noqa: BLE001: any failure of torch or its compiler, named in one line
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise DeltaGPTError(f"{name} cannot be timed on this machine ({type(e).__name__}: {first})") from None
        times = step_times(steps, rounds, ROUND_S)
    finally:
        torch.set_num_threads(before)
    return {name: times[key] for name, key in keys.items()}



def main(argv=None):
    """python -m workbench.speed --study FILE: the timed speed of a study's variants, training nothing (what
    compare --study measures after its runs), to see how another job moves it."""
    ap = argparse.ArgumentParser(prog="python -m workbench.speed", description=main.__doc__.split("\n")[0])
    ap.add_argument("--study", required=True, help="a study file (studies/)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds, each timing every variant in turn")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the studies train with 1)")
    args = ap.parse_args(argv)
    keep_freed_memory()  # as the runs and compare's timing do: without it the routed steps page-fault more
    try:
        study = S.load_study(args.study)
        runs = [r for r in S.cross(study, "runs/speed") if r.seed == study.seeds[0]]
        option = study.sweep[0] if study.sweep else None
        shapes = {}
        for r in runs:
            ds = data.load(r.cfg.dataset, **({"data_dir": r.cfg.data_dir} if r.cfg.data_dir else {}))
            shapes[speed_name(r.variant, option, r.value)] = (asdict(model_config(r.cfg, model_vocab(ds))), r.cfg)
        times = measure(shapes, args.rounds, args.threads)
    except DeltaGPTError as e:
        raise SystemExit(f"error: {e}") from None
    rows = []
    for r in runs:
        name, ref = speed_name(r.variant, option, r.value), speed_name(study.reference, option, r.value)
        best, median = speed_ratio(times[name], times[ref])
        rows.append([name, f"{1000 * statistics.median(times[name]):.1f}", f"{median:.3f}x", f"{best:.3f}x"])
    print(f"{study.name}: a training step of each variant, {args.rounds} interleaved rounds, {args.threads} "
          f"thread(s), CPU time; speed relative to {study.reference}")
    print(markdown(["variant", "ms per step (median)", "speed (median)", "speed (best rounds)"], rows))


if __name__ == "__main__":
    main()
