"""
Side-by-side benchmark of the residual modes: forward+backward tokens/s, bytes of tensors saved for
backward (activation memory), and parameter count, each with its ratio to baseline, in one run.

    python cli.py bench                          # the cpu and d768 configs below, all modes
    python cli.py bench --config cpu --iters 20  # one config
    python cli.py bench --config w128 --threads 1 --residual baseline,attnres,attnres-h4   # the studies' shape
    python cli.py bench --config w128 --threads 1 --profile   # where each mode's step goes (workbench/profile.py)
    python cli.py bench --config w128 --threads 1 --profile --compile   # the compiled step, by kind of operation
    python -m workbench.bench ...                # the same without the CLI
    python cli.py bench --device cuda            # GPU: d768, context 1024, bf16, eager and compiled

How it counts saved bytes and times the modes, on the CPU and on CUDA: docs/speed.md.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial

import torch

from delta_gpt import GPT, GPTConfig, RESIDUALS
from errors import DeltaGPTError
from plumbing.config import ConfigError, at_least_one, parse_mode
from plumbing.system import keep_freed_memory
from workbench.profile import compiled_profile_table, profile_compiled, profile_modes, profile_table
from workbench.report import speed_ratio
from workbench.speed import step_times

# name -> (model config, batch size), fp32 eager on the CPU: the cpu preset's model (character vocabulary), the
# shape of the width-128 studies (studies/heads-w128.toml: the cpu preset 16 layers deep) and GPT-2 small
CONFIGS = {
    "cpu": (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0), 12),
    "w128": (GPTConfig(n_layer=16, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0), 12),
    "d768": (GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=128, dropout=0.0), 4),
}
ALL = ("cpu", "d768")  # --config all: the two configs every speed table shows
# name -> (model config, default batch size), bf16 autocast on CUDA: GPT-2 small at context 1024
CUDA_CONFIGS = {
    "d768": (GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0), 16),
}
VARIANTS = ("eager", "compiled")


def make(config, mode, **route):
    """A model of `config` in `mode` (a residual mode; a routed one may end in -static, its static control,
    and then in -hH, H routing heads), with routing fields in `route` (ignored for baseline)."""
    return GPT(mode_config(config, mode, **route))


def mode_config(config, mode, **route):
    """make's GPTConfig (ValueError for a value the model refuses, such as heads that do not divide the width)."""
    residual, named = parse_mode(mode)
    route = {} if residual == "baseline" else {k: v for k, v in route.items() if v is not None}
    return replace(config, residual=residual, n_route_blocks=None, route_partial=None, route_sources=None,
                   **route, **named)


def saved_bytes(model, idx):
    """Bytes of the tensors autograd saves for backward in one forward+backward (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step(model, idx):
    _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def bench(config, batch, modes=RESIDUALS, iters=None, rounds=15, memory_layers=(), seed=0, round_s=1.0, **route):
    """Rows of {mode, params, saved, tok_s, ...} for one config, ratios to the first mode (baseline).
    Each round times `iters` steps of every mode in turn, in CPU time (the process's, all its threads),
    which time-sharing inflates less than wall time (not nothing: caches are shared), and the modes in
    turn alike. tok_s is the best round's; tok_s_x its ratio to the baseline's
    best round; paired_x the median over rounds of the baseline's time in that round over the mode's, the
    steadier figure on a shared machine (docs/speed.md). iters: default about round_s seconds of the first mode."""
    torch.manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    models = {m: make(config, m, **route) for m in modes}
    rows = {m: dict(mode=m, params=models[m].get_num_params(), saved=saved_bytes(models[m], idx)) for m in modes}
    for n_layer in memory_layers:  # activation memory at other depths, to show it grows linearly
        for m in modes:
            rows[m][f"saved_L{n_layer}"] = saved_bytes(make(replace(config, n_layer=n_layer), m, **route), idx)
    steps = {m: partial(step, models[m], idx) for m in modes}
    for warm_up in steps.values():
        warm_up()
    times = step_times(steps, rounds, round_s, iters)
    for m, r in rows.items():
        r["tok_s"] = batch * config.block_size / min(times[m])
        r["paired_x"] = speed_ratio(times[m], times[modes[0]])[1]
    base = rows[modes[0]]
    for r in rows.values():
        for key in [k for k in r if k in ("params", "tok_s") or k.startswith("saved")]:
            r[key + "_x"] = r[key] / base[key]
    return list(rows.values())


def cpp_compiler():
    """The C++ compiler Inductor would call on the CPU (g++ unless configured)."""
    from torch._inductor import cpp_builder
    return cpp_builder.get_cpp_compiler()


def check_cpp_compiler():
    """BenchError, one sentence, when no working C++ compiler is there for torch.compile on the CPU."""
    compiler = "a C++ compiler"
    try:
        compiler = cpp_compiler()
        done = subprocess.run([compiler, "-x", "c++", "-", "-o", os.devnull], input="int main() { return 0; }",
                              capture_output=True, text=True, timeout=120)
        why = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["it failed"])[0]
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if why is not None:
        raise BenchError(f"--compile on the CPU needs a working C++ compiler for torch.compile's Inductor, and "
                         f"{compiler} does not work ({why}); install one (apt-get install g++) or leave --compile out")


def bench_compiled(config, batch, modes=RESIDUALS, iters=None, rounds=15, seed=0, round_s=1.0):
    """Rows of {mode, cold_s, warm_s, tok_s, tok_s_x, eager_x, paired_x} on the CPU, every mode compiled: the
    first compile's wall time (cold unless Inductor's cache already holds these graphs) and a second one's
    after dynamo forgets them (warm: Inductor's cache), then the compiled models and the eager baseline timed
    in interleaved rounds as bench() does; ratios to the compiled baseline (eager_x: to the eager one)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch.manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    eager = make(config, modes[0])
    rows, runs = {}, {"eager baseline": partial(step, eager, idx)}
    for m in modes:
        model = make(config, m)
        times = []
        for _ in range(2):  # cold, then warm
            torch._dynamo.reset()
            compiled = torch.compile(model)
            t0 = time.perf_counter()
            try:
                step(compiled, idx)
            except Exception as e:  # noqa: BLE001: Inductor's failures (headers, OpenMP, ...) in one line
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise BenchError(f"{m} does not compile on this machine ({type(e).__name__}: {first})") from None
            times.append(time.perf_counter() - t0)
        rows[m] = dict(mode=m, cold_s=times[0], warm_s=times[1])
        runs[m] = partial(step, compiled, idx)
        print(f"  {m}: compiled in {times[0]:.0f} s, again in {times[1]:.0f} s", flush=True)
    rows["eager baseline"] = dict(mode="eager baseline", cold_s=None, warm_s=None)
    runs["eager baseline"]()  # warm-up (the compiled ones ran twice above)
    times = step_times(runs, rounds, round_s, iters)
    for name, r in rows.items():
        r["tok_s"] = batch * config.block_size / min(times[name])
        r["tok_s_x"], r["paired_x"] = speed_ratio(times[name], times[modes[0]])
        r["eager_x"] = speed_ratio(times[name], times["eager baseline"])[0]
    return [rows["eager baseline"]] + [rows[m] for m in modes]


def compiled_table(rows):
    head = ["mode", "compile s (first)", "compile s (again)", "tokens/s", "x compiled baseline",
            "x median", "x eager baseline"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join([r["mode"], shown(r["cold_s"], ".0f"), shown(r["warm_s"], ".0f"), f"{r['tok_s']:,.0f}",
                           f"{r['tok_s_x']:.3f}", f"{r['paired_x']:.3f}", f"{r['eager_x']:.3f}"]) + " |"
        for r in rows])


def speed_table(rows, memory_layers=()):
    """The rows as a Markdown table."""
    head = ["mode", "params", "x", "saved MB", "x", "tokens/s", "x", "x median"]
    for n_layer in memory_layers:
        head += [f"saved MB L{n_layer}", "x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mode"], f"{r['params']:,}", f"{r['params_x']:.4f}", f"{r['saved'] / 2**20:.1f}",
                 f"{r['saved_x']:.3f}", f"{r['tok_s']:,.0f}", f"{r['tok_s_x']:.3f}", f"{r['paired_x']:.3f}"]
        for n_layer in memory_layers:
            cells += [f"{r[f'saved_L{n_layer}'] / 2**20:.1f}", f"{r[f'saved_L{n_layer}_x']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cuda_step(model, idx):
    """One forward+backward under bf16 autocast (model: a GPT or its torch.compile wrapper)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure_cuda(model, idx, warmup, iters, rounds):
    """(best seconds per step over `rounds` rounds of `iters` steps, peak bytes allocated in them),
    after `warmup` steps (which compile a compiled model)."""
    for _ in range(warmup):
        cuda_step(model, idx)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            cuda_step(model, idx)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters)
    return min(times), torch.cuda.max_memory_allocated()


def bench_cuda(config, batch, modes=RESIDUALS, variants=VARIANTS, iters=10, rounds=3, warmup=3, seed=0,
               on_rows=None, **route):
    """Rows of {mode, params, eager_tok_s, eager_mfu, eager_peak, compiled_...} on CUDA, with ratios to
    the first mode (baseline). One mode at a time, its model freed before the next; on_rows(rows) is
    called after each mode (to save partial results)."""
    device = torch.device("cuda")
    torch.manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device)
    rows = []
    for m in modes:
        torch.manual_seed(seed)
        model = make(config, m, **route).to(device)
        row = dict(mode=m, params=model.get_num_params())
        for v in variants:
            torch._dynamo.reset()  # each mode compiles afresh, never against another model's guards
            run = torch.compile(model) if v == "compiled" else model
            try:
                dt, peak = measure_cuda(run, idx, warmup, iters, rounds)
                row.update({f"{v}_tok_s": batch * config.block_size / dt, f"{v}_peak": peak,
                            f"{v}_mfu": model.estimate_mfu(batch, dt, device)})
            except torch.cuda.OutOfMemoryError:
                row.update({f"{v}_tok_s": None, f"{v}_peak": None, f"{v}_mfu": None, f"{v}_error": "out of memory"})
            del run
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        add_ratios(rows, ["params"] + [f"{v}_{k}" for v in variants for k in ("tok_s", "peak")])
        if on_rows is not None:
            on_rows(rows)
    torch._dynamo.reset()
    return rows


def add_ratios(rows, keys):
    """r[key + '_x'] = r[key] / rows[0][key] (None where either is missing)."""
    base = rows[0]
    for r in rows:
        for key in keys:
            ok = r.get(key) is not None and base.get(key)
            r[key + "_x"] = r[key] / base[key] if ok else None


def cuda_table(rows, variants=VARIANTS):
    """The CUDA rows as a Markdown table: each variant's tokens/s, MFU and peak memory, with ratios."""
    head = ["mode", "params", "x"]
    for v in variants:
        head += [f"{v} tokens/s", "x", "MFU", "peak GiB", "x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mode"], f"{r['params']:,}", shown(r.get("params_x"), ".4f")]
        for v in variants:
            missing = r.get(f"{v}_error", "-")
            peak = r.get(f"{v}_peak")
            cells += [shown(r.get(f"{v}_tok_s"), ",.0f", missing), shown(r.get(f"{v}_tok_s_x"), ".3f"),
                      shown(r.get(f"{v}_mfu"), ".1%"), shown(peak / 2**30 if peak is not None else None, ".2f"),
                      shown(r.get(f"{v}_peak_x"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shown(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


class BenchError(DeltaGPTError):
    """A benchmark option that is wrong, or does not fit the device."""


def check_args(args):
    """Raise BenchError, one clear sentence, for a bad option or options that do not fit the device."""
    modes = [m for m in args.residual.split(",") if m]
    for mode in modes or [""]:
        parse_mode(mode)
    try:
        at_least_one(**{name: getattr(args, name) for name in ("iters", "rounds", "n_layer", "n_embd", "threads", "steps")
                        if getattr(args, name) is not None})
    except ConfigError as e:
        raise BenchError(str(e)) from None
    if args.malloc not in ("keep", "default"):
        raise BenchError(f"unknown --malloc {args.malloc!r}; choose keep or default")
    if args.device not in ("cpu", "cuda"):
        raise BenchError(f"unknown --device {args.device!r}; choose cpu or cuda")
    if args.device == "cpu":
        if args.config not in (*CONFIGS, "all"):
            raise BenchError(f"unknown --config {args.config!r}; choose one of {', '.join(CONFIGS)} or all")
        if args.steps is not None and not args.profile:
            raise BenchError("--steps sets how many steps --profile records; give --profile too, or leave --steps out")
        if args.batch_size is not None or args.variants is not None or args.json is not None:
            raise BenchError("--batch-size, --variants and --json apply to --device cuda only; the CPU configs "
                             "fix their batch")
        for name in ALL if args.config == "all" else [args.config]:
            try:
                config, _ = cpu_config(name, args)
            except ValueError as e:
                raise BenchError(f"--config {name} with --n-layer/--n-embd: {e}") from None
            for mode in modes:
                try:
                    mode_config(config, mode)
                except ValueError as e:
                    raise BenchError(f"--config {name}, mode {mode}: {e}") from None
        return
    if args.n_layer is not None or args.n_embd is not None or args.profile or args.compile:
        raise BenchError("--n-layer, --n-embd, --profile and --compile apply to the CPU configs only (on CUDA "
                         "--variants eager,compiled)")
    if not torch.cuda.is_available():
        raise BenchError(f"--device cuda needs a CUDA GPU, and this PyTorch ({torch.__version__}) sees none; "
                         f"run the CPU benchmark without --device, or install a CUDA build of PyTorch (docs/gpus.md)")
    if args.config not in (*CUDA_CONFIGS, "all"):
        raise BenchError(f"--config {args.config} is a CPU config; on CUDA choose {', '.join(CUDA_CONFIGS)} or all")
    bad = [v for v in (args.variants or "").split(",") if v and v not in VARIANTS]
    if bad or args.variants == "":
        raise BenchError(f"unknown --variants {args.variants!r}; choose eager, compiled or eager,compiled")
    if args.batch_size is not None and args.batch_size < 1:
        raise BenchError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.json is not None and os.path.exists(args.json):
        raise BenchError(f"--json {args.json} already exists; move it away or choose another file")


def main_cuda(args, modes):
    variants = tuple(v for v in VARIANTS if v in (args.variants or ",".join(VARIANTS)).split(","))
    iters, rounds = args.iters or 10, args.rounds or 3
    name = torch.cuda.get_device_name()
    for cname in CUDA_CONFIGS if args.config == "all" else [args.config]:
        config, batch = CUDA_CONFIGS[cname]
        batch = args.batch_size or batch
        print(f"\n{cname}: n_layer {config.n_layer}, n_embd {config.n_embd}, context {config.block_size}, batch {batch}, "
              f"bf16 autocast, {' and '.join(variants)}, {name}, torch {torch.__version__}, "
              f"best of {rounds} rounds of {iters} steps", flush=True)
        info = dict(config=cname, n_layer=config.n_layer, n_embd=config.n_embd, block_size=config.block_size,
                    batch=batch, device=name, torch=torch.__version__, iters=iters, rounds=rounds)

        def save(rows):
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(info, rows=rows), f, indent=1)
            print(f"  {rows[-1]['mode']} done", flush=True)

        rows = bench_cuda(config, batch, modes, variants, iters=iters, rounds=rounds, on_rows=save)
        print(cuda_table(rows, variants))


def parser(prog=None):
    """bench's options (python -m workbench.bench and python cli.py bench both parse with it)."""
    ap = argparse.ArgumentParser(prog=prog or "python -m workbench.bench", description=__doc__.split("\n\n")[1].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="all", help=f"{', '.join(CONFIGS)} or all ({' and '.join(ALL)}) on the CPU; on CUDA: {', '.join(CUDA_CONFIGS)} "
                    f"(context 1024) or all")
    ap.add_argument("--residual", default=",".join(RESIDUALS), help="comma-separated modes, baseline first; MODE-static: that mode's "
                    "static routing control (e.g. delta-static); then -hH: H routing heads (delta-h4, delta-static-h4)")
    ap.add_argument("--iters", type=int, default=None, help="steps per timing round (default: about a second's worth; 10 on CUDA)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds, interleaved over the modes on the CPU (the fastest is taken; default 15, 3 on CUDA)")
    ap.add_argument("--n-layer", type=int, default=None, help="CPU: the config at another depth (e.g. a study's)")
    ap.add_argument("--profile", action="store_true", help="CPU: instead of timing, torch.profiler's breakdown of each "
                    "mode's step: routing's share, forward and backward, by operation (workbench/profile.py); with "
                    "--compile: the compiled step by kind of operation")
    ap.add_argument("--steps", type=int, default=None, help="with --profile: steps recorded per mode (default 5)")
    ap.add_argument("--compile", action="store_true", help="CPU: every mode and the baseline compiled "
                    "(torch.compile, Inductor): compile times, then speed against the compiled and the eager "
                    "baseline (needs a C++ compiler; minutes per mode the first time)")
    ap.add_argument("--n-embd", type=int, default=None, help="CPU: the config at another width (a multiple of its heads)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice; 1 for figures "
                    "that another job on the machine should not move)")
    ap.add_argument("--malloc", default="keep",
                    help="keep (the default): malloc keeps freed memory for reuse, as CPU training does; or default: the C "
                         "library's own behaviour")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: GPT-2 small at context 1024 in bf16, eager and "
                    "compiled, with MFU and peak memory")
    ap.add_argument("--batch-size", type=int, default=None, help=f"CUDA: sequences per step (default {CUDA_CONFIGS['d768'][1]})")
    ap.add_argument("--variants", default=None, help="CUDA: eager, compiled or eager,compiled (the default)")
    ap.add_argument("--json", default=None, help="CUDA: also write the rows to this JSON file (after each mode)")
    return ap


def bench_args(argv=None, prog=None):
    return parser(prog).parse_args(argv)


def options_help():
    """One line per option, for `python cli.py bench --help`."""
    return "\n".join(f"  {a.option_strings[-1]:<14} {a.help}" for a in parser()._actions if a.dest != "help")


def cpu_config(name, args):
    """(GPTConfig, batch) of CPU config `name`, at --n-layer and --n-embd where given."""
    config, batch = CONFIGS[name]
    return replace(config, n_layer=config.n_layer if args.n_layer is None else args.n_layer,
                   n_embd=config.n_embd if args.n_embd is None else args.n_embd), batch


def main(argv=None, prog=None):
    """Parse and check the options (BenchError for a bad one), set the process up and run the benchmark."""
    args = bench_args(argv, prog)
    check_args(args)
    if args.compile:
        check_cpp_compiler()  # before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = tuple(args.residual.split(","))
    if modes[0] != "baseline":
        modes = ("baseline",) + tuple(m for m in modes if m != "baseline")
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as train.py (bf16 autocast leaves few fp32 matmuls)
        return main_cuda(args, modes)
    rounds = args.rounds or 15
    malloc = "keeps freed memory" if args.malloc == "keep" and keep_freed_memory() else "default"
    for name in ALL if args.config == "all" else [args.config]:
        config, batch = cpu_config(name, args)
        shape = (f"\n{name}: n_layer {config.n_layer}, n_embd {config.n_embd}, context {config.block_size}, "
                 f"batch {batch}, fp32 {'compiled' if args.compile else 'eager'}, threads {torch.get_num_threads()}, "
                 f"malloc {malloc}")
        if args.profile:
            steps = args.steps or 5
            print(f"{shape}, torch.profiler over {steps} steps of each mode, interleaved", flush=True)
            torch.manual_seed(0)
            idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
            if args.compile:  # the compiled step by kind: routing's operations are fused with the rest
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                compiled = {m: torch.compile(make(config, m)) for m in modes}
                print(compiled_profile_table(profile_compiled(compiled, idx, steps)))
            else:
                print(profile_table(profile_modes({m: make(config, m) for m in modes}, idx, steps)))
            continue
        if args.compile:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            print(f"{shape}, Inductor's cache in {cache_dir()}, CPU time, "
                  f"{rounds} rounds (tokens/s: the best round; x median: of each round's ratio)", flush=True)
            print(compiled_table(bench_compiled(config, batch, modes, iters=args.iters, rounds=rounds)))
            continue
        print(f"{shape}, CPU time, {rounds} rounds (tokens/s: the best round; x median: of each round's ratio)", flush=True)
        memory_layers = (2 * config.n_layer,) if name == "d768" else ()
        rows = bench(config, batch, modes, iters=args.iters, rounds=rounds, memory_layers=memory_layers)
        print(speed_table(rows, memory_layers))


if __name__ == "__main__":
    try:
        main()
    except DeltaGPTError as e:
        sys.exit(f"error: {e}")
