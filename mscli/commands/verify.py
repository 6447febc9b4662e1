"""``msdist verify``: launch a layout's ranks with msrun and check correctness and bandwidth.

The parent never imports MindSpore: it builds a spec (see ``mscli.verify_report``),
starts the ranks through the harness launcher (msrun is the distributed engine), shows
progress, and turns the per-rank JSON into one report.
"""

from __future__ import annotations

import os
import shlex
from typing import Optional

import typer

from .. import pictures, render
from ..errors import EXIT_FAILED, UsageError, check_output_file, user_errors
from ..layouts import load
from .. import verify_report as vr

DEFAULT_TIMEOUT_S = 300
QUICK_SIZE = 4096
# A CPU rank holds ~0.4-1.5 GB (MindSpore runtime + buffers); keep a margin.
CPU_RANK_MB = 700
MAX_LOCAL_RANKS = 64


def _local_capacity() -> int:
    """How many CPU ranks this machine can hold at once, from its available memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return max(1, min(MAX_LOCAL_RANKS, int(line.split()[1]) // 1024 // CPU_RANK_MB))
    except OSError:
        pass
    return MAX_LOCAL_RANKS


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


def _plan_launch(layout, nodes, node_rank, master_addr, master_port, local, loopback_nodes):
    """Decide where the ranks run; raise UsageError when this machine cannot run them."""
    world = layout.world_size
    if loopback_nodes and nodes:
        raise UsageError("--loopback-nodes simulates nodes on this machine: drop --nodes/--node-rank/--master-addr.")
    if nodes:
        if nodes < 1 or world % nodes:
            raise UsageError(f"--nodes {nodes} is invalid: expected a divisor of the world size {world}.")
        if node_rank is None or not 0 <= node_rank < nodes:
            raise UsageError(f"--node-rank {node_rank} is invalid: expected 0..{nodes - 1} (this node's index).")
        if not master_addr:
            raise UsageError("--nodes needs --master-addr HOST: the address of the node with rank 0.")
        if nodes > 1 and node_rank > 0 and master_port is None:
            raise UsageError("--node-rank > 0 needs --master-port P: the port the node with rank 0 uses.")
        return {"mode": "cluster", "local": world // nodes}
    if loopback_nodes:
        if loopback_nodes < 1 or world % loopback_nodes:
            raise UsageError(f"--loopback-nodes {loopback_nodes} is invalid: expected a divisor of {world}.")
    run_local = local or layout.backend == "cpu" or loopback_nodes
    if not run_local and layout.num_nodes > 1:
        raise UsageError(
            f"layout {layout.name or ''} has {world} ranks on {layout.num_nodes} nodes: run "
            "msdist verify on every node with --nodes N --node-rank I --master-addr HOST, "
            "or pass --local to run it on this machine's CPU."
        )
    if run_local:
        capacity = _local_capacity()
        if world > capacity:
            raise UsageError(
                f"world_size {world} is larger than this machine can run with --local "
                f"(about {capacity} CPU ranks with its memory): use a smaller layout or "
                "run on the cluster with --nodes."
            )
    return {"mode": "loopback" if loopback_nodes else "local", "local": world // (loopback_nodes or 1)}


def _env(local: bool, layout) -> dict:
    env = {}
    if local or layout.backend == "cpu":
        env["MSDIST_DEVICE_TARGET"] = "CPU"
    return env


def _dry_run(layout, nodes, master_addr, master_port, plan, log_dir) -> list[str]:
    from mindscience.distributed.harness import build_msrun_command

    count = nodes or 1
    port = master_port or 8118
    addr = master_addr or "127.0.0.1"
    lines = []
    for node in range(count):
        cmd = build_msrun_command(
            layout.world_size,
            spec_path=os.path.join(log_dir, "spec.json"),
            out_dir=os.path.join(log_dir, "results"),
            log_dir=log_dir,
            master_port=port,
            local_worker_num=plan["local"],
            node_rank=node,
            master_addr=addr,
        )
        lines.append(f"# node {node}\n" + shlex.join(cmd))
    return lines


class _ProgressView:
    """A Rich progress display of every rank's checks, on stderr."""

    def __init__(self, world: int, total: int, enabled: bool):
        self.progress = None
        if not enabled:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]rank {task.fields[rank]:>3}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=render.stderr_console(),
            transient=True,
        )
        self.tasks = {}
        shown = list(range(world))[:16]  # a very wide world would flood the screen
        for rank in shown:
            self.tasks[rank] = self.progress.add_task("", total=total, rank=rank, status="starting")

    def __enter__(self):
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.__exit__(*exc)

    def update(self, snapshot: dict) -> None:
        if not self.progress:
            return
        for rank, state in snapshot.get("ranks", {}).items():
            task = self.tasks.get(int(rank))
            if task is None:
                continue
            status = state.get("status") or "pending"
            label = f"{status} {state.get('current') or ''}".strip()
            self.progress.update(task, completed=state.get("done", 0), status=label)


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
        plan = None if saved else _plan_launch(spec_layout, nodes, node_rank, master_addr, master_port, local, loopback_nodes)
        if master_port is not None and not 1 <= master_port <= 65535:
            raise UsageError(f"--master-port {master_port} is invalid: expected 1..65535.")
        run_dir = os.path.abspath(log_dir or os.path.join("msdist_logs", "verify"))
        if dry_run and not saved:
            for line in _dry_run(spec_layout, nodes or loopback_nodes, master_addr, master_port, plan, run_dir):
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
    from mindscience.distributed.harness import LaunchError, launch, launch_local_multinode
    from mindscience.distributed.harness.worker import GATHERED_FILE

    env = _env(local, layout)
    world = layout.world_size
    view = _ProgressView(plan["local"] if plan["mode"] == "cluster" else world, len(spec["checks"]),
                         enabled=fmt == "rich")
    spec = {**spec, "gather": plan["mode"] == "cluster" and nodes > 1}
    if log_dir:  # a report from an earlier run in the same folder must not be read as this one's
        stale = os.path.join(os.path.abspath(log_dir), "results", GATHERED_FILE)
        if os.path.exists(stale):
            os.remove(stale)
    with user_errors():
        try:
            with view:
                if plan["mode"] == "loopback":
                    result = launch_local_multinode(spec, world, loopback_nodes, master_port=master_port,
                                                    timeout=timeout, log_dir=log_dir, env=env,
                                                    on_progress=view.update)
                elif plan["mode"] == "cluster":
                    result = launch(spec, world, local_worker_num=plan["local"], node_rank=node_rank,
                                    master_addr=master_addr, master_port=master_port, timeout=timeout,
                                    log_dir=log_dir, env=env, on_progress=view.update)
                else:
                    result = launch(spec, world, master_port=master_port, timeout=timeout, log_dir=log_dir,
                                    env=env, on_progress=view.update)
        except LaunchError as err:
            raise UsageError(str(err)) from None
    ranks = dict(result.ranks)
    if plan["mode"] == "cluster":
        if node_rank:
            render.stderr_console().print(
                f"node {node_rank}: {'ok' if result.ok else 'FAILED'}; node 0 prints the report."
            )
            if not result.ok:
                raise typer.Exit(EXIT_FAILED)
            return None
        ranks.update(_gathered(result.log_dir))
    failures = [
        {"rank": f["rank"], "reason": f"{f.get('kind', 'error')}: {f['reason']}", "log_tail": f.get("log_tail", "")}
        for f in result.failures
    ]
    if plan["mode"] == "loopback":
        # The simulated nodes hold world / N ranks each: the report marks the groups that span them.
        from dataclasses import replace

        layout = replace(layout, devices_per_node=world // loopback_nodes)
    report = vr.build_report(layout, ranks, failures, min_busbw, result.duration_s)
    report["log_dir"] = result.log_dir
    report["command"] = result.command
    return report


def _gathered(run_dir: str) -> dict:
    """Results of other nodes' ranks, gathered to rank 0 over the backend by the worker."""
    import json

    from mindscience.distributed.harness.worker import GATHERED_FILE

    path = os.path.join(run_dir, "results", GATHERED_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return {int(k): v for k, v in json.load(fh).items()}
