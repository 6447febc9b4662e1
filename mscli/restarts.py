"""``msdist train``'s launches: the first one, and a restart after each failure (``--max-restarts``).

A launch fails when a rank dies, hangs past ``--timeout`` or exits non-zero; the harness
has then stopped every rank of it (none is left running). Up to ``--max-restarts`` times
this module then finds the newest checkpoint complete on every rank under ``--save`` (the
manifest is written last: a ``step_<k>`` with one is whole; no checkpoint: step 0, or the
``--resume`` one), cleans what a crashed save left, and launches again at the same layout,
resuming from it. The batch of step ``k`` depends only on ``(seed, k)``, so the losses are
the uninterrupted run's. With ``--elastic``, when a node does not come back within
``--rejoin-timeout``, the run goes on with the nodes left, at the layout ``msdist
suggest``'s search ranks first for the smaller world (same model, same global batch),
loading the checkpoint resharded to it.

Every node's ``msdist`` agrees on a restart through
:class:`~mindscience.distributed.harness.rendezvous.Rendezvous` (files of
``<--save>/.rendezvous``): each checks in, node 0 decides, the others follow.

Signals: the first SIGTERM or SIGINT to ``msdist train`` is passed to this machine's
ranks; they agree on it after their current step (a small collective each step, so any
rank's signal counts), save that step together and stop: exit code 3. A second signal
stops every rank at once (exit 130).

The parent never imports MindSpore.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import replace

from mindscience.distributed.training import faults
from mindscience.distributed.training import report as tr

RENDEZVOUS_DIR = ".rendezvous"


class SignalGuard:
    """While installed: the first SIGTERM/SIGINT is passed on to the ranks (SIGTERM) and
    remembered; a second raises KeyboardInterrupt, which stops the launch at once (the
    harness kills every process of the job on its way out)."""

    def __init__(self):
        self.signal = None
        self.count = 0
        self.pids: set = set()
        self._old = {}

    def watch(self, snapshot: dict) -> None:
        """The harness progress callback: keep the pids of this machine's ranks."""
        for state in (snapshot.get("ranks") or {}).values():
            if state.get("pid"):
                self.pids.add(int(state["pid"]))

    def _handle(self, signum, frame):
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt
        self.signal = signum
        for pid in sorted(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (a test runner's worker): no handler
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


@contextmanager
def attempt_env(attempt: int):
    """``MSDIST_ATTEMPT`` for the ranks of launch ``attempt`` (msrun hands the environment down)."""
    before = os.environ.get(faults.ATTEMPT_ENV)
    os.environ[faults.ATTEMPT_ENV] = str(attempt)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(faults.ATTEMPT_ENV, None)
        else:
            os.environ[faults.ATTEMPT_ENV] = before


def stopped_step(ranks: dict):
    """``(step, saved directory)`` after which the ranks stopped on a signal, or None."""
    for state in ranks.values():
        for record in (state or {}).get("records", []):
            if record.get("check") == "train.step" and record.get("stopped"):
                return record["train_step"], record.get("saved")
    return None


def rows_done(ranks: dict) -> list:
    """``[(step, loss, seconds)]`` every rank of ``ranks`` finished (a failed launch included)."""
    try:
        return tr.finished_steps(tr.collect(ranks)["steps"], list(ranks))
    except ValueError:
        return []


def gone_nodes(result, fault_list: list, attempt: int, ranks_per_node: int) -> set:
    """Loopback nodes that do not come back: those of a rank a ``node`` fault killed."""
    crashed = {f["rank"] for f in result.failures if f.get("kind") in ("crash", "missing", "stopped")}
    return {f.rank // ranks_per_node for f in fault_list
            if f.kind == "node" and f.attempt in (None, attempt) and f.rank in crashed}


def elastic_layout(workload, layout, opts, world: int, devices_per_node: int, check_model):
    """The layout for ``world`` devices: the first of ``msdist suggest``'s ranking (same model,
    micro-batch, global batch and ZeRO stage) that the model splits into.

    Returns:
        ``(Layout, why)``, or ``(None, why)`` when none fits.
    """
    from mindscience.distributed.costmodel import suggest as search
    from mindscience.distributed.topology.layout import Layout
    from mindscience.distributed.training.options import microbatches

    training = replace(workload.training, micro_batch_size=opts.micro_batch_size,
                       global_batch_size=opts.global_batch_size, zero_stage=opts.zero_stage)
    found = search(replace(workload, training=training), world, min(devices_per_node, world), None,
                   micro_batch_sizes=[opts.micro_batch_size], zero_stages=[opts.zero_stage])
    tried = 0
    for cand in found["candidates"]:
        tried += 1
        new = Layout(world_size=world, tp=cand["tp"], cp=cand["cp"], pp=cand["pp"], dp=cand["dp"],
                     order=cand["order"], devices_per_node=min(devices_per_node, world),
                     name=f"elastic-tp{cand['tp']}-cp{cand['cp']}-dp{cand['dp']}-pp{cand['pp']}",
                     backend=layout.backend)
        try:
            check_model(workload, new)
            microbatches(opts, new.dp)
        except ValueError:
            continue
        why = (f"msdist suggest's fastest layout of {world} devices for {workload.model.name} at global batch "
               f"{opts.global_batch_size} (estimated step {cand['step_time_s']:.3g} s; {tried} candidate(s) "
               "looked at)")
        return new, why
    return None, f"no layout of {world} devices fits {workload.model.name} at global batch {opts.global_batch_size}"


def layout_text(layout) -> str:
    return f"tp={layout.tp} cp={layout.cp} dp={layout.dp} pp={layout.pp} ({layout.world_size} ranks)"


def run(*, layout, workload, opts, resume_info, plan, launch, build_spec, check_model, max_restarts: int,
        elastic: bool, rejoin_timeout: float, node_rank, nodes, run_dir: str, on_restart=None,
        on_progress=None) -> dict:
    """Launch the run, and relaunch it after failures (see the module doc).

    Args:
        layout, workload, opts, resume_info, plan: The run as ``msdist train`` checked it.
        launch: ``launch(spec, layout, plan, log_dir, on_progress) -> LaunchResult``.
        build_spec: ``build_spec(layout, workload, opts, resume_path) -> spec``.
        check_model: ``check_model(workload, layout)`` (raises when the model does not split).
        max_restarts: Relaunches allowed.
        elastic: Go on with the nodes left when one does not rejoin.
        rejoin_timeout: Seconds node 0 waits for every node at a restart.
        node_rank, nodes: This node and the node count of a cluster run (None otherwise).
        run_dir: The run's log folder; launch ``a`` >= 1 logs to ``<run_dir>/restart_<a>``.
        on_restart: Called with each restart's record as it is decided.
        on_progress: The harness progress callback (also given the launch's layout).

    Returns:
        ``{"result", "layout", "plan", "opts", "earlier": [(step, loss, s)], "restarts",
        "stopped": {"step", "saved", "signal"} or None, "interrupted": bool,
        "failure": str or None}``.
    """
    first_step = (resume_info or {}).get("step") or 0
    target = first_step + opts.steps
    resume_dir = (resume_info or {}).get("directory")
    fault_list = faults.parse_faults(os.environ.get(faults.FAULT_ENV))
    cluster = plan["mode"] == "cluster"
    node_count = nodes if cluster else (plan.get("nodes") or 1)
    my_node = node_rank or 0
    current_nodes = list(range(node_count))
    rendezvous = None
    if max_restarts and (cluster or plan["mode"] == "loopback"):
        from mindscience.distributed.harness.rendezvous import Rendezvous

        # The --save folder: every node sees it. Without one (a restart from step 0) the
        # log folder, which only loopback nodes share.
        root = os.path.join(opts.save or run_dir, RENDEZVOUS_DIR)
        rendezvous = Rendezvous(root, node_count, rejoin_timeout)
        if my_node == 0:
            shutil.rmtree(root, ignore_errors=True)  # an earlier run's check-ins are not this one's
    try:
        return _run(layout=layout, workload=workload, opts=opts, plan=plan, launch=launch, build_spec=build_spec,
                    check_model=check_model, max_restarts=max_restarts, elastic=elastic,
                    rejoin_timeout=rejoin_timeout, node_rank=node_rank, run_dir=run_dir, on_restart=on_restart,
                    on_progress=on_progress, first_step=first_step, target=target, resume_dir=resume_dir,
                    fault_list=fault_list, cluster=cluster, my_node=my_node, current_nodes=current_nodes,
                    rendezvous=rendezvous)
    finally:
        # On a cluster the others may still be reading node 0's last decision: the next
        # run's node 0 removes the folder instead.
        if rendezvous is not None and not cluster:
            shutil.rmtree(rendezvous.root, ignore_errors=True)


def _run(*, layout, workload, opts, plan, launch, build_spec, check_model, max_restarts, elastic, rejoin_timeout,
         node_rank, run_dir, on_restart, on_progress, first_step, target, resume_dir, fault_list, cluster,
         my_node, current_nodes, rendezvous) -> dict:
    run_started = time.time()
    earlier, restarts = [], []
    guard = SignalGuard()
    attempt = 0
    cur_opts = replace(opts, resume=resume_dir)
    out = {"stopped": None, "interrupted": False, "failure": None}
    with guard:
        while True:
            spec = build_spec(layout, workload, cur_opts, cur_opts.resume)
            log_dir = run_dir if attempt == 0 else os.path.join(run_dir, f"restart_{attempt}")
            launched_at = time.time()
            guard.pids = set()  # this launch's ranks only: an earlier one's pids may be reused

            def progress(snapshot, _layout=layout):
                guard.watch(snapshot)
                if on_progress is not None:
                    on_progress(snapshot, _layout)

            try:
                with attempt_env(attempt):
                    result = launch(spec, layout, plan, log_dir, progress)
            except KeyboardInterrupt:
                out.update(result=None, layout=layout, plan=plan, opts=cur_opts, earlier=earlier, restarts=restarts,
                           interrupted=True)
                return out
            out.update(result=result, layout=layout, plan=plan, opts=cur_opts, earlier=earlier, restarts=restarts)
            if result.ok:
                stop = stopped_step(result.ranks)
                if stop is not None:
                    out["stopped"] = {"step": stop[0], "saved": stop[1], "signal": guard.signal}
                if node_rank in (None, 0):
                    faults.clean_leftovers(opts.save)
                return out
            failure = result.failures[0] if result.failures else {"rank": -1, "kind": "infra",
                                                                 "reason": "the launch failed"}
            rows = rows_done(result.ranks)
            reached = rows[-1][0] if rows else cur_first(cur_opts, first_step, restarts)
            if guard.signal is not None:
                out["failure"] = f"stopped on signal {guard.signal} before the ranks could save"
                out["interrupted"] = True
                return out
            if attempt >= max_restarts:
                out["failure"] = failure["reason"]
                earlier.extend(rows)
                return out
            # ---- agree on the next launch
            gone = gone_nodes(result, fault_list, attempt, plan["local"]) if plan["mode"] == "loopback" else set()
            present, waited = current_nodes, 0.0
            if rendezvous is not None:
                if cluster and my_node != 0:
                    from mindscience.distributed.harness.rendezvous import RendezvousError

                    rendezvous.check_in(attempt + 1, my_node, {"reason": failure["reason"]})
                    try:
                        decision = rendezvous.await_decision(attempt + 1)
                    except RendezvousError as err:
                        out["failure"] = f"{failure['reason']}; {err}"
                        earlier.extend(rows)
                        return out
                else:
                    for node in current_nodes:
                        if node == my_node or (not cluster and node not in gone):
                            rendezvous.check_in(attempt + 1, node, {"reason": failure["reason"]})
                    present, waited = rendezvous.gather(attempt + 1, current_nodes)
                    decision = None
            else:
                decision = None
            if decision is None:
                decision = decide(present=present, current_nodes=current_nodes, layout=layout, workload=workload,
                                  opts=opts, plan=plan, elastic=elastic, rejoin_timeout=rejoin_timeout,
                                  target=target, first_step=first_step, resume_dir=resume_dir,
                                  check_model=check_model)
                if rendezvous is not None:
                    rendezvous.decide(attempt + 1, decision)
            if decision["action"] != "launch" or (cluster and my_node not in decision["nodes"]):
                out["failure"] = f"{failure['reason']}; {decision.get('why', 'this node is not in the restart')}"
                earlier.extend(rows)
                return out
            resumed_step, resumed_dir = decision["first_step"], decision["resume"]
            kept = faults.kept_steps(rows, resumed_step)
            earlier = [row for row in earlier if row[0] <= resumed_step] + kept
            if cluster or node_rank in (None, 0):
                faults.clean_leftovers(opts.save)
            new_layout = layout
            if decision.get("layout"):
                from mindscience.distributed.topology.layout import Layout

                new_layout = Layout(**decision["layout"])
            relaunch_at = time.time()
            record = {"attempt": attempt + 1, "at_s": round((result.failed_at or result.ended_at or relaunch_at)
                                                            - run_started, 3),
                      "rank": failure["rank"], "kind": failure.get("kind"), "reason": failure["reason"],
                      "reached_step": reached, "resumed_from": resumed_step, "checkpoint": resumed_dir,
                      "steps_lost": max(0, reached - resumed_step),
                      "seconds_lost": round(relaunch_at - launched_at - sum(r[2] for r in kept), 3),
                      "failed_at": result.failed_at, "stopped_at": result.ended_at, "relaunch_at": relaunch_at,
                      "rejoin_wait_s": round(waited, 3), "nodes": decision["nodes"],
                      "layout": None if new_layout is layout else new_layout.to_dict(),
                      "why": decision.get("why")}
            restarts.append(record)
            if on_restart is not None:
                on_restart(record)
            if new_layout is not layout:
                layout = new_layout
                plan = dict(plan, local=layout.world_size // len(decision["nodes"]), nodes=len(decision["nodes"]))
                if not cluster:
                    plan["mode"] = "loopback" if len(decision["nodes"]) > 1 else "local"
            current_nodes = decision["nodes"]
            if cluster:
                plan = dict(plan, node_rank=decision["nodes"].index(my_node))
            cur_opts = replace(opts, steps=target - resumed_step, resume=resumed_dir)
            attempt += 1


def cur_first(opts, first_step: int, restarts: list) -> int:
    """The step the current launch started from."""
    return restarts[-1]["resumed_from"] if restarts else first_step


def decide(*, present, current_nodes, layout, workload, opts, plan, elastic, rejoin_timeout, target, first_step,
           resume_dir, check_model) -> dict:
    """Node 0's decision of the next launch (see :mod:`~mindscience.distributed.harness.rendezvous`)."""
    missing = [n for n in current_nodes if n not in present]
    newest = faults.newest_complete(opts.save, at_most=target - 1)
    if newest is not None and newest[0] >= first_step:
        step, directory = newest
    else:
        step, directory = first_step, resume_dir
    decision = {"action": "launch", "nodes": list(present), "first_step": step, "resume": directory,
                "layout": None, "why": None}
    if not missing:
        return decision
    names = ", ".join(map(str, missing))
    if not elastic:
        return {**decision, "action": "stop",
                "why": f"node(s) {names} did not rejoin within the {rejoin_timeout:g} s --rejoin-timeout; pass "
                       "--elastic to go on with the nodes left"}
    if 0 not in present:
        return {**decision, "action": "stop", "why": "node 0 (the scheduler's) is gone: the run cannot go on"}
    world = plan["local"] * len(present)
    new, why = elastic_layout(workload, layout, opts, world, plan["local"], check_model)
    if new is None:
        return {**decision, "action": "stop", "why": why}
    return {**decision, "layout": new.to_dict(),
            "why": f"node(s) {names} did not rejoin within {rejoin_timeout:g} s: {layout_text(layout)} -> "
                   f"{layout_text(new)}, {why}"}
