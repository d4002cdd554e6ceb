"""Options: the groups of TrainConfig fields, one clear error for a bad value or combination, the model's
GPTConfig from a run's options, and the one parser of typed option values (command lines and study files).
plumbing/run_config.py builds a run's TrainConfig from them (train.make_config, train.config_from_args).

    overrides = parse_args(["--residual", "delta", "--max-iters=100"], TrainConfig)[1]   # {'residual': 'delta', ...}
    check_config(cfg)                                                                    # ConfigError if bad
"""
import difflib
import re
from dataclasses import fields, replace

import torch

from delta_gpt import GPT2_MODELS, GPTConfig, RESIDUALS, ROUTING_FIELDS
from errors import ConfigError
from plumbing.rundir import import_wandb

MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name != "vocab_size")  # the TrainConfig fields that build GPTConfig
ROUTE_FIELDS = ("residual", *ROUTING_FIELDS)  # --init-from may change these
ARCH_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name not in ("dropout", "fast_routing"))  # fixed once trained
BOOKKEEPING_FIELDS = ("out_dir", "resume", "overwrite", "progress", "eval_only", "threads", "keep_freed_memory", "memory_check",
                      "log_interval", "ckpt_interval", "wandb_project", "wandb_run_name")  # change no number of a run
BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}  # a flag's value in words
PROCESS_FIELDS = ("device", "threads", "keep_freed_memory")  # what system.apply_process_settings reads


def default_preset():
    return "cpu" if not torch.cuda.is_available() else "shakespeare_char"


def preset_config(TrainConfig, presets, preset=None, **overrides):
    """A TrainConfig from a named preset plus field overrides, before its values are checked (unknown names
    and presets are refused)."""
    preset = preset or default_preset()
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(presets)}")
    unknown = set(overrides) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"unknown TrainConfig field(s) {', '.join(sorted(unknown))}")
    if overrides.get("resume") and overrides.get("init_from", "scratch") != "scratch":
        raise ConfigError("--resume continues out_dir/last.pt; it cannot be combined with --init-from")
    return replace(TrainConfig(), **{**presets[preset], **overrides, "preset": preset})


def parse_mode(mode):
    """'delta_block-static-h4' -> ('delta_block', {route_weights: static, route_heads: 4}): the names bench,
    compare and study files give a routed mode's static control and its heads; ConfigError if unknown."""
    m = re.fullmatch(r"(\w+?)(-static)?(?:-h(\d+))?", mode)
    if not m or m[1] not in RESIDUALS or (m[1] == "baseline" and m[0] != "baseline"):
        raise ConfigError(f"unknown mode {mode!r}; choose from {', '.join(RESIDUALS)}, a routed mode's static "
                          f"control (delta_block-static), or H routing heads (delta_block-h4, delta_block-static-h4)")
    return m[1], dict(**({"route_weights": "static"} if m[2] else {}), **({"route_heads": int(m[3])} if m[3] else {}))


def mode_label(c):
    """A model's mode as headers, reports and tables name it (a GPTConfig, or a TrainConfig with the model's
    values): delta, delta-static, delta_block-h4, attnres cumulative, ... (parse_mode reads the first part back)."""
    if c.residual == "baseline":
        return "baseline"
    heads = f"-h{c.route_heads}" if (c.route_heads or 1) > 1 else ""
    static = "-static" if c.route_weights == "static" else ""
    return f"{c.residual}{static}{heads}" + (" cumulative" if c.route_sources == "cumulative" else "")


def out_dir_of(cfg):
    return cfg.out_dir or f"runs/{cfg.preset}-{cfg.residual}"


def flag(name):
    return name.replace("_", "-")


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
    if cfg.threads is not None:
        at_least_one(threads=cfg.threads)
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
        from torch.distributed import fsdp
        if not hasattr(fsdp, "fully_shard"):  # public since PyTorch 2.6
            raise ConfigError(f"--fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, PyTorch 2.6 or "
                              f"newer); this is {torch.__version__}: upgrade torch or train with DDP")
        if cfg.dtype == "float16":
            raise ConfigError("--fsdp shards gradients, which float16's gradient scaler cannot unscale; "
                              "use --dtype bfloat16 (or float32)")
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


def with_model_defaults(cfg):
    """cfg with the model's own values of its fields (a mode's default routing options filled in), as a run
    records them."""
    model = model_config(cfg, vocab_size=1)
    return replace(cfg, **{k: getattr(model, k) for k in MODEL_FIELDS})


def as_typed(message):
    """A message in command-line words: GPTConfig's n_route_blocks=3 becomes --n-route-blocks 3."""
    names = "|".join(sorted(MODEL_FIELDS, key=len, reverse=True))
    message = re.sub(rf"(?<![\w*/.-])({names})=('?)([^\s;,')]*)\2", lambda m: f"--{flag(m[1])} {m[3]}", message)
    return re.sub(rf"(?<![\w*/.-])({names})\b(?!=)", lambda m: f"--{flag(m[1])}", message)


def parse_args(argv, TrainConfig):
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
            if not negated and argv and argv[0].lower() in BOOL_WORDS:
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
        try:
            overrides[key] = typed(kind, value, text=True)
        except ValueError as expected:
            raise ConfigError(f"--{flag(key)} expects {expected}, got {value!r}") from None
    return overrides.pop("preset", None), overrides


def typed(kind, value, text):
    """The value of an option of type `kind` (str(field.type)), from command-line text (text=True: parsed, "none"
    is None for an Optional option) or from a study file (checked as TOML typed it; an int is taken for a float).
    A value that does not fit raises ValueError naming what the option expects: "an integer", ..."""
    base = next(name for name in ("bool", "int", "float", "str") if name in kind)
    expected = dict(bool="true or false", int="an integer", float="a number", str="a string")[base]
    if "Optional" in kind and (value is None or text and value.lower() == "none"):
        return None
    if text and base != "str":
        try:
            return BOOL_WORDS[value.lower()] if base == "bool" else int(value) if base == "int" else float(value)
        except (KeyError, ValueError):
            raise ValueError(expected) from None
    fits = dict(bool=isinstance(value, bool), int=type(value) is int, float=type(value) in (int, float),
                str=isinstance(value, str))[base]
    if not fits:
        raise ValueError(expected)
    return float(value) if base == "float" else value


def train_help(TrainConfig, presets):
    """Every TrainConfig field as an option with its help and the cpu preset's value (`--help`)."""
    defaults = replace(TrainConfig(), **presets["cpu"])
    lines = [f"  --{flag(f.name):<27} {f.metadata['help']} [cpu: {getattr(defaults, f.name)}]" for f in fields(TrainConfig)]
    return ("Training options: any TrainConfig field, as --field VALUE, --field=VALUE or --flag / --no-flag.\n\n"
            "\b\n" + "\n".join(lines) + f"\n\nPresets: {', '.join(presets)} (default: cpu without CUDA, "
            "shakespeare_char with it).")
