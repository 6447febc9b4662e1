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


def check_output_file(option: str, path: str, suffixes: tuple = ()) -> None:
    """An output file option (``--svg``, ``--png``, ``--plot``) must name a file this process can write.

    Checked before any work, so a long run does not end in a failed write: it is not a
    folder, the name ends in one of ``suffixes`` (when given; the format follows the option,
    not the name, so a mismatch would write e.g. PNG bytes into ``plan.svg``), its folder
    exists, and a file can be created there (opened for appending, and removed again when
    it did not exist: ``os.access`` says yes to root even on ``/proc``).

    Raises:
        UsageError: one line naming the option, the path and the fix.
    """
    if os.path.isdir(path):
        name = "picture" + suffixes[0] if suffixes else "FILE"
        raise UsageError(f"{option} {path}: is a folder: expected a file name, e.g. {os.path.join(path, name)}.")
    suffix = os.path.splitext(path)[1].lower()
    if suffixes and suffix not in suffixes:
        names = " or ".join(suffixes)
        raise UsageError(f"{option} {path}: expected a file name ending in {names}, e.g. picture{suffixes[0]}"
                         f"{' (--png writes PNG, --svg SVG)' if option in ('--svg', '--png') else ''}.")
    check_output_folder(option, path)
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot write there ({err.strerror or err}). Pick a writable "
                         "folder.") from None
    if not existed:
        os.remove(path)


def write_error(option: str, path: str, err: OSError) -> UsageError:
    """The one-line error of a failed write of an output option (a full disk, a vanished folder)."""
    return UsageError(f"{option} {path}: cannot write it ({err.strerror or err}). Pick a writable folder.")


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
