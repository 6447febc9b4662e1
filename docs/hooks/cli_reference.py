"""MkDocs hook: the CLI reference page (``cli.md``), generated from the Typer app at build time.

It walks ``typer.main.get_command(mscli.main.app)`` (every command and sub-command with
its arguments and options as ``msdist --help`` shows them), so the page cannot drift from
the code: nothing is copied by hand.
"""

from __future__ import annotations

import inspect
import re


PAGE = "cli.md"


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell."""
    text = re.sub(r"\s+", " ", text or "").strip()
    return text.replace("|", "\\|")


def _param_rows(command, ctx) -> list:
    """One table row per argument and option: its names (and value type) and help (and default)."""
    rows = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            names = f"`{param.name.upper()}`" + ("" if param.required else " (optional)")
            help_text = getattr(param, "help", None) or ""
        else:
            record = param.get_help_record(ctx)
            if record is None:
                continue
            names, help_text = f"`{record[0]}`", record[1]
        rows.append(f"| {_cell(names)} | {_cell(help_text)} |")
    return rows


def _section(command: click.Command, path: list, out: list) -> None:
    name = " ".join(path)
    ctx = command.context_class(command, info_name=path[-1])
    level = "#" * min(len(path), 4)
    out.append(f"{level} `{name}`\n")
    help_text = inspect.cleandoc(command.help or "")
    if help_text:
        out.append(help_text + "\n")
    usage = " ".join(command.collect_usage_pieces(ctx))
    out.append(f"```text\n{name} {usage}\n```\n")
    if hasattr(command, "list_commands"):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                _section(sub, [*path, sub_name], out)
        return
    rows = _param_rows(command, ctx)
    if rows:
        out.append("| argument / option | meaning |\n|---|---|")
        out.extend(rows)
        out.append("")


def render() -> str:
    """The Markdown of the CLI reference."""
    import typer.main

    from mscli.main import app

    root = typer.main.get_command(app)
    out = ["# CLI reference\n",
           "Generated from the Typer app (`mscli.main.app`) when the site is built: this is what "
           "`msdist COMMAND --help` prints. The guide pages show each command at work: "
           "[plan](plan.md), [suggest](suggest.md), [verify](verify.md), [train](train.md), "
           "[checkpoint](checkpoints.md), [pictures](pictures.md).\n"]
    ctx = root.context_class(root, info_name="msdist")
    for sub_name in root.list_commands(ctx):
        sub = root.get_command(ctx, sub_name)
        if sub is not None and not sub.hidden:
            _section(sub, ["msdist", sub_name], out)
    return "\n".join(out) + "\n"


def on_files(files, config):
    # imported here: the tests render the page with the test extra only (no mkdocs)
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
