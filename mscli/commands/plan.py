"""``msdist plan``: which ranks form which groups, computed without any device."""

from __future__ import annotations

import os
from typing import Optional

import typer

from mindscience.distributed.topology.plan import DEFAULT_HCCL_BUFFSIZE_MB, build_plan, rank_plan

from .. import render, render_cost
from ..errors import UsageError, check_format, check_output_folder, user_errors
from ..layouts import load_with_sections, resolve_model


def _split_keys(groups: Optional[str]) -> list[str]:
    if not groups:
        return []
    return [k.strip() for k in groups.split(",") if k.strip()]


def workload_for(path, sections: dict, model: Optional[str]):
    """The workload of a plan: the layout file's sections, with ``--model``'s file over them.

    A section the model file lacks (say ``cluster:``) comes from the layout file. None when
    neither names a model.
    """
    from mindscience.distributed.costmodel import load_workload, workload_from_mapping

    workload = workload_from_mapping(sections, str(path))
    if model is not None:
        workload = load_workload(resolve_model(model), base=workload)
    return workload if workload.model is not None else None


def hccl_buffsize(value: Optional[int]) -> int:
    """``--hccl-buffsize``, else the ``HCCL_BUFFSIZE`` variable, else 200 (MB)."""
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
    hccl_buffsize_mb: Optional[int] = typer.Option(
        None, "--hccl-buffsize", help="HCCL_BUFFSIZE in MB for the memory estimate (default: env or 200)."
    ),
    model: Optional[str] = typer.Option(
        None, "--model", "-m",
        help="Model file or preset (gpt3-175b, gqa-7b, sci-transformer-s): adds per-stage memory and "
        "per-step communication estimates. A 'model:' section in the layout file does the same.",
    ),
) -> None:
    """Print the rank-to-group plan of a layout (no device, no MindSpore needed)."""
    with user_errors():
        check_format(fmt)
        if hccl_buffsize_mb is not None and hccl_buffsize_mb < 1:
            raise UsageError(f"--hccl-buffsize {hccl_buffsize_mb} is invalid: expected a positive number of MB.")
        buffsize = hccl_buffsize(hccl_buffsize_mb)
        spec, path, sections = load_with_sections(layout)
        workload = workload_for(path, sections, model)
        extra = _split_keys(groups)
        if rank is not None:
            data = rank_plan(spec, rank, extra, buffsize)
        else:
            data = build_plan(spec, extra, buffsize)
        if workload is not None:
            from mindscience.distributed.costmodel import estimate

            data.update(estimate(spec, workload, buffsize))
        if svg:
            check_output_folder("--svg", svg)
    # With --format json the SVG still shows the human view; only stdout changes.
    echo = fmt == "rich"
    tables = render_cost.cost_view(data, show_all) if (echo or svg) else []
    if rank is not None:
        render.render_rank(data, svg, echo=echo, extra=tables)
    else:
        render.render_plan(data, str(path), show_all, svg, echo=echo, extra=tables)
    if not echo:
        render.print_json(data)
