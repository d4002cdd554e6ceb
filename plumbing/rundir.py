"""The run directory: an OS lock for the run, refusals that keep other runs' files, metrics.jsonl and
config.json (and W&B), the progress bar or lines, and the stop flag that turns a signal into a checkpoint."""
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from errors import ConfigError, TrainError

RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "config.json")  # what a run writes in its directory


def check_folder(folder, option):
    """Refuse a folder that is a file or lies under one (before anything is computed, not when writing)."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"{option} {folder}: {existing} is a file, not a folder; choose another {option}")


def refuse_to_replace(out, force, inputs=()):
    """Refuse to write `out` over one of `inputs` (always), over an existing file (unless force), or under a file."""
    out = Path(out)
    check_folder(out.parent, "--out")
    if any(Path(p).exists() and out.exists() and out.samefile(p) for p in inputs):
        raise ConfigError(f"--out {out} is the input checkpoint itself; write the result to another path")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file path such as {out / 'converted.pt'}")
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it, or choose another --out")


def check_same_data(out_dir, meta, way_out):
    """Refuse to go on with a run whose dataset was prepared again from other text (config.json records its hash)."""
    try:
        then = json.loads((Path(out_dir) / "config.json").read_text())["dataset"].get("content_hash")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no record (or an unreadable one)
        return
    if then and meta.get("content_hash") and then != meta["content_hash"]:
        raise ConfigError(f"{out_dir} holds a run trained on dataset {meta.get('name')} as it was before it was "
                          f"prepared again from other text (its content hash differs); {way_out}")


def lock_holder(out_dir):
    """The process id holding out_dir/run.lock (a run training there now), or None."""
    try:
        import fcntl
        with open(Path(out_dir) / "run.lock") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "unknown"
    except (ImportError, OSError):
        pass
    return None


def why_no_checkpoint(path):
    """Why a run's checkpoint is not there: the run is still before its first, it stopped before it, or no such run."""
    path = Path(path)
    try:
        cfg = json.loads((path.parent / "config.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"checkpoint {path} does not exist"
    holder = lock_holder(path.parent)
    first = f"step {cfg.get('ckpt_interval')} (--ckpt-interval)" if path.name == "last.pt" else "its first evaluation that improves"
    if holder:
        return (f"checkpoint {path} does not exist yet: the run in {path.parent} is still training (process {holder}) and "
                f"writes it at {first}; wait for it")
    return (f"checkpoint {path} does not exist: the run in {path.parent} stopped before writing it; start it again "
            f"with --overwrite (or in another --out-dir)")


def claim_run_dir(cfg, master, lock):
    """(None, {}) as checkpoint.resume_checkpoint's (checkpoint, changed settings), for a fresh run: a run
    already in out_dir is refused unless --overwrite, which deletes the old run's files; then the lock marks
    the folder's run files as this run's."""
    out_dir = Path(cfg.out_dir)
    if cfg.eval_only:
        return None, {}
    existing = [f for f in RUN_FILES if (out_dir / f).exists()]
    if existing and not cfg.overwrite:
        resume = "pass --resume to continue it, " if "last.pt" in existing else "it wrote no checkpoint to resume; pass "
        raise ConfigError(f"{out_dir} already holds a run ({', '.join(existing)}); {resume}--overwrite to start over "
                          f"(deleting it), or another --out-dir")
    init = Path(cfg.init_from)
    if cfg.overwrite and init.exists() and init.resolve().parent == out_dir.resolve():
        raise ConfigError(f"--init-from {cfg.init_from} is inside {out_dir}, which --overwrite would clear; "
                          f"copy it elsewhere first or choose another --out-dir")
    if cfg.overwrite and master:  # the old run's files must not be resumed or read by mistake
        for old in RUN_FILES:
            (out_dir / old).unlink(missing_ok=True)
    lock.claim()
    return None, {}


class RunLock:
    """An OS lock on out_dir/run.lock for the whole run, so two trainings never write one run directory; the
    kernel drops it however the process ends. A run that fails (or is quit at once) before started() leaves the
    folder as it found it: the files of a run that claimed it, the lock file and the folders it made are removed."""

    def __init__(self, out_dir, active):
        self.path, self.file, self.made, self.before, self.setup_done = Path(out_dir) / "run.lock", None, [], None, False
        self.owns_files = False  # set by claim(): the run files in the folder are this new run's
        if not active:
            return
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no lock
            return
        self.made = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]  # deepest first
        if self.path.is_file():
            self.before = self.path.read_text(errors="replace")
            if self.before.strip() and not self.before.strip().isdigit():
                raise TrainError(f"{self.path} is not a run lock that delta-gpt wrote; move it away, or choose "
                                 f"another --out-dir")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            self.release()
            raise TrainError(f"{out_dir} is in use by another training run (process {holder}); wait for it to "
                             f"finish, stop it, or choose another --out-dir") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()

    def claim(self):
        """A new run has the folder (claim_run_dir): the run files written there from now on are its own."""
        self.owns_files = True

    def started(self):
        """The run has done a step: from here a failure leaves its files (and the lock file) in place."""
        self.setup_done = True

    def undo(self):
        """A run that failed to start: remove the files of a run that claimed the folder, put back the lock
        file's old content or remove it, and the folders it made."""
        if self.file is None:
            return
        for name in RUN_FILES if self.owns_files else ():
            (self.path.parent / name).unlink(missing_ok=True)
        if self.before is not None:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(self.before)
        else:
            self.path.unlink(missing_ok=True)
        self.release()
        for folder in self.made:
            with contextlib.suppress(OSError):  # only while empty
                folder.rmdir()

    def quit_now(self):
        """A second signal: one line on the way out, and the folder as promised (StopFlag then ends the process)."""
        folder = self.path.parent
        if not self.setup_done:
            self.undo()
            said = f"before the run's first step: {folder} is left as it was"
        elif (folder / "last.pt").exists():
            said = f"{folder / 'last.pt'} holds the run's last checkpoint (continue with --resume)"
        else:
            said = f"the run wrote no checkpoint yet; start it again with --overwrite"
        print(f"stopped at once by a second signal, without a checkpoint of the current step; {said}",
              file=sys.stderr, flush=True)

    def release(self):
        if self.file is not None:
            self.file.close()  # closing drops the flock
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None and not self.setup_done:
            self.undo()
        self.release()


class StopFlag:
    """SIGINT/SIGTERM set a flag (the loop then checkpoints and exits), saying so at once; a second one ends the
    process at once, even inside a long torch op, where Python's own handlers wait for the op to return
    (on_second runs first: it says what is left)."""

    def __init__(self, master=True, on_second=None):
        self.signal, self.previous, self.wakeup = None, {}, None
        self.master, self.on_second = master, on_second

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self.handle)
        # the C-level handler writes each signal's number to this pipe at once: a thread counts them there
        read, write = os.pipe()
        os.set_blocking(write, False)
        self.wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False), read, write
        threading.Thread(target=self.count_signals, args=(read,), daemon=True).start()
        return self

    def handle(self, signum, frame):
        self.signal = signum

    def count_signals(self, read):
        count = 0
        while (got := os.read(read, 1)):
            if got[0] not in (signal.SIGINT, signal.SIGTERM):
                continue
            count += 1
            if count == 1 and self.master:
                print("stopping: the run ends after the current step or evaluation, with a checkpoint (a second "
                      "Ctrl-C quits at once, without one)", file=sys.stderr, flush=True)
            if count == 2:
                if self.on_second is not None:
                    self.on_second()
                os._exit(128 + got[0])  # 130 for Ctrl-C, as a shell reports it
        os.close(read)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.wakeup is not None:
            previous, read, write = self.wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the thread reads end-of-file and ends
            self.wakeup = None


def jsonable(obj):
    """obj with every non-finite float as None, so the JSON written is strict JSON (null, not NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


class RunRecord:
    """The run directory's metrics.jsonl (one JSON object per line), config.json and, with --wandb-project, W&B."""

    def __init__(self, out_dir, master, resume_step=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.master = master
        self.wandb = None
        self.commit = git_commit()
        if not master:
            return
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():  # drop lines a crash left past the checkpoint (and a torn last line)
            keep = [l for l in self.path.read_text().splitlines() if (row := parse_row(l)) and row.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(l + "\n" for l in keep))
            os.replace(tmp, self.path)

    def write_config(self, cfg, model, meta, world_size, device, dtype, step, changed):
        """config.json, W&B's run, and a resumed run's changed settings as a metrics line (rank 0)."""
        if not self.master:
            return
        if changed:
            self.log(kind="resume", step=step, changed={k: list(v) for k, v in changed.items()})
        info = dict(config=asdict(cfg), model_config=asdict(model.config), params=model.get_num_params(),
                    dataset=meta, commit=self.commit,
                    world_size=world_size, device=str(device), dtype=dtype, torch=torch.__version__)
        (self.path.parent / "config.json").write_text(json.dumps(info, indent=2) + "\n")
        if cfg.wandb_project:  # a new W&B run each time train.py starts, resumed or not
            run_dir = self.path.parent
            self.wandb = import_wandb().init(project=cfg.wandb_project, name=cfg.wandb_run_name or run_dir.name,
                                             config=info, dir=os.environ.get("WANDB_DIR", str(run_dir)))

    def log(self, **row):
        if self.master:
            row = jsonable({k: v for k, v in row.items() if v is not None})
            with open(self.path, "a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")
            if self.wandb is not None and (numbers := wandb_numbers(row)):
                self.wandb.log(numbers, step=row["step"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class Progress:
    """A tqdm bar on a terminal, a plain line every log_interval steps without one."""

    def __init__(self, cfg, master, start_step):
        self.cfg, self.master = cfg, master
        show = master and cfg.progress
        self.terminal = show and sys.stderr.isatty()
        self.lines = show and not self.terminal
        self.bar = tqdm(total=cfg.max_iters, initial=start_step, disable=not self.terminal, dynamic_ncols=True,
                        desc=cfg.residual)

    def step(self, step, loss, lr, tok_s, mfu):
        if not self.master:
            return
        postfix = dict(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
        if mfu is not None:
            postfix["mfu"] = f"{mfu * 100:.1f}%"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if step % self.cfg.log_interval == 0 and self.lines:
            print(f"step {step}/{self.cfg.max_iters}: " + ", ".join(f"{k} {v}" for k, v in postfix.items()), flush=True)

    def write(self, line):
        if self.master:
            self.bar.write(line)

    def close(self):
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def import_wandb():
    """The wandb module, or one clear error saying how to get it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--wandb-project needs the wandb package, which is not installed: pip install wandb==0.31.0 "
                          "(requirements.txt's pin), or leave --wandb-project out (metrics.jsonl is written either way)") from None
    return wandb


def wandb_numbers(row):
    """A metrics.jsonl row as W&B metrics: each number under KIND/NAME (nested dicts joined by '/', lists left out)."""
    out = {}

    def walk(key, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}/{k}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    for k, v in row.items():
        if k not in ("kind", "step"):
            walk(f"{row['kind']}/{k}", v)
    return out


def parse_row(line):
    """One metrics.jsonl line as a dict, or None for a blank or torn (half-written) line; old files' NaN reads too."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(out_dir):
    """The rows of a run's metrics.jsonl."""
    path = Path(out_dir) / "metrics.jsonl"
    return [row for l in path.read_text().splitlines() if (row := parse_row(l))] if path.exists() else []


def git_commit():
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
