"""MkDocs hook: the outputs shown for ``msdist`` commands that need no device are real runs.

A ``console`` block preceded by the line ``<!-- msdist-output -->`` is rebuilt when the
site is built: each ``$ msdist ...`` line is run in-process (the Typer app, the ``rich``
output that a pipe gets, 120 columns) and the lines after it, up to the next ``$``, are
replaced by what it printed (stdout, then the ``msdist:`` lines of stderr). ``$ printf``
/ ``$ echo`` lines run in the shell (to write a small layout file); every block of a page
shares one temporary folder, so a file one command writes (``suggest --write``) is there
for the next. A command that fails stops the build with its output.

A block preceded by ``<!-- msdist-excerpt: COMMAND -->`` quotes part of an output instead:
the build (and the tests) run COMMAND (``&&`` joins a ``printf`` that writes its layout) and
fail unless every run of tokens between ``...`` elisions appears, in order, in the real
output; for a ``json`` block, every ``"key": scalar`` pair shown must occur in the real JSON.

tests/test_docs.py runs the same functions over every page and the README, so a renamed
option or preset fails the tests too, and compares the README's blocks (which no build
rewrites) with the real output.

Commands that need ranks (``verify``, ``train``, ``checkpoint`` of a saved run) are never
marked: their pages show a recorded run and say so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import tempfile

MARKER = "<!-- msdist-output -->"
EXCERPT = re.compile(r"^<!-- msdist-excerpt: (.+?) -->$")
ELISION = ("...", "\u2026")
WIDTH = "120"
# The pages show figures of the 2-core machine they were recorded on: the cpu preset prices ranks
# sharing this many cores (costmodel.devices.local_cores), whatever machine builds the site.
CPU_CORES = "2"
SHELL_COMMANDS = ("printf", "echo")


class OutputError(RuntimeError):
    """A marked command failed (or is not a command this hook runs)."""


@contextlib.contextmanager
def _in_dir(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run(command: str, cwd: str) -> tuple:
    """Run one ``$`` line in ``cwd``: ``(exit code, output lines)``."""
    argv = shlex.split(command)
    if argv and argv[0] in SHELL_COMMANDS:
        done = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, check=False)
        return done.returncode, (done.stdout + done.stderr).splitlines()
    if not argv or argv[0] != "msdist":
        raise OutputError(f"{command!r}: a marked block runs msdist commands (and {', '.join(SHELL_COMMANDS)})")
    from typer.testing import CliRunner

    from mscli.main import app

    with _in_dir(cwd):
        result = CliRunner().invoke(app, argv[1:], env={"COLUMNS": WIDTH, "MSDIST_DEBUG": None,
                                                        "MSDIST_CPU_CORES": CPU_CORES})
    text = result.stdout + (result.stderr if result.stderr else "")
    return result.exit_code, [line.rstrip() for line in text.splitlines()]


def run_block(lines: list, cwd: str, where: str = "") -> list:
    """The block's ``$`` lines, each followed by its real output."""
    out = []
    for line in lines:
        if not line.startswith("$ "):
            continue
        code, printed = run(line[2:], cwd)
        if code != 0:
            raise OutputError(f"{where}: `{line[2:]}` exited {code}:\n" + "\n".join(printed[-20:]))
        out.append(line)
        out.extend(printed)
    return out


def blocks(markdown: str) -> list:
    """Every marked block: ``(start, stop, body lines)``, line indices of the fences."""
    lines = markdown.split("\n")
    found = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        start = i + 1
        if start >= len(lines) or not lines[start].startswith("```"):
            raise OutputError(f"line {i + 1}: {MARKER} must be followed by a ``` block")
        stop = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("```")), None)
        if stop is None:
            raise OutputError(f"line {start + 1}: the block after {MARKER} is not closed")
        found.append((start, stop, lines[start + 1:stop]))
    return found


def expand(markdown: str, where: str = "") -> str:
    """``markdown`` with every marked block's outputs replaced by real ones."""
    found = blocks(markdown)
    if not found:
        return markdown
    lines = markdown.split("\n")
    with tempfile.TemporaryDirectory(prefix="msdist-docs-") as cwd:
        # Run in page order (a later block may read a file an earlier one wrote), splice after.
        rendered = [run_block(body, cwd, where) for _, _, body in found]
    for (start, stop, _), new in reversed(list(zip(found, rendered))):
        lines[start + 1:stop] = new
    return "\n".join(lines)


def _tokens(lines: list) -> list:
    return " ".join(lines).split()


def _segments(lines: list) -> list:
    """The shown lines cut at elisions (a line or a token ``...``): token runs that must
    each appear, whole and in order, in the real output (wrapping does not matter)."""
    segments, current = [], []
    for token in _tokens(lines):
        if token in ELISION:
            if current:
                segments.append(current)
            current = []
        else:
            current.append(token)
    if current:
        segments.append(current)
    return segments


def _find(tokens: list, run_: list, start: int) -> int:
    for i in range(start, len(tokens) - len(run_) + 1):
        if tokens[i:i + len(run_)] == run_:
            return i + len(run_)
    return -1


def _json_pairs(text: str) -> list:
    return re.findall(r'"(\w+)":\s*(-?\d+(?:\.\d+)?(?:e-?\d+)?|"[^"]*"|true|false|null)', text)


def _flatten(data, into: dict) -> dict:
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(value, (dict, list)):
                into.setdefault(key, []).append(value)
            _flatten(value, into)
    elif isinstance(data, list):
        for value in data:
            _flatten(value, into)
    return into


def _same(shown: str, value) -> bool:
    import json

    want = json.loads(shown)
    if isinstance(want, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        decimals = len(shown.split(".")[1].split("e")[0]) if "." in shown else 0
        return round(float(value), decimals) == want
    return want == value and type(want) is type(value)


def check_excerpt(command: str, fence: str, body: list, cwd: str, where: str = "") -> None:
    """Raise :class:`OutputError` unless ``body`` is an excerpt of ``command``'s real output:
    for a ``json`` block every shown ``"key": scalar`` pair occurs in the real JSON; for any
    other block every run of tokens between elisions occurs, in order."""
    import json

    body = [line for line in body if not line.startswith("$ ")]  # the command itself, shown as typed
    code, printed = 0, []
    for part in command.split(" && "):
        code, printed = run(part, cwd)
        if code != 0:
            raise OutputError(f"{where}: `{part}` exited {code}:\n" + "\n".join(printed[-20:]))
    if fence.strip("`").strip().startswith("json"):
        # stdout only: the ``msdist:`` diagnostics of stderr follow the JSON
        real = _flatten(json.loads("\n".join(line for line in printed if not line.startswith("msdist: "))), {})
        for key, shown in _json_pairs("\n".join(body)):
            if not any(_same(shown, v) for v in real.get(key, [])):
                raise OutputError(f"{where}: `{command}` shows \"{key}\": {shown}, the real output has "
                                  f"{real.get(key, 'no such key')!r:.200}")
        return
    tokens, position = _tokens(printed), 0
    for segment in _segments(body):
        found = _find(tokens, segment, position)
        if found < 0:
            raise OutputError(f"{where}: `{command}`: the shown lines {' '.join(segment)[:200]!r} are not in "
                              "its real output (run it and paste the new lines)")
        position = found


def excerpts(markdown: str) -> list:
    """Every ``<!-- msdist-excerpt: CMD -->`` block: ``(command, fence line, body lines)``."""
    lines = markdown.split("\n")
    found = []
    for i, line in enumerate(lines):
        match = EXCERPT.match(line.strip())
        if not match:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise OutputError(f"line {i + 1}: {line.strip()} must be followed by a ``` block")
        stop = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), len(lines))
        found.append((match.group(1), lines[i + 1], lines[i + 2:stop]))
    return found


def check_page(markdown: str, where: str = "") -> int:
    """Check every excerpt of a page (one temporary folder for the page); how many."""
    found = excerpts(markdown)
    if found:
        with tempfile.TemporaryDirectory(prefix="msdist-docs-") as cwd:
            for command, fence, body in found:
                check_excerpt(command, fence, body, cwd, where)
    return len(found)


def on_page_markdown(markdown, page, config, files):
    check_page(markdown, page.file.src_path)
    return expand(markdown, page.file.src_path)
