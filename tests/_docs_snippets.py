"""The Python snippets of the documentation, as tests/test_docs.py and the ranks read them.

Every ```` ```python ```` block of the guide pages (``docs/**/*.md`` except the pages other
tools own, and README.md) is preceded by a marker line naming how it runs::

    <!-- docs-test: NAME -->

``NAME`` is a setup of tests/_docs_checks.py (the names the snippet uses but does not
define, and the layout, on 4 ranks of the session's shared launch). Pure Python, no
MindSpore import.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- docs-test: ([\w-]+) -->$")
# Pages whose Python blocks are not snippets of this kind (other engineers' reference pages
# hold formulas and measured code; the API pages hold none).
SKIP = {"docs/COST_MODEL.md", "docs/COMPILED_MODE.md", "docs/BENCHMARKS.md"}


@dataclasses.dataclass(frozen=True)
class Snippet:
    path: str      # relative to the repository root
    index: int     # the n-th Python block of the page
    line: int      # 1-based line of its opening fence
    setup: str     # the marker's name ("" when unmarked)
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}#{self.index}"


def pages() -> list:
    """The pages whose Python blocks must run, relative to the repository root."""
    found = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                                   for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [p for p in found if p not in SKIP]


def snippets_of(path: str) -> list:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            stop = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = MARKER.match(lines[i - 1].strip()) if i else None
            out.append(Snippet(path, len(out), i + 1, marker.group(1) if marker else "",
                               textwrap.dedent("\n".join(lines[i + 1:stop])) + "\n"))
            i = stop
        i += 1
    return out


def all_snippets() -> list:
    return [s for p in pages() for s in snippets_of(p)]
