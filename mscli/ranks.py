"""Launching a layout's ranks from the command line: shared by ``msdist verify`` and ``msdist train``.

Where the ranks run (this machine, simulated nodes over loopback, one node of a real
cluster), the msrun commands of ``--dry-run``, the Rich progress of every rank on stderr,
and the launch itself through the harness (timeouts, a killed or hung rank named, nothing
left running). The parent never imports MindSpore.
"""

from __future__ import annotations

import json
import os
import shlex

from . import render
from .errors import UsageError, user_errors

# A CPU rank holds ~0.4-1.5 GB (MindSpore runtime + buffers); keep a margin.
CPU_RANK_MB = 700
MAX_LOCAL_RANKS = 64


def local_capacity() -> int:
    """How many CPU ranks this machine can hold at once, from its available memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return max(1, min(MAX_LOCAL_RANKS, int(line.split()[1]) // 1024 // CPU_RANK_MB))
    except OSError:
        pass
    return MAX_LOCAL_RANKS


def plan_launch(layout, nodes, node_rank, master_addr, master_port, local, loopback_nodes,
                command: str = "verify") -> dict:
    """Decide where the ranks run: ``{"mode": local|loopback|cluster, "local": ranks here}``.

    Raises:
        UsageError: this machine cannot run them, or the cluster flags are incomplete.
    """
    world = layout.world_size
    if master_port is not None and not 1 <= master_port <= 65535:
        raise UsageError(f"--master-port {master_port} is invalid: expected 1..65535.")
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
            f"msdist {command} on every node with --nodes N --node-rank I --master-addr HOST, "
            "or pass --local to run it on this machine's CPU."
        )
    if run_local:
        capacity = local_capacity()
        if world > capacity:
            raise UsageError(
                f"world_size {world} is larger than this machine can run with --local "
                f"(about {capacity} CPU ranks with its memory): use a smaller layout or "
                "run on the cluster with --nodes."
            )
    return {"mode": "loopback" if loopback_nodes else "local", "local": world // (loopback_nodes or 1)}


def rank_env(local: bool, layout) -> dict:
    """Environment of the ranks: the CPU device for ``--local`` and CPU layouts."""
    env = {}
    if local or layout.backend == "cpu":
        env["MSDIST_DEVICE_TARGET"] = "CPU"
    return env


def dry_run_lines(layout, nodes, master_addr, master_port, plan, log_dir) -> list[str]:
    """``# node i`` and the msrun command line of every node (``--dry-run``)."""
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


class ProgressView:
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


def clear_stale(log_dir) -> None:
    """Remove a gathered report of an earlier run in ``log_dir`` (it must not read as this one's)."""
    from mindscience.distributed.harness.worker import GATHERED_FILE

    if log_dir:
        stale = os.path.join(os.path.abspath(log_dir), "results", GATHERED_FILE)
        if os.path.exists(stale):
            os.remove(stale)


def launch_ranks(spec: dict, layout, plan: dict, *, progress: bool, timeout: float, local: bool,
                 nodes, node_rank, master_addr, master_port, loopback_nodes, log_dir, on_progress=None):
    """Run ``spec`` on the layout's ranks as ``plan`` says, with the progress view on stderr.

    ``on_progress``, if given, also receives every harness snapshot (each rank's records
    so far among them), after the progress view.

    Returns:
        The harness's LaunchResult.

    Raises:
        UsageError: the job could not start (a port in use, msrun missing), as one line.
    """
    from mindscience.distributed import harness

    env = rank_env(local, layout)
    world = layout.world_size
    view = ProgressView(plan["local"] if plan["mode"] == "cluster" else world, len(spec["checks"]),
                        enabled=progress)
    spec = {**spec, "gather": plan["mode"] == "cluster" and nodes > 1}
    clear_stale(log_dir)

    def report(snapshot):
        view.update(snapshot)
        if on_progress is not None:
            on_progress(snapshot)

    with user_errors():
        try:
            with view:
                if plan["mode"] == "loopback":
                    return harness.launch_local_multinode(spec, world, loopback_nodes, master_port=master_port,
                                                          timeout=timeout, log_dir=log_dir, env=env,
                                                          on_progress=report)
                if plan["mode"] == "cluster":
                    return harness.launch(spec, world, local_worker_num=plan["local"], node_rank=node_rank,
                                          master_addr=master_addr, master_port=master_port, timeout=timeout,
                                          log_dir=log_dir, env=env, on_progress=report)
                return harness.launch(spec, world, master_port=master_port, timeout=timeout, log_dir=log_dir,
                                      env=env, on_progress=report)
        except harness.LaunchError as err:
            raise UsageError(str(err)) from None


def all_ranks(result, plan: dict) -> dict:
    """Every rank's result: this node's, plus on node 0 of a cluster the others' gathered ones."""
    ranks = dict(result.ranks)
    if plan["mode"] == "cluster":
        ranks.update(gathered(result.log_dir))
    return ranks


def failure_rows(result) -> list[dict]:
    """``{"rank", "reason", "log_tail"}`` of every rank that failed, most important first."""
    return [
        {"rank": f["rank"], "reason": f"{f.get('kind', 'error')}: {f['reason']}", "log_tail": f.get("log_tail", "")}
        for f in result.failures
    ]


def gathered(run_dir: str) -> dict:
    """Results of other nodes' ranks, gathered to rank 0 over the backend by the worker."""
    from mindscience.distributed.harness.worker import GATHERED_FILE

    path = os.path.join(run_dir, "results", GATHERED_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return {int(k): v for k, v in json.load(fh).items()}
