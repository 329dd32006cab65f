"""The one base class of bad input.

`InputError` says that what a user gave cannot be used: a setting, a file, a dataset, a teacher,
a store. Each module's own error class for bad input derives from it (`ConfigError`,
`EvaluationError`, `DatasetError`, `ModelError`, `StoreError`, `CodecError`, `OutputError`), so
the `fadrm` command reports any of them in one line with status 2, while any other exception,
a plain `ValueError` included, is a fault of the program: status 1, with its traceback. It is a
`ValueError`, so callers that catch `ValueError` still catch it. This module imports nothing, so
a command refused early never loads torch.
"""


class InputError(ValueError):
    """What the user gave cannot be used; the message says what and what is accepted."""
