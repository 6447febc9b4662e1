"""``msdist plan``: which ranks form which groups, computed without any device."""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

import typer

from mindscience.distributed.topology.plan import DEFAULT_HCCL_BUFFSIZE_MB, build_plan, rank_plan

from .. import pictures, render, render_cost, render_schedule
from ..errors import UsageError, check_format, check_output_file, user_errors, write_error
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


def apply_cluster(workload, device: Optional[str] = None, device_memory_gb: Optional[float] = None,
                  calibrate: Optional[str] = None):
    """The workload with the command line's cluster options, and where each cluster value came from.

    ``--device`` re-fills from its preset every value the file did not set;
    ``--device-memory-gb`` overrides the memory; ``--calibrate report.json`` takes compute,
    bandwidths and latencies from a ``msdist verify`` report. Returns ``(workload,
    sources)`` (:func:`~mindscience.distributed.costmodel.calibrate.cluster_sources`).
    """
    from dataclasses import replace

    from mindscience.distributed.costmodel.calibrate import calibrate as calibrated, cluster_sources, read_report
    from mindscience.distributed.costmodel.spec import ClusterSpec

    cluster, explicit = workload.cluster, set(workload.cluster_keys)
    if device is not None:
        kept = {k: getattr(cluster, k) for k in explicit if k != "device"}
        cluster = ClusterSpec(device=device, **kept)
    sources = cluster_sources(cluster, explicit)
    if device_memory_gb is not None:
        if not 0 < device_memory_gb < math.inf:
            raise UsageError(f"--device-memory-gb {device_memory_gb} is invalid: expected a finite number of "
                             "GiB > 0, e.g. 64.")
        cluster = replace(cluster, device_memory_gb=device_memory_gb)
        sources["device_memory_gb"] = "--device-memory-gb"
    if calibrate is not None:
        cluster, sources = calibrated(cluster, read_report(calibrate), calibrate, sources)
    return replace(workload, cluster=cluster), sources


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


def _picture(data, spec, extra, buffsize, rank, svg, png, color_by):
    """What ``--svg`` / ``--png`` draw (checked before anything is printed), or None.

    With ``--rank`` the whole world is drawn, that rank outlined.
    """
    outputs = [(path, fmt) for path, fmt in ((svg, "svg"), (png, "png")) if path]
    if not outputs:
        if color_by is not None:
            raise UsageError(f"--color-by {color_by} colours a picture: add --svg FILE or --png FILE.")
        return None
    for path, fmt in outputs:
        check_output_file(f"--{fmt}", path, (f".{fmt}",))
    pictures.require(f"--{outputs[0][1]}")
    whole = data
    if rank is not None:
        whole = build_plan(spec, extra, buffsize)
        whole.update({k: data[k] for k in ("model", "memory", "communication", "time", "schedule") if k in data})
    return whole, outputs, pictures.color_axis(whole, color_by), rank


def with_virtual_stages(workload, virtual_stages: Optional[int]):
    """The workload priced with ``--virtual-stages`` (None: as its training section says).

    ``workload`` None (no model) stays None: then the option only shapes ``--schedule``.

    Raises:
        UsageError: ``virtual_stages < 1``.
    """
    from dataclasses import replace

    if virtual_stages is None:
        return workload
    if virtual_stages < 1:
        raise UsageError(f"--virtual-stages {virtual_stages} is invalid: expected at least 1 model chunk per "
                         "pipeline rank.")
    if workload is None:
        return None
    return replace(workload, training=replace(workload.training, virtual_pipeline_stages=virtual_stages))


def with_moe_imbalance(workload, imbalance: Optional[float]):
    """The workload priced with ``--moe-imbalance`` (None: the training section's, default 1.0).

    Raises:
        UsageError: a factor below 1, or the option without a MoE model.
    """
    from dataclasses import replace

    if imbalance is None:
        return workload
    if not imbalance >= 1:
        raise UsageError(f"--moe-imbalance {imbalance} is invalid: expected a factor >= 1, the busiest rank's "
                         "routed tokens over the mean (1.0: balanced).")
    if workload is None or not workload.model.is_moe:
        raise UsageError("--moe-imbalance needs a mixture-of-experts model (num_moe_experts), e.g. --model "
                         "mixtral-8x7b.")
    return replace(workload, training=replace(workload.training, moe_imbalance=imbalance))


def _pipeline_data(data, spec, schedule, microbatches, virtual_stages, workload=None) -> None:
    """The embedding groups (pp > 1) and, with ``--schedule``, the schedule data.

    The schedule's virtual stages: ``--virtual-stages``, else for ``interleaved`` the
    model's ``training.virtual_pipeline_stages``, so the timeline and the step time
    describe the same schedule.
    """
    from mindscience.distributed.pipeline.plan import embedding_groups, schedule_data
    from mindscience.distributed.pipeline.schedules import ScheduleError

    if spec.pp > 1:
        data["embedding_groups"] = embedding_groups(spec)
    if schedule is None:
        if microbatches != 8 or (virtual_stages is not None and workload is None):
            raise UsageError("--microbatches and --virtual-stages describe a schedule: add --schedule "
                             "1f1b, gpipe or interleaved (--virtual-stages also prices a --model's step time).")
        return
    if virtual_stages is None:
        chunks = workload.training.virtual_pipeline_stages if workload is not None else 1
        virtual_stages = chunks if schedule == "interleaved" else 1
    try:
        data["schedule"] = schedule_data(spec.pp, schedule, microbatches, virtual_stages)
    except ScheduleError as err:
        raise UsageError(f"--schedule: {err}") from None
    if workload is not None:
        _stage_layers(data, workload, spec.pp, virtual_stages)


def _stage_layers(data, workload, pp: int, virtual_stages: int) -> None:
    """The model's layers per model stage beside the schedule, and a note when they differ.

    The timeline's durations are the same for every stage (a forward 1 unit, a backward
    2); with unequal stages a stage's actions really take its layers / the mean as long.
    """
    from dataclasses import replace

    from mindscience.distributed.costmodel.errors import ModelConstraintError
    from mindscience.distributed.costmodel.params import model_stage_layers

    training = replace(workload.training, virtual_pipeline_stages=virtual_stages)
    try:
        layers = model_stage_layers(workload.model, training, pp)
    except ModelConstraintError:
        return  # the estimate above already reported the constraint
    sched = data["schedule"]
    sched["stage_layers"] = layers
    if len(set(layers)) > 1:
        sched["layer_timeline"], sched["layer_makespan"] = layer_timeline(sched, layers)
        busiest = max(range(len(layers)), key=lambda k: layers[k])
        data.setdefault("notes", []).append(
            f"--schedule: the model stages hold unequal layers {layers}: the unit timeline gives every action "
            f"the same duration; 'layer_timeline' (printed below it) replays the same order with a forward "
            f"of model stage k lasting layers[k] units and a backward twice that, and model stage {busiest} "
            f"({layers[busiest]} layers) paces the pipeline, as the step time prices it. The --svg picture "
            "draws the unit timeline.")


def layer_timeline(sched: dict, layers: list) -> tuple[list, int]:
    """The schedule's per-rank compute order replayed with durations in layers.

    A forward of model stage ``g`` lasts ``layers[g]`` units, a backward ``2 * layers[g]``;
    it starts when its rank is free and its inputs are there (the forward of ``g - 1``;
    the own forward and the backward of ``g + 1``). Transfers take no time and do not
    block, unlike the unit timeline's rendezvous: a picture of where the larger stages
    hold the others up, not a replay of the runtime.

        >>> s = {"stages": 2, "virtual_stages": 1, "timeline": [
        ...     [{"kind": "F", "microbatch": 0, "chunk": 0}, {"kind": "B", "microbatch": 0, "chunk": 0}],
        ...     [{"kind": "F", "microbatch": 0, "chunk": 0}, {"kind": "B", "microbatch": 0, "chunk": 0}]]}
        >>> [[(e["start"], e["end"]) for e in rank] for rank in layer_timeline(s, [1, 3])[0]], layer_timeline(s, [1, 3])[1]
        ([[(0, 1), (10, 12)], [(1, 4), (4, 10)]], 12)
    """
    p, stages = sched["stages"], sched["stages"] * sched["virtual_stages"]
    order = [[(e["kind"], e["microbatch"], e["chunk"]) for e in rank] for rank in sched["timeline"]]
    end, clock, pos = {}, [0] * p, [0] * p
    out = [[] for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(order[r]):
                kind, mb, chunk = order[r][pos[r]]
                g = chunk * p + r
                deps = [("F", mb, g - 1)] if kind == "F" and g > 0 else []
                if kind == "B":
                    deps = [("F", mb, g)] + ([("B", mb, g + 1)] if g < stages - 1 else [])
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                clock[r] = end[(kind, mb, g)] = start + layers[g] * (1 if kind == "F" else 2)
                out[r].append({"kind": kind, "microbatch": mb, "chunk": chunk, "start": start, "end": clock[r]})
                pos[r] += 1
                progressed = True
    return out, max(clock, default=0)


def plan(
    layout: Optional[str] = typer.Argument(
        None, help="Layout YAML file or bundled layout name (default: the 4-rank CPU layout)."
    ),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Show only this rank and its groups."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich (tables) or json (stdout holds only JSON)."),
    groups: Optional[str] = typer.Option(
        None, "--groups", "-g", help="Extra axis combinations, comma-separated, e.g. tp-cp,tp-dp-cp or edp-ep (expert axes: etp, ep, edp)."
    ),
    show_all: bool = typer.Option(False, "--all", help="Print every rank and group, even for large worlds."),
    svg: Optional[str] = typer.Option(
        None, "--svg", help="Also draw the device grid (and memory per stage, the schedule) to FILE.svg."
    ),
    png: Optional[str] = typer.Option(None, "--png", help="The same picture as --svg, to FILE.png."),
    color_by: Optional[str] = typer.Option(
        None, "--color-by", help="Colour the grid's devices by their group on tp, cp, dp, pp or a listed group such as ep, "
        "edp or etp-ep (default: the innermost axis larger than 1)."
    ),
    svg_table: Optional[str] = typer.Option(None, "--svg-table", help="Also save the terminal tables to FILE.svg."),
    hccl_buffsize_mb: Optional[int] = typer.Option(
        None, "--hccl-buffsize", help="HCCL_BUFFSIZE in MB for the memory estimate (default: env or 200)."
    ),
    model: Optional[str] = typer.Option(
        None, "--model", "-m",
        help="Model file or preset (gpt3-175b, gqa-7b, llama3-405b, bloom-176b, tiny-gpt, tiny-llama, "
        "sci-transformer-s; MoE: mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, tiny-moe): adds per-stage memory and "
        "per-step communication estimates (and the MoE rows: experts, expert memory, all-to-all). A 'model:' "
        "section in the layout file does the same.",
    ),
    moe_imbalance: Optional[float] = typer.Option(
        None, "--moe-imbalance", help="MoE: the busiest rank's routed tokens over the mean (>= 1; multiplies its "
        "expert FLOPs, dispatched activations and all-to-all bytes; default training.moe_imbalance, 1.0)."),
    schedule: Optional[str] = typer.Option(
        None, "--schedule", help="Pipeline schedule to show: 1f1b, gpipe or interleaved (per-stage "
        "timeline, bubble, activations in flight; JSON key 'schedule')."),
    microbatches: int = typer.Option(8, "--microbatches", help="Micro-batches per step for --schedule."),
    virtual_stages: Optional[int] = typer.Option(
        None, "--virtual-stages", help="Model chunks per pipeline rank: the interleaved schedule --schedule "
        "interleaved draws and, with a model, the one the step time is priced for (overrides "
        "training.virtual_pipeline_stages; default: the model's, else 1)."),
    calibrate: Optional[str] = typer.Option(
        None, "--calibrate", help="A `msdist verify --format json` report: take compute TFLOP/s, bandwidths "
        "and latencies from it (what it lacks stays as configured; the output says which came from where).",
    ),
) -> None:
    """Print the rank-to-group plan of a layout (no device, no MindSpore needed)."""
    with user_errors():
        check_format(fmt)
        if hccl_buffsize_mb is not None and hccl_buffsize_mb < 1:
            raise UsageError(f"--hccl-buffsize {hccl_buffsize_mb} is invalid: expected a positive number of MB.")
        buffsize = hccl_buffsize(hccl_buffsize_mb)
        spec, path, sections = load_with_sections(layout)
        workload = with_virtual_stages(workload_for(path, sections, model), virtual_stages)
        workload = with_moe_imbalance(workload, moe_imbalance)
        extra = _split_keys(groups)
        if rank is not None:
            data = rank_plan(spec, rank, extra, buffsize)
        else:
            data = build_plan(spec, extra, buffsize)
        if workload is None and calibrate is not None:
            raise UsageError("--calibrate needs a model: add --model FILE or a 'model:' section to the layout.")
        if workload is not None:
            from mindscience.distributed.costmodel import estimate

            workload, sources = apply_cluster(workload, calibrate=calibrate)
            data.update(estimate(spec, workload, buffsize))
            data["model"]["cluster_sources"] = sources
        _pipeline_data(data, spec, schedule, microbatches, virtual_stages, workload)
        if svg_table:
            check_output_file("--svg-table", svg_table, (".svg",))
        picture = _picture(data, spec, extra, buffsize, rank, svg, png, color_by)
    # With --format json the pictures still show the human view; only stdout changes.
    echo = fmt == "rich"
    tables = render_cost.cost_view(data, show_all) if (echo or svg_table) else []
    if echo or svg_table:
        tables += render_schedule.schedule_view(data)
    with user_errors():
        try:
            if rank is not None:
                render.render_rank(data, svg_table, echo=echo, extra=tables)
            else:
                render.render_plan(data, str(path), show_all, svg_table, echo=echo, extra=tables)
        except OSError as err:  # checked above; a disk can still fill up or a folder vanish
            if not svg_table:
                raise
            raise write_error("--svg-table", svg_table, err) from None
    if picture:
        with user_errors():
            pictures.save_plan(*picture)
    if not echo:
        render.print_json(data)
    for note in data.get("notes", []):  # stderr in both formats: stdout may hold only JSON
        sys.stderr.write(f"msdist: note: {note}\n")
