"""The 4-rank job of test_docs.py: every Python snippet of the documentation, run as written.

One check per snippet (``docs.snippet``, tests/_docs_checks.py), in page order, in the
session's shared 4-rank launch (``_jobs.py``). The spec is read from the pages when the
family is launched, so a new snippet joins it by itself (its marker names its setup).
"""

from __future__ import annotations

import os

import _jobs
from _docs_snippets import all_snippets

WORLD_SIZE = 4
# Measured: see tests/test_docs.py's module docstring.
TIMEOUT_S = 600
HERE = os.path.dirname(os.path.abspath(__file__))


def spec() -> dict:
    return {"modules": ["_docs_checks"], "layout": {"world_size": WORLD_SIZE},
            "checks": [{"name": "docs.snippet", "params": {"path": s.path, "index": s.index}}
                       for s in all_snippets()]}


_jobs.register("docs", spec, world_size=WORLD_SIZE, timeout=TIMEOUT_S, test_files=("test_docs.py",),
               paths=(HERE,))


def run_job():
    return _jobs.run("docs")
