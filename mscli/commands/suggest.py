"""``msdist suggest``: which layouts of N devices fit a model, fastest communication first."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Optional

import typer

from mindscience.distributed.topology import BACKENDS, Layout

from .. import render, render_cost
from ..errors import EXIT_FAILED, UsageError, check_format, check_output_folder, user_errors
from ..layouts import resolve_model
from .plan import hccl_buffsize


def _best_layout(result: dict, workload, backend: str) -> str:
    """The text of a layout file for the best candidate, with the workload's sections."""
    from mindscience.distributed.costmodel.spec import workload_sections
    from mindscience.distributed.topology.layout_file import layout_to_yaml

    best = result["candidates"][0]
    name = f"{workload.model.name}-tp{best['tp']}-cp{best['cp']}-dp{best['dp']}-pp{best['pp']}"
    layout = Layout(world_size=result["world_size"], tp=best["tp"], cp=best["cp"], pp=best["pp"],
                    dp=best["dp"], order=best["order"], devices_per_node=result["devices_per_node"],
                    name=name, backend=backend)
    nodes = result["world_size"] // result["devices_per_node"]
    return layout_to_yaml(
        layout,
        description=f"msdist suggest's best layout for {workload.model.name} on {nodes} node(s) x "
        f"{result['devices_per_node']} devices",
        sections=workload_sections(workload),
        comment=(f"Written by: msdist suggest --model {workload.model.name} --world {result['world_size']}\n"
                 f"Estimated communication {best['est_time_s']:.4g} s per step (bottleneck "
                 f"{best['bottleneck']}), peak {best['peak_bytes'] / 1024**3:.1f} GiB per rank."),
    )


def suggest(
    model: str = typer.Option(..., "--model", "-m", help="Model file or preset (gpt3-175b, gqa-7b, sci-transformer-s)."),
    world: int = typer.Option(..., "--world", "-w", help="Number of devices."),
    devices_per_node: Optional[int] = typer.Option(
        None, "--devices-per-node", "-d", help="Devices per node (default: the model file's cluster section, else 8)."),
    device_memory_gb: Optional[float] = typer.Option(
        None, "--device-memory-gb", help="Memory per device in GiB (default: the cluster section, else 64)."),
    top: int = typer.Option(10, "--top", "-k", help="Show the best K layouts."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich (a table) or json (stdout holds only JSON)."),
    write: Optional[str] = typer.Option(None, "--write", help="Save the best layout as a layout file."),
    backend: str = typer.Option("ascend", "--backend", help="backend: of the layout --write saves."),
) -> None:
    """Rank every (tp, cp, dp, pp) and order of N devices that fits the model (no device needed).

    Exit 1 when none fits, naming the closest layout and why.
    """
    from mindscience.distributed.costmodel import load_workload
    from mindscience.distributed.costmodel import suggest as search

    with user_errors():
        check_format(fmt)
        if world < 1:
            raise UsageError(f"--world {world} is invalid: expected a positive number of devices.")
        if devices_per_node is not None and (devices_per_node < 1 or world % devices_per_node):
            raise UsageError(f"--devices-per-node {devices_per_node} is invalid: expected a positive divisor "
                             f"of --world {world} (every node holds the same number of devices).")
        if device_memory_gb is not None and not device_memory_gb > 0:
            raise UsageError(f"--device-memory-gb {device_memory_gb} is invalid: expected a number of GiB > 0.")
        if top < 1:
            raise UsageError(f"--top {top} is invalid: expected at least 1.")
        if backend not in BACKENDS:
            raise UsageError(f"--backend {backend!r} is invalid: expected one of {', '.join(BACKENDS)}.")
        if write:
            check_output_folder("--write", write)
        workload = load_workload(resolve_model(model))
        if device_memory_gb is not None:
            workload = replace(workload, cluster=replace(workload.cluster, device_memory_gb=device_memory_gb))
        result = search(workload, world, devices_per_node, top, hccl_buffsize(None))
    if fmt == "json":
        render.print_json(result)
    else:
        render_cost.render_suggest(result, workload.model.name)
    if not result["candidates"]:
        render_cost.warn_nothing_fits(render_cost.nothing_fits_message(result))
        raise typer.Exit(EXIT_FAILED)
    if write:
        with open(write, "w", encoding="utf-8") as fh:
            fh.write(_best_layout(result, workload, backend))
        sys.stderr.write(f"msdist: wrote the best layout to {write} (msdist plan {write})\n")
