"""The documentation cannot rot: its snippets run, its shown outputs are real, the site's parts exist.

* Every Python snippet of the guide pages and the README (tests/_docs_snippets.py) carries
  a ``<!-- docs-test: SETUP -->`` marker naming a setup of tests/_docs_checks.py, and runs
  as written on 4 ranks, in the session's shared 4-rank launch (``-m multiprocess``).
* Every ``msdist`` command whose output a page regenerates at build time
  (``<!-- msdist-output -->``) or quotes (``<!-- msdist-excerpt: CMD -->``, checked against
  the real output) runs here too, through the same functions as the MkDocs hook
  (docs/hooks/cli_outputs.py); the README, which no build rewrites, is compared as well.
* The CLI reference page is generated from every command of the Typer app; the README's
  quick start is the command CI runs; the README stays short.

``mkdocs build --strict`` itself runs in .ci/run after the tests.
"""

import os
import sys

import pytest

from _docs_snippets import ROOT, all_snippets, pages

sys.path.insert(0, os.path.join(ROOT, "docs", "hooks"))
import cli_outputs  # noqa: E402
import cli_reference  # noqa: E402

README_MAX_LINES = 300
QUICK_START = 'pip install -e ".[test]" && python -m pytest -q'


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


# ---------------------------------------------------------------- snippets: markers (no ranks)
def test_every_python_snippet_names_a_known_setup():
    import _docs_checks  # imports no MindSpore at module level

    found = all_snippets()
    assert len(found) >= 15, [s.id for s in found]
    unknown = [f"{s.id} (line {s.line}): {s.setup or 'no marker'}" for s in found if s.setup not in _docs_checks.SETUPS]
    assert not unknown, ("each ```python block needs a `<!-- docs-test: SETUP -->` line above it, SETUP one of "
                         f"{sorted(_docs_checks.SETUPS)} (tests/_docs_checks.py): {unknown}")
    for s in found:
        compile(s.code, s.id, "exec")  # a syntax error fails here, before any rank starts


# ---------------------------------------------------------------- snippets: run on 4 ranks
@pytest.fixture(scope="module")
def snippet_job():
    import _docs_job

    return _docs_job.run_job()


@pytest.mark.multiprocess
def test_every_snippet_runs_on_four_ranks(snippet_job):
    records = {}
    for rank, state in sorted(snippet_job.ranks.items()):
        for record in (state or {}).get("records", []):
            records.setdefault(f"{record['page']}#{record['index']}", {})[rank] = record
    expected = [s.id for s in all_snippets()]
    assert sorted(records) == sorted(expected), f"launch ok={snippet_job.ok}, logs {snippet_job.log_dir}"
    failed = {sid: r.get("error") for sid, ranks in records.items() for r in ranks.values() if not r["passed"]}
    assert not failed, "\n\n".join(f"{sid}:\n{err}" for sid, err in failed.items())
    assert all(len(ranks) == 4 for ranks in records.values())


@pytest.mark.multiprocess
def test_snippets_keep_what_their_comments_say(snippet_job):
    by_setup = {}
    for state in snippet_job.ranks.values():
        for record in (state or {}).get("records", []):
            by_setup.setdefault(record.get("setup"), []).append(record)
    for r in by_setup["groups"]:
        assert r["y_shape"] == [8, 8] and len(r["tp_ranks"]) == 2  # all-gather of the last dim over tp2
    for r in by_setup["moe-groups"]:
        assert r["ep_ranks"] in ([0, 1], [2, 3]) and r["edp_ranks"] in ([0, 2], [1, 3])
        assert r["dispatch_ranks"] == r["ep_ranks"]
    assert sorted(r["first"] for r in by_setup["moe-groups"]) == [0, 0, 4, 4]  # ep rank 0 and 1, twice
    for r in by_setup["mappings-uneven"]:
        assert r["sizes"] == [251, 251, 251, 250] and r["full_shape"] == [1003, 8] and r["full_is_x"]
        assert r["heads_shape"] == [1003, 2]
    for r in by_setup["mappings-jit"]:
        assert r["value"] == pytest.approx(r["expected"], rel=1e-5)
    for r in by_setup["layers"]:
        assert r["y_shape"] == [4, 1024]
    for r in by_setup["attention"]:
        assert r["loss_finite"] and r["out_shape"] == [2, 2, 4, 8] and r["y_shape"] == [2, 2, 1024]
    for r in by_setup["pipeline-recompute"]:
        assert (r["what_ran"], r["would_run"]) == ("none", "none")
    for r in by_setup["recompute-rules"]:
        assert (r["kept"], r["kept_jit"]) == ("selective", "none")
    for r in by_setup["checkpoint"]:
        assert r["loaded_step"] == 100
    for name in ("pipeline-runtime", "gpt", "finalizer-net"):  # finalizer-net: its jit train_step, called
        assert all(r["loss_finite"] for r in by_setup[name])


# ---------------------------------------------------------------- shown outputs
def _pages_with(marker):
    return [p for p in pages() if marker in _read(p)]


def test_pages_quote_real_msdist_outputs():
    checked = {p: cli_outputs.check_page(_read(p), p) for p in _pages_with("<!-- msdist-excerpt:")}
    assert sum(checked.values()) >= 4, checked


def test_outputs_regenerated_at_build_time_come_from_commands_that_run():
    for path in _pages_with(cli_outputs.MARKER):
        text = _read(path)
        expanded = cli_outputs.expand(text, path)
        for start, stop, body in cli_outputs.blocks(expanded):
            commands = [line for line in body if line.startswith("$ ")]
            assert commands and len(body) > len(commands), (path, body)  # every command printed something


def test_readme_outputs_equal_real_runs():
    readme = _read("README.md")
    shown = cli_outputs.blocks(readme)
    assert shown, "the README shows no regenerated msdist output"
    real = cli_outputs.blocks(cli_outputs.expand(readme, "README.md"))
    for (_, _, was), (_, _, now) in zip(shown, real):
        assert [l.rstrip() for l in was] == [l.rstrip() for l in now], (
            "README.md shows an msdist output that changed: paste the new one (python -c 'import sys; "
            "sys.path.insert(0, \"docs/hooks\"); import cli_outputs; print(cli_outputs.expand(open(\"README.md\")"
            ".read()))')")


# ---------------------------------------------------------------- the site's generated parts, the README
def test_cli_reference_documents_every_command():
    import typer.main

    from mscli.main import app

    text = cli_reference.render()
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="msdist")
    for name in root.list_commands(ctx):
        assert f"`msdist {name}`" in text
        command = root.get_command(ctx, name)
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in getattr(param, "opts", []):
                if opt.startswith("--"):
                    assert opt in text, (name, opt)
    assert "`msdist checkpoint reshard`" in text


def test_readme_is_short_and_its_quick_start_is_what_ci_runs():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert QUICK_START in readme and QUICK_START in _read(".ci/run")
    assert "pip install -e . && msdist verify" in readme
    assert "mkdocs build --strict" in _read(".ci/run")


def test_nav_pages_exist_and_pictures_are_shown():
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh.read().replace("!!python", "#"))

    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    generated = {"cli.md"}
    for page in walk(config["nav"]):
        assert page in generated or os.path.exists(os.path.join(ROOT, "docs", page)), page
    shown = "".join(_read(p) for p in pages())
    for svg in ("plan-grid.svg", "plan-memory.svg", "plan-schedule.svg", "verify-bandwidth.svg"):
        assert f"]({svg})" in shown, svg
