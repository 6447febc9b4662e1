"""Errors raised for invalid parallel layouts.

Every message says the offending value, what was expected and how to fix it, so
that a CLI can print it as one line and a training script can show it as is.
"""


class LayoutError(ValueError):
    """A parallel layout (sizes, order, world, axis key) is invalid."""


class LayoutFileError(LayoutError):
    """A layout file is missing, malformed or holds a bad key or value.

    Attributes:
        path: The file the error is about.
        key: The offending key, or None when the error concerns the whole file.
    """

    def __init__(self, message: str, path: str = "", key: str | None = None):
        super().__init__(message)
        self.path = path
        self.key = key
