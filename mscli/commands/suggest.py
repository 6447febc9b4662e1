"""``msdist suggest``: which layouts of N devices fit a model, fastest training step first."""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from typing import Optional

import typer

from mindscience.distributed.costmodel.devices import describe_devices
from mindscience.distributed.topology import BACKENDS, Layout

from .. import render, render_cost
from ..errors import EXIT_FAILED, UsageError, check_format, check_output_file, user_errors, write_error
from ..layouts import resolve_model
from .plan import apply_cluster, hccl_buffsize, with_moe_imbalance


def parse_fix(text: Optional[str]) -> dict:
    """``"tp=8,cp=1"`` -> ``{"tp": 8, "cp": 1}`` (``{}`` without the option).

    Raises:
        UsageError: an empty pair (``--fix ,``), a pair that is not AXIS=SIZE, or an axis
            given twice (``tp=2,tp=4``: which one was meant is unknown).
    """
    fix: dict = {}
    if text is None:
        return fix
    for part in (p.strip() for p in text.split(",")):
        axis, equals, size = part.partition("=")
        axis = axis.strip()
        try:
            if not equals:
                raise ValueError(part)
            value = int(size)
        except ValueError:
            what = f"{part!r} is not AXIS=SIZE" if part else "it holds an empty pair"
            raise UsageError(f"--fix {text!r} is invalid: {what}; expected AXIS=SIZE pairs joined by commas, "
                             "e.g. tp=8,cp=1.") from None
        if axis in fix:
            raise UsageError(f"--fix {text!r} is invalid: {axis} is pinned twice ({axis}={fix[axis]} and "
                             f"{axis}={value}); give each axis once, e.g. --fix {axis}={value}.")
        fix[axis] = value
    return fix


def parse_sizes(text: Optional[str]) -> Optional[list]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (None without the option)."""
    if text is None:
        return None
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--micro-batch-sizes {text!r} is invalid: expected positive integers such as 1,2,4.")
    return sizes


def parse_zero_stages(text: Optional[str]) -> Optional[list]:
    """``"0,1,2,3"`` -> ``[0, 1, 2, 3]`` (None without the option).

    Raises:
        UsageError: not integers, or a stage outside 0-3.
    """
    if text is None:
        return None
    try:
        stages = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        stages = []
    if not stages or any(z not in (0, 1, 2, 3) for z in stages):
        raise UsageError(f"--zero-stages {text!r} is invalid: expected ZeRO stages among 0, 1, 2, 3 joined by "
                         "commas, e.g. 0,1,2,3.")
    return stages


# The layout backend a device preset runs on: what `--write` saves when `--backend` is not
# given. A cluster without a preset (the generic accelerator) keeps the historical `ascend`.
DEVICE_BACKENDS = {"ascend-910b": "ascend", "a100-80gb": "gpu", "h100-80gb": "gpu", "h200": "gpu", "cpu": "cpu"}


def device_backend(device: Optional[str]) -> str:
    """The ``backend:`` of a layout for devices of preset ``device`` (None: the generic accelerator).

        >>> device_backend("cpu"), device_backend("h100-80gb"), device_backend(None)
        ('cpu', 'gpu', 'ascend')
    """
    return DEVICE_BACKENDS.get(device or "", "ascend")


def _best_layout(result: dict, workload, backend: str) -> str:
    """The text of a layout file for the best candidate, with the workload's sections."""
    from mindscience.distributed.costmodel.spec import workload_sections
    from mindscience.distributed.topology.layout_file import layout_to_yaml

    best = result["candidates"][0]
    training = replace(workload.training, micro_batch_size=best["micro_batch_size"],
                       virtual_pipeline_stages=best["virtual_stages"], zero_stage=best["zero_stage"],
                       global_batch_size=best["micro_batch_size"] * best["dp"] * best["microbatches"])
    workload = replace(workload, training=training)
    name = f"{workload.model.name}-tp{best['tp']}-cp{best['cp']}-dp{best['dp']}-pp{best['pp']}"
    # A MoE model's layout carries its expert axes (ep, etp) as well.
    experts = {"ep": best["ep"], "etp": best["etp"]} if result.get("moe") else {}
    if experts:
        name += f"-ep{best['ep']}-etp{best['etp']}"
    layout = Layout(world_size=result["world_size"], tp=best["tp"], cp=best["cp"], pp=best["pp"],
                    dp=best["dp"], order=best["order"], devices_per_node=result["devices_per_node"],
                    name=name, backend=backend, **experts)
    nodes = result["world_size"] // result["devices_per_node"]
    return layout_to_yaml(
        layout,
        description=f"msdist suggest's best layout for {workload.model.name} on {nodes} node(s) x "
        f"{result['devices_per_node']} devices",
        sections=workload_sections(workload),
        comment=(f"Written by: msdist suggest --model {workload.model.name} --world {result['world_size']}\n"
                 f"Estimated step {best['step_time_s']:.4g} s ({best['tokens_per_s']:.4g} tokens/s, MFU "
                 f"{best['mfu']:.1%}); communication {best['est_time_s']:.4g} s per step (bottleneck "
                 f"{best['bottleneck']}), peak {best['peak_bytes'] / 1024**3:.1f} GiB per rank."),
    )


def suggest(
    model: str = typer.Option(..., "--model", "-m", help="Model file or preset (gpt3-175b, gqa-7b, llama3-405b, "
                              "bloom-176b, tiny-gpt, tiny-llama, sci-transformer-s; MoE: mixtral-8x7b, "
                              "qwen3-30b-a3b, deepseek-v3, tiny-moe)."),
    world: int = typer.Option(..., "--world", "-w", help="Number of devices."),
    devices_per_node: Optional[int] = typer.Option(
        None, "--devices-per-node", "-d", help="Devices per node (default: the model file's cluster section, else 8)."),
    device_memory_gb: Optional[float] = typer.Option(
        None, "--device-memory-gb", help="Memory per device in GiB (default: the cluster section, else 64)."),
    top: int = typer.Option(10, "--top", "-k", help="Show the best K layouts."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich (a table) or json (stdout holds only JSON)."),
    write: Optional[str] = typer.Option(None, "--write", help="Save the best layout as a layout file."),
    backend: Optional[str] = typer.Option(
        None, "--backend", help="backend: of the layout --write saves (default: the device model's: cpu for the "
        "cpu preset, gpu for the NVIDIA ones, else ascend)."),
    device: Optional[str] = typer.Option(
        None, "--device", help="Device preset filling the cluster values the model file leaves out: "
        + describe_devices() + "."),
    fix: Optional[str] = typer.Option(None, "--fix", help="Pin axis sizes, e.g. tp=8,cp=1; a MoE model's expert "
                                      "axes too, e.g. ep=8 or ep=8,etp=1 (else every ep dividing the experts and "
                                      "etp in {1, tp} are tried)."),
    micro_batch_sizes: Optional[str] = typer.Option(
        None, "--micro-batch-sizes", help="Search these micro-batch sizes too, e.g. 1,2,4 (each layout keeps its "
        "fastest; without a global_batch_size every layout trains max(sizes) x world samples per step)."),
    virtual_stages: Optional[int] = typer.Option(
        None, "--virtual-stages", help="Price the interleaved 1F1B schedule with V model chunks per pipeline rank."),
    zero_stages: Optional[str] = typer.Option(
        None, "--zero-stages", help="Search these ZeRO stages too, e.g. 0,1,2,3 (0 replicated, 1 optimizer state, "
        "2 + gradients, 3 + weights sharded over dp-cp; each layout keeps its fastest, ties to the lower memory; "
        "default: the model file's training.zero_stage)."),
    moe_imbalance: Optional[float] = typer.Option(
        None, "--moe-imbalance", help="MoE: the busiest rank's routed tokens over the mean (>= 1; multiplies its "
        "expert FLOPs, dispatched activations and all-to-all bytes; default training.moe_imbalance, 1.0)."),
    calibrate: Optional[str] = typer.Option(
        None, "--calibrate", help="A `msdist verify --format json` report: take compute TFLOP/s, bandwidths and "
        "latencies from it (what it lacks stays as configured; the output says which came from where)."),
) -> None:
    """Rank every (tp, cp, dp, pp) and order of N devices that fits the model by estimated step time.

    A mixture-of-experts model also searches its expert axes (ep a divisor of the experts,
    etp 1 or tp) and shows them as the ep/etp columns.

    The step time is compute + pipeline bubble + exposed communication of the busiest
    stage (docs/COST_MODEL.md); no device needed. Exit 1 when none fits, naming the
    closest layout and why.
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
        if top < 1:
            raise UsageError(f"--top {top} is invalid: expected at least 1.")
        if backend is not None and backend not in BACKENDS:
            raise UsageError(f"--backend {backend!r} is invalid: expected one of {', '.join(BACKENDS)}.")
        if write:
            check_output_file("--write", write)
        if virtual_stages is not None and virtual_stages < 1:
            raise UsageError(f"--virtual-stages {virtual_stages} is invalid: expected at least 1.")
        pinned, sizes, stages = parse_fix(fix), parse_sizes(micro_batch_sizes), parse_zero_stages(zero_stages)
        workload = with_moe_imbalance(load_workload(resolve_model(model)), moe_imbalance)
        workload, sources = apply_cluster(workload, device, device_memory_gb, calibrate)
        result = search(workload, world, devices_per_node, top, hccl_buffsize(None), fix=pinned,
                        micro_batch_sizes=sizes, virtual_stages=virtual_stages, zero_stages=stages)
        result["cluster"] = asdict(workload.cluster)
        result["cluster_sources"] = sources
    if fmt == "json":
        render.print_json(result)
    else:
        render_cost.render_suggest(result, workload.model.name)
    for note in result["notes"]:  # on stderr in both formats: stdout may hold only JSON
        sys.stderr.write(f"msdist: note: {note}\n")
    if not result["candidates"]:
        render_cost.warn_nothing_fits(render_cost.nothing_fits_message(result))
        raise typer.Exit(EXIT_FAILED)
    if write:
        with user_errors():
            try:
                with open(write, "w", encoding="utf-8") as fh:
                    fh.write(_best_layout(result, workload, backend or device_backend(workload.cluster.device)))
            except OSError as err:
                raise write_error("--write", write, err) from None
        sys.stderr.write(f"msdist: wrote the best layout to {write} (msdist plan {write})\n")
