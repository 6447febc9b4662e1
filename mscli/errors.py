"""The one place where errors become messages and exit codes.

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (layout, options).
Set ``MSDIST_DEBUG=1`` to see the full traceback instead of the one-line message.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import typer

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class UsageError(ValueError):
    """Bad command-line input that is not about the layout itself."""


def check_format(fmt: str) -> None:
    """``--format`` must be ``rich`` or ``json``."""
    if fmt not in ("rich", "json"):
        raise UsageError(f"--format {fmt!r} is invalid: expected 'rich' or 'json'.")


def check_output_folder(option: str, path: str) -> None:
    """The folder an output option (``--svg``, ``--write``) writes into must exist."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: folder {folder} does not exist. Create it or pick another path.")


def fail(message: str, code: int = EXIT_BAD_INPUT) -> "typer.Exit":
    """Print ``message`` as one line on stderr and return the Exit to raise."""
    sys.stderr.write(f"msdist: error: {message}\n")
    return typer.Exit(code)


@contextmanager
def user_errors():
    """Turn ValueErrors (layout and usage errors) into one stderr line and exit code 2."""
    try:
        yield
    except ValueError as err:
        if os.environ.get("MSDIST_DEBUG"):
            raise
        raise fail(" ".join(str(err).split())) from None
