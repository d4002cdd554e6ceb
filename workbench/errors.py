"""The one base class of delta-gpt's errors for bad input: the CLI prints its message as one line.

Every module raises a subclass of DeltaGPTError (data.DataError, train.ConfigError, train.TrainError,
...) when the user gave something it cannot use; the message is one sentence saying what was wrong and
what to do. Anything else that escapes is a bug and keeps its traceback.
"""


class DeltaGPTError(ValueError):
    """Bad input, or a run that cannot go on: one sentence saying what was wrong and what to do."""
