"""The one base class of delta-gpt's errors for bad input: the CLI prints its message as one line.
Anything else that escapes is a bug and keeps its traceback."""


class DeltaGPTError(ValueError):
    """Bad input, or a run that cannot go on: one sentence saying what was wrong and what to do."""


class ConfigError(DeltaGPTError):
    """An option value that cannot be used, or options that do not go together."""


class TrainError(DeltaGPTError):
    """A run that cannot go on (non-finite loss, unusable checkpoint, busy run directory)."""
