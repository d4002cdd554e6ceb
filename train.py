"""
Training script for delta-gpt: one process on CPU, CUDA or MPS, or DDP launched with torchrun.

    python train.py --residual delta                          # the `cpu` preset where there is no CUDA
    python train.py --preset shakespeare_char --residual attnres --max-iters 2000
    python train.py --out-dir runs/cpu-delta --resume --max-iters 4000   # continue, bit-exact on CPU
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2_124m --residual delta
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 train.py --preset paper_220m --residual delta   # node 0 of 2

`python cli.py train ...` takes the same options. Every TrainConfig field is an option (--max-iters or
--max_iters; --compile / --no-compile for flags); unknown options and wrong types are refused.

Each step draws its global batch from (seed, step) and rank r's micro-step m takes slice r * accum + m,
so a resumed run sees exactly the batches it would have seen, and 2 ranks with 1 micro-step, 1 rank with
2 micro-steps and 1 rank with a double batch all train on the same data. Evaluation always uses the
same fixed batches, so curves compare across runs, seeds and modes.
"""
import contextlib
import ctypes
import difflib
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
from delta_gpt import GPT, GPTConfig, RESIDUALS, is_routing_key

MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "residual",
                "n_route_blocks", "route_partial", "route_sources")  # TrainConfig fields that build GPTConfig
ARCH_FIELDS = tuple(f for f in MODEL_FIELDS if f != "dropout") + ("vocab_size",)  # fixed once trained
ROUTE_FIELDS = ("residual", "n_route_blocks", "route_partial", "route_sources")  # --init-from may change these
GPT2_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
EVAL_SEED = 20260518  # seeds the fixed evaluation batches, the same whatever the training seed


class TrainError(RuntimeError):
    """A run that cannot go on (non-finite loss, unusable checkpoint): one line, with what to do."""


@dataclass
class TrainConfig:
    preset: str = "cpu"  # the preset these values started from (recorded; --preset chooses it)
    out_dir: Optional[str] = None  # run directory for checkpoints and metrics (default runs/PRESET-RESIDUAL)
    dataset: str = "shakespeare_char"  # a prepared dataset under data_dir (see `python cli.py prepare`)
    data_dir: Optional[str] = None  # where datasets live (default: the data/ folder)
    # model
    residual: str = "baseline"  # baseline | attnres | delta | delta_block
    n_layer: int = 4  # transformer layers (2 sublayers each)
    n_head: int = 4  # attention heads
    n_embd: int = 128  # model width
    block_size: int = 64  # context length in tokens
    dropout: float = 0.0  # dropout in attention, residual and embeddings
    bias: bool = False  # bias in Linear and LayerNorm layers
    n_route_blocks: Optional[int] = None  # routing blocks N (must divide 2*n_layer; default per mode)
    route_partial: Optional[bool] = None  # also route the current block's partial sum (delta_block)
    route_sources: Optional[str] = None  # delta (block sums) or cumulative (stream snapshots)
    init_from: str = "scratch"  # scratch, a baseline checkpoint path, or gpt2 / gpt2-medium / ...
    # optimisation
    batch_size: int = 12  # sequences per micro-step per rank
    gradient_accumulation_steps: int = 1  # micro-steps per step, over all ranks (divided among them)
    max_iters: int = 2000  # total optimizer steps
    learning_rate: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # final learning rate of the cosine decay
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: Optional[int] = None  # cosine decay length in steps (default max_iters)
    decay_lr: bool = True  # warmup + cosine decay; off: constant learning_rate
    weight_decay: float = 0.1  # AdamW weight decay of 2-D weights
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    grad_clip: float = 1.0  # clip gradients at this global norm; 0 disables
    route_lr_mult: float = 1.0  # learning-rate multiplier of the routing queries and gains
    seed: int = 1337  # seeds batches, dropout and init
    # evaluation, logging, checkpoints
    eval_interval: int = 250  # evaluate every this many steps
    eval_iters: int = 20  # fixed batches per evaluation
    log_interval: int = 10  # write a metrics line every this many steps
    ckpt_interval: int = 250  # write last.pt every this many steps
    eval_only: bool = False  # evaluate once and exit
    resume: bool = False  # continue from out_dir/last.pt
    overwrite: bool = False  # start afresh even if out_dir holds a checkpoint
    progress: bool = True  # show a progress bar
    # system
    device: str = "auto"  # auto (cuda, then mps, then cpu), or cpu, cuda, cuda:1, mps
    dtype: str = "auto"  # auto (bfloat16 on CUDA where supported, else float16; float32 on CPU/MPS), float32, bfloat16, float16
    compile: Optional[bool] = None  # torch.compile the model (default: on for CUDA, off elsewhere)
    fsdp: bool = False  # shard parameters, gradients and optimizer state with FSDP2 (under torchrun)
    activation_checkpointing: bool = False  # recompute each attention and MLP in backward to save activation memory
    wandb_project: Optional[str] = None  # also log the metrics to this Weights & Biases project (needs the wandb package)
    wandb_run_name: Optional[str] = None  # the W&B run's name (default: the run directory's name)


PAPER = dict(dataset="fineweb_edu", block_size=2048, max_iters=10000, learning_rate=6e-4, min_lr=6e-5, warmup_iters=1000,
             beta2=0.95, eval_interval=500, eval_iters=100, ckpt_interval=500)  # the paper's recipe
PRESETS = {
    # nanoGPT's CPU recipe: a few minutes on 2 cores
    "cpu": dict(),
    # nanoGPT's shakespeare_char GPU recipe (6 layers, 6 heads, 384 wide, context 256)
    "shakespeare_char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, batch_size=64,
                             max_iters=5000, eval_iters=200, log_interval=10, ckpt_interval=500),
    # GPT-2 small on FineWeb-Edu, nanoGPT's train_gpt2 recipe (about 0.5M tokens per step)
    "gpt2_124m": dict(dataset="fineweb_edu", n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12,
                      gradient_accumulation_steps=40, max_iters=600000, learning_rate=6e-4, min_lr=6e-5,
                      warmup_iters=2000, beta2=0.95, eval_interval=1000, eval_iters=200, ckpt_interval=1000),
    # the paper's sizes in its recipe: seq 2048, 10K steps, 6e-4 -> 6e-5 cosine, warmup 1000, AdamW (0.9, 0.95),
    # weight decay 0.1; 256 sequences (0.5M tokens) per step; head size 64 (128 at 7B)
    "paper_220m": dict(PAPER, n_layer=12, n_head=12, n_embd=768, batch_size=8, gradient_accumulation_steps=32),
    "paper_533m": dict(PAPER, n_layer=24, n_head=16, n_embd=1024, batch_size=8, gradient_accumulation_steps=32),
    "paper_1b": dict(PAPER, n_layer=36, n_head=20, n_embd=1280, batch_size=8, gradient_accumulation_steps=32),
    "paper_7b": dict(PAPER, n_layer=36, n_head=32, n_embd=4096, batch_size=8, gradient_accumulation_steps=32,
                     fsdp=True, activation_checkpointing=True),
}


def default_preset():
    return "cpu" if not torch.cuda.is_available() else "shakespeare_char"


def make_config(preset=None, **overrides):
    """TrainConfig from a named preset plus field overrides; bad names and values raise ValueError."""
    preset = preset or default_preset()
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {', '.join(sorted(unknown))}")
    if overrides.get("resume") and overrides.get("init_from", "scratch") != "scratch":
        raise ValueError("--resume continues out_dir/last.pt; it cannot be combined with --init-from")
    cfg = replace(TrainConfig(), **{**PRESETS[preset], **overrides, "preset": preset})
    check_config(cfg)
    return cfg


def resume_config(preset=None, **overrides):
    """The config of the run in out_dir (from its last.pt) with `overrides` on top, for --resume.
    The architecture may not change (train() refuses it, naming the fields); other changes are logged."""
    if overrides.get("init_from", "scratch") != "scratch":
        raise ValueError("--resume continues out_dir/last.pt; it cannot be combined with --init-from")
    fresh = make_config(preset, **{**overrides, "resume": True})
    ckpt = load_checkpoint(Path(out_dir_of(fresh)) / "last.pt", mmap=True)
    names = {f.name for f in fields(TrainConfig)}
    saved = replace(TrainConfig(), **{k: v for k, v in ckpt["config"].items() if k in names})
    if preset is not None and preset != saved.preset:
        raise ValueError(f"--preset {preset} differs from the run's preset {saved.preset}; a resumed run keeps its preset")
    # the saved init_from only records where the run began: its weights now come from last.pt
    cfg = replace(saved, **{**overrides, "resume": True})
    check_config(cfg)
    return cfg


def out_dir_of(cfg):
    return cfg.out_dir or f"runs/{cfg.preset}-{cfg.residual}"


def check_config(cfg):
    """One clear ValueError for a bad value; the model fields are checked by GPTConfig itself."""
    for name in ("batch_size", "gradient_accumulation_steps", "eval_interval", "eval_iters", "log_interval",
                 "ckpt_interval"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    for name in ("max_iters", "warmup_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{flag(name)} must not be negative, got {getattr(cfg, name)}")
    if cfg.device != "auto":
        try:
            torch.device(cfg.device)
        except RuntimeError:
            raise ValueError(f"--device {cfg.device!r} is unknown; choose auto, cpu, cuda, cuda:N or mps") from None
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {cfg.dtype!r} is unknown; choose auto, float32, bfloat16 or float16")
    if cfg.init_from in GPT2_MODELS and cfg.block_size > 1024:
        raise ValueError(f"--init-from {cfg.init_from} has 1024 positions; use --block-size 1024 or less")
    if cfg.wandb_run_name is not None and not cfg.wandb_project:
        raise ValueError("--wandb-run-name names a Weights & Biases run: add --wandb-project NAME")
    if cfg.wandb_project:
        import_wandb()  # a missing package is one line now, not after the model is built
    if cfg.eval_only and not cfg.resume and cfg.init_from == "scratch":
        raise ValueError("--eval-only evaluates a trained model: add --resume (out_dir/last.pt) or --init-from PATH")
    model_config(cfg, vocab_size=1)  # GPTConfig checks the model fields


def model_config(cfg, vocab_size):
    return GPTConfig(vocab_size=vocab_size, **{k: getattr(cfg, k) for k in MODEL_FIELDS})


def flag(name):
    return name.replace("_", "-")


# ------------------------------------------------------------------------------------------------
# command line: --field value for every TrainConfig field

def field_help():
    """Each TrainConfig field's one-line comment, read from the source above."""
    src = inspect.getsource(TrainConfig)
    return dict(re.findall(r"^\s+(\w+): [^=]+= .*?  # (.*)$", src, flags=re.M))


def parse_args(argv):
    """['--residual', 'delta', '--max-iters=100', '--no-compile', ...] -> (preset, overrides).
    Raises ValueError naming an unknown option (with the closest match) or a value of the wrong type."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    preset, overrides, argv = None, {}, list(argv)
    while argv:
        arg = argv.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --max-iters 100")
        name, _, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in types
        key = name[3:] if negated else name
        kind = types.get(key)
        if kind is not None and "bool" in str(kind) and not value:  # --flag / --no-flag
            overrides[key] = not negated
            continue
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            hint = f"; did you mean --{flag(close[0])}?" if close else ""
            raise ValueError(f"unknown option --{flag(key)}{hint} (see `python cli.py train --help`)")
        if not value:
            if not argv:
                raise ValueError(f"--{flag(key)} needs a value")
            value = argv.pop(0)
        overrides[key] = convert(key, kind, value)
    preset = overrides.pop("preset", None)
    return preset, overrides


def convert(key, kind, value):
    kind = str(kind)
    if value.lower() == "none" and "Optional" in kind:
        return None
    try:
        if "bool" in kind:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        if "int" in kind:
            return int(value)
        if "float" in kind:
            return float(value)
        return value
    except ValueError:
        expected = "true or false" if "bool" in kind else "an integer" if "int" in kind else "a number"
        raise ValueError(f"--{flag(key)} expects {expected}, got {value!r}") from None


# ------------------------------------------------------------------------------------------------
# checkpoints: plain dicts, written atomically, read with weights_only=True

def save_checkpoint(obj, path):
    """torch.save to a temporary file in the same folder, then rename: a crash leaves the old file whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path, map_location="cpu", mmap=False):
    """A checkpoint dict, or one clear TrainError/FileNotFoundError saying what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated, corrupt, or pickled objects weights_only refuses
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise TrainError(f"checkpoint {path} is unreadable (truncated, corrupt or not a delta-gpt checkpoint: "
                         f"{reason}); use another checkpoint or train again") from None
    if not isinstance(ckpt, dict) or not {"model", "model_config", "config"} <= set(ckpt):
        raise TrainError(f"{path} is not a delta-gpt checkpoint (it lacks model, model_config and config)")
    return ckpt


def model_from_checkpoint(ckpt, **override):
    """The GPT stored in a checkpoint (nanoGPT's `_orig_mod.` prefixes stripped). `override` may change
    config fields such as residual; when the routing changes, routing weights start at zero init."""
    config = GPTConfig(**{**ckpt["model_config"], **override})
    model = GPT(config)
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    if any(getattr(config, k) != ckpt["model_config"].get(k) for k in ROUTE_FIELDS):
        state = {k: v for k, v in state.items() if not is_routing_key(k)}  # new routing starts at zero init
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not is_routing_key(k)] + list(unexpected)
    if bad:
        raise TrainError(f"checkpoint weights do not fit the model: {', '.join(bad[:4])} ...; "
                         f"is it a delta-gpt checkpoint of this architecture?")
    return model


def arch_diff(old, new, keys=ARCH_FIELDS):
    """The architecture fields whose values differ between two model-config dicts, for messages."""
    return [f"{k} ({old.get(k)!r} in the checkpoint, {new.get(k)!r} now)" for k in keys if old.get(k) != new.get(k)]


# ------------------------------------------------------------------------------------------------
# data

def batch_starts(arr, block_size, count, key):
    """`count` window starts in arr, drawn by a generator seeded with `key` (a tuple of ints)."""
    return np.random.default_rng(key).integers(0, len(arr) - block_size, size=count)


def get_batch(arr, block_size, starts, device):
    """The windows of arr at `starts`: inputs x and next-token targets y, (B, T) each."""
    x = torch.from_numpy(np.stack([arr[i:i + block_size] for i in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([arr[i + 1:i + 1 + block_size] for i in starts]).astype(np.int64))
    if device.type == "cuda":  # pin arrays x,y, which allows us to move them to GPU asynchronously
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def open_dataset(cfg):
    """The run's dataset, checked against the context; the default dataset is prepared when missing."""
    kw = {"data_dir": cfg.data_dir} if cfg.data_dir else {}
    try:
        return data.load(cfg.dataset, block_size=cfg.block_size, **kw)
    except data.DataError:
        path = Path(cfg.data_dir or data.DEFAULT_DATA_DIR) / cfg.dataset
        if cfg.dataset != "shakespeare_char" or path.exists():
            raise
    print(f"preparing {cfg.dataset} (first use)")
    data.prepare(cfg.dataset, **kw)
    return data.load(cfg.dataset, block_size=cfg.block_size, **kw)


def derive_seed(*key):
    """A 63-bit seed from a tuple of ints (numpy's SeedSequence mixes them)."""
    return int(np.random.SeedSequence(key).generate_state(2, np.uint64)[0] >> np.uint64(1))


def eval_batch(ds, split, k, batch_size, block_size, device):
    """Evaluation batch k of a split: the same for every evaluation of every run, whatever the seed."""
    arr = ds.val if split == "val" else ds.train
    key = (EVAL_SEED, 1, int(split == "val"), k)  # four numbers: never a training step's key (seed, 0, step)
    return get_batch(arr, block_size, batch_starts(arr, block_size, batch_size, key), device)


@torch.no_grad()
def estimate_loss(model, ds, split, eval_iters, batch_size, ctx=contextlib.nullcontext(), progress=False):
    """Mean loss of `model` (in eval mode) over the fixed evaluation batches of a split."""
    device, training = next(model.parameters()).device, model.training
    model.eval()
    losses = []
    for k in tqdm(range(eval_iters), desc=f"{split} loss", disable=not progress, leave=False):
        X, Y = eval_batch(ds, split, k, batch_size, model.config.block_size, device)
        with ctx:
            losses.append(model(X, Y)[1].item())
    model.train(training)
    return sum(losses) / len(losses)


@torch.no_grad()
def routing_stats(model, ds, n_batches, batch_size, ctx=contextlib.nullcontext()):
    """The model's routing statistics on the first n fixed validation batches (stacked into one)."""
    device, training = next(model.parameters()).device, model.training
    model.eval()
    X = torch.cat([eval_batch(ds, "val", k, batch_size, model.config.block_size, device)[0] for k in range(n_batches)])
    with ctx:
        stats = model.routing_stats(X)
    model.train(training)
    return stats


def get_lr(it, cfg):
    """Linear warmup, then cosine decay from learning_rate to min_lr over lr_decay_iters steps."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > decay_iters:
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) # coeff ranges 0..1
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


# ------------------------------------------------------------------------------------------------
# the run

def pick_device(cfg):
    if cfg.device != "auto":
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {cfg.device} asks for CUDA, which this machine does not have; use --device cpu")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"--device {cfg.device} asks for MPS, which this machine does not have; use --device cpu")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(cfg, device):
    if cfg.dtype != "auto":
        return cfg.dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def keep_freed_memory():
    """Have the C library's malloc keep freed memory for the next step instead of handing it back to the OS.

    By default glibc serves large blocks with mmap and unmaps them when freed, and trims free memory at
    the top of its heap; each training step on the CPU then page-faults its activations and gradients
    back in, and the kernel zeroes every page: a large share of a step on a small CPU, and a larger one
    for the routed modes, whose reads and gradients are more blocks of the same sizes (README, Speed).
    With mmap off and trimming at 2 GiB, freed memory is reused as PyTorch's CUDA caching allocator
    reuses it, and the process keeps its peak size. Process-wide, for CPU training and the benchmark;
    glibc (Linux) only. Returns whether it took effect."""
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to ask, or one without mallopt
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def git_commit():
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop writes a checkpoint at the next step and exits cleanly.
    A second signal falls back to the default behaviour."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {}
        if threading_main():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def threading_main():
    import threading
    return threading.current_thread() is threading.main_thread()


def train(cfg):
    """Run training as configured; returns a summary dict (rank 0) with the final losses and timings.
    Raises ValueError / DataError for bad input and TrainError when the run cannot go on."""
    check_config(cfg)
    ddp = int(os.environ.get("RANK", -1)) != -1 # is this a ddp run?
    if ddp:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = pick_device(cfg)
        if device.type == "cuda":  # one GPU per process
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        if rank == 0:
            open_dataset(cfg)  # prepares the default dataset once, before the other ranks read it
        torch.distributed.barrier()
    else:
        rank, world_size, device = 0, 1, pick_device(cfg)
    try:
        return _train(cfg, rank, world_size, device)
    finally:
        if ddp:
            destroy_process_group()


def _train(cfg, rank, world_size, device):
    master = rank == 0 # this process will do logging, checkpointing etc.
    out_dir = Path(out_dir_of(cfg))
    cfg = replace(cfg, out_dir=str(out_dir))
    ckpt_path = out_dir / "last.pt"
    ckpt = None
    if cfg.resume:
        ckpt = load_checkpoint(ckpt_path, map_location=device)
        changed = {k: (v, getattr(cfg, k)) for k, v in ckpt["config"].items()
                   if hasattr(cfg, k) and getattr(cfg, k) != v and k != "resume"}
        if master and changed:
            print("resuming with changed settings: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    elif ckpt_path.exists() and not cfg.overwrite and not cfg.eval_only:
        raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it, --overwrite to start "
                         f"over, or another --out-dir")
    elif cfg.overwrite and master and not cfg.eval_only:  # the old run's checkpoints must not be resumed by mistake
        for old in ("last.pt", "best.pt"):
            (out_dir / old).unlink(missing_ok=True)
    if cfg.gradient_accumulation_steps % world_size:
        raise ValueError(f"--gradient-accumulation-steps {cfg.gradient_accumulation_steps} must be a multiple "
                         f"of the number of processes {world_size}")
    accum = cfg.gradient_accumulation_steps // world_size  # micro-steps per rank
    tokens_per_iter = accum * world_size * cfg.batch_size * cfg.block_size
    torch.manual_seed(cfg.seed + rank)
    if device.type == "cpu":
        keep_freed_memory()  # no page faults on every step's fresh activations
    torch.backends.cuda.matmul.allow_tf32 = True # allow tf32 on matmul
    torch.backends.cudnn.allow_tf32 = True # allow tf32 on cudnn
    dtype = pick_dtype(cfg, device)
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    ctx = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device_type=device.type, dtype=ptdtype)

    ds = open_dataset(cfg)
    meta = ds.meta

    model, iter_num, best_val_loss = build_model(cfg, ckpt, ds)
    # the config records the model actually built (GPT-2 weights bring their own shape)
    cfg = replace(cfg, **{k: getattr(model.config, k) for k in MODEL_FIELDS})
    model.to(device)

    # optimizer and gradient scaler (a no-op unless float16)
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))
    optimizer = quiet(model.configure_optimizers, cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                      device.type, route_lr_mult=cfg.route_lr_mult)
    elapsed = 0.0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        for group in optimizer.param_groups:  # this run's settings, not the saved ones
            group.update(betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay if group["name"] == "decay" else 0.0,
                         lr_mult=cfg.route_lr_mult if group["name"] == "routing" else 1.0)
        if scaler.is_enabled() and ckpt["scaler"]:  # a float32/bf16 run saved a disabled scaler's empty state
            scaler.load_state_dict(ckpt["scaler"])
        restore_rng(ckpt["rng"])
        elapsed = ckpt.get("elapsed", 0.0)
    ckpt = None # free up memory

    raw_model = model
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    if use_compile:
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    record = RunRecord(out_dir, master and not cfg.eval_only, resume_step=iter_num if cfg.resume else None)
    if master and not cfg.eval_only:
        record.write_config(cfg, raw_model, meta, world_size, device, dtype)
        if cfg.resume and changed:
            record.log(kind="resume", step=iter_num, changed={k: list(v) for k, v in changed.items()})
        print(f"{cfg.residual}: {raw_model.get_num_params():,} parameters, {tokens_per_iter:,} tokens per step, "
              f"{device} {dtype}{' compiled' if use_compile else ''}, run directory {out_dir}")

    def evaluate():
        """Mean loss over the fixed eval batches of each split, and routing statistics on the first val batch."""
        out = {split: estimate_loss(raw_model, ds, split, cfg.eval_iters, cfg.batch_size, ctx)
               for split in ("train", "val")}
        if cfg.residual != "baseline":
            out["routing"] = routing_stats(raw_model, ds, 1, cfg.batch_size, ctx)
        return out

    saved_step = iter_num if cfg.resume else None  # the step last.pt holds, for messages

    def checkpoint(path, step):
        save_checkpoint(dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                             model_config=asdict(raw_model.config), config=asdict(cfg), iter_num=step,
                             best_val_loss=best_val_loss, rng=rng_state(), dataset=dataset_info(meta, cfg.dataset),
                             elapsed=elapsed + time.time() - t_start, commit=record.commit), path)

    t_start = time.time() - elapsed  # wall time counts on across resumes
    if cfg.eval_only:
        losses = evaluate() if master else {}
        if master:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        return dict(val_loss=losses.get("val"), train_loss=losses.get("train"), iter_num=iter_num)

    model.train()
    bar = tqdm(total=cfg.max_iters, initial=iter_num, disable=not (master and cfg.progress), dynamic_ncols=True,
               desc=cfg.residual)
    t_last, last_loss, tok_s, stopped = time.time(), float("nan"), None, None
    val_loss = None
    with StopFlag() as stop:
        while True:
            # evaluate, keep the best and the latest checkpoints
            final = iter_num >= cfg.max_iters
            fresh = iter_num > record.start_step or not cfg.resume  # a checkpoint's step was evaluated before it was saved
            if master and fresh and (iter_num % cfg.eval_interval == 0 or final):
                losses = evaluate()
                val_loss = losses["val"]
                record.log(kind="eval", step=iter_num, train_loss=losses["train"], val_loss=losses["val"],
                           elapsed=time.time() - t_start, routing=losses.get("routing"))
                bar.write(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                          + (f", routing max weight {losses['routing']['mean_max_weight']:.3f}" if "routing" in losses else ""))
                if losses["val"] < best_val_loss:
                    best_val_loss = losses["val"]
                    if iter_num > 0:
                        checkpoint(out_dir / "best.pt", iter_num)
            due = iter_num % cfg.ckpt_interval == 0 or final
            if master and (due and iter_num > record.start_step or final and saved_step is None):
                checkpoint(ckpt_path, iter_num)
                saved_step = iter_num
            if final:
                break

            # one optimizer step: accum micro-steps per rank, gradients synced on the last one only
            lr = get_lr(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group["lr_mult"]
            torch.manual_seed(derive_seed(cfg.seed, 2, iter_num, rank))  # dropout: exact on resume, any world size
            loss_sum = torch.zeros((), device=device)
            # the step's global batch; rank r's micro-step m takes its slice r * accum + m
            starts = batch_starts(ds.train, cfg.block_size, cfg.batch_size * accum * world_size, (cfg.seed, 0, iter_num))
            for micro in range(accum):
                part = (rank * accum + micro) * cfg.batch_size
                X, Y = get_batch(ds.train, cfg.block_size, starts[part:part + cfg.batch_size], device)
                sync = contextlib.nullcontext() if world_size == 1 or micro == accum - 1 else model.no_sync()
                with sync:
                    with ctx:
                        _, loss = model(X, Y)
                    loss_sum += loss.detach()
                    scaler.scale(loss / accum).backward()
            # the mean loss over micro-steps and ranks, and whether any rank was signalled to stop
            stats = torch.stack([loss_sum / accum, torch.tensor(float(stop.signal is not None), device=device)])
            if world_size > 1:
                torch.distributed.all_reduce(stats)
                stats[0] /= world_size
            step_loss, stop_now = stats[0].item(), stats[1].item() > 0
            if stop_now:  # this step's gradients are dropped: the checkpoint resumes by redoing it
                optimizer.zero_grad(set_to_none=True)
                if master:
                    checkpoint(ckpt_path, iter_num)
                stopped = f"stopped by signal at step {iter_num}; checkpoint {ckpt_path} written (continue with --resume)"
                break
            kept = (f"{ckpt_path} still holds step {saved_step}" if saved_step is not None
                    else "no checkpoint was written yet")
            if not math.isfinite(step_loss):
                raise TrainError(f"loss is {step_loss} at step {iter_num}; stopped without applying it, {kept} "
                                 f"(lower --learning-rate or check the data)")
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf")).item()
            if not math.isfinite(grad_norm) and not scaler.is_enabled():  # fp16's scaler skips such steps itself
                raise TrainError(f"gradient norm is {grad_norm} at step {iter_num} (loss {step_loss:.4f}); stopped "
                                 f"without applying it, {kept} (lower --learning-rate or check the data)")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

            # timing and logging
            iter_num += 1
            t_now = time.time()
            dt, t_last = t_now - t_last, t_now
            tok_s, last_loss = tokens_per_iter / dt, step_loss
            if master:
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum, dt, device)
                postfix = dict(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                if mfu is not None:
                    postfix["mfu"] = f"{mfu * 100:.1f}%"
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
                if iter_num % cfg.log_interval == 0:
                    record.log(kind="train", step=iter_num, train_loss=step_loss, lr=lr, tokens_per_s=tok_s,
                               elapsed=t_now - t_start, **({"mfu": mfu} if mfu is not None else {}))
    bar.close()
    record.finish()
    if stopped:
        if master:
            print(stopped)
        raise KeyboardInterrupt(stopped)
    return dict(val_loss=val_loss, best_val_loss=best_val_loss, train_loss=last_loss, iter_num=iter_num,
                elapsed=time.time() - t_start, tokens_per_s=tok_s, out_dir=str(out_dir),
                params=raw_model.get_num_params())


def build_model(cfg, ckpt, ds):
    """The model to train, with the step to start at and the best val loss so far: from the resume
    checkpoint, from scratch, from GPT-2 weights, or from a (baseline) checkpoint with zero-init routing."""
    meta = ds.meta
    if ckpt is not None:
        wanted = asdict(model_config(cfg, ckpt["model_config"]["vocab_size"]))
        diff = arch_diff(ckpt["model_config"], wanted)
        if diff:
            raise ValueError(f"cannot resume {cfg.out_dir}/last.pt with a different architecture: {'; '.join(diff)}")
        check_tokenizer(ckpt, meta, f"{cfg.out_dir}/last.pt")
        return model_from_checkpoint(ckpt, dropout=cfg.dropout), ckpt["iter_num"], ckpt["best_val_loss"]
    route = {k: getattr(cfg, k) for k in ROUTE_FIELDS + ("dropout",)}
    if cfg.init_from == "scratch":
        vocab_size = 50304 if ds.tokenizer.name == "gpt2" else ds.vocab_size  # GPT-2's padded to a multiple of 64
        model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from in GPT2_MODELS:
        if ds.tokenizer.name != "gpt2":
            raise ValueError(f"--init-from {cfg.init_from} needs a GPT-2 BPE dataset; {cfg.dataset} is {ds.tokenizer.name}")
        model = GPT.from_pretrained(cfg.init_from, route)
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
    else:
        src = load_checkpoint(cfg.init_from)
        check_tokenizer(src, meta, cfg.init_from)
        wanted = asdict(model_config(cfg, src["model_config"]["vocab_size"]))
        diff = arch_diff(src["model_config"], wanted, [k for k in ARCH_FIELDS if k not in ROUTE_FIELDS])
        if diff:
            raise ValueError(f"--init-from {cfg.init_from} has a different architecture: {'; '.join(diff)}")
        model = model_from_checkpoint(src, **route)
    return model, 0, float("inf")


def quiet(fn, *args, **kwargs):
    """Call fn with its stdout swallowed (configure_optimizers prints nanoGPT's parameter counts)."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return fn(*args, **kwargs)


def check_tokenizer(ckpt, meta, path):
    """A checkpoint's dataset tokenizer must match the run's dataset (same ids for the same text)."""
    saved = ckpt.get("dataset") or {}
    if saved.get("tokenizer") != meta.get("tokenizer") or saved.get("chars") != meta.get("chars"):
        raise ValueError(f"{path} was trained with a different tokenizer or vocabulary ({saved.get('name')}, "
                         f"{saved.get('tokenizer')}) than this dataset ({meta.get('tokenizer')}); "
                         f"use a dataset with the same tokenizer")


def dataset_info(meta, name):
    """What sample and report need to decode without the dataset: name, tokenizer, vocabulary."""
    return dict(name=name, tokenizer=meta.get("tokenizer"), vocab_size=meta.get("vocab_size"), chars=meta.get("chars"))


def rng_state():
    """The RNG states, saved in checkpoints. (Dropout is reseeded from (seed, step, rank) every step, so
    resuming is exact without them; they are restored for anything else that draws random numbers.)"""
    state = dict(torch=torch.get_rng_state())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state):
    torch.set_rng_state(state["torch"].cpu())  # RNG states must be CPU byte tensors, wherever the checkpoint was mapped
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


class RunRecord:
    """The run directory's metrics.jsonl (one JSON object per line) and config.json."""

    def __init__(self, out_dir, master, resume_step=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.master = master
        self.wandb = None  # the Weights & Biases run, with --wandb-project (rank 0)
        self.start_step = resume_step or 0
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

    def write_config(self, cfg, model, meta, world_size, device, dtype):
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
            with open(self.path, "a") as f:
                f.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
            if self.wandb is not None and (numbers := wandb_numbers(row)):
                self.wandb.log(numbers, step=row["step"])

    def finish(self):
        """End the W&B run (metrics.jsonl needs nothing)."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def import_wandb():
    """The wandb module, or one clear error saying how to get it."""
    try:
        import wandb
    except ImportError:
        raise ValueError("--wandb-project needs the wandb package, which is not installed: pip install wandb==0.31.0 "
                         "(requirements.txt's pin), or leave --wandb-project out (metrics.jsonl is written either way)") from None
    return wandb


def wandb_numbers(row):
    """A metrics.jsonl row as W&B metrics: each number under KIND/NAME (nested dicts joined by '/',
    lists such as the per-sublayer routing statistics left out), e.g. train/train_loss, eval/val_loss."""
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
    """One metrics.jsonl line as a dict, or None for a blank or torn (half-written) line."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(out_dir):
    """The rows of a run's metrics.jsonl."""
    path = Path(out_dir) / "metrics.jsonl"
    return [row for l in path.read_text().splitlines() if (row := parse_row(l))] if path.exists() else []


def main(argv=None):
    """Parse options, train, and turn bad input into one line and exit status 1 (130 when interrupted)."""
    try:
        preset, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = resume_config(preset, **overrides) if overrides.get("resume") else make_config(preset, **overrides)
        train(cfg)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, FileNotFoundError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
