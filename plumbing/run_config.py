"""The TrainConfig of a run: from a preset and options, from a command line, or from the run's last.pt
for --resume. train.py binds these to its TrainConfig (config_class) and PRESETS (train.make_config,
train.resume_config, train.config_from_args), which cli.py, compare and the studies call."""
from dataclasses import fields, replace
from pathlib import Path

from errors import ConfigError
from plumbing.checkpoint import load_checkpoint
from plumbing.config import (ARCH_FIELDS, as_typed, check_config, flag, model_config, out_dir_of,
                             parse_args, preset_config)


def make_config(config_class, presets, preset=None, **overrides):
    """A config from a named preset plus field overrides; bad names and values raise ConfigError."""
    cfg = preset_config(config_class, presets, preset, **overrides)
    check_config(cfg)
    return cfg


def resume_config(config_class, presets, preset=None, **overrides):
    """The config of the run in out_dir (from its last.pt) with `overrides` on top, for --resume;
    another architecture is refused, naming the options given and the run's values."""
    out_dir = out_dir_of(preset_config(config_class, presets, preset,
                                       **{**overrides, "resume": True}))
    ckpt = load_checkpoint(Path(out_dir) / "last.pt", mmap=True)
    names = {f.name for f in fields(config_class)}
    saved = replace(config_class(), **{k: v for k, v in ckpt["config"].items() if k in names})
    if preset is not None and preset != saved.preset:
        raise ConfigError(f"--preset {preset} differs from the run's preset {saved.preset}; "
                          f"a resumed run keeps its preset")
    # the run's architecture, each mode's defaults filled in
    has = model_config(saved, vocab_size=1)
    changed = [f"--{flag(k)} {v} "
               f"(the run has {getattr(has, k) if getattr(has, k) is not None else 'none'})"
               for k, v in overrides.items() if k in ARCH_FIELDS and v != getattr(has, k)]
    if changed:
        raise ConfigError(f"cannot resume {out_dir} with another architecture: "
                          f"{'; '.join(changed)}; "
                          f"leave these out, or train a new run in another --out-dir")
    # the saved init_from only records where the run began: its weights now come from last.pt
    cfg = replace(saved, **{**overrides, "resume": True})
    check_config(cfg)
    return cfg


def config_from_args(config_class, presets, argv):
    """The TrainConfig a command line asks for: a fresh run, or with --resume the run in out_dir."""
    preset, overrides = parse_args(argv, config_class)
    try:
        return (resume_config(config_class, presets, preset, **overrides) if overrides.get("resume")
                else make_config(config_class, presets, preset, **overrides))
    except ConfigError as e:
        raise ConfigError(as_typed(str(e))) from None
