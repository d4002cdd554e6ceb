"""
Training script for delta-gpt: one process on CPU, CUDA or MPS, or several launched with torchrun,
with DDP (each holds the whole model) or FSDP2 (--fsdp: parameters, gradients and optimizer state sharded).

    python train.py --residual delta                          # the `cpu` preset where there is no CUDA
    python train.py --preset shakespeare_char --residual attnres --max-iters 2000
    python train.py --out-dir runs/cpu-delta --resume --max-iters 4000   # continue, bit-exact on CPU
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2_124m --residual delta
    torchrun --standalone --nproc_per_node=8 train.py --preset paper_1b --residual delta --fsdp
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 train.py --preset paper_220m --residual delta   # node 0 of 2

`python cli.py train ...` takes the same options. Every TrainConfig field is an option (--max-iters or
--max_iters; --compile / --no-compile for flags); unknown options and wrong types are refused.

Each step draws its global batch from (seed, step) and rank r's micro-step m takes slice r * accum + m,
so a resumed run sees exactly the batches it would have seen, and 2 ranks with 1 micro-step, 1 rank with
2 micro-steps and 1 rank with a double batch all train on the same data. Evaluation always uses the
same fixed batches, so curves compare across runs, seeds and modes.

The file reads top-down: options, checkpoints, data, then the run (setup, the loop and its steps).
"""
import contextlib
import ctypes
import difflib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
import report
from delta_gpt import GPT, GPT2_MODELS, GPTConfig, RESIDUALS, ROUTING_FIELDS, is_routing_key
from errors import DeltaGPTError

ROUTED_MODES = tuple(m for m in RESIDUALS if m != "baseline")
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "config.json")  # what a run writes in its directory
EVAL_SEED = 20260518  # seeds the fixed evaluation batches, the same whatever the training seed


class ConfigError(DeltaGPTError):
    """An option value that cannot be used, or options that do not go together."""


class TrainError(DeltaGPTError):
    """A run that cannot go on (non-finite loss, unusable checkpoint, busy run directory)."""


# ------------------------------------------------------------------------------------------------
# options: every TrainConfig field is a command-line option; its help text lives beside it

def option(default, help):
    """A TrainConfig field with its one-line help (both command lines show it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    preset: str = option("cpu", "the preset these values started from (recorded; --preset chooses it)")
    out_dir: Optional[str] = option(None, "run directory for checkpoints and metrics (default runs/PRESET-RESIDUAL)")
    dataset: str = option("shakespeare_char", "a prepared dataset under data_dir (see `python cli.py prepare`)")
    data_dir: Optional[str] = option(None, "where datasets live (default: the data/ folder)")
    # model
    residual: str = option("baseline", "baseline | attnres | delta | delta_block")
    n_layer: int = option(4, "transformer layers (2 sublayers each)")
    n_head: int = option(4, "attention heads")
    n_embd: int = option(128, "model width")
    block_size: int = option(64, "context length in tokens")
    dropout: float = option(0.0, "dropout in attention, residual and embeddings")
    bias: bool = option(False, "bias in Linear and LayerNorm layers")
    n_route_blocks: Optional[int] = option(None, "routing blocks N (must divide 2*n_layer; default per mode)")
    route_partial: Optional[bool] = option(None, "also route the current block's partial sum (delta_block)")
    route_sources: Optional[str] = option(None, "delta (block sums) or cumulative (stream snapshots)")
    fast_routing: bool = option(True, "the fused routing path (same numbers as the plain one; off: the plain path)")
    init_from: str = option("scratch", "scratch, a baseline checkpoint path, or gpt2 / gpt2-medium / ...")
    # optimisation
    batch_size: int = option(12, "sequences per micro-step per rank")
    gradient_accumulation_steps: int = option(1, "micro-steps per step, over all ranks (divided among them)")
    max_iters: int = option(2000, "total optimizer steps")
    learning_rate: float = option(1e-3, "peak learning rate")
    min_lr: float = option(1e-4, "final learning rate of the cosine decay")
    warmup_iters: int = option(100, "linear warmup steps")
    lr_decay_iters: Optional[int] = option(None, "cosine decay length in steps (default max_iters)")
    decay_lr: bool = option(True, "warmup + cosine decay; off: constant learning_rate")
    weight_decay: float = option(0.1, "AdamW weight decay of 2-D weights")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip gradients at this global norm; 0 disables")
    route_lr_mult: float = option(1.0, "learning-rate multiplier of the routing queries and gains")
    seed: int = option(1337, "seeds batches, dropout and init")
    # evaluation, logging, checkpoints
    eval_interval: int = option(250, "evaluate every this many steps")
    eval_iters: int = option(20, "fixed batches per evaluation")
    log_interval: int = option(10, "write a metrics line (and, without a terminal, a progress line) every this many steps")
    ckpt_interval: int = option(250, "write last.pt every this many steps")
    eval_only: bool = option(False, "evaluate once and exit")
    resume: bool = option(False, "continue from out_dir/last.pt")
    overwrite: bool = option(False, "start afresh even if out_dir holds a run (its checkpoints are deleted)")
    progress: bool = option(True, "show a progress bar (a plain line every log_interval steps without a terminal)")
    # system
    device: str = option("auto", "auto (cuda, then mps, then cpu), or cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (bfloat16 on CUDA where supported, else float16; float32 on CPU/MPS), "
                                "float32, bfloat16, float16")
    compile: Optional[bool] = option(None, "torch.compile the model (default: on for CUDA, off elsewhere)")
    threads: Optional[int] = option(None, "CPU threads for torch (default: the free cores, so a busy machine gets fewer)")
    keep_freed_memory: bool = option(True, "CPU: malloc keeps freed memory for the next step (no page faults each step)")
    fsdp: bool = option(False, "shard parameters, gradients and optimizer state over the processes with FSDP2")
    activation_checkpointing: bool = option(False, "recompute each attention and MLP in backward (less activation memory)")
    wandb_project: Optional[str] = option(None, "also log the metrics to this Weights & Biases project (needs the wandb package)")
    wandb_run_name: Optional[str] = option(None, "the W&B run's name (default: the run directory's name)")


MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name != "vocab_size")  # the TrainConfig fields that build GPTConfig
ROUTE_FIELDS = ("residual", *ROUTING_FIELDS)  # --init-from may change these
ARCH_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name not in ("dropout", "fast_routing"))  # fixed once trained
BOOKKEEPING_FIELDS = ("out_dir", "resume", "overwrite", "progress", "eval_only", "threads", "keep_freed_memory",
                      "log_interval", "ckpt_interval", "wandb_project", "wandb_run_name")  # change no number of a run

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
    """TrainConfig from a named preset plus field overrides; bad names and values raise ConfigError."""
    cfg = preset_config(preset, **overrides)
    check_config(cfg)
    return cfg


def preset_config(preset=None, **overrides):
    """make_config's TrainConfig before its values are checked (unknown names and presets are refused)."""
    preset = preset or default_preset()
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"unknown TrainConfig field(s) {', '.join(sorted(unknown))}")
    if overrides.get("resume") and overrides.get("init_from", "scratch") != "scratch":
        raise ConfigError("--resume continues out_dir/last.pt; it cannot be combined with --init-from")
    return replace(TrainConfig(), **{**PRESETS[preset], **overrides, "preset": preset})


def resume_config(preset=None, **overrides):
    """The config of the run in out_dir (from its last.pt) with `overrides` on top, for --resume.
    The architecture may not change (refused, naming the options given and the run's values); other changes
    are logged. Values are checked against the run's settings, not a preset's."""
    out_dir = out_dir_of(preset_config(preset, **{**overrides, "resume": True}))
    ckpt = load_checkpoint(Path(out_dir) / "last.pt", mmap=True)
    names = {f.name for f in fields(TrainConfig)}
    saved = replace(TrainConfig(), **{k: v for k, v in ckpt["config"].items() if k in names})
    if preset is not None and preset != saved.preset:
        raise ConfigError(f"--preset {preset} differs from the run's preset {saved.preset}; a resumed run keeps its preset")
    has = model_config(saved, vocab_size=1)  # the run's architecture, each mode's defaults filled in
    changed = [f"--{flag(k)} {v} (the run has {getattr(has, k) if getattr(has, k) is not None else 'none'})"
               for k, v in overrides.items() if k in ARCH_FIELDS and v != getattr(has, k)]
    if changed:
        raise ConfigError(f"cannot resume {out_dir} with another architecture: {'; '.join(changed)}; "
                          f"leave these out, or train a new run in another --out-dir")
    # the saved init_from only records where the run began: its weights now come from last.pt
    cfg = replace(saved, **{**overrides, "resume": True})
    check_config(cfg)
    return cfg


def out_dir_of(cfg):
    return cfg.out_dir or f"runs/{cfg.preset}-{cfg.residual}"


def at_least_one(**options):
    """ConfigError naming the first option (by its field name) whose value is below 1."""
    for name, value in options.items():
        if value < 1:
            raise ConfigError(f"--{flag(name)} must be at least 1, got {value}")


def check_config(cfg):
    """One clear ConfigError for a bad value or combination; GPTConfig checks the model fields."""
    at_least_one(**{name: getattr(cfg, name) for name in ("batch_size", "gradient_accumulation_steps",
                                                          "eval_interval", "eval_iters", "log_interval", "ckpt_interval")})
    for name in ("max_iters", "warmup_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{flag(name)} must not be negative, got {getattr(cfg, name)}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {cfg.threads}")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in out_dir and --overwrite deletes it; give one of them")
    if cfg.device != "auto":
        try:
            torch.device(cfg.device)
        except RuntimeError:
            raise ConfigError(f"--device {cfg.device!r} is unknown; choose auto, cpu, cuda, cuda:N or mps") from None
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {cfg.dtype!r} is unknown; choose auto, float32, bfloat16 or float16")
    if cfg.fsdp:
        check_fsdp(cfg)
    if cfg.init_from in GPT2_MODELS and cfg.block_size > 1024:
        raise ConfigError(f"--init-from {cfg.init_from} has 1024 positions; use --block-size 1024 or less")
    if cfg.wandb_run_name is not None and not cfg.wandb_project:
        raise ConfigError("--wandb-run-name names a Weights & Biases run: add --wandb-project NAME")
    if cfg.wandb_project:
        import_wandb()  # a missing package is one line now, not after the model is built
    if cfg.eval_only and not cfg.resume and cfg.init_from == "scratch":
        raise ConfigError("--eval-only evaluates a trained model: add --resume (out_dir/last.pt) or --init-from PATH")
    model_config(cfg, vocab_size=1)  # GPTConfig checks the model fields


def gpt_config(**fields_):
    """GPTConfig(**fields_), its ValueError for a bad field turned into a ConfigError."""
    try:
        return GPTConfig(**fields_)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def model_config(cfg, vocab_size):
    return gpt_config(vocab_size=vocab_size, **{k: getattr(cfg, k) for k in MODEL_FIELDS})


def flag(name):
    return name.replace("_", "-")


def parse_args(argv):
    """['--residual', 'delta', '--max-iters=100', '--no-compile', ...] -> (preset, overrides).
    Raises ConfigError naming an unknown option (with the closest match) or a value of the wrong type."""
    types = {f.name: str(f.type) for f in fields(TrainConfig)}
    overrides, argv = {}, list(argv)
    while argv:
        arg = argv.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --max-iters 100")
        name, _, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in types
        key = name[3:] if negated else name
        kind = types.get(key)
        if kind is not None and "bool" in kind and not value:  # --flag / --no-flag, or --flag true
            if not negated and argv and argv[0].lower() in ("true", "false", "1", "0", "yes", "no"):
                value = argv.pop(0)
            else:
                overrides[key] = not negated
                continue
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            hint = f"; did you mean --{flag(close[0])}?" if close else ""
            raise ConfigError(f"unknown option --{flag(key)}{hint} (see `python cli.py train --help`)")
        if not value:
            if not argv:
                raise ConfigError(f"--{flag(key)} needs a value")
            value = argv.pop(0)
        overrides[key] = convert(key, kind, value)
    return overrides.pop("preset", None), overrides


def options_help():
    """Every TrainConfig field as an option with its help and the cpu preset's value (`--help`)."""
    defaults = TrainConfig()
    lines = [f"  --{flag(f.name):<27} {f.metadata['help']} [cpu: {getattr(defaults, f.name)}]" for f in fields(TrainConfig)]
    return ("Training options: any TrainConfig field, as --field VALUE, --field=VALUE or --flag / --no-flag.\n\n"
            "\b\n" + "\n".join(lines) + f"\n\nPresets: {', '.join(PRESETS)} (default: cpu without CUDA, "
            "shakespeare_char with it).")


def convert(key, kind, value):
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
        raise ConfigError(f"--{flag(key)} expects {expected}, got {value!r}") from None


def config_from_args(argv):
    """The TrainConfig a command line asks for: a fresh run, or with --resume the run in out_dir."""
    preset, overrides = parse_args(argv)
    return resume_config(preset, **overrides) if overrides.get("resume") else make_config(preset, **overrides)


# ------------------------------------------------------------------------------------------------
# checkpoints: plain dicts, written atomically, read with weights_only=True

def save_checkpoint(obj, path):
    """torch.save to a temporary file in the same folder, then rename: a crash leaves the old file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
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
    """A checkpoint dict, or one clear TrainError saying what is wrong with the file."""
    path = Path(path)
    if path.is_dir():
        raise TrainError(f"{path} is a folder, not a checkpoint file; give a file such as {path / 'last.pt'}")
    if not path.is_file():
        raise TrainError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated, corrupt, or pickled objects weights_only refuses
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise TrainError(f"checkpoint {path} is unreadable (truncated, corrupt or not a delta-gpt checkpoint: "
                         f"{reason}); use another checkpoint or train again") from None
    if not isinstance(ckpt, dict) or not {"model", "model_config", "config"} <= set(ckpt):
        raise TrainError(f"{path} is not a delta-gpt checkpoint (it lacks model, model_config and config)")
    return ckpt


def checkpoint_dict(model_state, model_config_, config, iter_num, best_val_loss, dataset, **extra):
    """The one layout of a checkpoint: weights, the model's GPTConfig and the run's TrainConfig (as a dict),
    step, best val loss, dataset info; training adds optimizer, scaler, rng, elapsed and commit, convert
    adds converted_from."""
    return dict(model=model_state, model_config=asdict(model_config_), config=config, iter_num=iter_num,
                best_val_loss=best_val_loss, dataset=dataset, **extra)


def routing_changed(saved, config):
    """Whether GPTConfig `config` routes otherwise than the checkpoint's model config `saved`: then the
    checkpoint's routing weights do not apply and routing starts at zero init."""
    return any(getattr(config, k) != saved.get(k) for k in ROUTE_FIELDS)


def model_from_checkpoint(ckpt, **override):
    """The GPT stored in a checkpoint (nanoGPT's `_orig_mod.` prefixes stripped). `override` may change
    config fields such as residual; when the routing changes, routing weights start at zero init."""
    config = gpt_config(**{**ckpt["model_config"], **override})
    model = GPT(config)
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    if routing_changed(ckpt["model_config"], config):
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


def check_tokenizer(ckpt, meta, path):
    """A checkpoint's dataset tokenizer must match the run's dataset (same ids for the same text)."""
    saved = ckpt.get("dataset") or {}
    if saved.get("tokenizer") != meta.get("tokenizer"):
        raise ConfigError(f"{path} was trained with the {saved.get('tokenizer')} tokenizer (dataset "
                          f"{saved.get('name')}), and this dataset uses {meta.get('tokenizer')}; use a dataset with "
                          f"the same tokenizer")
    if saved.get("chars") != meta.get("chars"):
        raise ConfigError(f"{path} was trained on the {len(saved.get('chars') or '')} characters of dataset "
                          f"{saved.get('name')}, and this dataset's {len(meta.get('chars') or '')} characters are not "
                          f"the same; use the dataset it was trained on, or one with the same characters")


def dataset_info(meta, name):
    """What sample and report need to decode without the dataset: name, tokenizer, vocabulary."""
    return dict(name=name, tokenizer=meta.get("tokenizer"), vocab_size=meta.get("vocab_size"), chars=meta.get("chars"))


def check_same_data(out_dir, meta, way_out):
    """Refuse to go on with the run in out_dir when its dataset has been prepared again from other text since
    the run began: its config.json records the content hash of the data it trained on."""
    try:
        then = json.loads((Path(out_dir) / "config.json").read_text())["dataset"].get("content_hash")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no record (or an unreadable one)
        return
    if then and meta.get("content_hash") and then != meta["content_hash"]:
        raise ConfigError(f"{out_dir} holds a run trained on dataset {meta.get('name')} as it was before it was "
                          f"prepared again from other text (its content hash differs); {way_out}")


def check_folder(folder, option):
    """Refuse a folder that is a file or lies under one (before anything is computed, not when writing)."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"{option} {folder}: {existing} is a file, not a folder; choose another {option}")


def refuse_to_replace(out, force, inputs=()):
    """Refuse to write `out` over one of `inputs` (always) or over any existing file (unless force), or
    under a file."""
    out = Path(out)
    check_folder(out.parent, "--out")
    if any(Path(p).exists() and out.exists() and out.samefile(p) for p in inputs):
        raise ConfigError(f"--out {out} is the input checkpoint itself; write the result to another path")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file path such as {out / 'converted.pt'}")
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it, or choose another --out")


def convert_checkpoint(src, out, residual, n_route_blocks=None, route_partial=None, eval_iters=20, batch_size=12,
                       data_dir=None, force=False):
    """A routed checkpoint at `out` from the baseline checkpoint `src`, routing at zero init.
    Returns (val loss before, val loss after, the routed model's config)."""
    at_least_one(eval_iters=eval_iters, batch_size=batch_size)
    refuse_to_replace(out, force, inputs=[src])
    if residual not in ROUTED_MODES:
        raise ConfigError(f"--residual {residual!r} is not a routed mode; choose {', '.join(ROUTED_MODES)}")
    ckpt = load_checkpoint(src)
    if ckpt["model_config"]["residual"] != "baseline":
        raise ConfigError(f"{src} is already a {ckpt['model_config']['residual']} model; "
                          f"convert starts from a baseline checkpoint")
    route = dict(residual=residual, n_route_blocks=n_route_blocks, route_partial=route_partial)
    base, routed = model_from_checkpoint(ckpt).eval(), model_from_checkpoint(ckpt, **route).eval()
    ds = checkpoint_dataset(ckpt, src, data_dir=data_dir)
    before = estimate_loss(base, ds, "val", eval_iters, batch_size, progress=True)
    after = estimate_loss(routed, ds, "val", eval_iters, batch_size, progress=True)
    config = dict(ckpt["config"], **{k: getattr(routed.config, k) for k in route}, init_from=str(src))
    save_checkpoint(checkpoint_dict(routed.state_dict(), routed.config, config, 0, after, ckpt.get("dataset"),
                                    converted_from=str(src)), out)
    return before, after, routed.config


def checkpoint_dataset(ckpt, ckpt_path, dataset=None, data_dir=None):
    """The checkpoint's dataset (or `dataset`), refused when its tokenizer differs from the checkpoint's."""
    saved = ckpt.get("dataset") or {}
    name = dataset or saved.get("name") or ckpt["config"].get("dataset")
    data_dir = data_dir or ckpt["config"].get("data_dir")
    ds = data.load(name, block_size=ckpt["model_config"]["block_size"], **({"data_dir": data_dir} if data_dir else {}))
    check_tokenizer(ckpt, ds.meta, ckpt_path)
    return ds


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


def prepared_meta(cfg):
    """The meta.json of cfg's dataset as prepared now, or None when it is not prepared (nothing is prepared)."""
    try:
        return data.load(cfg.dataset, **({"data_dir": cfg.data_dir} if cfg.data_dir else {})).meta
    except data.DataError:
        return None


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
    """Mean loss of `model` (in eval mode) over the fixed evaluation batches of a split; with progress, a
    bar on a terminal (none in a log file)."""
    device, training = next(model.parameters()).device, model.training
    model.eval()
    losses = []
    for k in tqdm(range(eval_iters), desc=f"{split} loss", disable=None if progress else True, leave=False):
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
        stats = report.routing_stats(model, X)
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
# the run: setup

def train(cfg):
    """Run training as configured; returns a summary dict (rank 0) with the final losses and timings.
    Raises a DeltaGPTError (ConfigError, DataError, TrainError) for bad input or a run that cannot go on."""
    check_config(cfg)
    with process_group(cfg) as (rank, world_size, device):
        run = start_run(cfg, rank, world_size, device)
        with run.lock:
            try:
                return evaluate_once(run) if cfg.eval_only else train_loop(run)
            finally:
                run.record.finish()


@contextlib.contextmanager
def process_group(cfg):
    """(rank, world_size, device): one process, or one of torchrun's (one GPU each on CUDA)."""
    torchrun = int(os.environ.get("RANK", -1)) != -1
    if not torchrun and not cfg.fsdp:
        yield 0, 1, pick_device(cfg)
        return
    rank, world_size, device = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), pick_device(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if torchrun:
        init_process_group(backend=backend)
    else:  # FSDP in one process: a process group of one, with an in-memory store
        init_process_group(backend=backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        if rank == 0:
            open_dataset(cfg)  # prepares the default dataset once, before the other ranks read it
        torch.distributed.barrier()
        yield rank, world_size, device
        torch.distributed.barrier()  # every rank done (rank 0 may still be writing) before the group goes away
    finally:
        destroy_process_group()


@dataclass
class Run:
    """Everything one training run holds; the loop's helpers read and advance it."""
    cfg: TrainConfig
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module          # what forward runs: compiled and/or wrapped for DDP
    raw_model: GPT                  # the plain GPT: its state_dict, evaluation and statistics
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ctx: contextlib.AbstractContextManager  # autocast, or nothing for float32
    ds: data.Dataset
    record: "RunRecord"
    lock: "RunLock"
    iter_num: int
    best_val_loss: float
    accum: int                      # micro-steps per rank
    saved_step: Optional[int]       # the step last.pt holds (None: not written yet)
    t_start: float = 0.0            # wall-clock origin: elapsed time counts on across resumes

    @property
    def master(self):
        return self.rank == 0

    @property
    def out_dir(self):
        return Path(self.cfg.out_dir)

    @property
    def tokens_per_iter(self):
        return self.accum * self.world_size * self.cfg.batch_size * self.cfg.block_size


def start_run(cfg, rank, world_size, device):
    """Claim the run directory, open the data, build (or restore) the model and optimizer."""
    cfg = replace(cfg, out_dir=out_dir_of(cfg))
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"--gradient-accumulation-steps {cfg.gradient_accumulation_steps} must be a multiple "
                          f"of the number of processes {world_size}")
    check_folder(cfg.out_dir, "--out-dir")
    lock = RunLock(cfg.out_dir, rank == 0 and not cfg.eval_only)
    with lock.held_on_error():
        ckpt, changed = claim_run_dir(cfg, rank == 0)
        torch.manual_seed(cfg.seed + rank)
        dtype, ctx, scaler = precision(cfg, device, rank == 0)
        ds = open_dataset(cfg)
        if cfg.resume:
            check_same_data(cfg.out_dir, ds.meta, "prepare it again from the text the run began on, or start a "
                                                  "new run (--overwrite, or another --out-dir)")
        build = build_sharded if cfg.fsdp else build_local
        model, iter_num, best_val_loss = build(cfg, ckpt, ds, rank, device, dtype)
        cfg = replace(cfg, **{k: getattr(model.config, k) for k in MODEL_FIELDS})  # GPT-2 weights bring their shape
        optimizer, elapsed = make_optimizer(cfg, model, ckpt, scaler, device, rank)
        wrapped = wrap_model(cfg, model, world_size, device)
        record = RunRecord(cfg.out_dir, rank == 0 and not cfg.eval_only, resume_step=iter_num if cfg.resume else None)
    run = Run(cfg, rank, world_size, device, wrapped, model, optimizer, scaler, ctx, ds, record, lock, iter_num,
              best_val_loss, cfg.gradient_accumulation_steps // world_size, iter_num if cfg.resume else None)
    run.t_start = time.time() - elapsed
    if run.master and not cfg.eval_only:
        record.write_config(cfg, model, ds.meta, world_size, device, dtype)
        if changed:
            record.log(kind="resume", step=iter_num, changed={k: list(v) for k, v in changed.items()})
        print(f"{cfg.residual}: {model.get_num_params():,} parameters, {run.tokens_per_iter:,} tokens per step, "
              f"{device} {dtype}{' compiled' if use_compile(cfg, device) else ''}, run directory {cfg.out_dir}")
    return run


def claim_run_dir(cfg, master):
    """The resume checkpoint (or None) and the settings a resume changes; refuses to start a fresh run over
    an existing one unless --overwrite, which then deletes the old checkpoints and metrics."""
    out_dir, ckpt_path = Path(cfg.out_dir), Path(cfg.out_dir) / "last.pt"
    if cfg.resume:
        ckpt = load_checkpoint(ckpt_path, mmap=True)  # read lazily: under FSDP only rank 0 reads the weights
        changed = {k: (v, getattr(cfg, k)) for k, v in ckpt["config"].items()
                   if hasattr(cfg, k) and getattr(cfg, k) != v and k != "resume"}
        if ckpt["iter_num"] >= cfg.max_iters and not cfg.eval_only:
            raise ConfigError(f"the run in {out_dir} has already reached --max-iters {cfg.max_iters} (it is at step "
                              f"{ckpt['iter_num']}); raise --max-iters to train it further")
        if master and changed:
            print("resuming with changed settings: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        return ckpt, changed
    if cfg.eval_only:
        return None, {}
    existing = [f for f in RUN_FILES if (out_dir / f).exists()]
    if existing and not cfg.overwrite:
        raise ConfigError(f"{out_dir} already holds a run ({', '.join(existing)}); pass --resume to continue it, "
                          f"--overwrite to start over (deleting it), or another --out-dir")
    init = Path(cfg.init_from)
    if cfg.overwrite and init.exists() and init.resolve().parent == out_dir.resolve():
        raise ConfigError(f"--init-from {cfg.init_from} is inside {out_dir}, which --overwrite would clear; "
                          f"copy it elsewhere first or choose another --out-dir")
    if cfg.overwrite and master:  # the old run's files must not be resumed or read by mistake
        for old in RUN_FILES:
            (out_dir / old).unlink(missing_ok=True)
    return None, {}


def pick_device(cfg):
    """The device the run asks for; auto is CUDA, then MPS, then the CPU."""
    if cfg.device != "auto":
        return checked_device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def checked_device(name):
    """torch.device(name), refused in one line when this machine does not have it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is unknown; choose auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asks for CUDA, which this machine does not have; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name} asks for MPS, which this machine does not have; use --device cpu")
    return device


def precision(cfg, device, master):
    """(dtype name, autocast context, gradient scaler): bfloat16 or float16 autocast on CUDA, float32 on the
    CPU and MPS unless asked; the scaler does nothing unless float16."""
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "float32" if device.type != "cuda" else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    slow = dtype == "float16" or (dtype == "bfloat16" and not cpu_has_bfloat16())
    if slow and device.type == "cpu" and master:
        print(f"warning: --dtype {dtype} on this CPU runs many times slower than float32 (it has no fast {dtype} "
              f"matrix products); it is allowed, but use --dtype float32 (the CPU default) unless you are testing "
              f"mixed precision", file=sys.stderr)
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    ctx = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device_type=device.type, dtype=ptdtype)
    return dtype, ctx, torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))


def cpu_has_bfloat16():
    """Whether this CPU multiplies bfloat16 natively (x86 AVX512-BF16 or AMX, Arm BF16), as Linux reports
    it; False where it cannot tell."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def build_model(cfg, ckpt, ds, master=True):
    """The model to train, with the step to start at and the best val loss so far: from the resume
    checkpoint, from scratch, from GPT-2 weights, or from a (baseline) checkpoint with zero-init routing
    (a routed checkpoint's routing is kept only for the same routing; master says when it is dropped)."""
    meta = ds.meta
    if ckpt is not None:
        wanted = asdict(model_config(cfg, ckpt["model_config"]["vocab_size"]))
        diff = arch_diff(ckpt["model_config"], wanted)
        if diff:
            raise ConfigError(f"cannot resume {cfg.out_dir}/last.pt with a different architecture: {'; '.join(diff)}")
        check_tokenizer(ckpt, meta, f"{cfg.out_dir}/last.pt")
        model = model_from_checkpoint(ckpt, dropout=cfg.dropout, fast_routing=cfg.fast_routing)
        return model, ckpt["iter_num"], ckpt["best_val_loss"]
    route = {k: getattr(cfg, k) for k in ROUTE_FIELDS + ("dropout", "fast_routing")}
    if cfg.init_from == "scratch":
        vocab_size = 50304 if ds.tokenizer.name == "gpt2" else ds.vocab_size  # GPT-2's padded to a multiple of 64
        model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from in GPT2_MODELS:
        if ds.tokenizer.name != "gpt2":
            raise ConfigError(f"--init-from {cfg.init_from} needs a GPT-2 BPE dataset; {cfg.dataset} is {ds.tokenizer.name}")
        try:
            model = GPT.from_pretrained(cfg.init_from, route)
        except ValueError as e:  # no transformers package, or no network
            raise ConfigError(str(e)) from None
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
    else:
        src = load_checkpoint(cfg.init_from)
        check_tokenizer(src, meta, cfg.init_from)
        wanted = asdict(model_config(cfg, src["model_config"]["vocab_size"]))
        diff = arch_diff(src["model_config"], wanted, [k for k in ARCH_FIELDS if k not in ROUTE_FIELDS])
        if diff:
            raise ConfigError(f"--init-from {cfg.init_from} has a different architecture: {'; '.join(diff)}")
        model = model_from_checkpoint(src, **route)
        was = src["model_config"]
        if master and was["residual"] != "baseline" and routing_changed(was, model.config):
            print(f"note: the {was['residual']} routing of --init-from {cfg.init_from} is dropped: " +
                  ("a baseline has none" if cfg.residual == "baseline" else
                   f"other routing settings, so {cfg.residual}'s routing starts at zero init"))
    return model, 0, float("inf")


def build_local(cfg, ckpt, ds, rank, device, dtype):
    """build_model on this process's device (one process, or a full copy per DDP rank)."""
    model, iter_num, best_val_loss = build_model(cfg, ckpt, ds, rank == 0)
    set_recompute(model, cfg.activation_checkpointing)
    return model.to(device), iter_num, best_val_loss


def set_recompute(model, on):
    """--activation-checkpointing: each Block recomputes its attention and MLP in backward."""
    for block in model.transformer.h:
        block.recompute = on


def make_optimizer(cfg, model, ckpt, scaler, device, rank=0):
    """AdamW (the model's three groups), restored from the resume checkpoint with this run's settings;
    returns it with the wall time the run had already trained."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # nanoGPT's parameter counts
        optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                               device.type, route_lr_mult=cfg.route_lr_mult)
    if ckpt is None:
        return optimizer, 0.0
    if cfg.fsdp:  # rank 0's full state, sent to every rank's shards
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        state = by_name(ckpt["optimizer"], optimizer_names(model, optimizer)) if rank == 0 else {}
        set_optimizer_state_dict(model, optimizer, state, options=full_state_options(broadcast_from_rank0=True))
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    for group in optimizer.param_groups:  # this run's settings, not the saved ones
        group.update(betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay if group["name"] == "decay" else 0.0,
                     lr_mult=cfg.route_lr_mult if group["name"] == "routing" else 1.0)
    if scaler.is_enabled() and ckpt["scaler"]:  # a float32/bf16 run saved a disabled scaler's empty state
        scaler.load_state_dict(ckpt["scaler"])
    restore_rng(ckpt["rng"])
    return optimizer, ckpt.get("elapsed", 0.0)


def use_compile(cfg, device):
    return cfg.compile if cfg.compile is not None else device.type == "cuda"


def wrap_model(cfg, model, world_size, device):
    """What the loop calls: the model, compiled (default on CUDA) and wrapped for DDP over several processes
    (FSDP's model is already sharded over them)."""
    if use_compile(cfg, device):
        model = torch.compile(model)
    if world_size > 1 and not cfg.fsdp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


# ------------------------------------------------------------------------------------------------
# the run: FSDP2 sharding, and checkpoints gathered into the one-file format

def check_fsdp(cfg):
    import torch.distributed.fsdp
    if not hasattr(torch.distributed.fsdp, "fully_shard"):  # public since PyTorch 2.6
        raise ConfigError(f"--fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, PyTorch 2.6 or "
                          f"newer); this is {torch.__version__}: upgrade torch or train with DDP")
    if cfg.dtype == "float16":
        raise ConfigError("--fsdp shards gradients, which float16's gradient scaler cannot unscale; "
                          "use --dtype bfloat16 (or float32)")


def build_sharded(cfg, ckpt, ds, rank, device, dtype):
    """FSDP2: rank 0 builds the model on the CPU (from scratch, a checkpoint or GPT-2) as one process would;
    every rank builds the same shape on the meta device, shards it and takes its shards of rank 0's weights.

    Each attention and each MLP is its own FSDP group (gathered for its forward and backward, then freed);
    the root group holds the rest: embeddings, LayerNorms, lm_head and the routers, whose queries the fast
    routing path reads together when the forward starts. On CUDA with bfloat16 the groups compute in
    bfloat16 and reduce gradients in float32; elsewhere they keep float32."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    full, shape = {}, None
    if rank == 0:
        model, iter_num, best_val_loss = build_model(cfg, ckpt, ds)
        full, shape = model.state_dict(), (model.config, iter_num, best_val_loss)
    box = [shape]
    torch.distributed.broadcast_object_list(box, src=0)
    config, iter_num, best_val_loss = box[0]
    with torch.device("meta"):
        model = GPT(config)
    set_recompute(model, cfg.activation_checkpointing)
    mixed = device.type == "cuda" and dtype == "bfloat16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block.attn, mp_policy=policy)
        fully_shard(block.mlp, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=full_state_options(broadcast_from_rank0=True))
    return model, iter_num, best_val_loss


def full_state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def full_state(run):
    """(model state_dict, optimizer state_dict) of the whole model, in the one-process format. Under FSDP
    every rank takes part in gathering them and only rank 0 receives them (in CPU memory)."""
    if not run.cfg.fsdp:
        return run.raw_model.state_dict(), run.optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    options = full_state_options(cpu_offload=True)
    model_state = get_model_state_dict(run.raw_model, options=options)
    optim_state = get_optimizer_state_dict(run.raw_model, run.optimizer, options=options)
    return model_state, by_index(optim_state, optimizer_names(run.raw_model, run.optimizer)) if run.master else None


def optimizer_names(model, optimizer):
    """The parameter names in the optimizer's order: what a plain optimizer state_dict numbers 0, 1, ..."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_index(state, names):
    """An optimizer state_dict keyed by parameter name (torch.distributed.checkpoint's) -> keyed by index."""
    index = {n: i for i, n in enumerate(names)}
    return dict(state={index[n]: s for n, s in state["state"].items()},
                param_groups=[dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]])


def by_name(state, names):
    """An optimizer state_dict keyed by index (a plain one's) -> keyed by parameter name."""
    return dict(state={names[i]: s for i, s in state["state"].items()},
                param_groups=[dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]])


def gradient_sync(run, last):
    """Gradients are reduced over the ranks on the last micro-step of a step only (DDP and FSDP)."""
    if run.world_size > 1 and not run.cfg.fsdp and not last:
        return run.model.no_sync()
    if run.cfg.fsdp:
        run.raw_model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


@contextlib.contextmanager
def root_gathered(run):
    """The root FSDP group's parameters gathered for a pass that does not enter through GPT.forward (the
    routing statistics read GPT.hidden); a no-op without FSDP."""
    if not run.cfg.fsdp:
        yield
        return
    run.raw_model.unshard()
    try:
        yield
    finally:
        run.raw_model.reshard()


# ------------------------------------------------------------------------------------------------
# the run: the loop

def train_loop(run):
    """Evaluate and checkpoint when due, then one optimizer step, until max_iters or a signal."""
    cfg = run.cfg
    bar = Progress(run)
    with StopFlag() as stop:
        while True:
            final = run.iter_num >= cfg.max_iters
            evaluate_and_checkpoint(run, final, bar)
            if final:
                break
            lr = get_lr(run.iter_num, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr * group["lr_mult"]
            t0 = time.time()
            loss = train_step(run, stop)
            if loss is None:  # a signal: this step's gradients are dropped; resuming redoes it
                return stopped(run, bar)
            run.iter_num += 1
            bar.step(loss, lr, time.time() - t0)
    bar.close()
    return dict(val_loss=bar.val_loss, best_val_loss=run.best_val_loss, train_loss=bar.loss, iter_num=run.iter_num,
                elapsed=time.time() - run.t_start, tokens_per_s=bar.tok_s, out_dir=cfg.out_dir,
                params=run.raw_model.get_num_params())


def train_step(run, stop):
    """One optimizer step: accum micro-steps per rank, gradients synced on the last one only. Returns the
    mean loss over micro-steps and ranks, or None when any rank was signalled to stop (nothing applied)."""
    cfg, model = run.cfg, run.model
    torch.manual_seed(derive_seed(cfg.seed, 2, run.iter_num, run.rank))  # dropout: exact on resume, any world size
    loss_sum = torch.zeros((), device=run.device)
    # the step's global batch; rank r's micro-step m takes its slice r * accum + m
    starts = batch_starts(run.ds.train, cfg.block_size, cfg.batch_size * run.accum * run.world_size,
                          (cfg.seed, 0, run.iter_num))
    for micro in range(run.accum):
        part = (run.rank * run.accum + micro) * cfg.batch_size
        X, Y = get_batch(run.ds.train, cfg.block_size, starts[part:part + cfg.batch_size], run.device)
        last = micro == run.accum - 1
        with gradient_sync(run, last):
            with run.ctx:
                _, loss = model(X, Y)
            loss_sum += loss.detach()
            run.scaler.scale(loss / run.accum).backward()
    stats = torch.stack([loss_sum / run.accum, torch.tensor(float(stop.signal is not None), device=run.device)])
    if run.world_size > 1:
        torch.distributed.all_reduce(stats)
        stats[0] /= run.world_size
    step_loss, stop_now = stats[0].item(), stats[1].item() > 0
    if stop_now:
        run.optimizer.zero_grad(set_to_none=True)
        return None
    apply_gradients(run, step_loss)
    return step_loss


def apply_gradients(run, step_loss):
    """Clip and apply the step's gradients, refusing a non-finite loss or gradient before it lands."""
    kept = (f"{run.out_dir / 'last.pt'} still holds step {run.saved_step}" if run.saved_step is not None
            else "no checkpoint was written yet")
    if not math.isfinite(step_loss):
        raise TrainError(f"loss is {step_loss} at step {run.iter_num}; stopped without applying it, {kept} "
                         f"(lower --learning-rate or check the data)")
    run.scaler.unscale_(run.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.cfg.grad_clip or float("inf"))
    grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # FSDP: a sharded norm
    if not math.isfinite(grad_norm) and not run.scaler.is_enabled():  # fp16's scaler skips such steps itself
        raise TrainError(f"gradient norm is {grad_norm} at step {run.iter_num} (loss {step_loss:.4f}); stopped "
                         f"without applying it, {kept} (lower --learning-rate or check the data)")
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)


def evaluate(run):
    """Mean loss over the fixed eval batches of each split, and routing statistics on the first val batch."""
    cfg = run.cfg
    out = {split: estimate_loss(run.raw_model, run.ds, split, cfg.eval_iters, cfg.batch_size, run.ctx)
           for split in ("train", "val")}
    if cfg.residual != "baseline":
        with root_gathered(run):
            out["routing"] = routing_stats(run.raw_model, run.ds, 1, cfg.batch_size, run.ctx)
    return out


def evaluate_and_checkpoint(run, final, bar):
    """Every eval_interval steps (and at the end): evaluate, log, keep best.pt; every ckpt_interval: last.pt.
    Every rank takes part (the same fixed batches, so the same losses and decisions); rank 0 writes."""
    cfg = run.cfg
    fresh = run.iter_num > run.record.start_step or not cfg.resume  # a checkpoint's step was evaluated before it was saved
    if fresh and (run.iter_num % cfg.eval_interval == 0 or final):
        losses = evaluate(run)
        bar.val_loss = losses["val"]
        run.record.log(kind="eval", step=run.iter_num, train_loss=losses["train"], val_loss=losses["val"],
                       elapsed=time.time() - run.t_start, routing=losses.get("routing"))
        bar.write(f"step {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                  + (f", routing max weight {losses['routing']['mean_max_weight']:.3f}" if "routing" in losses else ""))
        if losses["val"] < run.best_val_loss:
            run.best_val_loss = losses["val"]
            if run.iter_num > 0:
                checkpoint(run, run.out_dir / "best.pt")
    due = run.iter_num % cfg.ckpt_interval == 0 or final
    if due and run.iter_num > run.record.start_step or final and run.saved_step is None:
        checkpoint(run, run.out_dir / "last.pt")
        run.saved_step = run.iter_num


def checkpoint(run, path):
    """Write the run's state at its current step to `path` (atomically, by rank 0; every rank calls it)."""
    cfg = run.cfg
    model_state, optim_state = full_state(run)
    if not run.master:
        return
    save_checkpoint(checkpoint_dict(model_state, run.raw_model.config, asdict(cfg), run.iter_num,
                                    run.best_val_loss, dataset_info(run.ds.meta, cfg.dataset),
                                    optimizer=optim_state, scaler=run.scaler.state_dict(),
                                    rng=rng_state(), elapsed=time.time() - run.t_start, commit=run.record.commit), path)


def stopped(run, bar):
    """A signal arrived: write last.pt at the current step (the step in flight is redone on resume) and exit."""
    ckpt_path = run.out_dir / "last.pt"
    checkpoint(run, ckpt_path)
    bar.close()
    message = f"stopped by signal at step {run.iter_num}; checkpoint {ckpt_path} written (continue with --resume)"
    if run.master:
        print(message)
    raise KeyboardInterrupt(message)


def evaluate_once(run):
    """--eval-only: the losses of the loaded model, nothing written."""
    losses = evaluate(run)
    if run.master:
        print(f"step {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    return dict(val_loss=losses.get("val"), train_loss=losses.get("train"), iter_num=run.iter_num)


class Progress:
    """The progress of the loop: a tqdm bar on a terminal; without one (a log file), a plain line every
    log_interval steps. It also writes the train rows of metrics.jsonl and keeps the last figures."""

    def __init__(self, run):
        self.run, cfg = run, run.cfg
        show = run.master and cfg.progress
        self.terminal = show and sys.stderr.isatty()
        self.lines = show and not self.terminal
        self.bar = tqdm(total=cfg.max_iters, initial=run.iter_num, disable=not self.terminal, dynamic_ncols=True,
                        desc=cfg.residual)
        self.loss, self.val_loss, self.tok_s = float("nan"), None, None

    def step(self, loss, lr, dt):
        run = self.run
        self.loss, self.tok_s = loss, run.tokens_per_iter / dt
        if not run.master:
            return
        mfu = run.raw_model.estimate_mfu(run.cfg.batch_size * run.accum, dt, run.device)
        postfix = dict(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{self.tok_s:,.0f}")
        if mfu is not None:
            postfix["mfu"] = f"{mfu * 100:.1f}%"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if run.iter_num % run.cfg.log_interval == 0:
            run.record.log(kind="train", step=run.iter_num, train_loss=loss, lr=lr, tokens_per_s=self.tok_s,
                           elapsed=time.time() - run.t_start, **({"mfu": mfu} if mfu is not None else {}))
            if self.lines:
                print(f"step {run.iter_num}/{run.cfg.max_iters}: " + ", ".join(f"{k} {v}" for k, v in postfix.items()),
                      flush=True)

    def write(self, line):
        if self.run.master:
            self.bar.write(line)

    def close(self):
        self.bar.close()


# ------------------------------------------------------------------------------------------------
# the run: its directory, signals, random state, process-wide settings

class RunLock:
    """An OS lock on out_dir/run.lock for the whole run, so two trainings never write one run directory.
    The kernel drops it when the process ends, however it ends: a killed run leaves no stale lock. A run that
    fails to start (held_on_error) leaves the folder as it found it: what the lock made is removed again."""

    def __init__(self, out_dir, active):
        self.path, self.file, self.made, self.before = Path(out_dir) / "run.lock", None, [], None
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

    @contextlib.contextmanager
    def held_on_error(self):
        """Release the lock if setting up the run fails, and undo what the lock made: the lock file's old
        content (a stale process id) back, or the file and the folders it was made in removed."""
        try:
            yield
        except BaseException:
            if self.file is not None:
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
            raise

    def release(self):
        if self.file is not None:
            self.file.close()  # closing drops the flock
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop writes a checkpoint at the next step and exits cleanly.
    A second signal falls back to the default behaviour."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        import threading
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.signal = signum
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


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
        raise ConfigError("--wandb-project needs the wandb package, which is not installed: pip install wandb==0.31.0 "
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


def git_commit():
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def keep_freed_memory():
    """Have the C library's malloc keep freed memory for the next step instead of handing it back to the OS.

    By default glibc serves large blocks with mmap and unmaps them when freed, and trims free memory at
    the top of its heap; each training step on the CPU then page-faults its activations and gradients
    back in, and the kernel zeroes every page: a large share of a step on a small CPU, and a larger one
    for the routed modes, whose reads and gradients are more blocks of the same sizes (docs/speed.md).
    With mmap off and trimming at 2 GiB, freed memory is reused as PyTorch's CUDA caching allocator
    reuses it, and the process keeps its peak size. Process-wide: only entry points call it; glibc
    (Linux) only. Returns whether it took effect."""
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to ask, or one without mallopt
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def busy_cores(seconds=0.25):
    """How many CPU cores other work keeps busy now, from /proc/stat over `seconds` (0 where unknown)."""
    def sample():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait
    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return 0
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1))


PROCESS_FIELDS = ("device", "threads", "keep_freed_memory")  # what apply_process_settings reads


def apply_process_settings(cfg):
    """What only an entry point may set, since it holds for the whole process: torch's thread count (with
    --threads, or the free cores: on a busy machine two jobs with all threads each run many times slower),
    for CPU training malloc keeping freed memory (--keep-freed-memory, the default), and on CUDA TF32 for
    the float32 matmuls that autocast leaves (as nanoGPT's train.py)."""
    kind = pick_device(cfg).type
    on_cpu = kind == "cpu"
    if kind == "cuda":
        torch.set_float32_matmul_precision("high")  # allow tf32 on matmul
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    elif on_cpu and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        cores, busy = torch.get_num_threads(), busy_cores()
        if busy and cores > 1:
            torch.set_num_threads(max(1, cores - busy))
            print(f"note: {busy} of {cores} cores are busy; training with {torch.get_num_threads()} thread(s) "
                  f"(--threads N to choose)", file=sys.stderr)
    if on_cpu and cfg.keep_freed_memory:
        keep_freed_memory()


def main(argv=None):
    """Parse options, train, and turn bad input into one line and exit status 1 (130 when interrupted)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print("usage: python train.py [--preset P] [--FIELD VALUE ...]   (or python cli.py train ...)\n")
        print(options_help().replace("\b\n", ""))
        return
    try:
        cfg = config_from_args(argv)
        apply_process_settings(cfg)
        train(cfg)
    except KeyboardInterrupt:
        sys.exit(130)
    except DeltaGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
