"""The ``msdist`` command line: ``plan`` and ``suggest`` (no device needed), ``verify``, ``train`` and ``layouts``.

Heavy imports (MindSpore, the launcher) happen inside the commands that need them, so
``msdist plan`` starts fast.
"""

from __future__ import annotations

import typer

from .commands.checkpoint import app as checkpoint_app
from .commands.plan import plan
from .commands.suggest import suggest
from .commands.train import train

app = typer.Typer(
    name="msdist",
    help="Plan, build and validate parallel layouts (tp/cp/dp/pp) of distributed MindSpore training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("plan")(plan)
app.command("suggest")(suggest)
app.command("train")(train)
app.add_typer(checkpoint_app, name="checkpoint")


@app.command("layouts")
def layouts_command(
    fmt: str = typer.Option("rich", "--format", "-f", help="rich or json."),
) -> None:
    """List the layouts bundled in layouts/."""
    from . import render
    from .errors import check_format, user_errors
    from .layouts import bundled_layouts
    from mindscience.distributed.topology import load_layout

    with user_errors():
        check_format(fmt)
        rows = []
        for name, path in bundled_layouts().items():
            layout = load_layout(path)
            rows.append({**layout.to_dict(), "ep": layout.ep, "etp": layout.etp, "name": name,
                         "nodes": layout.num_nodes, "file": str(path)})
    if fmt == "json":
        render.print_json(rows)
    else:
        render.render_layout_list(rows)


def _register_verify() -> None:
    try:
        from .commands.verify import verify
    except ModuleNotFoundError as err:  # verify is optional until it lands
        if err.name != "mscli.commands.verify":
            raise
        return
    app.command("verify")(verify)


_register_verify()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
