"""``msdist verify``: launch a layout's ranks with msrun and check correctness and bandwidth.

The parent never imports MindSpore: it builds a spec (see ``mscli.verify_report``),
starts the ranks through the harness launcher (msrun is the distributed engine), shows
progress, and turns the per-rank JSON into one report.
"""

from __future__ import annotations

import os
from typing import Optional

import typer

from .. import pictures, render
from ..errors import EXIT_FAILED, UsageError, check_output_file, user_errors
from ..layouts import load
from .. import verify_report as vr
from ..ranks import all_ranks, dry_run_lines, failure_rows, launch_ranks, plan_launch

DEFAULT_TIMEOUT_S = 300
QUICK_SIZE = 4096


def parse_fault(text: Optional[str]) -> Optional[dict]:
    """``crash:RANK[:raise|segfault|exit]`` or ``hang:RANK[:SECONDS]`` -> a fault check."""
    if not text:
        return None
    parts = text.split(":")
    try:
        kind, rank = parts[0], int(parts[1])
    except (IndexError, ValueError):
        raise UsageError(f"--inject-fault {text!r} is invalid: expected crash:RANK[:mode] or hang:RANK[:seconds].") from None
    if kind == "crash":
        mode = parts[2] if len(parts) > 2 else "raise"
        return {"name": "fault.crash", "params": {"ranks": [rank], "mode": mode}}
    if kind == "hang":
        seconds = float(parts[2]) if len(parts) > 2 else 3600.0
        return {"name": "fault.hang", "params": {"ranks": [rank], "seconds": seconds}}
    raise UsageError(f"--inject-fault {text!r} is invalid: expected crash:RANK[:mode] or hang:RANK[:seconds].")


def verify(
    layout: Optional[str] = typer.Argument(None, help="Layout YAML file or bundled name (default: the 4-rank CPU layout)."),
    checks: str = typer.Option("correctness,bandwidth", "--checks", help="What to run: correctness, bandwidth or both."),
    mode: str = typer.Option("pynative,jit", "--mode", help="Execution modes of the correctness checks: pynative, jit, graph (comma-separated)."),
    quick: bool = typer.Option(False, "--quick", help="Bandwidth at one small size only."),
    min_bytes: str = typer.Option("1K", "--min-bytes", "-b", help="Smallest size of the sweep (nccl-tests -b)."),
    # Default: a latency point and a bandwidth point. On an oversubscribed CPU every call
    # costs ~40 ms of latency, so each extra size adds seconds; sweep wider with -b/-e/-f.
    max_bytes: str = typer.Option("256K", "--max-bytes", "-e", help="Largest size of the sweep (nccl-tests -e)."),
    factor: int = typer.Option(256, "--factor", "-f", help="Size multiplier between steps (nccl-tests -f)."),
    iters: int = typer.Option(3, "--iters", "-n", help="Timed iterations per size."),
    warmup: int = typer.Option(1, "--warmup", "-w", help="Untimed iterations per size."),
    dtype: str = typer.Option("float32", "--dtype", "-d", help="float32, float16 or bfloat16."),
    min_busbw: Optional[float] = typer.Option(None, "--min-busbw", help="Fail (exit 1) below this busbw (GB/s) at the largest size."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Stop every rank after this many seconds."),
    fmt: str = typer.Option("rich", "--format", help="rich (tables) or json (stdout holds only JSON)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Also write the JSON report to this file."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also draw bus bandwidth vs message size to FILE.svg or FILE.png (matplotlib: the plots extra)."),
    from_report: Optional[str] = typer.Option(None, "--from-report", help="Show (and --plot) a JSON report saved with --output instead of launching ranks."),
    local: bool = typer.Option(False, "--local", help="Run every rank on this machine's CPU, whatever the layout's backend."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Number of nodes of a cluster run."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's index (0 gathers and prints the report)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Address of the node with rank 0."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Scheduler port (default: a free one)."),
    loopback_nodes: Optional[int] = typer.Option(None, "--loopback-nodes", help="Simulate this many nodes on this machine over loopback."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the msrun command of every node and exit."),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Folder for msrun logs and per-rank results."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every correctness row, not only the summary and the failures."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Also train this model (file or preset, e.g. tiny-gpt) two steps at the "
        "layout and compare the losses with the dense model's on the same batches (summary family 'train')."),
    inject_fault: Optional[str] = typer.Option(None, "--inject-fault", hidden=True, help="Testing: crash:RANK[:mode] or hang:RANK[:s]."),
) -> None:
    """Launch the layout's ranks, check every group, mapping and layer, and measure bandwidth."""
    with user_errors():
        if fmt not in ("rich", "json"):
            raise UsageError(f"--format {fmt!r} is invalid: expected 'rich' or 'json'.")
        if timeout <= 0:
            raise UsageError(f"--timeout {timeout} is invalid: expected a positive number of seconds.")
        if output:
            check_output_file("--output", output)
        if plot:
            pictures.check_plot(plot)
        saved = vr.load_report(from_report) if from_report else None
        spec_layout, _ = load(layout)
        kinds = vr.parse_checks(checks)
        sizes = [QUICK_SIZE] if quick else vr.size_sweep(vr.parse_bytes(min_bytes), vr.parse_bytes(max_bytes), factor)
        modes = vr.parse_modes(mode)
        spec = vr.build_spec(spec_layout, kinds, sizes, iters, warmup, dtype, parse_fault(inject_fault),
                             modes=modes)
        if model is not None:
            spec["checks"].append(model_check(spec_layout, model, mode=modes))
        plan = None if saved else plan_launch(spec_layout, nodes, node_rank, master_addr, master_port, local,
                                              loopback_nodes)
        run_dir = os.path.abspath(log_dir or os.path.join("msdist_logs", "verify"))
        if dry_run and not saved:
            for line in dry_run_lines(spec_layout, nodes or loopback_nodes, master_addr, master_port, plan, run_dir):
                typer.echo(line)
            return
    report = saved or _run(spec, spec_layout, plan, fmt, timeout, local, nodes, node_rank, master_addr, master_port,
                  loopback_nodes, log_dir, min_busbw)
    if report is None:  # a non-zero node of a cluster: node 0 reports
        return
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            import json

            json.dump(report, fh, indent=2)
    if fmt == "json":
        render.print_json(report)
    else:
        render.render_verify(report, verbose=verbose)
    if plot:
        with user_errors():
            pictures.save_bandwidth(report, plot)
    if not report["ok"]:
        raise typer.Exit(EXIT_FAILED)


def _run(spec, layout, plan, fmt, timeout, local, nodes, node_rank, master_addr, master_port,
         loopback_nodes, log_dir, min_busbw):
    result = launch_ranks(spec, layout, plan, progress=fmt == "rich", timeout=timeout, local=local, nodes=nodes,
                          node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                          loopback_nodes=loopback_nodes, log_dir=log_dir)
    if plan["mode"] == "cluster" and node_rank:
        render.stderr_console().print(
            f"node {node_rank}: {'ok' if result.ok else 'FAILED'}; node 0 prints the report."
        )
        if not result.ok:
            raise typer.Exit(EXIT_FAILED)
        return None
    ranks = all_ranks(result, plan)
    world = layout.world_size
    if plan["mode"] == "loopback":
        # The simulated nodes hold world / N ranks each: the report marks the groups that span them.
        from dataclasses import replace

        layout = replace(layout, devices_per_node=world // loopback_nodes)
    report = vr.build_report(layout, ranks, failure_rows(result), min_busbw, result.duration_s)
    report["log_dir"] = result.log_dir
    report["command"] = result.command
    return report


def model_check(layout, model: str, mode=("jit",)) -> dict:
    """``train.dense_compare``: two training steps of GPTModel at the layout against the dense
    model on the same batches (family ``train`` of the summary), with the model file's
    training section (one micro-batch per dp rank and pipeline stage at least)."""
    from dataclasses import asdict

    from .train import model_and_options

    workload, opts = model_and_options(layout, model, steps=2, mode="jit" if "jit" in mode else "pynative")
    return {"name": "train.dense_compare", "params": {"model": asdict(workload.model),
                                                      "training": asdict(workload.training),
                                                      "options": opts.to_dict(), "steps": 2}}
