"""The one base class of delta-gpt's errors for bad input: the CLI prints its message as one line.
Anything else that escapes is a bug and keeps its traceback."""


class DeltaGPTError(ValueError):
    """Bad input, or a run that cannot go on: one sentence saying what was wrong and what to do."""


class ConfigError(DeltaGPTError):
    """An option value that cannot be used, or options that do not go together."""


class TrainError(DeltaGPTError):
    """A run that cannot go on (non-finite loss, unusable checkpoint, busy run directory)."""


def check_packages(names=("torch", "numpy", "tqdm", "typer", "tiktoken")):
    """Exit with one line when this Python lacks delta-gpt's packages: the likeliest first mistake is a shell
    where the project's .venv is not active (an entry point calls this before importing any of them)."""
    import importlib.util
    import sys
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"error: this Python ({sys.executable}) lacks delta-gpt's packages ({', '.join(missing)}); run "
                 f"`make install` once, then `source .venv/bin/activate` (or run .venv/bin/python instead of python)")
