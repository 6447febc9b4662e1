"""``msdist plan``: which ranks form which groups, computed without any device."""

from __future__ import annotations

import os
from typing import Optional

import typer

from mindscience.distributed.topology.plan import DEFAULT_HCCL_BUFFSIZE_MB, build_plan, rank_plan

from .. import render
from ..errors import UsageError, user_errors
from ..layouts import load


def _split_keys(groups: Optional[str]) -> list[str]:
    if not groups:
        return []
    return [k.strip() for k in groups.split(",") if k.strip()]


def _buffsize(value: Optional[int]) -> int:
    if value is not None:
        return value
    env = os.environ.get("HCCL_BUFFSIZE")
    if env:
        try:
            return int(env)
        except ValueError:
            raise UsageError(
                f"HCCL_BUFFSIZE={env!r} is not an integer number of MB: unset it or set e.g. 200."
            ) from None
    return DEFAULT_HCCL_BUFFSIZE_MB


def plan(
    layout: Optional[str] = typer.Argument(
        None, help="Layout YAML file or bundled layout name (default: the 4-rank CPU layout)."
    ),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Show only this rank and its groups."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich (tables) or json (stdout holds only JSON)."),
    groups: Optional[str] = typer.Option(
        None, "--groups", "-g", help="Extra axis combinations, comma-separated, e.g. tp-cp,tp-dp-cp."
    ),
    show_all: bool = typer.Option(False, "--all", help="Print every rank and group, even for large worlds."),
    svg: Optional[str] = typer.Option(None, "--svg", help="Also save the human view as an SVG picture."),
    hccl_buffsize: Optional[int] = typer.Option(
        None, "--hccl-buffsize", help="HCCL_BUFFSIZE in MB for the memory estimate (default: env or 200)."
    ),
) -> None:
    """Print the rank-to-group plan of a layout (no device, no MindSpore needed)."""
    with user_errors():
        if fmt not in ("rich", "json"):
            raise UsageError(f"--format {fmt!r} is invalid: expected 'rich' or 'json'.")
        if hccl_buffsize is not None and hccl_buffsize < 1:
            raise UsageError(f"--hccl-buffsize {hccl_buffsize} is invalid: expected a positive number of MB.")
        buffsize = _buffsize(hccl_buffsize)
        spec, path = load(layout)
        extra = _split_keys(groups)
        if rank is not None:
            data = rank_plan(spec, rank, extra, buffsize)
        else:
            data = build_plan(spec, extra, buffsize)
        if svg:
            folder = os.path.dirname(os.path.abspath(svg))
            if not os.path.isdir(folder):
                raise UsageError(f"--svg {svg}: folder {folder} does not exist. Create it or pick another path.")
    # With --format json the SVG still shows the human view; only stdout changes.
    echo = fmt == "rich"
    if rank is not None:
        render.render_rank(data, svg, echo=echo)
    else:
        render.render_plan(data, str(path), show_all, svg, echo=echo)
    if not echo:
        render.print_json(data)
